"""Tile sizes, warps and pipeline stages per GPU generation and head dim.

Each table row names the measurement that chose it. Keys are the padded head dim
(the next power of two >= headdim, at least 16).
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
    ``"gluon-ws"`` (the warp-specialized one in kernels/fwd_sm90_ws.py)."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    kernel: str = "triton"


@dataclass(frozen=True)
class BwdConfig:
    dkdv: TileConfig  # BLOCK_M walks queries, BLOCK_N is the key block a program owns
    dq: TileConfig  # BLOCK_M is the query block a program owns, BLOCK_N walks keys


def _bwd(m1, n1, w1, s1, m2, n2, w2, s2) -> BwdConfig:
    return BwdConfig(TileConfig(m1, n1, w1, s1), TileConfig(m2, n2, w2, s2))


# Hopper (sm_90), 16-bit inputs: forward tiles per head dim as (full rows, long full rows, masked
# rows, long masked rows) and one backward pair. Masked rows: causal or a sliding window; long: a
# row attends to at least LONG_KEYS keys. First chosen by benchmarks/tune.py on one H200, bf16, batch 4 x
# seqlen 4096, nheads x headdim = 2048 (2026-11-21, torch 2.11 / triton 3.6; full sweep in
# benchmarks/results/h200-tune-2026-11-21.json):
#   fwd d=64:  128x64 w8 s4 437 non-causal (128x64 w8 s3: 431); 128x64 w8 s3 387 causal.
#   dK/dV d=128: 32x64 w4 s3 best of 9 (358 / 311 TFLOP/s whole backward, non-causal / causal);
#   dK/dV d=64:  64x64 w4 s3 best of 9 (293 / 254).
#   dQ d=128: 128x64 w8 s3 best of 8 (364 / 326); dQ d=64: 64x32 w4 s3 best of 8 (287 / 269).
# Re-measured on the current kernels (H200, bf16, 2026-11-22, A/B in one run, scratch sweep of 7 tiles
# over batch x seqlen = 32 x 512 .. 1 x 32768, fwd TFLOP/s; the first sweep had put 256x64 w8 s3 ahead
# of 128x128 w8 s3 for d=128, 506 vs 483, and 64x64 w4 s3 causal at 425):
#   fwd d=128 full: 128x128 w8 s3 beats 256x64 w8 s3 at every length: 328 / 423 / 472 / 498 / 499 /
#     501 vs 319 / 392 / 430 / 457 / 456 / 473 at 512 / 1k / 2k / 4k / 8k / 16k keys.
#   fwd d=128 causal: 64x64 w4 s3 leads below 8192 keys (425 vs 409 at 4k, 384 vs 348 at 2k, 232 vs
#     198 at 512: a diagonal block wastes half of a tile, and the bigger tile wastes more); from 8192
#     on 128x128 w8 s3 leads (457 vs 421 at 8k, 496 vs 458 at 16k, 519 vs 467 at 32k). A window
#     (1024, 0) at 16k rows stays short: 64x64 0.349 ms, 128x128 0.420.
#   fwd d=64 causal: 128x64 w8 s4 >= s3 at every length (387 / 397 / 416 / 428 vs 373 / 395 / 416 / 420).
#   backward d=128: no other pair of 11 leads at more than one length (within 3%), so it stays (rows of
#   4096+ keys now take a 64x128 dK/dV tile, below).
# d=16/32 reuse the d=64 rows and d=256 the smallest tiles that fit shared memory (not swept).
LONG_KEYS = 8192
_FWD_SM90 = {
    16: (TileConfig(128, 64, 8, 4),) * 4,
    32: (TileConfig(128, 64, 8, 4),) * 4,
    64: (TileConfig(128, 64, 8, 4),) * 4,
    128: (TileConfig(128, 128, 8, 3),) * 2 + (TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)),
    256: (TileConfig(128, 64, 8, 2),) * 4,
}
# Hopper head dim 256 (and 160/192, padded to it), first tuned 2026-11-22 (they had kept the smallest tiles
# that fit, 64x64 w4 s2 forward, 32x64 w8 s1 / 64x32 w8 s1 backward). H200, bf16, 8 heads (10 for
# 192/128), TFLOP/s, old -> new (benchmarks/d256_fwd_tiles.py: 12 forward tiles; d256_bwd_tiles.py: 13 dK/dV
# and 12 dQ tiles, then with --pairs 6 x 5 pairs; results/h200-{fwd,bwd}-d256-sweep*-2026-11-22.json):
#   fwd 4 x 4096 full 315 -> 476, causal 263 -> 385; 1 x 16384 full 281 -> 499, causal 310 -> 491
#   (128x32 w8 s3 next, 439-450); 192/128 full 262 -> 454, causal 215 -> 374 (128x64 w8 s3: its
#   128-wide V tiles leave room for a third stage, which d=256 lacks).
#   bwd 4 x 4096 d=256 full 96 -> 225, causal 95 -> 211 (dK/dV 64x32 w4 s2, dQ 128x64 w8 s1; 64x64 w8 s2
#   dK/dV leads full rows by 2%, trails causal by 10%); 192/128 full 97 -> 216, causal 87 -> 193 with dQ
#   128x64 w8 s2 (200 / 178 with s1).
# Bias tiles pass through shared memory too: d=256 with a bias keeps the old forward tile.
_FWD_SM90_V128 = {256: (TileConfig(128, 64, 8, 3),) * 4}
# Hopper d=128 with softcap: tanh and exp2 share the special-function units, and two resident 64x64
# programs per SM overlap them with the other's matmuls better than one 128x128 program. H200, bf16,
# 16 heads, fwd ms, 128x128 w8 s3 / 64x64 w4 s3: 4 x 4096 full 1.352 / 1.250, causal 0.782 / 0.712;
# 2 x 8192 full 2.626 / 2.782, causal 1.428 / 1.313 (128x64 w8 s3, 128x128 w8 s2, 256x64 w8 s3,
# 64x128 w4 s3 and 128x64 w8 s2 slower everywhere). ALiBi keeps the plain tiles (same sweep: 128x128
# leads but for causal 4 x 4096, where 64x64 leads as for plain).
_FWD_SM90_SOFTCAP = {128: (TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3),
                           TileConfig(64, 64, 4, 3))}
# Hopper d=128 with attn_bias: the bias tile is pipelined through shared memory too, which 128x128 w8 s3
# overflows. Same sweep, full rows, fwd ms: 8 x 2048 / 4 x 4096: 128x64 w8 s3 0.744 / 1.528, 128x128
# w8 s2 0.916 / 1.762, 64x64 w4 s3 0.920 / 1.842, 128x64 w8 s2 1.036 / 1.998, 256x64 w8 s3 1.308 / 2.516.
_FWD_SM90_BIAS = {128: (TileConfig(128, 64, 8, 3),) * 4, 256: (TileConfig(64, 64, 4, 2),) * 4}
_BWD_SM90 = {
    16: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    32: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    64: _bwd(64, 64, 4, 3, 64, 32, 4, 3),
    128: _bwd(32, 64, 4, 3, 128, 64, 8, 3),
    256: _bwd(64, 32, 4, 2, 128, 64, 8, 1),
}
_BWD_SM90_V128 = {256: _bwd(64, 32, 4, 2, 128, 64, 8, 2)}
# Hopper d=128, rows of at least LONG_BWD_KEYS keys: a dK/dV program owns 128 keys (a warpgroup each 64)
# and walks 64 queries a step, so each Q and dO tile loaded serves twice the keys. It spilled (38-192 B)
# until the dK/dV loop stopped carrying pointer tiles (2026-11-22). H200, bf16, whole backward TFLOP/s,
# 32x64 w4 s3 -> 64x128 w8 s3, two rounds (python benchmarks/bwd_dkdv_tiles.py,
# results/h200-bwd-dkdv-tiles-2026-11-22.json; Flex in brackets): 1 x 16384 16/16 full 394-396 -> 408-414
# (416), causal 392-405 -> 405-411 (388); 32/8 full 386-393 -> 419-421 (416), causal 382-387 -> 405-406
# (389); 2 x 8192 32/8 causal 345-363 -> 362-372 (366); 4 x 4096 16/16 ties (392-399, Flex 399); few KV
# heads (split key blocks) tie or gain. Shorter rows and narrow windows keep 32x64: 16 x 512 32/8 causal
# 176 -> 163, 4 x 1024 206 -> 195, window (1024, 0) at 1 x 16384 301 -> 284-287, at 4 x 4096 32/8 288-297
# -> 269-271; 1 x 2048 ties. ALiBi keeps 32x64: on 64x128 its full rows took 1.26-1.28x plain's time
# (4 x 4096, 2 x 8192; results/h200-variants-window-mods-2026-11-22-wide.json), while softcap stayed at
# 1.12-1.13x. A bias tile or dropout's counters keep 32x64 too (not measured).
LONG_BWD_KEYS = 4096
_BWD_SM90_LONG = {128: _bwd(64, 128, 8, 3, 128, 64, 8, 3)}
_BWD_SHORT_TILE_FEATURES = frozenset({"alibi", "bias", "dropout"})
# Hopper d=128, 16-bit: the Gluon dK/dV kernel (kernels/bwd_sm90.py), 64 keys a program walking 64 queries a
# step, Q and dO double-buffered (98 KB, 248 registers: two programs an SM). The dK/dV kernel's own time
# against the Triton tiles above (H200, bf16, profiler; python benchmarks/bwd_dkdv_gluon.py at 57e9840,
# results/h200-bwd-dkdv-gluon-2026-11-23.json), us: 4 x 4096 16/16 full 1974 -> 1673, causal 1162 -> 902;
# 2 x 8192 causal 2267 -> 1690; 1 x 16384 causal 4196 -> 3419; 16 x 1024 full 558 -> 495; 32/8 4 x 4096 causal
# 2417 -> 1821; window (1024, 0) at 1 x 16384 616 -> 500; softcap 50 full 4 x 4096 2226 -> 1971. ALiBi stays on
# the Triton kernel (it spills here: causal 2 x 8192 2248 -> 3049). The whole backward gains 0-3% in steady
# state: it runs at the H200's 700 W power cap, the SM clock down from 1980 to 1710-1770 MHz with either kernel
# (benchmarks/bwd_power.py, results/h200-bwd-power-2026-11-23.json: 3390-3404 against 3397-3400 us a call).
# Three Q/dO slots would leave one program an SM (131 KB). Packed sequences take it too (2026-11-23): on the
# Triton kernel their backward had fallen to 1.13-1.14x the padded batch's (which runs this one), on it 1.02-1.04x
# (paired; results/h200-variants-varlen-2026-11-23-gluon-dkdv.json). Not with dropout, a bias, other head dims,
# or split key blocks (configs.bwd_kv_plan).
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
    if dtype == torch.float32:
        return _FWD_FP32
    padded = padded_head_dim(head_dim)
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


# Hopper d=128, 16-bit: the Gluon kernel (kernels/fwd_sm90.py, async wgmma with the softmax overlapping
# the PV matmul, TMA key/value ring) where it leads the Triton kernel. Its 64x128 tile (Q in shared
# memory, one key slot: gluon_ring) leads on every full or causal row, ALiBi too; the 64x64 tile on sliding
# windows of fewer than GLUON_WIDE_WINDOW_KEYS keys (a window's edge blocks waste less of it), and on
# softcap with ALiBi. Long full rows with softcap take the Triton kernel unless the row max is held fixed
# (bf16, softcap <= 51.9: then Gluon 64x128 leads, 2 x 8192 2.26 vs 2.47 ms, 1 x 16384 4.52 vs 4.89 ms,
# scratch A/B 2026-11-22, in results/h200-softcap-fixed-max-2026-11-22.json). H200, bf16, 16 heads, fwd
# TFLOP/s best of 3 interleaved rounds, Triton table tile / Gluon 64x64 / Gluon 64x128, same run (2026-11-22,
# benchmarks/gluon_tiles.py -> results/h200-gluon-tiles-2026-11-22.json, and an earlier run that
# agreed; 4 x 4096 / 2 x 8192 / 1 x 16384):
#   full:    510 / 495 / 589,  503 / 512 / 540,  510 / 509 / 555;  GQA 32/8 4 x 4096: 490 / 501 / 531
#   causal:  425 / 461 / 528,  471 / 480 / 506,  499 / 480 / 542;  GQA 32/8 4 x 4096: 454 / 455 / 488
#   sink:    full 494 / 510 / 534 .. 514 / 507 / 550; causal 432 / 463 / 498 .. 524 / 488 / 541
#   softcap full:   399 / 410 / 433,  440 / 417 / 422,  440 / 416 / 437  (long full rows: Triton)
#   softcap causal: 391 / 409 / 395,  382 / 400 / 414,  397 / 414 / 427
#   With the scale folded into Q (2026-11-23, gluon_tiles.py softcap -> results/h200-gluon-tiles-softcap-
#   2026-11-23.json), long full rows with a running max still tie: fp16 425 / 414 / 415 (2 x 8192), 425 / 412 /
#   427 (1 x 16384); softcap 60 439 / 429 / 429, 443 / 427 / 444; with a sink 436 / 437 / 428, 442 / 437 / 443.
#   Softcap windows tie too: (2048, 0) 370 / 471 / 477, (4096, 0) 371 / 464 / 453, (8192, 0) 378 / 481 / 472.
#   ALiBi full 451 / 458 .. 467 / 469; causal 381 / 427 .. 461 / 473 (Triton / Gluon 64x64); with
#     64x128 (gluon_tiles.py short): 4 x 4096 full 445 / 457 / 433, causal 377 / 417 / 351. Since the
#     64x128 tile takes blocks on one side of the diagonal as a linear bias (fwd_sm90._alibi_linear_step),
#     ALiBi runs it at (full, causal) 510, 464 / 526, 475 / 534, 503 TFLOP/s against 476, 469 / 465, 444 /
#     472, 466 on 64x64 (4 x 4096 / 2 x 8192 / 1 x 16384, 16 heads, slopes 2**(-8h/16)): 1.03-1.08x the
#     plain time, 4 x 4096 causal 1.09-1.16x (results/h200-alibi-linear-2026-11-22.json, one scratch run).
#   window (1024, 0) 1 x 16384: 398 / 447 / 447; 2 x 8192: 356 / 415 / 405; (2048, 0) 4 x 4096:
#   495 / 572 / 580; with softcap 1 x 16384: 355 / 379 / 380.
#   Shorter rows (short): full 32 x 512 339 / 387 / 410 .. 8 x 2048 444 / 495 / 493; causal
#   215 / 253 / 237 .. 340 / 410 / 403 (those calls are host-bound through the API: GLUON_MIN_PAIRS).
# Earlier A/B of the 64x64 tile alone (three runs): window (1024, 0) 1 x 16384 355-357 vs 315-323 us;
# causal 4 x 4096 653-675 vs 557-644; softcap 4 x 4096 full 1384-1400 vs 1302-1353.
_FWD_SM90_GLUON = TileConfig(64, 64, 4, 2, kernel="gluon")
_FWD_SM90_GLUON_WIDE = TileConfig(64, 128, 4, 2, kernel="gluon")
# The 64x64 tile slimmed to three programs an SM (gluon_ring): Q in shared memory, one key slot and two
# value slots, 161 registers and 66 KB (the plain 64x64 plan takes 195 and 82 KB: two programs). Short
# programs spend much of their time filling and draining their pipeline; a third program on the SM keeps
# the tensor cores busy meanwhile. H200, bf16, 16 heads, fwd TFLOP/s, median of 5 interleaved rounds, the
# tile table before it / 64x64 / slim (probe: results/h200-gluon-slim-probe-2026-11-23.json):
#   causal 32 x 512 238 (64x64) / 238 / 266; 16 x 1024 319 (64x128) / 319 / 354; 8 x 2048 396 (64x128) / 374 /
#   419; 4 x 4096 458 (64x128) / 428 / 451; 2 x 8192 483 / 467 / 483.
#   windows at 1 x 16384, (512, 0) 282 (64x64) / 291 / 325; (1024, 0) 352 / 372 / 404; (2048, 0) 412 / 423 /
#   442; (4096, 0) 491 (64x128) / 466 / 490; (1024, 0) at 2 x 8192 358 / 371 / 407, at 4 x 4096 347 / 362 / 398.
# Re-run with the rule in place (`python benchmarks/gluon_slim.py --rounds 5` -> results/h200-gluon-slim-
# 2026-11-23.json), 64x64 / slim: causal 32 x 512 227 / 258, 16 x 1024 300 / 349, 8 x 2048 366 / 409; windows
# (1024, 0) 352 / 397, 2 x 8192 349 / 397, 32/8 heads at 4 x 4096 368 / 398; the 64x128 tile keeps causal rows
# of 4096+ keys (453 / 453 slim, 488 / 469 at 8192) and windows of 4096+ (478 / 475).
# With softcap or a sink it fits three programs too (159-162 registers) and leads by more, table / 64x64 /
# slim, median of 3 (results/h200-gluon-slim-features-2026-11-23.json): causal softcap 16 x 1024 300 (64x128)
# / 313 / 349, 8 x 2048 372 / 390 / 425; causal sink 322 / 312 / 349, 382 / 377 / 409; softcap windows (1024,
# 0) 361 (64x64) / 380 / 427, (4096, 0) 468 / 468 / 483; sink windows (128, 0) at 64/8 heads 154 / 156 / 178,
# (1024, 0) 365 / 378 / 418. ALiBi takes 182 registers (two programs): it keeps the 64x64 tile. Packed
# causal batches (flash_attn_varlen_func, two-round A/B, ms, 64x128 -> slim; results/h200-varlen-slim-
# 2026-11-23.json): 16 x 2048 0.662-0.664 -> 0.642, 16 lengths of 516..3890 1.062-1.063 -> 1.041-1.042, 64 x 512
# 0.275-0.279 -> 0.256-0.259, 32 lengths of 64..1023 0.187-0.188 -> 0.175.
# So causal rows under GLUON_SLIM_CAUSAL_KEYS keys and windows under GLUON_WIDE_WINDOW_KEYS keys (softcap
# windows of any width) take it, plain or with GLUON_SLIM_FEATURES.
_FWD_SM90_GLUON_SLIM = TileConfig(64, 64, 4, 2, kernel="gluon-slim")
GLUON_SLIM_CAUSAL_KEYS = 4096
GLUON_SLIM_FEATURES = frozenset({"window", "softcap", "sink", "varlen"})
# Long rows at head dim 128 (16-bit; plain, softcap, ALiBi or a sink, not softcap with ALiBi; no window, packed
# sequences or cache) take the warp-specialized forward (kernels/fwd_sm90_ws.py): CTAs of 128 query rows, two consumer
# warpgroups of 64 and a TMA producer warp, a ring of two 128-key slots (``BLOCK_M``: one consumer's rows).
# H200, bf16, 16 heads, fwd TFLOP/s, median of 3 interleaved rounds, 64x128 tile / warp-specialized persistent
# / a CTA per tile / cuDNN (`python benchmarks/gluon_ws.py` -> results/h200-gluon-ws-2026-11-23.json):
#   full 32 x 512 393 / 382 / 308 / 517; 16 x 1024 449 / 458 / 411 / 576; 8 x 2048 506 / 517 / 491 / 594;
#   4 x 4096 521 / 527 / 549 / 592; 2 x 8192 544 / 577 / 569 / 605; 1 x 16384 539 / 594 / 580 / 608;
#   32/8 heads 4 x 4096 534 / 572 / 558 / 596; with a sink 4 x 4096 529 / 562 / 552.
#   causal 8 x 2048 411 / 373 / 398 / 485; 4 x 4096 472 / 457 / 472 / 510; 2 x 8192 491 / 507 / 531 / 533;
#   1 x 16384 542 / 423 / 575 / 552; 32/8 heads 4 x 4096 484 / 491 / 494 / 522, 1 x 16384 537 / 578 / 578 / 570;
#   with a sink 2 x 8192 514 / 520 / 531.
#   The mods shapes (`python benchmarks/gluon_ws.py mods` -> results/h200-gluon-ws-mods-2026-11-23.json): plain full
#   4 x 4096 544 / 570 / 558 / 599; softcap 50 full 4 x 4096 489 / 561 / 546, 2 x 8192 507 / 575 / 564; causal
#   2 x 8192 453 / 505 / 533; ALiBi full 508 / 509 / 501, 523 / 522 / 519 (its linear bias spills about 50
#   instructions' worth at 240 registers a thread: a tie), causal 2 x 8192 454 / 466 / 479.
# So full rows of GLUON_WS_FULL_KEYS keys and more take it persistent (rows cost alike; the next tile's Q
# loads under this one), causal rows of GLUON_WS_CAUSAL_KEYS and more a CTA per tile (ws_ctas). Full rows of
# 2048 keys would gain 1-2%, within the spread, and packed sequences (which keep the 64x128 tile) would then
# trail the dense batch by 12% at 16 x 2048 (the variants suite's varlen_equal bar is 10%): they stay on it.
# Tiles ordered heads first (every head's longest rows at once; a switch measured in the first run,
# results/h200-gluon-ws-orders-2026-11-23.json) lost 2-14%: the CTAs running at once share fewer keys in L2.
_FWD_SM90_GLUON_WS = TileConfig(64, 128, 4, 2, kernel="gluon-ws")
GLUON_WS_FULL_KEYS = 4096
GLUON_WS_CAUSAL_KEYS = 8192
GLUON_WS_FEATURES = frozenset({"sink", "softcap", "alibi"})


def ws_ctas(causal: bool, tiles: int, sms: int) -> int:
    """The warp-specialized forward's grid. Full rows cost alike: one CTA an SM walks them round robin.
    Causal rows differ in length, and round robin leaves SMs idle at the end (1 x 16384: 423 TFLOP/s against
    575): a CTA per tile, launched longest first, lets the hardware hand the next tile to the first SM free."""
    return tiles if causal else min(tiles, sms)


# Head dim 256: 64x64 with one key and one value slot (see gluon_ring). TFLOP/s against the Triton
# kernel's 128x64 tile and cuDNN (H200, bf16, 8 heads, interleaved rounds; `python
# benchmarks/gluon_head_dims.py` -> results/h200-gluon-head-dims-2026-11-22.json): 2 x 8192 full
# 626 / 502 / 726, causal 580 / 449 / 612; 8 x 2048 full 577 / 449 / 652, causal 462 / 350 / 500; window
# (4096, 0) 561 / 474; softcap 672 / 458. Two slots each (one program an SM): 399-563; Q in registers
# spills (255 registers + 20 B): 250-296. Not taken: d=64 gains at most 6% (64x128: 418 vs 394 at 1 x 16384
# causal) and loses on 8 x 2048.
_FWD_SM90_GLUON_D256 = TileConfig(64, 64, 4, 1, kernel="gluon")
# Head dims 192/128 (q and k 192 wide, read as 128 + 64 columns: the kernel's TAIL) take the 64x64 tile,
# Q in registers, two slots each (209 registers). TFLOP/s against the Triton kernel and cuDNN, 10 heads,
# same script and run (`python benchmarks/gluon_head_dims.py 192`): 2 x 8192 full 614 / 424 / 599, causal
# 560 / 388 / 528; 8 x 2048 full 542 / 407 / 559, causal 438 / 328 / 451. Read through one 256-wide box
# instead (zeros past 192), the best plan ties the Triton kernel (409-444).


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


# Host time: repeated calls replay their launches (flashtile.replay, TMA descriptors made again on the new
# tensors), and a replayed Gluon call costs the host 5-18 us more than a replayed Triton one: 39-43 / 24-38 us
# a no-grad forward, 255-265 / 230-248 us a training step (fwd + bwd), against 104 / 76-83 and 630-813 /
# 600-649 unreplayed (H200 host, 1 x 128 tokens, 32/8 heads, causal; three runs). Kernel time on short calls,
# Gluon against the Triton table tile, through the API, replayed, two rounds (`python
# benchmarks/gluon_short.py` -> results/h200-gluon-short-2026-11-23.json), fwd TFLOP/s: 32 x 512 16/16 full
# 323-337 -> 385-398, causal 227-232 -> 241-247; 16 x 1024 16/16 full 400-415 -> 432-458, causal 288-294 ->
# 314-338; 8 x 2048 16/16 causal 357-363 -> 391-402; 4 x 4096 16/16 causal 395-398 -> 472-479; 8 x 512 32/8
# causal 225-226 -> 234; 1 x 1024 32/8 causal 196-221 -> 226-234. The Gluon kernel leads or ties everywhere,
# so it takes every call of at least GLUON_MIN_PAIRS (query row, key) pairs over all heads, about 0.05 ms of
# work (1 x 1024 causal at 32 heads is half of it): below that a call is bound by the host, where the Gluon
# launch's extra microseconds count for more than its kernel's gain. (Until replays took TMA descriptors the
# floor was 8x higher, 16 x 1024 full rows at 16 heads: an unreplayed Gluon call cost 20-30 us more.)
GLUON_MIN_PAIRS = 32 * 1024 * 1024
# Head dims (q/k, v) the Gluon kernel takes; a pair's work grows with the head dims, so the threshold
# above counts pairs of d=128 (a call at d=256 needs half as many). At d=64 it takes short causal rows alone
# (below); KV-cache calls take it at the first three.
GLUON_KV_HEAD_DIMS = ((128, 128), (256, 256), (192, 128))
GLUON_HEAD_DIMS = GLUON_KV_HEAD_DIMS + ((64, 64),)
# Causal rows of fewer than GLUON_SHORT_CAUSAL_KEYS keys take the 64x64 tile (its slim plan unless they have
# ALiBi, as every causal row under GLUON_SLIM_CAUSAL_KEYS keys does: above): a program walks a few key
# blocks, and its diagonal block wastes half of a 64-key block instead of half of a 128-key one. H200, bf16,
# Gluon 64x64 / 64x128, fwd TFLOP/s, two rounds (`python benchmarks/gluon_causal_short.py` ->
# results/h200-gluon-causal-short-2026-11-23.json; a scratch run before it agreed): d=128 causal 32 x 512
# 16/16 254-255 / 242-243, 32/8 268-271 / 253-262; 16 x 1024 339 / 331-335 and 305-336 / 325-339 (level:
# the wide tile keeps it); 8 x 2048 395-404 / 415-416. At d=64 the Triton kernel (128x64 w8 s4) leads the
# Gluon kernel on full rows and ties it on causal rows of 2048+ keys, but trails it on short causal ones:
# 32 x 512 32/32 causal Triton 200 against Gluon 64x64 219-222, 16 x 1024 267-273 against 277-279 (full
# rows at 512: 325-327 against 310-319); so plain causal rows under GLUON_SHORT_CAUSAL_KEYS keys at d=64 take
# the Gluon 64x64 tile, and nothing else at d=64 does.
GLUON_SHORT_CAUSAL_KEYS = 1024
# Sliding windows: a row of fewer keys wastes more of the 64x128 tile at the window's two edges, so it
# takes 64x64 ((1024, 0): 404 vs 384 TFLOP/s at 1 x 16384, 385 vs 379 at 2 x 8192, though 32/8 heads led
# on 64x128, 439 vs 408, in this run and the one before). From 4096 keys the wide tile leads: (4096, 0)
# 473 vs 458 at 1 x 16384, 485 vs 458 at 2 x 8192, with a sink 485 vs 458, ALiBi 451 vs 436; (8192, 0)
# 517 vs 486. (2048, 0) ties (447 / 442, 418 / 422); softcap windows keep 64x64 (4096: 448 vs 455).
# H200, bf16, 16 heads, best of 3 interleaved rounds, `python benchmarks/gluon_tiles.py window` ->
# results/h200-gluon-tiles-window-2026-11-22.json.
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
    if head_dim == 64:
        return _FWD_SM90_GLUON if short_causal and not features else None
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
    ws_keys = GLUON_WS_FULL_KEYS if window_right < 0 else GLUON_WS_CAUSAL_KEYS
    if (warp_specialized and head_dim_v == 128 and features <= GLUON_WS_FEATURES and window_left < 0
            and seqlen_k >= ws_keys and not {"softcap", "alibi"} <= features):
        return _FWD_SM90_GLUON_WS
    if {"softcap", "alibi"} <= features:
        # The wide tile's linear ALiBi takes the raw scores, not the capped ones; exact there, it spills.
        return _FWD_SM90_GLUON
    return _FWD_SM90_GLUON_WIDE


# KV-cache calls (flash_attn_with_kvcache) with many query rows -- chunked prefill -- on a contiguous cache
# take the Gluon forward too, from GLUON_KV_MIN_PAIRS (row, key) pairs, each row counted as seeing the whole
# capacity (a chunk's rows see the cache before it; the lengths are on the device). The KV-cache kernel packs
# the query heads of one KV head into its rows, which wins for the few rows of a decode step; below
# GLUON_KV_MIN_QUERIES rows or that work, calls are bound by the host and the two tie or the KV-cache kernel
# leads. H200, bf16, 32/8 heads, d=128, causal, eager calls, ms (Gluon / KV-cache kernel; `python
# benchmarks/kv_prefill.py` -> results/h200-kv-prefill-2026-11-22-ea42afd.json): 4 x (8192 + 2048 new) 2.28 / 3.28,
# 1 x (30000 + 2048) 1.86 / 2.64, 8 x (2048 + 1024) 0.82 / 0.99, 4 x (8192 + 256) 0.43 / 0.48, 4 x (8192 + 128)
# 0.32 / 0.32, 1 x (8192 + 128) 0.46 / 0.39, 16 x (2048 + 128) 0.41 / 0.36, 4 x (8192 + 64) 0.30 / 0.26.
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


# Softcap bounds every score to [-C, C], C = softcap * log2(e) (scores in log2 units), so the Gluon
# forward can hold every row's max at one value m chosen up front: no running max, no rescaling of O
# (its softmax then takes fewer instructions than a plain one's). exp2(s - m) must stay inside float32's
# and bfloat16's normal range (2**-126 up): with m = min(C, 102 - C) a row whose scores all sit at -C
# still has its largest term at 2**-102 or more, 24 bits above the flush to zero, so what it drops is
# below float32's rounding of the sum. The largest term is then 2**(C - m): 1 up to C = 51, 2**(2C - 102)
# above, and SOFTCAP_FIXED_MAX keeps that at 2**48 or less, far from float32's 2**128 in l and O.
# float16's P (up to 65504) has too narrow a range for it; ALiBi and sink logits are not bounded by the
# cap. Accuracy: the largest term is rounded to bf16 like the others (a running max keeps it at exactly
# 1), max |error| vs float32 on random inputs 0.016 against 0.008 (PyTorch bf16: 0.12; H200 scratch run,
# 2026-11-22). Speed, fwd ms, fixed / running max at softcap 50: 4 x 4096 full 1.166 / 1.266, causal 0.657
# / 0.704; 2 x 8192 causal 1.192 / 1.332; 1 x 16384 causal 2.240 / 2.538.
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


# The dK/dV kernel runs one program per (key block, KV head, sequence), each walking every query row of
# its GQA group that sees the block. Few KV heads (GQA, tensor-parallel shards) or short batches leave
# SMs idle. Below BWD_KV_PROGRAMS_PER_SM programs an SM each key block's query rows are split into parts
# of at least BWD_KV_MIN_ROWS_PER_SPLIT rows, for about that many programs an SM, with float32 partial
# sums added up after the kernel (bwd_sum_parts), and the dQ kernel runs alongside on a second stream.
# Both cost the host more per call (the fork and join; two partial buffers and their sums), so they take
# backwards of at least BWD_SPLIT_MIN_PAIRS (query row, key) pairs over all heads. The floor was 64 Mi
# while every backward cost the host ~0.5 ms on the H200 host (1 x 4096 with 4/1 heads, causal, then ran
# 0.68x split through the API though its kernels took less GPU time). A repeated backward is now replayed
# (flashtile/replay.py, the fork included), and that row ran 152-167 TFLOP/s split against 93 unsplit
# (results/h200-bwd-fill-2026-11-22-{replayed,58415a2}.json); 1 x 4096 with 2/1 heads (16 Mi pairs) ran 136
# split against 77 (benchmarks/bwd_split_rule.py, results/h200-bwd-split-rule-2026-11-22.json): the floor is
# 16 Mi. Fewer rows per part (1024 or 512) gained 15-40% on some 2048-token rows but lost 3-10% on full
# (non-causal) rows of 4096-8192 tokens, and single rows moved by 25% between runs: not changed.
# The dQ kernel alongside without parts (from 2 to 4 programs an SM) was tried and not kept: MHA 4 heads
# at 1 x 8192 321 against 299 TFLOP/s split, but 1 x 4096 32/8 heads 274 against 300 and 1 x 2048 32/8
# 162 against 193 unchanged (results/h200-bwd-fill-dq-alongside-only-2026-11-22.json).
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
        return _BWD_SM90_V128[padded]
    if row_keys >= LONG_BWD_KEYS and padded in _BWD_SM90_LONG and not _BWD_SHORT_TILE_FEATURES & features:
        return _BWD_SM90_LONG[padded]
    return _BWD_SM90[padded]


# Attention over a KV cache (kernels/decode.py), per padded head dim: (up to 16 packed rows, up to
# DECODE_PREFILL_ROWS, more). Packed rows are query tokens x the query heads of one KV head: a
# decode step with GQA group 4 fills 4 rows of a 16-row tile, the smallest tl.dot takes. Decode is
# bound by reading K and V once, so the key tile and pipeline depth matter and the query tile does
# not; prefill over a cache takes forward-like tiles. Not measured on a GPU yet: starting points
# that compile for sm_90 / sm_80 without register spills (ptxas -v, triton 3.6, 2026-11-22):
#   sm_90 bf16 d=128 16x64 w4 s3: 112 regs (paged: 168), K/V cp.async double-buffered (paged:
#   single-buffered, the block-table read takes a pipeline stage); 16x128 w4 s3: 168 regs, 136 KB smem.
#   fp32 (FMA dot): 16x32 w4 spills 660 B at d=128, 16x64 w8 does not (62 regs); d=256 needs 16x32 w8.
#   bf16 d=256 32 rows: 32x64 w4 spills, 32x32 w4 does not; prefill d=256 64x32 w8: wgmma, 193 regs.
# Measured on the H200 (bf16, 32/8 heads, d=128, CUDA-graph replay, scratch sweep 2026-11-21), decode
# rows: batch 16 x 8192 keys 16x128 w4 s3 123.6 us = 1.02x the 4.27 TB/s copy bandwidth (16x64 w4 s3
# 129.5 with 2 splits, 16x256 w8 s2 131.4, 16x32 w4 s4 129.4); pages of 256 take the same tiles (125.4 us).
DECODE_SM90 = {
    16: (TileConfig(16, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    32: (TileConfig(16, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    64: (TileConfig(16, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    128: (TileConfig(16, 128, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    256: (TileConfig(16, 64, 4, 2), TileConfig(32, 32, 4, 2), TileConfig(64, 32, 8, 2)),
}
# Decode from pages smaller than a key block: each key row is looked up on its own page, and the
# table read for the next block must land before its K/V loads go out, so the pipeline runs one
# block ahead; more resident programs per SM make up the bytes in flight. Measured on the H200
# (bf16, 32/8 heads, d=128, page 16, CUDA graph, scratch sweep 2026-11-21 over 16 x {16, 32, 64, 128}
# keys, w4/w8, s1-s4, 1-8x the programs), time over the contiguous cache's:
#   16x32 w4 s3, 4 programs per SM: batch 16 x 8192 1.08, x 32768 1.055; batch 1 x 131072 1.07, x 32768 1.17
#   16x64 w4 s3 (2 per SM): 1.12 / 1.08 / 1.10 / 1.19; 16x16 pages read whole (one table read a block)
#   w4 s4: 1.30-1.32; next-block K/V held in registers instead of the pipeline: 1.30-1.32.
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

# Split-KV (flash-decoding): with few (batch x KV head x row block) programs the GPU's SMs idle, so
# each sequence's keys are cut into num_splits shares whose partial results a second kernel merges.
# Auto picks, from shapes alone (never from cache_seqlens, so CUDA graphs replay any lengths):
#   splits = DECODE_PROGRAMS_PER_SM * SMs // programs, at most the key blocks of the capacity
#   and DECODE_MAX_SPLITS, at least 1.
# Rounding down keeps every program resident in one wave (no tail). Measured on the H200 (bf16, d=128,
# 32/8 heads, CUDA graph, one-load combine kernel): batch 1 x 32768 keys: 8 splits 49.4 us, 12: 39.2,
# 16: 38.2, 24: 46.1, 32: 45.4, 48: 50.2; batch 16 x 8192: 1 split 123.6 us, 2: 133.9; so one program
# per SM (a 16x128 s3 program fills an SM's shared memory). Reading full key blocks through the TMA
# (device-side descriptors) instead of cp.async measured 1-2% slower on these shapes.
# Short caches split down to one 128-key block a split: with so few programs the SMs idle anyway. Auto with
# 512 keys a split -> with 128, us (SDPA in the second run): batch 1 x 512 keys 8.85 -> 7.12 (7.57), x 1024
# 11.16 -> 8.30 (6.69), x 2048 11.48 -> 8.63 (7.23), x 4096 12.25 -> 9.96 (9.55); batch 4 x 512 9.30 -> 8.10
# (8.05), x 1024 11.59 -> 9.65 (8.74); from 8192 keys (batch 1) and 2048 (batch 4) the splits are unchanged
# (`python benchmarks/decode_splits.py` -> results/h200-decode-splits-2026-11-22.json, before, and
# h200-decode-splits-after-2026-11-22.json, each with 1-32 splits forced).
DECODE_PROGRAMS_PER_SM = 1
DECODE_MIN_KEYS_PER_SPLIT = 128
DECODE_MAX_SPLITS = 128
# Short caches, from a sweep of key tiles (32/64/128), warps (2/4/8), stages (2-4) and split counts (H200,
# bf16, d=128, 32/8 heads, CUDA graph, combine launched as a programmatic dependent; scratch sweep
# 2026-11-22, us): when splits of 128+ keys cannot give every SM a program, splits of one 64-key block
# double the programs (batch 1 x 1024 keys: 16 splits of 64 keys 5.91, 8 of 128 6.55, SDPA 6.70); and a
# split of one key block gains nothing from a third stage, whose shared memory only costs (1 x 1024, 8 x 128
# keys: 6.55 with two stages, 7.63 with three). With two blocks a split the two depths tie within the
# noise (1 x 4096: 9.22 / 9.62 in the sweep, 10.00 / 9.85 in an A/B). Small pages keep their gather tile.
# A/B in one run: `benchmarks/decode_short.py` (results in BENCHMARKS.md, "Short caches").
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
ONE_PASS_KEYS = 128
ONE_PASS_FEATURES = frozenset({"window", "softcap", "alibi", "sink", "varlen"})


def deterministic(asked: bool) -> bool:
    """Whether a backward must add its sums in a fixed order: the call asked (``deterministic=True``), or
    torch does (``torch.use_deterministic_algorithms(True)``)."""
    return asked or torch.are_deterministic_algorithms_enabled()


def one_pass_bwd(head_dim: int, head_dim_v: int, dtype: torch.dtype, device: torch.device, features: frozenset,
                 window_right: int, batch: int, nheads_kv: int, seqlen_k: int,
                 deterministic: bool) -> bool:
    """Whether a backward takes the one-pass kernel; ``features``: the call's feature names (packed sequences
    are one), ``window_right`` its right bound (0 when causal, -1 none), ``deterministic`` whether its gradients
    must be bit-identical run to run."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _arch(device) == 90
            and head_dim == 128 and head_dim_v == 128 and features <= ONE_PASS_FEATURES
            and not ("alibi" in features and window_right > 0) and not deterministic
            and -(-seqlen_k // ONE_PASS_KEYS) * nheads_kv * batch >= sm_count(device))


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
    if one_pass and one_pass_bwd(head_dim, head_dim_v, dtype, device, features, window[1], batch, nheads_kv, seqlen_k,
                                 deterministic):
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


# Dense calls (flash_attn_func) with few query rows per KV head -- a decode step as transformers makes it,
# one query over the whole cache -- run on the KV-cache kernel as over a full cache of seqlen_k keys: it
# packs the query heads of a KV head into one tile, reads K and V once, and splits long rows over the SMs,
# where the forward kernel runs one program per query head (32 programs for a batch-1 step of 32 heads).
# Packed sequences (flash_attn_varlen_func, a continuous batch's decode step) too, with max_seqlen_q as the
# rows: the kernel reads q through cu_seqlens_q and the packed k as one cache row from cu_seqlens_k[b].
# Not for dropout or bias, which the KV-cache kernel lacks. H200, bf16, 32/8 heads,
# d=128, causal, one query, GPU us by CUDA-graph replay, forward kernel / KV-cache kernel / SDPA (`python
# benchmarks/dense_decode.py` -> results/h200-dense-decode-2026-11-22.json): batch 1 x 512 keys 8.8 / 8.9 /
# 7.5, x 4096 47.3 / 12.2 / 9.3, x 32768 499 / 38.1 / 37.6; 16 x 8192 516 / 124 / 123; 64 x 1024 165 / 72 /
# 66; 4 queries x 8192 129 / 12.8 / 7.4. Short caches (`python benchmarks/dense_decode.py --short` ->
# results/h200-dense-decode-short-2026-11-22.json, after the short-cache tiles): 1 x 128 4.7 / 4.8 / 4.3,
# x 256 6.1 / 4.9 / 6.0, x 1024 14.4 / 6.1 / 6.7; 8 x 256 8.2 / 6.5 / 5.6; 16 x 512 23.8 / 10.0 / 8.4. The
# second launch (the splits' merge) once cost the host more than the kernel saved, which kept short calls on
# the forward kernel; a repeated call is replayed now (flashtile/replay.py), and the KV-cache kernel's host
# time is the same within this host's noise. A call takes it once the forward kernel's programs walk
# DENSE_DECODE_MIN_KEYS keys (waves x keys): from 256 keys it is ahead on every measured shape, at 128 level.
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
                  page_size: int = 0) -> TileConfig:
    """Tiles of the KV-cache attention kernel; ``packed_rows = seqlen_q * (nheads // nheads_kv)``;
    ``page_size``: of a paged cache, 0 for a contiguous one."""
    if device.type != "cuda":
        return _DECODE_INTERPRET
    if dtype == torch.float32:
        table = _DECODE_FP32
    else:
        table = DECODE_SM90 if _arch(device) == 90 else DECODE_SM80
    column = 0 if packed_rows <= 16 else 1 if packed_rows <= DECODE_PREFILL_ROWS else 2
    cfg = table[padded_head_dim(head_dim)][column]
    gather = page_size and page_size % cfg.BLOCK_N != 0
    if gather and table is DECODE_SM90 and column == 0 and padded_head_dim(head_dim) in DECODE_SM90_GATHER:
        return DECODE_SM90_GATHER[padded_head_dim(head_dim)]
    return cfg


def decode_plan(head_dim: int, dtype: torch.dtype, device: torch.device, rows: int, programs: int, capacity: int,
                num_splits: int = 0, page_size: int = 0, config: TileConfig | None = None) -> tuple:
    """``(tiles, splits)`` of the KV-cache kernel: :func:`decode_config`'s tiles and :func:`decode_splits`'s
    count, with the short-cache rules above. ``rows``: packed query rows a (batch row, KV head);
    ``programs``: batch x KV heads (the row blocks are counted here); ``config``: tiles given instead of
    the table's (tuning sweeps), taken as they are."""
    cfg = config or decode_config(head_dim, dtype, device, rows, page_size)
    programs *= -(-rows // cfg.BLOCK_M)
    gather = bool(page_size) and page_size % cfg.BLOCK_N != 0
    splits = decode_splits(num_splits, programs, capacity, device, cfg.BLOCK_N, gather)
    if device.type != "cuda" or config is not None:
        return cfg, splits
    short = DECODE_SHORT_BLOCK_N
    wanted = DECODE_PROGRAMS_PER_SM * sm_count(device) // max(programs, 1)
    if (num_splits == 0 and not gather and cfg.BLOCK_N >= short and splits < wanted
            and (not page_size or page_size % short == 0)):
        cfg = replace(cfg, BLOCK_N=short)
        splits = decode_splits(0, programs, capacity, device, short, min_keys=short)
    if -(-capacity // (splits * cfg.BLOCK_N)) <= 1 and cfg.num_stages > DECODE_SHORT_STAGES:
        cfg = replace(cfg, num_stages=DECODE_SHORT_STAGES)
    return cfg, splits


def decode_splits(num_splits: int, programs: int, capacity: int, device: torch.device, block_n: int,
                  gather: bool = False, min_keys: int = DECODE_MIN_KEYS_PER_SPLIT) -> int:
    """Key splits per sequence: ``num_splits`` when given (clamped to ``[1, DECODE_MAX_SPLITS]`` and to
    the key blocks of the capacity), else the auto rule above. ``programs``: row blocks x batch x KV heads;
    ``gather``: keys are looked up row by row on small pages (twice the programs hide that latency)."""
    blocks = max(1, -(-capacity // block_n))
    if num_splits > 0:
        return max(1, min(num_splits, DECODE_MAX_SPLITS, blocks))
    interpret = device.type != "cuda"
    if interpret:
        min_keys = _INTERPRET_MIN_KEYS_PER_SPLIT
    by_length = max(1, capacity // max(min_keys, block_n))
    per_sm = DECODE_PROGRAMS_PER_SM * (DECODE_GATHER_PROGRAMS if gather else 1)
    wanted = per_sm * sm_count(device) // max(programs, 1)
    return max(1, min(wanted, by_length, DECODE_MAX_SPLITS, blocks))
