"""Host side of the FP8 quantizer (``kernels/quant_fp8.py``): allocation, strides and the grid.

:func:`quantize` makes what :func:`flashtile.backends.torch_fp8.quantize` makes (its twin), for dense or packed
(varlen) q, k, v, in two launches. Block scales (the default): the first takes v's amax per block (v's one
scale per (batch row, KV head) needs all of them before any row is cast), the second reduces them to v's descale
in each program, computes q's scales (per block, over the query heads of a KV group) and k's, and casts all
three. Per-tensor scales (``block_quant=False``, the ablation): the first writes every block's amax, the host
reduces them per (batch row, KV head), the second casts with those descales.
"""
from __future__ import annotations

import math

import torch

from ...alloc import empty
from ..torch_fp8 import FP8_DTYPE, QUANT_BLOCK, descale_of, hadamard_signs, packed_vt_width
from . import interpreter_enabled
from .fastlaunch import CachedLaunch
from .host import bsh_strides, cdiv, input_precision, on_device, tma_rows, unit_stride
from .kernels.quant_fp8 import quantize_fp8

# Warps per program (one QUANT_BLOCK x head-dim tile, rotated in one dot, one stage) and the registers a thread, by
# head dim: programs an SM are bounded by registers and by shared memory (the +-1 matrix and the tile, 24/64/192 KB
# at d64/128/256), so the warps an SM has to hide a tile's load and its serial steps (load, rotate, amax, cast,
# store) come from wider programs. With the host path's sync gone: a quantize of the FP8 bench's inputs (16k tokens,
# 2048 wide) 342-546 -> 181 us at d128, 621-645 -> 227 us at d256 (H200, do_bench, against 5d069c2,
# results/h200-fp8-side-2026-11-27-02dd45f.json). Compiled for sm_90 (ptxas, triton 3.6, the default's second
# launch, group 1 / 4):
#   d    warps, registers   registers used                 programs an SM   warps an SM (was)
#   64   8, 64              64 / 64, 1 spill store at g4   4                32 (32)
#   128  16, 64             63 / 64, no spill              2                32 (16: 8 warps, 115-124 registers)
#   256  16, 128            124 / 122, no spill            1                16 (8: 8 warps, 229-240 registers)
# The per-tensor ablation's amax launch (block_quant=False) spills 8 stores at d128 group 4. Uncapped, _divide's
# straight-line code let ptxas take 201 registers at d128, 8 warps. 4 warps spilled at d256
# (688-1048 B of stack); the pipeliner's stages double-buffered the group loop (d256 GQA asked 360448 B of shared
# memory).
_WARPS = {64: 8, 128: 16, 256: 16}
_MAXNREG = {64: 64, 128: 64, 256: 128}
# Triton's own launch path binds the kernel's ~50 arguments on every call (tens of microseconds of host time a
# launch, twice a quantize): the shapes' static arguments are worked out once per layout instead.
_QUANT = CachedLaunch(quantize_fp8, ("Q", "K", "V", "Q8", "K8", "VT8", "Q_DESCALE", "K_DESCALE", "V_DESCALE", "V_AMAX",
                                     "R", "CU_SEQLENS_Q", "CU_SEQLENS_K", "seqlen_q", "seqlen_k", "total_q", "total_k"))
_STRIDES = ("stride_qb", "stride_qm", "stride_qh", "stride_kb", "stride_km", "stride_kh", "stride_vb", "stride_vm",
            "stride_vh", "stride_q8b", "stride_q8m", "stride_q8h", "stride_k8b", "stride_k8m", "stride_k8h",
            "stride_vtb", "stride_vth", "stride_vtd", "stride_vtm", "stride_qdb", "stride_qdh", "stride_qdm",
            "stride_kdb", "stride_kdh", "stride_kdm", "stride_vdb", "stride_vdh", "stride_vdm", "stride_vab",
            "stride_vah")


def quantize(q, k, v, block_quant: bool = True, incoherent: bool = True, seed: int = 0, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """``(q8, k8, v8_t, q_descale, k_descale, v_descale)`` of 16-bit (or fp32) q, k, v with a head dim of 64,
    128 or 256 (see ``torch_fp8.quantize`` for the layouts; packed tensors with ``cu_seqlens_*``, v8_t then as
    ``torch_fp8.pack_v_t`` lays it out). v8_t's rows (its last dim, the keys) start 16 bytes apart, as the FP8
    kernel's TMA reads them."""
    varlen = cu_seqlens_q is not None
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    # Triton's interpreter rounds fp32 -> e4m3 wrongly where the rounding carries into the exponent (125.1
    # becomes 64, not 128): there the kernel stores the scaled, saturated fp32 values and torch casts them.
    dtype = torch.float32 if interpreter_enabled() else FP8_DTYPE
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_kv = k.shape[-2]
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        # Packed V^T: each sequence from a 16-byte-aligned column (torch_fp8.pack_v_t). The kernel writes every
        # byte, the zeros outside the sequences included: no memset (a whole extra write of the outputs).
        v8_t = tma_rows((nheads_kv, head_dim, packed_vt_width(v.shape[0], batch)), dtype, v.device)
        vt_strides = (0, *v8_t.stride())
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        v8_t = tma_rows((batch, nheads_kv, head_dim, seqlen_k), dtype, v.device)
        vt_strides = v8_t.stride()
    q8, k8 = (empty(x.shape, dtype, x.device) for x in (q, k))
    blocks_q, blocks_k = cdiv(max(seqlen_q, 1), QUANT_BLOCK), cdiv(max(seqlen_k, 1), QUANT_BLOCK)
    rotation = hadamard_signs(head_dim, seed, q.device, q.dtype)
    grid = (max(blocks_q, blocks_k), batch, 2 * nheads_kv)
    q_descale, k_descale, v_amax, v_descale = _scale_buffers(batch, nheads_kv, blocks_q, blocks_k, q.device)
    # Under the interpreter the cast tensors are fp32 stand-ins: their dtype is in the key with the layouts.
    layouts = tuple((t.shape, t.stride(), t.dtype) for t in (q, k, v, q8, k8, v8_t))

    def launch(targets, qk_mode: str, v_mode: str):
        def static():
            strides = (*(stride for t in (q, k, v, q8, k8) for stride in bsh_strides(t, varlen)), *vt_strides,
                       *(stride for t in targets for stride in t.stride()), *v_amax.stride()[:2])
            return dict(zip(_STRIDES, strides), nheads_kv=nheads_kv, group=nheads // nheads_kv,
                        inv_sqrt_d=1.0 / math.sqrt(head_dim), HEAD_DIM=head_dim, BLOCK=QUANT_BLOCK,
                        ROTATE=incoherent, QK_MODE=qk_mode, V_MODE=v_mode, VARLEN=varlen,
                        INPUT_PRECISION=input_precision(q.dtype), FMA=not interpreter_enabled(),
                        num_warps=_WARPS[head_dim], num_stages=1, maxnreg=_MAXNREG[head_dim])

        key = (layouts, tuple((t.shape, t.stride()) for t in targets), v_amax.stride(), q.device, grid, incoherent,
               qk_mode, v_mode, varlen)
        _QUANT(key, grid, (q, k, v, q8, k8, v8_t, *targets, v_amax, rotation, cu_seqlens_q if varlen else q,
                           cu_seqlens_k if varlen else q, seqlen_q, seqlen_k, q.shape[0], k.shape[0]), static)

    with on_device(q):
        if block_quant:
            launch((q_descale, k_descale, v_amax), "skip", "amax")
            # The second launch reduces v's block amaxes itself (no torch ops between the launches).
            launch((q_descale, k_descale, v_descale[:, :, None]), "compute", "reduce")
            return (*_cast(q8, k8, v8_t), q_descale, k_descale, v_descale)
        # Per (batch row, KV head): the largest block amax of each, one descale for all blocks.
        launch((q_descale, k_descale, v_amax), "amax", "amax")
        per_tensor = [descale_of(amax.amax(dim=2)) for amax in (q_descale, k_descale, v_amax)]
        expanded = [d[:, :, None].expand(-1, -1, blocks)
                    for d, blocks in zip(per_tensor, (blocks_q, blocks_k, blocks_k))]
        launch(expanded, "given", "given")
    return (*_cast(q8, k8, v8_t), *per_tensor)


def _scale_buffers(batch: int, nheads_kv: int, blocks_q: int, blocks_k: int, device) -> tuple:
    """``(q_descale, k_descale, v_amax, v_descale)`` float32 ``(batch, nheads_kv, blocks_q | blocks_k | blocks_k)``
    and ``(batch, nheads_kv)``: views of one allocation (each costs the host a few microseconds). Every block is
    written by the kernel: packed, those past a short sequence by the programs that find no rows there (descale 1,
    or amax 0 where a buffer takes amaxes), so the buffer needs no fill."""
    rows = batch * nheads_kv
    sizes = (rows * blocks_q, rows * blocks_k, rows * blocks_k, rows)
    # Each view starts 16 bytes apart, as its own allocation would (kernels are specialized on that alignment).
    padded = [cdiv(size, 4) * 4 for size in sizes]
    buffer = empty((sum(padded), ), torch.float32, device)
    parts = [part[:size] for part, size in zip(buffer.split(padded), sizes)]
    return (parts[0].view(batch, nheads_kv, blocks_q), parts[1].view(batch, nheads_kv, blocks_k),
            parts[2].view(batch, nheads_kv, blocks_k), parts[3].view(batch, nheads_kv))


def _cast(*tensors) -> tuple:
    """e4m3 tensors (the interpreter's fp32 stand-ins, already saturated, cast here into rows as aligned)."""
    return tuple(t if t.dtype == FP8_DTYPE else tma_rows(t.shape, FP8_DTYPE, t.device).copy_(t) for t in tensors)
