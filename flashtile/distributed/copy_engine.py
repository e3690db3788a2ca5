"""The ring's transfers on the GPUs' copy engines (opt-in: ``set_transport("copy_engine")``).

NCCL's send/receive is a kernel: beside the attention kernels, which hold every SM, it runs only as their CTAs
retire (docs/distributed.md). A copy between a local buffer and a peer's buffer mapped into this process
(``cudaMemcpyAsync``, what ``Tensor.copy_`` issues for two contiguous tensors of one dtype) runs on a copy engine and
takes no SM. So every rank keeps two message slots for each direction of the ring in PyTorch symmetric memory
(``torch.distributed._symmetric_memory``, its CUDA backend: every rank maps every other rank's slots), and a message
goes around in four steps on a side stream:

    sender (message n)                         receiver (its message n, from the sender)
    wait pulled >= n - 1 (slot n % 2 is free)
    copy the tensors into its slot n % 2
    write ready = n + 1 into the receiver's flags -> wait ready >= n + 1
                                                  copy the sender's slot n % 2 into fresh tensors
    wait pulled >= n - 1  <-  write pulled = n + 1 into the sender's flags

Every rank is both, in the same order (every rank makes the same ring calls), so each direction needs one counter.
The flags are 32-bit words in symmetric memory, written and waited on with the driver's stream memory operations
(``cuStreamWriteValue32``, ``cuStreamWaitValue32``): the GPU's front end does both in stream order, with no kernel
and no host wait. The write has a memory fence before it, so the data copied before it lands first.

The received tensors are fresh (as NCCL's), so nothing the ring keeps aliases a slot; the cost against NCCL is one
local copy a message (into the slot, at memory speed), and memory for two slots of the largest message each way.
Needs CUDA tensors, every rank's GPUs peers of each other (one NVLink domain), and a PyTorch with symmetric memory;
NVLink multicast is not used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set where the process has not set it).
"""
from __future__ import annotations

import ctypes
import os
import warnings

import torch
import torch.distributed as dist

# Where a tensor starts in a message slot: copies of aligned addresses run at the copy engines' full speed.
_ALIGN = 256
# The flag words of a rank: ready[direction] (messages its sender has staged), pulled[direction] (its messages its
# receiver has copied out). Direction 0: to the next rank; 1: to the previous one.
_READY, _PULLED, _FLAGS = 0, 2, 4
_CU_STREAM_WAIT_VALUE_GEQ = 0x0  # wait until (int32)(*address - value) >= 0: counters that may wrap
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # a memory fence before the write


class _StreamMemOps:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` from the CUDA driver (through ctypes: PyTorch exposes the
    write alone)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise RuntimeError(f"the copy-engine ring transport needs the CUDA driver library libcuda.so.1: {error}") \
                from error
        for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
            function = getattr(self.lib, name)
            function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            function.restype = ctypes.c_int
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"{what} failed: CUresult {result} ({(text.value or b'?').decode()})")

    def wait_at_least(self, stream, address: int, value: int) -> None:
        """``stream`` waits until the word at ``address`` (this GPU's memory) reaches ``value``."""
        self._check(self.lib.cuStreamWaitValue32_v2(stream.cuda_stream, address, value & 0xFFFFFFFF,
                                                    _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def write(self, stream, address: int, value: int) -> None:
        """``stream`` writes ``value`` at ``address`` (any GPU's memory mapped here) after its earlier work."""
        self._check(self.lib.cuStreamWriteValue32_v2(stream.cuda_stream, address, value & 0xFFFFFFFF,
                                                     _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


def _symmetric(numel: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """``(local, [every rank's view])``: a symmetric-memory tensor of ``group`` (a collective of its ranks)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as error:
        raise RuntimeError(f"the copy-engine ring transport needs torch.distributed._symmetric_memory (torch "
                           f"{torch.__version__} has none): {error}") from error
    # The slots need no NVLink multicast object (symmetric memory makes one per buffer where the GPUs can): asked off
    # unless the process already says otherwise.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():  # deprecated where rendezvous finds the group itself; needed before
            warnings.simplefilter("ignore", FutureWarning)
            enable(name)
    local = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, name)
    return local, [handle.get_buffer(rank, (numel,), dtype) for rank in range(dist.get_world_size(group))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat bytes."""
    return t.reshape(-1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst <- src``, flat bytes mapped on this GPU (its own or a peer's memory): one ``cudaMemcpyAsync`` on the
    current stream, which a copy engine runs."""
    dst.copy_(src)


class _Copied:
    """What :meth:`Ring.finish` waits for (a ``Work``'s ``wait``): the current stream waits for the side stream's
    event recorded after the message's copies."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class Channel:
    """The copy-engine transfers of one process group on one GPU: the slots, the flags, the message counters and the
    side stream (made at the group's first transfer: a collective of its ranks, which reach it together)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.ops = _StreamMemOps()
        self.stream = torch.cuda.Stream(device)
        self.flags, self.peer_flags = _symmetric(_FLAGS, torch.int32, device, group)
        self.flags.zero_()
        self._quiesce()  # every rank's flags zero before any peer writes one
        # Each direction's two slots, sized by its largest message (the forward's K/V, the backward's dK/dV sums).
        self.slot_bytes = [0, 0]
        self.slots, self.peer_slots = [None, None], [None, None]
        self.sent = [0, 0]  # messages sent (and received) in each direction

    def _quiesce(self) -> None:
        """Every rank's GPU idle (its own copies out of the peers' slots done), then a barrier of the group: no rank
        reads or writes a peer's memory across it."""
        torch.cuda.synchronize(self.device)
        nccl = "nccl" in str(dist.get_backend(self.group))
        dist.barrier(group=self.group, device_ids=[self.device.index] if nccl else None)
        torch.cuda.synchronize(self.device)

    def _reserve(self, direction: int, nbytes: int) -> None:
        """Slots of at least ``nbytes`` in ``direction`` (every rank asks for the same sizes at the same message)."""
        if nbytes <= self.slot_bytes[direction]:
            return
        if self.slots[direction] is not None:
            self._quiesce()  # no peer still copies out of the slots about to be freed
        self.slots[direction] = self.peer_slots[direction] = None
        self.slots[direction], self.peer_slots[direction] = _symmetric(2 * nbytes, torch.uint8, self.device,
                                                                       self.group)
        self.slot_bytes[direction] = nbytes

    def _slot(self, rank: int, direction: int, index: int) -> torch.Tensor:
        size = self.slot_bytes[direction]
        return self.peer_slots[direction][rank].narrow(0, index % 2 * size, size)

    def _flag(self, rank: int, word: int) -> int:
        return self.peer_flags[rank].data_ptr() + 4 * word

    def start(self, tensors: tuple, reverse: bool) -> tuple:
        """Send ``tensors`` (contiguous, on this GPU) to the next rank (``reverse``: the previous one) and receive as
        many of the same shapes from the other side. Returns ``(received, [work], tensors)``, as NCCL's path does:
        the received tensors are ready once the current stream has waited for the work."""
        direction = int(reverse)
        to, source = ((self.rank - 1) % self.size, (self.rank + 1) % self.size) if reverse else \
            ((self.rank + 1) % self.size, (self.rank - 1) % self.size)
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self._reserve(direction, end)
        received = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)
        n = self.sent[direction]
        stream, ops = self.stream, self.ops
        stream.wait_stream(torch.cuda.current_stream())  # the tensors are written
        with torch.cuda.stream(stream):
            if n >= 2:
                ops.wait_at_least(stream, self._flag(self.rank, _PULLED + direction), n - 1)
            mine = self._slot(self.rank, direction, n)
            for t, offset in zip(tensors, offsets):
                data = _bytes(t.contiguous())
                _copy(mine.narrow(0, offset, data.numel()), data)
            ops.write(stream, self._flag(to, _READY + direction), n + 1)
            ops.wait_at_least(stream, self._flag(self.rank, _READY + direction), n + 1)
            theirs = self._slot(source, direction, n)
            for r, offset in zip(received, offsets):
                data = _bytes(r)
                _copy(data, theirs.narrow(0, offset, data.numel()))
            ops.write(stream, self._flag(source, _PULLED + direction), n + 1)
            copied = torch.cuda.Event()
            copied.record(stream)
        self.sent[direction] = n + 1
        return received, [_Copied(copied)], tensors


# The channels, by (group, device index): each made at its group's first copy-engine transfer.
_CHANNELS: dict = {}


def channel(group, device: torch.device) -> Channel:
    """The :class:`Channel` of ``group`` on ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (group, index)
    found = _CHANNELS.get(key)
    if found is None:
        found = _CHANNELS[key] = Channel(group, torch.device("cuda", index))
    return found
