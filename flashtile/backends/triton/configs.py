"""Tile sizes, warps and pipeline stages per GPU generation and head dim.

Each table row names the measurement that chose it. Keys are the padded head dim
(the next power of two >= headdim, at least 16).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """One kernel's launch: query tile, key tile, warps, software-pipeline depth."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BwdConfig:
    dkdv: TileConfig  # BLOCK_M walks queries, BLOCK_N is the key block a program owns
    dq: TileConfig  # BLOCK_M is the query block a program owns, BLOCK_N walks keys


def _bwd(m1, n1, w1, s1, m2, n2, w2, s2) -> BwdConfig:
    return BwdConfig(TileConfig(m1, n1, w1, s1), TileConfig(m2, n2, w2, s2))


# Hopper (sm_90), 16-bit inputs: (non-causal, causal) forward tiles and one backward pair per head dim.
# Chosen by benchmarks/tune.py on one H200, bf16, batch 4 x seqlen 4096, nheads x headdim = 2048
# (2026-11-21, torch 2.11 / triton 3.6; full sweep in benchmarks/results/h200-tune-2026-11-21.json):
#   fwd d=128: 256x64 w8 s3 506 TFLOP/s non-causal (128x128 w8 s3: 483, 128x64 w8 s3: 465);
#              64x64 w4 s3 425 causal (128x64 w8 s3: 415, 256x64 w8 s3: 353).
#   fwd d=64:  128x64 w8 s4 437 non-causal (128x64 w8 s3: 431); 128x64 w8 s3 387 causal.
#   dK/dV d=128: 32x64 w4 s3 best of 9 (358 / 311 TFLOP/s whole backward, non-causal / causal);
#   dK/dV d=64:  64x64 w4 s3 best of 9 (293 / 254).
#   dQ d=128: 128x64 w8 s3 best of 8 (364 / 326); dQ d=64: 64x32 w4 s3 best of 8 (287 / 269).
# d=16/32 reuse the d=64 rows and d=256 the smallest tiles that fit shared memory (not swept).
_FWD_SM90 = {
    16: (TileConfig(128, 64, 8, 4), TileConfig(128, 64, 8, 3)),
    32: (TileConfig(128, 64, 8, 4), TileConfig(128, 64, 8, 3)),
    64: (TileConfig(128, 64, 8, 4), TileConfig(128, 64, 8, 3)),
    128: (TileConfig(256, 64, 8, 3), TileConfig(64, 64, 4, 3)),
    256: (TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 2)),
}
_BWD_SM90 = {
    16: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    32: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    64: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    128: _bwd(32, 64, 4, 3, 128, 64, 8, 3),
    256: _bwd(32, 64, 8, 1, 64, 32, 8, 1),
}
# Hopper, non-causal forward with per-element score work (softcap, ALiBi): the 256-row tile
# above runs out of registers. Measured on the H200 (bf16, 4 x 4096 x 16 heads, d=128, fwd ms;
# plain 256x64 = 1.19): ALiBi 256x64 1.96, 128x64 1.34, 128x128 1.27, 64x64 1.36;
# softcap 256x64 1.34, 128x64 1.36, 128x128 1.26, 64x64 1.33.
_FWD_SM90_SCORE_MODS = {128: TileConfig(128, 128, 8, 3)}
# Ampere (sm_80/86/89), 16-bit inputs: smaller shared memory than Hopper, so shallower pipelines.
# Not measured yet on an Ampere GPU: conservative tiles that fit its 164 KB of shared memory.
_FWD_SM80 = {
    16: (TileConfig(128, 64, 4, 3),) * 2,
    32: (TileConfig(128, 64, 4, 3),) * 2,
    64: (TileConfig(128, 64, 4, 3),) * 2,
    128: (TileConfig(128, 64, 8, 2),) * 2,
    256: (TileConfig(64, 32, 4, 2),) * 2,
}
_BWD_SM80 = {
    16: _bwd(64, 64, 4, 2, 64, 64, 4, 2),
    32: _bwd(64, 64, 4, 2, 64, 64, 4, 2),
    64: _bwd(64, 64, 4, 2, 64, 64, 4, 2),
    128: _bwd(32, 64, 4, 2, 64, 32, 4, 2),
    256: _bwd(32, 32, 4, 1, 32, 32, 4, 1),
}
# fp32 tiles take twice the shared memory and registers: halve them.
_FWD_FP32 = TileConfig(64, 32, 4, 2)
_BWD_FP32 = _bwd(32, 32, 4, 1, 32, 32, 4, 1)
_BWD_FP32_D256 = _bwd(16, 32, 4, 1, 32, 16, 4, 1)
# Under TRITON_INTERPRET=1 small tiles keep the awkward test shapes spanning several blocks.
_FWD_INTERPRET = TileConfig(32, 32, 4, 1)
_BWD_INTERPRET = _bwd(16, 32, 4, 1, 32, 16, 4, 1)


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple:
    """The GPU's compute capability, asked of the driver once per device."""
    return torch.cuda.get_device_capability(device)


def padded_head_dim(headdim: int) -> int:
    return max(16, 1 << (headdim - 1).bit_length())


def _arch(device: torch.device) -> int:
    major, _ = capability(device)
    return 90 if major >= 9 else 80


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device, causal: bool,
               score_mods: bool = False) -> TileConfig:
    """``score_mods``: the call computes softcap or ALiBi on every score."""
    if device.type != "cuda":
        return _FWD_INTERPRET
    if dtype == torch.float32:
        return _FWD_FP32
    padded = padded_head_dim(head_dim)
    if _arch(device) == 90:
        if score_mods and not causal and padded in _FWD_SM90_SCORE_MODS:
            return _FWD_SM90_SCORE_MODS[padded]
        return _FWD_SM90[padded][int(causal)]
    return _FWD_SM80[padded][int(causal)]


def bwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> BwdConfig:
    if device.type != "cuda":
        return _BWD_INTERPRET
    if dtype == torch.float32:
        return _BWD_FP32_D256 if padded_head_dim(head_dim) == 256 else _BWD_FP32
    table = _BWD_SM90 if _arch(device) == 90 else _BWD_SM80
    return table[padded_head_dim(head_dim)]
