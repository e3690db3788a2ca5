"""The ring's forward and backward over a schedule of block calls (shared by dense and packed sequences).

Each rank keeps its queries; the key/value shards travel the ring (rank r sends to r + 1), so at step
``s`` rank ``r`` holds the shard of rank ``r - s``. The exchange for the next step is started before
the step's blocks run, so it overlaps with them.

Forward: every block's ``(out, lse)`` is merged into float32 accumulators with the backend's
``merge_states`` (the same merge as :func:`flashtile.merge_attention_states`); an attention sink is
one more merge at the end (a logit with no value).

Backward (as in ring-flash-attention): each query row's global ``out`` and ``lse`` are final, so the
backend's block backward, given them, recomputes that block's probabilities exactly. dQ adds up
locally; the dK/dV partial sums of the held shard travel with it and arrive back at their owner.
The backward runs the steps last to first on the ring reversed (rank r + 1 sends to r). It starts on
the shard the forward ended with (saved for it: one more K/V shard of activation memory until then,
and nothing to exchange before the first blocks) and ends on the rank's own shard (no K/V to
receive), during which the dK/dV partial sums of that shard come home from the next rank. So every
transfer overlaps with blocks -- none is left exposed after the last step -- and on 2 ranks the
backward moves no K/V at all. A step's blocks run before it waits for the partial sums it adds to,
and their gradients are added into the received float32 sums (no zeroed accumulator per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import validation
from ..backends import AttentionCall, AttnArgs
from ..dispatch import Plan, dispatch, get_backend, merge_call, profiled, record_kernel
from .comm import Ring


@dataclass(frozen=True)
class BlockCall:
    """One backend call of a ring step: queries ``q0:q0 + rows`` of this rank's shard against keys
    ``k0:k0 + keys`` of the held shard. ``packed``: the views stay ``(tokens, nheads, d)`` and ``args``
    carries offsets; otherwise views of packed tensors get a batch dim of 1."""

    q0: int
    rows: int
    k0: int
    keys: int
    args: AttnArgs
    plan: Plan
    packed: bool = False


def plan_block(q, k, v, window: tuple, options: dict, **varlen) -> tuple:
    """``(args, plan)`` of a block call on views ``q, k, v`` with backend window ``window``: validated and
    dispatched like any flashtile call (counted in stats, refused in strict mode if it would fall back)."""
    args = validation.attn_args(q, k, v, window_size=window, varlen=bool(varlen), **options, **varlen)
    return args, dispatch(AttentionCall.of(q, k, v, args))


def _narrow(x: torch.Tensor, dim: int, start: int, length: int, batch: bool) -> torch.Tensor:
    view = x.narrow(dim, start, length)
    return view.unsqueeze(0) if batch else view


class RingRun:
    """One ring attention call: the ring, the block calls of every step and the sink, for forward and backward.

    ``steps[s]`` lists the :class:`BlockCall` of step ``s``. Tensors are dense ``(batch, seqlen, nheads, d)``
    (lse ``(batch, nheads, seqlen)``) or packed ``(tokens, nheads, d)`` (lse ``(nheads, tokens)``).
    """

    def __init__(self, ring: Ring, steps: list, label: str):
        self.ring, self.steps = ring, steps
        # What a profiler trace and flashtile.stats() show, e.g. flashtile.ring[fwd zigzag P=4 causal].
        self.fwd_name, self.bwd_name = f"flashtile.ring[fwd {label}]", f"flashtile.ring[bwd {label}]"

    def _views(self, call: BlockCall, seq: int, q, k, v):
        batch = seq == 0 and not call.packed
        return (_narrow(q, seq, call.q0, call.rows, batch), _narrow(k, seq, call.k0, call.keys, batch),
                _narrow(v, seq, call.k0, call.keys, batch))

    def forward(self, q, k, v, sink):
        """``(out, lse, last)``: out in q's dtype, lse float32, ``last`` the ``(k, v)`` shard held at the
        last step (the backward starts with it)."""
        seq = q.dim() - 3
        packed = seq == 0
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
        lse_shape = (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
        merge = dispatch(merge_call(out if not packed else out.unsqueeze(0)))
        merge_states = get_backend(merge.backend).merge_states
        record_kernel(self.fwd_name)
        held = (k, v)
        untouched = True  # out and lse still hold nothing: a block over every row is copied, not merged
        with profiled(self.fwd_name):
            for step, calls in enumerate(self.steps):
                pending = self.ring.start(held) if step + 1 < len(self.steps) else None
                for call in calls:
                    qb, kb, vb = self._views(call, seq, q, *held)
                    with profiled(call.plan.fwd_name):
                        block_out, block_lse = get_backend(call.plan.backend).forward(qb, kb, vb, call.args)
                    rows_out = _narrow(out, seq, call.q0, call.rows, packed)
                    rows_lse = _narrow(lse, lse.dim() - 1, call.q0, call.rows, packed)
                    if packed and call.packed:
                        block_out, block_lse = block_out.unsqueeze(0), block_lse.unsqueeze(0)
                    if untouched and call.rows == q.shape[seq]:
                        rows_out.copy_(block_out)
                        rows_lse.copy_(block_lse)
                        untouched = False
                        continue
                    untouched = False
                    with profiled(merge.fwd_name):
                        # The merge reads either out in float32, whatever its dtype.
                        merged_out, merged_lse = merge_states(rows_out, rows_lse, block_out, block_lse)
                    if call.rows == q.shape[seq]:
                        # Every row: the merged tensors become the accumulators (no copy back).
                        out, lse = (merged_out[0], merged_lse[0]) if packed else (merged_out, merged_lse)
                    else:
                        rows_out.copy_(merged_out)
                        rows_lse.copy_(merged_lse)
                if pending is not None:
                    held = self.ring.finish(pending)
            if sink is not None:
                out, lse = _add_sink(out, lse, sink, packed)
        return out.to(q.dtype), lse, held

    def backward(self, dout, q, k, v, out, lse, sink, last):
        """``(dq, dk, dv, dsink)``, dsink None without a sink (this rank's rows' share: sum it over the group
        as any replicated parameter's gradient). ``last``: the shard :meth:`forward` ended with."""
        seq = q.dim() - 3
        packed = seq == 0
        dq = None
        record_kernel(self.bwd_name)
        held = last
        dkv_pending = None
        with profiled(self.bwd_name):
            for step in reversed(range(len(self.steps))):
                # The shard of step - 1 comes from the next rank; step 0's is this rank's own.
                pending = self.ring.start(held, reverse=True) if step > 1 else None
                grads = [self._block_backward(call, seq, dout, q, *held, out, lse) for call in self.steps[step]]
                final = step == 0  # the sums are complete: rounded to the inputs' dtypes on the last add
                dq = _accumulate(dq, q, seq, [(c.q0, c.rows, batch, dqb) for c, batch, dqb, _, _ in grads], final)
                # The partial sums of the held shard from the ranks it visited before (None on the first step).
                earlier_dk, earlier_dv = (None, None) if dkv_pending is None else self.ring.finish(dkv_pending)
                dk = _accumulate(earlier_dk, k, seq, [(c.k0, c.keys, batch, g) for c, batch, _, g, _ in grads], final)
                dv = _accumulate(earlier_dv, v, seq, [(c.k0, c.keys, batch, g) for c, batch, _, _, g in grads], final)
                dkv_pending = self.ring.start((dk, dv), reverse=True) if step > 0 else None
                held = self.ring.finish(pending) if pending is not None else (k, v)
        dsink = None if sink is None else _sink_grad(dout, out, lse, sink, packed)
        return dq, dk, dv, dsink

    def _block_backward(self, call: BlockCall, seq: int, dout, q, k, v, out, lse) -> tuple:
        """``(call, batch, dq, dk, dv)`` of one block call on the held shard ``k, v``: the gradients of its rows
        and keys in the inputs' dtype (``batch``: they carry a batch dim of 1 that the accumulators lack)."""
        batch = seq == 0 and not call.packed
        qb, kb, vb = self._views(call, seq, q, k, v)
        dout_b = _narrow(dout, seq, call.q0, call.rows, batch)
        out_b = _narrow(out, seq, call.q0, call.rows, batch)
        # Contiguous: the backends read the lse of the rows they are given with their own strides.
        lse_b = _narrow(lse, lse.dim() - 1, call.q0, call.rows, batch).contiguous()
        dqb, dkb, dvb = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        record_kernel(call.plan.bwd_name)
        with profiled(call.plan.bwd_name):
            get_backend(call.plan.backend).backward(dout_b, qb, kb, vb, out_b, lse_b, call.args, dqb, dkb, dvb, None,
                                                    None)
        return call, batch, dqb, dkb, dvb


def _accumulate(total, like: torch.Tensor, seq: int, parts: list, final: bool = False) -> torch.Tensor:
    """``total`` (float32, ``like``'s shape; None: zeros) plus every ``(start, length, batch, grad)`` of ``parts``
    at rows ``start:start + length`` along ``seq``. A first part over every row with no total yet is upcast
    (one kernel, where a zeroed accumulator and an add are two). ``final``: the sum in ``like``'s dtype; a last
    part over every row is added and rounded in one kernel (the float32 sum rounded once, as by a cast after)."""
    for i, (start, length, batch, grad) in enumerate(parts):
        whole = length == like.shape[seq]
        if final and whole and i == len(parts) - 1:
            grad = grad.reshape(like.shape)
            return grad if total is None else torch.add(total, grad, out=torch.empty_like(like))
        if total is None and whole:
            total = grad.reshape(like.shape).float()
            continue
        if total is None:
            total = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        _narrow(total, seq, start, length, batch).add_(grad)
    if total is None:
        total = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    return total.to(like.dtype) if final else total


def _sink_rows(sink: torch.Tensor, packed: bool) -> torch.Tensor:
    """The sink as float32 broadcast to the lse's layout."""
    sink = sink.float()
    return sink.view(-1, 1) if packed else sink.view(1, -1, 1)


def _to_out_layout(x: torch.Tensor, packed: bool) -> torch.Tensor:
    """An lse-shaped tensor as a factor of out: ``(nheads, T) -> (T, nheads, 1)``, ``(B, H, L) -> (B, L, H, 1)``."""
    return x.transpose(0, 1).unsqueeze(-1) if packed else x.transpose(1, 2).unsqueeze(-1)


def _add_sink(out, lse, sink, packed):
    """The sink's logit added to every row's softmax denominator (it has no value vector)."""
    total = torch.logaddexp(lse, _sink_rows(sink, packed))
    return out * _to_out_layout(torch.exp(lse - total), packed), total


def _sink_grad(dout, out, lse, sink, packed):
    """dL/dsink[h] = -sum over rows of P_sink * delta, with P_sink = exp(sink - lse) and delta = dout . out."""
    delta = (dout.float() * out.float()).sum(-1)
    delta = delta.transpose(0, 1) if packed else delta.transpose(1, 2)
    p_sink = torch.exp(_sink_rows(sink, packed) - lse)
    dims = (1,) if packed else (0, 2)
    return (-(p_sink * delta).sum(dims)).to(sink.dtype)


class RingFunction(torch.autograd.Function):
    """Autograd of a :class:`RingRun`: ``(out, lse)`` from ``(q, k, v, sink)``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, run: RingRun):
        out, lse, last = run.forward(q, k, v, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink, *last)
        ctx.run = run
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None, None
        q, k, v, out, lse, sink, *last = ctx.saved_tensors
        dq, dk, dv, dsink = ctx.run.backward(dout.contiguous(), q, k, v, out, lse, sink, tuple(last))
        return dq, dk, dv, dsink if ctx.needs_input_grad[3] else None, None
