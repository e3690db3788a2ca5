"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds its shard of q, k and v (:func:`flashtile.distributed.shard`); the k/v shards (with
``nheads_kv`` heads: GQA never repeats them) go around the ring while every rank attends its queries
to the shard it holds, step by step (:mod:`.engine`). Which part of a held shard each query sees is
worked out per step in :mod:`.blocks`: with a causal mask and zigzag balance, step 0 is one causal
call on the rank's own shard, and every other step is one full call -- all local queries against the
first half of the held shard (it comes from an earlier rank), or the second half of the queries
against the whole held shard (from a later rank).
"""
from __future__ import annotations


from .. import validation
from .blocks import visible_blocks
from .comm import Ring, check_same_across
from .engine import BlockCall, RingFunction, RingRun, plan_block
from .options import block_options, mask_name, refuse_alibi, shapes
from .sharding import check_balance, group_size_rank, segments


def ring_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, sink=None, balance="zigzag", deterministic=False, return_lse=False):
    """Exact attention of this rank's query shard over the whole sequence, with a ring of K/V exchanges.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's shard (:func:`shard` with the same
            ``balance``); k ``(batch, seqlen_local, nheads_kv, headdim)``, v ``(..., nheads_kv, headdim_v)``.
            Every rank of ``group`` must pass the same shapes (checked: a ValueError on every rank).
        group: the process group of the sequence's ranks (None: the default group).
        causal, softmax_scale, window_size, softcap, sink, deterministic: as in
            :func:`flashtile.flash_attn_func`, over global positions (windows count tokens of the full
            sequence). ``sink`` ``(nheads,)``: its gradient is this rank's rows' share; sum it over the
            group like any replicated parameter's gradient.
        alibi_slopes: not implemented here (NotImplementedError); :func:`ulysses_attention` has it.
        balance: ``"zigzag"`` (rank r holds chunks r and 2P-1-r of 2P: equal causal work) or ``"contiguous"``.
        return_lse: also return the float32 lse ``(batch, nheads, seqlen_local)``.

    Returns:
        ``out`` ``(batch, seqlen_local, nheads, headdim_v)`` in q's dtype (and ``lse``). Differentiable in
        q, k, v (and sink): the backward runs the ring again.
    """
    check_balance(balance)
    refuse_alibi(alibi_slopes, "ring_attention")
    validation.check_qkv(q, k, v)
    world, rank = group_size_rank(group)
    check_same_across(group, "ring_attention", shapes(q, k, v), q.device)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring_attention: q and k shards must have one length (self-attention over one sharded "
                         f"sequence), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if balance == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"ring_attention: balance='zigzag' holds two equal chunks per rank, so seqlen_local must "
                         f"be even, got q {tuple(q.shape)}")
    options, window = block_options(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                    softcap=softcap, sink=sink, deterministic=deterministic)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ring = Ring(group)
    mine = segments(q.shape[1], rank, world, balance)
    planned = {}
    steps = []
    for step in range(world):
        theirs = segments(q.shape[1], ring.source(step), world, balance)
        calls = []
        for block in visible_blocks(mine, theirs, window):
            key = (block.rows, block.keys, block.window)
            if key not in planned:
                planned[key] = plan_block(q[:, :block.rows], k[:, :block.keys], v[:, :block.keys], block.window,
                                          options)
            calls.append(BlockCall(block.q0, block.rows, block.k0, block.keys, *planned[key]))
        steps.append(calls)
    run = RingRun(ring, steps, f"{balance} P={world} {mask_name(window)}")
    out, lse = RingFunction.apply(q, k, v, sink, run)
    return (out, lse) if return_lse else out
