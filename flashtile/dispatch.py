"""Which backend runs a call, why, and the record of it.

Backends are tried in the order of :data:`BACKENDS`; each says through its ``supports(call)``
whether it can run a call and, if not, why. The first that can runs it. Every device has a
*preferred* backend: Triton for CUDA tensors and for CPU tensors under ``TRITON_INTERPRET=1``
(how CI tests the kernels), the pure-PyTorch tiled backend for other CPU tensors. A call that
the preferred backend cannot run is a *fallback*: it is counted in :func:`stats` by reason,
warned about once per reason and logged at INFO on the ``flashtile`` logger, or, in strict
mode (:func:`set_strict` or ``FLASHTILE_STRICT=1``), refused with :class:`FallbackError`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import env, replay
from .backends import AttentionCall, missing_features

logger = logging.getLogger("flashtile")

TRITON = "triton"
TORCH = "torch"
# Dispatch order: the first backend that can run a call runs it.
BACKENDS = (TRITON, TORCH)
_LIGHT_MODULES = {TRITON: "flashtile.backends.triton", TORCH: "flashtile.backends.torch_tiled"}
_KERNEL_MODULES = {TRITON: "flashtile.backends.triton.launch", TORCH: "flashtile.backends.torch_tiled"}

_lock = threading.Lock()
_calls: Counter = Counter()
_kernels: Counter = Counter()
_fallbacks: Counter = Counter()
_warned: set = set()
_forced: list = []
_disabled: list = []
_strict = [False]


class FallbackError(RuntimeError):
    """Raised in strict mode when a call cannot run on its device's preferred backend."""


@dataclass
class Plan:
    """The dispatch decision for one call: what runs, under which names, and why not the others."""

    call: AttentionCall
    preferred: str
    backend: str | None
    rejected: dict = field(default_factory=dict)
    fwd_name: str = ""
    bwd_name: str = ""
    # Shared by every plan of the same kind of call: read it through ``config`` (a copy).
    tiles: dict = field(default_factory=dict, repr=False)
    error: Exception | None = None

    @property
    def config(self) -> dict:
        """The launch configuration of the chosen backend (a copy the caller may change)."""
        return copy.deepcopy(self.tiles)

    @property
    def fallback_reason(self) -> str | None:
        if self.backend is None or self.backend == self.preferred:
            return None
        return self.rejected.get(self.preferred)


def stats() -> dict:
    """``{"calls": {backend: n}, "kernels": {profiler name: n}, "fallbacks": {reason: n}, "device_errors": [...]}``
    since the last reset. ``device_errors`` lists the bad index values the kernels recorded and nobody has
    checked yet (:func:`flashtile.check_device_errors`; reading them waits for the device's queued work)."""
    from . import device_errors

    with _lock:
        counts = {"calls": dict(_calls), "kernels": dict(_kernels), "fallbacks": dict(_fallbacks)}
    return {**counts, "device_errors": device_errors.pending()}


def reset_stats() -> None:
    """Clear the counters and the device-side error records (a fallback reason already warned about is not
    warned again)."""
    from . import device_errors

    with _lock:
        _calls.clear()
        _kernels.clear()
        _fallbacks.clear()
    device_errors.clear()


def set_strict(strict: bool = True) -> None:
    """In strict mode a fallback raises :class:`FallbackError` instead of warning, and a bad index value a kernel
    recorded (flashtile/device_errors.py) raises ``ValueError`` where the host waits for the device anyway."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool (True or False), got {strict!r} ({type(strict).__name__})")
    _strict[0] = strict


def strict_enabled() -> bool:
    return _strict[0] or env.flag("FLASHTILE_STRICT")


@contextlib.contextmanager
def force_backend(name: str):
    """Run calls inside the block on backend ``name`` (for tests and benchmarks); never a fallback."""
    _check_name(name)
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


@contextlib.contextmanager
def disable_backends(*names: str):
    """Treat the named backends as unable to run anything inside the block.

    ``FLASHTILE_DISABLE_BACKENDS=triton,torch`` does the same for the whole process.
    """
    for name in names:
        _check_name(name)
    _disabled.append(names)
    try:
        yield
    finally:
        _disabled.pop()


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def _is_disabled(name: str) -> bool:
    from_env = env.get("FLASHTILE_DISABLE_BACKENDS", "").replace(" ", "").split(",")
    return name in from_env or any(name in names for names in _disabled)


def preferred_backend(device) -> str:
    """Triton for CUDA tensors (and CPU tensors under the interpreter), else the torch backend."""
    if device.type == "cuda":
        return TRITON
    if device.type == "cpu" and _light(TRITON).interpreter_enabled():
        return TRITON
    return TORCH


@functools.lru_cache(maxsize=None)
def _light(name: str):
    return importlib.import_module(_LIGHT_MODULES[name])


@functools.lru_cache(maxsize=None)
def get_backend(name: str):
    """The module that runs ``name``'s kernels: it offers ``forward(...)`` and ``backward(...)``."""
    return importlib.import_module(_KERNEL_MODULES[name])


def profiled(name: str):
    """A ``torch.profiler.record_function(name)`` block while a profiler runs; otherwise nothing,
    which saves a few microseconds per call."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _reason(name: str, call: AttentionCall) -> str | None:
    if _is_disabled(name):
        return "disabled (by disable_backends() or FLASHTILE_DISABLE_BACKENDS)"
    return _light(name).supports(call)


@functools.lru_cache(maxsize=1024)
def _describe(name: str, call: AttentionCall):
    # Names and tiles depend only on the call's properties: work them out once per kind of call,
    # not on every step of a training loop.
    return _light(name).describe(call)


def check_features(call: AttentionCall) -> None:
    """Raise ``NotImplementedError`` naming the first feature of ``call`` that no backend implements."""
    implemented = frozenset().union(*(_light(name).FEATURES for name in BACKENDS))
    missing = missing_features(call, implemented)
    if missing:
        raise NotImplementedError(f"{missing} is not implemented yet in flashtile (no backend supports it)")


def plan(call: AttentionCall) -> Plan:
    """Decide, without running or recording anything, which backend would run ``call``."""
    result = Plan(call, preferred_backend(call.device), None)
    candidates = (_forced[-1],) if _forced else BACKENDS
    for name in BACKENDS:
        reason = _reason(name, call)
        if reason is not None:
            result.rejected[name] = reason
        elif result.backend is None and name in candidates:
            result.backend = name
    if _forced and result.backend is None:
        result.error = RuntimeError(f"forced backend {_forced[-1]!r} cannot run this call: {result.rejected[_forced[-1]]}")
    elif result.backend is None:
        try:
            check_features(call)
        except NotImplementedError as error:
            result.error = error
        else:
            reasons = "; ".join(f"{name}: {why}" for name, why in result.rejected.items())
            result.error = RuntimeError(f"no flashtile backend can run this call ({reasons})")
    else:
        result.fwd_name, result.bwd_name, result.tiles = _describe(result.backend, call)
        if _forced:
            result.preferred = result.backend
    return result


def merge_call(out) -> AttentionCall:
    """The call ``merge_attention_states`` makes on partial outputs like ``out`` ``(batch, seqlen, nheads,
    headdim)``: one feature, ``merge``, which a backend lists in FEATURES when it has ``merge_states``."""
    batch, seqlen, nheads, headdim = out.shape
    return AttentionCall(out.device, out.dtype, batch, seqlen, 0, nheads, nheads, headdim, False,
                         (("merge", "merge_attention_states: merging partial attention results"),))


def dispatch(call: AttentionCall) -> Plan:
    """:func:`plan` the call, enforce the fallback policy, and record the choice."""
    # stacklevel 5: the user's line that called flash_attn_func (enforce <- dispatch <- _attention <- flash_attn_func).
    return enforce(plan(call), stacklevel=5)


def enforce(result: Plan, stacklevel: int = 2) -> Plan:
    """What :func:`dispatch` does with the plan it made, for a plan made earlier by :func:`plan`: raise its error,
    or enforce the fallback policy (a FallbackError in strict mode) and record the choice. ``stacklevel``: that of
    a fallback's warning, as :func:`record_fallback` takes it."""
    if result.error is not None:
        raise result.error
    reason = result.fallback_reason
    if reason is None:
        record_choice(result)
    else:
        record_fallback(reason, result.backend, preferred=result.preferred, stacklevel=stacklevel)
        record_kernel(result.fwd_name)
    return result


def refusal(result: Plan) -> Exception | None:
    """The error :func:`enforce` would raise for ``result`` (the plan's own, or strict mode's FallbackError), None if
    it would run; nothing is recorded (a caller that must agree with other processes first asks this)."""
    if result.error is not None:
        return result.error
    reason = result.fallback_reason
    return None if reason is None or not strict_enabled() else _strict_error(reason, result.preferred)


def _strict_error(reason: str, preferred: str) -> FallbackError:
    return FallbackError(f"flashtile strict mode: the {preferred} backend cannot run this call: {reason}")


def record_choice(result: Plan) -> None:
    """Count a call that runs on its preferred backend, as :func:`dispatch` does (for a plan it made earlier)."""
    with _lock:
        _calls[result.backend] += 1
        _kernels[result.fwd_name] += 1


# Plans of repeated calls (every layer of every step repeats a few shapes), with their validated
# arguments, under the caller's key of the call's signature plus state_key(): a repeat skips
# validation and planning. Only plans that run on the preferred backend are kept.
_remembered: dict = {}
_REMEMBER_MAX = 1024


def recall(key):
    """What :func:`remember` kept under ``key``, or None."""
    return _remembered.get(key)


def remember(key, value) -> None:
    """Keep ``value`` under ``key`` (the oldest plans are dropped all at once past _REMEMBER_MAX)."""
    if len(_remembered) >= _REMEMBER_MAX:
        _remembered.clear()
    _remembered[key] = value


def forget_plans() -> None:
    """Drop the remembered plans (after changing what a backend supports, e.g. in a test)."""
    _remembered.clear()


def state_key() -> tuple:
    """Everything besides the call that :func:`plan` and the fallback policy read: forced and disabled
    backends, strict mode and the environment variables behind them. A plan made under one key holds
    while the key is unchanged."""
    return (tuple(_forced), tuple(_disabled), _strict[0], env.get("FLASHTILE_DISABLE_BACKENDS"),
            env.get("FLASHTILE_STRICT"), env.get("TRITON_INTERPRET"))


def record_fallback(reason: str, backend: str, *, preferred: str = "preferred", stacklevel: int = 2) -> None:
    """Record a call that runs on ``backend`` because the ``preferred`` backend cannot run it.

    Counts the call under ``stats()["calls"][backend]`` and the reason under
    ``stats()["fallbacks"][reason]``, logs at INFO and warns once per reason; in strict mode it
    raises :class:`FallbackError` instead and counts nothing. ``backend`` may lie outside
    :data:`BACKENDS` (e.g. ``"torch_sdpa"``, torch's own kernel). ``stacklevel`` is that of
    :func:`warnings.warn` as seen from the caller.
    """
    if strict_enabled():
        raise _strict_error(reason, preferred)
    # A replay would skip this record: such a call is never replayed.
    replay.not_replayable(f"a fallback: {reason}")
    with _lock:
        _calls[backend] += 1
        _fallbacks[reason] += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        message = f"flashtile fell back from the {preferred} to the {backend} backend: {reason}"
        logger.info(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def record_kernel(name: str) -> None:
    """Count a kernel that runs outside the forward call (the backward)."""
    with _lock:
        _kernels[name] += 1
