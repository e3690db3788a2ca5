"""The recording of one call: the buffers it allocates and the kernels it launches (for :mod:`flashtile.replay`).

:mod:`flashtile.alloc` notes each buffer here and the launchers note each launch; :mod:`flashtile.replay`
builds a replay from what was noted. This module imports nothing of flashtile, so that both can import it.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_local = threading.local()


class Recorder:
    """What one call allocated and launched."""

    def __init__(self):
        self.buffers: list = []
        # (launch, args): the launch is called as ``launch(args)`` to run the kernel again.
        self.launches: list = []
        self.unreplayable: str | None = None


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Note this thread's allocations and launches into ``recorder`` inside the block."""
    previous = getattr(_local, "recorder", None)
    _local.recorder = recorder
    try:
        yield recorder
    finally:
        _local.recorder = previous


def active() -> Recorder | None:
    """The recorder of this thread's current call, or None (nearly always)."""
    return getattr(_local, "recorder", None)


def not_replayable(reason: str) -> None:
    """Mark the current recording, if any, as one a replay cannot repeat: the call does ``reason``, work
    besides allocating and launching."""
    recorder = active()
    if recorder is not None:
        recorder.unreplayable = reason


def note_buffer(t: torch.Tensor) -> None:
    """Note a buffer a kernel will fill (:mod:`flashtile.alloc`) in the current recording, if any."""
    recorder = active()
    if recorder is not None:
        recorder.buffers.append(t)
