"""Autograd glue: forward saves (q, k, v, out, lse); backward asks the same backend for gradients.

Backends share one contract (see ``flashtile/backends/__init__.py``): ``forward(q, k, v, args)``
returns ``(out, lse)`` and ``backward`` writes ``dq, dk, dv`` (and ``dsink``, ``dbias`` when asked)
into tensors it is handed, so the packed variants can hand it views of one packed gradient instead
of stacking copies. The same Functions serve dense and varlen calls (``args.varlen``).

``sink`` and ``attn_bias`` are inputs of ``.apply`` (not only fields of ``args``) so that autograd
returns their gradients: ``dsink`` ``(nheads,)`` is made in the sink's dtype for the backend to fill;
``dbias`` arrives float32 ``(batch, nheads, seqlen_q, seqlen_k)`` and is summed down to the bias's
broadcast shape and cast to its dtype. Each is allocated only when its input requires grad.

Dropout counters are drawn once per forward (:func:`flashtile.rng.draw_seed_offset`; here, or by the
interface for a call without autograd), and the backward reuses them; a replay is given them. Each kernel
runs inside ``torch.profiler.record_function`` under its name, so a trace shows which path ran.

A call the interface keys (a training step repeats its shapes) comes with a
:class:`flashtile.replay.Kept`: its forward replays an earlier call's launches, and its backward is
recorded once and then replayed on ``(dout, *saved tensors)`` (:func:`_gradients`), which skips the
backend's planning and launch bookkeeping.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import replay
from .alloc import empty, empty_like
from .dispatch import get_backend, profiled, record_kernel


class FlashAttnFunc(torch.autograd.Function):
    """Attention on separate q, k, v: dense ``(batch, seqlen, nheads, headdim)`` or varlen
    ``(total_tokens, nheads, headdim)``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, attn_bias, args, plan, kept):
        out, lse = _forward(ctx, plan, (q, k, v), q, k, v, args, sink, attn_bias, kept)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors

        def run():
            dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
            return dq, dk, dv, *_backward(ctx, dout, q, k, v, out, lse, dq, dk, dv, sink_index=3, bias_index=4)

        return *_gradients(ctx, run, dout, (q, k, v, out, lse), 5), None, None, None


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    """Attention on ``qkv`` ``(batch, seqlen, 3, nheads, headdim)`` or varlen ``(total_tokens, 3, nheads, headdim)``;
    the gradient lands in one packed tensor."""

    @staticmethod
    def forward(ctx, qkv, sink, attn_bias, args, plan, kept):
        out, lse = _forward(ctx, plan, (qkv,), *_unpack(qkv), args, sink, attn_bias, kept)
        ctx.save_for_backward(qkv, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qkv, out, lse = ctx.saved_tensors

        def run():
            dqkv = empty_like(qkv)
            return dqkv, *_backward(ctx, dout, *_unpack(qkv), out, lse, *_unpack(dqkv), sink_index=1, bias_index=2)

        return *_gradients(ctx, run, dout, (qkv, out, lse), 3), None, None, None


class FlashAttnKVPackedFunc(torch.autograd.Function):
    """Attention on ``q`` and ``kv`` ``(batch, seqlen_k, 2, nheads_kv, headdim)`` or varlen
    ``(total_k, 2, nheads_kv, headdim)``; dK and dV land in one packed tensor."""

    @staticmethod
    def forward(ctx, q, kv, sink, attn_bias, args, plan, kept):
        out, lse = _forward(ctx, plan, (q, kv), q, *_unpack(kv), args, sink, attn_bias, kept)
        ctx.save_for_backward(q, kv, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse = ctx.saved_tensors

        def run():
            dq, dkv = empty_like(q), empty_like(kv)
            return dq, dkv, *_backward(ctx, dout, q, *_unpack(kv), out, lse, dq, *_unpack(dkv), sink_index=2,
                                       bias_index=3)

        return *_gradients(ctx, run, dout, (q, kv, out, lse), 4), None, None, None


def _unpack(packed: torch.Tensor) -> tuple:
    """Views of a packed tensor's parts: its packing dim is the third from last (dense or varlen)."""
    return packed.unbind(packed.dim() - 3)


def draw_dropout_counters(args):
    """``args`` with fresh dropout counters when it has dropout (else unchanged)."""
    if args.dropout_p == 0:
        return args
    from . import rng

    seed, offset = rng.draw_seed_offset()
    return replace(args, seed=seed, offset=offset)


def wants_grad(*tensors) -> bool:
    """Whether autograd would need the attention's backward: grad mode on and an input (None ignored) that
    requires a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def replay_inputs(inputs: tuple, sink, alibi_slopes=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_k=None) -> tuple:
    """What a replay of a call is given (:mod:`flashtile.replay`): ``inputs``, the sink, ALiBi slopes and bias
    (None where the call has none; the kernels read the latter two as broadcast views of them) and, for packed
    sequences (``cu_seqlens_q`` not None), the offsets and key counts its kernels read. ``cu_seqlens_k`` is
    None when it is ``cu_seqlens_q`` (a replay cannot take one tensor twice; the interface's key tells the
    cases apart)."""
    if cu_seqlens_q is None:
        return (*inputs, sink, alibi_slopes, attn_bias)
    return (*inputs, sink, alibi_slopes, attn_bias, cu_seqlens_q,
            None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k, seqused_k)


def replay_inputs_of(inputs: tuple, args) -> tuple:
    """:func:`replay_inputs` with the sink, ALiBi slopes, bias and offsets of validated ``args``."""
    return replay_inputs(inputs, args.sink, args.alibi_slopes, args.attn_bias, args.cu_seqlens_q, args.cu_seqlens_k,
                         args.seqused_k)


def dropout_counters(args) -> tuple:
    """The dropout (seed, offset) of ``args`` as a replay is given them: empty without dropout."""
    return (args.seed, args.offset) if args.dropout_p else ()


def run_forward(plan, q, k, v, args):
    """The backend's forward alone, ``(out, lse)``, on ``args`` whose dropout counters are drawn
    (:func:`draw_dropout_counters`). Calls that need no gradient run it without an autograd Function (which
    costs host time)."""
    with profiled(plan.fwd_name):
        return get_backend(plan.backend).forward(q, k, v, args)


def _forward(ctx, plan, inputs, q, k, v, args, sink, attn_bias, kept):
    """The forward of the Function given ``inputs`` (q, k, v as their views); a call whose ``kept`` replays
    fit runs as their launches, and one with ``kept`` and no fitting replay is recorded."""
    ctx.plan, ctx.kept = plan, kept
    # This call's dropout counters: the backward regenerates the same mask from them.
    ctx.args = args = draw_dropout_counters(args)
    given, counters = replay_inputs_of(inputs, args), dropout_counters(args)
    outputs = None if kept is None else replay.replayed(kept.forward, given, counters)
    if outputs is not None:
        out, lse = outputs
    elif kept is not None:
        (out, lse), kept.forward = replay.record(lambda: run_forward(plan, q, k, v, args), given, kept.forward,
                                                 counters)
    else:
        out, lse = run_forward(plan, q, k, v, args)
    # What the gradients of sink and attn_bias are reduced and cast to.
    ctx.sink_dtype = None if sink is None else sink.dtype
    ctx.bias_shape = None if attn_bias is None else attn_bias.shape
    ctx.bias_dtype = None if attn_bias is None else attn_bias.dtype
    ctx.mark_non_differentiable(lse)
    # The lse's gradient is never used: no zeros tensor is made for it.
    ctx.set_materialize_grads(False)
    return out, lse


def _gradients(ctx, run, dout, saved: tuple, count: int) -> tuple:
    """The first ``count`` gradients the Function returns, from ``run()``; None for each when the output got
    no gradient. A context with ``kept`` replays runs the backward as the recorded launches of an earlier
    call like it, on ``(dout, *saved)``, when their layouts fit, else records this one."""
    if dout is None:
        return (None,) * count
    refuse_double_backward()
    kept, args = ctx.kept, ctx.args
    inputs, counters = replay_inputs_of((dout, *saved), args), dropout_counters(args)
    grads = None if kept is None else replay.replayed(kept.backward, inputs, counters)
    if grads is not None:
        record_kernel(ctx.plan.bwd_name)
        return *grads, *(None,) * (count - len(grads))
    if kept is None:
        return run()
    grads, kept.backward = replay.record(run, inputs, kept.backward, counters)
    return grads


def refuse_double_backward() -> None:
    """Raise when the backward runs under ``create_graph=True``: the gradients would have no graph of their own,
    so a gradient of them (a gradient penalty) would come out silently wrong."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            "flashtile attention does not support double backward: its backward is a kernel with no derivative of "
            "its own, so backward(create_graph=True) (for a gradient of a gradient, e.g. a gradient penalty) is "
            "refused rather than answered wrongly; run that attention with torch's math SDPA instead"
        )


def _backward(ctx, dout, q, k, v, out, lse, dq, dk, dv, sink_index: int, bias_index: int):
    """Run the backend's backward into dq, dk, dv; returns ``(dsink, dbias)`` for autograd (None when not needed)."""
    args, plan = ctx.args, ctx.plan
    dsink = dbias = None
    if ctx.needs_input_grad[sink_index]:
        # Summed in float32 and stored in the sink's dtype by the backend.
        dsink = empty((args.sink.shape[0],), ctx.sink_dtype, q.device)
    if ctx.needs_input_grad[bias_index]:
        dbias = empty(tuple(args.attn_bias.shape), torch.float32, q.device)  # contiguous, as the contract asks
    record_kernel(plan.bwd_name)
    with profiled(plan.bwd_name):
        get_backend(plan.backend).backward(dout, q, k, v, out, lse, args, dq, dk, dv, dsink, dbias)
    if dbias is not None:
        dbias = dbias.sum_to_size(ctx.bias_shape).to(ctx.bias_dtype)
    return dsink, dbias
