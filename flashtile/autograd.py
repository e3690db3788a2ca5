"""Autograd glue: forward saves (q, k, v, out, lse); backward asks the same backend for gradients.

Backends share one contract (see ``flashtile/backends/__init__.py``): ``forward`` returns
``(out, lse)`` and ``backward`` writes ``dq, dk, dv`` into tensors it is handed, so the
packed variants can hand it views of one packed gradient instead of stacking copies.
Each runs inside ``torch.profiler.record_function`` under its kernel's name, so a trace
shows which path ran.
"""
from __future__ import annotations

import torch

from .alloc import empty_like
from .dispatch import get_backend, record_kernel


class FlashAttnFunc(torch.autograd.Function):
    """Attention on separate q, k, v in the ``(batch, seqlen, nheads, headdim)`` layout."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic, plan):
        out, lse = _forward(plan, q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, deterministic, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        _backward(ctx, dout, q, k, v, out, lse, dq, dk, dv)
        return dq, dk, dv, None, None, None, None


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    """Attention on ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)``; gradients land in one packed tensor."""

    @staticmethod
    def forward(ctx, qkv, softmax_scale, causal, deterministic, plan):
        out, lse = _forward(plan, *qkv.unbind(2), softmax_scale, causal)
        ctx.save_for_backward(qkv, out, lse)
        ctx.args = (softmax_scale, causal, deterministic, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qkv, out, lse = ctx.saved_tensors
        dqkv = empty_like(qkv)
        _backward(ctx, dout, *qkv.unbind(2), out, lse, *dqkv.unbind(2))
        return dqkv, None, None, None, None


class FlashAttnKVPackedFunc(torch.autograd.Function):
    """Attention on ``q`` and ``kv`` of shape ``(batch, seqlen_k, 2, nheads_kv, headdim)``."""

    @staticmethod
    def forward(ctx, q, kv, softmax_scale, causal, deterministic, plan):
        out, lse = _forward(plan, q, *kv.unbind(2), softmax_scale, causal)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = (softmax_scale, causal, deterministic, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = empty_like(q), empty_like(kv)
        _backward(ctx, dout, q, *kv.unbind(2), out, lse, dq, *dkv.unbind(2))
        return dq, dkv, None, None, None, None


def _forward(plan, q, k, v, softmax_scale, causal):
    with torch.profiler.record_function(plan.fwd_name):
        return get_backend(plan.backend).forward(q, k, v, softmax_scale, causal)


def _backward(ctx, dout, q, k, v, out, lse, dq, dk, dv) -> None:
    softmax_scale, causal, deterministic, plan = ctx.args
    record_kernel(plan.bwd_name)
    with torch.profiler.record_function(plan.bwd_name):
        get_backend(plan.backend).backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dq, dk, dv)
