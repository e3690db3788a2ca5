"""Tile sizes, warps and pipeline stages per GPU generation and head dim, and the rules that pick a kernel.

The comments are tables: each row gives the value, the result file under benchmarks/results/ (or the scratch
run) and the numbers that chose it; the GPU is an H200 (sm_90) unless a row says otherwise. How a value was
found, and what was tried and not kept, is in the commit history. Keys are the padded head dim (the next power
of two >= headdim, at least 16).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TileConfig:
    """One kernel's launch: query tile, key tile, warps, software-pipeline depth, and which forward
    kernel: ``"triton"`` (kernels/fwd.py), ``"gluon"`` (the Hopper kernel in kernels/fwd_sm90.py),
    ``"gluon-slim"`` (that kernel with Q in shared memory and one key slot: see gluon_ring) or
    ``"gluon-ws"`` (the warp-specialized one in kernels/fwd_sm90_ws.py). ``heads``: KV heads a program of the
    KV-cache kernel (kernels/decode.py ``HEADS``; 1 for every other kernel). ``consumers``: the warp-specialized
    forward's consumer warpgroups of BLOCK_M rows each, 2 or 3 (its ``CONSUMERS``: a CTA's tile is consumers x
    BLOCK_M rows; 2 for every other kernel, which ignores it); ``pingpong``: its 16-bit consumers take turns issuing
    their matmuls (its ``PINGPONG``; False for every other kernel)."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    kernel: str = "triton"
    heads: int = 1
    consumers: int = 2
    pingpong: bool = False


@dataclass(frozen=True)
class BwdConfig:
    dkdv: TileConfig  # BLOCK_M walks queries, BLOCK_N is the key block a program owns
    dq: TileConfig  # BLOCK_M is the query block a program owns, BLOCK_N walks keys


def _bwd(m1, n1, w1, s1, m2, n2, w2, s2) -> BwdConfig:
    return BwdConfig(TileConfig(m1, n1, w1, s1), TileConfig(m2, n2, w2, s2))


# Hopper (sm_90), 16-bit inputs. _FWD_SM90: forward tiles per padded head dim, one per kind of row: (full, full of
# LONG_KEYS+ keys, masked, masked of LONG_KEYS+ keys); masked = causal or a sliding window. H200, bf16, fwd TFLOP/s,
# chosen vs runner-up at 512 / 1k / 2k / 4k / 8k / 16k keys (benchmarks/tune.py, results/h200-tune-2026-11-21.json;
# re-run on the current kernels as a 7-tile A/B, 2026-11-22):
#   d       rows              tile           evidence
#   16-64   all               128x64 w8 s4   d=64 full 437 vs s3 431; causal 387/397/416/428 vs s3 373/395/416/420
#   128     full              128x128 w8 s3  328/423/472/498/499/501 vs 256x64 w8 s3 319/392/430/457/456/473
#   128     masked, < 8192    64x64 w4 s3    2k 384 vs 128x128 348, 4k 425 vs 409 (a diagonal block wastes less)
#   128     masked, >= 8192   128x128 w8 s3  8k 457 vs 64x64 421, 16k 496 vs 458, 32k 519 vs 467
#   256     all               128x64 w8 s2   see the head dim 256 table below
# d=16/32 reuse d=64's tiles (not swept).
LONG_KEYS = 8192
_FWD_SM90 = {
    16: (TileConfig(128, 64, 8, 4),) * 4,
    32: (TileConfig(128, 64, 8, 4),) * 4,
    64: (TileConfig(128, 64, 8, 4),) * 4,
    128: (TileConfig(128, 128, 8, 3),) * 2 + (TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)),
    256: (TileConfig(128, 64, 8, 2),) * 4,
}
# Hopper head dim 256, and 160/192 padded to it with 128-wide values (_V128). H200, bf16, 8 heads (10 for
# 192/128), TFLOP/s, the smallest tiles that fit (64x64 w4 s2; 32x64 w8 s1 / 64x32 w8 s1) -> chosen
# (benchmarks/d256_fwd_tiles.py, d256_bwd_tiles.py --pairs; results/h200-{fwd,bwd}-d256-sweep*-2026-11-22.json):
#   table           d        tile                              evidence
#   _FWD_SM90       256      128x64 w8 s2                      4x4096 full 315 -> 476, causal 263 -> 385; 1x16384
#                                                              full 281 -> 499, causal 310 -> 491 (128x32 w8 s3 439-450)
#   _FWD_SM90_V128  192/128  128x64 w8 s3                      full 262 -> 454, causal 215 -> 374 (room for a 3rd stage)
#   _BWD_SM90       256      dK/dV 64x32 w4 s2, dQ 128x64 w8 s1  4x4096 full 96 -> 225, causal 95 -> 211
#   _BWD_SM90_V128  192/128  dK/dV 64x32 w4 s2, dQ 128x64 w8 s2  full 97 -> 216, causal 87 -> 193 (dQ s1: 200 / 178)
#   _FWD_SM90_BIAS  256      64x64 w4 s2                       the bias tile passes through shared memory too
_FWD_SM90_V128 = {256: (TileConfig(128, 64, 8, 3),) * 4}
# _FWD_SM90_SOFTCAP, d=128 with softcap: tanh and exp2 share the SFUs, and two resident 64x64 programs overlap them
# with each other's matmuls. H200, bf16, 16 heads, fwd ms, 128x128 w8 s3 / 64x64 w4 s3 (scratch sweep, 2026-11-22):
#   rows                   tile            evidence
#   full, < LONG_KEYS      64x64 w4 s3     4x4096 1.352 / 1.250
#   full, >= LONG_KEYS     128x128 w8 s3   2x8192 2.626 / 2.782
#   causal                 64x64 w4 s3     4x4096 0.782 / 0.712; 2x8192 1.428 / 1.313
# 128x64 w8 s3/s2, 128x128 w8 s2, 256x64 w8 s3 and 64x128 w4 s3 were slower everywhere; ALiBi keeps the plain tiles.
_FWD_SM90_SOFTCAP = {128: (TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3),
                           TileConfig(64, 64, 4, 3))}
# _FWD_SM90_BIAS, d=128 with attn_bias: the bias tile is pipelined through shared memory, which 128x128 w8 s3
# overflows. Same sweep, full rows, fwd ms at 8x2048 / 4x4096:
#   128x64 w8 s3 0.744 / 1.528 (chosen); 128x128 w8 s2 0.916 / 1.762; 64x64 w4 s3 0.920 / 1.842
_FWD_SM90_BIAS = {128: (TileConfig(128, 64, 8, 3),) * 4, 256: (TileConfig(64, 64, 4, 2),) * 4}
_BWD_SM90 = {
    16: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    32: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    64: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    128: _bwd(32, 64, 4, 3, 128, 64, 8, 3),
    256: _bwd(64, 32, 4, 2, 128, 64, 8, 1),
}
_BWD_SM90_V128 = {256: _bwd(64, 32, 4, 2, 128, 64, 8, 2)}
# _BWD_SM90_LONG, d=128, rows of LONG_BWD_KEYS+ keys: a dK/dV program owns 128 keys and walks 64 queries a step, so
# each Q and dO tile serves twice the keys. H200, bf16, whole backward TFLOP/s, 32x64 w4 s3 -> 64x128 w8 s3 [Flex],
# two rounds (benchmarks/bwd_dkdv_tiles.py, results/h200-bwd-dkdv-tiles-2026-11-22.json):
#   shape, heads        full                        causal
#   1x16384, 16/16      394-396 -> 408-414 [416]    392-405 -> 405-411 [388]
#   1x16384, 32/8       386-393 -> 419-421 [416]    382-387 -> 405-406 [389]
#   2x8192, 32/8                                    345-363 -> 362-372 [366]
#   4x4096, 16/16       tie, 392-399 [399]
# Shorter rows keep 32x64 (16x512 causal 176 -> 163, 4x1024 206 -> 195, window (1024, 0) 1x16384 301 -> 284-287);
# so do ALiBi (1.26-1.28x plain's time on 64x128, results/h200-variants-window-mods-2026-11-22-wide.json), a bias
# and dropout (not measured): _BWD_SHORT_TILE_FEATURES.
LONG_BWD_KEYS = 4096
_BWD_SM90_LONG = {128: _bwd(64, 128, 8, 3, 128, 64, 8, 3)}
_BWD_SHORT_TILE_FEATURES = frozenset({"alibi", "bias", "dropout"})
# _BWD_DKDV_SM90_GLUON, d=128, 16-bit: the Gluon dK/dV kernel (kernels/bwd_sm90.py: 64 keys a program, Q and dO
# double-buffered, 98 KB and 248 registers, two programs an SM), when its key blocks fill the GPU unsplit. dK/dV
# kernel us, Triton tiles -> Gluon (H200, bf16, profiler; benchmarks/bwd_dkdv_gluon.py,
# results/h200-bwd-dkdv-gluon-2026-11-23.json):
#   call                                evidence
#   4x4096 16/16 full / causal          1974 -> 1673 / 1162 -> 902;  32/8 causal 2417 -> 1821
#   2x8192 / 1x16384 causal             2267 -> 1690 / 4196 -> 3419
#   window (1024, 0) 1x16384            616 -> 500;  softcap 50 full 4x4096 2226 -> 1971
#   packed sequences                    backward 1.13-1.14x -> 1.02-1.04x the padded batch's
#                                       (results/h200-variants-varlen-2026-11-23-gluon-dkdv.json)
# ALiBi spills there (causal 2x8192 2248 -> 3049) and keeps the Triton kernel; so do dropout, a bias, other head
# dims and split key blocks. The whole backward gains 0-3%: it runs at the H200's 700 W cap either way
# (benchmarks/bwd_power.py, results/h200-bwd-power-2026-11-23.json).
_BWD_DKDV_SM90_GLUON = TileConfig(64, 64, 4, 2, kernel="gluon")
GLUON_DKDV_FEATURES = frozenset({"window", "softcap", "sink", "varlen"})


def gluon_dkdv_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device,
                      features: frozenset) -> TileConfig | None:
    """The Gluon dK/dV kernel's tile where it serves the call, else None."""
    if (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or _arch(device) != 90
            or head_dim != 128 or head_dim_v != 128 or not features <= GLUON_DKDV_FEATURES):
        return None
    return _BWD_DKDV_SM90_GLUON


def with_gluon_dkdv(cfg: BwdConfig, gluon: TileConfig | None, plan) -> tuple:
    """``(cfg, parts, alongside)``: the Gluon dK/dV tile in ``cfg`` when ``gluon`` is given and its key blocks
    fill the GPU unsplit (``plan(block_n)`` gives the parts and whether dQ runs alongside), else ``cfg``'s
    Triton tile with its own plan."""
    if gluon is not None:
        parts, alongside = plan(gluon.BLOCK_N)
        if parts == 1:
            return replace(cfg, dkdv=gluon), 1, alongside
    return (cfg, *plan(cfg.dkdv.BLOCK_N))


# Ampere (sm_80/86/89), 16-bit inputs: smaller shared memory than Hopper, so shallower pipelines.
# Not measured yet on an Ampere GPU: conservative tiles that fit its 164 KB of shared memory.
_FWD_SM80 = {
    16: (TileConfig(128, 64, 4, 3),) * 4,
    32: (TileConfig(128, 64, 4, 3),) * 4,
    64: (TileConfig(128, 64, 4, 3),) * 4,
    128: (TileConfig(128, 64, 8, 2),) * 4,
    256: (TileConfig(64, 32, 4, 2),) * 4,
}
_BWD_SM80 = {
    16: _bwd(64, 64, 4, 2, 64, 64, 4, 2),
    32: _bwd(64, 64, 4, 2, 64, 64, 4, 2),
    64: _bwd(64, 64, 4, 2, 64, 64, 4, 2),
    128: _bwd(32, 64, 4, 2, 64, 32, 4, 2),
    256: _bwd(32, 32, 4, 1, 32, 32, 4, 1),
}
# fp32 tiles take twice the shared memory and registers: halve them. The dots run on FMAs, whose operand layouts hold
# a tile's rows in every thread: up to head dim 128, 8 warps (same tiles) end the spills. Not timed on a GPU. ptxas
# (sm_90, triton 3.6), 4 -> 8 warps, stack bytes / compile s on one CPU core, fwd, dK/dV, dQ (packed, d=96 and d=64):
#   d=96    fwd 9208 -> 728 B (32 registers at 4 warps), dK/dV 1792 -> 256, dQ 720 -> 0; 8.9 -> 4.1 s
#   d=64    fwd 456 -> 0, dK/dV 264 -> 0, dQ 0 -> 0; 3.8 -> 2.4 s
#   d=256   fwd 2048 -> 3304 (kept at 4 warps), dK/dV 2264 -> 2328, dQ 0 -> 0; 10.4 -> 5.6 s (dense)
_FWD_FP32 = TileConfig(64, 32, 8, 2)
_FWD_FP32_D256 = TileConfig(64, 32, 4, 2)
_BWD_FP32 = _bwd(32, 32, 8, 1, 32, 32, 8, 1)
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


def _narrow_values(head_dim: int, head_dim_v: int) -> bool:
    """Whether the values' head dim pads to at most half of the larger head dim (192/128, padded 256/128)."""
    return 0 < padded_head_dim(head_dim_v) < padded_head_dim(head_dim)


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device, seqlen_k: int, window_left: int,
               window_right: int, softcap: bool = False, bias: bool = False, head_dim_v: int = 0,
               dropout: bool = False) -> TileConfig:
    """Tiles for a call with ``seqlen_k`` keys under the window (``-1`` = unbounded side; causal is
    ``window_right = 0``); ``softcap`` / ``bias`` / ``dropout``: the call has one. ``head_dim`` is the larger
    of the query/key and value head dims, ``head_dim_v`` the values' (0: the same)."""
    if device.type != "cuda":
        return _FWD_INTERPRET
    padded = padded_head_dim(head_dim)
    if dtype == torch.float32:
        return _FWD_FP32_D256 if padded == 256 else _FWD_FP32
    table = _FWD_SM80
    if _arch(device) == 90:
        table = _FWD_SM90
        if bias and padded in _FWD_SM90_BIAS:
            table = _FWD_SM90_BIAS
        elif softcap and padded in _FWD_SM90_SOFTCAP:
            table = _FWD_SM90_SOFTCAP
        elif _narrow_values(head_dim, head_dim_v) and padded in _FWD_SM90_V128:
            table = _FWD_SM90_V128
    # Causal rows of a short sequence, or a narrow window, make short programs whose edge blocks
    # waste more of a bigger tile.
    masked = window_left >= 0 or window_right >= 0
    long_rows = row_keys(seqlen_k, window_left, window_right) >= LONG_KEYS
    cfg = table[padded][2 * masked + long_rows]
    if dropout and _arch(device) == 90 and padded >= 128:
        # With dropout the 128x128 three-stage tile at d=128 asked for 240 KB of shared memory, over the
        # H200's 227 KB, and failed to launch (tests/test_bwd_sm90.py, 2026-11-23). Two stages fit.
        cfg = replace(cfg, num_stages=min(cfg.num_stages, 2))
    return cfg


# Hopper d=128, 16-bit: the Gluon forward (kernels/fwd_sm90.py: async wgmma, the softmax overlapping the PV matmul,
# a TMA key/value ring) where it leads the Triton kernel; gluon_fwd_config picks the tile. H200, bf16, 16 heads, fwd
# TFLOP/s, Triton table tile / Gluon 64x64 / Gluon 64x128 at 4x4096, 2x8192, 1x16384, best of 3 interleaved rounds
# (benchmarks/gluon_tiles.py, results/h200-gluon-tiles-2026-11-22.json):
#   rows                   tile      evidence
#   full                   64x128    510/495/589, 503/512/540, 510/509/555; GQA 32/8 4x4096 490/501/531
#   causal                 64x128    425/461/528, 471/480/506, 499/480/542; GQA 32/8 4x4096 454/455/488
#   sink                   64x128    full 494/510/534 .. 514/507/550; causal 432/463/498 .. 524/488/541
#   softcap causal         64x128    391/409/395, 382/400/414, 397/414/427
#   softcap full < 8192    64x128    4x4096 399/410/433
#   softcap full >= 8192   Triton    440/417/422, 440/416/437; 64x128 when fixed_row_max holds: 2x8192 2.26 vs
#                                    2.47 ms, 1x16384 4.52 vs 4.89 (results/h200-softcap-fixed-max-2026-11-22.json)
#   ALiBi                  64x128    linear bias off the diagonal (fwd_sm90._alibi_linear_step), full/causal
#                                    510/464, 526/475, 534/503 vs 64x64 476/469, 465/444, 472/466
#                                    (results/h200-alibi-linear-2026-11-22.json)
#   softcap with ALiBi     64x64     the linear ALiBi takes the raw scores, not the capped ones
# Windows and short rows: the slim, GLUON_SHORT_CAUSAL_KEYS and GLUON_WIDE_WINDOW_KEYS tables below.
_FWD_SM90_GLUON = TileConfig(64, 64, 4, 2, kernel="gluon")
_FWD_SM90_GLUON_WIDE = TileConfig(64, 128, 4, 2, kernel="gluon")
# _FWD_SM90_GLUON_SLIM (gluon_ring): 64x64 with Q in shared memory and one key slot, 161 registers and 66 KB, three
# programs an SM (the plain 64x64 plan: 195 and 82 KB, two); short programs spend much of their time filling and
# draining their pipeline, and a third program keeps the tensor cores busy meanwhile. It takes causal rows under
# GLUON_SLIM_CAUSAL_KEYS keys and windows under GLUON_WIDE_WINDOW_KEYS (softcap windows of any width), plain or with
# GLUON_SLIM_FEATURES. H200, bf16, 16 heads, fwd TFLOP/s, [table tile /] 64x64 / slim (benchmarks/gluon_slim.py
# --rounds 5, results/h200-gluon-slim-2026-11-23.json; features: results/h200-gluon-slim-features-2026-11-23.json):
#   rows                                  evidence
#   causal 32x512 / 16x1024 / 8x2048      227/258, 300/349, 366/409
#   causal 4096+ keys: keeps 64x128       64x128 453 vs slim 453 at 4096, 488 vs 469 at 8192
#   window (1024, 0) 1x16384 / 2x8192     352/397, 349/397; 32/8 heads 4x4096 368/398
#   window 4096+ keys: keeps 64x128       64x128 478 vs slim 475
#   causal softcap 16x1024 / 8x2048       300/313/349, 372/390/425; windows (1024, 0) 361/380/427
#   causal sink 16x1024 / 8x2048          322/312/349, 382/377/409; windows (1024, 0) 365/378/418
#   packed causal, ms, 64x128 -> slim     16x2048 0.662 -> 0.642, 64x512 0.275 -> 0.256
#                                         (results/h200-varlen-slim-2026-11-23.json)
# ALiBi takes 182 registers (two programs an SM): it keeps the 64x64 tile.
_FWD_SM90_GLUON_SLIM = TileConfig(64, 64, 4, 2, kernel="gluon-slim")
GLUON_SLIM_CAUSAL_KEYS = 4096
GLUON_SLIM_FEATURES = frozenset({"window", "softcap", "sink", "varlen"})
# _FWD_SM90_GLUON_WS, d=128, 16-bit: the warp-specialized forward (kernels/fwd_sm90_ws.py: CTAs of 128 query rows, two
# consumer warpgroups of 64 and a TMA producer warp, a ring of two 128-key slots; BLOCK_M is one consumer's rows) for
# full rows of GLUON_WS_FULL_KEYS+ keys (persistent) and causal rows of GLUON_WS_CAUSAL_KEYS+ (a CTA per tile:
# ws_ctas); plain or with GLUON_WS_FEATURES (not softcap with ALiBi), no window, packed sequences or cache. H200,
# bf16, 16 heads, fwd TFLOP/s, 64x128 / WS persistent / WS a CTA per tile / cuDNN, median of 3 interleaved rounds
# (benchmarks/gluon_ws.py [mods], results/h200-gluon-ws-2026-11-23.json, results/h200-gluon-ws-mods-2026-11-23.json):
#   rows                                 evidence
#   full 4x4096 / 2x8192 / 1x16384       521/527/549/592, 544/577/569/605, 539/594/580/608
#   full 2048 keys: keeps 64x128         506/517/491/594 (1-2%, within the spread; packed sequences, which keep
#                                        64x128, would trail the dense batch by 12% at 16x2048)
#   causal 4x4096: keeps 64x128          472/457/472/510
#   causal 2x8192 / 1x16384              491/507/531/533, 542/423/575/552
#   softcap 50 full 4x4096 / 2x8192      489/561/546, 507/575/564
#   ALiBi full 4x4096 / 2x8192           508/509/501, 523/522/519 (a tie: its linear bias spills a little)
_FWD_SM90_GLUON_WS = TileConfig(64, 128, 4, 2, kernel="gluon-ws")
GLUON_WS_FULL_KEYS = 4096
GLUON_WS_CAUSAL_KEYS = 8192
GLUON_WS_FEATURES = frozenset({"sink", "softcap", "alibi"})
# _FWD_SM90_GLUON_WS_D64, d=64, 16-bit: the warp-specialized forward's two-consumer tile for the rows and features it
# takes at d=128 (the same floors), else the Triton kernel (GLUON_WS_D64 None: off). H200, bf16, B = 16384 // N,
# 32 heads, fwd TFLOP/s, Triton table tile / 64x128 s2 / 64x128 s4, median of 2 interleaved rounds
# (benchmarks/gluon_ws_heads.py at 0259788, results/h200-gluon-ws-heads-2026-11-28-0259788.json; a first run of the
# e02143e tree beside it):
#   rows                               evidence
#   full 4x4096 / 1x16384              389/431/393, 436/446/443 (+2-11%; first run 427/441, 442/458)
#   causal 1x16384                     429/442/437 (+3%; first run 423/445)
#   causal 4x4096 / 16x1024: floors    344/162/160, 269/204/199 (first run 384/356, 273/203): the Triton tile stays
# sm_90 ptxas (benchmarks/sm90_compile.py fwd-ws-d64[-n256][-s4][-sink] [causal] [softcap]), 240 registers a
# consumer: 64x128 s2 0 STL in every case, 98.7 KB, 24 HGMMAs a consumer; s4 0 STL, 164.3 KB; 64x256 s2 225-271 STL
# (S_j's 128 registers, P_{j-1}'s 64 in flight and O's 32 exceed 240). FA3's 192 keys are no power of two for Gluon.
_FWD_SM90_GLUON_WS_D64 = TileConfig(64, 128, 4, 2, kernel="gluon-ws")
# _FWD_SM90_GLUON_WS_D64_C3, d=64: the same kernel with THREE consumer warpgroups (CTAs of 192 rows, FlashAttention-3's
# kBlockM at d=64) sharing each 128-key K/V slot: a third less K/V TMA traffic and ring bookkeeping a row, and three
# softmaxes for the schedulers to interleave. Registers: 3 x 4 warps at 160 (consumer 0 168) and the producer at 24
# under maxnreg 128 (launch._WS_REGS). ON (GLUON_WS_D64); ALiBi keeps two consumers (its linear bias spills in 160
# registers). H200, bf16, 32 heads, fwd TFLOP/s, 2 consumers / 3 consumers / 3 with 64-key slots / 3 taking turns,
# median of 2 interleaved rounds (benchmarks/gluon_ws_heads.py --dims 64 at 18f7d93,
# results/h200-gluon-ws-heads-c3-2026-11-28-18f7d93.json):
#   full 4x4096 / 1x16384        449/482/398/472, 459/511/426/491 (+7%, +11%)
#   causal 1x16384               445/465/416/455 (+5%)
#   causal 4x4096 (under the causal floor: not taken)  365/368/341/360; the Triton tile 383
# sm_90 ptxas (benchmarks/sm90_compile.py fwd-ws-d64[-c3][-sink|-alibi] [causal]
# [softcap]), spill stores in all / in a consumer's key loop, shared memory, SASS a warp on the unmasked 128-key block:
#   tile          full             causal           softcap          causal softcap   sink     ALiBi
#   2 consumers   0/0 98.7 KB 407  0/0 408          -                -                -        -
#   3 consumers   1/0 115.1 KB 405 6/0 411-442      0/0 358-389      11/3 368-395     2/0      135/11 858-894
# (two Q buffers of 3 x 64 rows and two slots; 3 consumers carry P_{j-1} as the bf16 operand, kernels/fwd_sm90_ws.py's
# P_AT_SOFTMAX; 24 HGMMAs a consumer a block either way). 64-key slots (ws-c3-n64): 0 spills in every case, ALiBi and
# windows too, 82.3 KB, 254 SASS a 64-key block. Turns at the tensor cores (ws-c3-pp, pingpong=True: 0, 1, 2, 0, ...,
# FA3's scheduler barrier at three warpgroups; two bf16 consumers' turns measured 0.97-1.04x, docs/design.md): 0 loop
# spills, 413-450. At d=128 three consumers spill 54-58 stores a key loop (O's 64 registers beside S's 64 and P's 32
# fill 160; 229.8 KB): FlashAttention-3 keeps 128 rows there too.
_FWD_SM90_GLUON_WS_D64_C3 = TileConfig(64, 128, 4, 2, kernel="gluon-ws", consumers=3)
GLUON_WS_D64 = _FWD_SM90_GLUON_WS_D64_C3


def ws_ctas(causal: bool, tiles: int, sms: int) -> int:
    """The warp-specialized forward's grid. Full rows cost alike: one CTA an SM walks them round robin.
    Causal rows differ in length, and round robin leaves SMs idle at the end (1 x 16384: 423 TFLOP/s against
    575): a CTA per tile, launched longest first, lets the hardware hand the next tile to the first SM free."""
    return tiles if causal else min(tiles, sms)


# _FWD_SM90_GLUON_D256 and, for head dims 192/128 (q and k read as 128 + 64 columns: the kernel's TAIL), the 64x64
# tile with Q in registers and two slots each (209 registers). H200, bf16, 8 heads (10 for 192/128), fwd TFLOP/s,
# Gluon / Triton / cuDNN, interleaved rounds (benchmarks/gluon_head_dims.py [192],
# results/h200-gluon-head-dims-2026-11-22.json):
#   d         2x8192 full   causal        8x2048 full   causal
#   256       626/502/726   580/449/612   577/449/652   462/350/500   (window (4096, 0) 561/474, softcap 672/458)
#   192/128   614/424/599   560/388/528   542/407/559   438/328/451
# d=64 takes the Gluon kernel for short causal rows only (GLUON_SHORT_CAUSAL_KEYS): elsewhere it gained at most 6%.
_FWD_SM90_GLUON_D256 = TileConfig(64, 64, 4, 1, kernel="gluon")
# GLUON_WS_D256, d=256, 16-bit: the warp-specialized forward's tile on the rows and features it takes at d=128 (the
# same floors), else _FWD_SM90_GLUON_D256; None: off. Two 64-key slots each of K and V (128 KB) leave room for one Q
# buffer (fwd_sm90_ws.q_buffers: 64 KB), released once both consumers' last S of the tile has read it. H200, bf16,
# B = 16384 // N, 8 heads, fwd TFLOP/s, 64x64 one warpgroup / WS 64-key slots, one Q / WS 32-key slots, two Q,
# median of 2 interleaved rounds (benchmarks/gluon_ws_heads.py at 0259788,
# results/h200-gluon-ws-heads-2026-11-28-0259788.json; a first run of the e02143e tree beside it):
#   rows                               evidence
#   full 4x4096 / 1x16384              601/621/475, 608/652/506 (+3-7%; first run 598/631, 640/662)
#   causal 1x16384                     622/655/483 (+5%; first run 623/660)
#   causal 4x4096, full 16x1024        531/532/411, 511/522/419 (first run 512/559, 506/538): under the floors
#   causal 16x1024                     381/368/296
# sm_90 ptxas (benchmarks/sm90_compile.py fwd-ws-d256-n64[-sink] [causal] [softcap]), consumers at 240 registers,
# 20 HGMMAs a 64-key block (16 for S, 4 for P V), 197 KB; 1-8 spill stores a CTA's tile outside the key loop, none
# in it. ALiBi (exact at 64 keys) spills 16-20 stores a consumer around the key loop: it stays on
# _FWD_SM90_GLUON_D256 (GLUON_WS_D256_FEATURES).
_FWD_SM90_GLUON_WS_D256 = TileConfig(64, 64, 4, 2, kernel="gluon-ws")
GLUON_WS_D256 = _FWD_SM90_GLUON_WS_D256
GLUON_WS_D256_FEATURES = frozenset({"sink", "softcap"})
# GLUON_WS_D192, 192/128 (DeepSeek's MLA heads: q and k read as 128 + 64 columns, the kernel's TAIL), 16-bit: the
# warp-specialized forward's tile on d=128's floors and GLUON_WS_D192_FEATURES, else the 64x64 tile above; None: off.
# H200, bf16, 16 heads, fwd TFLOP/s, 64x64 one warpgroup / WS 128-key slots / WS 64-key slots / WS 64-key x3, mean of
# 2 interleaved rounds (benchmarks/gluon_ws_heads.py --dims 192 --seqlens 4096 16384 at dc0a4a4, one GPU of a host
# running tests on the other three; results/h200-gluon-ws-heads-d192-2026-11-28-dc0a4a4.json):
#   rows                 evidence
#   full 2x4096          588/640/574/585 (+9%)
#   full 1x16384         602/672/617/601 (+12%)
#   causal 1x16384       630/641/641/594 (+2%; rounds 1.88/2.41 ms against 2.17/2.19)
#   causal 2x4096        under the causal floor; rounds of 0.32-2.6 ms (the host's tests): no evidence either way
# Shared memory, one CTA an SM
# (227 KB): two consumers' Q of 64 x 192 (48 KB a buffer), slots of K (BLOCK_N x 192) and V (BLOCK_N x 128):
#   tile                        Q        K and V rings      total (fwd_sm90_ws.q_buffers)
#   128-key slots x2 (the row)  1 x 48   2 x (48 + 32)      208 KB (two Q buffers would take 256)
#   64-key slots x2             2 x 48   2 x (24 + 16)      176 KB
#   64-key slots x3             2 x 48   3 x (24 + 16)      216 KB
# 128-key blocks halve the per-block softmax bookkeeping (row max, sum, rescale of O) against 64, with d=128's
# registers (S 64 x 128 and O 64 x 128 in float32); 20 HGMMAs a block (12 for S over 192 columns, 8 for P V). sm_90
# ptxas, 240 registers a consumer (benchmarks/sm90_compile.py fwd-ws-d192[-n64][-s3][-sink] [causal] [softcap]),
# spill stores of consumer 0 / 1, none inside the key loops (loop_stl = loop_ldl = 0 in every case):
#   128-key x2   full 9/5, causal 10/12, softcap 6/4 and 9/9 causal, sink 10/5 and 10/12 causal; 213.4 KB
#   64-key x2    0 spills in every case, 180.7 KB;  64-key x3: 0, 221.7 KB
# The key loop a consumer issues 971 SASS instructions a 128-key block against 2 x 554 on 64-key blocks (d=128's
# 128-key loop: 934), for the same tensor-core work; the spills above run once a tile, outside it.
# ALiBi stays on the 64x64 tile, as at d=256: its linear bias spills inside the key loop (-alibi: 2-5 stores and
# 28-36 loads a consumer there, 50-64 stores in all; d=128's ALiBi alike, a tie in its A/B).
_FWD_SM90_GLUON_WS_D192 = TileConfig(64, 128, 4, 2, kernel="gluon-ws")
GLUON_WS_D192 = _FWD_SM90_GLUON_WS_D192
GLUON_WS_D192_FEATURES = frozenset({"headdim_v", "sink", "softcap"})


def gluon_ring(cfg: TileConfig, head_dim: int) -> dict:
    """The Gluon kernel's shared-memory plan for tile ``cfg``: key and value ring slots, and whether Q
    sits in registers. Two programs per SM must fit 227 KB of shared memory and 255 registers a thread
    (sm_90 compile, bf16, d=128): 64x64 with Q in registers and two slots each takes 82 KB and 194
    registers; 64x128 with Q in registers spills (255 + 112 bytes of stack), with Q in shared memory
    254 registers and two key slots 147 KB, so it keeps one key slot (115 KB), refilled right after
    S_j has read it, a whole softmax before the next block needs it. At d=256 the accumulator alone takes
    128 registers: Q stays in shared memory, and one slot each (96 KB, 231-240 registers) keeps two
    programs an SM (``cfg.num_stages`` = 1). At 192/128 Q fits in registers (209) and two slots each in
    104 KB. The slim 64x64 tile (``kernel="gluon-slim"``) keeps Q in shared memory and one key slot: 161
    registers and 66 KB, three programs an SM."""
    narrow_ring = cfg.BLOCK_N >= 128 or cfg.kernel == "gluon-slim"
    return dict(K_STAGES=1 if narrow_ring else cfg.num_stages, V_STAGES=cfg.num_stages,
                Q_IN_REGS=not narrow_ring and head_dim < 256)


# GLUON_MIN_PAIRS: below this many (query row, key) pairs over all heads (about 0.05 ms of work) a call is bound by
# the host, where a replayed Gluon call costs 5-18 us more than a replayed Triton one (39-43 vs 24-38 us a no-grad
# forward); above it the Gluon kernel leads or ties. H200, bf16, fwd TFLOP/s through the API, replayed, Triton ->
# Gluon, two rounds (benchmarks/gluon_short.py, results/h200-gluon-short-2026-11-23.json):
#   call                       full                      causal
#   32x512 16/16               323-337 -> 385-398        227-232 -> 241-247
#   16x1024 16/16              400-415 -> 432-458        288-294 -> 314-338
#   4x4096 16/16                                         395-398 -> 472-479
#   1x1024 32/8 (half the floor)                         196-221 -> 226-234
GLUON_MIN_PAIRS = 32 * 1024 * 1024
# Head dims (q/k, v) the Gluon kernel takes; a pair's work grows with the head dims, so the threshold
# above counts pairs of d=128 (a call at d=256 needs half as many). At d=64 it takes short causal rows alone
# (below); KV-cache calls take it at the first three.
GLUON_KV_HEAD_DIMS = ((128, 128), (256, 256), (192, 128))
GLUON_HEAD_DIMS = GLUON_KV_HEAD_DIMS + ((64, 64),)
# GLUON_SHORT_CAUSAL_KEYS: causal rows this short take the 64x64 tile (the diagonal wastes half of a 64-key block, not
# of a 128-key one; its slim plan unless they have ALiBi), and at d=64 the Gluon kernel takes them alone. H200, bf16,
# fwd TFLOP/s, two rounds (benchmarks/gluon_causal_short.py, results/h200-gluon-causal-short-2026-11-23.json):
#   d     rows                  evidence
#   128   causal 32x512         Gluon 64x64 254-255 vs 64x128 242-243 (32/8 heads 268-271 vs 253-262)
#   128   causal 16x1024        339 vs 331-335: level, 64x128 kept;  8x2048 395-404 vs 415-416
#   64    causal 32x512         Gluon 64x64 219-222 vs Triton 128x64 200;  16x1024 277-279 vs 267-273
#   64    full 512              Triton 325-327 vs Gluon 310-319 (and ties on causal rows of 2048+): Triton
GLUON_SHORT_CAUSAL_KEYS = 1024
# GLUON_WIDE_WINDOW_KEYS: windows of fewer keys take 64x64 (a window's two edges waste more of the wide tile). H200,
# bf16, 16 heads, fwd TFLOP/s, best of 3 interleaved rounds, the leader first (benchmarks/gluon_tiles.py window,
# results/h200-gluon-tiles-window-2026-11-22.json):
#   window      tile      evidence
#   (1024, 0)   64x64     1x16384 404 vs 64x128 384, 2x8192 385 vs 379 (32/8 heads led on 64x128, 439 vs 408)
#   (2048, 0)   64x64     ties: 447 / 442, 418 / 422
#   (4096, 0)   64x128    1x16384 473 vs 64x64 458, 2x8192 485 vs 458; sink 485 vs 458, ALiBi 451 vs 436
#   (8192, 0)   64x128    517 vs 486
#   softcap     64x64     (4096, 0) 455 vs 448
GLUON_WIDE_WINDOW_KEYS = 4096
# What the Gluon kernel implements besides causal masks: calls with any other feature take the Triton one.
# ("headdim_v": a value head dim other than q's, of the pairs in GLUON_HEAD_DIMS; "varlen": packed sequences,
# seqused_k too. A varlen call's rows count every sequence as the longest, as its grid does.)
GLUON_FEATURES = frozenset({"window", "softcap", "alibi", "sink", "headdim_v", "varlen"})


def gluon_fwd_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device, rows: int,
                     seqlen_k: int, window_left: int, window_right: int, features: frozenset,
                     softcap: float = 0.0, keys_per_row: int | None = None, min_pairs: int | None = None,
                     warp_specialized: bool = True):
    """The Gluon Hopper forward's tiles when it runs this call (``rows``: batch x heads x seqlen_q;
    ``features``: the call's feature names, as in ``AttentionCall``; ``keys_per_row``: the keys a row sees
    on average, when the square-mask estimate ``mean_row_keys`` does not hold; ``min_pairs``: the floor of
    (row, key) pairs, GLUON_MIN_PAIRS unless given; ``warp_specialized``: whether the warp-specialized
    kernel may take it (it reads no KV cache)), else None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or _arch(device) != 90:
        return None
    if (head_dim, head_dim_v) not in GLUON_HEAD_DIMS or not features <= GLUON_FEATURES:
        return None
    keys = mean_row_keys(seqlen_k, window_left, window_right) if keys_per_row is None else keys_per_row
    work = rows * keys * (head_dim + head_dim_v)
    if seqlen_k == 0 or work < (GLUON_MIN_PAIRS if min_pairs is None else min_pairs) * 256:
        return None
    short_causal = window_left < 0 and window_right == 0 and seqlen_k < GLUON_SHORT_CAUSAL_KEYS
    ws_keys = GLUON_WS_FULL_KEYS if window_right < 0 else GLUON_WS_CAUSAL_KEYS
    # The warp-specialized kernel: long rows, no left bound, its features (not softcap with ALiBi).
    ws_rows = warp_specialized and window_left < 0 and seqlen_k >= ws_keys
    ws = (ws_rows and head_dim_v == head_dim and features <= GLUON_WS_FEATURES
          and not {"softcap", "alibi"} <= features)
    if head_dim == 64:
        if short_causal and not features:
            return _FWD_SM90_GLUON
        if ws and "alibi" in features and GLUON_WS_D64 is not None and GLUON_WS_D64.consumers == 3:
            # ALiBi's linear bias spills in three consumers' 160 registers: two consumers run it.
            return _FWD_SM90_GLUON_WS_D64
        return GLUON_WS_D64 if ws else None
    if head_dim == 256 and ws and features <= GLUON_WS_D256_FEATURES and GLUON_WS_D256 is not None:
        return GLUON_WS_D256
    if head_dim == 192 and ws_rows and features <= GLUON_WS_D192_FEATURES and GLUON_WS_D192 is not None:
        return GLUON_WS_D192
    if head_dim != 128:
        return _FWD_SM90_GLUON_D256 if head_dim == 256 else _FWD_SM90_GLUON
    if window_left >= 0:
        if row_keys(seqlen_k, window_left, window_right) >= GLUON_WIDE_WINDOW_KEYS and "softcap" not in features:
            return _FWD_SM90_GLUON_WIDE
        return _FWD_SM90_GLUON_SLIM if features <= GLUON_SLIM_FEATURES else _FWD_SM90_GLUON
    if window_right == 0 and seqlen_k < GLUON_SLIM_CAUSAL_KEYS and features <= GLUON_SLIM_FEATURES:
        return _FWD_SM90_GLUON_SLIM
    long_rows = row_keys(seqlen_k, window_left, window_right) >= LONG_KEYS
    if "softcap" in features and window_right < 0 and long_rows and fixed_row_max(softcap, dtype, features) is None:
        return None
    if short_causal:
        return _FWD_SM90_GLUON
    if ws:
        return _FWD_SM90_GLUON_WS
    if {"softcap", "alibi"} <= features:
        # The wide tile's linear ALiBi takes the raw scores, not the capped ones; exact there, it spills.
        return _FWD_SM90_GLUON
    return _FWD_SM90_GLUON_WIDE


# GLUON_KV_MIN_QUERIES / GLUON_KV_MIN_PAIRS: chunked prefill over a contiguous KV cache takes the Gluon forward from
# this many rows and (row, key) pairs, each row counted as seeing the whole capacity; below, the KV-cache kernel (the
# query heads of a KV head packed into its rows) ties or leads. H200, bf16, 32/8 heads, d=128, causal, eager, ms,
# Gluon / KV-cache kernel (benchmarks/kv_prefill.py, results/h200-kv-prefill-2026-11-22-ea42afd.json):
#   4 x (8192 + 2048 new) 2.28 / 3.28;  1 x (30000 + 2048) 1.86 / 2.64;  8 x (2048 + 1024) 0.82 / 0.99
#   4 x (8192 + 256) 0.43 / 0.48;  4 x (8192 + 128) 0.32 / 0.32 (the floor);  1 x (8192 + 128) 0.46 / 0.39
#   16 x (2048 + 128) 0.41 / 0.36;  4 x (8192 + 64) 0.30 / 0.26
GLUON_KV_MIN_QUERIES = 128
GLUON_KV_MIN_PAIRS = 16 * 16 * 1024 * 1024


def gluon_kv_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device, batch: int,
                    seqlen_q: int, nheads: int, capacity: int, window_left: int, window_right: int,
                    features: frozenset, softcap: float = 0.0):
    """The Gluon Hopper forward's tiles when it runs this KV-cache call (``features`` as in
    ``gluon_fwd_config``, with "kvcache" and "paged"), else None: paged caches keep the KV-cache kernel."""
    if "paged" in features or seqlen_q < GLUON_KV_MIN_QUERIES or (head_dim, head_dim_v) not in GLUON_KV_HEAD_DIMS:
        return None
    return gluon_fwd_config(head_dim, head_dim_v, dtype, device, batch * nheads * seqlen_q, capacity, window_left,
                            window_right, frozenset(features) - {"kvcache"}, softcap,
                            keys_per_row=row_keys(capacity, window_left, window_right), min_pairs=GLUON_KV_MIN_PAIRS,
                            warp_specialized=False)


# SOFTCAP_FIXED_MAX: softcap bounds every score to [-C, C] (C = softcap * log2(e)), so the Gluon forward may hold each
# row's max at m = min(C, 102 - C) chosen up front: no running max, no rescaling of O. The smallest term stays above
# 2**-102 (24 bits above float32's and bfloat16's flush to zero) and the largest, 2**(C - m), at most 2**48 up to
# this softcap. bf16 only (float16's P range is too narrow); not with ALiBi or sinks (not bounded by the cap).
#   evidence (H200 scratch run, 2026-11-22)
#   max |error| vs float32     0.016 (running max 0.008; PyTorch bf16 0.12)
#   fwd ms, fixed / running    softcap 50: 4x4096 full 1.166 / 1.266, causal 0.657 / 0.704; 1x16384 causal 2.240 / 2.538
SOFTCAP_FIXED_MAX = 75 * math.log(2)


def fixed_row_max(softcap: float, dtype: torch.dtype, features) -> float | None:
    """The Gluon forward's fixed row max (log2 units) for a call with this softcap, or None."""
    if not 0 < softcap <= SOFTCAP_FIXED_MAX or dtype != torch.bfloat16 or {"alibi", "sink"} & set(features):
        return None
    bound = softcap / math.log(2)
    return min(bound, 102.0 - bound)


def row_keys(seqlen_k: int, window_left: int, window_right: int) -> int:
    """The most keys one query row attends to under the window (-1 = unbounded side)."""
    if window_left < 0 or window_right < 0:
        return seqlen_k
    return min(seqlen_k, window_left + window_right + 1)


def mean_row_keys(seqlen_k: int, window_left: int, window_right: int) -> int:
    """About how many keys a query row attends to on average: half of them when one side of the
    window is bounded (causal), all of them when none is."""
    if (window_left < 0) != (window_right < 0):
        return seqlen_k // 2
    return row_keys(seqlen_k, window_left, window_right)


# Split dK/dV (bwd_kv_plan): one program per (key block, KV head, sequence) leaves SMs idle with few KV heads or a
# short batch. Below BWD_KV_PROGRAMS_PER_SM programs an SM, each key block's query rows are cut into parts of at least
# BWD_KV_MIN_ROWS_PER_SPLIT rows (float32 partial sums added after the kernel, bwd_sum_parts) and the dQ kernel runs
# alongside on a second stream, for backwards of BWD_SPLIT_MIN_PAIRS+ (query row, key) pairs over all heads (the fork
# and the sums cost the host). H200, bf16, whole backward TFLOP/s, replayed, split / unsplit:
#   call                                      evidence
#   1x4096, 4/1 heads, causal (64 Mi pairs)   152-167 / 93 (results/h200-bwd-fill-2026-11-22-{replayed,58415a2}.json)
#   1x4096, 2/1 heads (16 Mi: the floor)      136 / 77 (results/h200-bwd-split-rule-2026-11-22.json)
BWD_KV_PROGRAMS_PER_SM = 4
BWD_KV_MIN_ROWS_PER_SPLIT = 2048
BWD_KV_MAX_SPLITS = 16
BWD_SPLIT_MIN_PAIRS = 16 * 1024 * 1024


def bwd_kv_plan(programs: int, rows: int, pairs: int, device: torch.device) -> tuple:
    """``(parts, alongside)``: parts per key block of the dK/dV kernel, and whether the dQ kernel runs
    alongside it (with parts only). ``programs``: key blocks x KV heads x sequences; ``rows``: the most
    query rows one key block sees (per query head); ``pairs``: the visible (query row, key) pairs over all
    heads, about. The parts wanted are rounded up to a power of two (H200 sweep: 3 -> 4 and 5 -> 8 ran as
    fast or faster)."""
    if device.type == "cuda" and pairs < BWD_SPLIT_MIN_PAIRS:
        return 1, False
    wanted = -(-BWD_KV_PROGRAMS_PER_SM * sm_count(device) // max(programs, 1))
    min_rows = BWD_KV_MIN_ROWS_PER_SPLIT if device.type == "cuda" else _INTERPRET_MIN_ROWS_PER_SPLIT
    parts = max(1, min(1 << (wanted - 1).bit_length(), rows // min_rows, BWD_KV_MAX_SPLITS))
    return parts, parts > 1


def bwd_plan(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, seqlen_k: int, window: tuple,
             block_n: int, device: torch.device) -> tuple:
    """:func:`bwd_kv_plan` for a call: dK/dV key blocks of ``block_n`` keys, ``window`` ``(left, right)``."""
    return bwd_kv_plan(-(-seqlen_k // block_n) * nheads_kv * batch, row_keys(seqlen_q, *window),
                       batch * nheads * seqlen_q * mean_row_keys(seqlen_k, *window), device)


def bwd_config(head_dim: int, dtype: torch.dtype, device: torch.device, head_dim_v: int = 0, row_keys: int = 0,
               features: frozenset = frozenset()) -> BwdConfig:
    """Backward tiles; head dims as in :func:`fwd_config`. ``row_keys``: the most keys a query row sees
    (:func:`row_keys`); ``features``: the call's feature names (ALiBi, bias and dropout keep the short
    rows' dK/dV tile)."""
    if device.type != "cuda":
        return _BWD_INTERPRET
    if dtype == torch.float32:
        return _BWD_FP32_D256 if padded_head_dim(head_dim) == 256 else _BWD_FP32
    padded = padded_head_dim(head_dim)
    if _arch(device) != 90:
        return _BWD_SM80[padded]
    if _narrow_values(head_dim, head_dim_v) and padded in _BWD_SM90_V128:
        cfg = _BWD_SM90_V128[padded]
        if "bias" in features:
            # The bias tile on the two-stage dQ tile asked 245760 B of shared memory, over the H200's 232448, and
            # failed to compile (tests/test_paths.py, d=192/128, 2026-11-27): one stage, as _BWD_SM90[256] has.
            cfg = replace(cfg, dq=replace(cfg.dq, num_stages=1))
        return cfg
    if row_keys >= LONG_BWD_KEYS and padded in _BWD_SM90_LONG and not _BWD_SHORT_TILE_FEATURES & features:
        return _BWD_SM90_LONG[padded]
    cfg = _BWD_SM90[padded]
    if "bias" in features and padded == 128:
        # A float32 bias tile on the three-stage 128x64 dQ tile asked 262144 B of shared memory, over the H200's
        # 232448 (tests/test_fuzz.py seed0-case134, bf16 with a float32 bias, 2026-11-27): two stages.
        cfg = replace(cfg, dq=replace(cfg.dq, num_stages=2))
    return cfg


# KV-cache attention (kernels/decode.py), per padded head dim: (up to 16 packed rows, up to DECODE_PREFILL_ROWS, more).
# Packed rows are query tokens x the query heads of one KV head (a GQA-4 decode step fills 4 rows of the smallest
# tl.dot's 16). Decode is bound by reading K and V once: the key tile and pipeline depth matter, the query tile not.
#   table, rows                   tile           evidence
#   DECODE_SM90 d=128, decode     16x128 w4 s3   16 x 8192 keys 123.6 us = 1.02x the 4.27 TB/s copy (16x64 w4 s3 129.5,
#                                                16x256 w8 s2 131.4, 16x32 w4 s4 129.4); pages of 256 125.4 (H200, bf16,
#                                                32/8 heads, CUDA graph, scratch sweep 2026-11-21)
#   every other row, DECODE_SM80  as below       compiled without spills, not timed (ptxas -v, triton 3.6, 2026-11-22):
#                                                sm_90 bf16 d=128 16x64 w4 s3 112 registers (paged 168); bf16 d=256
#                                                32x64 w4 spills, 32x32 does not; prefill d=256 64x32 w8 193
#   _DECODE_FP32                  w8             fp32 (FMA dot) 16x32 w4 spills 660 B at d=128, 16x64 w8 62 registers
DECODE_SM90 = {
    16: (TileConfig(16, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    32: (TileConfig(16, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    64: (TileConfig(16, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    128: (TileConfig(16, 128, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    256: (TileConfig(16, 64, 4, 2), TileConfig(32, 32, 4, 2), TileConfig(64, 32, 8, 2)),
}
# DECODE_SM90_FP8: an e4m3 cache (kernels/decode.py FP8_CACHE: K converted to fp16 in registers, V read as 16-bit
# pairs of columns straight into the dot operand's layout), with DECODE_FP8_PROGRAMS_PER_SM programs an SM. Until
# wip-fp8-side V went through shared memory twice (e4m3 words in, fp16 out and back: 164 KB of shared-memory traffic
# a 128-key block against 100 KB now) and 16x128 w8 s3 at 2 programs an SM took 395 us at 16 x 32768 keys, 0.82x
# the bf16 cache's 478, 109.9 us at 1 x 131072 (0.81x of 136); every tile from 16x64 to 16x256, w4/w8, 1-3
# programs an SM was within 0.5% of it (H200, GQA 32/8, d=128, CUDA graph, flashtile/bench/fp8.py at 4664c6d,
# results/h200-fp8-2026-11-27-4664c6d.json): bound by the kernel's work per byte, not by memory. Now 16x128 w4 s3
# at 3 programs an SM takes 0.564x the bf16 cache's time at 16 x 32768 keys (392.8 -> 275.6 us), 0.630x at
# 1 x 131072 (109.4 -> 86.9 us; same call against 5d069c2, results/h200-fp8-side-2026-11-27-02dd45f.json; the
# other tiles not timed). SASS instructions of the unmasked loop per 128 keys, registers, shared memory (ptxas,
# sm_90, triton 3.6):
#   tile          before            now                          programs an SM
#   16x128 w8 s3  3904, 108, 104 KB  2928, 128, 72 KB            2 (registers)
#   16x128 w4 s3  -                  2320, 168, 72 KB (chosen)   3 (shared memory)
#   16x256 w8 s2  -                  2388, 164, 76 KB            1 (registers)
# Other rows and head dims take the bf16 table's tiles. The decode row is the FP8 step's own split/tile choice
# (decode_plan: this tile, DECODE_FP8_PROGRAMS_PER_SM[heads] x SMs // programs splits; the bf16 row's 1 an SM is
# not assumed). ``heads``: KV heads a program (kernels/decode.py HEADS: key rows of heads x 128 bytes, where one
# head's are 128-byte pieces 1 KB apart); a call whose heads do not divide nheads_kv, or whose rows overflow the row
# block, takes one head a program at 3 an SM. Time over the bf16 cache's step (splits), H200, GQA 32/8, d=128, CUDA
# graph, one round (benchmarks/decode_fp8_tiles.py, results/h200-fp8-decode-tiles-2026-11-28-2ee657b.json):
#   value                        16 x 32768     1 x 131072     evidence
#   16x128 w4 s3 heads 2, 1/SM   0.529 (2)      0.607 (33)     chosen; bench --suite fp8 at 8b93cf6: 0.52 / 0.61
#   16x128 w4 s2 heads 2, 2/SM   0.538 (4)      0.619 (66)
#   16x128 w4 s3 heads 1, 3/SM   0.557 (3)      0.628 (49)     the row before; 2/SM 0.539 / 0.623, 1/SM 0.645 / 0.667
#   16x64 heads 2, 16x32 heads 4 0.547-0.568    0.621-0.633
#   head-major cache, heads 1    0.542          0.625          each head's keys contiguous: the layout is not the limit
# At 1 x 131072 the split kernel takes 66.8 of the FP8 step's 85.2 us (bf16 121.2 of 135.6; torch profiler): the ~14-18
# us the step takes beyond it (the graph's launch, the split-KV combine) hold the ratio above 0.55 there.
DECODE_SM90_FP8 = {128: (TileConfig(16, 128, 4, 3, heads=2), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3))}
# Programs an SM by KV heads a program: two heads' slots (140 KB of shared memory) leave room for one.
DECODE_FP8_PROGRAMS_PER_SM = {1: 3, 2: 1}
# DECODE_SM90_GATHER: pages smaller than a key block, each key row looked up on its own page (the next block's table
# read lands before its K/V loads), with DECODE_GATHER_PROGRAMS programs an SM making up the bytes in flight. Time
# over the contiguous cache's (H200, bf16, 32/8 heads, d=128, page 16, CUDA graph, scratch sweep 2026-11-21):
#   tile, programs an SM      16x8192   16x32768   1x131072   1x32768
#   16x32 w4 s3, 4 (chosen)   1.08      1.055      1.07       1.17
#   16x64 w4 s3, 2            1.12      1.08       1.10       1.19
DECODE_SM90_GATHER = {128: TileConfig(16, 32, 4, 3)}
DECODE_GATHER_PROGRAMS = 4
# Ampere: shallower pipelines for its 164 KB of shared memory (compiled for sm_80, not measured).
DECODE_SM80 = {
    16: (TileConfig(16, 64, 4, 2), TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 2)),
    32: (TileConfig(16, 64, 4, 2), TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 2)),
    64: (TileConfig(16, 64, 4, 2), TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 2)),
    128: (TileConfig(16, 64, 4, 2), TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 2)),
    256: (TileConfig(16, 32, 4, 2), TileConfig(32, 32, 4, 2), TileConfig(32, 32, 4, 2)),
}
# float32 inputs, any GPU: the dot runs on FMAs, so wide warps and no deep pipeline.
_DECODE_FP32 = {
    16: (TileConfig(16, 64, 8, 2), TileConfig(32, 64, 8, 2), TileConfig(32, 64, 8, 2)),
    32: (TileConfig(16, 64, 8, 2), TileConfig(32, 64, 8, 2), TileConfig(32, 64, 8, 2)),
    64: (TileConfig(16, 64, 8, 2), TileConfig(32, 64, 8, 2), TileConfig(32, 64, 8, 2)),
    128: (TileConfig(16, 64, 8, 2), TileConfig(32, 64, 8, 2), TileConfig(32, 64, 8, 2)),
    256: (TileConfig(16, 32, 8, 2), TileConfig(32, 32, 8, 2), TileConfig(32, 32, 8, 2)),
}
# Packed rows above which a call takes the prefill tiles.
DECODE_PREFILL_ROWS = 32
# Interpreter: 16-key tiles, so small test caches still span several blocks, pages and splits.
_DECODE_INTERPRET = TileConfig(16, 16, 4, 1)

# Split-KV (flash-decoding, decode_splits): with few (batch x KV head x row block) programs each sequence's keys are
# cut into shares whose partial results a second kernel merges. Auto, from shapes alone (never cache_seqlens, so CUDA
# graphs replay any lengths): DECODE_PROGRAMS_PER_SM x SMs // programs splits, at most the capacity's key blocks and
# DECODE_MAX_SPLITS, at least 1 (rounding down keeps one wave). H200, bf16, d=128, 32/8 heads, CUDA graph, us:
#   value                          evidence
#   DECODE_PROGRAMS_PER_SM 1       1x32768: 8 splits 49.4, 12: 39.2, 16: 38.2, 24: 46.1, 32: 45.4; 16x8192: 1 split
#                                  123.6, 2: 133.9 (a 16x128 s3 program fills an SM's shared memory)
#   DECODE_MIN_KEYS_PER_SPLIT 128  512 -> 128 keys: 1x512 8.85 -> 7.12 (SDPA 7.57), 1x4096 12.25 -> 9.96 (9.55), 4x1024
#                                  11.59 -> 9.65 (8.74); unchanged from 8192 keys (benchmarks/decode_splits.py,
#                                  results/h200-decode-splits-2026-11-22.json, h200-decode-splits-after-2026-11-22.json)
DECODE_PROGRAMS_PER_SM = 1
DECODE_MIN_KEYS_PER_SPLIT = 128
DECODE_MAX_SPLITS = 128
# Short caches (decode_plan), H200, bf16, d=128, 32/8 heads, CUDA graph, scratch sweep 2026-11-22, us (A/B:
# benchmarks/decode_short.py):
#   value                     evidence
#   DECODE_SHORT_BLOCK_N 64   128-key splits leave SMs idle: 1x1024 16 splits of 64 keys 5.91, 8 of 128 6.55, SDPA 6.70
#   DECODE_SHORT_STAGES 2     one key block a split: 6.55 with two stages, 7.63 with three (two blocks: tie)
# Small pages keep their gather tile.
DECODE_SHORT_BLOCK_N = 64
DECODE_SHORT_STAGES = 2
# The interpreter has no SMs: pretend 8 and short splits, so auto splitting is exercised cheaply.
_INTERPRET_SMS = 8
_INTERPRET_MIN_KEYS_PER_SPLIT = 32
_INTERPRET_MIN_ROWS_PER_SPLIT = 64


# The one-pass Hopper backward (kernels/bwd_sm90_ws.py): CTAs of 128 keys that compute P and dS once for dK, dV
# and dQ, adding dQ into float32 with the TMA's reduce (in whatever order the CTAs get there). It takes 16-bit
# calls at head dim 128, packed sequences too, with windows, softcap, ALiBi or a sink, once its CTAs fill the
# SMs: bf16 on the H200, 0.81-0.93x the time of the dK/dV + dQ pair, softcap 0.93-1.01x of the pair's plain rows
# (benchmarks/bwd_ws.py, BENCHMARKS.md); packed sequences 0.84-0.97x with or without the features and seqused_k
# (benchmarks/bwd_ws.py varlen). ALiBi with no right bound, or causal (the bias is linear where keys are
# seen); a right bound past the diagonal keeps the pair. Deterministic calls keep the pair.
# At head dim 64 it takes calls of ONE_PASS_D64_MIN_PAIRS+ visible (query row, key) pairs over all heads; below,
# causal rows keep the pair. H200, bf16, backward TFLOP/s, pair -> one-pass, median of 10 (the sweep
# script is in commit 4b46fb9; results/h200-one-pass-d64-2026-11-27-4664c6d.json):
#   call                             full          causal
#   1x4096, 16/16 heads              239 -> 333    174 -> 153 (the floor: 2^27 pairs causal, 2^28 full)
#   1x16384, 32/32                   355 -> 410    336 -> 407
#   4x4096, 32/32                    353 -> 392    318 -> 348
#   2x4096, 64/8 with a sink         338 -> 395    282 -> 296
ONE_PASS_KEYS = 128
# Query rows a step at head dim 64 (FA3/FA4's 128x128 step): half the per-step barriers, hand-overs and reduces
# per multiply-add; 1.00-1.04x the 64-row step on the H200 (results/h200-one-pass-d64-rows128-2026-11-27-501d93d.json).
# Softcap keeps 64 (174 spill stores at 128, benchmarks/sm90_compile.py), packed sequences too (shared memory at the
# limit).
ONE_PASS_D64_ROWS = 128
ONE_PASS_FEATURES = frozenset({"window", "softcap", "alibi", "sink", "varlen"})
ONE_PASS_HEAD_DIMS = (64, 128)
ONE_PASS_D64_MIN_PAIRS = 1 << 28
# The wide one-pass kernel (kernels/bwd_sm90_wide.py) at (q/k, v) head dims 192/128 (DeepSeek's) and 192/192: FA4's
# sm90 tile, CTAs of 64 keys, steps of 64 queries, two consumer warpgroups splitting dK, dV and dQ by head-dim columns;
# the same features and rule as above (ALiBi exact, so right bounds too); head dim 256 with one Q/dO slot (two would
# need 296 KB of shared memory). H200, bf16, B = 16384 // N, H = 2048 // d, backward TFLOP/s, Triton pair -> wide,
# one call, out, LSE and every gradient checked at each shape first (results/h200-bwd-one-pass-2026-11-27-02dd45f.json):
#   d          N=1k full / causal     4k full / causal       16k full / causal      ratio
#   192/128    218 -> 259 / 174 -> 207  247 -> 321 / 220 -> 295  249 -> 339 / 245 -> 341  1.18-1.39x
#   192/192    168 -> 294 / 150 -> 235  188 -> 369 / 191 -> 340  190 -> 391 / 212 -> 392  1.57-2.06x
#   256/256    214 -> 310 / 172 -> 246  236 -> 391 / 221 -> 360  238 -> 412 / 251 -> 413  1.44-1.74x
# sm_90 ptxas (benchmarks/sm90_compile.py wide[-v192][-d256]): see kernels/bwd_sm90_wide.py (256: 0 spill stores,
# 230,672 B).
ONE_PASS_WIDE_HEAD_DIMS = ((192, 128), (192, 192), (256, 256))
ONE_PASS_WIDE_KEYS = 64


def one_pass_rows(head_dim: int, features: frozenset) -> int:
    """Query rows a step of the one-pass backward."""
    wide = head_dim == 64 and not features & {"softcap", "varlen"}
    return ONE_PASS_D64_ROWS if wide else ONE_PASS_KEYS // 2


def one_pass_wide(head_dim: int, head_dim_v: int) -> bool:
    """Whether the one-pass backward at these head dims is the wide kernel (kernels/bwd_sm90_wide.py)."""
    return (head_dim, head_dim_v) in ONE_PASS_WIDE_HEAD_DIMS


def one_pass_stages(head_dim: int) -> int:
    """Q/dO ring slots of the one-pass backward: one at head dim 256 (64 KB a slot), else two."""
    return 1 if head_dim == 256 else 2


# The one-pass kernels' consumer warpgroups after ``setmaxnreg`` (240 each, the producer and reducer warps' group 24:
# the SM's 64K registers), and the cap they are compiled under (12 warps at 168).
ONE_PASS_CONSUMER_REGS = 240
ONE_PASS_MAXNREG = 168
# The 96-key variant at 192/128 (kernels/bwd_sm90_wide96.py): 14 warps, counted as 16 by the compiler, at 128 registers;
# two consumer warpgroups at 160 and the third (the default partition) at the 168 left (sm_90 ptxas, 2 x 4096: 0 spill
# instructions full, 2 in the causal key loop; softcap or ALiBi spill there, so it takes neither). Packed sequences
# (4096 + 4096 with seqused_k): 0 spill instructions in the key loops full and causal; with a window as well, 1 spill
# store and 4-5 reloads a step in the two worker consumers' loops (dense windows: 1-2 reloads), so packed calls with a
# window keep the 64-key kernel (ONE_PASS_96_APART).
ONE_PASS_96_CONSUMER_REGS = 160
ONE_PASS_96_MAXNREG = 128
ONE_PASS_96_FEATURES = frozenset({"window", "sink", "varlen", "headdim_v"})
ONE_PASS_96_APART = frozenset({"window", "varlen"})
# ONE_PASS_96: 192/128 calls of ONE_PASS_96_FEATURES (dense or packed) take the 96-key CTAs (False: the 64-key wide
# kernel).
# H200, bf16, backward alone, TFLOP/s (2.5 x 2 B H N^2 (d + dv), halved when causal), 64-key wide kernel / its
# dq_first + release_each + rotate / 96 keys / 96 keys with two dS buffers, 2 interleaved rounds, every variant's
# out, lse, dQ, dK, dV checked first (benchmarks/bwd_one_pass_192.py, results/h200-bwd192-2026-11-28-f1ac707.json):
#   rows                               evidence
#   1 x 16384, 10 heads, full          347/370/400/402 (96 keys 1.15x)
#   1 x 16384, 10 heads, causal        339/370/384/383 (1.13x)
#   DeepSeek 2 x 4096, 16 heads, causal 293/324/329/330 (1.12x)
#   packed 16k, 8 seqs 263-4096, causal 268/-/290/- (1.08x; DeepSeek's 16 heads; SWEEP_SHAPES=packed,
#                                      results/h200-bwd192-packed-2026-11-28-a7e461c.json)
# Softcap and ALiBi spill in its key loop: they keep the 64-key kernel.
ONE_PASS_96 = True


@dataclass(frozen=True)
class OnePassConfig:
    """The one-pass backward's knobs (tuning sweeps pass one to launch.backward as ``one_pass``): Q/dO ring slots,
    the consumers' registers after ``setmaxnreg`` and the compile cap; the wide kernel's (kernels/bwd_sm90_wide.py)
    order of dQ's product before dK's (``dq_first``), release of each dQ staging buffer as soon as it is read
    (``release_each``) and walk begun at each CTA's key block (``rotate``); at 192/128, CTAs of 96 keys on
    three consumer warpgroups (``keys96``: kernels/bwd_sm90_wide96.py, FA4's tile; :func:`one_pass_config` gives it
    its registers) and its dS buffers (``ds_bufs``: 1 or 2). At head dims 64 and 128 (kernels/bwd_sm90_ws.py)
    ``dq_first`` too, dK's product with dS^T from registers (``dk_rs``, FA3's), issued before dS^T is stored
    unless ``dq_first``, at 128-row steps (head dim 64) dQ split between the consumers by rows, not columns
    (``dq_rows``, FA3's: products of N = 64, not 32), and at head dim 128 the next step's S^T issued before this
    step's dQ, dK and dV products are waited on (``s_ahead``: it runs while dQ is staged)."""
    stages: int
    consumer_regs: int = ONE_PASS_CONSUMER_REGS
    maxnreg: int = ONE_PASS_MAXNREG
    dq_first: bool = False
    release_each: bool = False
    rotate: bool = False
    keys96: bool = False
    ds_bufs: int = 1
    dk_rs: bool = False
    dq_rows: bool = False
    s_ahead: bool = False


# ONE_PASS_DQ_ROWS: calls of 128-row steps (head dim 64, no softcap, not packed) split dQ by rows (dq_rows).
# H200, bf16, the backward alone, 16384 tokens, 32 heads, d64, knob off / on, TFLOP/s, 3 interleaved rounds, each
# variant's dQ, dK, dV compared with the default's first (benchmarks/bwd_ws.py knobs,
# results/h200-bwd-one-pass-knobs-2026-11-28-cf3c2dd.json):
#   rows                evidence
#   16 x 1024  full     317 / 324 (1.02x)     causal 217 / 218
#   4 x 4096   full     407 / 406             causal 357 / 356
#   1 x 16384  full     440 / 448 (1.02x)     causal 429 / 443 (1.03x)
# dq_first and dk_rs stay off (same run): at d64 dq_first 0.96-0.99x, dk_rs 0.98-1.00x; at d128 dk_rs 0.95-0.99x,
# both 0.98-1.01x, dq_first 1.00-1.01x.
ONE_PASS_DQ_ROWS = True
# ONE_PASS_S_AHEAD: head dim 128 issues the next step's S^T under this step's last products (s_ahead). sm_90 ptxas
# (`python benchmarks/sm90_compile.py fused-d128[-alibi|-varlen] [causal] [softcap] [window] s_ahead=1`): no spills
# in the key loops with every feature (ALiBi's one STL/LDL a step goes), a causal step 597 -> 612 instructions.
# H200, bf16, the backward alone, 16384 tokens, 16 heads, d128, knob off / on, TFLOP/s, 3 interleaved rounds, each
# variant's dQ, dK, dV compared with the default's first (benchmarks/bwd_ws.py knobs,
# results/h200-bwd-one-pass-knobs-2026-11-28-aa81f72.json):
#   rows                evidence
#   16 x 1024  full     360 / 366 (1.02x)     causal 249 / 251 (1.01x)
#   4 x 4096   full     479 / 487 (1.02x)     causal 400 / 407 (1.02x)
#   1 x 16384  full     516 / 522 (1.01x)     causal 499 / 506 (1.02x)
# ds_named_barrier (both consumers meet on dS at one named barrier, FA3's) lost in the same run: 0.96-0.97x at d128,
# 0.97-1.00x of dq_rows at d64 (tried, not kept: docs/design.md).
ONE_PASS_S_AHEAD = True


def one_pass_config(head_dim: int, keys96: bool = False, features: frozenset = frozenset()) -> OnePassConfig:
    """The one-pass backward's knobs at this head dim (``keys96``: the 96-key variant's at 192/128) for a call of
    ``features`` (whose steps of 128 rows take ``dq_rows``: ONE_PASS_DQ_ROWS; head dim 128 ``s_ahead``:
    ONE_PASS_S_AHEAD)."""
    if keys96:
        return OnePassConfig(2, ONE_PASS_96_CONSUMER_REGS, ONE_PASS_96_MAXNREG, keys96=True)
    return OnePassConfig(one_pass_stages(head_dim),
                         dq_rows=ONE_PASS_DQ_ROWS and one_pass_rows(head_dim, features) == 128,
                         s_ahead=ONE_PASS_S_AHEAD and head_dim == 128)


def one_pass_96_takes(head_dim: int, head_dim_v: int, features: frozenset) -> bool:
    """Whether the 96-key kernel (kernels/bwd_sm90_wide96.py) takes a call: head dims 192/128, features of
    ONE_PASS_96_FEATURES but not all of ONE_PASS_96_APART (a window on packed sequences)."""
    return ((head_dim, head_dim_v) == (192, 128) and features <= ONE_PASS_96_FEATURES
            and not ONE_PASS_96_APART <= features)


def one_pass_keys96(head_dim: int, head_dim_v: int, features: frozenset) -> bool:
    """Whether the one-pass backward runs 96-key CTAs: the calls the 96-key kernel takes
    (:func:`one_pass_96_takes`), dense or packed, unless ONE_PASS_96 is off."""
    return ONE_PASS_96 and one_pass_96_takes(head_dim, head_dim_v, features)


def one_pass_keys(head_dim: int, head_dim_v: int, keys96: bool = False) -> int:
    """Keys a CTA of the one-pass backward owns (``keys96``: the 96-key CTAs run, :func:`one_pass_keys96`)."""
    if keys96:
        return 96
    return ONE_PASS_WIDE_KEYS if one_pass_wide(head_dim, head_dim_v) else ONE_PASS_KEYS


def deterministic(asked: bool) -> bool:
    """Whether a backward must add its sums in a fixed order: the call asked (``deterministic=True``), or
    torch does (``torch.use_deterministic_algorithms(True)``)."""
    return asked or torch.are_deterministic_algorithms_enabled()


def one_pass_bwd(head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device, features: frozenset,
                 window_right: int, batch: int, nheads_kv: int, seqlen_k: int,
                 deterministic: bool, pairs: int = 0) -> bool:
    """Whether a backward takes the one-pass kernel; ``features``: the call's feature names (packed sequences
    are one), ``window_right`` its right bound (0 when causal, -1 none), ``deterministic`` whether its gradients
    must be bit-identical run to run, ``pairs`` the visible (query row, key) pairs over all heads, about."""
    wide = one_pass_wide(head_dim, head_dim_v)
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _arch(device) == 90
            and (wide or head_dim == head_dim_v and head_dim in ONE_PASS_HEAD_DIMS)
            and features - {"headdim_v"} <= ONE_PASS_FEATURES
            and not ("alibi" in features and window_right > 0 and not wide) and not deterministic
            and (head_dim != 64 or pairs >= ONE_PASS_D64_MIN_PAIRS)
            and -(-seqlen_k // one_pass_keys(head_dim, head_dim_v, one_pass_keys96(head_dim, head_dim_v, features)))
                 * nheads_kv * batch >= sm_count(device))


@dataclass(frozen=True)
class BwdPlan:
    """How a backward runs: the one-pass kernel (``one_pass``), or the dK/dV + dQ pair with ``cfg``'s tiles, key
    blocks split into ``parts`` float32 partial sums (1: unsplit), dQ on a second stream when ``alongside``."""
    one_pass: bool
    cfg: BwdConfig
    parts: int = 1
    alongside: bool = False


def bwd_choice(cfg: BwdConfig, head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device,
               features: frozenset, window: tuple, batch: int, nheads: int, nheads_kv: int, seqlen_q: int,
               seqlen_k: int, deterministic: bool, one_pass: bool = True, gluon: bool = True) -> BwdPlan:
    """The backward's plan, for the launcher and for the kernel names alike. ``cfg``: :func:`bwd_config`'s tiles;
    ``window``: ``(left, right)``; ``one_pass`` / ``gluon``: whether the one-pass kernel / the Gluon dK/dV kernel may
    be taken (False once the inputs are found unfit for the TMA). The one-pass kernel stores whole dK/dV rows, so it
    never takes the pair's split plan."""
    pairs = batch * nheads * seqlen_q * mean_row_keys(seqlen_k, *window)
    if one_pass and one_pass_bwd(head_dim, head_dim_v, dtype, device, features, window[1], batch, nheads_kv, seqlen_k,
                                 deterministic, pairs):
        return BwdPlan(True, cfg)
    tile = gluon_dkdv_config(head_dim, head_dim_v, dtype, device, features) if gluon else None
    cfg, parts, alongside = with_gluon_dkdv(cfg, tile, lambda block_n: bwd_plan(
        batch, nheads, nheads_kv, seqlen_q, seqlen_k, window, block_n, device))
    return BwdPlan(False, cfg, parts, alongside)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU (asked once per device); a fixed small count on CPU."""
    if device.type != "cuda":
        return _INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# Dense calls with few query rows per KV head (a decode step through flash_attn_func, or a continuous batch's through
# flash_attn_varlen_func, max_seqlen_q rows) run on the KV-cache kernel as over a full cache of seqlen_k keys: it packs
# a KV head's query heads into one tile, reads K and V once and splits long rows over the SMs. Not for dropout or a
# bias (DENSE_DECODE_FEATURES). A call takes it once the forward kernel's programs walk DENSE_DECODE_MIN_KEYS keys
# (waves x keys). H200, bf16, 32/8 heads, d=128, causal, one query, us by CUDA-graph replay, forward kernel / KV-cache
# kernel / SDPA (benchmarks/dense_decode.py [--short], results/h200-dense-decode{,-short}-2026-11-22.json):
#   call                  evidence
#   1 x 4096 / 32768      47.3 / 12.2 / 9.3;  499 / 38.1 / 37.6
#   16 x 8192; 64 x 1024  516 / 124 / 123;  165 / 72 / 66
#   1 x 256 (from here)   6.1 / 4.9 / 6.0;  1 x 1024 14.4 / 6.1 / 6.7;  16 x 512 23.8 / 10.0 / 8.4
#   1 x 128 (level)       4.7 / 4.8 / 4.3
DENSE_DECODE_FEATURES = frozenset({"window", "softcap", "alibi", "sink", "headdim_v", "varlen"})
DENSE_DECODE_MIN_KEYS = 256
# The KV-cache kernels' second grid axis is batch x KV heads (append and combine: batch), which CUDA caps.
MAX_GRID_Y = 65535


def dense_takes_decode(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_kv: int,
                       features: frozenset, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a dense call runs on the KV-cache kernel (see DENSE_DECODE_FEATURES); ``features``: its
    feature names, as in ``AttentionCall``. Under the interpreter every call whose rows fit does; on a GPU
    16-bit calls (float32 was not measured)."""
    if seqlen_q * (nheads // nheads_kv) > DECODE_PREFILL_ROWS or seqlen_k == 0 or batch * nheads_kv > MAX_GRID_Y:
        return False
    if not features <= DENSE_DECODE_FEATURES:
        return False
    if device.type != "cuda":
        return True
    # The forward kernel's programs (one query block per head: seqlen_q <= 32) in waves over the SMs.
    waves = -(-batch * nheads // sm_count(device))
    return dtype != torch.float32 and waves * seqlen_k >= DENSE_DECODE_MIN_KEYS


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device, packed_rows: int,
                  page_size: int = 0, fp8: bool = False) -> TileConfig:
    """Tiles of the KV-cache attention kernel; ``packed_rows = seqlen_q * (nheads // nheads_kv)``;
    ``page_size``: of a paged cache, 0 for a contiguous one; ``fp8``: the cache is e4m3."""
    if device.type != "cuda":
        return _DECODE_INTERPRET
    if dtype == torch.float32:
        table = _DECODE_FP32
    else:
        table = DECODE_SM90 if _arch(device) == 90 else DECODE_SM80
    if fp8 and table is DECODE_SM90 and padded_head_dim(head_dim) in DECODE_SM90_FP8:
        table = DECODE_SM90_FP8
    column = 0 if packed_rows <= 16 else 1 if packed_rows <= DECODE_PREFILL_ROWS else 2
    cfg = table[padded_head_dim(head_dim)][column]
    gather = page_size and page_size % cfg.BLOCK_N != 0
    sm90 = table in (DECODE_SM90, DECODE_SM90_FP8)
    if gather and sm90 and column == 0 and padded_head_dim(head_dim) in DECODE_SM90_GATHER:
        return DECODE_SM90_GATHER[padded_head_dim(head_dim)]
    return cfg


def decode_plan(head_dim: int, dtype: torch.dtype, device: torch.device, rows: int, programs: int, capacity: int,
                num_splits: int = 0, page_size: int = 0, config: TileConfig | None = None, fp8: bool = False,
                nheads_kv: int = 1) -> tuple:
    """``(tiles, splits)`` of the KV-cache kernel: :func:`decode_config`'s tiles and :func:`decode_splits`'s
    count, with the short-cache rules above. ``rows``: packed query rows a (batch row, KV head);
    ``programs``: batch x KV heads (the row blocks and the KV heads a program are counted here); ``config``:
    tiles given instead of the table's (tuning sweeps), taken as they are; ``fp8``: the cache is e4m3
    (DECODE_SM90_FP8); ``nheads_kv``: KV heads a batch row (a table tile of several heads a program that do not
    divide them, or whose rows overflow one row block, takes one)."""
    cfg = config or decode_config(head_dim, dtype, device, rows, page_size, fp8)
    # The e4m3 decode tile (not a sweep's, nor small pages' gather tile) runs more programs an SM.
    fp8_tile = fp8 and config is None and cfg == DECODE_SM90_FP8.get(padded_head_dim(head_dim), (None,))[0]
    if config is not None and nheads_kv % config.heads:
        raise ValueError(f"decode config {config} takes {config.heads} KV heads a program, which must divide "
                         f"nheads_kv={nheads_kv}")
    if config is None and cfg.heads > 1 and (nheads_kv % cfg.heads or rows * cfg.heads > cfg.BLOCK_M):
        # Row blocks holding one head's rows would read every head's keys for it.
        cfg = replace(cfg, heads=1)
    programs = programs // cfg.heads * -(-rows * cfg.heads // cfg.BLOCK_M)
    gather = bool(page_size) and page_size % cfg.BLOCK_N != 0
    per_sm = DECODE_FP8_PROGRAMS_PER_SM[cfg.heads] if fp8_tile else DECODE_PROGRAMS_PER_SM
    splits = decode_splits(num_splits, programs, capacity, device, cfg.BLOCK_N, gather, per_sm=per_sm)
    if device.type != "cuda" or config is not None:
        return cfg, splits
    short = DECODE_SHORT_BLOCK_N
    wanted = per_sm * sm_count(device) // max(programs, 1)
    if (num_splits == 0 and not gather and cfg.BLOCK_N >= short and splits < wanted
            and (not page_size or page_size % short == 0)):
        cfg = replace(cfg, BLOCK_N=short)
        splits = decode_splits(0, programs, capacity, device, short, min_keys=short, per_sm=per_sm)
    if -(-capacity // (splits * cfg.BLOCK_N)) <= 1 and cfg.num_stages > DECODE_SHORT_STAGES:
        cfg = replace(cfg, num_stages=DECODE_SHORT_STAGES)
    return cfg, splits


def decode_splits(num_splits: int, programs: int, capacity: int, device: torch.device, block_n: int,
                  gather: bool = False, min_keys: int = DECODE_MIN_KEYS_PER_SPLIT, per_sm: int = 0) -> int:
    """Key splits per sequence: ``num_splits`` when given (clamped to ``[1, DECODE_MAX_SPLITS]`` and to
    the key blocks of the capacity), else the auto rule above. ``programs``: row blocks x batch x KV heads;
    ``gather``: keys are looked up row by row on small pages (twice the programs hide that latency);
    ``per_sm``: programs an SM (0: DECODE_PROGRAMS_PER_SM)."""
    blocks = max(1, -(-capacity // block_n))
    if num_splits > 0:
        return max(1, min(num_splits, DECODE_MAX_SPLITS, blocks))
    interpret = device.type != "cuda"
    if interpret:
        min_keys = _INTERPRET_MIN_KEYS_PER_SPLIT
    by_length = max(1, capacity // max(min_keys, block_n))
    per_sm = (per_sm or DECODE_PROGRAMS_PER_SM) * (DECODE_GATHER_PROGRAMS if gather else 1)
    wanted = per_sm * sm_count(device) // max(programs, 1)
    return max(1, min(wanted, by_length, DECODE_MAX_SPLITS, blocks))
