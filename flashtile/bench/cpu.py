"""CPU comparison, for machines without a CUDA GPU: flashtile's pure-PyTorch tiled backend
against naive attention (the whole ``seqlen x seqlen`` score matrix, fp32) and torch's CPU
``scaled_dot_product_attention``; forward only.

Each (provider, shape) runs in a fresh subprocess, because CPU memory is invisible to
``torch.cuda`` statistics: its peak extra memory is ``ru_maxrss`` after the runs minus
``ru_maxrss`` once the inputs are allocated (after a small warm-up call has loaded every lazy
module). Time is the median wall clock of a few forward calls after one untimed call.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import torch

from . import common, validate
from .providers import naive_attention

PROVIDERS = ("flashtile", "naive", "sdpa")
SEQLENS = (1024, 4096, 16384)
QUICK_SEQLENS = (512, 1024, 2048)
BATCH, NHEADS, HEADDIM = 1, 8, 64
WORKER_TIMEOUT_S = 3600

NOTE = (
    "CPU, forward only, batch 1, 8 heads. Each provider and shape in a fresh subprocess; time = median wall "
    "clock of >= 3 calls after 1 untimed call; peak_extra_GB = ru_maxrss after the calls minus ru_maxrss "
    "after allocating the inputs. flashtile = flash_attn_func on CPU tensors (pure-PyTorch tiled backend, "
    "TRITON_INTERPRET unset); naive = softmax(q k^T * scale) v with the full score matrix; sdpa = "
    "torch.nn.functional.scaled_dot_product_attention on (B,H,S,D) contiguous copies. max_abs_err: "
    "|out - attention_ref float64| on head 0."
)


def _forward(provider: str, q, k, v, causal: bool):
    """The provider's forward as a no-argument callable on inputs ``(batch, seqlen, nheads, headdim)``."""
    if provider == "flashtile":
        import flashtile

        return lambda: flashtile.flash_attn_func(q, k, v, causal=causal)
    if provider == "naive":
        scale = q.shape[-1] ** -0.5
        return lambda: naive_attention(q, k, v, causal, scale)
    if provider == "sdpa":
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def _inputs(batch, seqlen, nheads, headdim, dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, seqlen, nheads, headdim, generator=gen).to(dtype) for _ in range(3)]


def worker(spec: dict) -> dict:
    """Measure one provider on one shape in this (fresh) process."""
    import flashtile

    dtype = common.DTYPES[spec["dtype"]]
    shape = (spec["batch"], spec["seqlen"], spec["nheads"], spec["headdim"])
    # A small call first loads whatever the provider imports lazily, so it is not counted as its memory.
    _forward(spec["provider"], *_inputs(1, 128, *shape[2:], dtype), spec["causal"])()
    q, k, v = _inputs(*shape, dtype)
    fwd = _forward(spec["provider"], q, k, v, spec["causal"])
    if spec["check"] and spec["provider"] != "naive":  # checked before it is timed: a wrong result is no speed
        with torch.no_grad():
            checked = validate.verdict({"out": fwd()}, validate.output_reference(q, k, v, 1, causal=spec["causal"]))
        if checked.get("invalid"):
            return checked
    else:
        checked = {}
    flashtile.reset_stats()
    load_before = os.getloadavg()[0]
    base = _maxrss_bytes()
    with torch.no_grad():
        runs = common.time_runs_ms(fwd)
    result = {
        **common.timing_fields("fwd", runs),
        "fwd_runs_ms": [round(t, 3) for t in runs],
        "peak_extra_GB": (_maxrss_bytes() - base) / 1e9,
        "threads": torch.get_num_threads(),
        # Other processes on the machine skew CPU timings badly (threads spin at barriers): keep the evidence.
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if spec["provider"] == "flashtile":
        result["flashtile_stats"] = flashtile.stats()
    return {**result, **checked}


def worker_main() -> None:
    """Entry point of the subprocess: the spec is argv[1]; the result is the last line of stdout."""
    spec = json.loads(sys.argv[1])
    try:
        result = worker(spec)
    except (Exception, MemoryError) as exc:  # noqa: BLE001 - reported as a marked cell
        result = {"err": common.describe_error(exc)}
    print(json.dumps(result), flush=True)


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _naive_bytes(batch, seqlen, nheads) -> int:
    return 2 * batch * nheads * seqlen * seqlen * 4  # scores and their softmax, fp32, alive together


def _run_worker(spec: dict, timeout_s: float) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CPU comparison is about the torch backend, not the interpreter
    package_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-c", "from flashtile.bench.cpu import worker_main; worker_main()", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"err": f"Timeout: no result within {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    if proc.returncode == -signal.SIGKILL:
        return {"err": "OOM: worker killed by SIGKILL (most likely the out-of-memory killer)"}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"err": f"WorkerFailed: exit code {proc.returncode}: {tail}"}


def _env() -> dict:
    env = common.base_env()
    env.update(
        {
            "device": "cpu",
            "cpu": common.cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "mem_total_GB": common.mem_total_gb(),
            "gpu": None,
        }
    )
    return env


def format_table(rows: list[dict]) -> str:
    naive_ms = {(r["D"], r["N"], r["causal"]): r.get("fwd_ms") for r in rows if r["prov"] == "naive"}
    table = []
    order = {p: i for i, p in enumerate(PROVIDERS)}
    for r in sorted(rows, key=lambda r: (r["D"], r["causal"], r["N"], order.get(r["prov"], 99))):
        if r.get("err") or r.get("invalid"):
            cell = common.invalid_cell(r) if r.get("invalid") else common.short_error(r["err"])
            table.append([str(r["D"]), str(r["N"]), str(r["causal"]).lower(), r["prov"], cell, "-", "-", "-", "-"])
            continue
        base = naive_ms.get((r["D"], r["N"], r["causal"]))
        table.append([
            str(r["D"]),
            str(r["N"]),
            str(r["causal"]).lower(),
            r["prov"],
            common.fmt(r["fwd_ms"], 1),
            common.fmt(r["fwd_gflops"], 1),
            common.fmt_bytes(r["peak_extra_GB"] * 1e9),
            f"{r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else "-",
            f"{base / r['fwd_ms']:.2f}x" if base else "-",
        ])
    headers = ["hdim", "seqlen", "causal", "provider", "fwd ms", "GFLOP/s", "peak extra mem", "max abs err", "speed vs naive"]
    return common.markdown_table(headers, table)


def sweep(seqlens, headdims, causals, providers, dtype_name: str, check: bool, on_row=None) -> list[dict]:
    """Measure every (headdim, causal, seqlen, provider), each in a fresh process; ``on_row(row)`` after each."""
    rows = []
    for headdim in headdims:
        for causal in causals:
            for seqlen in seqlens:
                for provider in providers:
                    row = {"D": headdim, "N": seqlen, "B": BATCH, "H": NHEADS, "causal": causal, "prov": provider}
                    available = _mem_available_bytes()
                    need = _naive_bytes(BATCH, seqlen, NHEADS)
                    if provider == "naive" and available is not None and need > 0.9 * available:
                        result = {"err": f"OOM: skipped, needs ~{need / 1e9:.1f} GB, {available / 1e9:.1f} GB available"}
                    else:
                        spec = dict(provider=provider, batch=BATCH, seqlen=seqlen, nheads=NHEADS, headdim=headdim,
                                    causal=causal, dtype=dtype_name, check=check)
                        result = _run_worker(spec, WORKER_TIMEOUT_S)
                    row.update(result)
                    if "fwd_ms" in row:
                        flops = common.fwd_flops(BATCH, NHEADS, seqlen, headdim, causal)
                        row["fwd_gflops"] = common.tflops(flops, row["fwd_ms"]) * 1e3
                    rows.append(row)
                    if on_row:
                        on_row(row)
    return rows


def progress_text(row: dict) -> str:
    if row.get("err"):
        return row["err"]
    if row.get("invalid"):
        return f"INVALID, not timed: {row['invalid']}"
    return f"{row['fwd_ms']:.1f} ms, peak extra {common.fmt_bytes(row['peak_extra_GB'] * 1e9)}"
