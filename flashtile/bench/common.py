"""Pieces shared by the GPU sweep and the CPU comparison: FLOP counts, timing, error cells,
reference check, environment capture, result files and tables.

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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fwd_flops(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool) -> float:
    """``4 * B * H * S * S * D`` (two GEMMs), halved when causal."""
    flops = 4.0 * batch * nheads * seqlen * seqlen * headdim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms or ms <= 0 else flops / (ms * 1e-3) / 1e12


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


def short_error(label: str) -> str:
    """A table cell for an error label: ``OOM`` or ``ERR(<exception type>)``."""
    kind = label.split(":", 1)[0]
    return "OOM" if kind == "OOM" else f"ERR({kind})"


def reference_output(q, k, v, causal: bool, heads: int | None = None, chunk_bytes: float = 2**30):
    """``attention_ref`` output (fp32 on CUDA, fp64 on CPU) for q, k, v ``(batch, seqlen, nheads, headdim)``
    with as many KV heads as query heads.

    Computed a few heads at a time so each ``seqlen x seqlen`` score block stays near
    ``chunk_bytes`` (the whole matrix can exceed memory); ``heads`` keeps only the first heads,
    a cheap spot check where the reference is slow.
    """
    from ..testing import attention_ref, reference_dtype

    batch, seqlen_q, nheads, headdim = q.shape
    nheads = min(nheads, heads) if heads else nheads
    ref_dtype = reference_dtype(q.device)
    score_bytes = batch * seqlen_q * k.shape[1] * torch.finfo(ref_dtype).bits // 8
    step = max(1, int(chunk_bytes // score_bytes))
    out = torch.empty((batch, seqlen_q, nheads, headdim), dtype=ref_dtype, device=q.device)
    with torch.no_grad():
        for h in range(0, nheads, step):
            sl = slice(h, min(h + step, nheads))
            out[:, :, sl] = attention_ref(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=causal)[0]
    return out


def max_abs_err(out, reference) -> float:
    """``max|out - reference|`` over the heads the reference covers (``out`` ``(batch, seqlen, nheads, headdim)``)."""
    from ..testing import max_abs_error

    return float(max_abs_error(out[:, :, : reference.shape[2]], reference))


# ---------------------------------------------------------------- environment and files


def git_commit(path: Path | None = None) -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding flashtile."""
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
        # A copy of the tree without .git (e.g. on a remote GPU box): the caller may name the commit.
        return {"commit": os.environ.get("FLASHTILE_GIT_COMMIT"), "dirty": None}
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


def result_path(out_dir: str | Path, prefix: str, date: str) -> Path:
    return Path(out_dir) / f"{prefix}-{date}.json"


ROW_KEY = ("D", "N", "B", "H", "causal", "prov")
ROW_LISTS = ("attn", "mem")


def load_previous(path: Path, env: dict, same: tuple[str, ...]) -> dict:
    """Rows of an earlier run in today's file at ``path``, when its ``env`` matches on ``same``
    (machine, dtype, commit): a sweep run in parts (``--headdims 64``, then ``128``) ends in one file.
    Otherwise ``{}``, and the file is overwritten."""
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or any(old.get("env", {}).get(k) != env.get(k) for k in same):
        return {}
    return {name: old.get(name) or [] for name in ROW_LISTS}


def merged(payload: dict, previous: dict) -> dict:
    """``payload`` plus the ``previous`` rows it did not measure again (same :data:`ROW_KEY`)."""
    if not any(previous.values()):
        return payload
    out = dict(payload)
    kept = 0
    for name in ROW_LISTS:
        if name not in payload:
            continue
        fresh = {tuple(r.get(k) for k in ROW_KEY) for r in payload[name]}
        old = [r for r in previous.get(name, []) if tuple(r.get(k) for k in ROW_KEY) not in fresh]
        kept += len(old)
        out[name] = old + payload[name]
    out["rows_from_earlier_run"] = kept
    return out


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
