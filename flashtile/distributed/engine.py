"""The ring's forward and backward over a schedule of block calls (shared by dense and packed sequences).

Each rank keeps its queries; the key/value shards travel the ring (rank r sends to r + 1), so at step
``s`` rank ``r`` holds the shard of rank ``r - s``. The exchange for the next step is started before
the step's blocks run, so it overlaps with them.

Forward: the first block over every row is the running ``(out, lse)``; every later block is merged into
it with the backend's ``merge_states`` (the same merge as :func:`flashtile.merge_attention_states`), in
place for a block over some rows, into a new tensor for one over every row: float32 between merges, the
inputs' dtype from the last one (one rounding, as a float32 sum cast at the end). An attention sink is
one more merge at the end (a logit with no value).

Backward (as in ring-flash-attention): each query row's global ``out`` and ``lse`` are final, so the
backend's block backward, given them, recomputes that block's probabilities exactly. dQ adds up
locally; the dK/dV partial sums of the held shard travel with it and arrive back at their owner (float32, or
with ``dkv_transfer="input"`` rounded to the inputs' dtype on each hop and added to in float32 between hops).
The backward runs the steps last to first on the ring reversed (rank r + 1 sends to r). It starts on
the shard the forward ended with (saved for it: one more K/V shard of activation memory until then,
and nothing to exchange before the first blocks) and ends on the rank's own shard (no K/V to
receive), during which the dK/dV partial sums of that shard come home from the next rank. So every
transfer overlaps with blocks -- none is left exposed after the last step -- and on 2 ranks the
backward moves no K/V at all. A step's blocks run before it waits for the partial sums it adds to.
The kernels write their gradients straight into the sums where they can (:class:`_Sum`): float32 rows
that hold nothing yet, and on the last step a float32 result, to which the sums that came home are added
in one pass that writes the inputs' dtype (one rounding, as a float32 sum cast at the end).

The host's work per call is small: the block calls are validated and dispatched once per kind of call
(:mod:`.ring` keeps them), and each block's launches are recorded on its first call and replayed on
later ones (:mod:`flashtile.replay`), as flash_attn_func's are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import replay, validation
from ..alloc import empty
from ..backends import AttentionCall, AttnArgs
from ..dispatch import (Plan, dispatch, enforce, get_backend, merge_call, plan, profiled, record_choice, record_kernel,
                        refusal)
from .comm import Ring


@dataclass(frozen=True)
class BlockCall:
    """One backend call of a ring step: queries ``q0:q0 + rows`` of this rank's shard against keys
    ``k0:k0 + keys`` of the held shard. ``packed``: the views stay ``(tokens, nheads, d)`` and ``args``
    carries offsets; otherwise views of packed tensors get a batch dim of 1. ``replays``: the recorded launches
    of the block (shared by the calls of one kind; None: not recorded), a :class:`flashtile.replay.Kept` for
    each way it is called (:func:`_kept`)."""

    q0: int
    rows: int
    k0: int
    keys: int
    args: AttnArgs
    plan: Plan
    packed: bool = False
    replays: dict | None = field(default=None, compare=False)


def _kept(call: BlockCall, how: tuple) -> replay.Kept | None:
    """The replays of ``call`` made the way ``how`` says: the forward, or the backward with its gradients' dtypes
    and whether it adds dQ (a replay checks its inputs' layouts, not their dtypes or the backend's options)."""
    return None if call.replays is None else call.replays.setdefault(how, replay.Kept())


def plan_block(q, k, v, window: tuple, options: dict, enforced: bool = True, **varlen) -> tuple:
    """``(args, plan)`` of a block call on views ``q, k, v`` with backend window ``window``: validated and
    dispatched like any flashtile call (counted in stats, refused in strict mode if it would fall back); without
    ``enforced`` only planned (:meth:`RingRun.record` enforces and counts it)."""
    args = validation.attn_args(q, k, v, window_size=window, varlen=bool(varlen), **options, **varlen)
    call = AttentionCall.of(q, k, v, args)
    return args, dispatch(call) if enforced else plan(call)


def _narrow(x: torch.Tensor, dim: int, start: int, length: int, batch: bool) -> torch.Tensor:
    view = x.narrow(dim, start, length)
    return view.unsqueeze(0) if batch else view


class RingRun:
    """One kind of ring attention call: the ring, the block calls of every step, for forward and backward
    (:mod:`.ring` keeps it for the calls like it).

    ``steps[s]`` lists the :class:`BlockCall` of step ``s``. Tensors are dense ``(batch, seqlen, nheads, d)``
    (lse ``(batch, nheads, seqlen)``) or packed ``(tokens, nheads, d)`` (lse ``(nheads, tokens)``).
    """

    def __init__(self, ring: Ring, steps: list, label: str, dkv_dtype: torch.dtype = torch.float32):
        self.ring, self.steps = ring, steps
        # The dtype the backward sends the dK/dV partial sums in (float32, or the inputs' 16-bit dtype).
        self.dkv_dtype = dkv_dtype
        sent = "" if dkv_dtype == torch.float32 else f" dkv={str(dkv_dtype).removeprefix('torch.')}"
        # What a profiler trace and flashtile.stats() show, e.g. flashtile.ring[bwd zigzag P=4 causal dkv=bfloat16],
        # with the transfers' stream priority when one was set (flashtile.ring[fwd zigzag P=4 causal nccl=high]).
        label += ring.note
        self.fwd_name, self.bwd_name = f"flashtile.ring[fwd {label}]", f"flashtile.ring[bwd {label}{sent}]"
        # The merge's plan, made on the first forward (kept while it runs on its preferred backend).
        self.merge = None
        # The last block call: the merge that takes it writes the inputs' dtype.
        self.last = next(((s, len(calls) - 1) for s, calls in reversed(list(enumerate(steps))) if calls), None)

    def record(self) -> None:
        """Enforce the dispatch policy on each kind of block call and count it, as :func:`dispatch` does (once per
        call: the plans are made once per kind of call, before the ranks compare shapes)."""
        seen = set()
        for calls in self.steps:
            for call in calls:
                if id(call.plan) not in seen:
                    seen.add(id(call.plan))
                    # stacklevel 4: the user's line (enforce <- record <- ring_attention).
                    enforce(call.plan, stacklevel=4)

    def refusal(self) -> Exception | None:
        """The error :meth:`record` would raise (the first block plan's that refuses), without recording."""
        return next((error for calls in self.steps for call in calls if (error := refusal(call.plan))), None)

    def _views(self, call: BlockCall, seq: int, q, k, v):
        batch = seq == 0 and not call.packed
        return (_narrow(q, seq, call.q0, call.rows, batch), _narrow(k, seq, call.k0, call.keys, batch),
                _narrow(v, seq, call.k0, call.keys, batch))

    def _merge_states(self, shape: tuple, device):
        """The backend's ``merge_states`` and the merge's plan (on float32 partial outputs of ``shape``
        ``(batch, seqlen, nheads, headdim_v)``), dispatched once per kind of call."""
        if self.merge is None or self.merge.fallback_reason is not None:
            # merge_call reads the shape, dtype and device of the outputs: a broadcast stand-in has them.
            stand_in = torch.empty((), dtype=torch.float32, device=device).expand(shape)
            self.merge = dispatch(merge_call(stand_in))
        else:
            record_choice(self.merge)
        return get_backend(self.merge.backend).merge_states, self.merge

    def _block_forward(self, call: BlockCall, q, k, v) -> tuple:
        """``(out, lse)`` of one block call on views ``q, k, v``: its recorded launches when they fit."""
        kept = _kept(call, ("forward",))
        with profiled(call.plan.fwd_name):
            outputs = None if kept is None else replay.replayed(kept.forward, (q, k, v), ranged=True)
            if outputs is not None:
                return outputs
            run = get_backend(call.plan.backend).forward
            if kept is None:
                return run(q, k, v, call.args)
            outputs, kept.forward = replay.record(lambda: run(q, k, v, call.args), (q, k, v), kept.forward)
            return outputs

    def forward(self, q, k, v, sink):
        """``(out, lse, last)``: out in q's dtype, lse float32, ``last`` the ``(k, v)`` shard held at the
        last step (the backward starts with it)."""
        seq = q.dim() - 3
        packed = seq == 0
        rows = q.shape[seq]
        merge_states, merge = self._merge_states((1,) * packed + q.shape[:-1] + v.shape[-1:], q.device)
        record_kernel(self.fwd_name)
        held = (k, v)
        out = lse = None  # the running result over every row: the first whole block's, then merged
        with profiled(self.fwd_name):
            for step, calls in enumerate(self.steps):
                pending = self.ring.start(held) if step + 1 < len(self.steps) else None
                for index, call in enumerate(calls):
                    block_out, block_lse = self._block_forward(call, *self._views(call, seq, q, *held))
                    whole = call.rows == rows
                    if out is None and whole:
                        out, lse = (block_out[0], block_lse[0]) if packed and not call.packed else (block_out,
                                                                                                   block_lse)
                        continue
                    if packed and call.packed:
                        block_out, block_lse = block_out.unsqueeze(0), block_lse.unsqueeze(0)
                    if out is None:
                        # A first block over some rows: the others hold nothing yet (out 0, lse -inf).
                        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
                        lse_shape = (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
                        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
                    # The last merge writes the result's dtype (a sink still scales it: float32 until then).
                    final = sink is None and (step, index) == self.last
                    if out.dtype != torch.float32 and not final and not whole:
                        out = out.float()  # merged in place from here on: float32 between merges
                    rows_out = _narrow(out, seq, call.q0, call.rows, packed)
                    rows_lse = _narrow(lse, lse.dim() - 1, call.q0, call.rows, packed)
                    if whole:
                        # Every row: the merge writes new accumulators.
                        into = (empty(rows_out.shape, q.dtype if final else torch.float32, q.device),
                                empty(rows_lse.shape, torch.float32, q.device))
                    else:
                        into = (rows_out, rows_lse)
                    with profiled(merge.fwd_name):
                        merged_out, merged_lse = merge_states(rows_out, rows_lse, block_out, block_lse, *into)
                    if whole:
                        out, lse = (merged_out[0], merged_lse[0]) if packed else (merged_out, merged_lse)
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
        dq = _QuerySum(q, seq)
        record_kernel(self.bwd_name)
        held = last
        dkv_pending = None
        with profiled(self.bwd_name):
            for step in reversed(range(len(self.steps))):
                # The shard of step - 1 comes from the next rank; step 0's is this rank's own.
                pending = self.ring.start(held, reverse=True) if step > 1 else None
                final = step == 0  # the sums are complete: the result is made
                # The held shard's partial sums from the ranks it visited before arrive after this step's blocks.
                ready = dkv_pending is None
                # The last step's gradients in float32 where sums come home to be added to them: rounded once.
                last_dtype = torch.float32 if len(self.steps) > 1 else None
                dk, dv = _Sum(k, seq, last_dtype), _Sum(v, seq, last_dtype)
                for call in self.steps[step]:
                    batch = seq == 0 and not call.packed
                    self._block_backward(call, seq, dout, q, *held, out, lse, *dq.target(call.q0, call.rows, batch),
                                         dk.target(call.k0, call.keys, batch, final, ready),
                                         dv.target(call.k0, call.keys, batch, final, ready))
                if dkv_pending is not None:
                    for total, earlier in zip((dk, dv), self.ring.finish(dkv_pending)):
                        total.receive(earlier)
                dkv_pending = None if final else self.ring.start((dk.sent(self.dkv_dtype), dv.sent(self.dkv_dtype)),
                                                                 reverse=True)
                held = self.ring.finish(pending) if pending is not None else (k, v)
        dsink = None if sink is None else _sink_grad(dout, out, lse, sink, packed)
        return dq.result(), dk.result(), dv.result(), dsink

    def _block_backward(self, call: BlockCall, seq: int, dout, q, k, v, out, lse, dq, add_dq, dk, dv) -> None:
        """The gradients of one block call on the held shard ``k, v`` into ``dq`` (added to it with ``add_dq``),
        ``dk``, ``dv`` (views of the sums or tensors beside them, see :class:`_QuerySum` and :class:`_Sum`): its
        recorded launches when they fit."""
        batch = seq == 0 and not call.packed
        qb, kb, vb = self._views(call, seq, q, k, v)
        dout_b = _narrow(dout, seq, call.q0, call.rows, batch)
        out_b = _narrow(out, seq, call.q0, call.rows, batch)
        # Contiguous: the backends read the lse of the rows they are given with their own strides.
        lse_b = _narrow(lse, lse.dim() - 1, call.q0, call.rows, batch).contiguous()
        given = (dout_b, qb, kb, vb, out_b, lse_b, dq, dk, dv)
        kept = _kept(call, ("backward", dq.dtype, dk.dtype, dv.dtype, add_dq))
        record_kernel(call.plan.bwd_name)
        with profiled(call.plan.bwd_name):
            if kept is not None and replay.replayed(kept.backward, given, ranged=True) is not None:
                return
            backend = get_backend(call.plan.backend)

            def run():
                backend.backward(dout_b, qb, kb, vb, out_b, lse_b, call.args, dq, dk, dv, None, None, add_dq=add_dq)
                return ()

            if kept is None:
                run()
            else:
                _, kept.backward = replay.record(run, given, kept.backward)


class _QuerySum:
    """dQ of this rank's rows, added up over the ring's steps in one float32 sum: a block's kernel writes rows that
    hold nothing yet and adds to the others (the backends' ``add_dq``), so no step needs a buffer or an add of its
    own; the sum is cast once at the end."""

    def __init__(self, like: torch.Tensor, seq: int):
        self.like, self.seq = like, seq
        self.total, self.covered = None, []  # the float32 sum and the row spans of it that hold something

    def target(self, start: int, length: int, batch: bool) -> tuple:
        """``(view, add)``: where the kernel puts the dQ of rows ``start:start + length``, and whether it adds."""
        if self.total is None:
            self.total = empty(self.like.shape, torch.float32, self.like.device)
        view = _narrow(self.total, self.seq, start, length, batch)
        fresh = _disjoint(self.covered, start, start + length)
        if not fresh:
            # Added to: the rows of it that hold nothing yet start from zero.
            _zero_gaps(self.total, self.seq, self.covered, start, start + length)
        self.covered.append((start, start + length))
        return view, not fresh

    def result(self) -> torch.Tensor:
        """The sum in like's dtype."""
        if self.total is None:
            return torch.zeros_like(self.like)
        _zero_gaps(self.total, self.seq, self.covered)
        return self.total.to(self.like.dtype)


def _disjoint(spans: list, start: int, end: int) -> bool:
    return all(end <= lo or start >= hi for lo, hi in spans)


def _zero_gaps(total: torch.Tensor, seq: int, spans: list, start: int = 0, end: int | None = None) -> None:
    """Zero the rows ``start:end`` of ``total`` along ``seq`` that no span ``(start, end)`` of ``spans`` covers."""
    end = total.shape[seq] if end is None else end
    for lo, hi, covered, _ in _pieces(total.shape[seq], spans, []):
        lo, hi = max(lo, start), min(hi, end)
        if not covered and lo < hi:
            total.narrow(seq, lo, hi - lo).zero_()


def _pieces(length: int, first: list, second: list) -> list:
    """``[(start, end, in_first, in_second)]``: ``0:length`` cut where the spans ``(start, end)`` of either list
    begin or end, each piece saying which list covers it."""
    cuts = sorted({0, length, *(x for span in first + second for x in span)})
    return [(lo, hi, not _disjoint(first, lo, hi), not _disjoint(second, lo, hi)) for lo, hi in zip(cuts, cuts[1:])
            if lo < hi]


class _Sum:
    """dK or dV of one step's held shard, added up part by part (a part: the rows ``start:start + length`` along
    ``seq`` that one block call's gradient covers; ``batch``: its view has a batch dim of 1) onto the float32 sums
    of the ranks it visited before, which travel with it.

    Until the last step the sum is float32 and a kernel writes a part straight into rows of it that hold nothing
    yet (no zeroed accumulator, no upcast, no add). On the last step the kernels write straight into the result,
    in ``last_dtype``: float32 where sums come home (they are added to it in the pass that rounds it to the inputs'
    dtype: rounded once, as a float32 sum cast at the end), else (None) the inputs' dtype. A part over rows that
    already hold one, or of a step whose earlier sums have not arrived yet (its blocks run before the wait), is
    written beside, in the inputs' dtype, and added to the float32 sum.
    The sums may travel rounded to the inputs' dtype (:meth:`sent`): one received so is made float32 again before
    a part is added to it."""

    def __init__(self, like: torch.Tensor, seq: int, last_dtype: torch.dtype | None = None):
        self.like, self.seq = like, seq
        self.last_dtype = like.dtype if last_dtype is None else last_dtype
        self.total, self.covered = None, []  # the float32 sum and the row spans of it that hold something
        self.last, self.written = None, []  # the last step's result in last_dtype and the row spans written
        self.beside = []  # (start, length, batch, grad) to add to the float32 sum

    def target(self, start: int, length: int, batch: bool, final: bool, ready: bool = True) -> torch.Tensor:
        """Where a kernel writes the part at rows ``start:start + length``; ``final``: of the last step;
        ``ready``: the float32 sum may be written now (no earlier sums to wait for)."""
        end = start + length
        if final:
            if self.last is None:
                self.last = empty(self.like.shape, self.last_dtype, self.like.device)
            if _disjoint(self.written, start, end):
                self.written.append((start, end))
                return _narrow(self.last, self.seq, start, length, batch)
        elif ready:
            if self.total is None:
                self.total = empty(self.like.shape, torch.float32, self.like.device)
            if _disjoint(self.covered, start, end):
                self.covered.append((start, end))
                return _narrow(self.total, self.seq, start, length, batch)
        grad = empty(_narrow(self.like, self.seq, start, length, batch).shape, self.like.dtype, self.like.device)
        self.beside.append((start, length, batch, grad))
        return grad

    def receive(self, total: torch.Tensor) -> None:
        """The sums of the earlier steps over every row (from the next rank): float32, or rounded to the inputs'
        dtype on the way (made float32 before anything is added to them; the last step's result takes them as
        they are)."""
        self.total, self.covered = total, [(0, self.like.shape[self.seq])]

    def add_beside(self) -> None:
        """Add the parts written beside to the float32 sum."""
        for start, length, batch, grad in self.beside:
            self._fill()
            _narrow(self.total, self.seq, start, length, batch).add_(grad)
        self.beside = []

    def _fill(self) -> None:
        """Zeros in every row of the float32 sum that holds nothing yet."""
        length = self.like.shape[self.seq]
        if self.total is None:
            self.total = torch.zeros(self.like.shape, dtype=torch.float32, device=self.like.device)
        elif self.total.dtype != torch.float32:
            self.total = self.total.float()  # received in 16 bits: the sum goes on in float32
        _zero_gaps(self.total, self.seq, self.covered)
        self.covered = [(0, length)]

    def float32(self) -> torch.Tensor:
        """The float32 sum over every row."""
        self.add_beside()
        self._fill()
        return self.total

    def sent(self, dtype: torch.dtype) -> torch.Tensor:
        """The sum over every row as it travels to the next rank: float32, or rounded to ``dtype``. A sum received
        in ``dtype`` takes the parts written beside (over rows apart) in place: each row's add runs in float32 and
        is rounded once, as through a float32 copy, with no copy and only the rows of the parts read and written."""
        spans = sorted((start, start + length) for start, length, _, _ in self.beside)
        apart = all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        if dtype != torch.float32 and self.total is not None and self.total.dtype == dtype and apart:
            for start, length, batch, grad in self.beside:
                _narrow(self.total, self.seq, start, length, batch).add_(grad)
            self.beside = []
            return self.total
        return self.float32().to(dtype)

    def result(self) -> torch.Tensor:
        """The sum in like's dtype."""
        self.add_beside()
        if self.last is None:
            return self.float32().to(self.like.dtype)
        length = self.like.shape[self.seq]
        pieces = _pieces(length, self.covered, self.written)
        if self.last.dtype != self.like.dtype and pieces == [(0, length, True, True)]:
            # Every row written and summed: added and rounded to like's dtype in one pass.
            return torch.add(self.last, self.total, out=empty(self.like.shape, self.like.dtype, self.like.device))
        for start, end, summed, written in pieces:
            rows = self.last.narrow(self.seq, start, end - start)
            if summed and written:
                rows.add_(self.total.narrow(self.seq, start, end - start))
            elif summed:
                rows.copy_(self.total.narrow(self.seq, start, end - start))
            elif not written:
                rows.zero_()
        return self.last.to(self.like.dtype)


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
