"""Small host-side helpers that every launcher (``launch.py`` for training, ``decode.py`` for KV
caches) uses on each call."""
from __future__ import annotations

import contextlib

import torch

from ... import replay
from .configs import capability


def cdiv(a: int, b: int) -> int:
    # triton.cdiv is a jit function: a few microseconds per host call, and this runs on every launch.
    return -(-a // b)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels address the head dim with stride 1; any other layout is read through strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def tma_rows(shape: tuple, dtype: torch.dtype, device, zeros: bool = False) -> torch.Tensor:
    """A tensor of ``shape`` whose rows (the last dim) start 16 bytes apart, as the TMA reads them: allocated with
    the last dim rounded up to a multiple of 16 bytes, then sliced back (an awkward length like 4133 included)."""
    from ...alloc import empty
    row = 16 // torch.empty((), dtype=dtype).element_size()
    padded = (*shape[:-1], cdiv(shape[-1], row) * row)
    base = torch.zeros(padded, dtype=dtype, device=device) if zeros else empty(padded, dtype, device)
    return base[..., :shape[-1]]


def bsh_strides(t: torch.Tensor, varlen: bool) -> tuple:
    """(batch, seq, head) strides of ``(batch, seq, heads, headdim)``, or of packed ``(tokens, heads, headdim)``
    with batch stride 0 (each sequence starts at its own row instead)."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple:
    """(batch, head) strides of lse: ``(batch, nheads, seqlen_q)``, or ``(nheads, tokens)`` for varlen."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def on_device(t: torch.Tensor):
    # Switching devices costs host time on every call: only when t is not on the current one.
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


class _SideStream:
    """A second stream of one device, and the two events that fork it from and join it to the
    current stream (reused: a wait takes the event's state when it is issued)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.forked = torch.cuda.Event()
        self.joined = torch.cuda.Event()

    def fork(self) -> None:
        """The side stream waits for the work queued so far on the current stream."""
        self.forked.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self.forked)

    def join(self) -> None:
        """The current stream waits for the work queued so far on the side stream."""
        self.joined.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(self.joined)


_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def fork(t: torch.Tensor, enabled: bool):
    """Yields a ``torch.cuda.Stream`` of ``t``'s device for launches that may run alongside the ones
    the caller makes on the current stream after the fork (None when not ``enabled`` or on CPU); on
    exit the current stream waits for them. Fits CUDA-graph capture: the side stream joins it through
    the fork and join. Events rather than ``wait_stream`` and an explicit stream rather than
    ``torch.cuda.stream``: each of those costs the host more per call. A recorded call notes the fork
    and the join among its launches, so that its replay forks and joins the same way."""
    if not (enabled and t.is_cuda):
        yield None
        return
    side = _SIDE_STREAMS.get(t.device.index)
    if side is None:
        side = _SIDE_STREAMS[t.device.index] = _SideStream(t.device)
    side.fork()
    recorder = replay.active()
    if recorder is not None:
        recorder.launches.append((_Step(side.fork), []))
    try:
        yield side.stream
    finally:
        side.join()
        if recorder is not None:
            recorder.launches.append((_Step(side.join), []))


class _Step:
    """A recorded step that takes no argument (a fork or a join), run again by a replay."""

    __slots__ = ("run",)
    # Nothing to address: fits a replay that passes tensors as addresses.
    pointers = True

    def __init__(self, run):
        self.run = run

    def __call__(self, args) -> None:
        self.run()


def input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in true fp32, never silently in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def dependent_launch(t: torch.Tensor) -> bool:
    """Whether a kernel on ``t``'s device may start as a programmatic dependent of the one before it (Hopper
    on): its launch and first instructions overlap the other's tail, and ``gdc_wait`` holds it until that
    one's writes are visible."""
    return t.is_cuda and capability(t.device)[0] >= 9


def fold_scale(args) -> bool:
    """Whether the Gluon forward folds softcap's scale (``softmax_scale / softcap``) into its Q tile, rounded
    to Q's dtype like the inputs: the tanh then takes ``q . k`` with no multiply a score. Not for a scale above
    1, where the larger Q could overflow fp16. (The Triton kernels keep the multiply: the same fold there
    measured slower, its backward 1.2-1.4x.)"""
    return 0 < args.softcap and args.softmax_scale <= args.softcap


def fast_tanh(q: torch.Tensor) -> bool:
    # The GPU's tanh.approx is within a 16-bit input's rounding; fp32 inputs get the exact formula.
    return q.is_cuda and q.dtype != torch.float32
