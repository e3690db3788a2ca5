"""Which backend runs a call, why, and the record of it.

CUDA tensors go to the Triton backend; CPU tensors go to the pure-PyTorch tiled
backend, except under ``TRITON_INTERPRET=1`` where the Triton kernels run on CPU
tensors through Triton's interpreter. A call that cannot take its device's
preferred backend is a *fallback*: it is counted in :func:`stats` by reason and
warned about once per reason. Nothing changes path in silence.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections import Counter

import torch

logger = logging.getLogger("flashtile")

TRITON = "triton"
TORCH = "torch"
BACKENDS = (TRITON, TORCH)

_lock = threading.Lock()
_calls: Counter = Counter()
_fallbacks: Counter = Counter()
_warned: set = set()
_forced: list = []


def stats() -> dict:
    """``{"calls": {backend: count}, "fallbacks": {reason: count}}`` since the last reset."""
    with _lock:
        return {"calls": dict(_calls), "fallbacks": dict(_fallbacks)}


def reset_stats() -> None:
    """Clear the call and fallback counters (fallback warnings are not repeated)."""
    with _lock:
        _calls.clear()
        _fallbacks.clear()


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot serve tensors on ``device``, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu":
        return None if interpreter_enabled() else "CPU tensors run on the torch backend unless TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"device type {device.type!r} has no Triton backend"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"GPU compute capability {major}.{minor} is below 8.0 (Ampere), which the Triton kernels need"
    return None


@contextlib.contextmanager
def force_backend(name: str):
    """Run calls inside the block on backend ``name`` (for tests and benchmarks)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def select_backend(q: torch.Tensor) -> str:
    """Pick the backend for a call on ``q``'s device and record the choice."""
    if _forced:
        backend = _forced[-1]
        _record(backend, None)
        return backend
    reason = _triton_unavailable_reason(q.device)
    if reason is None:
        backend = TRITON
    else:
        backend = TORCH
        # CPU tensors belong to the torch backend: only a CUDA tensor that misses Triton is a fallback.
        if q.device.type == "cpu":
            reason = None
    _record(backend, reason)
    return backend


def _record(backend: str, fallback_reason: str | None) -> None:
    with _lock:
        _calls[backend] += 1
        if fallback_reason is None:
            return
        _fallbacks[fallback_reason] += 1
        first = fallback_reason not in _warned
        _warned.add(fallback_reason)
    if first:
        message = f"flashtile fell back to the {backend} backend: {fallback_reason}"
        logger.info(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def get_backend(name: str):
    """The backend module: it offers ``forward(...)`` and ``backward(...)``."""
    if name == TRITON:
        from .backends.triton import launch

        return launch
    from .backends import torch_tiled

    return torch_tiled
