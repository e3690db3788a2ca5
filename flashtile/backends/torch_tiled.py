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

Every variant of the package contract (``flashtile/backends/__init__.py``) lives in
:class:`_ScoreTiles`, which builds one score tile and knows which key chunks a query block can
see; the forward and backward loops below are the plain algorithm around it. Varlen calls run
the dense path once per sequence on slices of the packed tensors.

KV-cache attention (``append_kv``, ``attention_kv``) and ``merge_states`` live in
:mod:`flashtile.backends.torch_decode` and are re-exported here.
"""
from __future__ import annotations

import math

import torch

from .. import device_errors, rng
from . import AttentionCall, AttnArgs, missing_features
from .torch_decode import KEY_CHUNK as KV_KEY_CHUNK, append_kv, attention_kv, merge_states  # noqa: F401 (re-exported)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Query rows per block (query positions x group) and keys per chunk. The fp32 score tile is
# 512 x 512 x 4 B = 1 MiB per (batch, kv-head): it stays in cache across the softmax passes,
# and each GEMM is big enough that thread synchronisation stays cheap. Measured on a 2-core
# AMD EPYC (fp32, 8 heads, headdim 64, forward), time / torch SDPA at seqlen 4096 and 16384:
# 512x512 1.11 / 1.06, 256x512 1.15 / 1.21, 512x256 1.14 / 1.17, 1024x512 1.65 / -.
BLOCK_ROWS = 512
KEY_CHUNK = 512


FEATURES = frozenset({"dropout", "window", "softcap", "alibi", "sink", "bias", "varlen", "headdim_v", "kvcache", "paged",
                      "merge", "fp8_cache"})


def supports(call: AttentionCall) -> str | None:
    """Plain tensor ops run on any device; only unimplemented features are refused."""
    missing = missing_features(call, FEATURES)
    return f"{missing} is not implemented in the torch backend" if missing else None


def describe(call: AttentionCall):
    """Profiler names of the forward and backward (with the features the call uses), and the tile sizes.

    A KV-cache call runs as ``flashtile.kvcache[...]`` and a merge of partial results as
    ``flashtile.merge[...]``; neither has a backward (its name is empty).
    """
    if "merge" in call.feature_names:
        return f"flashtile.merge[torch d={call.headdim_v}]", "", {}
    if call.kvcache:
        extras = "".join(f"+{name}" for name, _ in call.features if name != "kvcache")
        mask = ("causal" if call.causal else "full") + extras
        return f"flashtile.kvcache[torch d={call.headdim} {mask} keys={KV_KEY_CHUNK}]", "", {"KEY_CHUNK": KV_KEY_CHUNK}
    mask = "+".join(["causal" if call.causal else "full"] + [name for name, _ in call.features])
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


def _unfold_lse(dst: torch.Tensor, q0: int, q1: int, rows: torch.Tensor) -> None:
    """Write ``rows`` ``(B * Hkv, (q1 - q0) * group)`` into queries ``q0:q1`` of ``dst`` ``(B, Hq, S)``."""
    batch, nheads, _ = dst.shape
    nheads_kv = rows.shape[0] // batch
    rows = rows.view(batch, nheads_kv, q1 - q0, nheads // nheads_kv).transpose(2, 3)
    dst[:, :, q0:q1].unflatten(1, (nheads_kv, -1)).copy_(rows)


def _fold_kv(x: torch.Tensor) -> torch.Tensor:
    """``(B, S, Hkv, D) -> (B * Hkv, S, D)`` contiguous fp32."""
    batch, seqlen, nheads_kv, headdim = x.shape
    return x.transpose(1, 2).reshape(batch * nheads_kv, seqlen, headdim).float().contiguous()


def _tile(buffer: torch.Tensor, batch_heads: int, rows: int, keys: int) -> torch.Tensor:
    """A contiguous ``(batch_heads, rows, keys)`` view at the front of a reused flat buffer."""
    return buffer[: batch_heads * rows * keys].view(batch_heads, rows, keys)


class _ScoreTiles:
    """Score tiles of one dense call (or one sequence of a varlen call), every variant applied.

    Tiles are ``(B * Hkv, rows, keys)`` with GQA rows folded (row ``r`` is query
    ``q0 + r // group`` of query head ``hkv * group + r % group``) and scores in log2 units, so the
    softmax can use ``exp2``, which is much cheaper than ``exp`` on CPU. ``batch_index`` is the
    batch (sequence) index of this call's first batch row: it picks the ALiBi slopes and the
    dropout RNG stream, so a varlen sequence draws the same mask as a dense batch row would.
    """

    def __init__(self, args: AttnArgs, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_kv: int,
                 device, batch_index: int = 0):
        self.scale = args.softmax_scale
        self.softcap = args.softcap
        self.seqlen_k = seqlen_k
        # Bottom-right alignment: query i sits on key i + diagonal.
        self.diagonal = seqlen_k - seqlen_q
        self.window_left = args.window_left
        # Causal is folded into window_right = 0 by the API; honour the flag too, as the reference does.
        self.window_right = 0 if args.causal else args.window_right
        self.batch, self.nheads, self.nheads_kv = batch, nheads, nheads_kv
        self.group = nheads // nheads_kv
        self.device = device
        self.slopes = None
        if args.alibi_slopes is not None:
            # In log2 units, like the scores they are subtracted from.
            self.slopes = self._per_head(args.alibi_slopes[batch_index:batch_index + batch].float() * LOG2E)
        self.sink = None
        if args.sink is not None:
            self.sink = self._per_head(args.sink.float().expand(batch, nheads))
        self.bias = args.attn_bias
        self.dropout_p, self.seed, self.offset = args.dropout_p, args.seed, args.offset
        self.dropout_stream = None
        if args.dropout_p > 0.0:
            # Counter c2 of the RNG: b * nheads + h, with b counted across the whole call.
            stream = torch.arange(batch_index * nheads, (batch_index + batch) * nheads, device=device)
            self.dropout_stream = self._per_head(stream.view(batch, nheads))

    def _per_head(self, x: torch.Tensor) -> torch.Tensor:
        """A ``(batch, nheads)`` tensor as ``(B * Hkv, group)``: the value of each row's head within its group."""
        return x.reshape(self.batch * self.nheads_kv, self.group)

    def rows_of(self, per_head: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
        """A ``(B * Hkv, group)`` per-head value repeated over queries ``q0:q1``: ``(B * Hkv, rows)``."""
        return per_head.unsqueeze(1).expand(-1, q1 - q0, -1).reshape(per_head.shape[0], -1)

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``start:end`` that some query of ``q0:q1`` can see; chunks outside are skipped, so
        time grows with the window, not with seqlen_k."""
        start, end = 0, self.seqlen_k
        if self.window_left >= 0:
            start = max(0, q0 + self.diagonal - self.window_left)
        if self.window_right >= 0:
            end = min(self.seqlen_k, q1 - 1 + self.diagonal + self.window_right + 1)
        return start, max(start, end)

    def _hidden(self, q0: int, q1: int, k0: int, k1: int, distance):
        """``(rows, keys)`` bool, True outside the window, or None when the whole tile is inside it."""
        hidden = None
        # Some query of the block is more than window_left ahead of the chunk's first key.
        if self.window_left >= 0 and k0 < q1 - 1 + self.diagonal - self.window_left:
            hidden = distance() > self.window_left
        # The chunk's last key is more than window_right past the block's first query.
        if self.window_right >= 0 and k1 - 1 > q0 + self.diagonal + self.window_right:
            right = distance() < -self.window_right
            hidden = right if hidden is None else hidden | right
        return hidden

    def _bias_tile(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The ``(B * Hkv, rows, keys)`` tile of the bias; only this tile is read (and copied)."""
        tile = self.bias[:, :, q0:q1, k0:k1].unflatten(1, (self.nheads_kv, self.group)).transpose(2, 3)
        return tile.reshape(self.batch * self.nheads_kv, (q1 - q0) * self.group, k1 - k0)

    def fill(self, s: torch.Tensor, q_blk: torch.Tensor, k_chunk: torch.Tensor, q0: int, q1: int, k0: int, k1: int,
             tanh_out: torch.Tensor | None = None) -> None:
        """Write the scores of queries ``q0:q1`` and keys ``k0:k1`` into ``s``, in log2 units, hidden ones -inf.

        ``tanh_out``: with a softcap, receives ``tanh(scale * q.k / softcap)`` for the backward's chain rule.
        """
        if self.softcap > 0:
            # beta=0: the buffer's old contents are ignored; alpha applies the scale inside the GEMM.
            s.baddbmm_(q_blk, k_chunk.transpose(1, 2), beta=0.0, alpha=self.scale / self.softcap).tanh_()
            if tanh_out is not None:
                tanh_out.copy_(s)
            s.mul_(self.softcap * LOG2E)
        else:
            s.baddbmm_(q_blk, k_chunk.transpose(1, 2), beta=0.0, alpha=self.scale * LOG2E)

        cache = []

        def distance() -> torch.Tensor:
            """``(rows, keys)`` ``i + diagonal - j``, built on first use."""
            if not cache:
                query = torch.arange(q0, q1, device=self.device).repeat_interleave(self.group)
                key = torch.arange(k0, k1, device=self.device)
                cache.append(query[:, None] + self.diagonal - key[None, :])
            return cache[0]

        if self.slopes is not None:
            s.sub_(self.rows_of(self.slopes, q0, q1).unsqueeze(-1) * distance().abs())
        hidden = self._hidden(q0, q1, k0, k1, distance)
        if self.bias is not None:
            bias = self._bias_tile(q0, q1, k0, k1)
            if bias.dtype == torch.bool:
                hidden = ~bias if hidden is None else hidden | ~bias
            else:
                s.add_(bias, alpha=LOG2E)  # never in place on the tile: it may be a view of the caller's bias
        if hidden is not None:
            s.masked_fill_(hidden, float("-inf"))

    def keep(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """The ``(B * Hkv, rows, keys)`` dropout keep mask of the tile (None without dropout); the
        backward regenerates exactly the forward's from the same global positions."""
        if self.dropout_stream is None:
            return None
        stream = self.rows_of(self.dropout_stream, q0, q1).unsqueeze(-1)
        query = torch.arange(q0, q1, device=self.device).repeat_interleave(self.group)[None, :, None]
        key = torch.arange(k0, k1, device=self.device)[None, None, :]
        return rng.dropout_keep(self.seed, self.offset, stream, query, key, self.dropout_p)


def forward(q, k, v, args: AttnArgs):
    """``(out, lse)``: ``out`` has q's shape with v's headdim, in q's dtype; ``lse`` fp32
    ``(B, Hq, Sq)`` dense or ``(Hq, total_q)`` varlen (see the package contract)."""
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    if args.varlen:
        total_q, nheads, _ = q.shape
        lse = torch.full((nheads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
        for b, (q0, q1, k0, k1) in enumerate(_sequences(args, q.shape[0], k.shape[0])):
            _forward_dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], args, out[None, q0:q1], lse[None, :, q0:q1], b)
        return out, lse
    batch, seqlen_q, nheads, _ = q.shape
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    _forward_dense(q, k, v, args, out, lse, 0)
    return out, lse


def backward(dout, q, k, v, out, lse, args: AttnArgs, dq, dk, dv, dsink, dbias, add_dq=False) -> None:
    """Write dQ, dK, dV (and dsink, dbias when given) in place; P is recomputed tile by tile from ``lse``.
    ``add_dq``: dQ is added to what the float32 ``dq`` holds."""
    if add_dq:
        if dq.dtype != torch.float32:
            raise ValueError(f"add_dq: dq must be a float32 sum to add dQ to, got dq of dtype {dq.dtype}")
        grad = torch.empty_like(dq)
        backward(dout, q, k, v, out, lse, args, grad, dk, dv, dsink, dbias)
        dq.add_(grad)
        return
    dsink_acc = None if dsink is None else torch.zeros(dsink.shape, dtype=torch.float32, device=q.device)
    if args.varlen:
        # Tokens outside every sequence (past cu_seqlens[-1], or past seqused_k) get zero gradients.
        for grad in (dq, dk, dv):
            grad.zero_()
        for b, (q0, q1, k0, k1) in enumerate(_sequences(args, q.shape[0], k.shape[0])):
            _backward_dense(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                            lse[None, :, q0:q1], args, dq[None, q0:q1], dk[None, k0:k1], dv[None, k0:k1],
                            dsink_acc, None, b)
    else:
        _backward_dense(dout, q, k, v, out, lse, args, dq, dk, dv, dsink_acc, dbias, 0)
    if dsink is not None:
        dsink.copy_(dsink_acc)


def _sequences(args: AttnArgs, total_q: int, total_k: int):
    """``(q_start, q_end, k_start, k_end)`` of each varlen sequence in the packed tensors of ``total_q`` and
    ``total_k`` rows; with ``seqused_k`` a sequence's keys end after its first ``seqused_k[b]``. Bad offsets
    and counts are clamped and noted in the error record, as the Triton kernels do (flashtile/device_errors.py)."""
    if args.attn_bias is not None:
        raise ValueError("attn_bias is for dense calls only; got one with cu_seqlens_q (a varlen call)")
    device = args.cu_seqlens_q.device
    spans_q = device_errors.packed_spans(args.cu_seqlens_q.tolist(), total_q, "cu_seqlens_q", device)
    spans_k = device_errors.packed_spans(args.cu_seqlens_k.tolist(), total_k, "cu_seqlens_k", device)
    used_k = None if args.seqused_k is None else args.seqused_k.tolist()
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(spans_q, spans_k)):
        if used_k is not None:
            k1 = k0 + device_errors.used_keys(used_k[b], k1 - k0, b, device)
        yield q0, q1, k0, k1


def _forward_dense(q, k, v, args: AttnArgs, out, lse, batch_index: int) -> None:
    """Fill ``out`` ``(B, Sq, Hq, Dv)`` and ``lse`` ``(B, Hq, Sq)`` (views, any strides)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    group = nheads // nheads_kv
    if seqlen_q == 0:
        return
    tiles = _ScoreTiles(args, batch, seqlen_q, seqlen_k, nheads, nheads_kv, q.device, batch_index)
    k_f, v_f = _fold_kv(k), _fold_kv(v)
    batch_heads = batch * nheads_kv
    block_q = max(1, BLOCK_ROWS // group)
    # One score tile reused for every (block, chunk): allocating a fresh one each time costs page faults.
    scores = torch.empty(batch_heads * min(block_q, seqlen_q) * group * KEY_CHUNK, device=q.device)
    for q0 in range(0, seqlen_q, block_q):
        q1 = min(q0 + block_q, seqlen_q)
        q_blk = _fold_rows(q, q0, q1, nheads_kv)
        rows = q_blk.shape[1]
        if tiles.sink is None:
            m_i = torch.full((batch_heads, rows), float("-inf"), device=q.device)
            l_i = torch.zeros(batch_heads, rows, device=q.device)
        else:
            # The sink is a logit with no value: it starts the running max and sum (exp2(0) = 1) and adds nothing to acc.
            m_i = tiles.rows_of(tiles.sink, q0, q1) * LOG2E
            l_i = torch.ones(batch_heads, rows, device=q.device)
        acc = torch.zeros(batch_heads, rows, headdim_v, device=q.device)

        start, end = tiles.key_range(q0, q1)
        for k0 in range(start, end, KEY_CHUNK):
            k1 = min(k0 + KEY_CHUNK, end)
            s = _tile(scores, batch_heads, rows, k1 - k0)
            tiles.fill(s, q_blk, k_f[:, k0:k1], q0, q1, k0, k1)
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps exp2() at 0, not NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_safe.unsqueeze(-1)).exp2_()
            # The running max grew: shrink what was summed under the old max to the new one.
            alpha = torch.exp2(m_i - m_safe)
            # The denominator sums the probabilities before dropout; only the output sees the dropped ones.
            l_i.mul_(alpha).add_(p.sum(dim=-1))
            keep = tiles.keep(q0, q1, k0, k1)
            if keep is not None:
                p.mul_(keep)
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, v_f[:, k0:k1])
            m_i = m_new

        # A row that saw no key has l_i = 0 and acc = 0: divide by 1 so its output is exactly 0.
        acc.div_(l_i.masked_fill(l_i == 0, 1.0).unsqueeze(-1))
        if args.dropout_p > 0.0:
            acc.mul_(1.0 / (1.0 - args.dropout_p))
        _unfold_rows(out, q0, q1, acc)
        # Back to natural log; log2(0) = -inf gives lse = -inf for a row that saw no key.
        _unfold_lse(lse, q0, q1, (m_i + l_i.log2()) * LN2)


def _backward_dense(dout, q, k, v, out, lse, args: AttnArgs, dq, dk, dv, dsink_acc, dbias, batch_index: int) -> None:
    """Fill ``dq``, ``dk``, ``dv`` (views, any strides) and ``dbias``; add this call's share to ``dsink_acc``.

    With S the scores, P = softmax(S), Z the dropout keep mask and r = 1 / (1 - dropout_p):
    dV = (P Z r)^T dO, dP = (dO V^T) Z r, dS = P * (dP - delta) with delta = rowsum(dO * O),
    dQ = scale * dS' K and dK = scale * dS'^T Q, where dS' = dS * (1 - tanh^2) under a softcap.
    The sink's gradient is -sum_rows exp(sink - lse) * delta. Every sum runs in a fixed order:
    deterministic.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    if dbias is not None:
        dbias.zero_()  # hidden scores and skipped chunks have zero gradient
    if seqlen_q == 0:
        dk.zero_()
        dv.zero_()
        return

    tiles = _ScoreTiles(args, batch, seqlen_q, seqlen_k, nheads, nheads_kv, q.device, batch_index)
    dropout_scale = 1.0 / (1.0 - args.dropout_p)
    k_f, v_f = _fold_kv(k), _fold_kv(v)
    dk_acc, dv_acc = torch.zeros_like(k_f), torch.zeros_like(v_f)
    batch_heads = batch * nheads_kv
    block_q = max(1, BLOCK_ROWS // group)
    scores = torch.empty(batch_heads * min(block_q, seqlen_q) * group * KEY_CHUNK, device=q.device)
    dscores = torch.empty_like(scores)
    tanh_buffer = torch.empty_like(scores) if args.softcap > 0 else None
    for q0 in range(0, seqlen_q, block_q):
        q1 = min(q0 + block_q, seqlen_q)
        q_blk = _fold_rows(q, q0, q1, nheads_kv)
        do_blk = _fold_rows(dout, q0, q1, nheads_kv)
        rows = q_blk.shape[1]
        # delta_i = sum_j P_ij dP_ij = dO_i . O_i: the softmax backward's row term, in one dot product.
        delta = (do_blk * _fold_rows(out, q0, q1, nheads_kv)).sum(dim=-1, keepdim=True)
        row_lse = _fold_lse(lse, q0, q1, nheads_kv)
        if dsink_acc is not None:
            # The sink's probability is exp(sink - lse) and its dP is 0, so dsink = -P_sink * delta.
            dsink_rows = -torch.exp(tiles.rows_of(tiles.sink, q0, q1) - row_lse) * delta.squeeze(-1)
            dsink_acc.add_(dsink_rows.view(batch, nheads_kv, q1 - q0, group).sum(dim=(0, 2)).flatten())
        # lse in log2 units to match the scores; a row that sees no key has lse = -inf, and
        # +inf in its place makes its P = exp2(s - inf) = 0 instead of NaN.
        row_lse = row_lse * LOG2E
        row_lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf")).unsqueeze(-1)
        dq_acc = torch.zeros(batch_heads, rows, headdim, device=q.device)

        start, end = tiles.key_range(q0, q1)
        for k0 in range(start, end, KEY_CHUNK):
            k1 = min(k0 + KEY_CHUNK, end)
            s = _tile(scores, batch_heads, rows, k1 - k0)
            tanh = None if tanh_buffer is None else _tile(tanh_buffer, batch_heads, rows, k1 - k0)
            tiles.fill(s, q_blk, k_f[:, k0:k1], q0, q1, k0, k1, tanh_out=tanh)
            # The forward's normalised probabilities, recomputed from the saved lse: no row max needed.
            p = s.sub_(row_lse).exp2_()
            dp = torch.bmm(do_blk, v_f[:, k0:k1].transpose(1, 2), out=_tile(dscores, batch_heads, rows, k1 - k0))
            keep = tiles.keep(q0, q1, k0, k1)
            if keep is None:
                dv_acc[:, k0:k1].baddbmm_(p.transpose(1, 2), do_blk)
            else:
                # The output used P Z r, so V's gradient sees the same and P's gradient is masked and rescaled.
                dv_acc[:, k0:k1].baddbmm_((p * keep).transpose(1, 2), do_blk, alpha=dropout_scale)
                dp.mul_(keep).mul_(dropout_scale)
            ds = dp.sub_(delta).mul_(p)
            if dbias is not None:
                _unfold_scores(dbias, q0, q1, k0, k1, ds)
            if tanh is not None:
                # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2.
                ds.mul_(tanh.square_().neg_().add_(1.0))
            dq_acc.baddbmm_(ds, k_f[:, k0:k1])
            # Rows of every query head in the group meet here, so dK/dV sum over the group.
            dk_acc[:, k0:k1].baddbmm_(ds.transpose(1, 2), q_blk)

        _unfold_rows(dq, q0, q1, dq_acc.mul_(args.softmax_scale))
    dk.copy_(dk_acc.mul_(args.softmax_scale).view(batch, nheads_kv, seqlen_k, headdim).transpose(1, 2))
    dv.copy_(dv_acc.view(batch, nheads_kv, seqlen_k, v.shape[3]).transpose(1, 2))


def _unfold_scores(dst: torch.Tensor, q0: int, q1: int, k0: int, k1: int, tile: torch.Tensor) -> None:
    """Write a ``(B * Hkv, rows, keys)`` tile into ``dst[:, :, q0:q1, k0:k1]`` of ``dst`` ``(B, Hq, Sq, Sk)``."""
    batch, nheads = dst.shape[:2]
    nheads_kv = tile.shape[0] // batch
    tile = tile.view(batch, nheads_kv, q1 - q0, nheads // nheads_kv, k1 - k0).transpose(2, 3)
    dst[:, :, q0:q1, k0:k1].unflatten(1, (nheads_kv, -1)).copy_(tile)
