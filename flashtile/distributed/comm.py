"""What crosses between ranks: the ring's point-to-point exchange, Ulysses' all-to-all (with its autograd),
and the one check per call that every rank was handed matching shapes (so a mismatch raises on every rank
instead of leaving some of them waiting in a collective forever)."""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

from ..dispatch import FallbackError


# The kinds of error a rank may refuse a call with, as the shape check shares them (0: none; the last: any other).
_REFUSALS = (ValueError, TypeError, NotImplementedError, FallbackError, RuntimeError)


def check_same_across(group, what: str, values: dict, device, refused: Exception | None = None) -> None:
    """All-gather ``values`` (name -> int) over ``group``; raise the same ValueError on every rank if any
    rank's values differ from another's. ``refused``: the error this rank's own checks and plans raised (made
    before the call, so that a refusal of one rank alone, e.g. a block shape that only it has falling back
    in strict mode, reaches the others instead of leaving them waiting in the ring): the refusing rank raises
    its error and every other rank one of the same type that names it. On a GPU the gather and its copy to the
    host run on a stream of their own, so that the host waits for them alone, not for the work queued before
    the call (earlier layers' kernels): the host goes on queueing while the GPU runs them."""
    world = dist.get_world_size(group)
    if world == 1:
        if refused is not None:
            raise refused
        return
    kind = 0 if refused is None else next((i for i, cls in enumerate(_REFUSALS, 1) if isinstance(refused, cls)),
                                           len(_REFUSALS))
    with _own_stream(torch.device(device)):
        mine = torch.tensor([*values.values(), kind], dtype=torch.long, device=device)
        gathered = torch.empty(world * mine.numel(), dtype=torch.long, device=device)
        dist.all_gather_into_tensor(gathered, mine, group=group)
        rows = gathered.view(world, -1).tolist()  # the call's one wait for the device (one copy; a row each took P)
    kinds = [row.pop() for row in rows]
    if any(row != rows[0] for row in rows):
        per_rank = "; ".join(f"rank {rank}: " + ", ".join(f"{name}={value}" for name, value in zip(values, row))
                             for rank, row in enumerate(rows))
        raise ValueError(f"{what}: every rank must pass the same shapes, got {per_rank}")
    if refused is not None:
        raise refused
    if any(kinds):
        ranks = [rank for rank, kind in enumerate(kinds) if kind]
        cls = _REFUSALS[kinds[ranks[0]] - 1]
        raise cls(f"{what}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of the group refused "
                  f"this call (its error says why there); every rank raises so that none waits in the ring")


_CHECK_STREAMS: dict = {}


def _own_stream(device: torch.device):
    """``torch.cuda.stream`` of a stream kept for the shape checks of ``device`` (nothing on a CPU)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CHECK_STREAMS.get(index)
    if stream is None:
        stream = _CHECK_STREAMS[index] = torch.cuda.Stream(index)
    return torch.cuda.stream(stream)


class Ring:
    """The ring of ``group``: every rank sends to the next rank and receives from the previous one."""

    def __init__(self, group):
        self.group = dist.group.WORLD if group is None else group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # Point-to-point operations name their peers by global rank.
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """The rank whose shard this rank holds at ``step`` (step 0: its own)."""
        return (self.rank - step) % self.size

    def start(self, tensors: tuple, reverse: bool = False):
        """Send ``tensors`` to the next rank and receive as many from the previous one (``reverse``: to the
        previous rank, from the next one), as one batch of non-blocking operations (NCCL runs them on its own
        stream, beside the attention on the current one). Returns what :meth:`finish` takes (it holds the sent
        tensors: they must live until sent)."""
        if self.size == 1:
            return tensors, [], ()
        to, source = (self.prev, self.next) if reverse else (self.next, self.prev)
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in received]
        return received, dist.batch_isend_irecv(ops), tensors

    @staticmethod
    def finish(pending) -> tuple:
        """Wait for a :meth:`start` and return the received tensors."""
        received, works, _sent = pending
        for work in works:
            work.wait()
        return received


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (one equal slice per rank)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (empty_like keeps a permuted input's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``(batch, seqlen_local, nheads, d)`` sequence shards -> ``(batch, P * seqlen_local, nheads / P, d)`` head
    shards: rank ``j`` gets heads ``j * nheads / P ...``, the ranks' tokens laid end to end (rank 0's first)."""
    return _Exchange.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`:
    ``(batch, P * seqlen_local, h, d)`` -> ``(batch, seqlen_local, P * h, d)``."""
    return _Exchange.apply(x, group, False)


def _seq_to_heads(x, group):
    world = dist.get_world_size(group)
    batch, seqlen, nheads, dim = x.shape
    parts = x.reshape(batch, seqlen, world, nheads // world, dim).permute(2, 0, 1, 3, 4)
    out = _all_to_all(parts, group)  # out[j]: rank j's tokens of my heads
    return out.permute(1, 0, 2, 3, 4).reshape(batch, world * seqlen, nheads // world, dim)


def _heads_to_seq(x, group):
    world = dist.get_world_size(group)
    batch, tokens, heads, dim = x.shape
    parts = x.reshape(batch, world, tokens // world, heads, dim).permute(1, 0, 2, 3, 4)
    out = _all_to_all(parts, group)  # out[j]: my tokens of rank j's heads
    return out.permute(1, 2, 0, 3, 4).reshape(batch, tokens // world, world * heads, dim)


class _Exchange(torch.autograd.Function):
    """:func:`_seq_to_heads` (``to_heads``) or :func:`_heads_to_seq`; the gradient goes through the other one."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def exit_rank() -> None:
    """End a spawned rank whose work is done and whose process group is destroyed, skipping the interpreter's
    teardown (stdout and stderr flushed first): there, now and then, a gloo thread still joinable aborts the finished
    process ("terminate called without an active exception", SIGABRT), which ``torch.multiprocessing.spawn``
    reports as a failure (1 in 10-20 two-rank CPU runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
