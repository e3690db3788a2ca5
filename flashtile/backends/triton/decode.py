"""Host side of the KV-cache kernels (``kernels/decode.py``): the ``append_kv``, ``attention_kv`` and
``merge_states`` parts of the backend contract (``flashtile/backends/__init__.py``).

A decode step is latency-bound (a kernel of tens of microseconds): whatever depends only on shapes
(tiles, splits, grids, strides, switches) is worked out once per kind of call, and later calls go
through :class:`~.fastlaunch.CachedLaunch` with only their tensors and scales. Nothing here reads a
tensor's values, synchronizes or sizes an allocation by them, so a step can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from ... import device_errors
from ...alloc import empty
from .. import KVCacheArgs, torch_decode
from . import interpreter_enabled
from .configs import TileConfig, decode_plan, padded_head_dim
from .fastlaunch import CachedLaunch
from .host import bsh_strides, cdiv, dependent_launch, fast_tanh, input_precision, lse_strides, on_device, unit_stride
from .kernels import decode as kernels

# Rows (query tokens x heads) per program of the merge kernel.
_MERGE_BLOCK_M = 16
# The combine kernel: one program per row, loading up to this many partial-output elements
# (splits x headdim_v) at once: every split of an auto split count at headdim 128, without spilling
# registers at 256. H200, batch 1 x 32768, 16 splits: 2.3 us, against 20 us for 16-row programs
# that loaded one split at a time.
_COMBINE_TILE = 16384
# The per-batch-row tensors every KV-cache kernel takes (stood in for by q when absent).
_CACHE_TENSORS = ("CACHE_SEQLENS", "CACHE_LEFTPAD", "CACHE_BATCH_IDX", "BLOCK_TABLE", "ERR")
_APPEND = CachedLaunch(kernels.append_kv, ("Q", "K_NEW", "V_NEW", "K_CACHE", "V_CACHE", "Q_OUT", "COS", "SIN")
                       + _CACHE_TENSORS + ("K_DESCALE", "V_DESCALE"))
# The cache's strides and rows and the capacity are per call: a cache grown by concatenation (a new length
# and new strides every step, as transformers keeps it) reuses one launch. q's strides are in the key; the
# output's and the partials' follow from the shapes.
_CACHE_STRIDES = ("stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn", "stride_vh")
_DECODE = CachedLaunch(kernels.attn_decode, ("Q", "K", "V", "O", "LSE", "ALIBI_SLOPES", "SINK", "CU_SEQLENS_Q",
                                             "SEQUSED_K", "softmax_scale", "softcap", "max_seqlen_k", "num_blocks")
                       + _CACHE_STRIDES + _CACHE_TENSORS + ("K_DESCALE", "V_DESCALE"))
_COMBINE = CachedLaunch(kernels.attn_decode_combine, ("O_PART", "LSE_PART", "O", "LSE", "CU_SEQLENS_Q", "ERR"))
_MERGE = CachedLaunch(kernels.merge_states, ("OA", "LSE_A", "OB", "LSE_B", "O", "LSE"))


def _layout(t) -> tuple | None:
    return None if t is None else (t.shape, t.stride())


def _strides3(t: torch.Tensor) -> tuple:
    """The (batch or page, seq, head) strides of a 4-d tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def cache_key(args: KVCacheArgs, capacity: bool = True) -> tuple:
    """What the KV-cache kernels' static arguments take from ``args`` (see fastlaunch.py); ``capacity``:
    with ``max_seqlen_k`` (a launch that takes it per call leaves it out)."""
    return (args.cache_seqlens is not None, args.cache_leftpad is not None, args.cache_batch_idx is not None,
            _layout(args.block_table), args.max_seqlen_k if capacity else None, args.seqlen_new, args.varlen,
            args.seqused_k is not None)


def _cache_tensors(q: torch.Tensor, args: KVCacheArgs) -> tuple:
    """The ``_CACHE_TENSORS`` arguments, in order (the last: the device's error record)."""
    present = (args.cache_seqlens, args.cache_leftpad, args.cache_batch_idx, args.block_table)
    return tuple(t if t is not None else q for t in present) + (device_errors.record(q.device),)


def _descales(q: torch.Tensor, args: KVCacheArgs) -> tuple:
    """``(K_DESCALE, V_DESCALE)`` of an FP8 cache (q stands in for a 16-bit cache's)."""
    return (args.k_descale, args.v_descale) if args.fp8 else (q, q)


def _descale_strides(args: KVCacheArgs) -> dict:
    """The (batch, KV head) strides of the descales: a per-head descale has batch stride 0."""
    strides = (*args.k_descale.stride(), *args.v_descale.stride()) if args.fp8 else (0, 0, 0, 0)
    return dict(zip(("stride_kdb", "stride_kdh", "stride_vdb", "stride_vdh"), strides), FP8_CACHE=args.fp8)


def _cache_static(k_cache: torch.Tensor, args: KVCacheArgs) -> dict:
    """Paging and the per-batch-row switches, from what :func:`cache_key` keys (without the capacity and the
    cache's rows, which the attention kernel takes per call)."""
    table = args.block_table
    return dict(
        stride_bt=table.stride(0) if table is not None else 0, page_size=k_cache.shape[1] if table is not None else 1,
        PAGED=table is not None, HAS_SEQLENS=args.cache_seqlens is not None,
        HAS_LEFTPAD=args.cache_leftpad is not None, HAS_BATCH_IDX=args.cache_batch_idx is not None,
    )


def append_kv(q, k_cache, v_cache, k, v, args: KVCacheArgs):
    """Write ``k``, ``v`` ``(batch, seqlen_new, nheads_kv, headdim[_v])`` into the caches in place at key
    rows ``cache_seqlens[b] + t`` (k rotated at that key row when ``args.rotary_cos`` is set), in one
    launch that also rotates q; returns q (a new contiguous tensor when rotated). Rows past the capacity, or on a page
    outside the cache, are dropped. The caches must have unit stride on the head dim."""
    if args.fp8 and interpreter_enabled():
        # Triton's interpreter rounds fp32 -> e4m3 wrongly where the rounding carries into the exponent (125.1
        # becomes 64): under it an FP8 cache is written by the torch statement of this kernel (the GPU casts).
        return torch_decode.append_kv(q, k_cache, v_cache, k, v, args)
    rotary = args.rotary_cos is not None
    seqlen_new = k.shape[1] if k is not None else 0
    batch, seqlen_q, nheads, head_dim = q.shape
    if (seqlen_new == 0 and not rotary) or batch == 0:
        return q
    nheads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    q_out = empty(q.shape, q.dtype, q.device) if rotary else q
    k_new = unit_stride(k) if seqlen_new else k_cache
    v_new = unit_stride(v) if seqlen_new else v_cache
    q_in = unit_stride(q)
    cos, sin = (unit_stride(args.rotary_cos), unit_stride(args.rotary_sin)) if rotary else (q, q)
    if rotary and cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()  # the kernel reads both tables with one row stride
    block_h, grid = _append_grid(batch, seqlen_q, seqlen_new, nheads, nheads_kv, rotary)
    if grid[0] == 0:
        return q

    def static():
        return dict(
            **dict(zip(("stride_qb", "stride_qm", "stride_qh"), _strides3(q_in))),
            **dict(zip(("stride_kb", "stride_kn", "stride_kh"), _strides3(k_new))),
            **dict(zip(("stride_vb", "stride_vn", "stride_vh"), _strides3(v_new))),
            **dict(zip(("stride_kcb", "stride_kcn", "stride_kch"), _strides3(k_cache))),
            **dict(zip(("stride_vcb", "stride_vcn", "stride_vch"), _strides3(v_cache))),
            **dict(zip(("stride_qob", "stride_qom", "stride_qoh"), _strides3(q_out))),
            stride_ro=cos.stride(0) if rotary else 0, seqlen_ro=cos.shape[0] if rotary else 0,
            seqlen_q=seqlen_q, seqlen_new=seqlen_new, nheads=nheads, nheads_kv=nheads_kv,
            kv_head_blocks=cdiv(nheads_kv, block_h) if seqlen_new else 0,
            HEAD_DIM_ACTUAL=head_dim, HEAD_DIM=padded_head_dim(head_dim),
            HEAD_DIM_V_ACTUAL=head_dim_v, HEAD_DIM_V=padded_head_dim(head_dim_v), BLOCK_H=block_h,
            ROTARY=rotary, ROTARY_DIM=2 * cos.shape[1] if rotary else 0, INTERLEAVED=bool(args.rotary_interleaved),
            # flash-attn: with a causal mask or a window, query t is rotated at new key t's position.
            Q_PER_TOKEN=bool(args.causal) or args.window_left >= 0 or args.window_right >= 0,
            **_cache_static(k_cache, args), **_descale_strides(args), max_seqlen_k=args.max_seqlen_k,
            num_blocks=k_cache.shape[0],
            num_warps=1 if block_h * padded_head_dim(max(head_dim, head_dim_v)) <= 1024 else 4,
        )

    key = (_layout(q_in), _layout(k_new), _layout(v_new), _layout(k_cache), _layout(v_cache),
           _layout(args.rotary_cos), _layout(args.rotary_sin), q.device, cache_key(args),
           bool(args.rotary_interleaved), bool(args.causal), args.window_left, args.window_right,
           _layout(args.k_descale), _layout(args.v_descale))
    with on_device(q):
        _APPEND(key, grid, (q_in, k_new, v_new, k_cache, v_cache, q_out, cos, sin, *_cache_tensors(q, args),
                            *_descales(q, args)), static)
    return q_out


@functools.lru_cache(maxsize=1024)
def _append_grid(batch, seqlen_q, seqlen_new, nheads, nheads_kv, rotary):
    """``(BLOCK_H, grid)``: programs (token, batch row, head block), the KV head blocks first, then q's."""
    block_h = min(triton.next_power_of_2(max(nheads_kv, 1)), 16)
    kv_blocks = cdiv(nheads_kv, block_h) if seqlen_new else 0
    q_blocks = cdiv(nheads, block_h) if rotary else 0
    tokens = max(seqlen_new if kv_blocks else 0, seqlen_q if q_blocks else 0)
    return block_h, (tokens, batch, kv_blocks + q_blocks)


class DecodePlan(NamedTuple):
    """Launch decisions of one kind of KV-cache call, from its shapes alone."""
    config: TileConfig
    num_splits: int
    grid: tuple
    combine_grid: tuple
    # Splits the combine kernel loads at once.
    combine_block: int


@functools.lru_cache(maxsize=1024)
def _plan(batch, seqlen_q, nheads, nheads_kv, head_dim, head_dim_v, dtype, device, capacity, num_splits,
          page_size: int, config: TileConfig | None, fp8: bool) -> DecodePlan:
    rows = seqlen_q * (nheads // nheads_kv)
    cfg, splits = decode_plan(max(head_dim, head_dim_v), dtype, device, rows, batch * nheads_kv, capacity, num_splits,
                              page_size, config, fp8, nheads_kv)
    # A program's rows: those of its cfg.heads KV heads, one head's after the other.
    m_blocks = cdiv(rows * cfg.heads, cfg.BLOCK_M)
    combine_block = min(triton.next_power_of_2(splits), max(1, _COMBINE_TILE // padded_head_dim(head_dim_v)))
    return DecodePlan(cfg, splits, (m_blocks, batch * nheads_kv // cfg.heads, splits), (seqlen_q * nheads, batch),
                      combine_block)


def _query_shape(q: torch.Tensor, args: KVCacheArgs) -> tuple:
    """``(batch, seqlen_q, nheads, headdim)`` of q; packed q (``args.varlen``) has ``max_seqlen_q`` rows a sequence."""
    if args.varlen:
        return args.cu_seqlens_q.shape[0] - 1, args.max_seqlen_q, q.shape[1], q.shape[2]
    return q.shape


def plan(q, k_cache, v_cache, args: KVCacheArgs, config: TileConfig | None = None) -> DecodePlan:
    """Tiles, splits and grids that :func:`attention_kv` launches for these shapes."""
    batch, seqlen_q, nheads, head_dim = _query_shape(q, args)
    return _plan(batch, seqlen_q, nheads, k_cache.shape[2], head_dim, v_cache.shape[3], q.dtype, q.device,
                 args.max_seqlen_k, args.num_splits, args.page_size if args.paged else 0, config, bool(args.fp8))


def attention_kv(q, k_cache, v_cache, args: KVCacheArgs, config: TileConfig | None = None):
    """q ``(batch, seqlen_q, nheads, headdim)`` attends to its cache row's keys ``[cache_leftpad[b],
    cache_seqlens[b] + seqlen_new)``; returns out ``(batch, seqlen_q, nheads, headdim_v)`` (q's dtype)
    and lse float32 ``(batch, nheads, seqlen_q)``. ``args.num_splits`` (0: from the shapes) cuts each
    sequence's keys into shares merged afterwards; ``config`` overrides the tile table (tuning sweeps)."""
    q, k_cache, v_cache = unit_stride(q), unit_stride(k_cache), unit_stride(v_cache)
    batch, seqlen_q, nheads, _ = q.shape
    out = empty((batch, seqlen_q, nheads, v_cache.shape[3]), q.dtype, q.device)
    lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    attend(q, k_cache, v_cache, out, lse, args, config)
    return out, lse


def attention_packed(q, k, v, out, lse, args: KVCacheArgs):
    """A varlen call's few query rows a sequence (a decode step of a continuous batch) on the KV-cache
    kernel: q, k, v packed ``(tokens, heads, headdim)``; ``args`` as :func:`launch._packed_cache_args`
    builds them (``cu_seqlens_q``, and the keys of sequence ``b`` as cache rows ``[cache_leftpad[b],
    cache_seqlens[b])`` of the packed k). Writes the rows of each sequence into the packed ``out``
    ``(tokens, nheads, headdim_v)`` and ``lse`` ``(nheads, tokens)``; rows past ``cu_seqlens_q[-1]`` are the
    caller's. q, k and v come with unit stride on the head dim (``launch.forward`` made them so)."""
    batch = args.cu_seqlens_q.shape[0] - 1
    # Every batch row reads the one packed tensor: a cache row of all the tokens, batch stride 0.
    attend(q, k.expand(batch, *k.shape), v.expand(batch, *v.shape), out, lse, args)


def attend(q, k_cache, v_cache, out, lse, args: KVCacheArgs, config: TileConfig | None = None):
    """Launch the KV-cache attention of q (dense, or packed with ``args.varlen``) into ``out`` and ``lse``."""
    batch, seqlen_q, nheads, head_dim = _query_shape(q, args)
    nheads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    varlen = args.varlen
    p = plan(q, k_cache, v_cache, args, config)
    cfg = p.config
    if p.num_splits > 1:
        # Partials keep the output's layout behind a split dim, so one store serves both cases; one buffer
        # holds both (an allocation costs the host more than two views).
        rows = p.num_splits * batch * seqlen_q * nheads
        part = empty((rows * (head_dim_v + 1), ), torch.float32, q.device)
        o_dst = part[:rows * head_dim_v].view(p.num_splits, batch, seqlen_q, nheads, head_dim_v)
        lse_dst = part[rows * head_dim_v:].view(p.num_splits, batch, nheads, seqlen_q)
    else:
        o_dst, lse_dst = out, lse
    # The combine starts while the split kernel finishes (programmatic dependent launch).
    pdl = p.num_splits > 1 and dependent_launch(q)
    alibi = args.alibi_slopes

    def static():
        if p.num_splits > 1:
            dst = (o_dst.stride(0), *o_dst.stride()[1:4], lse_dst.stride(0), *lse_dst.stride()[1:3])
        else:
            dst = (0, *bsh_strides(out, varlen), 0, *lse_strides(lse, varlen))
        return dict(
            **dict(zip(_OUT_STRIDES, (*bsh_strides(q, varlen), *dst))),
            window_left=args.window_left, window_right=args.window_right,
            stride_alibi_b=alibi.stride(0) if alibi is not None else 0,
            seqlen_q=seqlen_q, seqlen_new=args.seqlen_new, nheads=nheads, nheads_kv=nheads_kv,
            num_splits=p.num_splits, total_q=q.shape[0], GROUP=nheads // nheads_kv,
            HEAD_DIM_QK_ACTUAL=head_dim, HEAD_DIM_QK=padded_head_dim(head_dim),
            HEAD_DIM_V_ACTUAL=head_dim_v, HEAD_DIM_V=padded_head_dim(head_dim_v),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, HEADS=cfg.heads,
            MASK_LEFT=args.window_left >= 0, MASK_RIGHT=args.window_right >= 0, SOFTCAP=args.softcap > 0,
            FAST_TANH=fast_tanh(q),
            ALIBI=alibi is not None, HAS_SINK=args.sink is not None,
            INPUT_PRECISION=input_precision(q.dtype),
            **_cache_static(k_cache, args),
            # Pages that hold whole key blocks are read with one table entry per block.
            PAGE_ALIGNED=args.block_table is not None and k_cache.shape[1] % cfg.BLOCK_N == 0, Q_VARLEN=varlen,
            HAS_SEQUSED=args.seqused_k is not None,
            PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_descale_strides(args),
            V_PAIRS=v_pairs, PTX=not interpreter_enabled(),
        )

    # An e4m3 V is read as 16-bit pairs of columns where its rows are 2-byte aligned with an even head dim (any
    # cache a torch op made).
    v_pairs = bool(args.fp8) and (v_cache.data_ptr() | v_cache.stride(0) | v_cache.stride(1) | v_cache.stride(2)
                                  | head_dim_v) % 2 == 0
    # The key holds what the static arguments read: q's layout and rows a sequence, the cache's shape but its
    # rows (and its page size when paged), the plan (the output's strides follow).
    key = (_layout(q), seqlen_q, k_cache.shape[2:], v_cache.shape[3], k_cache.shape[1] if args.paged else None,
           q.device, cache_key(args, capacity=False), p, args.window_left, args.window_right, args.softcap > 0,
           _layout(alibi), args.sink is not None, _layout(args.k_descale), _layout(args.v_descale), v_pairs)
    cu_seqlens_q = args.cu_seqlens_q if varlen else q
    with on_device(q):
        # The kernel's max_seqlen_k bounds the key rows read from a cache row: a paged row's capacity, or the
        # rows a contiguous cache holds (its capacity, or every packed token with varlen).
        _DECODE(key, p.grid, (q, k_cache, v_cache, o_dst, lse_dst, alibi if alibi is not None else q,
                              args.sink if args.sink is not None else q, cu_seqlens_q,
                              args.seqused_k if args.seqused_k is not None else q, float(args.softmax_scale),
                              float(args.softcap), args.max_seqlen_k if args.paged else k_cache.shape[1],
                              k_cache.shape[0], *_strides3(k_cache), *_strides3(v_cache), *_cache_tensors(q, args),
                              *_descales(q, args)),
                static)
        if p.num_splits > 1:
            block_s = p.combine_block
            _COMBINE((out.shape, out.stride(), lse.stride(), p, q.device, varlen), p.combine_grid,
                     (o_dst, lse_dst, out, lse, cu_seqlens_q, device_errors.record(q.device)),
                     lambda: dict(zip(_COMBINE_STRIDES, (o_dst.stride(0), *o_dst.stride()[1:4], lse_dst.stride(0),
                                                         *lse_dst.stride()[1:3], *bsh_strides(out, varlen),
                                                         *lse_strides(lse, varlen))),
                                  nheads=nheads, num_splits=p.num_splits, seqlen_q=seqlen_q, total_q=out.shape[0],
                                  HEAD_DIM_V_ACTUAL=head_dim_v, HEAD_DIM_V=padded_head_dim(head_dim_v),
                                  BLOCK_S=block_s, Q_VARLEN=varlen, PDL=pdl, launch_pdl=pdl,
                                  num_warps=2 if block_s <= 32 else 8))


_OUT_STRIDES = ("stride_qb", "stride_qm", "stride_qh", "stride_os", "stride_ob", "stride_om", "stride_oh",
                "stride_ls", "stride_lb", "stride_lh")
_COMBINE_STRIDES = ("stride_ps", "stride_pb", "stride_pm", "stride_ph", "stride_pls", "stride_plb", "stride_plh",
                    "stride_ob", "stride_om", "stride_oh", "stride_lb", "stride_lh")
_MERGE_STRIDES = ("stride_ab", "stride_am", "stride_ah", "stride_bb", "stride_bm", "stride_bh",
                  "stride_ob", "stride_om", "stride_oh", "stride_lab", "stride_lah", "stride_lam",
                  "stride_lbb", "stride_lbh", "stride_lbm", "stride_lb", "stride_lh")


def merge_states(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    """The attention over the union of two disjoint key sets: outs ``(batch, seqlen, nheads, headdim)``
    (any strides), lses float32 ``(batch, nheads, seqlen)`` (any strides); returns ``(out, lse)``, out
    in out_a's dtype. ``lse = log(exp(lse_a) + exp(lse_b))``; where both are ``-inf``: out 0, lse ``-inf``.
    ``out``, ``lse``: where to write the result instead (any float dtype of out, any strides with a unit last
    one; they may be ``out_a``, ``lse_a``: each program reads its rows before it writes them)."""
    out_a, out_b = unit_stride(out_a), unit_stride(out_b)
    batch, seqlen, nheads, head_dim = out_a.shape
    if out is None:
        out = empty((batch, seqlen, nheads, head_dim), out_a.dtype, out_a.device)
    if lse is None:
        lse = empty((batch, nheads, seqlen), torch.float32, out_a.device)
    if out.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError(f"merge_states: out and lse need a unit last stride, got strides {out.stride()} and "
                         f"{lse.stride()}")
    if batch == 0 or seqlen == 0 or nheads == 0:
        return out, lse
    grid = (cdiv(seqlen * nheads, _MERGE_BLOCK_M), batch)
    key = (_layout(out_a), _layout(out_b), _layout(lse_a), _layout(lse_b), _layout(out), _layout(lse),
           out_a.device)
    with on_device(out_a):
        _MERGE(key, grid, dict(OA=out_a, LSE_A=lse_a, OB=out_b, LSE_B=lse_b, O=out, LSE=lse),
               lambda: dict(zip(_MERGE_STRIDES, (*_strides3(out_a), *_strides3(out_b), *_strides3(out),
                                                 *lse_a.stride(), *lse_b.stride(), *lse.stride()[:2])),
                            seqlen=seqlen, nheads=nheads, HEAD_DIM_ACTUAL=head_dim,
                            HEAD_DIM=padded_head_dim(head_dim), BLOCK_M=_MERGE_BLOCK_M, num_warps=4))
    return out, lse
