"""Output allocation. With ``FLASHTILE_POISON=1`` (the test suite sets it) every buffer a
kernel must fill starts as NaN, so an element the kernel forgets to write fails the test
instead of passing as a plausible value left over in memory."""
from __future__ import annotations

import os

import torch


def _poison() -> bool:
    return os.environ.get("FLASHTILE_POISON", "0") not in ("", "0")


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if _poison() else t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if _poison() else out
