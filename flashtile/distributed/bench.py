"""Context-parallel speed: ring (zigzag), Ulysses, the hybrid and torch's ``context_parallel`` side by side.

    python -m flashtile.distributed.bench --gpus 2 --out results/cp-2gpu.json
    torchrun --nproc-per-node 4 -m flashtile.distributed.bench --out results/cp-4gpu.json

Causal forward + backward, batch 1, head dim 128, bf16, MHA 32/32 and GQA 32/8, at each
``--tokens-per-gpu`` (N tokens in all = P x that). Every method runs on the same inputs:

- ``flashtile_1gpu``: :func:`flashtile.flash_attn_func` on the whole sequence on one GPU (rank 0): ``T1``.
- ``ring``: :func:`ring_attention`, zigzag; ``ulysses``: :func:`ulysses_attention`, zigzag;
  ``hybrid``: :func:`attention` on a (2, P/2) ``("ulysses", "ring")`` mesh (P >= 4 only).
- ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` around SDPA (its ring, its
  round-robin causal balance), the peer of ``../shared/peers/h200-2026-11-27-torch-cp.json``.

Efficiency = T1 / (P x T_P). Times: CUDA events, a fixed number of runs on every rank (collectives
must match), median per rank, max over ranks. On the first length every method's out and dq, dk,
dv are checked against the one-GPU flashtile result (gathered; the error relative to each tensor's largest
value); a method that is off is reported
``wrong`` and not timed. Peak memory per GPU (max over ranks) is reported with each time.
``--long 262144`` on 4 GPUs runs the ring alone on 1M tokens (GQA by ``--heads``' last pair) and
checks 16 rows spread over the sequence against a float32 reference.
``--dkv-transfer input`` sends the ring's dK/dV partial sums in bf16 instead of float32 (the ring's and the
hybrid's ``dkv_transfer``; every row records it).
``--nccl-priority high`` runs the ring's transfers (the ring's and the hybrid's) on NCCL streams of high
priority (:func:`set_nccl_priority`); each row names the priority it ran with.
Without ``RANK`` in the environment it spawns ``--gpus`` processes itself. ``--device cpu`` runs a
smoke test on gloo (tiny sizes; torch's context_parallel is CUDA-only there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ..interface import flash_attn_func
from . import attention, exit_rank, ring_attention, set_nccl_priority, shard, ulysses_attention, unshard
from .comm import NCCL_PRIORITIES
from .options import DKV_TRANSFERS

METHODS = ("ring", "ulysses", "hybrid", "torch_cp")
# flashtile's attention kernels (forward, backward); the preprocess, dQ/dK/dV sums and merges count as "other".
ATTENTION_KERNELS = ("attn_", "bwd_dkdv", "bwd_dq")


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashtile.distributed.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes to spawn without torchrun (default: all GPUs)")
    parser.add_argument("--tokens-per-gpu", default="8192,16384,32768")
    parser.add_argument("--heads", default="32/32,32/8", help="nheads/nheads_kv pairs")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each method (after 2 warm-up runs)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--long", type=int, default=0, metavar="TOKENS_PER_GPU",
                        help="instead of the grid: one ring run at this length (262144 on 4 GPUs = 1M tokens), its "
                             "time and memory, and sampled rows of out checked against a float32 reference")
    parser.add_argument("--dkv-transfer", default="float32", choices=DKV_TRANSFERS,
                        help="how the ring (and the hybrid's ring) sends its dK/dV partial sums: float32 or the "
                             "inputs' dtype")
    parser.add_argument("--nccl-priority", default="default", choices=NCCL_PRIORITIES,
                        help="the CUDA stream priority of the ring's transfers (ring and hybrid; set_nccl_priority)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="after timing, run each method once more under torch.profiler: a chrome trace per rank "
                             "in DIR and, per method, where rank 0's time went (attention kernels, NCCL, other "
                             "kernels, the GPU idle)")
    parser.add_argument("--out", default=None,
                        help="JSON result path (default: benchmarks/results/cp-<P>x<gpu>-<date>.json)")
    options = parser.parse_args(argv)
    options.argv = list(sys.argv[1:] if argv is None else argv)  # for the result file's command
    return options


def _timed(fn, runs: int, device) -> tuple:
    """``(median ms on this rank, peak memory GB)`` of ``fn`` after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return statistics.median(times), memory


def _union_us(spans) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _traced(fn, device, path: str) -> dict:
    """One run of ``fn`` under torch.profiler, its chrome trace written to ``path``: this rank's ms of the span from
    the first kernel to the last, split into the attention kernels (flashtile's :data:`ATTENTION_KERNELS`), other
    compute kernels (copies, adds, merges, casts), NCCL alone (no compute kernel beside it: exposed) and the GPU
    idle (launch gaps, host work, waits)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)
    kernels = [(event.name, event.time_range.start, event.time_range.end) for event in prof.events()
               if event.device_type == DeviceType.CUDA]
    return breakdown_ms(kernels)


def breakdown_ms(kernels) -> dict:
    """``{"span", "attention", "other", "nccl_exposed", "idle", "nccl"}`` in ms of ``(name, start_us, end_us)``
    kernels: the span from the first start to the last end; the time an attention kernel runs; the time other
    compute kernels run with no attention kernel; NCCL with no compute kernel beside it; no kernel at all (these
    four add up to the span); and every NCCL kernel's time, overlapped or not (bytes / it: the bandwidth had).
    ``{}`` without kernels."""
    kinds = {"attention": [], "other": [], "nccl": []}
    for name, start, end in kernels:
        name = name.lower()
        kind = "nccl" if "nccl" in name else "attention" if name.startswith(ATTENTION_KERNELS) else "other"
        kinds[kind].append((start, end))
    spans = [s for group in kinds.values() for s in group]
    if not spans:
        return {}
    attention = _union_us(kinds["attention"])
    compute = _union_us(kinds["attention"] + kinds["other"])
    busy = _union_us(spans)
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"span": wall / 1e3, "attention": attention / 1e3, "other": (compute - attention) / 1e3,
            "nccl_exposed": (busy - compute) / 1e3, "idle": (wall - busy) / 1e3, "nccl": _union_us(kinds["nccl"]) / 1e3}


def _max_over_ranks(*values) -> list:
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class _Method:
    """One context-parallel method on this rank's shards: ``step()`` runs forward + backward; ``results()`` gathers
    out and the gradients of the whole sequence (for the check)."""

    def __init__(self, name, q, k, v, dout, group, mesh, dkv_transfer="float32"):
        self.name, self.group, self.mesh, self.dkv_transfer = name, group, mesh, dkv_transfer
        where = mesh if name == "hybrid" else group
        self.where = where
        self.local = [shard(x, where).requires_grad_() for x in (q, k, v)]
        self.dout = shard(dout, where)
        self.out = None

    def run(self):
        q, k, v = self.local
        if self.name == "ring":
            return ring_attention(q, k, v, self.group, causal=True, dkv_transfer=self.dkv_transfer)
        if self.name == "ulysses":
            return ulysses_attention(q, k, v, self.group, causal=True)
        return attention(q, k, v, self.mesh, causal=True, dkv_transfer=self.dkv_transfer)

    def step(self):
        for x in self.local:
            x.grad = None
        self.out = self.run()
        self.out.backward(self.dout)

    def results(self):
        self.step()
        return [unshard(x, self.where) for x in (self.out, *(t.grad for t in self.local))]


class _TorchCP:
    """torch's context_parallel (SDPA layout ``(batch, nheads, seqlen, d)``, its own sharding)."""

    def __init__(self, q, k, v, dout, mesh1d):
        from torch.distributed.tensor.experimental import context_parallel

        self.mesh = mesh1d
        self.gqa = q.shape[2] != k.shape[2]
        self.tensors = [x.transpose(1, 2).contiguous() for x in (q, k, v, dout)]
        self.context = context_parallel(mesh1d, buffers=self.tensors, buffer_seq_dims=[2, 2, 2, 2])
        self.context.__enter__()  # shards the buffers in place
        # Leaves of their own: the context resizes the buffers back on exit, which a tensor that requires grad refuses.
        self.leaves = [x.detach().requires_grad_() for x in self.tensors[:3]]

    def step(self):
        q, k, v, dout = *self.leaves, self.tensors[3]
        for x in (q, k, v):
            x.grad = None
        kwargs = {"enable_gqa": True} if self.gqa else {}
        self.out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        self.out.backward(dout)

    def results(self):
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        self.step()
        q, k, v = self.leaves
        full = context_parallel_unshard(self.mesh, [self.out, q.grad, k.grad, v.grad], [2, 2, 2, 2])
        return [x.transpose(1, 2) for x in full]

    def close(self):
        self.context.__exit__(None, None, None)


def _check(ours, reference) -> float:
    """The largest error of out, dq, dk, dv relative to the largest magnitude of the same reference tensor."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
               for a, b in zip(ours, reference))


def run(options) -> list:
    device = torch.device(options.device, torch.cuda.current_device() if options.device == "cuda" else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from torch.distributed.device_mesh import init_device_mesh

    mesh1d = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    mesh2d = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("ulysses", "ring")) if world >= 4 else None
    methods = [m for m in options.methods.split(",") if m != "hybrid" or mesh2d is not None]
    rows = []
    for heads in options.heads.split(","):
        nheads, nheads_kv = map(int, heads.split("/"))
        for index, tokens in enumerate(int(t) for t in options.tokens_per_gpu.split(",")):
            n = world * tokens
            generator = torch.Generator(device=device).manual_seed(n + nheads_kv)
            q, k, v = (torch.randn(1, n, h, options.headdim, device=device, dtype=dtype, generator=generator)
                       for h in (nheads, nheads_kv, nheads_kv))
            dout = torch.randn(1, n, nheads, options.headdim, device=device, dtype=dtype, generator=generator)
            row = dict(world=world, tokens_per_gpu=tokens, N=n, nheads=nheads, nheads_kv=nheads_kv,
                       headdim=options.headdim, dtype=str(dtype).replace("torch.", ""), causal=True,
                       dkv_transfer=options.dkv_transfer, nccl_priority=options.nccl_priority)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def one_gpu():
                for x in leaves:
                    x.grad = None
                flash_attn_func(*leaves, causal=True).backward(dout)

            t1 = mem1 = 0.0
            if rank == 0:
                t1, mem1 = _timed(one_gpu, options.runs, device)
                if options.trace:
                    row["flashtile_1gpu_breakdown_ms"] = _traced(one_gpu, device, os.path.join(
                        options.trace, f"flashtile_1gpu-{nheads}x{nheads_kv}-{tokens}.json"))
            reference = None
            if index == 0:
                one_gpu()  # on every rank: each checks its method's gathered result
                reference = [flash_attn_func(*leaves, causal=True).detach(), *(x.grad for x in leaves)]
            row["flashtile_1gpu_ms"], row["flashtile_1gpu_mem_gb"] = _max_over_ranks(t1, mem1)
            del leaves
            for name in methods:
                method = None
                try:
                    method = _TorchCP(q, k, v, dout, mesh1d) if name == "torch_cp" else _Method(
                        name, q, k, v, dout, None, mesh2d, options.dkv_transfer)
                    if reference is not None:
                        err = _check(method.results(), reference)
                        row[f"{name}_rel_err"] = err
                        # bf16: the reference differs from us by its own rounding (a few 2^-8 of the largest value,
                        # 0.2-0.4% measured on 4 H200s); a wrong method is off by O(1).
                        if not err < (2e-2 if dtype == torch.bfloat16 else 1e-4):
                            row[f"{name}_status"] = "wrong"
                            continue
                    ms, mem = _max_over_ranks(*_timed(method.step, options.runs, device))
                    row[f"{name}_ms"], row[f"{name}_mem_gb"] = ms, mem
                    row[f"{name}_efficiency"] = row["flashtile_1gpu_ms"] / (world * ms) if rank == 0 else None
                    row[f"{name}_status"] = "ok"
                    if options.trace:
                        row[f"{name}_breakdown_ms"] = _traced(method.step, device, os.path.join(
                            options.trace, f"{name}-{nheads}x{nheads_kv}-{tokens}-rank{rank}.json"))
                except Exception as error:  # noqa: BLE001 -- a method that cannot run is reported, not fatal
                    row[f"{name}_status"] = f"error: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
                finally:
                    if isinstance(method, _TorchCP):
                        method.close()
                    del method
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                print(_line(row, methods), flush=True)
    return rows


def run_long(options) -> list:
    """One causal ring forward + backward on ``world * options.long`` tokens: time, peak memory, and the
    largest error of 16 sampled rows of out against a float32 reference (rank 0 computes it row by row)."""
    from ..testing import attention_ref
    from .sharding import segments

    device = torch.device(options.device, torch.cuda.current_device() if options.device == "cuda" else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    nheads, nheads_kv = map(int, options.heads.split(",")[-1].split("/"))
    n = world * options.long
    generator = torch.Generator(device=device).manual_seed(n)
    full = [torch.randn(1, n, h, options.headdim, device=device, dtype=dtype, generator=generator)
            for h in (nheads, nheads_kv, nheads_kv, nheads)]
    local = [shard(x).requires_grad_() for x in full[:3]]
    dout = shard(full[3])
    del full[3]
    if rank != 0:
        del full  # rank 0 keeps q, k, v for the reference
    out = None

    def step():
        nonlocal out
        for x in local:
            x.grad = None
        out = ring_attention(*local, causal=True, dkv_transfer=options.dkv_transfer)
        out.backward(dout)

    ms, mem = _max_over_ranks(*_timed(step, 1, device))
    # 16 rows spread over the sequence (the first and last included), gathered on every rank by a sum.
    rows = torch.linspace(0, n - 1, 16).long().tolist()
    sampled = torch.zeros(len(rows), nheads, options.headdim, dtype=torch.float32, device=device)
    at, local_of = 0, {}
    for start, length in segments(options.long, rank, world, "zigzag"):
        for i, position in enumerate(rows):
            if start <= position < start + length:
                local_of[i] = at + position - start
        at += length
    for i, index in local_of.items():
        sampled[i] = out[0, index].float()
    dist.all_reduce(sampled)
    row = dict(world=world, tokens_per_gpu=options.long, N=n, nheads=nheads, nheads_kv=nheads_kv,
               headdim=options.headdim, dkv_transfer=options.dkv_transfer,
               nccl_priority=options.nccl_priority, ring_ms=ms, ring_mem_gb=mem,
               sampled_rows=rows)
    if rank == 0:
        q, k, v = full
        group = nheads // nheads_kv

        def reference_row(p):
            # Row p of causal attention sees keys 0..p; one KV head at a time keeps the upcast copies small.
            return torch.cat([attention_ref(q[:, p:p + 1, g * group:(g + 1) * group], k[:, :p + 1, g:g + 1],
                                            v[:, :p + 1, g:g + 1])[0][0, 0] for g in range(nheads_kv)])

        errors = [(reference_row(p) - sampled[i]).abs().max().item() for i, p in enumerate(rows)]
        row["max_err"] = max(errors)
        print(f"P={world} {nheads}/{nheads_kv} N={n}: ring fwd+bwd {ms:.0f} ms, {mem:.1f} GB/GPU, "
              f"max |out - fp32 ref| over {len(rows)} rows {row['max_err']:.2e}", flush=True)
    return [row]


def _breakdown(parts) -> str:
    """`` [span 9.96 attention 7.10 ...]`` of a ``--trace`` breakdown, or nothing without one."""
    return " [" + " ".join(f"{k} {v:.2f}" for k, v in parts.items()) + "]" if parts else ""


def _line(row, methods) -> str:
    cells = [f"P={row['world']} {row['nheads']}/{row['nheads_kv']} {row['tokens_per_gpu']:>6}/gpu "
             f"T1={row['flashtile_1gpu_ms']:.1f}ms" + _breakdown(row.get("flashtile_1gpu_breakdown_ms"))
             + (f" dkv_transfer={row['dkv_transfer']}" if row["dkv_transfer"] != "float32" else "")
             + (f" nccl={row['nccl_priority']}" if row["nccl_priority"] != "default" else "")]
    for name in methods:
        if row.get(f"{name}_status") == "ok":
            cells.append(f"{name} {row[f'{name}_ms']:.1f}ms eff {row[f'{name}_efficiency']:.2f} "
                         f"{row[f'{name}_mem_gb']:.1f}GB" + _breakdown(row.get(f"{name}_breakdown_ms")))
        else:
            cells.append(f"{name} {row.get(f'{name}_status', '-')[:40]}")
    return " | ".join(cells)


def _main_rank(options):
    device = options.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    set_nccl_priority(options.nccl_priority)
    rows = run_long(options) if options.long else run(options)
    if dist.get_rank() == 0:
        from ..bench import common

        gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        # Versions, date and commit as every suite file has them (FLASHTILE_GIT_COMMIT first, then git), and the
        # command that made the file (BENCHMARKS.md names it).
        env = {**common.base_env(), "argv": options.argv,
               "command": " ".join(["python -m flashtile.distributed.bench", *options.argv])}
        payload = dict(what=__doc__.split("\n")[0], gpu=gpu, world=dist.get_world_size(), env=env, rows=rows)
        name = f"cp-{dist.get_world_size()}x{common.gpu_slug(gpu)}-{env['date']}.json"
        out = options.out or os.path.join("benchmarks", "results", name)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {out}")


def _spawned(rank, world, init_file, options):
    backend = "nccl" if options.device == "cuda" else "gloo"
    if options.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _main_rank(options)
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()
    exit_rank()


def main(argv=None) -> int:
    options = parse(argv)
    if "RANK" in os.environ:
        if options.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL picks a device
        dist.init_process_group("nccl" if options.device == "cuda" else "gloo")
        try:
            _main_rank(options)
        finally:
            dist.destroy_process_group()
        return 0
    import torch.multiprocessing as mp

    world = options.gpus or (torch.cuda.device_count() if options.device == "cuda" else 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, os.path.join(tmp, "init"), options), nprocs=world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
