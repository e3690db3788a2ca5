"""Small host-side helpers that every launcher (``launch.py`` for training, ``decode.py`` for KV
caches) uses on each call."""
from __future__ import annotations

import contextlib

import torch


def cdiv(a: int, b: int) -> int:
    # triton.cdiv is a jit function: a few microseconds per host call, and this runs on every launch.
    return -(-a // b)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels address the head dim with stride 1; any other layout is read through strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def on_device(t: torch.Tensor):
    # Switching devices costs host time on every call: only when t is not on the current one.
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def fork(t: torch.Tensor, enabled: bool):
    """Yields a context for launches that may run alongside the ones the caller makes after it, on a
    second stream of ``t``'s device (the current stream otherwise); on exit the current stream waits
    for them. Fits CUDA-graph capture: the side stream joins it through the fork and join."""
    if not (enabled and t.is_cuda):
        yield contextlib.nullcontext
        return
    main = torch.cuda.current_stream(t.device)
    side = _SIDE_STREAMS.get(t.device.index)
    if side is None:
        side = _SIDE_STREAMS[t.device.index] = torch.cuda.Stream(t.device)
    side.wait_stream(main)
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


def input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in true fp32, never silently in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def fast_tanh(q: torch.Tensor) -> bool:
    # The GPU's tanh.approx is within a 16-bit input's rounding; fp32 inputs get the exact formula.
    return q.is_cuda and q.dtype != torch.float32
