"""Replays: a repeated call runs as its kernel launches alone.

An eager decode step is bound by the host: each layer's attention is a few kernels of a few
microseconds, behind a Python path of validation, dispatch, planning and launch bookkeeping that
costs several times more. A step repeats the one before it (the same shapes, strides, dtypes and
options; only the tensors are new), so all of that work gives the same answer every time.

The first such call runs normally under a :class:`Recorder`, which notes each buffer the backend
allocates (:func:`flashtile.alloc.empty`) and each kernel it launches
(:class:`~flashtile.backends.triton.fastlaunch.CachedLaunch`), with every argument. :func:`build`
then finds where each tensor argument came from: one of the call's inputs, a buffer, or a view of
either (found by its storage). The :class:`Replay` keeps the launches' other arguments as they were
and, called with the next call's inputs, allocates the buffers and launches the same compiled kernels
with the new tensors' addresses: three launches and two allocations for a decode step.

What this relies on:
- The caller's key (:mod:`flashtile.interface`) and the replay's own check of the inputs' shapes,
  strides and 16-byte alignment pin everything the launches' non-tensor arguments were computed from
  (the key holds dtypes, devices and options).
- The recorded call does nothing besides allocating and launching. A call with dropout draws new random
  counters each call: its replay is given them, and its launches take them where the recorded call's were
  (by argument name, :data:`COUNTER_NAMES`). The Triton backend's routes only allocate and launch, and
  whatever else could happen marks the recording
  unreplayable: a fallback (it must be counted every call), other work the backend names
  (:func:`not_replayable`: a torch reduction, a copy back), a tensor argument (or a TMA descriptor's
  tensor) that is neither an input, a buffer nor a view of one (a copy made on the way), inputs
  that are one object passed twice or views whose storage two inputs share (a replay could not tell which
  input to use).

A training step repeats too: the forward of a call that wants a gradient replays like any other, and
its backward is recorded and replayed on ``(dout, *saved tensors)`` (:mod:`flashtile.autograd`).
Packed sequences are given their offsets (and ``seqused_k``) as inputs besides the tensors, whose values
the kernels read on the device; the plan they replay was made for the same longest lengths, which size
the grids (:func:`flashtile.autograd.with_offsets`). A TMA descriptor (the Gluon Hopper forward's) is
made again on its tensor's new address with the recorded shape, strides and tile; the launcher encodes it
on every launch, as it does for a descriptor made afresh.
"""
from __future__ import annotations

import logging
import operator

import torch

from . import alloc
# The recording state lives in its own module (alloc notes buffers there); its names are used as replay.X.
from .recording import Recorder, active, is_persistent, not_replayable, note_buffer, recording  # noqa: F401

logger = logging.getLogger("flashtile")


class Replay:
    """The launches of a recorded call, run again on new inputs (see the module docstring)."""

    __slots__ = ("inputs", "layouts", "alignments", "buffers", "views", "descriptors", "counters", "pointers",
                 "launches", "outputs", "device", "uses")

    def __init__(self, inputs: tuple, layouts: tuple, alignments: tuple, buffers: tuple, views: tuple,
                 descriptors: tuple, counters: int, pointers: bool, launches: tuple, outputs, device: int | None):
        # The tensors the launches take, in this order: the inputs given (their indices), the buffers
        # allocated ((shape, strides, dtype, device)), then views of those ((index, shape, stride, offset in elements
        # past the storage offset of the one viewed, the same in bytes past its start, dtype)).
        self.inputs, self.buffers, self.views = inputs, buffers, views
        # TMA descriptors of those tensors: (index of the tensor, the recorded descriptor's layout).
        self.descriptors = descriptors
        # How many dropout counters (seed, offset) each replay is given: 0 for a call without dropout.
        self.counters = counters
        # Each given input's (shape, strides) and start modulo 16 when recorded.
        self.layouts, self.alignments = layouts, alignments
        # Compiled launches take each tensor as its address (an int, which the launcher checks no further):
        # a view is an address past another's, without a tensor made for it.
        self.pointers = pointers
        # (launch, the arguments that are no tensor, a getter of the argument list from tensors + those).
        self.launches = launches
        # A getter of the outputs from the inputs and buffers.
        self.outputs = outputs
        # The CUDA device the launches ran on (they run on the current one), None on CPU.
        self.device = device
        # The calls it served.
        self.uses = 0

    def __call__(self, inputs: tuple, counters: tuple = ()):
        """The call's outputs, or None when an input's layout or alignment differs from the recorded one,
        or another CUDA device is current (the caller then runs the call normally). ``counters``: this call's
        dropout seed and offset, which the launches take where the recorded call's were."""
        if self.device is not None and torch._C._cuda_getDevice() != self.device:
            return None
        if len(counters) != self.counters:
            return None
        given = [inputs[i] for i in self.inputs]
        starts = [t.data_ptr() for t in given]
        if any(start & 15 != alignment for start, alignment in zip(starts, self.alignments)):
            return None
        if any((t.shape, t.stride()) != layout for t, layout in zip(given, self.layouts)):
            return None
        # Not through alloc.empty: a replay is never recorded, and poison is asked once.
        made = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in self.buffers]
        if alloc.poisoned():
            for t in made:
                t.fill_(float("nan"))
        tensors = given + made
        if self.pointers:
            arguments = starts + [t.data_ptr() for t in tensors[len(given):]]
            arguments += [arguments[index] + delta for index, _, _, _, delta, _ in self.views]
        else:
            arguments = list(tensors)
            for index, shape, stride, offset, _, dtype in self.views:
                base = arguments[index]
                base = base if base.dtype == dtype else base.view(dtype)
                arguments.append(base.as_strided(shape, stride, base.storage_offset() + offset))
        arguments += [_Descriptor(arguments[index], layout) for index, layout in self.descriptors]
        arguments += counters
        for launch, constants, gather in self.launches:
            launch(gather(arguments + constants))
        self.uses += 1
        return self.outputs(tensors)


class _Address:
    """A tensor's address where a launcher asks for ``base.data_ptr()``."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


class _Descriptor:
    """A recorded TMA descriptor over another tensor of its layout: what a compiled launch reads of one (its
    base's address, shape, strides and padding; the tile and swizzle are in the compiled kernel)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding")

    def __init__(self, base, layout: tuple):
        self.base = _Address(base) if base.__class__ is int else base
        self.shape, self.strides, self.block_shape, self.layout, self.padding = layout

    @staticmethod
    def layout_of(descriptor) -> tuple:
        """What a replay keeps of a recorded descriptor (not its tensor, which it must not keep alive)."""
        return (list(descriptor.shape), list(descriptor.strides), list(descriptor.block_shape), descriptor.layout,
                descriptor.padding)


# Launch arguments of these types are constants; anything else is checked for a tensor or a descriptor.
_PLAIN = frozenset((int, float, bool, str, type(None)))
_TENSOR, _DESCRIPTOR, _COUNTER, _CONSTANT = range(4)
# Launch arguments by these names are the dropout counters, given afresh to each replay of a call with dropout.
COUNTER_NAMES = ("seed", "offset")


def build(recorder: Recorder, inputs: tuple, outputs: tuple, counters: tuple = ()) -> Replay | str:
    """A :class:`Replay` of the call ``recorder`` saw, or why it cannot be replayed. ``inputs``: the call's
    tensors (None for absent ones), in the order the replay will be given them; ``outputs``: the tensors
    it returns; ``counters``: the call's dropout (seed, offset), empty without dropout, which each launch
    must take by the names COUNTER_NAMES (the launch says its argument names). The replay compares each
    input's shape, strides and 16-byte alignment (Triton specializes a pointer on it) with the recorded ones."""
    if recorder.unreplayable:
        return recorder.unreplayable
    if not recorder.launches:
        return "nothing was launched"
    given = [i for i, t in enumerate(inputs) if t is not None]
    tensors = [inputs[i] for i in given] + list(recorder.buffers)
    by_id: dict = {}
    by_storage: dict = {}
    for index, t in enumerate(tensors):
        if id(t) in by_id:
            return f"input {given[index]} is the same tensor as an earlier input"
        by_id[id(t)] = index
        storage = t.untyped_storage().data_ptr()
        # A storage that two inputs share cannot say which input a view of it was made from.
        by_storage[storage] = None if storage in by_storage else index
    for t in recorder.buffers:
        # A buffer is allocated again with its strides (empty_like keeps a transposed input's): it must
        # fill its storage exactly, as one empty_strided gives.
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
            return f"a buffer of shape {tuple(t.shape)} with strides {t.stride()} does not fill its storage"
    views: list = []

    def index_of(t):
        index = by_id.get(id(t))
        if index is not None:
            return index
        owner = by_storage.get(t.untyped_storage().data_ptr())
        # A view may read its base's bytes as another dtype of the same width (a bool mask as uint8).
        if owner is None or tensors[owner].element_size() != t.element_size():
            return None
        views.append((owner, tuple(t.shape), t.stride(), t.storage_offset() - tensors[owner].storage_offset(),
                      t.data_ptr() - tensors[owner].data_ptr(), t.dtype))
        tensors.append(t)
        by_id[id(t)] = len(tensors) - 1
        return len(tensors) - 1

    recorded = []
    descriptors: list = []
    plain = _PLAIN
    taken = 0
    for launch, args in recorder.launches:
        slots, constants = [], []
        # Where this launch takes the dropout counters, by argument name.
        names = getattr(launch, "names", ()) if counters else ()
        counter_at = {names.index(name): i for i, name in enumerate(COUNTER_NAMES) if name in names}
        for position, value in enumerate(args):
            kind = value.__class__
            if position in counter_at:
                if value != counters[counter_at[position]]:
                    return f"a launch takes {value} for the dropout counter {COUNTER_NAMES[counter_at[position]]}"
                slots.append((_COUNTER, counter_at[position]))
                taken += 1
            elif kind in plain:
                # Most arguments are numbers (a launch takes ~70): kept as they are.
                slots.append((_CONSTANT, len(constants)))
                constants.append(value)
            elif (kind is torch.Tensor or isinstance(value, torch.Tensor)) and is_persistent(value):
                # A tensor kept for the process (a device error record): the same one on every call.
                slots.append((_CONSTANT, len(constants)))
                constants.append(value)
            elif kind is torch.Tensor or isinstance(value, torch.Tensor):
                index = index_of(value)
                if index is None:
                    return (f"a launch argument of shape {tuple(value.shape)} is neither an input, a buffer nor a "
                            "view of one")
                slots.append((_TENSOR, index))
            elif isinstance(getattr(value, "base", None), torch.Tensor):
                index = index_of(value.base)
                if index is None:
                    return (f"a tensor descriptor's tensor of shape {tuple(value.base.shape)} is neither an input, "
                            "a buffer nor a view of one")
                slots.append((_DESCRIPTOR, len(descriptors)))
                descriptors.append((index, _Descriptor.layout_of(value)))
            else:
                slots.append((_CONSTANT, len(constants)))
                constants.append(value)
        recorded.append((launch, slots, constants))
    if counters and not taken:
        return "no launch takes the dropout counters by name"
    output_indices = []
    for t in outputs:
        index = by_id.get(id(t))
        if index is None or index >= len(given) + len(recorder.buffers):
            return "an output is neither an input nor a buffer"
        output_indices.append(index)
    # Every tensor is known now: a launch gathers its arguments from the tensors, then the descriptors, the
    # dropout counters and its constants.
    starts = (0, len(tensors), len(tensors) + len(descriptors), len(tensors) + len(descriptors) + len(counters))
    launches = tuple((launch, constants, _getter([starts[kind] + index for kind, index in slots]))
                     for launch, slots, constants in recorded)
    layouts = tuple((inputs[i].shape, inputs[i].stride()) for i in given)
    alignments = tuple(inputs[i].data_ptr() & 15 for i in given)
    buffers = tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in recorder.buffers)
    device = inputs[given[0]].device
    pointers = all(getattr(launch, "pointers", False) for launch, _ in recorder.launches)
    return Replay(tuple(given), layouts, alignments, buffers, tuple(views), tuple(descriptors), len(counters), pointers,
                  launches, _getter(output_indices), device.index if device.type == "cuda" else None)


def _getter(indices: list):
    """``f(items)``: the tuple of ``items[i]`` for ``i`` in ``indices`` (a tuple of one for one index, an empty
    tuple for none)."""
    if not indices:
        return lambda items: ()
    get = operator.itemgetter(*indices)
    return get if len(indices) > 1 else (lambda items: (get(items),))


def replayed(replays: tuple | None, inputs: tuple, counters: tuple = (), ranged: bool = False):
    """The outputs of the first of ``replays`` that fits ``inputs`` (and ``counters``, a call's dropout seed and
    offset), or None. Never while a profiler runs, so that the call's profiler ranges are recorded, unless the
    caller opens the call's range around the replay itself (``ranged``)."""
    if not replays or (not ranged and torch.autograd._profiler_enabled()):
        return None
    for again in replays:
        outputs = again(inputs, counters)
        if outputs is not None:
            return outputs
    return None


# Replays kept for one key: calls of one kind whose layouts take turns (two caches of other capacities).
KEEP = 4


class Kept:
    """The replays kept for one kind of call (a remembered plan's, :mod:`flashtile.interface`): its forward's
    and, for calls that want a gradient, its backward's (the call's autograd context takes this along; a
    KV-cache call has only a forward). Each is a tuple as :func:`record` returns it, empty to record the next
    call, or None not to record."""

    __slots__ = ("forward", "backward")

    def __init__(self, forward: tuple | None = ()):
        self.forward, self.backward = forward, ()


def record(run, inputs: tuple, replays: tuple | None, counters: tuple = ()) -> tuple:
    """``run()``'s result (a tuple whose first items are the call's output tensors), and the replays to keep
    for its key: ``replays`` with this call's in front; None when ``replays`` is None (not recorded) or the
    call cannot be replayed, which its key's later calls then need not try. ``counters``: the dropout seed
    and offset ``run`` launches with (:func:`build`)."""
    if replays is None:
        return run(), None
    recorder = Recorder()
    with recording(recorder):
        result = run()
    again = build(recorder, inputs, tuple(t for t in result if isinstance(t, torch.Tensor)), counters)
    if not isinstance(again, Replay):
        logger.debug("flashtile: not replayable: %s", again)
        return result, None
    return result, (again, *replays[:KEEP - 1])
