"""Ulysses attention: all-to-all from sequence shards to head shards, attention on the whole sequence, and back.

Every rank trades its tokens of the other ranks' heads for the other ranks' tokens of its own heads
(:func:`.comm.seq_to_heads`), runs :func:`flashtile.flash_attn_func` on the full sequence with
``nheads / P`` heads (every variant works: positions are global), and trades back. Zigzag shards are
put in sequence order after the first exchange and back before the last.

GQA: the KV heads are split across ranks like the query heads when ``nheads_kv`` is a multiple of
``P``. With fewer KV heads than ranks (``P`` a multiple of ``nheads_kv``) each KV head is repeated
``P / nheads_kv`` times before the exchange, so that every rank gets the one KV head its query heads
use (the repeat's gradient sums back).
"""
from __future__ import annotations

import torch

from .. import validation
from ..dispatch import profiled, record_kernel
from ..interface import flash_attn_func
from .comm import check_same_across, heads_to_seq, seq_to_heads
from .options import shapes
from .sharding import check_balance, global_order, group_size_rank


def check_heads(nheads: int, nheads_kv: int, world: int, where: str) -> int:
    """How many times to repeat each KV head so the heads split over ``world`` ranks (1: no repeat)."""
    if nheads % world:
        raise ValueError(f"{where}: nheads={nheads} must be a multiple of the {world} ranks the heads are split "
                         f"across")
    if nheads_kv % world == 0:
        return 1
    if world % nheads_kv:
        raise ValueError(f"{where}: nheads_kv={nheads_kv} must be a multiple of the {world} ranks, or divide it "
                         f"(then each KV head is repeated), got nheads_kv={nheads_kv} with {world} ranks")
    return world // nheads_kv


def split_heads(q, k, v, group, where: str):
    """q, k, v (and the KV repeat) as head shards of the whole sequence (gathered tokens, rank 0's first)."""
    world, _ = group_size_rank(group)
    repeat = check_heads(q.shape[2], k.shape[2], world, where)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    return seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)


def heads_of(x, nheads: int, group):
    """This rank's slice of a per-head tensor (``(nheads,)`` or ``(batch, nheads)``), or None."""
    if x is None:
        return None
    world, rank = group_size_rank(group)
    per_rank = nheads // world
    return x[..., rank * per_rank:(rank + 1) * per_rank]


def ulysses_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, sink=None, balance="zigzag", deterministic=False, return_lse=False):
    """Exact attention over the whole sequence from this rank's shards, with two all-to-alls.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's shard (:func:`shard` with the same
            ``balance``); k, v ``(batch, seqlen_local, nheads_kv, headdim[_v])``. ``nheads`` must be a
            multiple of the group size ``P``; ``nheads_kv`` a multiple of ``P`` or a divisor of it (each KV
            head is then repeated ``P / nheads_kv`` times before the exchange). Every rank passes the same shapes.
        causal, softmax_scale, window_size, softcap, alibi_slopes, sink, deterministic: as in
            :func:`flashtile.flash_attn_func`. ``sink`` / ``alibi_slopes``: each rank reads its heads' part,
            so their gradients are that part's (sum them over the group like a replicated parameter's).
        balance: how the sequence was sharded (``"zigzag"`` or ``"contiguous"``).
        return_lse: also return the float32 lse ``(batch, nheads, seqlen_local)`` (no gradient).

    Returns:
        ``out`` ``(batch, seqlen_local, nheads, headdim_v)`` in q's dtype (and ``lse``).
    """
    check_balance(balance)
    validation.check_qkv(q, k, v)
    world, _ = group_size_rank(group)
    check_same_across(group, "ulysses_attention", shapes(q, k, v), q.device)
    name = f"flashtile.ulysses[{balance} P={world} {'causal' if causal else 'full'}]"
    record_kernel(name)
    with profiled(name):
        nheads, seqlen = q.shape[2], q.shape[1]
        qh, kh, vh = split_heads(q, k, v, group, "ulysses_attention")
        order = None
        if balance == "zigzag" and world > 1:
            order = global_order(world, seqlen, balance).to(q.device)
            qh, kh, vh = (x.index_select(1, order) for x in (qh, kh, vh))
        out, lse, _ = flash_attn_func(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=heads_of(alibi_slopes, nheads, group),
                                      deterministic=deterministic, sink=heads_of(sink, nheads, group),
                                      return_attn_probs=True)
        out = _to_shards(out, order, group)
        if not return_lse:
            return out
        with torch.no_grad():
            lse = _to_shards(lse.transpose(1, 2).unsqueeze(-1), order, group).squeeze(-1).transpose(1, 2)
        return out, lse


def _to_shards(x, order, group):
    """Head shards of the whole sequence (in sequence order) back to sequence shards of every head."""
    if order is not None:
        x = _unorder(x, order)
    return heads_to_seq(x, group)


def _unorder(x, order):
    """The inverse of ``x.index_select(1, order)``, differentiably."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return x.index_select(1, inverse)
