"""The copy-engine transport's protocol (flashtile/distributed/copy_engine.py) on CPU: every rank of a ring simulated
in one process, its streams as queues that a scheduler runs (a wait runs once its flag holds), its symmetric memory as
CPU tensors that every simulated rank sees. The ring's sequence of messages (a forward's K/V, then a backward's K/V and
dK/dV sums in the other direction, twice) must arrive intact, in every order the scheduler may run the streams, and
never deadlock. On GPUs (skipped without them) the same sequence runs through real copies and flags, one process a GPU;
the ring attention through it: tests/test_distributed.py -k copy_engine."""
import contextlib
import datetime
import os
import random
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.distributed import copy_engine, exit_rank


class _Stream:
    """A simulated CUDA stream: operations run in order, each once its condition holds; ``priority``: the scheduler
    runs the stream of the highest priority that can run."""

    def __init__(self, name, priority):
        self.name, self.priority, self.ops, self.done = name, priority, [], 0

    def enqueue(self, op, ready=lambda: True):
        self.ops.append((ready, op))

    def wait_stream(self, other):
        mark = len(other.ops)
        self.enqueue(lambda: None, lambda: other.done >= mark)

    def wait_event(self, event):
        stream, mark = event.at
        self.enqueue(lambda: None, lambda: stream.done >= mark)


class _Sim:
    """The simulated ranks: which one the host is running, its streams, the symmetric allocations."""

    def __init__(self, world, seed):
        self.world, self.rank, self.current = world, 0, None
        self.rng = random.Random(seed)
        self.compute = [_Stream(f"compute{rank}", self.rng.random()) for rank in range(world)]
        self.streams = list(self.compute)
        self.made, self.counts = [], [0] * world

    def current_stream(self, device=None):
        return self.current or self.compute[self.rank]

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def new_stream(self, device=None):
        stream = _Stream(f"side{self.rank}", self.rng.random())
        self.streams.append(stream)
        return stream

    def symmetric(self, numel, dtype, device, group):
        """The rank's next symmetric allocation: every rank's i-th call gets the i-th set (garbage-filled, as memory
        fresh from the allocator)."""
        index = self.counts[self.rank]
        self.counts[self.rank] += 1
        if index == len(self.made):
            self.made.append([torch.full((numel,), 77 if dtype == torch.uint8 else -7, dtype=dtype)
                              for _ in range(self.world)])
        assert self.made[index][0].numel() == numel and self.made[index][0].dtype == dtype
        return self.made[index][self.rank], self.made[index]

    def word(self, address):
        """The flag tensor and index at ``address``."""
        for tensors in self.made:
            for t in tensors:
                if t.dtype == torch.int32 and t.data_ptr() <= address < t.data_ptr() + 4 * t.numel():
                    return t, (address - t.data_ptr()) // 4
        raise AssertionError(f"no flag at {address:#x}")

    def run(self, until_empty):
        """Run the streams, one operation at a time of the stream of the highest priority whose next operation may
        run (so the streams of low priority lag as far as their waits let them), until none may; with ``until_empty``
        every operation must have run (else: a deadlock)."""
        while True:
            runnable = [s for s in self.streams if s.done < len(s.ops) and s.ops[s.done][0]()]
            if not runnable:
                break
            stream = max(runnable, key=lambda s: s.priority)
            stream.ops[stream.done][1]()
            stream.done += 1
        if until_empty:
            stuck = [f"{s.name} at {s.done}/{len(s.ops)}" for s in self.streams if s.done < len(s.ops)]
            assert not stuck, f"deadlock: {stuck}"


class _Ops:
    def __init__(self, sim):
        self.sim = sim

    def wait_at_least(self, stream, address, value):
        flags, index = self.sim.word(address)
        # cuStreamWaitValue32 with GEQ: (int32)(*address - value) >= 0.
        stream.enqueue(lambda: None, lambda: (int(flags[index]) - value) % 2**32 < 2**31)

    def write(self, stream, address, value):
        flags, index = self.sim.word(address)
        stream.enqueue(lambda: flags.__setitem__(index, value))


class _Dist:
    def __init__(self, sim):
        self.sim = sim

    def get_world_size(self, group):
        return self.sim.world

    def get_rank(self, group):
        return self.sim.rank

    @staticmethod
    def get_backend(group):
        return "gloo"

    @staticmethod
    def barrier(group=None, device_ids=None):
        return None


def _schedule(world, calls=2):
    """The messages of ``calls`` ring calls, forward then backward, as the engine starts them: ``[(reverse, kind)]``
    (kind "kv": K and V in bf16; "dkv": the float32 dK/dV sums, twice the bytes)."""
    forward = [(False, "kv")] * (world - 1)
    backward = []
    for step in reversed(range(world)):
        if step > 1:
            backward.append((True, "kv"))
        if step > 0:
            backward.append((True, "dkv"))
    return (forward + backward) * calls


def _message(kind, rank, index):
    """What ``rank`` sends as its ``index``-th message: values no other message has."""
    base = rank * 10000 + index * 10
    if kind == "kv":
        return tuple((torch.arange(2 * 5 * 3 * 4) + base + part).reshape(2, 5, 3, 4).to(torch.bfloat16)
                     for part in range(2))
    return tuple((torch.arange(2 * 5 * 3 * 4) + base + part + 0.5).reshape(2, 5, 3, 4).float() for part in range(2))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_messages_arrive_intact(world, monkeypatch):
    """Every message a rank receives is the one its source sent at the same place in the sequence, with the slots
    reused and grown (the dK/dV sums are larger) and the flag counters going on across calls, with the streams given
    random priorities (a stream of low priority lags its peers as far as the flags let it): with every rank's whole
    sequence queued before any stream runs (hosts ahead of their GPUs: a slot would be restaged before its message
    was pulled if the protocol let it), and with the streams run after each call."""
    for seed in range(12):
        for ahead in (True, False):
            _simulate(world, seed, ahead, monkeypatch)


def _simulate(world, seed, ahead, monkeypatch):
    sim = _Sim(world, seed)
    monkeypatch.setattr(torch.cuda, "Stream", sim.new_stream)
    monkeypatch.setattr(torch.cuda, "stream", sim.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", sim.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("Event", (), {"record": _record})())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(copy_engine, "dist", _Dist(sim))
    monkeypatch.setattr(copy_engine, "_symmetric", sim.symmetric)
    monkeypatch.setattr(copy_engine, "_StreamMemOps", lambda: _Ops(sim))
    monkeypatch.setattr(copy_engine, "_copy", lambda dst, src: sim.current_stream().enqueue(lambda: dst.copy_(src)))
    channels = []
    for rank in range(world):
        sim.rank = rank
        channels.append(copy_engine.Channel(object(), torch.device("cpu")))
    received = [[] for _ in range(world)]  # per rank: (reverse, index in its direction, kind, tensors)
    counts = [[0, 0] for _ in range(world)]
    for reverse, kind in _schedule(world):
        for rank in range(world):
            sim.rank = rank
            index = counts[rank][reverse]
            counts[rank][reverse] += 1
            got, works, _ = channels[rank].start(_message(kind, rank, index), reverse)
            for work in works:
                work.wait()  # the compute stream waits for the copies, as Ring.finish does
            received[rank].append((reverse, index, kind, got))
            if not ahead:
                sim.run(until_empty=False)
    sim.run(until_empty=True)
    for rank in range(world):
        for reverse, index, kind, got in received[rank]:
            source = (rank + (1 if reverse else -1)) % world
            for ours, theirs in zip(got, _message(kind, source, index)):
                assert torch.equal(ours, theirs), dict(seed=seed, ahead=ahead, rank=rank, reverse=reverse, index=index)
    # Each direction's slots fit its largest message, each tensor starting 256-byte aligned: the forward's K/V (bf16,
    # 240 bytes each), the backward's float32 sums (480 bytes each, grown to from its K/V).
    assert channels[0].slot_bytes == [2 * 256, 2 * 512]


def _record(event, stream=None):
    event.at = (stream, len(stream.ops))


def _gpu_worker(rank, world, init_file, out_dir):
    """The message sequence through a real channel on GPU ``rank``; the messages that arrived wrong, saved."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    channel = copy_engine.channel(dist.group.WORLD, torch.device("cuda", rank))
    if rank == 1:
        torch.cuda._sleep(int(5e7))  # ~25 ms on rank 1's stream: the other ranks run ahead as far as the flags let them
    received, counts = [], [0, 0]
    for reverse, kind in _schedule(world, calls=3):
        index = counts[reverse]
        counts[reverse] += 1
        got, works, _ = channel.start(tuple(t.cuda() for t in _message(kind, rank, index)), reverse)
        for work in works:
            work.wait()
        received.append((reverse, index, kind, got))
    torch.cuda.synchronize()
    wrong = [(reverse, index) for reverse, index, kind, got in received
             if not all(torch.equal(ours.cpu(), theirs) for ours, theirs in
                        zip(got, _message(kind, (rank + (1 if reverse else -1)) % world, index)))]
    torch.save(wrong, os.path.join(out_dir, f"wrong{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


def _gpus(world):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < world, reason=f"needs {world} CUDA devices, found {have}")


@pytest.mark.parametrize("world", [pytest.param(2, marks=_gpus(2)), pytest.param(4, marks=_gpus(4))])
def test_messages_arrive_intact_on_gpus(world):
    """The sequence of test_messages_arrive_intact, three calls, through symmetric memory, copy engines and stream
    memory operations: every message intact on every rank, with one rank's GPU started late."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_gpu_worker, args=(world, os.path.join(out_dir, "init"), out_dir), nprocs=world)
        wrong = [torch.load(os.path.join(out_dir, f"wrong{rank}.pt")) for rank in range(world)]
    assert wrong == [[]] * world, wrong
