"""Ring attention on packed documents: the global ``cu_seqlens`` of one packed sequence, sharded in
contiguous token ranges (rank r holds tokens ``r * T ... (r + 1) * T``; documents may cross shards).

Step 0 is one varlen call on the rank's own tokens, cut at the document boundaries that fall inside
them. At any other step the held shard and the local one are disjoint token ranges, so at most one
document has tokens in both (the one that spans the gap): that step is at most one dense call on
its two pieces, cut further by the mask (:mod:`.blocks`); every other pair of documents is skipped.
"""
from __future__ import annotations

import array
import bisect
import zlib

import torch

from .. import validation
from .blocks import visible_blocks
from .comm import Ring, check_same_across
from .engine import BlockCall, RingFunction, RingRun, plan_block
from .options import DKV_TRANSFERS, block_options, check_dkv_transfer, dkv_dtype, mask_name, refuse_alibi
from .sharding import group_size_rank


def _check_cu_seqlens(cu_seqlens, total: int, device) -> list:
    """The global offsets as a list, checked: int32 ``(num_docs + 1,)`` from 0 up to ``total``, non-decreasing."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        what = (f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor)
                else type(cu_seqlens).__name__)
        raise TypeError(f"cu_seqlens must be an int32 tensor (num_docs + 1,), got {what}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on q's device {device}, got {cu_seqlens.device}")
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the global token count {total} (ranks x local tokens), "
                         f"got {cu if len(cu) <= 16 else cu[:8] + ['...'] + cu[-4:]}")
    return cu


def _local_offsets(cu: list, start: int, stop: int) -> list:
    """The document boundaries inside tokens ``start:stop``, relative to ``start`` (0 and the length included)."""
    return [0] + [c - start for c in cu if start < c < stop] + [stop - start]


def _shared_document(cu: list, q_start: int, k_start: int, tokens: int):
    """``(q_lo, q_hi, k_lo, k_hi)``: global pieces of the one document with tokens in both disjoint ranges, or None."""
    later = max(q_start, k_start)
    doc = bisect.bisect_right(cu, later) - 1
    lo, hi = cu[doc], cu[min(doc + 1, len(cu) - 1)]
    earlier_end = min(q_start, k_start) + tokens
    if lo >= earlier_end:
        return None
    pieces = (max(lo, q_start), min(hi, q_start + tokens), max(lo, k_start), min(hi, k_start + tokens))
    return pieces if pieces[0] < pieces[1] and pieces[2] < pieces[3] else None


def _plan(q, k, v, cu: list, group, world: int, rank: int, sink, window_size, options: dict,
          dkv_transfer: str) -> RingRun:
    """The :class:`RingRun` of a call: step 0 on the rank's own documents, then at most one dense call a step on
    the one document shared with the held shard; each kind of block call planned once (enforced by ``record``)."""
    tokens = q.shape[0]
    options, window = block_options(q[None], k[None], v[None], sink=sink, window_size=window_size, **options)
    ring = Ring(group, q.device)
    start = rank * tokens
    local = _local_offsets(cu, start, start + tokens)
    local_cu = torch.tensor(local, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(local, local[1:]))
    diagonal = plan_block(q, k, v, window, options, enforced=False, cu_seqlens_q=local_cu, cu_seqlens_k=local_cu,
                          max_seqlen_q=longest, max_seqlen_k=longest)
    steps = [[BlockCall(0, tokens, 0, tokens, *diagonal, packed=True)]]
    planned = {}
    for step in range(1, world):
        k_start = ring.source(step) * tokens
        shared = _shared_document(cu, start, k_start, tokens)
        calls = []
        if shared is not None:
            q_lo, q_hi, k_lo, k_hi = shared
            for block in visible_blocks([(q_lo, q_hi - q_lo)], [(k_lo, k_hi - k_lo)], window):
                key = (block.rows, block.keys, block.window)
                if key not in planned:
                    planned[key] = plan_block(q[None, :block.rows], k[None, :block.keys], v[None, :block.keys],
                                              block.window, options, enforced=False)
                calls.append(BlockCall(q_lo - start + block.q0, block.rows, k_lo - k_start + block.k0, block.keys,
                                       *planned[key]))
        steps.append(calls)
    return RingRun(ring, steps, f"varlen P={world} {mask_name(window)}", dkv_dtype(dkv_transfer, q.dtype))


def ring_attention_varlen(q, k, v, cu_seqlens, max_seqlen, group=None, *, causal=False, softmax_scale=None,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sink=None, deterministic=False,
                          return_lse=False, dkv_transfer="float32"):
    """Ring attention over packed documents, each token attending only within its document.

    Args:
        q: ``(tokens_local, nheads, headdim)``: this rank's contiguous range of the packed tokens
            (``shard(x, group, dim=0, balance="contiguous")``); k, v ``(tokens_local, nheads_kv, headdim[_v])``.
        cu_seqlens: int32 ``(num_docs + 1,)``, the global offsets of the documents in the whole packed
            sequence (the same on every rank), ending at ``P * tokens_local``.
        max_seqlen: the longest document (an int; checked like flash_attn_varlen_func's).
        causal, softmax_scale, window_size, softcap, sink, deterministic: as in
            :func:`flashtile.flash_attn_varlen_func`, positions counted within each document.
        alibi_slopes: not implemented (NotImplementedError).
        return_lse: also return the float32 lse ``(nheads, tokens_local)``.
        dkv_transfer: ``"float32"`` or ``"input"``, as in :func:`ring_attention`.

    Returns:
        ``out`` ``(tokens_local, nheads, headdim_v)`` in q's dtype (and ``lse``), differentiable.
    """
    check_dkv_transfer(dkv_transfer)
    refuse_alibi(alibi_slopes, "ring_attention_varlen")
    validation.check_qkv(q, k, v, varlen=True)
    validation.check_max_seqlen("max_seqlen", max_seqlen)
    world, rank = group_size_rank(group)
    tokens = q.shape[0]
    # Planned before the ranks compare their shapes and offsets (the call's one wait for the device). Their
    # blocks differ, so one rank alone may refuse (strict mode and a block that falls back): the comparison
    # carries that, and every rank raises.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    run, error, offsets = None, None, -1
    try:
        if k.shape[0] != tokens:
            raise ValueError(f"ring_attention_varlen: q and k shards must have one length, got q {tuple(q.shape)} "
                             f"and k {tuple(k.shape)}")
        cu = _check_cu_seqlens(cu_seqlens, world * tokens, q.device)
        offsets = zlib.crc32(array.array("q", cu).tobytes())
        run = _plan(q, k, v, cu, group, world, rank, sink, window_size,
                    dict(causal=causal, softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic),
                    dkv_transfer)
        error = run.refusal()
    except Exception as planning:  # noqa: BLE001 -- raised by check_same_across, after every rank has compared
        error = planning
    check_same_across(group, "ring_attention_varlen",
                      dict(tokens_q=tokens, tokens_k=k.shape[0], nheads=q.shape[1], nheads_kv=k.shape[1],
                           headdim=q.shape[2], headdim_v=v.shape[2], cu_seqlens_crc32=offsets,
                           dkv_transfer=DKV_TRANSFERS.index(dkv_transfer)),
                      q.device, refused=error)
    run.record()
    out, lse = RingFunction.apply(q, k, v, sink, run)
    return (out, lse) if return_lse else out
