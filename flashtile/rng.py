"""The dropout RNG: counter-based Philox4x32-10, bit-identical to Triton's ``tl.philox``.

Counter-based means the random bits of an element are a pure function of ``(seed, counters)``:
no state is carried from one draw to the next, so the backward regenerates the forward's mask
tile by tile, and every backend (Triton kernel, pure-PyTorch tiles, the test reference) draws
the same mask for the same element. One Philox call yields four 32-bit words, so four
adjacent keys share one: the element ``(i, j)`` of batch ``b`` and query head ``h`` uses the
counters ``(c0, c1, c2, c3) = (j // 4, i, b * nheads + h, offset)`` and is kept iff::

    (philox(seed, j // 4, i, b * nheads + h, offset)[j % 4] >> 1) >= keep_threshold(dropout_p)

i.e. the top 31 bits of word ``j % 4``, read as a uniform integer in ``[0, 2**31)``,
are at least ``dropout_p * 2**31`` (31 bits so a Triton kernel can compare signed int32).

Here the uint32 words live in int64 tensors: every product of two 32-bit values is split into
16-bit halves so that no intermediate leaves the signed 64-bit range.
"""
from __future__ import annotations

import torch

__all__ = ["philox", "keep_threshold", "dropout_keep", "dropout_mask", "draw_seed_offset"]

MASK32 = 0xFFFFFFFF
# The constants of tl.philox's 32-bit path (triton/language/random.py, philox_impl).
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10


def _mul_hi_lo(a: int, b):
    """``(a * b) >> 32`` and ``(a * b) & 0xffffffff`` for a 32-bit constant ``a`` and uint32 ``b``.

    ``a = a_hi * 2**16 + a_lo``; both partial products stay below ``2**48``, so they are exact in
    int64, while the full 64-bit product would overflow it.
    """
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_hi, p_lo = a_hi * b, a_lo * b
    high = (p_hi + (p_lo >> 16)) >> 16  # floor((p_hi * 2**16 + p_lo) / 2**32), carries included
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32
    return high, low


def _as_counter(c, device):
    """An int64 tensor holding ``c`` as uint32 (negative int32 bit patterns wrap, like Triton's bitcast)."""
    return torch.as_tensor(c, dtype=torch.int64, device=device) & MASK32


def philox(seed: int, c0, c1, c2, c3):
    """Philox4x32 with 10 rounds: ``tl.philox(seed, c0, c1, c2, c3)`` with uint32 counters.

    Args:
        seed: a non-negative int below ``2**64``; the key is ``(seed & 0xffffffff, seed >> 32)``.
        c0, c1, c2, c3: ints or int64 tensors (any values: taken mod ``2**32``); they broadcast.

    Returns:
        Four int64 tensors of the broadcast shape holding uint32 values in ``[0, 2**32)``.
    """
    device = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)
    c0, c1, c2, c3 = (_as_counter(c, device) for c in (c0, c1, c2, c3))
    key0, key1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ key0, lo_b, hi_a ^ c3 ^ key1, lo_a
        # The key is bumped with 32-bit wraparound, as Triton's unsigned add does.
        key0 = (key0 + PHILOX_KEY_A) & MASK32
        key1 = (key1 + PHILOX_KEY_B) & MASK32
    return tuple(torch.broadcast_tensors(c0, c1, c2, c3))


def keep_threshold(dropout_p: float) -> int:
    """The 31-bit threshold: an element is kept iff its random 31-bit integer is ``>=`` it."""
    return int(dropout_p * 2**31)


def dropout_keep(seed: int, offset: int, bh, rows, cols, dropout_p: float) -> torch.Tensor:
    """Which elements dropout keeps (True = keep), for broadcasting position tensors.

    Args:
        seed, offset: the RNG counters of one forward call (see :func:`draw_seed_offset`).
        bh: int64 tensor of ``b * nheads + h`` (batch index ``b``, query head ``h``).
        rows, cols: int64 tensors of the query index ``i`` and key index ``j``.
        dropout_p: the drop probability.

    Returns:
        A bool tensor of the broadcast shape of ``bh``, ``rows`` and ``cols``.
    """
    # One Philox call yields four words: keys 4c..4c+3 share counter c, key 4c + w reads word w.
    words = torch.stack(philox(seed, cols // 4, rows, bh, offset))
    lane = torch.as_tensor(cols % 4).expand(words.shape[1:])
    bits = words.gather(0, lane.unsqueeze(0)).squeeze(0)
    return (bits >> 1) >= keep_threshold(dropout_p)


def dropout_mask(seed: int, offset: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                 device=None) -> torch.Tensor:
    """The whole ``(batch, nheads, seqlen_q, seqlen_k)`` bool keep mask, e.g. for a reference.

    Varlen: sequence ``b`` draws with its own index ``b`` and positions ``i, j`` local to the
    sequence (counted from its first query / key), so its mask is
    ``dropout_mask(seed, offset, b + 1, nheads, seqlen_q_b, seqlen_k_b, dropout_p)[b]``
    (or :func:`dropout_keep` with ``bh = b * nheads + h`` directly).
    """
    bh = torch.arange(batch * nheads, dtype=torch.int64, device=device).view(batch, nheads, 1, 1)
    rows = torch.arange(seqlen_q, dtype=torch.int64, device=device).view(1, 1, seqlen_q, 1)
    cols = torch.arange(seqlen_k, dtype=torch.int64, device=device).view(1, 1, 1, seqlen_k)
    return dropout_keep(seed, offset, bh, rows, cols, dropout_p)


def draw_seed_offset() -> tuple[int, int]:
    """A fresh ``(seed, offset)`` from torch's default CPU generator, so ``torch.manual_seed``
    reproduces dropout. CPU only: it never waits for a GPU. ``0 <= seed < 2**63``,
    ``0 <= offset < 2**31`` (the offset is an int32 counter in the kernels)."""
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    offset = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
    return seed, offset
