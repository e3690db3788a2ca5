"""Host side of the Triton backend: strides, grids, allocation. Implements the backend contract
documented in ``flashtile/backends/__init__.py``."""
from __future__ import annotations


import functools

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import device_errors, replay
from ...alloc import empty, empty_like
from ...dispatch import record_fallback
from ...rng import keep_threshold
from .. import AttnArgs, KVCacheArgs, present_features
from . import configs, decode
from .configs import (bwd_config, fixed_row_max, fwd_config, gluon_fwd_config, gluon_kv_config, gluon_ring,
                      padded_head_dim, row_keys)
# The KV-cache part of the backend contract lives in decode.py (attention_kv below picks between it and
# the Gluon forward); the dispatcher finds it here.
from .decode import append_kv, merge_states  # noqa: F401
from .fastlaunch import CachedLaunch
from .host import (bsh_strides, cdiv, fast_tanh, fold_scale, fork, input_precision, lse_strides, on_device,
                   unit_stride)
from .kernels.bwd import bwd_dkdv, bwd_dq, bwd_preprocess, bwd_sink_grad, bwd_sum_parts
from .kernels.bwd_sm90 import attn_bwd_dkdv_sm90
from .kernels.bwd_sm90_wide import attn_bwd_sm90_wide
from .kernels.bwd_sm90_wide96 import attn_bwd_sm90_wide96
from .kernels.bwd_sm90_ws import attn_bwd_sm90_ws
from .kernels.common import LOG2E as _LOG2E
from .kernels.fwd import attn_fwd
from .kernels.fwd_sm90 import attn_fwd_sm90
from .kernels.fwd_sm90_ws import attn_fwd_sm90_ws
from .kernels.tail import fill_tail

_PREPROCESS_BLOCK_M = 64
# The kernels' log2(e), as a host float for the scales passed to the Gluon forward.
LOG2E = _LOG2E.value


def _stride_names(name: str) -> tuple:
    """The kernels' ``(batch, seqlen, head)`` stride arguments of tensor ``name``: ``stride_<name>b``,
    ``stride_<name>m`` (``n`` for keys and values) and ``stride_<name>h``."""
    seq = "n" if name in ("k", "v", "dk", "dv") else "m"
    return f"stride_{name}b", f"stride_{name}{seq}", f"stride_{name}h"


def _strides(varlen: bool, **tensors) -> dict:
    """The :func:`_stride_names` kernel arguments of each tensor."""
    result = {}
    for name, t in tensors.items():
        result.update(zip(_stride_names(name), bsh_strides(t, varlen)))
    return result


def _shape(q, k, v, args: AttnArgs):
    """``(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, headdim_v)``; varlen seqlens are the maxima."""
    if args.varlen:
        batch = args.cu_seqlens_q.shape[0] - 1
        return batch, args.max_seqlen_q, args.max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    batch, seqlen_q, nheads, head_dim = q.shape
    return batch, seqlen_q, k.shape[1], nheads, k.shape[2], head_dim, v.shape[3]


def _variant_tensors(q, args: AttnArgs) -> dict:
    """The kernels' per-call arguments for ALiBi, bias, dropout and varlen (tensors and counters).
    Absent tensors are stood in for by ``q`` (never read: their switches are off)."""
    bias = args.attn_bias
    if bias is not None and bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)  # same bytes; Triton loads uint8 more portably than bool
    return dict(
        softcap=float(args.softcap), seed=args.seed, offset=args.offset,
        dropout_scale=1.0 / (1.0 - args.dropout_p),
        ALIBI_SLOPES=args.alibi_slopes if args.alibi_slopes is not None else q,
        BIAS_PTR=bias if bias is not None else q,
        **_sequence_tensors(q, args), **_sequence_bounds(q, args),
    )


def _sequence_tensors(stand_in, args) -> dict:
    """The varlen offsets and key counts (``stand_in`` stands in for those a call lacks)."""
    return dict(CU_SEQLENS_Q=args.cu_seqlens_q if args.varlen else stand_in,
                CU_SEQLENS_K=args.cu_seqlens_k if args.varlen else stand_in,
                SEQUSED_K=args.seqused_k if args.seqused_k is not None else stand_in)


def _sequence_bounds(q, args, k=None) -> dict:
    """The rows of the packed q and k (``k``: the launcher's; without it ``args.total_k``) that the kernels keep
    every varlen offset within, and the device's error record (flashtile/device_errors.py). A KV-cache call's k
    is the cache: its rows are the cache's batch rows, which ``cache_batch_idx`` must name."""
    if k is not None:
        total_k = k.shape[0]
    else:
        # AttnArgs built without it (tests of the launchers): no bound beyond int32's.
        total_k = args.total_k if args.total_k >= 0 else 2**31 - 1
    return dict(total_q=q.shape[0], total_k=total_k, ERR=device_errors.record(q.device))


def _variant_static(q, args: AttnArgs, nheads: int) -> dict:
    """The kernels' switches and strides for softcap, window, ALiBi, sink, bias, dropout and varlen."""
    bias = args.attn_bias
    bias_strides = bias.stride() if bias is not None else (0, 0, 0, 0)
    alibi = args.alibi_slopes
    return dict(
        window_left=args.window_left, window_right=args.window_right, threshold=keep_threshold(args.dropout_p),
        stride_alibi_b=alibi.stride(0) if alibi is not None else 0,
        stride_bb=bias_strides[0], stride_bh=bias_strides[1], stride_bm=bias_strides[2], stride_bn=bias_strides[3],
        nheads=nheads,
        MASK_LEFT=args.window_left >= 0, MASK_RIGHT=args.window_right >= 0,
        SOFTCAP=args.softcap > 0,
        FAST_TANH=fast_tanh(q),
        ALIBI=alibi is not None, BIAS="" if bias is None else ("keep" if bias.dtype == torch.bool else "add"),
        DROPOUT=args.dropout_p > 0,
        IS_VARLEN=args.varlen, HAS_SEQUSED=args.seqused_k is not None,
        INPUT_PRECISION=input_precision(q.dtype),
    )


def _args_key(args: AttnArgs, lengths: bool = True) -> tuple:
    """Everything of ``args`` that the static kernel arguments depend on (see fastlaunch.py); without
    ``lengths``, for a launch that takes the sequence lengths as dynamic arguments."""
    bias, alibi = args.attn_bias, args.alibi_slopes
    key = (args.window_left, args.window_right, args.softcap > 0, args.dropout_p,
           None if alibi is None else alibi.stride(), args.sink is not None,
           None if bias is None else (bias.dtype, bias.shape, bias.stride()), args.varlen, args.seqused_k is not None)
    if lengths:
        key += (args.max_seqlen_q, args.max_seqlen_k, None if args.cu_seqlens_q is None else args.cu_seqlens_q.shape[0])
    return key


def _layout_key(*tensors) -> tuple:
    return tuple((t.shape, t.stride()) for t in tensors)


def _head_dims(head_dim: int, head_dim_v: int) -> dict:
    return dict(HEAD_DIM_QK_ACTUAL=head_dim, HEAD_DIM_QK=padded_head_dim(head_dim),
                HEAD_DIM_V_ACTUAL=head_dim_v, HEAD_DIM_V=padded_head_dim(head_dim_v))


# q/k head dims that the backward pair (bwd.py) works as a main part and a tail instead of padding them:
# 192 = 128 + 64, where padding to 256 made 18% of the pair's matmul work at 192/128. H200, bf16, same tiles, bwd
# TFLOP/s padded -> tail (results/h200-bwd-d192-tail-2026-11-27-078b20b.json, each shape checked first):
#   192/128  N=1k/4k/16k full 181/201/204 -> 218/246/249, causal 157/199/220 -> 173/219/244
#   192/192  N=1k/4k/16k full 166/182/182 -> 168/188/188, causal 134/172/193 -> 149/190/210
_BWD_TAILS = {192: (128, 64)}


def _bwd_head_dims(head_dim: int, head_dim_v: int) -> dict:
    """:func:`_head_dims` for bwd.py's dK/dV and dQ kernels: ``HEAD_DIM_QK`` is the main part and ``TAIL_DIM``
    the tail's columns (0 for a head dim that is padded whole)."""
    main, tail = _BWD_TAILS.get(head_dim, (padded_head_dim(head_dim), 0))
    return dict(_head_dims(head_dim, head_dim_v), HEAD_DIM_QK=main, TAIL_DIM=tail)


# The packed rows the kernels keep varlen offsets within, and the error record they note bad values in.
_SEQUENCE_BOUNDS = ("total_q", "total_k", "ERR")
# The arguments that change between calls of one shape; everything else is worked out once per shape.
_VARIANT_DYNAMIC = ("softcap", "seed", "offset", "dropout_scale", "ALIBI_SLOPES", "BIAS_PTR",
                    "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUSED_K", "softmax_scale") + _SEQUENCE_BOUNDS
# The forward also takes its lengths and strides per call: a decode loop's growing KV cache, or packed
# batches of other lengths, then reuse one launch (fastlaunch.py keys them by Triton's specialization).
_FWD_LENGTHS = ("seqlen_q", "seqlen_k", "stride_lse_b", "stride_lse_h") + sum(map(_stride_names, "qkvo"), ())
_FWD = CachedLaunch(attn_fwd, ("Q", "K", "V", "O", "LSE", "SINK") + _VARIANT_DYNAMIC + _FWD_LENGTHS)
_PREPROCESS = CachedLaunch(bwd_preprocess, ("O", "DO", "LSE", "DELTA", "LSE2", "DQ_ACC"))
# The backward takes the (longest) lengths per call as well: packed batches of other lengths reuse its launches.
_BWD_LENGTHS = ("seqlen_q", "seqlen_k")
_DKDV = CachedLaunch(bwd_dkdv, ("Q", "K", "V", "DO", "DK", "DV", "LSE2", "DELTA") + _VARIANT_DYNAMIC + _BWD_LENGTHS)
_DQ = CachedLaunch(bwd_dq, ("Q", "K", "V", "DO", "DQ", "LSE2", "DELTA", "DBIAS") + _VARIANT_DYNAMIC + _BWD_LENGTHS)


# Values of fewer than NARROW_V columns run on V zero-padded to NARROW_V. On the H200 the Triton kernels' V tile of 8
# real columns in 16 gave wrong outputs (and once an illegal address) with a q/k head dim that is not a multiple of 16:
# d40/dv8, d24/dv8, d72/dv8 wrong; d48/dv8, d40/dv16 and d40/dv40 right (tests/test_fuzz.py seed0-case86, 125, 181).
NARROW_V = 16


def _widened(*tensors) -> list:
    """The tensors zero-padded in the last dim to NARROW_V columns (not replayed: the pads are torch copies)."""
    replay.not_replayable(f"values narrower than {NARROW_V} columns are padded")
    return [torch.nn.functional.pad(t, (0, NARROW_V - t.shape[-1])) for t in tensors]


def forward(q, k, v, args: AttnArgs, config=None):
    """``config`` overrides the tile table (for tuning sweeps)."""
    if v.shape[-1] < NARROW_V and q.device.type == "cuda":
        out, lse = forward(q, k, *_widened(v), args, config)
        return out[..., :v.shape[-1]].contiguous(), lse
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v = _shape(q, k, v, args)
    features = frozenset(present_features(args, head_dim, head_dim_v))
    # A decode step's few query rows: the KV-cache kernel, over k and v as a full cache.
    decode_step = config is None and configs.dense_takes_decode(batch, seqlen_q, seqlen_k, nheads, nheads_kv,
                                                                features, q.dtype, q.device)
    if decode_step and not args.varlen:
        return decode.attention_kv(q, k, v, _cache_args(args, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k))
    if args.varlen:
        out = empty((*q.shape[:2], head_dim_v), q.dtype, q.device)
        lse = empty((nheads, q.shape[0]), torch.float32, q.device)
        # Rows past the last sequence belong to none: their output is 0 and their lse -inf.
        _fill_tail(out, args.cu_seqlens_q, 0.0, lse)
    else:
        out = empty((batch, seqlen_q, nheads, head_dim_v), q.dtype, q.device)
        lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    if seqlen_q == 0 or batch == 0:
        if args.varlen:
            replay.not_replayable("an empty packed output is filled")
            out.zero_(), lse.fill_(float("-inf"))
        return out, lse
    if decode_step:
        decode.attention_packed(q, k, v, out, lse, _packed_cache_args(args))
        return out, lse
    cfg = config or gluon_fwd_config(head_dim, head_dim_v, q.dtype, q.device, batch * nheads * seqlen_q, seqlen_k,
                                     args.window_left, args.window_right, features, args.softcap)
    if cfg is not None and cfg.kernel.startswith("gluon"):
        reason = tma_unfit(q, k, v)
        if reason is None:
            sm90 = _forward_sm90_ws if cfg.kernel == "gluon-ws" else _forward_sm90
            sm90(q, k, v, out, lse, args, cfg, (batch, seqlen_q, seqlen_k, nheads // nheads_kv), features)
            return out, lse
        record_fallback(f"the Gluon Hopper forward needs TMA-compatible inputs ({reason})", "triton",
                        preferred="triton (Gluon Hopper kernel)")
        cfg = None
    cfg = cfg or fwd_config(max(head_dim, head_dim_v), q.dtype, q.device, seqlen_k, args.window_left,
                            args.window_right, softcap=args.softcap > 0, bias=args.attn_bias is not None,
                            head_dim_v=head_dim_v, dropout=args.dropout_p > 0)
    grid = (cdiv(seqlen_q, cfg.BLOCK_M), nheads, batch)
    even_m = not args.varlen and seqlen_q % cfg.BLOCK_M == 0

    def static():
        return dict(group=nheads // nheads_kv, **_head_dims(head_dim, head_dim_v), BLOCK_M=cfg.BLOCK_M,
                    BLOCK_N=cfg.BLOCK_N, HAS_SINK=args.sink is not None, EVEN_M=even_m,
                    **_variant_static(q, args, nheads), num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    # Lengths and strides are dynamic: the key holds the head counts and dims the static arguments need.
    key = (nheads, nheads_kv, head_dim, head_dim_v, q.dtype, even_m, q.device, _args_key(args, lengths=False), cfg)
    stride_lse_b, stride_lse_h = lse_strides(lse, args.varlen)
    with on_device(q):
        _FWD(key, grid, dict(Q=q, K=k, V=v, O=out, LSE=lse, SINK=args.sink if args.sink is not None else q,
                             softmax_scale=args.softmax_scale, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                             stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h,
                             **_strides(args.varlen, q=q, k=k, v=v, o=out), **_variant_tensors(q, args)), static)
    return out, lse


def _cache_args(args: AttnArgs, **cache) -> KVCacheArgs:
    """A call's arguments as a KV-cache call's (no new tokens): the same keys, masks and features. Dense:
    over a full cache (``max_seqlen_k`` keys); see also :func:`_packed_cache_args`."""
    return KVCacheArgs(softmax_scale=args.softmax_scale, causal=args.causal, window_left=args.window_left,
                       window_right=args.window_right, softcap=args.softcap, alibi_slopes=args.alibi_slopes,
                       sink=args.sink, **cache)


def _packed_cache_args(args: AttnArgs) -> KVCacheArgs:
    """A varlen call's arguments as a KV-cache call's whose cache row is the whole packed k: sequence ``b``'s
    keys are rows ``cu_seqlens_k[b]..cu_seqlens_k[b + 1]`` as left padding and lengths (views: nothing is
    computed), of which the kernel takes the first ``seqused_k[b]``; ``max_seqlen_k`` stays the longest
    sequence's (it sizes the splits)."""
    return _cache_args(args, max_seqlen_q=args.max_seqlen_q, max_seqlen_k=args.max_seqlen_k,
                       cu_seqlens_q=args.cu_seqlens_q, cache_seqlens=args.cu_seqlens_k[1:],
                       cache_leftpad=args.cu_seqlens_k[:-1], seqused_k=args.seqused_k)


def tma_unfit(*tensors) -> str | None:
    """Why the TMA cannot read these ``(batch, seqlen, heads, headdim)`` tensors (q, k, v and maybe dO; it needs
    a 16-byte aligned start and strides), or None."""
    for name, t in zip(("q", "k", "v", "dO"), tensors):
        if t.data_ptr() % 16 or any(stride * t.element_size() % 16 for stride in t.stride()[:-1]):
            return f"{name} starts at {t.data_ptr() % 16} bytes past 16-byte alignment with strides {t.stride()}"
    return None


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def _tma_layout(tile: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(tile), _GL_DTYPES[dtype])


def _tma_desc(t: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """A TMA descriptor of ``(batch, seqlen, heads, headdim)`` tensor ``t`` that reads ``rows`` rows of one head
    (their first ``cols`` columns; all without)."""
    tile = (1, rows, 1, cols or t.shape[3])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(tile), _tma_layout(tile, t.dtype))


# The descriptors carry the data pointers (the launcher encodes them per call); their shapes and strides
# are in the launch key.
_FWD_SM90 = CachedLaunch(attn_fwd_sm90, ("q_desc", "k_desc", "v_desc", "q_tail_desc", "k_tail_desc", "O", "LSE",
                                         "qk_scale", "softcap2", "row_max", "ALIBI_SLOPES", "SINK", "CU_SEQLENS_Q",
                                         "CU_SEQLENS_K", "SEQUSED_K", "CACHE_SEQLENS", "CACHE_LEFTPAD",
                                         "CACHE_BATCH_IDX") + _SEQUENCE_BOUNDS)


def _score_constants(args: AttnArgs, dtype: torch.dtype, features: frozenset) -> tuple:
    """The Gluon forwards' score constants: ``(qk_scale, softcap2, row_max, fold)``. With softcap the scores
    are ``softcap2 * tanh(q.k * qk_scale)`` in log2 units, without it ``q.k * qk_scale``; ``row_max``: the
    fixed row max (configs.fixed_row_max) or None; ``fold``: whether Q takes ``qk_scale`` (host.fold_scale)."""
    if args.softcap > 0:
        qk_scale, softcap2 = args.softmax_scale / args.softcap, args.softcap * LOG2E
    else:
        qk_scale, softcap2 = args.softmax_scale * LOG2E, 0.0
    return qk_scale, softcap2, fixed_row_max(args.softcap, dtype, features), fold_scale(args)


def _qk_descs(q, k, cfg) -> tuple:
    """The Gluon forwards' TMA descriptors of q and k (``cfg.BLOCK_M`` and ``cfg.BLOCK_N`` rows): ``(q_desc, k_desc,
    q_tail, k_tail)``. A head dim that is no power of two (192) is read as its largest power-of-two columns (128)
    and the rest (the kernels' ``TAIL``); without a tail the kernel reads no tail descriptor, and None spares the
    launcher encoding one per call."""
    main = 1 << (q.shape[3].bit_length() - 1)
    if main == q.shape[3]:
        return _tma_desc(q, cfg.BLOCK_M), _tma_desc(k, cfg.BLOCK_N), None, None
    return (_tma_desc(q[..., :main], cfg.BLOCK_M), _tma_desc(k[..., :main], cfg.BLOCK_N),
            _tma_desc(q[..., main:], cfg.BLOCK_M), _tma_desc(k[..., main:], cfg.BLOCK_N))


def _forward_sm90(q, k, v, out, lse, args: AttnArgs, cfg, shape: tuple, features: frozenset):
    """Launch the Gluon Hopper forward (kernels/fwd_sm90.py); ``shape``: ``(batch, seqlen_q, seqlen_k, group)``,
    the seqlens of packed sequences their maxima, a KV cache's ``seqlen_k`` its capacity."""
    batch, seqlen_q, seqlen_k, group = shape
    nheads = q.shape[-2]
    kvcache = isinstance(args, KVCacheArgs)
    # The packed rows (or a KV cache's batch rows), taken before the packed tensors become one TMA batch row.
    bounds = _sequence_bounds(q, args, k)
    if args.varlen:
        # Packed (tokens, heads, headdim) tensors are one batch row of the TMA's 4-d view.
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    alibi = args.alibi_slopes  # (batch, nheads), maybe broadcast
    qk_scale, softcap2, row_max, fold = _score_constants(args, q.dtype, features)

    cache_tensors = (args.cache_seqlens, args.cache_leftpad, args.cache_batch_idx) if kvcache else (None,) * 3

    def static():
        stride_lse_b, stride_lse_h = lse_strides(lse, args.varlen)
        return dict(
            window_left=args.window_left, window_right=args.window_right,
            stride_alibi_b=alibi.stride(0) if alibi is not None else 0,
            **_strides(args.varlen, o=out), stride_lse_b=stride_lse_b,
            stride_lse_h=stride_lse_h, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=group,
            seqlen_new=args.seqlen_new if kvcache else 0,
            MASK_LEFT=args.window_left >= 0, MASK_RIGHT=args.window_right >= 0, SOFTCAP=args.softcap > 0,
            ALIBI=alibi is not None, HAS_SINK=args.sink is not None, **gluon_ring(cfg, q.shape[3]),
            FIXED_MAX=row_max is not None, FOLD_SCALE=fold, TAIL=tail,
            IS_VARLEN=args.varlen, HAS_SEQUSED=args.seqused_k is not None,
            KVCACHE=kvcache,
            **dict(zip(("HAS_SEQLENS", "HAS_LEFTPAD", "HAS_BATCH_IDX"), (t is not None for t in cache_tensors))),
            num_warps=cfg.num_warps)

    q_desc, k_desc, q_tail, k_tail = _qk_descs(q, k, cfg)
    tail = q_tail is not None
    key = (_layout_key(q, k, v, out, lse), q.device, _args_key(args), cfg, row_max is not None, fold,
           decode.cache_key(args) if kvcache else None)
    with on_device(q):
        _FWD_SM90(key, (cdiv(seqlen_q, cfg.BLOCK_M), nheads, batch),
                  dict(q_desc=q_desc, k_desc=k_desc, v_desc=_tma_desc(v, cfg.BLOCK_N), q_tail_desc=q_tail,
                       k_tail_desc=k_tail, O=out, LSE=lse, qk_scale=qk_scale, softcap2=softcap2,
                       row_max=row_max or 0.0, ALIBI_SLOPES=alibi if alibi is not None else q,
                       SINK=args.sink if args.sink is not None else q, **_sequence_tensors(q, args), **bounds,
                       **dict(zip(("CACHE_SEQLENS", "CACHE_LEFTPAD", "CACHE_BATCH_IDX"),
                                  (t if t is not None else q for t in cache_tensors)))),
                  static)


_FWD_SM90_WS = CachedLaunch(attn_fwd_sm90_ws, ("q_desc", "k_desc", "v_desc", "q_tail_desc", "k_tail_desc", "O", "LSE",
                                               "SINK", "ALIBI_SLOPES", "qk_scale", "softcap2", "row_max"))
# The consumers' registers after ``setmaxnreg``, and the cap the kernel is compiled under (what each warp
# holds before the partitions resize), by consumer warpgroups (TileConfig.consumers): 2 x 4 consumer warps at 240
# and the producer warp at 24 fit the SM's 64K registers; 3 x 4 at 160 beside it, 16 warps (the producer's
# padded to a warpgroup) of 128 (FlashAttention-3's split at three warpgroups: 160 and 32).
_WS_REGS = {2: (240, 168), 3: (160, 128)}


def _forward_sm90_ws(q, k, v, out, lse, args: AttnArgs, cfg, shape: tuple, features: frozenset):
    """Launch the warp-specialized Hopper forward (kernels/fwd_sm90_ws.py) on dense ``(batch, seqlen, heads, d)``
    inputs, d = 64, 128 or 256 for q, k and v alike (the descriptors read whole rows), or 192 for q and k with 128 for
    v (q and k read as 128 + 64 columns: :func:`_qk_descs`); ``shape``: ``(batch, seqlen_q, seqlen_k, group)``. A CTA's
    tile is ``cfg.consumers`` warpgroups of ``cfg.BLOCK_M`` rows."""
    if cfg.consumers not in _WS_REGS:
        raise ValueError(f"config: the warp-specialized forward runs 2 or 3 consumer warpgroups, got "
                         f"consumers={cfg.consumers}")
    batch, seqlen_q, seqlen_k, group = shape
    nheads = q.shape[2]
    causal = args.window_right >= 0
    tiles = cdiv(seqlen_q, cfg.consumers * cfg.BLOCK_M) * nheads * batch
    consumer_regs, maxnreg = _WS_REGS[cfg.consumers]
    ctas = configs.ws_ctas(causal, tiles, configs.sm_count(q.device))
    alibi = args.alibi_slopes  # (batch, nheads), maybe broadcast
    qk_scale, softcap2, row_max, fold = _score_constants(args, q.dtype, features)

    def static():
        stride_lse_b, stride_lse_h = lse_strides(lse, False)
        return dict(stride_alibi_b=alibi.stride(0) if alibi is not None else 0, window_left=args.window_left,
                    window_right=args.window_right, **_strides(False, o=out), stride_lse_b=stride_lse_b,
                    stride_lse_h=stride_lse_h, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=group, nheads=nheads,
                    num_tiles=tiles, MASK_LEFT=args.window_left >= 0, MASK_RIGHT=causal, SOFTCAP=args.softcap > 0,
                    ALIBI=alibi is not None, HAS_SINK=args.sink is not None, FIXED_MAX=row_max is not None,
                    FOLD_SCALE=fold, STAGES=cfg.num_stages, CONSUMER_REGS=consumer_regs,
                    TAIL=q_tail is not None, CONSUMERS=cfg.consumers, PINGPONG=cfg.pingpong, num_warps=cfg.num_warps,
                    maxnreg=maxnreg)

    q_desc, k_desc, q_tail, k_tail = _qk_descs(q, k, cfg)
    key = (_layout_key(q, k, v, out, lse), q.device, _args_key(args), cfg, ctas, row_max is not None, fold)
    with on_device(q):
        _FWD_SM90_WS(key, (ctas, ), dict(q_desc=q_desc, k_desc=k_desc, v_desc=_tma_desc(v, cfg.BLOCK_N),
                                         q_tail_desc=q_tail, k_tail_desc=k_tail, O=out, LSE=lse,
                                         SINK=args.sink if args.sink is not None else q,
                                         ALIBI_SLOPES=alibi if alibi is not None else q, qk_scale=qk_scale,
                                         softcap2=softcap2, row_max=row_max or 0.0), static)


def attention_kv(q, k_cache, v_cache, args: KVCacheArgs, config=None):
    """``decode.attention_kv``, or for chunked prefill on a contiguous cache the Gluon Hopper forward
    (``configs.gluon_kv_config``); ``config`` forces the KV-cache kernel's tiles (tuning sweeps)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    cfg = None
    # Decode steps (few query rows) and paged caches stay on the KV-cache kernel before any other work.
    if config is None and seqlen_q >= configs.GLUON_KV_MIN_QUERIES and not args.paged and batch and nheads:
        q, k_cache, v_cache = unit_stride(q), unit_stride(k_cache), unit_stride(v_cache)
        features = frozenset(present_features(args, head_dim, v_cache.shape[3]))
        cfg = gluon_kv_config(head_dim, v_cache.shape[3], q.dtype, q.device, batch, seqlen_q, nheads,
                              args.max_seqlen_k, args.window_left, args.window_right, features, args.softcap)
    if cfg is not None:
        reason = tma_unfit(q, k_cache, v_cache)
        if reason is None:
            return _forward_kvcache_sm90(q, k_cache, v_cache, args, cfg, features)
        record_fallback(f"the Gluon Hopper forward needs TMA-compatible inputs ({reason})", "triton",
                        preferred="triton (Gluon Hopper kernel)")
    return decode.attention_kv(q, k_cache, v_cache, args, config)


def _forward_kvcache_sm90(q, k_cache, v_cache, args: KVCacheArgs, cfg, features: frozenset):
    """A KV-cache call (contiguous cache, after ``append_kv``) on the Gluon Hopper forward. Returns
    ``(out, lse)`` as ``decode.attention_kv`` does."""
    batch, seqlen_q, nheads, _ = q.shape
    out = empty((batch, seqlen_q, nheads, v_cache.shape[3]), q.dtype, q.device)
    lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    _forward_sm90(q, k_cache, v_cache, out, lse, args, cfg,
                  (batch, seqlen_q, args.max_seqlen_k, nheads // k_cache.shape[2]), features)
    return out, lse


def backward(dout, q, k, v, out, lse, args: AttnArgs, dq, dk, dv, dsink=None, dbias=None, config=None, kv_splits=None,
             add_dq=False, one_pass=None):
    """``config`` overrides the tile table and ``kv_splits`` the dK/dV programs per key block (for tuning
    sweeps and tests); ``one_pass`` (a configs.OnePassConfig) makes a call that the one-pass kernel takes run it
    with those knobs (tuning sweeps), and is refused for any other."""
    if add_dq and dq.dtype != torch.float32:
        raise ValueError(f"add_dq: dq must be a float32 sum to add dQ to, got dq of dtype {dq.dtype}")
    if one_pass is not None and (config is not None or kv_splits):
        raise ValueError(f"one_pass: a one-pass override runs no pair, so config and kv_splits must be None, got "
                         f"config={config}, kv_splits={kv_splits}")
    if v.shape[-1] < NARROW_V and q.device.type == "cuda":
        dout, v, out = _widened(dout, v, out)
        dv_wide = torch.empty_like(v)
        backward(dout, q, k, v, out, lse, args, dq, dk, dv_wide, dsink, dbias, config, kv_splits, add_dq, one_pass)
        dv.copy_(dv_wide[..., :dv.shape[-1]])
        return
    q, k, v, out, dout = (unit_stride(t) for t in (q, k, v, out, dout))
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v = _shape(q, k, v, args)
    if dbias is not None:
        # Pairs outside the window are never visited: their dS is 0.
        replay.not_replayable("the bias gradient is zeroed")
        dbias.zero_()
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0:
        replay.not_replayable("empty gradients are zeroed")
        dk.zero_(), dv.zero_()
        if not add_dq:
            dq.zero_()
        if dsink is not None:
            dsink.zero_()
        return
    dq_out, dk_out, dv_out = (unit_stride(t) for t in (dq, dk, dv))
    if args.varlen:
        # Tokens past the last sequence get gradient 0 (the kernels zero keys past seqused_k).
        for grad, cu in ((dq_out, args.cu_seqlens_q), (dk_out, args.cu_seqlens_k), (dv_out, args.cu_seqlens_k)):
            if grad is not dq_out or not add_dq:
                _fill_tail(grad, cu, 0.0)
    features = frozenset(present_features(args, head_dim, head_dim_v))
    if one_pass is not None and one_pass.keys96 and not configs.one_pass_96_takes(head_dim, head_dim_v, features):
        raise ValueError(f"one_pass: 96-key CTAs take calls at head dims 192/128 with no feature but "
                         f"{sorted(configs.ONE_PASS_96_FEATURES)}, not all of {sorted(configs.ONE_PASS_96_APART)}, "
                         f"got {head_dim}/{head_dim_v} with {sorted(features)}")
    if one_pass is not None and one_pass.dk_rs and configs.one_pass_wide(head_dim, head_dim_v):
        raise ValueError(f"one_pass: dk_rs is a knob of the one-pass kernel at head dims 64 and 128 "
                         f"(kernels/bwd_sm90_ws.py), got head dims {head_dim}/{head_dim_v}")
    if one_pass is not None and one_pass.s_ahead and ((head_dim, head_dim_v) != (128, 128) or one_pass.dk_rs):
        # The next step's S^T held beside dQ, dK and dV does not fit the registers at 64 (128-row steps: 64 a thread)
        # or beside dk_rs's operand: ptxas would serialize every wgmma (C7512).
        raise ValueError(f"one_pass: s_ahead is a knob of the one-pass kernel at head dim 128 without dk_rs "
                         f"(kernels/bwd_sm90_ws.py), got head dims {head_dim}/{head_dim_v}, dk_rs={one_pass.dk_rs}")
    if one_pass is not None and one_pass.dq_rows and (configs.one_pass_wide(head_dim, head_dim_v)
                                                      or configs.one_pass_rows(head_dim, features) != 128):
        raise ValueError(f"one_pass: dq_rows splits 128-row steps (head dim 64 without softcap or packed "
                         f"sequences), got head dims {head_dim}/{head_dim_v} with {sorted(features)}")
    cfg = config or bwd_config(max(head_dim, head_dim_v), q.dtype, q.device, head_dim_v,
                               row_keys(seqlen_k, args.window_left, args.window_right), features)
    varlen = args.varlen
    delta = empty_like(lse)
    lse2 = empty_like(lse)
    stride_lse_b, stride_lse_h = lse_strides(lse, varlen)
    if config is None and not kv_splits:
        # Calls whose CTAs (configs.one_pass_keys) fill the GPU take the one-pass kernel when they allow dQ's reduce
        # order to vary.
        plan = configs.bwd_choice(cfg, head_dim, head_dim_v, q.dtype, q.device, features,
                                  (args.window_left, args.window_right), batch, nheads, nheads_kv, seqlen_q, seqlen_k,
                                  configs.deterministic(args.deterministic))
        if (plan.one_pass or plan.cfg.dkdv.kernel == "gluon") and (reason := tma_unfit(q, k, v, dout)) is not None:
            kernel = "one-pass Gluon Hopper backward" if plan.one_pass else "Gluon Hopper dK/dV backward"
            record_fallback(f"the {kernel} needs TMA-compatible inputs ({reason})", "triton",
                            preferred=f"triton ({kernel})")
            plan = configs.bwd_choice(cfg, head_dim, head_dim_v, q.dtype, q.device, features,
                                      (args.window_left, args.window_right), batch, nheads, nheads_kv, seqlen_q,
                                      seqlen_k, False, one_pass=False, gluon=False)
    else:
        # A tile override (tuning sweeps, tests) runs the pair on the Triton tiles given.
        plan = configs.BwdPlan(False, cfg, *configs.bwd_plan(batch, nheads, nheads_kv, seqlen_q, seqlen_k,
                                                      (args.window_left, args.window_right), cfg.dkdv.BLOCK_N,
                                                      q.device))
    # The one-pass kernel adds dQ up in float32 (zeroed by the preprocess, unless add_dq), then cast into dq; a
    # float32 dq that the TMA can address is that sum itself (no buffer of its own, no cast after).
    own_sum = plan.one_pass and dq_out.dtype == torch.float32 and tma_unfit(dq_out) is None
    if add_dq and plan.one_pass and not own_sum:
        # dQ to add to a sum the one-pass kernel cannot address: the pair's dQ kernel adds it.
        plan = configs.bwd_choice(cfg, head_dim, head_dim_v, q.dtype, q.device, features,
                                  (args.window_left, args.window_right), batch, nheads, nheads_kv, seqlen_q, seqlen_k,
                                  False, one_pass=False)
    if one_pass is not None and not plan.one_pass:
        raise ValueError(f"one_pass: this call (head dims {head_dim}/{head_dim_v}, {q.dtype}, batch {batch}, "
                         f"{nheads_kv} KV heads, {seqlen_k} keys, features {sorted(features)}) does not take the "
                         f"one-pass backward, got one_pass={one_pass}")
    tiles = one_pass or configs.one_pass_config(head_dim, configs.one_pass_keys96(head_dim, head_dim_v, features),
                                                features)
    one_pass, cfg, splits, alongside = plan.one_pass, plan.cfg, kv_splits or plan.parts, plan.alongside
    dq_acc = (dq_out if own_sum else empty(q.shape, torch.float32, q.device)) if one_pass else None
    # Split key blocks store float32 partial sums: one partial head per (KV head, part).
    dk_part, dv_part = dk_out, dv_out
    if splits > 1:
        dk_part, dv_part = (empty((*g.shape[:-2], nheads_kv * splits, g.shape[-1]), torch.float32, g.device)
                            for g in (dk_out, dv_out))
        if varlen:
            for part in (dk_part, dv_part):
                _fill_tail(part, args.cu_seqlens_k, 0.0)
    # Varlen lengths are dynamic arguments; dense ones are in the layouts.
    key = (_layout_key(q, k, v, out, dout, lse, dq_out, dk_part, dv_part), q.device, _args_key(args, lengths=False),
           cfg, dbias is not None, splits, add_dq, own_sum)

    def shared():
        return dict(stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h, group=nheads // nheads_kv,
                    **_bwd_head_dims(head_dim, head_dim_v), **_strides(varlen, q=q, k=k, v=v, do=dout),
                    **_variant_static(q, args, nheads))

    tensors = dict(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, softmax_scale=args.softmax_scale,
                   seqlen_q=seqlen_q, seqlen_k=seqlen_k, **_variant_tensors(q, args))
    with on_device(q):
        # Varlen: the preprocess walks all packed tokens as one sequence of a batch of 1.
        rows = q.shape[0] if varlen else seqlen_q
        _PREPROCESS((key, one_pass), (cdiv(rows, _PREPROCESS_BLOCK_M), nheads, 1 if varlen else batch),
                    dict(O=out, DO=dout, LSE=lse, DELTA=delta, LSE2=lse2, DQ_ACC=out if dq_acc is None else dq_acc),
                    lambda: dict(**_strides(varlen, o=out, do=dout, dq=out if dq_acc is None else dq_acc),
                                 stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h, seqlen_q=rows,
                                 HEAD_DIM_ACTUAL=head_dim_v, HEAD_DIM=padded_head_dim(head_dim_v),
                                 BLOCK_M=_PREPROCESS_BLOCK_M, ZERO_DQ=one_pass and not add_dq, DQ_DIM_ACTUAL=head_dim,
                                 DQ_DIM=padded_head_dim(head_dim)))
        if dsink is not None:
            _sink_grad(args.sink, lse, delta, dsink, varlen)
        if one_pass:
            _backward_sm90_ws(q, k, v, dout, dq_acc, dk_out, dv_out, lse2, delta, args, features, key, tiles)
            if dq_acc is not dq_out:
                _sum_parts(dq_acc, dq_out, 1, varlen)
        else:
            _backward_pair(cfg, key, tensors, shared, (batch, seqlen_q, seqlen_k, nheads, nheads_kv), splits, alongside,
                           q, k, v, dout, dq_out, dk_out, dv_out, dk_part, dv_part, lse2, delta, args, features, dbias,
                           add_dq)
        if splits > 1:
            # The parts of each KV head, added in a fixed order (run-to-run identical) and cast on the way.
            for part, grad in ((dk_part, dk_out), (dv_part, dv_out)):
                _sum_parts(part, grad, splits, varlen)
    for given, written in ((dq, dq_out), (dk, dk_out), (dv, dv_out)):
        if given is not written:
            replay.not_replayable("a gradient is copied back")
            given.copy_(written)


def _backward_pair(cfg, key, tensors: dict, shared, shape: tuple, splits: int, alongside: bool, q, k, v, dout, dq, dk,
                   dv, dk_part, dv_part, lse2, delta, args: AttnArgs, features: frozenset, dbias, add_dq: bool):
    """The two-kernel backward: dK/dV (the Gluon kernel, or bwd.py's into ``dk_part``/``dv_part`` with ``splits``
    parts a key block) and bwd.py's dQ kernel (``add_dq``: added to what dq holds); side by side on an under-filled
    GPU (``alongside``)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    varlen = args.varlen
    with fork(q, alongside) as side:
        if cfg.dkdv.kernel == "gluon":
            _backward_dkdv_sm90(q, k, v, dout, dk, dv, lse2, delta, args, cfg.dkdv, features, key, side)
        else:
            _DKDV(key, (cdiv(seqlen_k, cfg.dkdv.BLOCK_N), nheads_kv * splits, batch),
                  dict(DK=dk_part, DV=dv_part, **tensors),
                  lambda: dict(**shared(), **_strides(varlen, dk=dk_part, dv=dv_part), split=splits,
                               BLOCK_M=cfg.dkdv.BLOCK_M, BLOCK_N=cfg.dkdv.BLOCK_N,
                               EVEN_M=not varlen and seqlen_q % cfg.dkdv.BLOCK_M == 0,
                               num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages),
                  stream=side)
        _DQ(key, (cdiv(seqlen_q, cfg.dq.BLOCK_M), nheads, batch),
            dict(DQ=dq, DBIAS=dbias if dbias is not None else q, **tensors),
            lambda: dict(**shared(), **_strides(varlen, dq=dq), BLOCK_M=cfg.dq.BLOCK_M,
                         BLOCK_N=cfg.dq.BLOCK_N, WRITE_DBIAS=dbias is not None, ADD_DQ=add_dq,
                         EVEN_M=not varlen and seqlen_q % cfg.dq.BLOCK_M == 0,
                         num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages))


_DKDV_SM90 = CachedLaunch(attn_bwd_dkdv_sm90, ("q_desc", "k_desc", "v_desc", "do_desc", "DK", "DV", "LSE2", "DELTA",
                                               "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUSED_K", "qk_scale", "softcap2",
                                               "softmax_scale") + _BWD_LENGTHS + _SEQUENCE_BOUNDS)


def _backward_dkdv_sm90(q, k, v, dout, dk, dv, lse2, delta, args: AttnArgs, cfg, features: frozenset, key, stream):
    """Launch the Gluon Hopper dK/dV kernel (kernels/bwd_sm90.py) on ``(batch, seqlen, heads, 128)`` inputs, or
    packed ``(tokens, heads, 128)`` ones (varlen), on ``stream``; ``key``: the backward's launch key (which holds
    no lengths: they are dynamic arguments)."""
    varlen = args.varlen
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, _, _ = _shape(q, k, v, args)
    qk_scale, softcap2, _, fold = _score_constants(args, q.dtype, features)

    def static():
        stride_lse_b, stride_lse_h = lse_strides(lse2, varlen)
        return dict(window_left=args.window_left, window_right=args.window_right, **_strides(varlen, dk=dk, dv=dv),
                    stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h, group=nheads // nheads_kv,
                    MASK_LEFT=args.window_left >= 0, MASK_RIGHT=args.window_right >= 0, SOFTCAP=args.softcap > 0,
                    FAST_TANH=fast_tanh(q), FOLD_SCALE=fold, IS_VARLEN=varlen,
                    HAS_SEQUSED=args.seqused_k is not None, STAGES=cfg.num_stages, num_warps=cfg.num_warps)

    sequences = {**_sequence_tensors(lse2, args), **_sequence_bounds(q, args, k)}
    if varlen:
        # One batch row of all tokens for the TMA; each program finds its sequence's rows.
        q, k, v, dout = (t.unsqueeze(0) for t in (q, k, v, dout))
    # Whether the scale folds depends on the values of the scale and softcap, which the backward's key leaves out.
    _DKDV_SM90((key, fold), (cdiv(seqlen_k, cfg.BLOCK_N), nheads_kv, batch),
               dict(q_desc=_tma_desc(q, cfg.BLOCK_M), k_desc=_tma_desc(k, cfg.BLOCK_N), v_desc=_tma_desc(v, cfg.BLOCK_N),
                    do_desc=_tma_desc(dout, cfg.BLOCK_M), DK=dk, DV=dv, LSE2=lse2, DELTA=delta,
                    **sequences, qk_scale=qk_scale, softcap2=softcap2,
                    softmax_scale=args.softmax_scale, seqlen_q=seqlen_q, seqlen_k=seqlen_k),
               static, stream=stream)


_ONE_PASS_DYNAMIC = ("DK", "DV", "LSE2", "DELTA", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUSED_K", "ALIBI_SLOPES",
                     "qk_scale", "softcap2", "softmax_scale") + _BWD_LENGTHS
_BWD_WS = CachedLaunch(attn_bwd_sm90_ws, ("q_desc", "k_desc", "v_desc", "do_desc", "dq_desc") + _ONE_PASS_DYNAMIC)
_BWD_WIDE = CachedLaunch(attn_bwd_sm90_wide, ("q_desc", "q_tail_desc", "k_desc", "k_tail_desc", "v_desc", "v_tail_desc",
                                              "do_desc", "do_tail_desc", "dq_desc", "dq_tail_desc") + _ONE_PASS_DYNAMIC)
_BWD_WIDE96 = CachedLaunch(attn_bwd_sm90_wide96, ("q_desc", "q_tail_desc", "k_desc", "k_tail_desc", "v_desc", "do_desc",
                                                  "dq_desc") + _ONE_PASS_DYNAMIC)


def _backward_sm90_ws(q, k, v, dout, dq_acc, dk, dv, lse2, delta, args: AttnArgs, features: frozenset, key,
                      tiles: configs.OnePassConfig):
    """Launch the one-pass Hopper backward on ``(batch, seqlen, heads, d)`` inputs, or packed ``(tokens, heads, d)``
    ones (varlen): kernels/bwd_sm90_ws.py at head dim 64 or 128, kernels/bwd_sm90_wide.py at 192 with values of 128
    or 192, and at 256 (configs.one_pass_wide). dK and dV go into ``dk``/``dv``, dQ (scaled) is added into the
    zeroed float32 ``dq_acc`` (q's shape); ``features``: the call's, as :func:`backward` found them; ``key``: the
    backward's launch key (which holds no lengths: they are dynamic arguments); ``tiles``: the kernel's knobs (the
    wide kernel's alone take ``release_each`` and ``rotate``, the one at 64/128 alone ``dk_rs``, ``dq_rows`` and
    ``s_ahead``; ``keys96`` runs kernels/bwd_sm90_wide96.py instead)."""
    varlen = args.varlen
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v = _shape(q, k, v, args)
    wide = configs.one_pass_wide(head_dim, head_dim_v)
    key = (key, tiles)
    # Softcap's scale stays a multiply an element (the fold is not taken): folded into K, as the dK/dV kernel
    # does, it would round the K that dQ's product reads.
    qk_scale, softcap2, _, _ = _score_constants(args, q.dtype, frozenset())
    alibi = args.alibi_slopes  # (batch, nheads), maybe broadcast

    def static():
        stride_lse_b, stride_lse_h = lse_strides(lse2, varlen)
        # The wide kernel's score tiles are small: it takes ALiBi exactly, with no linear form; it reads v and dO
        # past their first 128 columns as a tail.
        own = (dict(V_TAIL=head_dim_v - 128, DQ_FIRST=tiles.dq_first, RELEASE_EACH=tiles.release_each,
                    ROTATE=tiles.rotate) if wide else dict(ALIBI_LINEAR=alibi is not None and args.window_right == 0,
                                                           DQ_FIRST=tiles.dq_first, DK_RS=tiles.dk_rs,
                                                           S_AHEAD=tiles.s_ahead))
        sequences = dict(IS_VARLEN=varlen, HAS_SEQUSED=args.seqused_k is not None)
        if tiles.keys96:
            # 96-key CTAs (kernels/bwd_sm90_wide96.py): values of 128, none of the 64-key switches.
            own = dict(DS_BUFS=tiles.ds_bufs)
        return dict(window_left=args.window_left, window_right=args.window_right, **_strides(varlen, dk=dk, dv=dv),
                    stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h, group=nheads // nheads_kv,
                    MASK_LEFT=args.window_left >= 0, MASK_RIGHT=args.window_right >= 0,
                    stride_alibi_b=alibi.stride(0) if alibi is not None else 0, SOFTCAP=args.softcap > 0,
                    FAST_TANH=fast_tanh(q), ALIBI=alibi is not None, **own, **sequences, STAGES=tiles.stages,
                    CONSUMER_REGS=tiles.consumer_regs, num_warps=4, maxnreg=tiles.maxnreg)

    if varlen:
        # One batch row of all tokens for the TMA; each CTA finds its sequence's rows (the descriptors' rows bound
        # their offsets).
        q, k, v, dout, dq_acc = (t.unsqueeze(0) for t in (q, k, v, dout, dq_acc))
    tensors = dict(DK=dk, DV=dv, LSE2=lse2, DELTA=delta, **_sequence_tensors(lse2, args),
                   ALIBI_SLOPES=alibi if alibi is not None else lse2, qk_scale=qk_scale, softcap2=softcap2,
                   softmax_scale=args.softmax_scale, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    # A CTA's keys; query steps of one_pass_rows rows.
    cta_keys = configs.one_pass_keys(head_dim, head_dim_v, tiles.keys96)
    rows = configs.one_pass_rows(head_dim, features)
    grid = (cdiv(seqlen_k, cta_keys), nheads_kv, batch)
    if wide:
        # Each tensor as its first 128 columns and the rest (192 = 128 + 64, 256 = 128 + 128); no tail of v and dO
        # at 128 (None).
        def parts(t, rows):
            main = _tma_desc(t[..., :128], rows)
            return (main, _tma_desc(t[..., 128:], rows)) if t.shape[3] > 128 else (main, None)

        (q_main, q_tail), (do_main, do_tail) = parts(q, rows), parts(dout, rows)
        if tiles.keys96:
            # Three consumers of 32 keys, each adding 64 of dQ's 192 columns.
            k_main, k_tail = parts(k, 32)
            _BWD_WIDE96(key, grid, dict(q_desc=q_main, q_tail_desc=q_tail, k_desc=k_main, k_tail_desc=k_tail,
                                        v_desc=_tma_desc(v, 32), do_desc=do_main, dq_desc=_tma_desc(dq_acc, rows, 64),
                                        **tensors), static)
            return
        (k_main, k_tail), (v_main, v_tail) = parts(k, cta_keys), parts(v, cta_keys)
        dq_main, dq_tail = parts(dq_acc, rows)
        _BWD_WIDE(key, grid, dict(q_desc=q_main, q_tail_desc=q_tail, k_desc=k_main, k_tail_desc=k_tail, v_desc=v_main,
                                  v_tail_desc=v_tail, do_desc=do_main, do_tail_desc=do_tail, dq_desc=dq_main,
                                  dq_tail_desc=dq_tail, **tensors), static)
        return
    # Each consumer owns half the CTA's keys and adds half of dQ's columns (dq_rows: half its rows).
    dq_desc = _tma_desc(dq_acc, rows // 2, head_dim) if tiles.dq_rows else _tma_desc(dq_acc, rows, head_dim // 2)
    _BWD_WS(key, grid, dict(q_desc=_tma_desc(q, rows), k_desc=_tma_desc(k, cta_keys // 2),
                            v_desc=_tma_desc(v, cta_keys // 2), do_desc=_tma_desc(dout, rows), dq_desc=dq_desc,
                            **tensors), static)


_SUM_BLOCK_M = 64
_SUM_PARTS = CachedLaunch(bwd_sum_parts, ("PART", "OUT"))


def _sum_parts(part: torch.Tensor, grad: torch.Tensor, splits: int, varlen: bool) -> None:
    """``grad`` (its dtype and strides) = the sum of ``splits`` consecutive heads of float32 ``part``, per head."""
    rows, batch = (grad.shape[0], 1) if varlen else (grad.shape[1], grad.shape[0])
    head_dim = grad.shape[-1]
    _SUM_PARTS((_layout_key(part, grad), grad.dtype, splits, varlen), (cdiv(rows, _SUM_BLOCK_M), grad.shape[-2], batch),
               dict(PART=part, OUT=grad),
               lambda: dict(seqlen=rows, **_strides(varlen, p=part, o=grad), HEAD_DIM_ACTUAL=head_dim,
                            HEAD_DIM=padded_head_dim(head_dim), SPLITS=splits, BLOCK_M=_SUM_BLOCK_M))


_TAIL_BLOCK_ROWS = 64
_FILL_TAIL = CachedLaunch(fill_tail, ("X", "LSE", "CU_SEQLENS", "value"))


def _fill_tail(x: torch.Tensor, cu_seqlens: torch.Tensor, value: float, lse: torch.Tensor | None = None) -> None:
    """Set the rows of packed ``x`` ``(total, nheads, head_dim)`` past ``cu_seqlens[-1]`` to ``value`` (and
    those columns of a forward's ``lse`` ``(nheads, total)`` to ``-inf``, in the same launch), reading the
    offset on the device (no host sync)."""
    total, nheads, head_dim = x.shape
    if total == 0:
        return
    if x.stride(-1) != 1 and head_dim > 1:
        raise ValueError(f"internal: rows to fill need unit stride on the last dim, got strides {x.stride()}")
    with on_device(x):
        _FILL_TAIL((x.shape, x.stride(), cu_seqlens.shape[0], x.dtype, _layout_key(lse) if lse is not None else None),
                   (cdiv(total, _TAIL_BLOCK_ROWS),), dict(X=x, LSE=lse if lse is not None else x, CU_SEQLENS=cu_seqlens,
                                                         value=value),
                   lambda: dict(batch=cu_seqlens.shape[0] - 1, total=total, stride_row=x.stride(0),
                                stride_h=x.stride(1), nheads=nheads, head_dim=head_dim,
                                stride_lse_h=lse.stride(0) if lse is not None else 0, BLOCK_R=_TAIL_BLOCK_ROWS,
                                BLOCK_C=min(triton.next_power_of_2(nheads * head_dim), 1024),
                                BLOCK_H=triton.next_power_of_2(nheads), HAS_LSE=lse is not None))


_SINK_BLOCK_M = 1024
_SINK_GRAD = CachedLaunch(bwd_sink_grad, ("SINK", "LSE", "DELTA", "DSINK"))


def _sink_grad(sink, lse, delta, dsink, varlen: bool) -> None:
    """``dsink`` (its dtype) = the sink's gradient from the forward's ``lse`` ``(batch, nheads, seqlen_q)``,
    or ``(nheads, tokens)`` packed, and the backward's ``delta``."""
    stride_lse_b, stride_lse_h = lse_strides(lse, varlen)
    batch, rows = (1, lse.shape[1]) if varlen else (lse.shape[0], lse.shape[2])
    _SINK_GRAD((lse.shape, lse.stride(), lse.device, sink.dtype, dsink.dtype, varlen), (sink.shape[0],),
               dict(SINK=sink, LSE=lse, DELTA=delta, DSINK=dsink),
               lambda: dict(batch=batch, rows=rows, stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h,
                            BLOCK_M=_SINK_BLOCK_M))
