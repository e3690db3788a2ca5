"""``flashtile.explain``: which backend and kernel a call would run, with what configuration, and
why every other backend was passed over. It validates and plans; it runs no kernel."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import validation
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
            alibi_slopes=None, deterministic=False, return_attn_probs=False) -> Explanation:
    """Explain the call ``flash_attn_func(q, k, v, ...)`` with the same arguments would make.

    Returns an :class:`Explanation`; an invalid call is reported in its ``error`` field, not raised.
    """
    try:
        validation.check_qkv(q, k, v)
        validation.check_softmax_scale(softmax_scale, q.shape[-1])
    except (TypeError, ValueError) as error:
        return Explanation(None, "", "", {}, None, None, {name: "invalid call" for name in BACKENDS}, str(error))
    result = plan(AttentionCall.of(q, k, causal, dropout_p, window_size, softcap, alibi_slopes))
    return Explanation(
        backend=result.backend, kernel=result.fwd_name, backward_kernel=result.bwd_name, config=result.config,
        preferred=result.preferred, fallback_reason=result.fallback_reason, rejected=result.rejected,
        error=None if result.error is None else str(result.error),
    )
