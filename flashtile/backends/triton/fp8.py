"""Host side of the FP8 Hopper forward (kernels/fwd_sm90_fp8.py): which calls it takes, its tiles, TMA
descriptors and grid. The API layer quantizes and validates; this launches on what it is given."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import device_errors, replay
from .. import AttnArgs, KVCacheArgs
from ..torch_fp8 import packed_vt_width
from . import configs
from .fastlaunch import CachedLaunch
from .host import bsh_strides, cdiv, lse_strides, on_device
from .launch import _WS_REGS, _fill_tail, _sequence_tensors
from .kernels.common import LOG2E
from .kernels.fwd_sm90_fp8 import attn_fwd_sm90_fp8
from .kernels.fwd_sm90_ws import DESCALE_BLOCK as _DESCALE_BLOCK

# Rows (of q, or keys) that share one per-block descale: a CTA's tile of queries, one or two key blocks.
DESCALE_BLOCK = _DESCALE_BLOCK.value
# What flashtile.fp8.kernel_reason routes here: q_descale and k_descale per block of DESCALE_BLOCK rows and KV
# head, (batch, nheads_kv, cdiv(seqlen, 128)), as the quantizer makes them; v_descale per (batch, KV head) only.
PER_BLOCK_DESCALES = True

# (BLOCK_N, STAGES, TWO_LEVEL) by head dim; every tile is 128 query rows (two consumers of 64). Chosen by the
# sm_90 compile alone (`python benchmarks/sm90_compile.py fwd-fp8[-d64|-d256]`), not yet by a GPU measurement:
# the consumers' 64 x BLOCK_N scores and 64 x d accumulator within 240 registers, and the ring deepened until
# shared memory (one CTA an SM: its registers) is used. TWO_LEVEL (each key block's P V summed into O in float32)
# takes a second 64 x d accumulator: d64 fits it with 128 keys; d128 with 128 keys spills (144 STL a consumer),
# with 64 keys it fits (0 spills, 98 KB); d256 fits neither (128 + 128 registers). The tensor cores add FP8
# products in about 13 mantissa bits: modelled as chopping O each 32-key step, one-level O is off by 0.09% at
# 1k keys, 0.33% at 4k, 1.3% at 16k (two-level 0.013%), against P's own e4m3 rounding of about 2.2%.
# d128 keeps 128 keys one-level (FA3's numerics, the larger tile) until a GPU run weighs it against (64, 4, True).
# d128 128 keys one-level: no loop spills (one 8-byte stack slot outside it), 164 KB; d256 128 keys spills 509
# STL, 64 keys none, 197 KB. With PINGPONG (P made the e4m3 operand before S_j's wgmma, so float32 P and S_j are
# never live together) d256 128 keys keeps 11 STL (6 and 4 a consumer), none in the unmasked loop (596 SASS
# instructions a 128-key block per consumer warp, against 2 x 411 for 64 keys): a tile for the next GPU sweep.
# H200 sweep (2x8192, bf16 inputs quantized, FP8 kernel TFLOP/s full / causal; sweep script in commit
# 4b46fb9, results/h200-fp8-tiles-d64-fwd-2026-11-27-00699c6.json):
#   d    tile (BLOCK_N, STAGES, TWO_LEVEL)                        evidence
#   64   (128, 4, True)        441/384; one-level 428/389, (128, 6, False) 428/389, (64, 4, True) 350/325
#   128  (128, 4, False)       745/651; (128, 3, False) 755/649, (128, 2, False) 750/648, (64, 4, True) 564/511
#   256  (64, 2, False)        916/784; (64, 4, False) 880/779, (64, 3, False) 881/773, (128, 2, False) 441/373
FP8_TILES = {64: (128, 4, True), 128: (128, 4, False), 256: (64, 2, False)}
# By head dim: the two consumers take turns issuing their matmuls (kernels/fwd_sm90_ws.py PINGPONG), so each
# one's softmax runs under the other's wgmmas. SASS of the sm_90 compile, a 128-key block at d128, one consumer
# warp: its wgmmas take ~512 cycles of the SM's tensor cores at the FP8 rate, its softmax ~520 issue cycles and
# 528 of MUFU (66 ex2, 8 cycles a warp each); the H200's ~2570 cycles a block (756 TF/s at 16k, 4664c6d) are
# about their sum: the consumers' softmaxes run side by side while the tensor cores wait. As FlashAttention-3,
# FP8 d >= 128 only: d64's wgmmas take half the MUFU's time, nothing to hide them under. H200, the FP8 bench's 12
# shapes, one round (results/h200-fp8-fwd-2026-11-27-02dd45f.json): turns on / off 0.96-1.06x (d128 16k full 829 /
# 784 TF/s, d256 8k causal 752 / 785), 7 of 12 ahead; the kernel 1.01-1.07x 5d069c2's and 1.07-1.49x bf16.
FP8_PINGPONG = {64: False, 128: True, 256: True}
QUERY_ROWS = 64


class Fp8Tile(NamedTuple):
    """One FP8 kernel tile: ``block_n`` keys a K/V slot, ``stages`` slots, ``two_level`` (O summed in float32 a key
    block at a time), ``pingpong`` (the consumers take turns at the tensor cores), ``consumers`` warpgroups of
    QUERY_ROWS query rows (2 or 3; their registers as the bf16 warp-specialized forward's, launch._WS_REGS)."""
    block_n: int
    stages: int
    two_level: bool
    pingpong: bool
    consumers: int = 2


def fp8_tile(head_dim: int, args: AttnArgs | None = None) -> Fp8Tile:
    """The tile the kernel runs at ``head_dim``: FP8_TILES' and FP8_PINGPONG's rows, two consumers; a call (``args``)
    without a mask, softcap or packed sequences takes FP8_PLAIN_TILES' row where its head dim has one."""
    plain = (args is not None and args.window_left < 0 and args.window_right < 0 and args.softcap == 0
             and not args.varlen)
    if plain and head_dim in FP8_PLAIN_TILES:
        return FP8_PLAIN_TILES[head_dim]
    return Fp8Tile(*FP8_TILES[head_dim], FP8_PINGPONG[head_dim])


# Tiles that may overlap the exponentials with the FP8 products better (Nsight Compute, d128 16k: tensor pipe 44%,
# MUFU 46%, their sum about one), chosen by a GPU A/B (benchmarks/gluon_ws_heads.py --fp8 times each beside
# fp8_tile's; forward_fp8_sm90(tile=...) runs one). sm_90 ptxas (`python benchmarks/sm90_compile.py fwd-fp8[-d64|
# -d256] knob=value`), SASS of an unmasked key block per consumer warp, spills in the key loop:
#   c3    three consumers, 192-row tiles at 160 registers (FA3's FP8 d64 tile is 192 x 160). d64 one-level, four
#         128-key slots: 464 a block, no spills (two consumers' default: 460); two-level spills 22 STL. d128 with
#         64-key slots (turns on): 325 a block (650 a 128 keys against 501), no spills; with 128-key slots 20 STL a
#         block and ptxas waits for each wgmma (S_j no longer under P_{j-1} V): not a candidate.
#   n128  d256 with two 128-key slots, turns on (FA3's FP8 d256 tile, 128 x 128): 580 a 128-key block (2 x 397
#         at 64 keys), 2 scalar STL and LDL in the loop, 197 KB; with per-block K descales (quant.quantize's default,
#         so the A/B's) 3 STL a consumer's full-row loop, 17 and 30 its causal loops (the default d256 tile: 0).
#         d128 with 256-key slots (FA3's is 224) spills 20 STL and serializes its wgmmas: not a candidate.
# H200, bf16 inputs quantized beforehand, FP8 kernel TFLOP/s, default / candidate, 2 interleaved rounds, outputs
# checked first (`python benchmarks/gluon_ws_heads.py --fp8 --dims 128 256 --seqlens 4096 16384`,
# results/h200-gluon-ws-heads-fp8-2026-11-28-aa81f72.json):
#   c3    d128 4x4096 full 725 / 706, causal 559 / 546; 1x16384 full 825 / 788, causal 783 / 726 (0.93-0.98x): off
#   n128  d256 4x4096 full 854 / 940, causal 677 / 273; 1x16384 full 969 / 1064, causal 925 / 952: plain calls
#         (FP8_PLAIN_TILES), where its loops keep their 3 STL; causal ones keep the default tile
FP8_CANDIDATES = {"c3": {64: Fp8Tile(128, 4, False, False, 3), 128: Fp8Tile(64, 4, False, True, 3)},
                  "n128": {256: Fp8Tile(128, 2, False, True)}}
# FP8_PLAIN_TILES: calls with no mask, no softcap and no packed sequences, by head dim (fp8_tile). d256: n128 above,
# 1.10x at 4k and 16k. Softcap (2-5 STL a consumer's loop) and packed sequences (6, 13 with softcap) spill more and
# were not measured: they keep FP8_TILES' row.
FP8_PLAIN_TILES = {256: FP8_CANDIDATES["n128"][256]}




def fp8_sm90_supported(args: AttnArgs, head_dim: int) -> str | None:
    """None when the FP8 Hopper forward takes a call with ``args`` at ``head_dim`` (q, k and v alike), else
    why not (a phrase for a fallback record or an error)."""
    if head_dim not in FP8_TILES:
        return f"head dim {head_dim} (the FP8 kernel takes {', '.join(map(str, sorted(FP8_TILES)))})"
    if isinstance(args, KVCacheArgs):
        return "a KV cache"
    unsupported = [name for name, present in (
        ("seqused_k without packed sequences", args.seqused_k is not None and not args.varlen),
        ("ALiBi", args.alibi_slopes is not None), ("a sink", args.sink is not None),
        ("an attention bias", args.attn_bias is not None), ("dropout", args.dropout_p > 0)) if present]
    if unsupported:
        return (f"{', '.join(unsupported)} (the FP8 kernel takes causal, windows, GQA, softcap and packed sequences "
                "with seqused_k)")
    return None


@functools.lru_cache(maxsize=None)
def _fp8_layout(tile: tuple):
    return gl.NVMMASharedLayout.get_default_for(list(tile), gl.float8e4nv)


def _desc(t: torch.Tensor, tile: tuple) -> TensorDescriptor:
    """A TMA descriptor of 4-d FP8 tensor ``t`` reading ``tile``-shaped boxes (zeros past its end)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(tile), _fp8_layout(tile))


def descriptors(q: torch.Tensor, k: torch.Tensor, v_t: torch.Tensor, head_dim: int, block_n: int) -> dict:
    """The kernel's TMA descriptors: Q in one consumer's rows, K in blocks of ``block_n`` keys, V^T in such key
    blocks of every head-dim row."""
    return dict(q_desc=_desc(q, (1, QUERY_ROWS, 1, head_dim)), k_desc=_desc(k, (1, block_n, 1, head_dim)),
                vt_desc=_desc(v_t, (1, 1, head_dim, block_n)))


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"internal: {name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")


def _check_tma(name: str, t: torch.Tensor) -> None:
    """The TMA reads ``t`` only from a 16-byte aligned start with 16-byte aligned strides and a unit last one."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        raise ValueError(f"internal: {name} needs a 16-byte aligned start and strides and unit stride on its last "
                         f"dim for the TMA, got strides {t.stride()} at {t.data_ptr() % 16} bytes past alignment")


def _score_scale(args: AttnArgs) -> tuple:
    """``(qk_scale, softcap2)``: the scores are ``softcap2 * tanh(q.k * qk_scale)`` with softcap (log2 units),
    else ``q.k * qk_scale``; the kernel multiplies ``qk_scale`` by the tile's Q and K descales."""
    if args.softcap > 0:
        return args.softmax_scale / args.softcap, args.softcap * LOG2E.value
    return args.softmax_scale * LOG2E.value, 0.0


_FWD_FP8 = CachedLaunch(attn_fwd_sm90_fp8, ("q_desc", "k_desc", "vt_desc", "O", "LSE", "Q_DESCALE", "K_DESCALE",
                                            "V_DESCALE", "qk_scale", "softcap2", "CU_SEQLENS_Q", "CU_SEQLENS_K",
                                            "SEQUSED_K", "ERR"))


def _sizes(q, k, args: AttnArgs) -> tuple:
    """``(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)``; packed sequences: their number and the longest
    lengths."""
    if args.varlen:
        return (args.cu_seqlens_q.shape[0] - 1, args.max_seqlen_q, args.max_seqlen_k, q.shape[1], k.shape[1],
                q.shape[2])
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def forward_fp8_sm90(q, k, v_t, q_descale, k_descale, v_descale, out, lse, args: AttnArgs,
                     tile: Fp8Tile | None = None) -> None:
    """FP8 attention forward on Hopper into ``out`` and ``lse``.

    q: float8_e4m3fn (batch, seqlen_q, nheads, d); k: float8_e4m3fn (batch, seqlen_k, nheads_kv, d);
    v_t: float8_e4m3fn (batch, nheads_kv, d, seqlen_k), V transposed so the keys are contiguous (FP8 wgmma
    reads its shared-memory operands K-major only, and P V reduces over the keys); its seqlen_k stride must be
    1 and its other strides multiples of 16 bytes (pad seqlen_k's allocation to a multiple of 16).
    q_descale, k_descale, v_descale: float32 (batch, nheads_kv), any strides (broadcast ones included): the
    dequantized inputs are ``q * q_descale[b, h // group]`` and so on. q_descale and k_descale may instead be
    per block of ``DESCALE_BLOCK`` (128) rows, (batch, nheads_kv, cdiv(seqlen, 128)): row i of q takes
    ``q_descale[b, h // group, i // 128]``, key j ``k_descale[b, h // group, j // 128]``.
    out: bf16 (batch, seqlen_q, nheads, d), written; lse: float32 (batch, nheads, seqlen_q), written with the
    natural-log sum of each row's exponentials of ``softmax_scale * q.k`` (after softcap), -inf where a row
    sees no key (its output is 0), as the bf16 forward stores it.
    Packed sequences (``args.varlen``): q (total_q, nheads, d), k (total_k, nheads_kv, d), v_t (nheads_kv, d,
    torch_fp8.packed_vt_width(total_k, batch)) with each sequence's keys from a 16-byte-aligned column
    (torch_fp8.pack_v_t: the TMA reads V^T's key dim at no other coordinate), out (total_q, nheads, d), lse
    (nheads, total_q); ``batch`` is the number of sequences, ``seqlen_q``/``seqlen_k`` ``args.max_seqlen_q``/``_k``,
    descale blocks count from each sequence's start, and ``args.seqused_k`` may cut each sequence's keys. Rows
    past ``cu_seqlens_q[-1]`` are written as 0 (lse -inf); any offsets keep every read and write inside the
    tensors, bad ones noted in the device error record.
    ``args``: causal/window, softcap and softmax_scale are read; ``fp8_sm90_supported(args, d)`` must be None.
    d = 64, 128 or 256 (FP8_TILES). ``tile``: the call's (:func:`fp8_tile`) unless given (an A/B of
    FP8_CANDIDATES' rows)."""
    varlen = args.varlen
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = _sizes(q, k, args)
    reason = fp8_sm90_supported(args, head_dim)
    if reason is not None:
        raise ValueError(f"internal: the FP8 Hopper forward does not take {reason}")
    if nheads % nheads_kv:
        raise ValueError(f"internal: nheads={nheads} is not a multiple of nheads_kv={nheads_kv}")
    fp8 = torch.float8_e4m3fn
    # The leading dims: (tokens, ) packed, (batch, seqlen) dense.
    rows_q, rows_k = ((q.shape[0], ), (k.shape[0], )) if varlen else ((batch, seqlen_q), (batch, seqlen_k))
    _check("q", q, (*rows_q, nheads, head_dim), fp8)
    _check("k", k, (*rows_k, nheads_kv, head_dim), fp8)
    columns_v = packed_vt_width(k.shape[0], batch) if varlen else seqlen_k
    _check("v_t", v_t, (*rows_k[:-1], nheads_kv, head_dim, columns_v), fp8)
    for name, scale, rows in (("q_descale", q_descale, seqlen_q), ("k_descale", k_descale, seqlen_k),
                              ("v_descale", v_descale, None)):
        # validation.check_descales: at least one block, even without rows.
        blocks = (max(1, cdiv(rows, DESCALE_BLOCK)), ) if rows is not None and scale.dim() == 3 else ()
        _check(name, scale, (batch, nheads_kv, *blocks), torch.float32)
    _check("out", out, (*rows_q, nheads, head_dim), torch.bfloat16)
    _check("lse", lse, (nheads, rows_q[0]) if varlen else (batch, nheads, seqlen_q), torch.float32)
    if varlen:
        # Rows past the last sequence belong to none: their output is 0 and their lse -inf.
        _fill_tail(out, args.cu_seqlens_q, 0.0, lse)
    if batch == 0 or seqlen_q == 0 or nheads == 0 or q.numel() == 0:
        return
    if k.numel() == 0:
        # No keys (a TMA descriptor needs a positive extent): every row sees none.
        replay.not_replayable("an output without keys is filled")
        out.zero_(), lse.fill_(float("-inf"))
        return
    if varlen:
        # Packed tensors are one batch row of the TMA's 4-d views.
        q, k, v_t = q.unsqueeze(0), k.unsqueeze(0), v_t.unsqueeze(0)
    for name, t in (("q", q), ("k", k), ("v_t", v_t)):
        _check_tma(name, t)
    if out.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError(f"internal: out and lse need unit stride on their last dim, got {out.stride()} and "
                         f"{lse.stride()}")
    tile = fp8_tile(head_dim, args) if tile is None else tile
    if tile.consumers not in _WS_REGS:
        raise ValueError(f"tile: consumers must be one of {sorted(_WS_REGS)}, got {tile}")
    consumer_regs, maxnreg = _WS_REGS[tile.consumers]
    causal = args.window_right >= 0
    tiles = cdiv(seqlen_q, tile.consumers * QUERY_ROWS) * nheads * batch
    # Packed sequences: a CTA per tile, as for causal rows; the tiles past a short sequence's rows end at once.
    ctas = configs.ws_ctas(causal or varlen, tiles, configs.sm_count(q.device))
    qk_scale, softcap2 = _score_scale(args)

    def static():
        stride_ob, stride_om, stride_oh = bsh_strides(out, varlen)
        stride_lse_b, stride_lse_h = lse_strides(lse, varlen)
        return dict(stride_qds_b=q_descale.stride(0), stride_qds_h=q_descale.stride(1),
                    stride_qds_m=q_descale.stride(2) if q_descale.dim() == 3 else 0,
                    stride_kds_b=k_descale.stride(0), stride_kds_h=k_descale.stride(1),
                    stride_kds_n=k_descale.stride(2) if k_descale.dim() == 3 else 0,
                    stride_vds_b=v_descale.stride(0), stride_vds_h=v_descale.stride(1),
                    window_left=args.window_left, window_right=args.window_right, stride_ob=stride_ob,
                    stride_om=stride_om, stride_oh=stride_oh, stride_lse_b=stride_lse_b,
                    stride_lse_h=stride_lse_h, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=nheads // nheads_kv,
                    nheads=nheads, num_tiles=tiles, MASK_LEFT=args.window_left >= 0, MASK_RIGHT=causal,
                    SOFTCAP=args.softcap > 0, K_BLOCKS=k_descale.dim() == 3, TWO_LEVEL=tile.two_level,
                    STAGES=tile.stages, CONSUMER_REGS=consumer_regs, PINGPONG=tile.pingpong, IS_VARLEN=varlen,
                    HAS_SEQUSED=args.seqused_k is not None, CONSUMERS=tile.consumers, num_warps=4, maxnreg=maxnreg)

    key = (tuple((t.shape, t.stride()) for t in (q, k, v_t, q_descale, k_descale, v_descale, out, lse)), q.device,
           args.window_left, args.window_right, args.softcap > 0, ctas, tile, varlen, args.seqused_k is not None,
           batch, seqlen_q, seqlen_k)
    with on_device(q):
        _FWD_FP8(key, (ctas, ), dict(**descriptors(q, k, v_t, head_dim, tile.block_n), O=out, LSE=lse,
                                     Q_DESCALE=q_descale, K_DESCALE=k_descale, V_DESCALE=v_descale, qk_scale=qk_scale,
                                     softcap2=softcap2, **_sequence_tensors(q, args),
                                     ERR=device_errors.record(q.device)), static)
