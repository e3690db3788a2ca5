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


# The CUDA stream priority of the ring's transfers: "default", or "high" (set_nccl_priority).
NCCL_PRIORITIES = ("default", "high")
_nccl_priority = ["default"]


def set_nccl_priority(priority: str) -> None:
    """Run the ring's K/V and dK/dV transfers on NCCL streams of ``priority``: ``"default"`` (the user's group
    itself) or ``"high"`` (a group of the same ranks whose NCCL streams have high priority, made on the first ring
    call over that group: when the attention kernels' CTAs retire, the block scheduler starts the transfer's CTAs
    before the next attention kernel's). Opt-in: on 4 H200s it moved the ring's efficiency by -1% to +1.5%
    (docs/distributed.md). ring_attention, ring_attention_varlen and the hybrid's ring read it at each call. A no-op
    on groups whose tensors do not go through NCCL (gloo on CPU): their profiler names say so."""
    if not isinstance(priority, str) or priority not in NCCL_PRIORITIES:
        raise ValueError(f"priority must be one of {NCCL_PRIORITIES}, got {priority!r}")
    _nccl_priority[0] = priority


def nccl_priority() -> str:
    """The priority :func:`set_nccl_priority` set (``"default"`` unless set)."""
    return _nccl_priority[0]


# The groups of high-priority NCCL streams, by the user's group they stand for (one each, made once).
_HIGH_PRIORITY_GROUPS: dict = {}


def high_priority_group(group):
    """The process group of ``group``'s ranks whose NCCL streams have high priority (made on the first call: a
    collective of ``group``'s ranks alone, which they all reach in the same order, since every rank of the group
    makes the same ring calls).

    Without a device bound to the default group, a group of the ranks (``new_group`` with
    ``use_local_synchronization``: the ranks outside it take no part; its communicator is made at its first
    transfer). With one, ``new_group`` would split the default group's communicator, a collective of every rank
    of the job: ``group``'s own communicator is split instead (``split_group``). Both name the new group by its
    ranks and the number of groups this process holds, so the ranks must have made as many groups before (torch's
    rule for these calls: the same order of group creation everywhere). It has torch's default timeout."""
    found = _HIGH_PRIORITY_GROUPS.get(group)
    if found is None:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        description = "flashtile_ring_high_priority"
        if dist.group.WORLD.bound_device_id is None:
            found = dist.new_group(dist.get_process_group_ranks(group), pg_options=options,
                                   use_local_synchronization=True, group_desc=description)
        else:
            found = dist.split_group(parent_pg=group, split_ranks=[list(range(dist.get_world_size(group)))],
                                     pg_options=options, group_desc=description)
        _HIGH_PRIORITY_GROUPS[group] = found
    return found


def _through_nccl(group, device: torch.device) -> bool:
    """Whether ``group``'s point-to-point operations on ``device``'s tensors run on NCCL."""
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group))


class Ring:
    """The ring of ``group``: every rank sends to the next rank and receives from the previous one, on NCCL
    streams of the priority set by :func:`set_nccl_priority` when the call was planned (``device``: where the
    tensors are)."""

    def __init__(self, group, device: torch.device):
        self.group = dist.group.WORLD if group is None else group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # Point-to-point operations name their peers by global rank (so any group of the same ranks carries them).
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        high = nccl_priority() == "high" and self.size > 1
        applied = high and _through_nccl(self.group, device)
        # What the profiler names add (RingRun): the priority asked for and whether it applies here.
        self.note = "" if not high else " nccl=high" if applied else " nccl=high (no-op: not NCCL)"
        # The group the transfers go through: the high-priority one is made at the first start(), after the ranks
        # have compared shapes (so that every rank of the group reaches its creation).
        self.p2p = None if applied else self.group

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
        if self.p2p is None:
            self.p2p = high_priority_group(self.group)
        to, source = (self.prev, self.next) if reverse else (self.next, self.prev)
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, to, self.p2p) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, source, self.p2p) for t in received]
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
