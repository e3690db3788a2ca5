"""The attention call as ``torch.library`` custom ops, so ``torch.compile(..., fullgraph=True)``
traces a model that calls flashtile without a graph break.

The public functions route here only while compiling; eager calls keep the autograd Functions of
:mod:`flashtile.autograd` (whose packed variants write one packed gradient without a copy). The
ops' real implementations dispatch at run time, so stats, strict mode and fallbacks behave as in
eager; their fake implementations only describe shapes (any sequence length: no recompile per
length) and refuse, at trace time, features no backend implements.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op

from .alloc import empty_like
from .backends import AttentionCall
from .dispatch import check_features, dispatch, get_backend, plan, record_kernel


def _call(q, k, causal, dropout_p, window_left, window_right, softcap, alibi_slopes) -> AttentionCall:
    return AttentionCall.of(q, k, causal, dropout_p, (window_left, window_right), softcap, alibi_slopes)


@custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
                  dropout_p: float, window_left: int, window_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``flash_attn_func``; the backend is chosen (and recorded) when it runs."""
    chosen = dispatch(_call(q, k, causal, dropout_p, window_left, window_right, softcap, alibi_slopes))
    with torch.profiler.record_function(chosen.fwd_name):
        return get_backend(chosen.backend).forward(q, k, v, softmax_scale, causal)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, softmax_scale, causal, dropout_p, window_left, window_right, softcap, alibi_slopes):
    check_features(_call(q, k, causal, dropout_p, window_left, window_right, softcap, alibi_slopes))
    batch, seqlen_q, nheads, headdim = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@custom_op("flashtile::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, on the backend the forward's dispatch rules pick for the same call."""
    chosen = plan(AttentionCall.of(q, k, causal))
    record_kernel(chosen.bwd_name)
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    with torch.profiler.record_function(chosen.bwd_name):
        # Every backend's backward is deterministic (no atomics), so there is no flag to pass on.
        get_backend(chosen.backend).backward(dout, q, k, v, out, lse, softmax_scale, causal, True, dq, dk, dv)
    return dq, dk, dv


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs[:5]
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (softmax_scale, causal)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout.contiguous(), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, softmax_scale, causal, dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """``(out, lse)`` through the custom op (the compiled path of the public functions)."""
    window_left, window_right = window_size
    return attention_fwd(q, k, v, float(softmax_scale), bool(causal), float(dropout_p), int(window_left),
                         int(window_right), float(softcap), alibi_slopes)
