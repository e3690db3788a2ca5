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

``forward(q, k, v, softmax_scale, causal) -> (out, lse)``
    q ``(batch, seqlen_q, nheads, headdim)``, k/v ``(batch, seqlen_k, nheads_kv, headdim)``,
    any strides, one dtype (fp16/bf16/fp32), already validated; seqlens may be 0.
    ``out`` has q's shape and dtype; ``lse`` is ``(batch, nheads, seqlen_q)`` float32,
    natural log, ``-inf`` for a row that sees no key (whose output is 0).

``backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dq, dk, dv) -> None``
    Writes the gradients into ``dq``, ``dk``, ``dv`` (same shapes as q, k, v; possibly
    strided views of one packed tensor). dK/dV of a KV head sum over its query-head group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCall:
    """The properties of one attention call that decide which backend and kernel can run it."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool
    # Optional features the call asks for, each as ``name: "argument=value: what it is"``.
    features: tuple = ()

    @classmethod
    def of(cls, q, k, causal=False, dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
        """The call ``flash_attn_func(q, k, v, ...)`` makes (q and k already validated)."""
        features = []
        if dropout_p != 0.0:
            features.append(("dropout", f"dropout_p={dropout_p}: dropout"))
        if tuple(window_size) != (-1, -1):
            features.append(("window", f"window_size={tuple(window_size)}: sliding-window attention"))
        if softcap != 0.0:
            features.append(("softcap", f"softcap={softcap}: softcapping"))
        if alibi_slopes is not None:
            features.append(("alibi", "alibi_slopes: ALiBi"))
        batch, seqlen_q, nheads, headdim = q.shape
        return cls(q.device, q.dtype, batch, seqlen_q, k.shape[1], nheads, k.shape[2], headdim,
                   bool(causal), tuple(features))


def missing_features(call: AttentionCall, implemented) -> str | None:
    """The first feature ``call`` asks for that is not in ``implemented``, described, or None."""
    for name, description in call.features:
        if name not in implemented:
            return description
    return None
