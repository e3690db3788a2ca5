"""Host side of the Triton backend: strides, grids, allocation. Implements the backend contract
documented in ``flashtile/backends/__init__.py``."""
from __future__ import annotations

import contextlib

import torch
import triton

from ...alloc import empty
from ...rng import keep_threshold
from .. import AttnArgs
from .configs import bwd_config, fwd_config, padded_head_dim
from .kernels.bwd import bwd_dkdv, bwd_dq, bwd_preprocess
from .kernels.fwd import attn_fwd

_PREPROCESS_BLOCK_M = 64


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels address the head dim with stride 1; any other layout is read through strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _bsh(t: torch.Tensor, varlen: bool):
    """(batch, seq, head) strides of ``(batch, seq, heads, headdim)``, or of packed ``(tokens, heads, headdim)``
    with batch stride 0 (each sequence starts at its own row instead)."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _strides(varlen: bool, **tensors) -> dict:
    """``stride_<name>b``, ``stride_<name>m``/``n`` and ``stride_<name>h`` kernel arguments for each tensor."""
    result = {}
    for name, t in tensors.items():
        seq = "n" if name in ("k", "v", "dk", "dv") else "m"
        result.update(zip((f"stride_{name}b", f"stride_{name}{seq}", f"stride_{name}h"), _bsh(t, varlen)))
    return result


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in true fp32, never silently in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _on_device(t: torch.Tensor):
    # Switching devices costs host time on every call: only when t is not on the current one.
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _shape(q, k, v, args: AttnArgs):
    """``(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, headdim_v)``; varlen seqlens are the maxima."""
    if args.varlen:
        batch = args.cu_seqlens_q.shape[0] - 1
        return batch, args.max_seqlen_q, args.max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    batch, seqlen_q, nheads, head_dim = q.shape
    return batch, seqlen_q, k.shape[1], nheads, k.shape[2], head_dim, v.shape[3]


def _lse_strides(lse: torch.Tensor, varlen: bool):
    """(batch, head) strides of lse: ``(batch, nheads, seqlen_q)``, or ``(nheads, tokens)`` for varlen."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _variant_args(q, args: AttnArgs, batch: int, nheads: int) -> dict:
    """The kernels' arguments for softcap, window, ALiBi, sink, bias, dropout and varlen.
    Absent tensors are stood in for by ``q`` (never read: their switches are off)."""
    bias = args.attn_bias
    bias_kind = ""
    if bias is not None:
        bias_kind = "keep" if bias.dtype == torch.bool else "add"
        if bias.dtype == torch.bool:
            bias = bias.view(torch.uint8)  # same bytes; Triton loads uint8 more portably than bool
    bias_strides = bias.stride() if bias is not None else (0, 0, 0, 0)
    alibi = args.alibi_slopes
    varlen = args.varlen
    return dict(
        softcap=float(args.softcap), window_left=args.window_left, window_right=args.window_right,
        ALIBI_SLOPES=alibi if alibi is not None else q,
        BIAS_PTR=bias if bias is not None else q,
        seed=args.seed, offset=args.offset,
        threshold=keep_threshold(args.dropout_p), dropout_scale=1.0 / (1.0 - args.dropout_p),
        CU_SEQLENS_Q=args.cu_seqlens_q if varlen else q,
        CU_SEQLENS_K=args.cu_seqlens_k if varlen else q,
        SEQUSED_K=args.seqused_k if args.seqused_k is not None else q,
        stride_alibi_b=alibi.stride(0) if alibi is not None else 0,
        stride_bb=bias_strides[0], stride_bh=bias_strides[1], stride_bm=bias_strides[2], stride_bn=bias_strides[3],
        nheads=nheads,
        MASK_LEFT=args.window_left >= 0, MASK_RIGHT=args.window_right >= 0,
        SOFTCAP=args.softcap > 0,
        # The GPU's tanh.approx is within a 16-bit input's rounding; fp32 inputs get the exact formula.
        FAST_TANH=q.is_cuda and q.dtype != torch.float32,
        ALIBI=alibi is not None, BIAS=bias_kind, DROPOUT=args.dropout_p > 0,
        IS_VARLEN=varlen, HAS_SEQUSED=args.seqused_k is not None,
        INPUT_PRECISION=_input_precision(q.dtype),
    )


def _head_dims(head_dim: int, head_dim_v: int) -> dict:
    return dict(HEAD_DIM_QK_ACTUAL=head_dim, HEAD_DIM_QK=padded_head_dim(head_dim),
                HEAD_DIM_V_ACTUAL=head_dim_v, HEAD_DIM_V=padded_head_dim(head_dim_v))


def forward(q, k, v, args: AttnArgs, config=None):
    """``config`` overrides the tile table (for tuning sweeps)."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v = _shape(q, k, v, args)
    if args.varlen:
        # Rows past the last sequence belong to none: the kernels leave them as 0 / -inf.
        out = torch.zeros((*q.shape[:2], head_dim_v), dtype=q.dtype, device=q.device)
        lse = torch.full((nheads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out = empty((batch, seqlen_q, nheads, head_dim_v), q.dtype, q.device)
        lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    if seqlen_q == 0 or batch == 0:
        return out, lse
    cfg = config or fwd_config(max(head_dim, head_dim_v), q.dtype, q.device, args.causal,
                               score_mods=args.softcap > 0 or args.alibi_slopes is not None)
    grid = (triton.cdiv(seqlen_q, cfg.BLOCK_M), nheads, batch)
    with _on_device(q):
        attn_fwd[grid](
            q, k, v, out, lse, args.softmax_scale,
            SINK=args.sink if args.sink is not None else q,
            **_strides(args.varlen, q=q, k=k, v=v, o=out),
            stride_lse_b=_lse_strides(lse, args.varlen)[0], stride_lse_h=_lse_strides(lse, args.varlen)[1],
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=nheads // nheads_kv,
            **_head_dims(head_dim, head_dim_v), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
            HAS_SINK=args.sink is not None, EVEN_M=not args.varlen and seqlen_q % cfg.BLOCK_M == 0,
            **_variant_args(q, args, batch, nheads),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse


def backward(dout, q, k, v, out, lse, args: AttnArgs, dq, dk, dv, dsink=None, dbias=None, config=None):
    """``config`` overrides the tile table (for tuning sweeps)."""
    q, k, v, out, dout = (_unit_stride(t) for t in (q, k, v, out, dout))
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v = _shape(q, k, v, args)
    if dbias is not None:
        # Pairs outside the window are never visited: their dS is 0.
        dbias.zero_()
    if args.varlen:
        # Tokens outside every sequence (and keys past seqused_k) get gradient 0.
        dq.zero_(), dk.zero_(), dv.zero_()
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        if dsink is not None:
            dsink.zero_()
        return
    dq_out, dk_out, dv_out = (_unit_stride(t) for t in (dq, dk, dv))
    cfg = config or bwd_config(max(head_dim, head_dim_v), q.dtype, q.device)
    varlen = args.varlen
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    stride_lse_b, stride_lse_h = _lse_strides(lse, varlen)
    variant = _variant_args(q, args, batch, nheads)
    strides = _strides(varlen, q=q, k=k, v=v, do=dout)
    shared = dict(stride_lse_b=stride_lse_b, stride_lse_h=stride_lse_h, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  group=nheads // nheads_kv, **_head_dims(head_dim, head_dim_v), **strides, **variant)
    with _on_device(q):
        # Varlen: the preprocess walks all packed tokens as one sequence of a batch of 1.
        rows = q.shape[0] if varlen else seqlen_q
        bwd_preprocess[(triton.cdiv(rows, _PREPROCESS_BLOCK_M), nheads, 1 if varlen else batch)](
            out, dout, lse, delta, lse2, *_bsh(out, varlen), *_bsh(dout, varlen), stride_lse_b, stride_lse_h, rows,
            HEAD_DIM_ACTUAL=head_dim_v, HEAD_DIM=padded_head_dim(head_dim_v), BLOCK_M=_PREPROCESS_BLOCK_M,
        )
        if dsink is not None:
            dsink.copy_(_sink_grad(args.sink, lse, delta, varlen))
        bwd_dkdv[(triton.cdiv(seqlen_k, cfg.dkdv.BLOCK_N), nheads_kv, batch)](
            q, k, v, dout, dk_out, dv_out, lse2, delta, args.softmax_scale, **shared, **_strides(varlen, dk=dk_out, dv=dv_out),
            BLOCK_M=cfg.dkdv.BLOCK_M, BLOCK_N=cfg.dkdv.BLOCK_N,
            EVEN_M=not varlen and seqlen_q % cfg.dkdv.BLOCK_M == 0,
            num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages,
        )
        bwd_dq[(triton.cdiv(seqlen_q, cfg.dq.BLOCK_M), nheads, batch)](
            q, k, v, dout, dq_out, lse2, delta, dbias if dbias is not None else q, args.softmax_scale, **shared,
            **_strides(varlen, dq=dq_out),
            BLOCK_M=cfg.dq.BLOCK_M, BLOCK_N=cfg.dq.BLOCK_N, WRITE_DBIAS=dbias is not None,
            EVEN_M=not varlen and seqlen_q % cfg.dq.BLOCK_M == 0,
            num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages,
        )
    for given, written in ((dq, dq_out), (dk, dk_out), (dv, dv_out)):
        if given is not written:
            given.copy_(written)


def _sink_grad(sink, lse, delta, varlen: bool) -> torch.Tensor:
    """``dsink[h] = -sum over rows of exp(sink[h] - lse) * delta``: the sink's softmax share times
    the row's delta (the sink has no value, so its dP is 0)."""
    share = torch.exp(sink[:, None] - lse) if varlen else torch.exp(sink[None, :, None] - lse)
    # Rows outside every sequence have lse = -inf and no gradient.
    share = torch.where(lse == float("-inf"), 0.0, share)
    dims = (1,) if varlen else (0, 2)
    return -(share * delta).sum(dim=dims)
