"""Pieces shared by the benchmark stages: FLOP and byte models, timers and their statistics,
marked cells for failures, the kernel-name proof, environment capture,
result files, tables and the progress line.

Nothing here imports CUDA-only modules, so the CPU path can use all of it.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

# Backward does 2.5x the matmul work of forward (5 GEMMs against 2): flash-attn's benchmark
# convention, which the peer numbers we compare with use too.
BWD_FLOPS_FACTOR = 2.5
# FLOPs of each timed stage in units of the forward's.
STAGE_FLOPS_FACTOR = {"fwd": 1.0, "bwd": BWD_FLOPS_FACTOR, "fwd_bwd": 1.0 + BWD_FLOPS_FACTOR}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The H200's measured device-to-device copy bandwidth (a large bf16 tensor copy, read + write
# counted; run of 2026-11-21 on the project's H200, the peer reference file's "ceil.copy_TBps" =
# 4.265). The spec sheet says 4.8 TB/s; no kernel reaches it, so the copy is the honest ceiling.
H200_COPY_TBPS = 4.265
BANDWIDTH_CEILING_SOURCE = ("H200 device-to-device copy of a large bf16 tensor, measured 2026-11-21 on the project's "
                            "H200 (4.265 TB/s; spec sheet 4.8 TB/s)")

FLOP_MODEL = ("fwd FLOPs = 2 * B * H * Sq * Sk * (D + Dv) (= 4 * B * H * Sq * Sk * D when Dv = D), halved when causal; "
              "bwd = 2.5x fwd; fwd_bwd = 3.5x fwd")
BYTE_MODEL = ("modeled HBM bytes, each tensor touched once: fwd = elt * (|q| + |k| + |v| + |o|) with |q| = B*Sq*H*D, "
              "|k| = B*Sk*Hkv*D, |v| = B*Sk*Hkv*Dv, |o| = B*Sq*H*Dv; bwd = elt * 2 * (|q| + |k| + |v| + |o|) (reads q, "
              "k, v, o, dO; writes dQ, dK, dV); fwd_bwd = their sum; decode = elt * B * L * Hkv * (D + Dv) (the K and V "
              "read; q and o are negligible). GB/s = bytes / median time.")


class Unavailable(Exception):
    """A provider or feature that is not installed or not implemented here: a cell marked ``n/a``."""


class Unsupported(Exception):
    """A shape or feature a provider does not support: a cell marked ``unsupported``."""


def fwd_flops(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool) -> float:
    """``4 * B * H * S * S * D`` (two GEMMs), halved when causal."""
    return attn_flops(batch, nheads, seqlen, seqlen, headdim, causal)


def attn_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int, causal: bool,
               headdim_v: int | None = None) -> float:
    """Forward FLOPs of attention: ``2 * B * H * Sq * Sk * (D + Dv)`` (q k^T, then p v), halved when causal."""
    flops = 2.0 * batch * nheads * seqlen_q * seqlen_k * (headdim + (headdim_v or headdim))
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms or ms <= 0 else flops / (ms * 1e-3) / 1e12


def attn_bytes(stage: str, batch: int, nheads: int, nheads_kv: int, seqlen_q: int, seqlen_k: int, headdim: int,
               headdim_v: int, elt: int) -> int:
    """Modeled HBM bytes of one attention ``stage`` (fwd, bwd, fwd_bwd); see :data:`BYTE_MODEL`."""
    q = batch * seqlen_q * nheads * headdim
    k = batch * seqlen_k * nheads_kv * headdim
    v = batch * seqlen_k * nheads_kv * headdim_v
    o = batch * seqlen_q * nheads * headdim_v
    fwd, bwd = q + k + v + o, 2 * (q + k + v + o)
    return elt * {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[stage]


def decode_bytes(batch: int, cache_len: int, nheads_kv: int, headdim: int, headdim_v: int, elt: int) -> int:
    """K and V bytes a decode step reads: ``elt * B * L * Hkv * (D + Dv)``."""
    return elt * batch * cache_len * nheads_kv * (headdim + headdim_v)


def gbps(nbytes: float, ms: float | None) -> float | None:
    return None if not ms or ms <= 0 else nbytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------- timing


def quantile(values, q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def timing_fields(prefix: str, times_ms) -> dict:
    """``{prefix}_ms`` (median) and its spread ``{prefix}_p10_ms`` / ``{prefix}_p90_ms`` over ``{prefix}_reps`` runs."""
    times = [float(t) for t in times_ms]
    if not times:
        raise ValueError(f"{prefix}: no timed runs")
    return {f"{prefix}_ms": quantile(times, 0.5), f"{prefix}_p10_ms": quantile(times, 0.1),
            f"{prefix}_p90_ms": quantile(times, 0.9), f"{prefix}_reps": len(times)}


WARMUP_MS, REP_MS = 25, 100


def gpu_timer(warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS):
    """``timer(fn, grad_to_none=None) -> [ms, ...]``: CUDA-event times of each run of ``fn`` after warm-up,
    L2 flushed before each (``triton.testing.do_bench(..., return_mode="all")``)."""
    from triton.testing import do_bench

    def timer(fn, grad_to_none=None) -> list[float]:
        return list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all"))

    return timer


def cpu_timer(runs: int = 2):
    """The same contract on CPU (smoke runs and tests): wall-clock times of ``runs`` calls, no warm-up."""

    def timer(fn, grad_to_none=None) -> list[float]:
        def call():
            for t in grad_to_none or ():
                t.grad = None
            fn()

        return time_runs_ms(call, min_runs=runs, max_runs=runs, min_total_s=0.0, warmup=0)

    return timer


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_runs_ms(fn, min_runs: int = 3, max_runs: int = 10, min_total_s: float = 2.0, warmup: int = 1) -> list[float]:
    """Wall-clock times in ms of ``fn()`` (CPU work): ``warmup`` untimed calls, then at least
    ``min_runs`` timed ones, more until ``min_total_s`` seconds or ``max_runs`` runs."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < min_runs or (sum(times) < min_total_s * 1e3 and len(times) < max_runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def describe_error(exc: BaseException) -> str:
    """A short, one-line label for a failed measurement, e.g. ``OOM: CUDA out of memory ...``."""
    text = " ".join(str(exc).split())
    if len(text) > 160:
        text = text[:157] + "..."
    name = type(exc).__name__
    lowered = text.lower()
    if isinstance(exc, MemoryError) or "OutOfMemory" in name or "out of memory" in lowered or "allocate memory" in lowered:
        return f"OOM: {name}: {text}"
    return f"{name}: {text}"


# Messages of peers that refuse a shape or feature (torch SDPA's backends, flash-attn, Flex).
_UNSUPPORTED = re.compile(r"no available kernel|no viable backend|not supported|unsupported|only supports|"
                          r"is not implemented for")


def error_kind(label: str) -> str:
    """``oom``, ``n/a`` (not installed / not implemented), ``unsupported`` (the peer refuses the shape),
    ``withdrawn`` (a published number taken back, see :mod:`flashtile.bench.results`) or ``error``, from a
    :func:`describe_error` label."""
    kind, _, text = label.partition(":")
    if label.startswith("withdrawn"):
        return "withdrawn"
    if kind == "OOM":
        return "oom"
    if kind in ("Unavailable", "ModuleNotFoundError", "ImportError"):
        return "n/a"
    if kind in ("Unsupported", "NotImplementedError") or _UNSUPPORTED.search(text.lower()):
        return "unsupported"
    return "error"


def invalid_cell(row: dict) -> str:
    """The table cell of a row whose results broke the tolerance rule: ``invalid (err 2.7e+00)``."""
    err = row.get("invalid_err")
    return f"invalid (err {err:.1e})" if isinstance(err, (int, float)) else "invalid"


def short_error(label: str) -> str:
    """A table cell for an error label: ``OOM``, ``n/a``, ``unsupported`` or ``ERR(<exception type>)``."""
    kind = error_kind(label)
    if kind == "withdrawn":
        return label
    if kind == "error":
        return f"ERR({label.split(':', 1)[0]})"
    return "OOM" if kind == "oom" else kind


def error_fields(row: dict) -> dict:
    """A row's failure labels: the ``*_err`` keys holding text (``max_abs_err`` is a number, not a failure)."""
    return {key: value for key, value in row.items() if key.endswith("_err") and isinstance(value, str) and value}


def row_status(row: dict) -> str:
    """One word per result row: ``ok``; ``invalid`` (its results broke the tolerance rule: never timed);
    ``skipped``; the kind of its main failure (``oom``, ``n/a``,
    ``unsupported``, ``error``: nothing measured); or ``partial`` (measured, but a later stage failed)."""
    if row.get("invalid"):
        return "invalid"
    if row.get("skipped"):
        return "skipped"
    main = row.get("fwd_err") or row.get("err")
    if main:
        return error_kind(main)
    if any(key != "check_err" for key in error_fields(row)):
        return "partial"
    return "ok"


# ---------------------------------------------------------------- proof of the path

KERNEL_NAME_CHARS = 120  # cuDNN/CUTLASS names run to kilobytes of template arguments


def kernel_proof(fn, cuda: bool) -> dict:
    """Run ``fn()`` once under ``torch.profiler``: ``{"kernels": [...], "ranges": [...]}``, the distinct
    CUDA kernel names that ran (truncated) and flashtile's ``record_function`` ranges
    (``flashtile.fwd[triton d=128 ...]``), which name the backend and tiles even on CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kernels, ranges = set(), set()
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            name = event.name
            kernels.add(name if len(name) <= KERNEL_NAME_CHARS else name[: KERNEL_NAME_CHARS - 3] + "...")
        elif event.name.startswith("flashtile."):
            ranges.add(event.name)
    return {"kernels": sorted(kernels), "ranges": sorted(ranges)}


def max_abs_err(out, reference) -> float:
    """``max|out - reference|`` over the heads the reference covers (``out`` ``(batch, seqlen, nheads, headdim)``)."""
    from ..testing import max_abs_error

    return float(max_abs_error(out[:, :, : reference.shape[2]], reference))


# ---------------------------------------------------------------- environment and files


def git_commit(path: Path | None = None) -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding flashtile."""
    if os.environ.get("FLASHTILE_GIT_COMMIT"):
        # A copy of the tree on another machine may carry a stale .git: the caller's name for it wins.
        return {"commit": os.environ["FLASHTILE_GIT_COMMIT"], "dirty": None}
    here = str(path or Path(__file__).resolve().parents[2])

    def git(*args):
        # --no-optional-locks: reading the status must not take the index lock of a shared tree.
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", here, *args],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}  # a copy of the tree without .git: name it with FLASHTILE_GIT_COMMIT
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return {"commit": commit, "dirty": dirty}


def base_env() -> dict:
    """Versions and the date, common to every result file."""
    import flashtile

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    git = git_commit()
    return {
        "date": datetime.date.today().isoformat(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "flashtile": flashtile.__version__,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "argv": sys.argv[1:],
        **machine_load(),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError):
        pass
    return None


def gpu_slug(name: str) -> str:
    """A short file-name slug of a GPU name: ``NVIDIA H200`` -> ``h200``,
    ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA GeForce RTX 4090`` -> ``rtx-4090``."""
    drop = {"nvidia", "geforce", "tesla", "amd", "radeon", "pcie", "nvl", "sxm", "hbm3", "hbm3e", "hbm2e"}
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    kept = [w for w in words if w not in drop and not re.fullmatch(r"\d+gb|sxm\d*|hbm\d*e?", w)]
    return "-".join(kept) or "gpu"


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)  # a run stopped mid-write leaves the previous complete file
    return path


DEFAULT_OUT = "flashtile-results"  # results go here, under the current directory, unless --out says otherwise


def stamp(env: dict) -> str:
    """``2026-11-27T153012Z``: the run's start (``env["time_utc"]``) for its file names."""
    return env["time_utc"].replace(":", "")


def unique_stem(out_dir: str | Path, name: str) -> Path:
    """``out_dir / name``, or ``name-2``, ``name-3``... when a file of that stem exists: a run never
    overwrites another's results."""
    out_dir = Path(out_dir)
    stem, n = out_dir / name, 1
    while any(out_dir.glob(f"{stem.name}.*")) or any(out_dir.glob(f"{stem.name}-*.png")):
        n += 1
        stem = out_dir / f"{name}-{n}"
    return stem


def result_path(out_dir: str | Path, prefix: str, env: dict) -> Path:
    """A new ``<out_dir>/<prefix>-<date>T<time>Z.json`` (see :func:`unique_stem`)."""
    return unique_stem(out_dir, f"{prefix}-{stamp(env)}").with_suffix(".json")


def machine_load() -> dict:
    """``{"load_1m", "cpus", "busy"}``: the 1-minute load average against the cores this process may use;
    ``busy`` when other work holds more than half of them (timings then swing)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return {"load_1m": None, "cpus": cpus, "busy": None}
    return {"load_1m": round(load, 2), "cpus": cpus, "busy": load > 0.5 * cpus}


def load_warning(env: dict) -> str | None:
    """One line flagging a busy machine from ``env``'s load fields, or None."""
    if env.get("busy"):
        return (f"BUSY MACHINE: load average {env['load_1m']} on {env['cpus']} cores at the start; timings "
                "(CPU timings most of all) may be slower and noisier than on an idle machine")
    return None


# ---------------------------------------------------------------- tables


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.{digits}f}"
    return str(value)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.0f} MB"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table with padded columns: readable in a terminal, pasteable into BENCHMARKS.md."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def log(message: str) -> None:
    """Progress goes to stderr so ``--json`` output on stdout stays clean."""
    print(message, file=sys.stderr, flush=True)


def fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """A progress bar over a sweep, one line per measured cell on stderr (readable in a terminal
    and in a log file alike): ``[#####.......] 12/48 25% 1m05s eta 3m10s  <cell>: <result>``."""

    def __init__(self, total: int, width: int = 20):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.start = time.perf_counter()

    def step(self, label: str, result: str = "") -> None:
        self.done += 1
        frac = min(self.done / self.total, 1.0)
        filled = int(frac * self.width)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * max(self.total - self.done, 0)
        bar = "#" * filled + "." * (self.width - filled)
        log(f"[{bar}] {self.done}/{self.total} {frac:4.0%} {fmt_duration(elapsed)} eta {fmt_duration(eta)}  "
            f"{label}{': ' + result if result else ''}")

