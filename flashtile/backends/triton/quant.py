"""Host side of the FP8 quantizer (``kernels/quant_fp8.py``): allocation, strides and the grid.

:func:`quantize` makes what :func:`flashtile.backends.torch_fp8.quantize` makes (its twin), for dense or packed
(varlen) q, k, v, in two launches. Block scales (the default): the first computes q's scales (per block, over the
query heads of a KV group) and k's, casts both, and takes v's amax per block (v's one scale per (batch row, KV head)
needs all of them before any row is cast); the second reduces them to v's descale in each program and casts v, its
programs in the reverse order (v's blocks read last by the first launch are still in L2). Per-tensor scales
(``block_quant=False``, the ablation): the first writes every block's amax, the host reduces them per (batch row, KV
head), the second casts q and k with those descales and a third v.
"""
from __future__ import annotations

import math

import torch

from ...alloc import empty
from ..torch_fp8 import FP8_DTYPE, QUANT_BLOCK, descale_of, hadamard_signs, packed_vt_width
from . import interpreter_enabled
from .fastlaunch import CachedLaunch
from .configs import sm_count
from .host import bsh_strides, cdiv, input_precision, on_device, tma_rows, unit_stride
from .kernels.quant_fp8 import quantize_fp8

# The first launch (q's and k's rotation and cast, v's block amaxes): warps and registers a thread by head dim. A
# program takes several blocks of one (batch row, tensor, head) in turn (_tiles), in a loop Triton's pipeliner splits
# into _STAGES stages: each block's tile is copied into shared memory (cp.async, LDGSTS.128) up to _STAGES - 1 blocks
# ahead of its rotation, so a program's loads run under its own wgmma, amax reductions, cast and stores, and the +-1
# matrix is read once a program, not once a block (at d256 it was 128 KB a block, twice the tile). Two stages do not
# overlap: the pipeliner issues the next block's copy at the end of the iteration and waits for it at the top. Before
# (one block a program, one stage), the serial chain load -> rotate -> amax -> cast -> store of each block left the
# SM's memory pipe idle between its programs' loads: a quantize of the FP8 bench's inputs (16k tokens, 2048 wide) took
# 181 us at d128 and 227 us at d256 (H200, results/h200-fp8-side-2026-11-27-02dd45f.json) against a floor of ~80 us
# (256 MB read with v's amax pass, 96 MB written, at 4.3 TB/s). Compiled for sm_90 (ptxas, triton 3.6, `python
# benchmarks/sm90_compile.py quant[-d64|-d256][-g4][-v]`), MHA / group 4:
#   d    warps, registers  used, spills         shared (stages)   programs an SM   before: used, shared
#   64   8, 64             64 / 64, 0           56 KB (3)         4                64, 24 KB, 4 an SM (1 STL at g4)
#   128  16, 128           96 / 96, 0           152 KB (4)        1                63, 64 KB, 2 an SM
#   256  16, 128           128 / 110, 0         128 KB (1)        1                124, 192 KB, 1 an SM
# The rotation is two products of half the head dim (kernels/quant_fp8._block_values: Sylvester's structure), half the
# FLOPs and half the matrix: d128 HGMMA.64x32x16 (was 64x64x16), d256 HGMMA.64x64x16 (was 64x128x16), plus one FADD an
# element. d256 has no room for a second stage's 64 KB tile; its gain is the halved product and the matrix read once a
# program. Offsets are 32-bit from each block's first row: 64-bit ones spilled 56 values in d256's block loop (46 at
# 32 warps of 64 registers). A GQA group's loops over its heads (its amax, then its cast) are pipelined the same way
# (64 LDGSTS.128 at d128 group 4, 152 KB; d64 group 4 spills 4 values). H200, 16k tokens x 2048, against the one-block
# programs before: 184 -> 137 us at d128, 230 -> 191 us at d256 (results/h200-fp8-quant-ab-2026-11-28-cf3c2dd.json).
# Not timed: d128 with 2 stages under 64 registers (88 KB, two programs an SM).
_WARPS = {64: 8, 128: 16, 256: 16}
_MAXNREG = {64: 64, 128: 128, 256: 128}
_STAGES = {64: 3, 128: 4, 256: 1}
# At most _MAX_TILES blocks a program, and as many as keep _PROGRAMS_PER_SM programs an SM in the grid (the last
# wave's imbalance, and short sequences' parallelism). With one program an SM (d128, d256), each program's start
# (the matrix's load from L2, then the first copies) runs under nothing else: longer programs pay it less often.
# The FP8 bench's shapes take 8 blocks a program at d128 and 4 at d256 (16k tokens, 2048 wide, 132 SMs); v's cast
# (_V_PROGRAMS_PER_SM: its next block prefetched in registers, one program an SM at d256) 4 and 2.
_MAX_TILES = 16
_PROGRAMS_PER_SM = 4
_V_PROGRAMS_PER_SM = 2
# The first launch's registers where a program takes one block (no stages): 64 / 64 / 128 used, no spills, 20 / 48 /
# 128 KB; 4 / 2 / 1 programs an SM, as before the block loop.
_ONE_BLOCK_MAXNREG = {64: 64, 128: 64, 256: 128}
# The second launch (v's cast, transposed): registers only bound its programs an SM (16 / 32 / 64 KB of shared
# memory for the transpose at d64 / 128 / 256); 79 / 64 / 125 registers used, no spills (d64 spilled 4 values under
# 64), 3 / 2 / 1 programs an SM.
# Each program loads its next block into registers while it casts one: the pipeliner's copies into shared memory
# would leave an unswizzled tile that the transpose reads 2 bytes at a time (64 LDS.U16 a thread, 8-way bank
# conflicts) instead of the LDSM.16.MT88 transposing loads of the layout change from registers.
_V_WARPS = {64: 8, 128: 16, 256: 16}
_V_MAXNREG = {64: 80, 128: 64, 256: 128}
# Triton's own launch path binds the kernel's ~50 arguments on every call (tens of microseconds of host time a
# launch, twice a quantize): the shapes' static arguments are worked out once per layout instead.
_QUANT = CachedLaunch(quantize_fp8, ("Q", "K", "V", "Q8", "K8", "VT8", "Q_DESCALE", "K_DESCALE", "V_DESCALE", "V_AMAX",
                                     "R", "CU_SEQLENS_Q", "CU_SEQLENS_K", "seqlen_q", "seqlen_k", "total_q", "total_k",
                                     "tiles"))
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
    q_descale, k_descale, v_amax, v_descale = _scale_buffers(batch, nheads_kv, blocks_q, blocks_k, q.device)
    # Under the interpreter the cast tensors are fp32 stand-ins: their dtype is in the key with the layouts.
    layouts = tuple((t.shape, t.stride(), t.dtype) for t in (q, k, v, q8, k8, v8_t))

    def launch(targets, qk_mode: str, v_mode: str):
        # q's, k's and v's programs; v's alone when q and k are skipped, under their own warps and registers.
        v_only = qk_mode == "skip"
        heads = (1 if v_only else 2 if v_mode == "skip" else 3) * nheads_kv
        tiles = _tiles(max(blocks_q, blocks_k), batch * heads, _V_PROGRAMS_PER_SM if v_only else _PROGRAMS_PER_SM,
                       q.device)
        grid = (cdiv(max(blocks_q, blocks_k), tiles), batch, heads)
        warps, maxnreg = (_V_WARPS if v_only else _WARPS)[head_dim], (_V_MAXNREG if v_only else _MAXNREG)[head_dim]
        stages = _STAGES[head_dim]
        if tiles == 1 and not v_only:
            # One block a program (a short input): nothing to overlap inside it, so no stages, and the registers
            # that let two programs an SM overlap each other's instead.
            stages, maxnreg = 1, _ONE_BLOCK_MAXNREG[head_dim]

        def static():
            strides = (*(stride for t in (q, k, v, q8, k8) for stride in bsh_strides(t, varlen)), *vt_strides,
                       *(stride for t in targets for stride in t.stride()), *v_amax.stride()[:2])
            return dict(zip(_STRIDES, strides), nheads_kv=nheads_kv, group=nheads // nheads_kv,
                        inv_sqrt_d=1.0 / math.sqrt(head_dim), HEAD_DIM=head_dim, BLOCK=QUANT_BLOCK,
                        ROTATE=incoherent, QK_MODE=qk_mode, V_MODE=v_mode, VARLEN=varlen,
                        STAGES=stages, INPUT_PRECISION=input_precision(q.dtype),
                        FMA=not interpreter_enabled(),
                        num_warps=warps, num_stages=1, maxnreg=maxnreg)

        key = (layouts, tuple((t.shape, t.stride()) for t in targets), v_amax.stride(), q.device, grid, incoherent,
               qk_mode, v_mode, varlen, stages)
        _QUANT(key, grid, (q, k, v, q8, k8, v8_t, *targets, v_amax, rotation, cu_seqlens_q if varlen else q,
                           cu_seqlens_k if varlen else q, seqlen_q, seqlen_k, q.shape[0], k.shape[0], tiles), static)

    with on_device(q):
        if block_quant:
            # q and k (their scales need no other block's) with v's block amaxes, then v's cast: the second
            # launch reduces v's block amaxes itself (no torch ops between the launches).
            launch((q_descale, k_descale, v_amax), "compute", "amax")
            launch((q_descale, k_descale, v_descale[:, :, None]), "skip", "reduce")
            return (*_cast(q8, k8, v8_t), q_descale, k_descale, v_descale)
        # Per (batch row, KV head): the largest block amax of each, one descale for all blocks.
        launch((q_descale, k_descale, v_amax), "amax", "amax")
        per_tensor = [descale_of(amax.amax(dim=2)) for amax in (q_descale, k_descale, v_amax)]
        expanded = [d[:, :, None].expand(-1, -1, blocks)
                    for d, blocks in zip(per_tensor, (blocks_q, blocks_k, blocks_k))]
        # q and k, then v under its own warps and registers (one launch of all three spilled at d64 and d256).
        launch(expanded, "given", "skip")
        launch(expanded, "skip", "given")
    return (*_cast(q8, k8, v8_t), *per_tensor)


def _tiles(blocks: int, rows: int, programs_per_sm: int, device) -> int:
    """Blocks a program takes in turn (its next blocks' loads in flight while it rotates and casts one): the most,
    up to :data:`_MAX_TILES`, that leave ``programs_per_sm`` programs an SM for ``blocks`` blocks of each of
    ``rows`` (batch row, tensor, KV head) rows of programs. Under the interpreter, 2 (its tests' lengths take a
    loop of several blocks too)."""
    if interpreter_enabled():
        return 2
    tiles = 1
    while tiles < _MAX_TILES and cdiv(blocks, 2 * tiles) * rows >= programs_per_sm * sm_count(device):
        tiles *= 2
    return tiles


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
