"""``flashtile.explain``: which backend and kernel a call would run, with what configuration, and
why every other backend was passed over. It validates and plans; it runs no kernel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import fp8, validation
from .backends import AttentionCall
from .dispatch import BACKENDS, plan


@dataclass
class Explanation:
    """What :func:`explain` found. ``str()`` gives a short report."""

    backend: str | None
    kernel: str
    backward_kernel: str
    config: dict
    preferred: str | None
    fallback_reason: str | None
    rejected: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def fallback(self) -> bool:
        return self.fallback_reason is not None

    def to_dict(self) -> dict:
        return {
            "backend": self.backend, "kernel": self.kernel, "backward_kernel": self.backward_kernel,
            "config": self.config, "preferred": self.preferred, "fallback": self.fallback,
            "fallback_reason": self.fallback_reason, "rejected": dict(self.rejected), "error": self.error,
        }

    def __str__(self) -> str:
        if self.backend is None:
            lines = [f"flashtile cannot run this call: {self.error}"]
        else:
            status = f"FALLBACK from {self.preferred}: {self.fallback_reason}" if self.fallback else "preferred backend"
            lines = [f"backend   {self.backend} ({status})",
                     f"forward   {self.kernel}",
                     f"backward  {self.backward_kernel}",
                     f"config    {self.config}"]
        lines += [f"not {name:7s} {why}" for name, why in self.rejected.items()]
        return "\n".join(lines)


def explain(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, deterministic=False, return_attn_probs=False, attn_bias=None, sink=None, *,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
            q_descale=None, k_descale=None, v_descale=None) -> Explanation:
    """Explain the call ``flash_attn_func(q, k, v, ...)`` with the same arguments would make.

    With ``cu_seqlens_q`` (and ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, optionally
    ``seqused_k``) it explains ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, ...)`` on packed
    ``(total_tokens, nheads, headdim)`` tensors instead.

    float8_e4m3fn q, k, v with ``q_descale``, ``k_descale``, ``v_descale`` explain the FP8 call (see docs/fp8.md).

    Returns an :class:`Explanation`; an invalid or unsupported call is reported in its ``error``
    field, not raised.
    """
    varlen = cu_seqlens_q is not None
    if isinstance(q, torch.Tensor) and q.dtype in validation.FP8_DTYPES:
        return _explain_fp8(q, k, v, q_descale, k_descale, v_descale, varlen, dict(
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, varlen=varlen,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_k=seqused_k), (dropout_p, alibi_slopes, sink, attn_bias))
    try:
        validation.check_qkv(q, k, v, varlen=varlen)
        args = validation.attn_args(
            q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, sink=sink, attn_bias=attn_bias, dropout_p=dropout_p, varlen=varlen,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, deterministic=deterministic)
    except (TypeError, ValueError, NotImplementedError) as error:
        return Explanation(None, "", "", {}, None, None, {name: "invalid call" for name in BACKENDS}, str(error))
    result = plan(AttentionCall.of(q, k, v, args))
    return Explanation(
        backend=result.backend, kernel=result.fwd_name, backward_kernel=result.bwd_name, config=result.config,
        preferred=result.preferred, fallback_reason=result.fallback_reason, rejected=result.rejected,
        error=None if result.error is None else str(result.error),
    )


def _explain_fp8(q, k, v, q_descale, k_descale, v_descale, varlen: bool, options: dict, refused: tuple) -> Explanation:
    """The FP8 call's plan (:func:`flashtile.fp8.plan`): the Gluon FP8 kernel or the torch statement of its math."""
    try:
        validation.check_qkv(q, k, v, varlen=varlen, dtypes=(torch.float8_e4m3fn,))
        validation.check_fp8_head_dims(q, v)
        validation.check_fp8_options(*refused)
        args = validation.attn_args(q, k, v, **options)
        batch, seqlen_q, seqlen_k = fp8._sizes(q, k, args)
        validation.check_descales(q, k, q_descale, k_descale, v_descale, batch, seqlen_q, seqlen_k)
    except (TypeError, ValueError, NotImplementedError) as error:
        return Explanation(None, "", "", {}, None, None, {name: "invalid call" for name in BACKENDS}, str(error))
    result = fp8.plan(q, k, args, (q_descale, k_descale, v_descale))
    return Explanation(backend=result.backend, kernel=result.fwd_name, backward_kernel="", config=result.config,
                       preferred=result.preferred, fallback_reason=result.fallback_reason, rejected=result.rejected)
