"""Launch a Triton kernel again without paying for Triton's per-call argument binding.

``kernel[grid](**kwargs)`` binds every argument, works out its specialization (dtype, 16-byte
alignment of pointers, ints divisible by 16 or equal to 1) and looks the compiled kernel up: on
the H200's host that costs about 100 us for the attention kernels' ~75 arguments, as long as a
small kernel runs. A training step calls the same kernel with the same shapes again and again,
so :class:`CachedLaunch` does that work once per *launch key* and afterwards calls the compiled
kernel's launcher directly, substituting only the arguments that change from call to call.

The caller promises that the key determines every *static* argument (shapes, strides, switches,
tile sizes) and therefore Triton's specialization of it; the *dynamic* arguments (named when the
launcher is built: tensors, float scalars, ints) are taken fresh on every call. What Triton
specializes them on is added to the key here: a tensor's dtype and 16-byte alignment, an int's
width, whether it is 1 and whether it divides by 16 (unless the kernel says ``do_not_specialize``).
So lengths and strides can be dynamic: a decode loop whose KV cache grows by one token a step, or
packed batches of other lengths, reuse one launch per specialization instead of one per length.
A call whose dynamic ints all equal an earlier call's (a training step, a decode step over a fixed
cache) finds its launch by their values, without working out their specialization again.
Launch hooks (e.g. a profiler's) are called as Triton calls them. Under Triton's interpreter every
call takes Triton's ordinary path. While a call is recorded (:mod:`flashtile.replay`), each launch is
noted with its compiled kernel, grid and every argument, so that the call can be replayed.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from ... import replay


def _interpreting() -> bool:
    from . import interpreter_enabled

    return interpreter_enabled()


def _current_stream() -> int:
    # Asked on every launch (inside a CUDA-graph capture it is the capturing stream), through the
    # raw call Triton's own launcher uses: torch.cuda.current_stream() builds a Stream object each time.
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


class CachedLaunch:
    """``launch(key, grid, dynamic, static)`` runs ``fn[grid](**dynamic, **static())``; a later call
    with the same key reuses the compiled kernel and the static arguments, and ``static`` is not
    called again.

    ``dynamic_names``: the arguments that may differ between calls with one key. Every tensor
    argument must be among them; ints among them are keyed by what Triton specializes them on.
    """

    def __init__(self, fn, dynamic_names: tuple, max_entries: int = 256):
        self.fn = fn
        self.names = tuple(fn.arg_names)
        unknown = set(dynamic_names) - set(self.names)
        if unknown:
            raise ValueError(f"{getattr(fn, '__name__', fn)} has no arguments {sorted(unknown)}")
        self.dynamic_names = tuple(dynamic_names)
        self.slots = tuple(self.names.index(name) for name in self.dynamic_names)
        # How Triton specializes each dynamic argument: (on its value, on its alignment).
        params = {param.name: param for param in getattr(fn, "params", ())}
        self.specialize = tuple(
            (not getattr(params.get(name), "do_not_specialize", False),
             not getattr(params.get(name), "do_not_specialize_on_alignment", False)) for name in self.dynamic_names)
        self.max_entries = max_entries
        self._values = operator.itemgetter(*self.dynamic_names)
        # Launches by the specialization of the dynamic arguments, and the same launches by their values.
        self._cache: dict = {}
        self._by_value: dict = {}

    def _kwargs(self, values: tuple, static) -> dict:
        """Every argument of a launch by name. A tensor (or a TMA descriptor of one) among the static
        arguments is refused: the cached launch would go on reading the first call's tensor."""
        kwargs = dict(zip(self.dynamic_names, values))
        for name, value in static().items():
            if isinstance(value, torch.Tensor) or isinstance(getattr(value, "base", None), torch.Tensor):
                raise TypeError(f"{getattr(self.fn, '__name__', self.fn)}: tensor argument {name} must be among "
                                f"the dynamic arguments {self.dynamic_names}")
            kwargs[name] = value
        return kwargs

    @staticmethod
    def _exact(values: tuple) -> tuple:
        # The dynamic arguments as they pick a launch exactly: ints by value, tensors by dtype and 16-byte
        # alignment (what Triton specializes a pointer on), floats and other values by type. A tensor passed
        # for several arguments (a stand-in for absent ones) is looked at once.
        exact = []
        tensors: dict = {}
        for value in values:
            kind = value.__class__
            if kind is int:
                exact.append(value)
            elif kind is float:
                exact.append(float)
            elif kind is torch.Tensor or isinstance(value, torch.Tensor):
                trait = tensors.get(id(value))
                if trait is None:
                    trait = tensors[id(value)] = (value.dtype, not value.data_ptr() & 15)
                exact.append(trait)
            else:
                exact.append(kind)
        return tuple(exact)

    def _traits(self, exact: tuple) -> tuple:
        # What Triton specializes the dynamic ints of ``exact`` on: width, value 1 and divisibility by 16,
        # as Triton's own binder works them out.
        return tuple(native_specialize_impl(BaseBackend, value, False, value_spec, align_spec) if type(value) is int
                     else value for value, (value_spec, align_spec) in zip(exact, self.specialize))

    def __call__(self, key, grid, dynamic, static, stream=None) -> None:
        """``dynamic``: the dynamic arguments by name, or their values in ``dynamic_names`` order (a tuple,
        which costs the host less); ``stream``: a ``torch.cuda.Stream`` to launch on instead of the current
        stream."""
        if type(dynamic) is tuple:
            values = dynamic
        else:
            if len(dynamic) != len(self.dynamic_names):
                raise TypeError(f"{getattr(self.fn, '__name__', self.fn)}: dynamic arguments "
                                f"{sorted(set(dynamic) ^ set(self.dynamic_names))} are not {self.dynamic_names}")
            values = self._values(dynamic)
            if len(self.dynamic_names) == 1:
                values = (values, )
        recorder = replay.active()
        if _interpreting():
            kwargs = self._kwargs(values, static)
            if recorder is not None:
                recorder.launches.append((_Interpreted(self.fn, grid, tuple(kwargs)), list(kwargs.values())))
            self.fn[grid](**kwargs)
            return
        exact = self._exact(values)
        entry = self._by_value.get((key, exact))
        if entry is None:
            full_key = (key, self._traits(exact))
            entry = self._cache.get(full_key)
            if entry is None:
                kwargs = self._kwargs(values, static)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    kernel = self.fn[grid](**kwargs)
                if len(self._cache) >= self.max_entries:
                    self._cache.clear()
                # Keep the static arguments only: holding this call's tensors would keep them alive.
                dynamic_slots = set(self.slots)
                args = [None if i in dynamic_slots else kwargs[name] for i, name in enumerate(self.names)]
                self._cache[full_key] = (kernel, args)
                if recorder is not None:
                    if hasattr(kernel, "result"):
                        replay.not_replayable("a kernel compiled asynchronously")
                    else:
                        recorder.launches.append((_Bound(kernel, _grid3(grid), stream, self.names),
                                                  [kwargs[name] for name in self.names]))
                return
            if hasattr(entry[0], "result"):  # compiled asynchronously: wait for it once
                entry = (entry[0].result(), entry[1])
                self._cache[full_key] = entry
            if len(self._by_value) >= self.max_entries:
                self._by_value.clear()
            self._by_value[(key, exact)] = entry
        kernel, args = entry
        args = list(args)
        for slot, value in zip(self.slots, values):
            args[slot] = value
        grid = _grid3(grid)
        if recorder is not None:
            recorder.launches.append((_Bound(kernel, grid, stream, self.names), args))
        _run(kernel, grid, _current_stream() if stream is None else stream.cuda_stream, args)


def _grid3(grid) -> tuple:
    return tuple(grid) + (1,) * (3 - len(grid))


def _run(kernel, grid: tuple, stream: int, args: list) -> None:
    """Launch compiled ``kernel`` on ``grid`` (3 dims) with every argument, as Triton's own launch path does."""
    # Launch hooks (a profiler's, say) get the metadata Triton's own path would give them; an
    # empty hook chain (Triton's default) needs none.
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    hooked = enter is not None and getattr(enter, "calls", True)
    metadata = kernel.launch_metadata(grid, stream, *args) if hooked else None
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata, enter, leave,
               *args)


class _Bound:
    """A compiled kernel on its grid: ``launch(args)`` runs it on the current stream, or on the side stream
    it was launched on (a replay's launch; see :func:`~flashtile.backends.triton.host.fork`). ``names``: the
    kernel's argument names, in the order ``args`` gives them."""

    __slots__ = ("kernel", "grid", "stream", "names")
    # A replay passes tensors as their addresses (ints), which Triton's launcher takes as they are.
    pointers = True

    def __init__(self, kernel, grid: tuple, stream=None, names: tuple = ()):
        self.kernel, self.grid, self.stream, self.names = kernel, grid, stream, names

    def __call__(self, args: list) -> None:
        _run(self.kernel, self.grid, _current_stream() if self.stream is None else self.stream.cuda_stream, args)


class _Interpreted:
    """A kernel under Triton's interpreter: ``launch(args)`` calls it with ``args`` by these names."""

    __slots__ = ("fn", "grid", "names")
    # The interpreter reads tensors, not addresses.
    pointers = False

    def __init__(self, fn, grid, names: tuple):
        self.fn, self.grid, self.names = fn, grid, names

    def __call__(self, args: list) -> None:
        self.fn[self.grid](**dict(zip(self.names, args)))
