"""Argument checks for the public API.

Every check raises ``ValueError`` or ``TypeError`` that names the argument and
quotes the actual shape, dtype or device, and says what was expected.
"""
from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


def _describe(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}"


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    """``t`` must be a floating tensor of rank ``ndim`` in a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got {t.dim()} dims ({_describe(t)})")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has unsupported dtype {t.dtype} ({_describe(t)}); "
            "expected torch.float16, torch.bfloat16 or torch.float32"
        )


def check_packed(name: str, t, parts: int, layout: str) -> tuple:
    """``t`` packs ``parts`` tensors along dim 2; returns them as views (no copy)."""
    check_tensor(name, t, 5, layout)
    if t.shape[2] != parts:
        raise ValueError(f"{name} must have shape {layout}, got dim 2 of size {t.shape[2]} (shape={tuple(t.shape)})")
    return t.unbind(2)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate q, k, v in the ``(batch, seqlen, nheads, headdim)`` layout."""
    layout = "(batch, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4, layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    bq, _, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)} and v={tuple(v.shape)}")
    if bq != bk:
        raise ValueError(f"batch mismatch: q has batch {bq} ({_describe(q)}) but k has batch {bk} ({_describe(k)})")
    if dq != dk:
        raise ValueError(f"headdim mismatch: q has headdim {dq} but k/v have headdim {dk} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"nheads of q must be a multiple of nheads of k/v, got q nheads={hq} and k/v nheads={hk} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    if dq % 8 != 0 or dq < 8 or dq > MAX_HEADDIM:
        raise ValueError(
            f"headdim must be a multiple of 8 between 8 and {MAX_HEADDIM}, got {dq} (q {tuple(q.shape)}); "
            "pad the head dimension to the next multiple of 8"
        )
    if bq < 1:
        raise ValueError(f"batch must be >= 1, got q {tuple(q.shape)}")


def check_softmax_scale(softmax_scale, headdim: int) -> float:
    """Return the scale to use: ``1/sqrt(headdim)`` when ``softmax_scale`` is None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, torch.Tensor) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive float, got {scale}")
    return scale
