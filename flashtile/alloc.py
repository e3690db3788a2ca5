"""Output allocation. With ``FLASHTILE_POISON=1`` (the test suite sets it) every buffer a
kernel must fill starts as NaN, so an element the kernel forgets to write fails the test
instead of passing as a plausible value left over in memory."""
from __future__ import annotations

import torch

from . import env, recording


def poisoned() -> bool:
    """Whether new buffers start as NaN (``FLASHTILE_POISON=1``)."""
    return env.flag("FLASHTILE_POISON")


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    recording.note_buffer(t)
    return t.fill_(float("nan")) if poisoned() else t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    recording.note_buffer(out)
    return out.fill_(float("nan")) if poisoned() else out
