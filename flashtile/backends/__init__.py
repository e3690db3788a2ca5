"""Attention backends and the contract each one keeps.

A backend is two modules: a light one that can always be imported (``supports``,
``describe``, ``FEATURES``) and a heavy one that runs kernels (``forward``, ``backward``).

``FEATURES``: the optional features (see :class:`AttentionCall`) the backend implements.

``supports(call) -> str | None``
    Why the backend cannot run ``call`` (a short sentence quoting the offending value), or
    None when it can. Cheap: it runs nothing.

``describe(call) -> (fwd_name, bwd_name, config)``
    The names its kernels run under in a profiler trace, e.g.
    ``flashtile.fwd[triton d=128 causal BM=128 BN=64]``, and the launch configuration.

``forward(q, k, v, args) -> (out, lse)``
    Dense: q ``(batch, seqlen_q, nheads, headdim)``, k ``(batch, seqlen_k, nheads_kv, headdim)``,
    v ``(batch, seqlen_k, nheads_kv, headdim_v)``. Varlen (``args.varlen``): the same without the
    batch dim, tokens of all sequences packed along dim 0 (see :class:`AttnArgs`).
    Any strides, one dtype (fp16/bf16/fp32), already validated; seqlens may be 0.
    ``out`` has q's shape with headdim_v, in q's dtype; ``lse`` is float32, natural log,
    ``(batch, nheads, seqlen_q)`` dense or ``(nheads, total_q)`` varlen. A row that sees no key
    (and has no sink) has output 0 and lse ``-inf``.

``backward(dout, q, k, v, out, lse, args, dq, dk, dv, dsink, dbias, add_dq=False) -> None``
    Writes the gradients into ``dq``, ``dk``, ``dv`` (same shapes as q, k, v; possibly strided
    views of one packed tensor; in q's dtype or float32, each stored in its own dtype). With
    ``add_dq`` (a float32 ``dq``) dQ is added to what ``dq`` holds instead (ring attention sums a
    row's dQ over its steps). dK/dV of a KV head sum over its query-head group. ``dsink``
    is None or a ``(nheads,)`` tensor to fill (summed in float32, stored in its dtype); ``dbias`` is
    None or a contiguous float32 ``(batch, nheads, seqlen_q, seqlen_k)`` tensor to fill with
    dL/d(score) (the autograd layer sums it down to the bias's broadcast shape). With
    ``args.deterministic`` (or ``torch.use_deterministic_algorithms(True)``) the gradients are
    bit-identical run to run; without, a backend may add partial sums in the order its programs finish
    (the Triton backend's one-pass Hopper kernel adds dQ that way; dK, dV and every other kernel's
    gradients are identical run to run either way).

KV-cache attention (``flashtile.flash_attn_with_kvcache``), for backends whose FEATURES hold
``"kvcache"`` (and ``"paged"`` for block tables); ``args`` is a :class:`KVCacheArgs`:

``append_kv(q, k_cache, v_cache, k, v, args) -> q``
    Writes the new tokens ``k``, ``v`` ``(batch, seqlen_new, nheads_kv, headdim[_v])`` into the
    caches in place: token ``t`` of batch row ``b`` goes to key row ``cache_seqlens[b] + t`` of that
    row's cache (see :class:`KVCacheArgs` for how a key row maps to memory). Rows that would land
    outside the cache's capacity, on a block table entry outside ``[0, num_blocks)`` or in no cache row
    (``cache_batch_idx`` outside ``[0, batch_cache)``) are not written, and are noted in the device's
    error record (flashtile/device_errors.py, docs/reliability.md). With
    rotary tables ``k`` is rotated before it is written, and the returned q is rotated; without
    them q is returned unchanged. Nothing here may synchronize with the host.

``attention_kv(q, k_cache, v_cache, args) -> (out, lse)``
    q ``(batch, seqlen_q, nheads, headdim)`` attends to the keys ``[cache_leftpad[b],
    cache_seqlens[b] + seqlen_new)`` of its cache row (the appended tokens included); causal and
    windows are aligned bottom-right to that key count. ``out`` ``(batch, seqlen_q, nheads,
    headdim_v)`` in q's dtype, ``lse`` float32 ``(batch, nheads, seqlen_q)``. No host
    synchronization, no allocation whose size depends on tensor values (CUDA-graph capturable).

``merge_states(out_a, lse_a, out_b, lse_b, out=None, lse=None) -> (out, lse)``
    The attention of the union of two disjoint key sets from the two partial results:
    ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``;
    outs ``(batch, seqlen, nheads, headdim)`` (out_a's dtype for the result), lses float32
    ``(batch, nheads, seqlen)``. Both ``-inf``: out 0, lse ``-inf``. Given ``out`` and ``lse`` (any float
    dtype of out, unit last strides), the result is written there; they may be ``out_a`` and ``lse_a``
    (merged in place, as ring attention accumulates its steps).

The math every backend computes (``diag = seqlen_k - seqlen_q`` of the row's sequence)::

    s_ij = scale * q_i . k_j
    s_ij = softcap * tanh(s_ij / softcap)                       if softcap > 0
    s_ij += -slope[b, h] * |i + diag - j|                       if alibi_slopes
    s_ij += bias[b, h, i, j]    (float bias)                    if attn_bias
    s_ij = -inf unless j < seqlen_k
                   and j >= i + diag - window_left              if window_left >= 0
                   and j <= i + diag + window_right             if window_right >= 0
                   and bias[b, h, i, j]   (bool bias)
    lse_i = log(sum_j exp(s_ij) + exp(sink[h]))                 (the sink term only with a sink)
    p_ij = exp(s_ij - lse_i)
    out_i = sum_j p_ij * z_ij / (1 - dropout_p) * v_j           z = flashtile.rng.dropout_keep (1 without dropout)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, eq=False)
class AttnArgs:
    """Everything a backend needs besides q, k and v, validated and normalised by the API.

    ``causal`` is already folded into the window: causal calls have ``window_right = 0``.
    Tensors live on q's device.
    """

    softmax_scale: float
    causal: bool = False
    # Keys visible to query i: [i + diag - window_left, i + diag + window_right]; -1 = unbounded.
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    # float32 (batch, nheads); a (nheads,) input arrives expanded (batch stride 0).
    alibi_slopes: Optional[torch.Tensor] = None
    # (nheads,), contiguous, in any of the inputs' dtypes: one extra logit per query head in each row's
    # softmax denominator (read as float32).
    sink: Optional[torch.Tensor] = None
    # (batch, nheads, seqlen_q, seqlen_k) view (broadcast dims have stride 0); float: added to
    # the scores, bool: True = keep. Dense calls only.
    attn_bias: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    # Counters of the dropout RNG (flashtile.rng): drawn once per forward, reused by its backward.
    seed: int = 0
    offset: int = 0
    # Varlen: int32 (batch + 1,) prefix sums of the sequence lengths; tokens of sequence b are
    # rows cu_seqlens[b]:cu_seqlens[b + 1] of the packed q (k, v).
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # int32 (batch,): sequence b uses only its first seqused_k[b] keys.
    seqused_k: Optional[torch.Tensor] = None
    # Varlen: the rows of the packed k (the kernels keep every offset within them); -1: not given.
    total_k: int = -1
    # Gradients bit-identical run to run: no kernel whose float sums depend on the order its programs finish.
    deterministic: bool = False

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


@dataclass(frozen=True, eq=False)
class KVCacheArgs(AttnArgs):
    """A KV-cache call (``flash_attn_with_kvcache``), validated and normalised by the API.

    The fields of :class:`AttnArgs` that apply (scale, causal, window, softcap, alibi_slopes, sink)
    mean what they mean there; ``max_seqlen_k`` is the capacity of one sequence (``seqlen_cache``,
    or ``max_blocks_per_seq * page_size`` when paged): an upper bound of its keys that never needs
    the tensors' values. No dropout or bias; ``cu_seqlens_q`` (packed q, ``max_seqlen_q`` rows a
    sequence) only where the Triton backend runs a varlen decode step on its KV-cache kernel.

    Key row ``r`` of batch row ``b`` lives at:
        contiguous cache ``(batch_cache, seqlen_cache, nheads_kv, headdim)``:
            ``k_cache[cache_batch_idx[b] (or b), r]``
        paged cache ``(num_blocks, page_size, nheads_kv, headdim)``:
            ``k_cache[block_table[b, r // page_size], r % page_size]``
    """

    # int32 (batch,): keys already in the cache of each batch row, before this call's new tokens.
    cache_seqlens: Optional[torch.Tensor] = None
    # New tokens appended (and attended to) by this call; 0 without k/v.
    seqlen_new: int = 0
    # int32 (batch,): which row of a contiguous cache each batch row uses.
    cache_batch_idx: Optional[torch.Tensor] = None
    # int32 (batch,): the first valid key row of each batch row (left padding before it).
    cache_leftpad: Optional[torch.Tensor] = None
    # int32 (batch, max_blocks_per_seq): pages of a paged cache.
    block_table: Optional[torch.Tensor] = None
    # (seqlen_ro, rotary_dim / 2) cos and sin tables; rotary_dim <= headdim, even.
    rotary_cos: Optional[torch.Tensor] = None
    rotary_sin: Optional[torch.Tensor] = None
    # True: pairs (2i, 2i + 1) rotate (GPT-J); False: pairs (i, i + rotary_dim / 2) (GPT-NeoX).
    rotary_interleaved: bool = True
    # Key splits per sequence, merged afterwards; 0 = the backend picks from the shapes alone.
    num_splits: int = 0
    # An FP8 cache (float8_e4m3fn): float32 (batch, nheads_kv) views (a per-KV-head descale has batch stride 0).
    # Key row r of batch row b holds k_cache[...] * k_descale[b, h]; new tokens are written as
    # e4m3(clamp(k / k_descale[b, h], -448, 448)) (after the rotary embedding). None for a 16-bit cache.
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None

    @property
    def fp8(self) -> bool:
        return self.k_descale is not None

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int:
        return self.max_seqlen_k // self.block_table.shape[1] if self.paged else self.max_seqlen_k


@dataclass(frozen=True)
class AttentionCall:
    """The properties of one attention call that decide which backend and kernel can run it.

    For a varlen call (:attr:`varlen`) ``batch`` is the number of sequences
    (``len(cu_seqlens_q) - 1``) and ``seqlen_q`` / ``seqlen_k`` are ``max_seqlen_q`` / ``max_seqlen_k``.
    """

    device: torch.device
    dtype: torch.dtype
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool
    # Optional features the call asks for, each as ``(name, "argument=value: what it is")``; names are
    # those of a backend's FEATURES: dropout, window, softcap, alibi, sink, bias, varlen, headdim_v,
    # kvcache, paged, fp8_cache. A kvcache call's ``seqlen_k`` is the cache capacity (``KVCacheArgs.max_seqlen_k``).
    features: tuple = ()
    # The head dim of v (and of the output); None means ``headdim``.
    headdim_v: Optional[int] = None
    # Tokens per page of a paged KV cache; 0 otherwise.
    page_size: int = 0
    # (window_left, window_right) as in AttnArgs (causal is window_right = 0; -1 = unbounded).
    window: tuple = (-1, -1)
    # AttnArgs.softcap (0: none); its value decides how the Hopper forward runs the softmax.
    softcap: float = 0.0
    # AttnArgs.deterministic: whether the backward must add its sums in a fixed order.
    deterministic: bool = False

    def __post_init__(self):
        if self.headdim_v is None:
            object.__setattr__(self, "headdim_v", self.headdim)

    @property
    def feature_names(self) -> frozenset:
        return frozenset(name for name, _ in self.features)

    @property
    def kvcache(self) -> bool:
        """Whether the call attends over a KV cache (``flash_attn_with_kvcache``)."""
        return "kvcache" in self.feature_names

    @property
    def varlen(self) -> bool:
        """Whether the call packs variable-length sequences (``cu_seqlens``) instead of a dense batch."""
        return "varlen" in self.feature_names

    @classmethod
    def of(cls, q, k, v, args: AttnArgs) -> AttentionCall:
        """The call that runs ``forward(q, k, v, args)`` (q, k, v and args already validated)."""
        if args.varlen:
            batch = args.cu_seqlens_q.shape[0] - 1
            seqlen_q, seqlen_k = args.max_seqlen_q, args.max_seqlen_k
            _, nheads, headdim = q.shape
            nheads_kv = k.shape[1]
        else:
            batch, seqlen_q, nheads, headdim = q.shape
            seqlen_k, nheads_kv = k.shape[1], k.shape[2]
            if isinstance(args, KVCacheArgs):
                seqlen_k = args.max_seqlen_k
        headdim_v = v.shape[-1]
        page_size = args.page_size if isinstance(args, KVCacheArgs) and args.paged else 0
        return cls(q.device, q.dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, bool(args.causal),
                   _features(args, headdim, headdim_v), headdim_v, page_size,
                   (args.window_left, args.window_right), args.softcap, bool(args.deterministic))


def _shape(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}".replace("torch.", "")


def present_features(args: AttnArgs, headdim: int, headdim_v: int) -> tuple:
    """The names of the optional features a call uses, in a fixed order (cheap: no descriptions)."""
    kvcache = isinstance(args, KVCacheArgs)
    present = (
        ("dropout", args.dropout_p > 0),
        # A causal call without a left bound is plain causal (window_right = 0 is how causal is stored).
        ("window", args.window_left >= 0 or (args.window_right >= 0 and not args.causal)),
        ("softcap", args.softcap > 0),
        ("alibi", args.alibi_slopes is not None),
        ("sink", args.sink is not None),
        ("bias", args.attn_bias is not None),
        ("kvcache", kvcache),
        ("paged", kvcache and args.paged),
        ("fp8_cache", kvcache and args.fp8),
        ("varlen", args.varlen),
        ("headdim_v", headdim_v != headdim),
    )
    return tuple(name for name, used in present if used)


def _features(args: AttnArgs, headdim: int, headdim_v: int) -> tuple:
    """The optional features of a call, in a fixed order, as ``(name, "argument=value: what it is")``."""
    def describe(name: str) -> str:
        if name == "dropout":
            return f"dropout_p={args.dropout_p}: dropout"
        if name == "window":
            with_causal = " with causal=True" if args.causal else ""
            return f"window_size=({args.window_left}, {args.window_right}){with_causal}: sliding-window attention"
        if name == "softcap":
            return f"softcap={args.softcap}: softcapping"
        if name == "alibi":
            return f"alibi_slopes={_shape(args.alibi_slopes)}: ALiBi"
        if name == "sink":
            return f"sink={_shape(args.sink)}: attention sinks"
        if name == "bias":
            kind = "boolean attention mask" if args.attn_bias.dtype == torch.bool else "additive attention bias"
            return f"attn_bias={_shape(args.attn_bias)}: {kind}"
        if name == "kvcache":
            return "flash_attn_with_kvcache: attention over a KV cache"
        if name == "paged":
            return f"block_table={_shape(args.block_table)}: a paged KV cache (page_size={args.page_size})"
        if name == "fp8_cache":
            return f"k_descale={_shape(args.k_descale)}: an FP8 (float8_e4m3fn) KV cache"
        if name == "varlen":
            used = " with seqused_k" if args.seqused_k is not None else ""
            return f"cu_seqlens_q={_shape(args.cu_seqlens_q)}{used}: variable-length sequences"
        return f"headdim_v={headdim_v}: a value head dim that differs from headdim={headdim}"

    return tuple((name, describe(name)) for name in present_features(args, headdim, headdim_v))


def missing_features(call: AttentionCall, implemented) -> str | None:
    """The first feature ``call`` asks for that is not in ``implemented``, described, or None."""
    for name, description in call.features:
        if name not in implemented:
            return description
    return None
