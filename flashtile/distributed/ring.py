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

import torch.distributed as dist

from .. import validation
from ..dispatch import recall, remember, state_key
from ..interface import _SCALARS, _layouts, _plain_window
from .blocks import visible_blocks
from .comm import Ring, check_same_across, nccl_priority
from .engine import BlockCall, RingFunction, RingRun, plan_block
from .options import DKV_TRANSFERS, block_options, check_dkv_transfer, dkv_dtype, mask_name, refuse_alibi, shapes
from .sharding import check_balance, group_size_rank, segments


def ring_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, sink=None, balance="zigzag", deterministic=False, return_lse=False,
                   dkv_transfer="float32"):
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
        dkv_transfer: how the backward sends the dK/dV partial sums around the ring: ``"float32"`` (the
            sums' dtype) or ``"input"`` (rounded to q's dtype on each hop: half the bytes for bf16/fp16; out
            and dq are unchanged, dk and dv within the 16-bit tolerance, see docs/distributed.md).

    Returns:
        ``out`` ``(batch, seqlen_local, nheads, headdim_v)`` in q's dtype (and ``lse``). Differentiable in
        q, k, v (and sink): the backward runs the ring again.
    """
    check_balance(balance)
    check_dkv_transfer(dkv_transfer)
    refuse_alibi(alibi_slopes, "ring_attention")
    validation.check_qkv(q, k, v)
    world, rank = group_size_rank(group)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   deterministic=deterministic)
    key = _signature(q, k, v, sink, options, balance, dkv_transfer, group, world, rank)
    run = None if key is None else recall(key)
    known, error = run is not None, None
    # Planned before the shapes are compared across the ranks (the call's one wait for the device), so that the
    # work after that wait is the launches. The ranks' blocks differ, so one rank alone may refuse (a plan's error,
    # or strict mode and a block that falls back): the comparison carries that, and every rank raises.
    try:
        if not known:  # a kept run never refuses: it ran on its preferred backends under this dispatch state
            run = _plan(q, k, v, group, world, rank, options, sink, balance, dkv_transfer)
            error = run.refusal()
    except Exception as planning:  # noqa: BLE001 -- raised by check_same_across, after every rank has compared
        error = planning
    # The ranks must agree on how the sums travel too (the receive buffers are sized by it).
    check_same_across(group, "ring_attention", dict(shapes(q, k, v), dkv_transfer=DKV_TRANSFERS.index(dkv_transfer)),
                      q.device, refused=error)
    run.record()
    if not known and key is not None and all(call.plan.fallback_reason is None for calls in run.steps
                                             for call in calls):
        remember(key, run)
    out, lse = RingFunction.apply(q, k, v, sink, run)
    return (out, lse) if return_lse else out


def _signature(q, k, v, sink, options: dict, balance, dkv_transfer: str, group, world: int, rank: int):
    """The key under which a call's :class:`RingRun` is kept for the calls like it (see flashtile.interface's
    ``_signature``): the shards' shapes, dtypes and devices, the options with their types, the sink's layout,
    the group, this rank's place in it, the transfers' stream priority and the dispatch state; None for a call
    planned afresh."""
    sink_layout = _layouts((sink,), strides=True)
    scalars = tuple(options[name] for name in ("causal", "softmax_scale", "softcap", "deterministic"))
    types = tuple(map(type, scalars))
    if sink_layout is None or not _plain_window(options["window_size"]) or not _SCALARS.issuperset(types):
        return None
    group = dist.group.WORLD if group is None else group
    key = ("ring_attention", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
           scalars, types, options["window_size"], sink_layout, balance, dkv_transfer, group, world, rank,
           nccl_priority(), state_key())
    try:
        hash(key)
    except TypeError:  # a balance or group that cannot be a key: validated and planned afresh
        return None
    return key


def _plan(q, k, v, group, world: int, rank: int, options: dict, sink, balance, dkv_transfer: str) -> RingRun:
    """The :class:`RingRun` of a call: its checks, and each kind of block call validated and dispatched once."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring_attention: q and k shards must have one length (self-attention over one sharded "
                         f"sequence), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if balance == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"ring_attention: balance='zigzag' holds two equal chunks per rank, so seqlen_local must "
                         f"be even, got q {tuple(q.shape)}")
    options, window = block_options(q, k, v, sink=sink, **options)
    ring = Ring(group, q.device)
    mine = segments(q.shape[1], rank, world, balance)
    planned = {}
    steps = []
    for step in range(world):
        theirs = segments(q.shape[1], ring.source(step), world, balance)
        calls = []
        for block in visible_blocks(mine, theirs, window):
            key = (block.rows, block.keys, block.window)
            if key not in planned:
                args, plan = plan_block(q[:, :block.rows], k[:, :block.keys], v[:, :block.keys], block.window,
                                        options, enforced=False)
                # The block's launches are recorded and replayed while it runs on its preferred backend.
                planned[key] = args, plan, {} if plan.fallback_reason is None else None
            args, plan, replays = planned[key]
            calls.append(BlockCall(block.q0, block.rows, block.k0, block.keys, args, plan, replays=replays))
        steps.append(calls)
    return RingRun(ring, steps, f"{balance} P={world} {mask_name(window)}", dkv_dtype(dkv_transfer, q.dtype))
