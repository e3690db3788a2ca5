"""KV-cache attention in plain tensor ops: the torch backend's ``append_kv``, ``attention_kv`` and
``merge_states`` (the contract is in ``flashtile/backends/__init__.py``), and the readable statement
of what the Triton decode kernels compute.

``append_kv`` writes the new tokens into the cache with one ``index_put_`` per cache, after rotating
them (rotary embeddings in fp32) at their absolute positions, the key rows they are written to. An FP8
cache (``args.k_descale``) gets them quantized, ``e4m3(clamp(x / descale, -448, 448))``, and
``attention_kv`` reads it back as ``cache * descale`` in fp32.

``attention_kv`` walks the key rows in chunks of :data:`KEY_CHUNK` with an online softmax. Each chunk
is gathered for every batch row at once, through the block table when the cache is paged, so the
extra memory is one chunk of K and V in fp32, never a second copy of the cache. The query heads that
share a KV head are computed together as extra query rows (GQA; K and V are never repeated). With
``num_splits > 1`` the key rows are cut into that many ranges, each range is attended to on its own
and the partial ``(out, lse)`` are combined with :func:`merge_states`: split-KV decoding and its
combine step, as the Triton kernels do it.

The rules of flash-attn (``flash_attn_with_kvcache``) for a batch row ``b`` with ``seqlen_new`` new
tokens and ``seqlen_q`` queries:

* key rows ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` are attended to, and causal masks,
  windows and ALiBi distances are aligned bottom-right to ``cache_seqlens[b] + seqlen_new``;
* rotary positions are key rows: new token ``t`` is rotated at ``cache_seqlens[b] + t``; query ``i``
  at ``cache_seqlens[b] + i`` when causal or windowed, else every query at ``cache_seqlens[b]``
  (left padding does not shift them).
"""
from __future__ import annotations

import math

import torch

from .. import device_errors
from . import KVCacheArgs
from .torch_fp8 import FP8_DTYPE, to_fp8

# Key rows per chunk: the fp32 score tile is (batch, nheads, seqlen_q, KEY_CHUNK), small for decoding,
# and 512 rows amortise the per-chunk gather and softmax bookkeeping (the tiled backend's key chunk).
KEY_CHUNK = 512


def append_kv(q, k_cache, v_cache, k, v, args: KVCacheArgs):
    """Write ``k``, ``v`` ``(batch, seqlen_new, nheads_kv, headdim)`` into the caches at key rows
    ``cache_seqlens[b] + t``, rotated when ``args`` has rotary tables; returns q (rotated likewise)."""
    if k is None or args.seqlen_new == 0:
        return q
    capacity, num_slots = args.max_seqlen_k, k_cache.shape[0]
    rows = args.cache_seqlens.long()[:, None] + torch.arange(args.seqlen_new, device=k.device)  # (batch, seqlen_new)
    if args.rotary_cos is not None:
        k = _rotate(k, rows, args)
        q = _rotate(q, _query_positions(q.shape[1], args), args)
    inside = (rows >= 0) & (rows < capacity)
    rows = rows.clamp(0, capacity - 1)
    if args.paged:
        page_size = k_cache.shape[1]
        slot = args.block_table.long().gather(1, rows // page_size)
        rows = rows % page_size
    else:
        slot = _cache_rows(args, k.shape[0], k.device)[:, None].expand_as(rows)
    inside = (inside & (slot >= 0) & (slot < num_slots)).flatten()
    slot, rows = slot.clamp(0, num_slots - 1).flatten(), rows.flatten()
    # A write to drop (past the capacity, or on a page outside the cache: only inputs the value checks
    # refuse) becomes a copy of the first kept write, or of a cache row's own contents when none is kept.
    # Nothing lands out of bounds, no two writes to one place disagree, and nothing syncs with the host.
    donor = inside.to(torch.int32).argmax()
    slot, rows = torch.where(inside, slot, slot[donor]), torch.where(inside, rows, rows[donor])
    keep = inside[:, None, None]
    for cache, new, descale in ((k_cache, k, args.k_descale), (v_cache, v, args.v_descale)):
        new = _to_cache(new, descale, cache.dtype).flatten(0, 1)  # (batch * seqlen_new, nheads_kv, headdim)
        if descale is not None:
            # e4m3 moved as bytes: where and index_put_ need no float8 kernels (not every device has them).
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        donor_value = torch.where(keep[donor], new[donor], cache[slot[donor], rows[donor]])
        cache.index_put_((slot, rows), torch.where(keep, new, donor_value))
    return q


def attention_kv(q, k_cache, v_cache, args: KVCacheArgs):
    """``(out, lse)`` of q ``(batch, seqlen_q, nheads, headdim)`` over its cache rows' keys; ``out`` in
    q's dtype with v_cache's head dim, ``lse`` float32 ``(batch, nheads, seqlen_q)``."""
    _note_bad_values(k_cache, args)
    keys_end = (args.cache_seqlens.long() + args.seqlen_new).clamp(0, args.max_seqlen_k)
    if args.cache_batch_idx is not None:
        # A batch row whose cache_batch_idx names no cache row attends to nothing, as in the kernels.
        idx = args.cache_batch_idx
        keys_end = keys_end.masked_fill((idx < 0) | (idx >= k_cache.shape[0]), 0)
    end = args.max_seqlen_k
    if args.fp8:
        # Gathered as bytes (indexing needs no float8 kernels), dequantized chunk by chunk in _from_cache.
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if q.device.type == "cpu":
        # Reading the longest sequence costs nothing on CPU and skips the empty tail of the cache
        # (on a GPU it would be a host sync, so there the chunks run to the capacity, masked).
        end = min(end, int(keys_end.max()))
    out = lse = None
    for split, (start, stop) in enumerate(_split_ranges(end, args.num_splits or 1)):
        # The sink is one logit of the whole softmax: it joins the first split only.
        part_out, part_lse = _attend_range(q, k_cache, v_cache, args, keys_end, start, stop, with_sink=split == 0)
        out, lse = (part_out, part_lse) if out is None else merge_states(out, lse, part_out, part_lse)
    return out.to(q.dtype), lse


def _note_bad_values(k_cache, args: KVCacheArgs) -> None:
    """On CPU (where reading the values costs no sync) note bad index values in the error record, as the
    Triton kernels do on their device (flashtile/device_errors.py); reads and writes are clamped or dropped
    elsewhere in this module either way."""
    if k_cache.device.type != "cpu":
        return
    lengths = args.cache_seqlens.tolist()
    for b, length in enumerate(lengths):
        if length < 0 or length + args.seqlen_new > args.max_seqlen_k:
            device_errors.note("cache_seqlens", b, length)
    if args.cache_leftpad is not None:
        for b, (pad, length) in enumerate(zip(args.cache_leftpad.tolist(), lengths)):
            if pad < 0 or pad > max(length, 0):
                device_errors.note("cache_leftpad", b, pad)
    if args.cache_batch_idx is not None:
        for b, row in enumerate(args.cache_batch_idx.tolist()):
            if not 0 <= row < k_cache.shape[0]:
                device_errors.note("cache_batch_idx", b, row)
    if args.paged:
        page_size = k_cache.shape[1]
        for b, (length, pages) in enumerate(zip(lengths, args.block_table.tolist())):
            used = min(-(-(max(length, 0) + args.seqlen_new) // page_size), len(pages))
            bad = [page for page in pages[:used] if not 0 <= page < k_cache.shape[0]]
            if bad:
                device_errors.note("block_table", b, bad[0])


def merge_states(out_a, lse_a, out_b, lse_b, out=None, lse=None):
    """The attention over the union of two disjoint key sets from each set's ``(out, lse)``; written into
    ``out``, ``lse`` when given (any dtype of out; they may be ``out_a``, ``lse_a``).

    ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``,
    computed in fp32 around the larger lse ``m``: the weights ``exp(lse - m)`` are at most 1 and come from
    the lses' difference, so neither overflow nor the rounding of large lses spoils them. Outs
    ``(batch, seqlen, nheads, headdim)`` (the result in out_a's dtype), lses float32 ``(batch, nheads, seqlen)``.
    """
    m = torch.maximum(lse_a, lse_b)
    # Both sides saw no key: subtract 0 so that both weights are exp(-inf) = 0, not exp(nan).
    m = m.masked_fill(m == float("-inf"), 0.0)
    weight_a, weight_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = weight_a + weight_b
    merged_lse = m + torch.log(total)  # log(0) = -inf when neither side saw a key
    merged = torch.zeros(out_a.shape, dtype=torch.float32, device=out_a.device)
    for part_out, weight in ((out_a, weight_a), (out_b, weight_b)):
        weight = (weight / total.masked_fill(total == 0, 1.0)).transpose(1, 2).unsqueeze(-1)  # (batch, seqlen, nheads, 1)
        # A side that saw no key adds nothing, whatever its out holds.
        merged += torch.where(weight > 0, weight * part_out.float(), 0.0)
    if out is None:
        out = merged.to(out_a.dtype)
    else:
        out.copy_(merged)
    if lse is None:
        return out, merged_lse
    return out, lse.copy_(merged_lse)


def _to_cache(new: torch.Tensor, descale, dtype: torch.dtype) -> torch.Tensor:
    """New tokens ``(batch, seqlen_new, nheads_kv, d)`` in the cache's dtype: for an FP8 cache
    ``e4m3(clamp(new / descale[b, h], -448, 448))`` (e4m3 has no infinity: past 448 saturates)."""
    if descale is None:
        return new.to(dtype)
    return to_fp8(new.float() / descale[:, None, :, None])


def _from_cache(chunk: torch.Tensor, descale) -> torch.Tensor:
    """fp32 keys or values ``(batch, keys, nheads_kv, d)`` gathered from the cache (its bytes when FP8: dequantized)."""
    if descale is None:
        return chunk.float()
    return chunk.view(FP8_DTYPE).float() * descale[:, None, :, None]


def _cache_rows(args: KVCacheArgs, batch: int, device) -> torch.Tensor:
    """int64 ``(batch,)``: the row of a contiguous cache each batch row uses."""
    if args.cache_batch_idx is not None:
        return args.cache_batch_idx.long()
    return torch.arange(batch, device=device)


def _query_positions(seqlen_q: int, args: KVCacheArgs) -> torch.Tensor:
    """int64 ``(batch, seqlen_q)`` rotary positions of the queries (flash-attn's rule, see the module doc)."""
    start = args.cache_seqlens.long()[:, None]
    if args.causal or args.window_left >= 0 or args.window_right >= 0:
        return start + torch.arange(seqlen_q, device=start.device)
    return start.expand(-1, seqlen_q)


def _rotate(x: torch.Tensor, positions: torch.Tensor, args: KVCacheArgs) -> torch.Tensor:
    """``x`` ``(batch, seqlen, nheads, headdim)`` with its first ``rotary_dim`` dims rotated by the
    angles of ``positions`` ``(batch, seqlen)``, in fp32, returned in x's dtype."""
    # Positions past the tables (refused by the value checks) are clamped rather than read out of bounds.
    positions = positions.clamp(0, args.rotary_cos.shape[0] - 1)
    cos = args.rotary_cos[positions].float()[:, :, None, :]  # (batch, seqlen, 1, rotary_dim / 2)
    sin = args.rotary_sin[positions].float()[:, :, None, :]
    half = cos.shape[-1]
    x32 = x.float()
    rotated, passed = x32[..., : 2 * half], x32[..., 2 * half :]
    if args.rotary_interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]  # pairs (2i, 2i + 1), GPT-J
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]  # pairs (i, i + rotary_dim / 2), GPT-NeoX
    r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    rotated = torch.stack((r1, r2), dim=-1).flatten(-2) if args.rotary_interleaved else torch.cat((r1, r2), dim=-1)
    return torch.cat((rotated, passed), dim=-1).to(x.dtype)


def _split_ranges(end: int, num_splits: int) -> list:
    """``num_splits`` (or fewer) consecutive key ranges covering ``[0, end)``; one empty range when ``end == 0``."""
    per_split = max(1, math.ceil(end / num_splits))
    return [(start, min(start + per_split, end)) for start in range(0, end, per_split)] or [(0, 0)]


def _gather(cache: torch.Tensor, args: KVCacheArgs, batch: int, k0: int, k1: int) -> torch.Tensor:
    """Key rows ``k0:k1`` of every batch row's cache: ``(batch, k1 - k0, nheads_kv, headdim)``, a copy of those rows only."""
    slots = cache.shape[0]
    if not args.paged:
        chunk = cache[:, k0:k1]
        if args.cache_batch_idx is None:
            return chunk[:batch]
        return chunk.index_select(0, args.cache_batch_idx.long().clamp(0, slots - 1))
    page_size = cache.shape[1]
    first, last = k0 // page_size, (k1 - 1) // page_size + 1
    # Entries past a sequence's last page may hold anything (e.g. -1): read page 0 there, the keys are masked.
    pages = args.block_table[:, first:last].long().clamp(0, slots - 1)
    chunk = cache[pages].flatten(1, 2)  # (batch, pages * page_size, nheads_kv, headdim)
    offset = k0 - first * page_size
    return chunk[:, offset : offset + k1 - k0]


def _attend_range(q, k_cache, v_cache, args: KVCacheArgs, keys_end, start: int, stop: int, with_sink: bool):
    """``(out, lse)`` fp32 of q over the key rows ``start:stop`` alone (standard layouts), as an online
    softmax over chunks of :data:`KEY_CHUNK` rows."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv, headdim_v = k_cache.shape[2], v_cache.shape[3]
    group = nheads // nheads_kv
    device = q.device
    # (batch, nheads_kv, seqlen_q, group, headdim): query head h = h_kv * group + g.
    q5 = q.float().reshape(batch, seqlen_q, nheads_kv, group, headdim).transpose(1, 2)
    keys_start = args.cache_leftpad.long() if args.cache_leftpad is not None else torch.zeros_like(keys_end)
    # Bottom-right alignment: query i sits on key row i + diagonal[b].
    diagonal = (keys_end - seqlen_q)[:, None, None]
    query = torch.arange(seqlen_q, device=device)[None, :, None]
    slopes = None
    if args.alibi_slopes is not None:
        slopes = args.alibi_slopes.float().view(batch, nheads_kv, 1, group, 1)

    if with_sink and args.sink is not None:
        # The sink is a logit with no value: it starts the running max and sum (exp(0) = 1), adds nothing to acc.
        m_i = args.sink.float().view(1, nheads_kv, 1, group).expand(batch, -1, seqlen_q, -1).clone()
        l_i = torch.ones_like(m_i)
    else:
        m_i = torch.full((batch, nheads_kv, seqlen_q, group), float("-inf"), device=device)
        l_i = torch.zeros_like(m_i)
    acc = torch.zeros(batch, nheads_kv, seqlen_q, group, headdim_v, device=device)

    for k0 in range(start, stop, KEY_CHUNK):
        k1 = min(k0 + KEY_CHUNK, stop)
        k_chunk = _from_cache(_gather(k_cache, args, batch, k0, k1), args.k_descale)
        v_chunk = _from_cache(_gather(v_cache, args, batch, k0, k1), args.v_descale)
        s = torch.einsum("bhqgd,bkhd->bhqgk", q5, k_chunk) * args.softmax_scale
        if args.softcap > 0:
            s = args.softcap * torch.tanh(s / args.softcap)
        key = torch.arange(k0, k1, device=device)[None, None, :]
        distance = query + diagonal - key  # (batch, seqlen_q, keys): i + diagonal - j
        if slopes is not None:
            s = s - slopes * distance.abs()[:, None, :, None, :]
        visible = (key >= keys_start[:, None, None]) & (key < keys_end[:, None, None])
        if args.window_left >= 0:
            visible = visible & (distance <= args.window_left)
        if args.window_right >= 0:
            visible = visible & (distance >= -args.window_right)
        s = s.masked_fill(~visible[:, None, :, None, :], float("-inf"))

        m_new = torch.maximum(m_i, s.amax(dim=-1))
        # A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps exp() at 0, not NaN.
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        # The running max grew: shrink what was summed under the old max to the new one.
        alpha = torch.exp(m_i - m_safe)
        l_i = l_i * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bhqgk,bkhd->bhqgd", p, v_chunk)
        m_i = m_new

    # A row that saw no key (and no sink) has l = 0 and acc = 0: divide by 1 so its output is exactly 0.
    out = acc / l_i.masked_fill(l_i == 0, 1.0).unsqueeze(-1)
    lse = m_i + torch.log(l_i)  # log(0) = -inf: lse -inf for a row that saw nothing
    out = out.transpose(1, 2).reshape(batch, seqlen_q, nheads, headdim_v)
    lse = lse.permute(0, 1, 3, 2).reshape(batch, nheads, seqlen_q)
    return out, lse
