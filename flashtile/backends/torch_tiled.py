"""Pure-PyTorch tiled attention: the FlashAttention algorithm stated in plain tensor ops.

This is the default backend for CPU tensors and the readable reference for the Triton
kernels. Queries are taken in blocks and keys/values in chunks; the ``(query block, key
chunk)`` score tile is the only quadratic-looking buffer, so extra memory is
``O(BLOCK_ROWS x KEY_CHUNK)`` plus ``O(seqlen x headdim)`` fp32 copies, never
``O(seqlen_q x seqlen_k)``. fp16/bf16 inputs are upcast to fp32 for all arithmetic.

GQA/MQA without repeating K/V: the ``group = nheads // nheads_kv`` query heads that share
one KV head are folded into the query-row dimension (row ``i * group + g`` is query ``i``
of head ``g``), so one ``bmm`` per KV head serves its whole group, and ``P^T @ dO`` sums
dK/dV over the group for free.
"""
from __future__ import annotations

import math

import torch

from . import AttentionCall, missing_features

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Query rows per block (query positions x group) and keys per chunk. The fp32 score tile is
# 512 x 512 x 4 B = 1 MiB per (batch, kv-head): it stays in cache across the softmax passes,
# and each GEMM is big enough that thread synchronisation stays cheap. Measured on a 2-core
# AMD EPYC (fp32, 8 heads, headdim 64, forward), time / torch SDPA at seqlen 4096 and 16384:
# 512x512 1.11 / 1.06, 256x512 1.15 / 1.21, 512x256 1.14 / 1.17, 1024x512 1.65 / -.
BLOCK_ROWS = 512
KEY_CHUNK = 512


FEATURES = frozenset()


def supports(call: AttentionCall) -> str | None:
    """Plain tensor ops run on any device; only unimplemented features are refused."""
    missing = missing_features(call, FEATURES)
    return f"{missing} is not implemented in the torch backend" if missing else None


def describe(call: AttentionCall):
    """Profiler names of the forward and backward, and the tile sizes."""
    mask = "causal" if call.causal else "full"
    tiles = f"rows={BLOCK_ROWS} keys={KEY_CHUNK}"
    config = {"BLOCK_ROWS": BLOCK_ROWS, "KEY_CHUNK": KEY_CHUNK}
    return f"flashtile.fwd[torch d={call.headdim} {mask} {tiles}]", f"flashtile.bwd[torch d={call.headdim} {mask} {tiles}]", config


def _fold_rows(x: torch.Tensor, q0: int, q1: int, nheads_kv: int) -> torch.Tensor:
    """Queries ``q0:q1`` of ``x`` ``(B, S, Hq, D)`` as ``(B * Hkv, (q1 - q0) * group, D)`` fp32."""
    batch, _, _, headdim = x.shape
    x = x[:, q0:q1].unflatten(2, (nheads_kv, -1)).permute(0, 2, 1, 3, 4)
    return x.reshape(batch * nheads_kv, -1, headdim).float()


def _unfold_rows(dst: torch.Tensor, q0: int, q1: int, rows: torch.Tensor) -> None:
    """Write ``rows`` ``(B * Hkv, (q1 - q0) * group, D)`` into queries ``q0:q1`` of ``dst`` ``(B, S, Hq, D)``."""
    batch, _, _, headdim = dst.shape
    nheads_kv = rows.shape[0] // batch
    dst = dst[:, q0:q1].unflatten(2, (nheads_kv, -1))
    dst.copy_(rows.view(batch, nheads_kv, q1 - q0, -1, headdim).transpose(1, 2))


def _fold_lse(lse: torch.Tensor, q0: int, q1: int, nheads_kv: int) -> torch.Tensor:
    """Queries ``q0:q1`` of ``lse`` ``(B, Hq, S)`` as ``(B * Hkv, (q1 - q0) * group)``."""
    lse = lse[:, :, q0:q1].unflatten(1, (nheads_kv, -1)).transpose(2, 3)
    return lse.reshape(-1, lse.shape[2] * lse.shape[3])


def _fold_kv(x: torch.Tensor) -> torch.Tensor:
    """``(B, S, Hkv, D) -> (B * Hkv, S, D)`` contiguous fp32."""
    batch, seqlen, nheads_kv, headdim = x.shape
    return x.transpose(1, 2).reshape(batch * nheads_kv, seqlen, headdim).float().contiguous()


def _tile(buffer: torch.Tensor, batch_heads: int, rows: int, keys: int) -> torch.Tensor:
    """A contiguous ``(batch_heads, rows, keys)`` view at the front of a reused flat buffer."""
    return buffer[: batch_heads * rows * keys].view(batch_heads, rows, keys)


def _causal_mask(q0: int, q1: int, group: int, k0: int, k1: int, diagonal: int, device) -> torch.Tensor:
    """``(rows, keys)`` bool, True where query ``i`` must not see key ``j``: ``j > i + diagonal``.

    ``diagonal = seqlen_k - seqlen_q`` aligns the mask to the bottom-right corner.
    """
    query = torch.arange(q0, q1, device=device).repeat_interleave(group)
    key = torch.arange(k0, k1, device=device)
    return key[None, :] > query[:, None] + diagonal


def _visible_keys(q1: int, seqlen_k: int, causal: bool, diagonal: int) -> int:
    """Keys ``0:end`` that some query before ``q1`` can see; later key chunks are skipped."""
    return max(0, min(seqlen_k, q1 + diagonal)) if causal else seqlen_k


def _needs_mask(q0: int, k1: int, causal: bool, diagonal: int) -> bool:
    """Whether the tile straddles the diagonal: a key before ``k1`` is hidden from the block's first query ``q0``."""
    return causal and k1 - 1 > q0 + diagonal


def forward(q, k, v, softmax_scale: float, causal: bool):
    """``out`` ``(B, Sq, Hq, D)`` in q's dtype and ``lse`` ``(B, Hq, Sq)`` fp32 (see the package contract)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    diagonal = seqlen_k - seqlen_q
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    if seqlen_q == 0 or seqlen_k == 0:
        return out, lse

    # Scores in log2 units so the softmax can use exp2, which is much cheaper than exp on CPU.
    qk_scale = softmax_scale * LOG2E
    k_f, v_f = _fold_kv(k), _fold_kv(v)
    batch_heads = batch * nheads_kv
    block_q = max(1, BLOCK_ROWS // group)
    # One score tile reused for every (block, chunk): allocating a fresh one each time costs page faults.
    scores = torch.empty(batch_heads * min(block_q, seqlen_q) * group * KEY_CHUNK, device=q.device)
    for q0 in range(0, seqlen_q, block_q):
        q1 = min(q0 + block_q, seqlen_q)
        q_blk = _fold_rows(q, q0, q1, nheads_kv)
        rows = q_blk.shape[1]
        m_i = torch.full((batch_heads, rows), float("-inf"), device=q.device)
        l_i = torch.zeros(batch_heads, rows, device=q.device)
        acc = torch.zeros(batch_heads, rows, headdim, device=q.device)

        for k0 in range(0, _visible_keys(q1, seqlen_k, causal, diagonal), KEY_CHUNK):
            k1 = min(k0 + KEY_CHUNK, seqlen_k)
            s = _tile(scores, batch_heads, rows, k1 - k0)
            # beta=0: the buffer's old contents are ignored; alpha applies the scale inside the GEMM.
            s.baddbmm_(q_blk, k_f[:, k0:k1].transpose(1, 2), beta=0.0, alpha=qk_scale)
            if _needs_mask(q0, k1, causal, diagonal):
                s.masked_fill_(_causal_mask(q0, q1, group, k0, k1, diagonal, q.device), float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps exp2() at 0, not NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_safe.unsqueeze(-1)).exp2_()
            # The running max grew: shrink what was summed under the old max to the new one.
            alpha = torch.exp2(m_i - m_safe)
            l_i.mul_(alpha).add_(p.sum(dim=-1))
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, v_f[:, k0:k1])
            m_i = m_new

        # A row that saw no key has l_i = 0 and acc = 0: divide by 1 so its output is exactly 0.
        _unfold_rows(out, q0, q1, acc.div_(l_i.masked_fill(l_i == 0, 1.0).unsqueeze(-1)))
        # Back to natural log; log2(0) = -inf gives lse = -inf for a row that saw no key.
        row_lse = ((m_i + l_i.log2()) * LN2).view(batch, nheads_kv, q1 - q0, group)
        lse[:, :, q0:q1].unflatten(1, (nheads_kv, group)).copy_(row_lse.transpose(2, 3))
    return out, lse


def backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, deterministic: bool, dq, dk, dv) -> None:
    """Write dQ, dK, dV into ``dq``, ``dk``, ``dv``; P is recomputed tile by tile from ``lse``.

    With S = scale * Q K^T, P = softmax(S), dP = dO V^T and dS = P * (dP - delta):
    dV = P^T dO, dQ = scale * dS K, dK = scale * dS^T Q. Always deterministic: every sum
    runs in a fixed order, so ``deterministic`` changes nothing.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    diagonal = seqlen_k - seqlen_q
    if seqlen_q == 0 or seqlen_k == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return

    qk_scale = softmax_scale * LOG2E
    k_f, v_f = _fold_kv(k), _fold_kv(v)
    dk_acc, dv_acc = torch.zeros_like(k_f), torch.zeros_like(v_f)
    batch_heads = batch * nheads_kv
    block_q = max(1, BLOCK_ROWS // group)
    scores = torch.empty(batch_heads * min(block_q, seqlen_q) * group * KEY_CHUNK, device=q.device)
    dscores = torch.empty_like(scores)
    for q0 in range(0, seqlen_q, block_q):
        q1 = min(q0 + block_q, seqlen_q)
        q_blk = _fold_rows(q, q0, q1, nheads_kv)
        do_blk = _fold_rows(dout, q0, q1, nheads_kv)
        rows = q_blk.shape[1]
        # delta_i = sum_j P_ij dP_ij = dO_i . O_i: the softmax backward's row term, in one dot product.
        delta = (do_blk * _fold_rows(out, q0, q1, nheads_kv)).sum(dim=-1, keepdim=True)
        # lse in log2 units to match the scores; a row that sees no key has lse = -inf, and
        # +inf in its place makes its P = exp2(s - inf) = 0 instead of NaN.
        row_lse = _fold_lse(lse, q0, q1, nheads_kv) * LOG2E
        row_lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf")).unsqueeze(-1)
        dq_acc = torch.zeros(batch_heads, rows, headdim, device=q.device)

        for k0 in range(0, _visible_keys(q1, seqlen_k, causal, diagonal), KEY_CHUNK):
            k1 = min(k0 + KEY_CHUNK, seqlen_k)
            s = _tile(scores, batch_heads, rows, k1 - k0)
            s.baddbmm_(q_blk, k_f[:, k0:k1].transpose(1, 2), beta=0.0, alpha=qk_scale)
            if _needs_mask(q0, k1, causal, diagonal):
                s.masked_fill_(_causal_mask(q0, q1, group, k0, k1, diagonal, q.device), float("-inf"))
            # The forward's normalised probabilities, recomputed from the saved lse: no row max needed.
            p = s.sub_(row_lse).exp2_()
            dv_acc[:, k0:k1].baddbmm_(p.transpose(1, 2), do_blk)
            dp = torch.bmm(do_blk, v_f[:, k0:k1].transpose(1, 2), out=_tile(dscores, batch_heads, rows, k1 - k0))
            ds = dp.sub_(delta).mul_(p)
            dq_acc.baddbmm_(ds, k_f[:, k0:k1])
            # Rows of every query head in the group meet here, so dK/dV sum over the group.
            dk_acc[:, k0:k1].baddbmm_(ds.transpose(1, 2), q_blk)

        _unfold_rows(dq, q0, q1, dq_acc.mul_(softmax_scale))
    dk.copy_(dk_acc.mul_(softmax_scale).view(batch, nheads_kv, seqlen_k, headdim).transpose(1, 2))
    dv.copy_(dv_acc.view(batch, nheads_kv, seqlen_k, headdim).transpose(1, 2))
