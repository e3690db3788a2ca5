"""Measuring one provider on one dense shape: forward, backward and forward+backward times, TFLOP/s,
modeled bandwidth, peak extra memory, the error against the reference, and the kernels that ran.

Timing goes through a ``timer(fn, grad_to_none=None) -> [ms, ...]`` (:func:`common.gpu_timer`:
CUDA events around each run after warm-up, L2 flushed before each; :func:`common.cpu_timer` in
the CPU smoke runs), reported as the median with the 10th/90th percentiles. Forward times the
forward call alone. Backward times ``out.backward(dout, retain_graph=True)`` alone on one retained
forward graph, gradients reset outside the timed region; only if a provider refuses that,
``median(fwd + backward) - median(fwd)`` is used, and the row says so in ``bwd_method``.
Forward+backward times ``fwd().backward(dout)``. Every failure (unsupported shape, OOM, compile
error) lands in the row as text (``fwd_err``, ``bwd_err``, ...) instead of stopping the sweep.
"""
from __future__ import annotations

import gc
import subprocess
import time

import torch

from . import common, providers, validate

DENSE_STAGES = ("fwd", "bwd", "fwd_bwd")


def _clear_grads(leaves):
    for t in leaves:
        t.grad = None


def _free_cuda(collect: bool = False):
    """Return cached blocks to the device (and with ``collect``, first collect garbage cycles: a full
    ``gc.collect`` takes a quarter second once transformers and inductor are loaded, so it runs once per
    shape, not per cell)."""
    if collect:
        gc.collect()
    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken CUDA context fails every later cell, which marks it
        pass


def _is_cuda(p: providers.Provider) -> bool:
    return bool(p.leaves) and p.leaves[0].is_cuda


def peak_extra_bytes(p: providers.Provider, backward: bool) -> int:
    """Peak bytes allocated by one forward (+ backward) beyond what was already allocated; the
    forward alone runs under ``no_grad`` (inference)."""
    _clear_grads(p.leaves)
    _free_cuda()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if backward:
        p.fwd().backward(p.dout)
    else:
        with torch.no_grad():
            p.fwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    _clear_grads(p.leaves)
    return peak


def time_backward(p: providers.Provider, out, timer, fwd_ms: float) -> dict:
    """Backward time of ``out``'s graph: ``backward(retain_graph=True)`` alone, else (fwd+bwd) - fwd."""
    try:
        out.backward(p.dout, retain_graph=True)  # the first backward compiles too
        _clear_grads(p.leaves)
        times = timer(lambda: out.backward(p.dout, retain_graph=True), grad_to_none=list(p.leaves))
        return {**common.timing_fields("bwd", times), "bwd_method": "backward(retain_graph=True)"}
    except Exception as exc:  # noqa: BLE001
        retained_err = common.describe_error(exc)
    _clear_grads(p.leaves)
    try:
        both = common.timing_fields("both", timer(lambda: p.fwd().backward(p.dout), grad_to_none=list(p.leaves)))
        return {"bwd_ms": both["both_ms"] - fwd_ms, "bwd_reps": both["both_reps"],
                "bwd_method": f"fwd+bwd minus fwd (retain_graph failed: {retained_err})"}
    except Exception as exc:  # noqa: BLE001
        return {"bwd_err": common.describe_error(exc)}


def record_kernels(p: providers.Provider, backward: bool) -> dict:
    """``{"kernels": {"fwd": [...], "bwd": [...]}, "ranges": {...}}``: one forward (and one backward)
    under the profiler, each on its own."""
    cuda = _is_cuda(p)
    kernels, ranges = {}, {}
    proof = common.kernel_proof(p.fwd, cuda)
    kernels["fwd"], ranges["fwd"] = proof["kernels"], proof["ranges"]
    if backward:
        out = p.fwd()
        common.synchronize(out.device)
        proof = common.kernel_proof(lambda: out.backward(p.dout), cuda)
        kernels["bwd"], ranges["bwd"] = proof["kernels"], proof["ranges"]
        _clear_grads(p.leaves)
    return {"kernels": kernels, "ranges": ranges}


def measure(name: str, inputs: dict, shape: providers.DenseShape, timer, stages=DENSE_STAGES, reference=None,
            profile: bool = False, memory: bool = True) -> dict:
    """One provider on one shape: its row (see :class:`providers.DenseShape` for the key fields).

    With ``reference`` (a :class:`validate.Reference`) the provider's output, LSE and, when a backward
    stage runs, gradients are checked first (:func:`validate.check`); a provider that fails is marked
    ``invalid`` and not timed. The forward is always timed (a backward needs it); ``bwd`` and ``fwd_bwd``
    when in ``stages``. ``profile`` records the kernel names; ``memory`` the peak extra memory (CUDA only)."""
    row = shape.key(name)
    reason = providers.not_applicable(name, shape)
    if reason:
        row["skipped"] = reason
        return row
    try:
        p = providers.BUILDERS[name](inputs, shape)
    except Exception as exc:  # noqa: BLE001 - an unavailable provider is a marked cell
        row["fwd_err"] = common.describe_error(exc)
        return row
    backward = "bwd" in stages or "fwd_bwd" in stages
    with p.scope:
        out = None
        try:
            start = time.perf_counter()
            out = p.fwd()  # the first call compiles (Triton, inductor): excluded from the timings
            common.synchronize(out.device)
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            out = None
            try:
                row.update(validate.check(p, reference, backward))
            except Exception as exc:  # noqa: BLE001 - a check that cannot run is no pass
                row["invalid"] = f"check failed: {common.describe_error(exc)}"
            if not row.get("invalid"):
                row.update(common.timing_fields("fwd", timer(p.fwd)))
                out = p.fwd()
        except Exception as exc:  # noqa: BLE001
            row["fwd_err"] = common.describe_error(exc)
        timed = "fwd_err" not in row and not row.get("invalid")
        if timed and "bwd" in stages:
            row.update(time_backward(p, out, timer, row["fwd_ms"]))
        out = None  # frees the retained graph
        _clear_grads(p.leaves)
        if timed and "fwd_bwd" in stages:
            try:
                both = timer(lambda: p.fwd().backward(p.dout), grad_to_none=list(p.leaves))
                row.update(common.timing_fields("fwd_bwd", both))
            except Exception as exc:  # noqa: BLE001
                row["fwd_bwd_err"] = common.describe_error(exc)
            _clear_grads(p.leaves)
        if timed and memory and _is_cuda(p):
            try:
                row["peak_extra_GB"] = peak_extra_bytes(p, backward) / 1e9
                row["peak_mode"] = "fwd+bwd" if backward else "fwd (no_grad)"
            except Exception as exc:  # noqa: BLE001
                row["mem_err"] = common.describe_error(exc)
        if "fwd_err" not in row and profile:
            try:
                row.update(record_kernels(p, backward and row.get("bwd_err") is None))
            except Exception as exc:  # noqa: BLE001 - the proof is extra; its failure is noted, not fatal
                row["profile_err"] = common.describe_error(exc)
    _clear_grads(p.leaves)
    _free_cuda()
    add_rates(row, shape)
    return row


def add_rates(row: dict, shape: providers.DenseShape) -> None:
    """TFLOP/s and modeled GB/s of every timed stage of ``row``."""
    for stage in DENSE_STAGES:
        ms = row.get(f"{stage}_ms")
        if ms:
            row[f"{stage}_tflops"] = common.tflops(shape.flops(stage), ms)
            row[f"{stage}_GBps"] = common.gbps(shape.bytes(stage), ms)


def driver_version() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _package_version(name: str) -> str | None:
    """The installed version of a distribution (a peer's), or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _env(dtype_name: str | None = None) -> dict:
    import triton

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    env = common.base_env()
    env.update(
        {
            "device": "cuda",
            "gpu": torch.cuda.get_device_name(index),
            "sms": props.multi_processor_count,
            "gpu_mem_GB": round(props.total_memory / 1e9, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            "driver": driver_version(),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "triton": triton.__version__,
            "fa4": _package_version("flash-attn-4"),
            "cpu": common.cpu_model(),
        }
    )
    if dtype_name:
        env["dtype"] = dtype_name
    return env


def _progress(row: dict) -> str:
    """A cell's result in a few words, for the progress line."""
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    if row.get("fwd_err"):
        return f"fwd failed: {row['fwd_err']}"
    if row.get("invalid"):
        return f"INVALID, not timed: {row['invalid']}"
    text = f"fwd {row['fwd_ms']:.3f} ms"
    if row.get("fwd_tflops") is not None:
        text += f" {_rate(row['fwd_tflops'])} TFLOP/s"
    if row.get("max_abs_err") is not None:
        text += f", err {row['max_abs_err']:.1e}"
    for stage in ("bwd", "fwd_bwd"):
        if row.get(f"{stage}_err"):
            text += f"; {stage} failed: {row[f'{stage}_err']}"
        elif row.get(f"{stage}_ms") is not None:
            text += f"; {stage} {row[f'{stage}_ms']:.3f} ms"
            if row.get(f"{stage}_tflops") is not None:
                text += f" {_rate(row[f'{stage}_tflops'])} TFLOP/s"
    return text


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"  # GPU rows are hundreds; CPU smoke rows fractions
