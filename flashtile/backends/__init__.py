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

``backward(dout, q, k, v, out, lse, args, dq, dk, dv, dsink, dbias) -> None``
    Writes the gradients into ``dq``, ``dk``, ``dv`` (same shapes as q, k, v; possibly strided
    views of one packed tensor). dK/dV of a KV head sum over its query-head group. ``dsink``
    is None or a float32 ``(nheads,)`` tensor to fill; ``dbias`` is None or a contiguous float32
    ``(batch, nheads, seqlen_q, seqlen_k)`` tensor to fill with dL/d(score) (the autograd layer
    sums it down to the bias's broadcast shape). Every backend is deterministic: no atomics.

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
    # float32 (nheads,): one extra logit per query head in each row's softmax denominator.
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

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


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
    # those of a backend's FEATURES: dropout, window, softcap, alibi, sink, bias, varlen, headdim_v.
    features: tuple = ()
    # The head dim of v (and of the output); None means ``headdim``.
    headdim_v: Optional[int] = None

    def __post_init__(self):
        if self.headdim_v is None:
            object.__setattr__(self, "headdim_v", self.headdim)

    @property
    def feature_names(self) -> frozenset:
        return frozenset(name for name, _ in self.features)

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
        headdim_v = v.shape[-1]
        return cls(q.device, q.dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, bool(args.causal),
                   _features(args, headdim, headdim_v), headdim_v)


def _shape(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}".replace("torch.", "")


def _features(args: AttnArgs, headdim: int, headdim_v: int) -> tuple:
    """The optional features of a call, in a fixed order, as ``(name, "argument=value: what it is")``."""
    features = []
    if args.dropout_p > 0:
        features.append(("dropout", f"dropout_p={args.dropout_p}: dropout"))
    # A causal call without a left bound is plain causal (window_right = 0 is how causal is stored).
    if args.window_left >= 0 or (args.window_right >= 0 and not args.causal):
        with_causal = " with causal=True" if args.causal else ""
        features.append(("window", f"window_size=({args.window_left}, {args.window_right}){with_causal}: "
                                   "sliding-window attention"))
    if args.softcap > 0:
        features.append(("softcap", f"softcap={args.softcap}: softcapping"))
    if args.alibi_slopes is not None:
        features.append(("alibi", f"alibi_slopes={_shape(args.alibi_slopes)}: ALiBi"))
    if args.sink is not None:
        features.append(("sink", f"sink={_shape(args.sink)}: attention sinks"))
    if args.attn_bias is not None:
        kind = "boolean attention mask" if args.attn_bias.dtype == torch.bool else "additive attention bias"
        features.append(("bias", f"attn_bias={_shape(args.attn_bias)}: {kind}"))
    if args.varlen:
        used = " with seqused_k" if args.seqused_k is not None else ""
        features.append(("varlen", f"cu_seqlens_q={_shape(args.cu_seqlens_q)}{used}: variable-length sequences"))
    if headdim_v != headdim:
        features.append(("headdim_v", f"headdim_v={headdim_v}: a value head dim that differs from headdim={headdim}"))
    return tuple(features)


def missing_features(call: AttentionCall, implemented) -> str | None:
    """The first feature ``call`` asks for that is not in ``implemented``, described, or None."""
    for name, description in call.features:
        if name not in implemented:
            return description
    return None
