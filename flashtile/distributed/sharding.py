"""Which tokens of the full sequence a rank holds, and moving between the full sequence and a shard.

A sequence of ``N`` tokens is cut into chunks of equal length:

- ``balance="zigzag"``: ``2P`` chunks; rank ``r`` holds chunks ``r`` and ``2P - 1 - r`` (in that order), so
  under a causal mask every rank has the same work (an early chunk paired with a late one)::

      P = 2, N = 8:   rank 0: tokens 0 1 | 6 7     rank 1: tokens 2 3 | 4 5

- ``balance="contiguous"``: ``P`` chunks; rank ``r`` holds chunk ``r``.

On a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` (dims ``"ulysses"`` and ``"ring"``) the
sequence is first cut over the ring ranks as above, and each ring shard is then cut into equal
contiguous parts over the Ulysses ranks (the Ulysses all-to-all gathers them back in order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

BALANCES = ("zigzag", "contiguous")


def check_balance(balance) -> str:
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    return balance


def group_size_rank(group) -> tuple[int, int]:
    """``(world size, rank)`` of this process in ``group`` (None: the default group)."""
    if not dist.is_initialized():
        raise RuntimeError("flashtile.distributed needs torch.distributed.init_process_group(...) first")
    return dist.get_world_size(group), dist.get_rank(group)


def chunks_of(rank: int, world: int, balance: str) -> tuple:
    """The chunk indices rank ``rank`` holds, in its local order (``2 * world`` chunks for zigzag)."""
    return (rank, 2 * world - 1 - rank) if balance == "zigzag" else (rank,)


def segments(seqlen_local: int, rank: int, world: int, balance: str) -> tuple:
    """``((global_start, length), ...)`` of the tokens rank ``rank`` holds, in its local order."""
    ids = chunks_of(rank, world, balance)
    chunk = seqlen_local // len(ids)
    return tuple((i * chunk, chunk) for i in ids)


def _is_mesh(group) -> bool:
    return type(group).__name__ == "DeviceMesh"


def shard(x: torch.Tensor, group=None, dim: int = 1, balance: str = "zigzag") -> torch.Tensor:
    """This rank's part of the full sequence ``x`` (the same tensor on every rank), along ``dim``.

    ``group`` is a process group (None: the default group) or a 2-D DeviceMesh with dims ``"ulysses"`` and
    ``"ring"`` (for :func:`flashtile.distributed.attention`). ``x.shape[dim]`` must divide into ``2P``
    chunks (zigzag) or ``P`` (contiguous). Returns a contiguous tensor with ``x.shape[dim] / P`` tokens.
    """
    check_balance(balance)
    if _is_mesh(group):
        from .hybrid import mesh_groups

        ulysses, ring = mesh_groups(group)
        return shard(shard(x, ring, dim, balance), ulysses, dim, "contiguous")
    world, rank = group_size_rank(group)
    ids = chunks_of(rank, world, balance)
    parts = world * len(ids)
    if x.shape[dim] % parts:
        raise ValueError(f"shard: x.shape[{dim}]={x.shape[dim]} must be a multiple of {parts} "
                         f"({world} ranks, balance={balance!r}), got x {tuple(x.shape)}")
    pieces = x.chunk(parts, dim)
    return torch.cat([pieces[i] for i in ids], dim).contiguous()


def unshard(x_local: torch.Tensor, group=None, dim: int = 1, balance: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard ``x_local`` (the inverse of :func:`shard`; an all-gather,
    so every rank must call it). No gradient flows through it."""
    check_balance(balance)
    if _is_mesh(group):
        from .hybrid import mesh_groups

        ulysses, ring = mesh_groups(group)
        return unshard(unshard(x_local, ulysses, dim, "contiguous"), ring, dim, balance)
    world, _ = group_size_rank(group)
    x_local = x_local.detach().contiguous()
    gathered = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(gathered, x_local, group=group)
    pieces = [None] * (world * len(chunks_of(0, world, balance)))
    for rank, part in enumerate(gathered):
        ids = chunks_of(rank, world, balance)
        for i, piece in zip(ids, part.chunk(len(ids), dim)):
            pieces[i] = piece
    return torch.cat(pieces, dim)


def global_order(world: int, seqlen_local: int, balance: str) -> torch.Tensor:
    """int64 ``(world * seqlen_local,)``: position ``p`` of the full sequence sits at index ``order[p]`` of the
    ranks' shards laid end to end (rank 0's first). Used by Ulysses to put gathered shards in order."""
    where = torch.empty(world * seqlen_local, dtype=torch.long)
    for rank in range(world):
        offset = rank * seqlen_local
        for start, length in segments(seqlen_local, rank, world, balance):
            where[start:start + length] = torch.arange(offset, offset + length)
            offset += length
    return where
