"""Which part of a key shard each part of a query shard sees: the attention blocks of one ring step.

A shard is a list of segments ``(global_start, length)`` laid end to end in memory (zigzag: two,
contiguous: one). For every (query segment, key segment) pair the global mask -- query at global
position ``i`` sees key ``j`` iff ``i - left <= j <= i + right`` (``-1``: unbounded; causal is
``right = 0``) -- is cut to the rows and keys that see anything, and rewritten as the window of a
backend call on those rows and keys. The backends align windows to the bottom-right corner
(``diag = seqlen_k - seqlen_q``), so a block whose global query and key ranges end at ``qe`` and
``ke`` takes the window ``(left + ke - qe, right - ke + qe)``; the trimming keeps both >= 0.

Blocks entirely masked are dropped; fully visible blocks that share their keys (or their queries) are
merged into one call, and the causal diagonal of a zigzag or contiguous shard against itself is one
causal call (its segments are in increasing global order, so local order is global order).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """Attention of local query rows ``q0:q0 + rows`` over local key rows ``k0:k0 + keys`` of the held shard,
    with the backend window ``window`` ((-1, 0) = causal, (-1, -1) = full)."""

    q0: int
    rows: int
    k0: int
    keys: int
    window: tuple


def _trim(qs: int, qe: int, ks: int, ke: int, left: int, right: int):
    """The global ranges that see anything under window (left, right), trimmed to that part; None if nothing."""
    for _ in range(2):
        if right >= 0:
            ke = min(ke, qe - 1 + right + 1)  # keys past the last query's right edge
            qs = max(qs, ks - right)  # queries whose right edge is before the first key
        if left >= 0:
            ks = max(ks, qs - left)  # keys before the first query's left edge
            qe = min(qe, ke + left)  # queries whose left edge is past the last key
    if qs >= qe or ks >= ke:
        return None
    return qs, qe, ks, ke


def _block_window(qs: int, qe: int, ks: int, ke: int, left: int, right: int) -> tuple:
    """The bottom-right-aligned window of a backend call on trimmed global ranges; -1 where every row sees
    every key on that side."""
    # The last query has the tightest left edge, the first query the tightest right edge.
    block_left = -1 if left < 0 or qe - 1 - left <= ks else left + ke - qe
    block_right = -1 if right < 0 or qs + right >= ke - 1 else right - ke + qe
    return block_left, block_right


def _offsets(segments) -> list:
    offsets, at = [], 0
    for _, length in segments:
        offsets.append(at)
        at += length
    return offsets


def visible_blocks(q_segments, k_segments, window: tuple) -> list:
    """The :class:`Block` calls that compute attention of a query shard over a key shard under the global
    ``window`` (left, right); an empty list when no query sees any key."""
    left, right = window
    total_q = sum(n for _, n in q_segments)
    total_k = sum(n for _, n in k_segments)
    if window == (-1, -1):
        return [Block(0, total_q, 0, total_k, (-1, -1))]
    if window == (-1, 0) and tuple(q_segments) == tuple(k_segments) and _increasing(q_segments):
        return [Block(0, total_q, 0, total_k, (-1, 0))]
    q_offsets, k_offsets = _offsets(q_segments), _offsets(k_segments)
    pairs = {}
    for i, (qs, nq) in enumerate(q_segments):
        for j, (ks, nk) in enumerate(k_segments):
            trimmed = _trim(qs, qs + nq, ks, ks + nk, left, right)
            if trimmed is None:
                continue
            bw = _block_window(*trimmed, left, right)
            tqs, tqe, tks, tke = trimmed
            block = Block(q_offsets[i] + tqs - qs, tqe - tqs, k_offsets[j] + tks - ks, tke - tks, bw)
            pairs[i, j] = block
    full = {key for key, b in pairs.items() if b.window == (-1, -1) and b.rows == q_segments[key[0]][1]
            and b.keys == k_segments[key[1]][1]}
    blocks = []
    if len(full) == len(q_segments) * len(k_segments):
        return [Block(0, total_q, 0, total_k, (-1, -1))]
    # Fully visible key segments seen whole by every query segment: one call over all queries.
    for j in range(len(k_segments)):
        if len(q_segments) > 1 and all((i, j) in full for i in range(len(q_segments))):
            blocks.append(Block(0, total_q, k_offsets[j], k_segments[j][1], (-1, -1)))
            for i in range(len(q_segments)):
                del pairs[i, j]
    # Query segments that see every key segment whole: one call over all keys.
    for i in range(len(q_segments)):
        if len(k_segments) > 1 and all((i, j) in full and (i, j) in pairs for j in range(len(k_segments))):
            blocks.append(Block(q_offsets[i], q_segments[i][1], 0, total_k, (-1, -1)))
            for j in range(len(k_segments)):
                del pairs[i, j]
    return blocks + list(pairs.values())


def _increasing(segments) -> bool:
    return all(a + n <= b for (a, n), (b, _) in zip(segments, segments[1:]))
