"""Host side of the Triton backend: strides, grids, allocation. Implements the backend contract
documented in ``flashtile/backends/__init__.py``."""
from __future__ import annotations

import contextlib

import torch
import triton

from ...alloc import empty
from .configs import bwd_config, fwd_config, padded_head_dim
from .kernels.bwd import bwd_dkdv, bwd_dq, bwd_preprocess
from .kernels.fwd import attn_fwd

_PREPROCESS_BLOCK_M = 64


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels address the head dim with stride 1; any other layout is read through strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _bsh(t: torch.Tensor):
    """(batch, seq, head) strides of a ``(batch, seq, heads, headdim)`` tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in true fp32, never silently in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _on_device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def forward(q, k, v, softmax_scale, causal, config=None):
    """``config`` overrides the tile table (for tuning sweeps)."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    out = empty((batch, seqlen_q, nheads, head_dim), q.dtype, q.device)
    lse = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    if seqlen_q == 0:
        return out, lse
    if seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    cfg = config or fwd_config(head_dim, q.dtype, q.device, causal)
    grid = (triton.cdiv(seqlen_q, cfg.BLOCK_M), nheads, batch)
    with _on_device(q):
        attn_fwd[grid](
            q, k, v, out, lse, softmax_scale,
            *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(out),
            nheads, seqlen_q, seqlen_k,
            nheads // nheads_kv, HEAD_DIM_ACTUAL=head_dim, HEAD_DIM=padded_head_dim(head_dim),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
            IS_CAUSAL=causal, EVEN_M=seqlen_q % cfg.BLOCK_M == 0,
            INPUT_PRECISION=_input_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse


def backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dq, dk, dv, config=None):
    """``config`` overrides the tile table (for tuning sweeps)."""
    # No atomics anywhere: gradients are deterministic whatever `deterministic` says.
    del deterministic
    q, k, v, out, dout = (_unit_stride(t) for t in (q, k, v, out, dout))
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    if seqlen_q == 0 or seqlen_k == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    dq_out, dk_out, dv_out = (_unit_stride(t) for t in (dq, dk, dv))
    cfg = config or bwd_config(head_dim, q.dtype, q.device)
    pad_d = padded_head_dim(head_dim)
    precision = _input_precision(q.dtype)
    delta = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    lse2 = empty((batch, nheads, seqlen_q), torch.float32, q.device)
    with _on_device(q):
        bwd_preprocess[(triton.cdiv(seqlen_q, _PREPROCESS_BLOCK_M), nheads, batch)](
            out, dout, lse, delta, lse2, *_bsh(out), *_bsh(dout), nheads, seqlen_q,
            HEAD_DIM_ACTUAL=head_dim, HEAD_DIM=pad_d, BLOCK_M=_PREPROCESS_BLOCK_M,
        )
        bwd_dkdv[(triton.cdiv(seqlen_k, cfg.dkdv.BLOCK_N), nheads_kv, batch)](
            q, k, v, dout, dk_out, dv_out, lse2, delta, softmax_scale,
            *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *_bsh(dk_out), *_bsh(dv_out),
            nheads, nheads_kv, seqlen_q, seqlen_k,
            nheads // nheads_kv, HEAD_DIM_ACTUAL=head_dim, HEAD_DIM=pad_d,
            BLOCK_M=cfg.dkdv.BLOCK_M, BLOCK_N=cfg.dkdv.BLOCK_N,
            IS_CAUSAL=causal, EVEN_M=seqlen_q % cfg.dkdv.BLOCK_M == 0, INPUT_PRECISION=precision,
            num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages,
        )
        bwd_dq[(triton.cdiv(seqlen_q, cfg.dq.BLOCK_M), nheads, batch)](
            q, k, v, dout, dq_out, lse2, delta, softmax_scale,
            *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *_bsh(dq_out),
            nheads, seqlen_q, seqlen_k,
            nheads // nheads_kv, HEAD_DIM_ACTUAL=head_dim, HEAD_DIM=pad_d,
            BLOCK_M=cfg.dq.BLOCK_M, BLOCK_N=cfg.dq.BLOCK_N,
            IS_CAUSAL=causal, EVEN_M=seqlen_q % cfg.dq.BLOCK_M == 0, INPUT_PRECISION=precision,
            num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages,
        )
    for given, written in ((dq, dq_out), (dk, dk_out), (dv, dv_out)):
        if given is not written:
            given.copy_(written)
