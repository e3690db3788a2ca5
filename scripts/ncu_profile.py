"""Hardware counters of one flashtile call at one shape, read by NVIDIA Nsight Compute (``ncu``; GPU only):
duration, TFLOP/s, tensor and XU (MUFU) pipe use, issue-slot use, warp cycles per issued instruction, the top
stall reasons with their shares, registers, occupancy and DRAM throughput of every kernel the call launches.

    python scripts/ncu_profile.py CASE [CASE ...] [--out DIR] [--source] [--kernel REGEX] [--metrics IDS]
    python scripts/ncu_profile.py fwd:d64:16k fwd:d128:16k fwd-fp8:d128:16k bwd:d128:16k --out $OUT

A CASE is ``KIND:SHAPE[:causal]``:

    fwd:d128:16k[:causal]       the bf16 forward (launch.forward), head dim 128, 16384 keys a sequence
    fwd-fp8:d128:16k[:causal]   the FP8 forward on inputs quantized beforehand (as flashtile.bench.fp8's fp8_kernel)
    bwd:d128:16k[:causal]       the bf16 backward alone (launch.backward; its forward runs before profiling)
    decode:16x32768             one decode step (flash_attn_with_kvcache) of batch 16 on a bf16 cache of 32768 keys
    decode-fp8:1x128k           the same on an e4m3 cache with per-KV-head descales

Dense shapes are the headline suite's: ``B = 16384 // N`` sequences (at least 1), ``H = 2048 // d`` heads; ``d192``
is DeepSeek's 192/128 (values of 128, 16 heads, ``B = 8192 // N``). Decode: GQA 32/8 at head dim 128, as the FP8
suite. Lengths take a ``k`` (x 1024). The inputs are bf16 and fresh standard-normal.

Each case runs in a child process of its own under ``ncu --clock-control none`` (the clocks left alone), which
profiles the kernels of ONE call: the child makes the call ``--warmup`` times (the compiles and the first
launches stay outside), then brackets one more call with ``cudaProfilerStart``/``Stop`` (``--profile-from-start
off``). Every kernel of that call is profiled (``--kernel`` narrows them by a regex of their names) with the
sections SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats, SchedulerStats, Occupancy, LaunchStats,
InstructionStats and MemoryWorkloadAnalysis, which collect the metrics this ncu knows for this GPU (Hopper's
``gmma`` stall among them; an explicit list would fail on a name a version lacks: ``--metrics`` adds names). The
metrics are read back by their IDs from the report's raw page (``ncu --import R --page raw --csv --print-units
base``) and the ones below chosen from them:

- duration ``gpu__time_duration.sum``; TFLOP/s of the longest kernel at the project's FLOP count (forward
  ``4 * B * H * N * N * d``, halved when causal; backward 2.5x); decode: GB/s of the K and V bytes a step reads;
- tensor pipe, XU pipe (MUFU: ex2, rcp) and issue slots busy, in % of peak over the SMs' active cycles;
- warp cycles per issued instruction and the stall reasons
  ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``, each in cycles of it: a reason's share
  is its cycles over the total (``selected`` is the issuing cycle itself, not a stall);
- registers a thread, achieved and theoretical occupancy, DRAM TB/s and % of peak, eligible warps a scheduler.

Warp-specialized kernels: ncu's counters add up every warp of the CTA, the producer's (TMA loads, waiting on
empty slots) with the consumers' (matmuls and softmax), so a stall share is a mix of the two. ``--source`` adds
the SourceCounters section (warp-state sampling at every SASS instruction) and prints the 20 instructions with the
most samples and their reasons: the consumers' key loop has its own instructions (HGMMA, MUFU.EX2, FFMA), so
those rows say what the consumers wait on.

Output: one table a case on stdout, and under ``--out`` (default ``flashtile-results``)
``<gpu>-ncu-<date>-<commit>.json`` (versions, GPU, ncu's, and every metric of every kernel), each case's
``.ncu-rep`` (open it in Nsight Compute's GUI) and ncu's log. If ncu is missing or collects nothing (no
counter access: ERR_NVGPUCTRPERM, a sandbox without the GPU's performance counters) the run exits 1 with the
reason in one line and prints no table; a case that fails after another worked is reported and the others go on.
Environment: ``NCU`` (the ncu binary; default: PATH, ``$CUDA_HOME/bin/ncu``, then the newest of
/usr/local/cuda-*/bin/ncu and /opt/nvidia/nsight-compute/*/ncu).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashtile.bench import common  # noqa: E402
from flashtile.bench.fp8 import DECODE_HEADS, TOKENS, WIDTH  # noqa: E402

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats", "Occupancy",
            "LaunchStats", "InstructionStats", "MemoryWorkloadAnalysis")
KINDS = ("fwd", "fwd-fp8", "bwd", "decode", "decode-fp8")
HEAD_DIMS = {"fwd": (64, 96, 128, 192, 256), "bwd": (64, 96, 128, 192, 256), "fwd-fp8": (64, 128, 256)}
# DeepSeek's MLA heads as the suite runs them: q and k of 192, v of 128, 16 heads, 8192 tokens a call.
D192_HEADS, D192_TOKENS, D192_V = 16, 8192, 128
# A call launches a few kernels (the backward: preprocess, the main kernel, dQ's cast): profile at most this many.
MAX_KERNELS = 16
TOP_STALLS, TOP_SOURCE = 6, 20
WS_NOTE = ("ncu adds up all warps of a CTA: in a warp-specialized kernel the producer's waits (empty slots) and "
           "the consumers' (matmuls, softmax) share one stall breakdown; --source splits them by SASS instruction")


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One flashtile call at one shape: ``kind`` (one of :data:`KINDS`), q of ``(batch, seqlen_q, nheads,
    head_dim)``, k and v of ``(batch, seqlen_k, nheads_kv, head_dim / head_dim_v)`` (decode: the cache)."""

    text: str
    kind: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int
    causal: bool

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", self.text).strip("-")

    @property
    def flops(self) -> float:
        """The project's FLOP count of the call: the forward's, 2.5x for the backward."""
        fwd = common.attn_flops(self.batch, self.nheads, self.seqlen_q, self.seqlen_k, self.head_dim,
                                self.causal and self.seqlen_q > 1, self.head_dim_v)
        return fwd * (common.BWD_FLOPS_FACTOR if self.kind == "bwd" else 1.0)

    @property
    def cache_bytes(self) -> int:
        """K and V bytes a decode step reads (0 for the dense kinds)."""
        if not self.kind.startswith("decode"):
            return 0
        elt = 1 if self.kind == "decode-fp8" else 2
        return common.decode_bytes(self.batch, self.seqlen_k, self.nheads_kv, self.head_dim, self.head_dim_v, elt)

    def describe(self) -> str:
        mask = " causal" if self.causal else ""
        if self.kind.startswith("decode"):
            return (f"{self.kind} B={self.batch} L={self.seqlen_k} H={self.nheads} Hkv={self.nheads_kv} "
                    f"d={self.head_dim}")
        dims = f"d={self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        return f"{self.kind} {dims} B={self.batch} H={self.nheads} N={self.seqlen_q}{mask}"


def _length(text: str, case: str, what: str) -> int:
    match = re.fullmatch(r"(\d+)(k?)", text.lower())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"case {case!r}: {what} must be a positive number, optionally with k (x 1024), "
                         f"like 4096 or 16k; got {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def parse_case(text: str) -> Case:
    """A :class:`Case` from ``KIND:dD:N[:causal]`` (dense) or ``KIND:BxL`` (decode); ValueError naming the case."""
    parts = text.split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise ValueError(f"case {text!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)} "
                         "(e.g. fwd:d128:16k, bwd:d128:4k:causal, decode-fp8:1x128k)")
    if kind.startswith("decode"):
        match = re.fullmatch(r"(\w+)x(\w+)", parts[1]) if len(parts) == 2 else None
        if match is None:
            raise ValueError(f"case {text!r}: a decode case is {kind}:BxL (batch x cache length), e.g. "
                             f"{kind}:16x32768 or {kind}:1x128k")
        batch, cache = _length(match.group(1), text, "the batch"), _length(match.group(2), text, "the cache length")
        nheads, nheads_kv, head_dim = DECODE_HEADS
        return Case(text, kind, batch, 1, cache, nheads, nheads_kv, head_dim, head_dim, False)
    if len(parts) not in (3, 4) or not re.fullmatch(r"d\d+", parts[1]):
        raise ValueError(f"case {text!r}: a {kind} case is {kind}:dD:N[:causal], e.g. {kind}:d128:16k or "
                         f"{kind}:d64:4096:causal")
    head_dim = int(parts[1][1:])
    if head_dim not in HEAD_DIMS[kind]:
        raise ValueError(f"case {text!r}: head dim {head_dim} is not one {kind} profiles; expected one of "
                         f"{', '.join(map(str, HEAD_DIMS[kind]))}")
    seqlen = _length(parts[2], text, "the sequence length")
    if len(parts) == 4 and parts[3] not in ("causal", "full"):
        raise ValueError(f"case {text!r}: the last field must be causal or full, got {parts[3]!r}")
    causal = len(parts) == 4 and parts[3] == "causal"
    if head_dim == 192:
        return Case(text, kind, max(1, D192_TOKENS // seqlen), seqlen, seqlen, D192_HEADS, D192_HEADS, 192, D192_V,
                    causal)
    nheads = WIDTH // head_dim
    return Case(text, kind, max(1, TOKENS // seqlen), seqlen, seqlen, nheads, nheads, head_dim, head_dim, causal)


# ---------------------------------------------------------------- the child: one call under the profiler


def make_call(case: Case, device: str = "cuda", dtype=None):
    """Inputs (bf16 unless ``dtype``) and a function making the case's call once (its outputs allocated by the
    call, the backward's gradients once here)."""
    import torch

    import flashtile
    from flashtile import fp8 as fp8_api
    from flashtile import validation
    from flashtile.backends.triton import launch, quant
    from flashtile.backends.torch_fp8 import FP8_MAX, to_fp8
    from flashtile.testing import make_qkv, random_like

    dtype = dtype or torch.bfloat16
    if case.kind.startswith("decode"):
        q = torch.randn(case.batch, 1, case.nheads, case.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(case.batch, case.seqlen_k, case.nheads_kv, case.head_dim, device=device, dtype=dtype)
                for _ in range(2))
        seqlens = torch.full((case.batch,), case.seqlen_k, dtype=torch.int32, device=device)
        if case.kind == "decode":
            return lambda: flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
        # Per-KV-head descales: each head's amax over the cache mapped to e4m3's largest value (as the FP8 suite).
        k_descale, v_descale = (t.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX for t in (k, v))
        k8, v8 = to_fp8(k.float() / k_descale[:, None]), to_fp8(v.float() / v_descale[:, None])
        return lambda: flashtile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, causal=True,
                                                         k_descale=k_descale, v_descale=v_descale)
    q, k, v = make_qkv(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_kv, case.head_dim, dtype,
                       device, requires_grad=False)
    v = v[..., :case.head_dim_v].contiguous()
    args = validation.attn_args(q, k, v, causal=case.causal)
    if case.kind == "fwd":
        return lambda: launch.forward(q, k, v, args)
    if case.kind == "fwd-fp8":
        quantized = quant.quantize(q, k, v)
        plan = fp8_api.plan(quantized[0], quantized[1], args, tuple(quantized[3:]))
        if plan.fallback_reason is not None:
            raise SystemExit(f"ncu_profile: {case.text}: the FP8 kernel would not run ({plan.fallback_reason})")
        return lambda: fp8_api.attention(*quantized, args, v_transposed=True)
    out, lse = launch.forward(q, k, v, args)
    dout = random_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    return lambda: launch.backward(dout, q, k, v, out, lse, args, dq, dk, dv)


def run_child(case: Case, warmup: int, meta_path: Path) -> None:
    """Warm-up calls, then one call between ``cudaProfilerStart`` and ``cudaProfilerStop``; writes the GPU's name
    and the kernels flashtile planned to ``meta_path``."""
    import torch

    import flashtile

    with torch.no_grad():
        call = make_call(case)
        for _ in range(warmup):
            call()
        torch.cuda.synchronize()
        flashtile.reset_stats()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    meta = {"gpu": torch.cuda.get_device_name(), "planned": sorted(flashtile.stats()["kernels"]), "warmup": warmup}
    meta_path.write_text(json.dumps(meta))


# ---------------------------------------------------------------- ncu command lines


def find_ncu() -> str | None:
    """``$NCU``, ``ncu`` on the PATH, ``$CUDA_HOME/bin/ncu`` (default /usr/local/cuda), then the newest of the
    usual install places (/usr/local/cuda-*/bin, /opt/nvidia/nsight-compute/*): the first that runs."""
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    installed = sorted(glob.glob("/usr/local/cuda-*/bin/ncu")) + sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    for candidate in (os.environ.get("NCU"), shutil.which("ncu"), os.path.join(cuda_home, "bin", "ncu"),
                      *reversed(installed)):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def profile_command(ncu: str, case: Case, report: Path, meta: Path, *, warmup: int = 3, source: bool = False,
                    kernel: str | None = None, metrics: str | None = None, python: str = sys.executable) -> list[str]:
    """The ncu command line that profiles ``case``'s call in a child process into ``report`` (a .ncu-rep);
    ``metrics``: more metric IDs (comma-separated) on top of the sections'."""
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--profile-from-start", "off",
           "--launch-count", str(MAX_KERNELS), "--export", str(report), "--force-overwrite"]
    if kernel:
        cmd += ["--kernel-name", f"regex:{kernel}"]
    for section in SECTIONS + (("SourceCounters",) if source else ()):
        cmd += ["--section", section]
    if metrics:
        cmd += ["--metrics", metrics]
    return cmd + [python, str(Path(__file__).resolve()), "--child", case.text, "--warmup", str(warmup),
                  "--meta", str(meta)]


def import_command(ncu: str, report: Path, page: str) -> list[str]:
    """The command printing ``page`` of a report as CSV (``raw``: every metric by ID, in base units; ``source``:
    the SASS with its samples)."""
    extra = ["--print-units", "base"] if page == "raw" else ["--print-source", "sass"]
    return [ncu, "--import", str(report), "--page", page, "--csv", *extra]


# ---------------------------------------------------------------- parsing ncu's CSV

# The launch columns ahead of the metrics on the raw page (and of "Section Name" on the details page).
LAUNCH_COLUMNS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
                  "Grid Size", "Device", "CC")
_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)?(\.\d+)?([eE][-+]?\d+)?")
_SI = {"p": 1e-12, "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BASE_UNITS = ("second", "byte", "hz", "Hz", "cycle", "inst", "warp", "sector", "request", "thread", "block")
_SHORT_UNITS = {"ns": "nsecond", "us": "usecond", "ms": "msecond", "s": "second"}


def number(text: str) -> float | None:
    """A metric value as a float: ``"1,205.50"`` -> 1205.5; None for ``n/a``, empty and non-numeric cells."""
    text = text.strip()
    if not text or not any(c.isdigit() for c in text) or not _NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def to_base(value: float, unit: str) -> tuple[float, str]:
    """``value`` in ``unit`` without its SI prefixes: ``(1.5, "msecond")`` -> ``(0.0015, "second")``,
    ``(2, "Tbyte/second")`` -> ``(2e12, "byte/second")``; other units (``%``, ``register/thread``) unchanged."""
    factor, parts = 1.0, []
    for i, part in enumerate(_SHORT_UNITS.get(unit, unit).split("/")):
        prefix, base = "", part
        for name in _BASE_UNITS:
            if part.endswith(name) and part[: -len(name)] in _SI:
                prefix, base = part[: -len(name)], name
                break
        factor = factor * _SI[prefix] if i == 0 else factor / _SI[prefix]
        parts.append(base)
    return value * factor, "/".join(parts)


def _csv_rows(text: str) -> list[list[str]]:
    """The CSV rows of ncu's output: its own lines (``==PROF==``, ``==WARNING==``, the child's prints) dropped."""
    return list(csv.reader(line for line in text.splitlines() if line.startswith('"')))


def parse_raw(text: str) -> list[dict]:
    """The kernels of a raw page (``--page raw --csv``: a header of launch columns then metric IDs, a row of units,
    a row a kernel), in launch order: ``{"kernel", "launch": {column: text}, "metrics": {id: (value, unit)}}``
    with values in base units (None where ncu printed n/a); non-numeric metric cells are kept as text."""
    rows = _csv_rows(text)
    if not rows or "Kernel Name" not in rows[0]:
        return []
    header, body = rows[0], rows[1:]
    units = [""] * len(header)
    if body and body[0] and body[0][0] == "":
        units, body = body[0], body[1:]
    kernels = []
    for row in body:
        if len(row) != len(header):
            continue
        launch, metrics = {}, {}
        for name, unit, cell in zip(header, units, row):
            if name in LAUNCH_COLUMNS:
                launch[name] = cell
                continue
            value = number(cell)
            if value is None and cell.strip() not in ("", "n/a"):
                metrics[name] = (cell, unit)
            else:
                metrics[name] = to_base(value, unit) if value is not None else (None, unit)
        kernels.append({"kernel": launch.get("Kernel Name", ""), "launch": launch, "metrics": metrics})
    return kernels


_SAMPLES = ("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All)", "# Samples", "Sampling Data (All)")
_NOT_ISSUED = ("Warp Stall Sampling (Not-issued Samples)", "Warp Stall Sampling (Not Issued)",
               "Sampling Data (Not Issued)")
_REASON_PREFIXES = ("smsp__pcsamp_warps_issue_stalled_", "stall_")


def parse_source(text: str) -> dict:
    """The SASS rows of a source page (``--page source --csv --print-source sass``) by kernel: ``{kernel: [{"address",
    "sass", "samples", "not_issued", "reasons": {reason: samples}}]}``. A kernel's block starts with a
    ``"Kernel Name","<name>"`` row, then a header (``Address``, ``Source``, the sampling columns, one column a stall
    reason)."""
    kernels: dict = {}
    kernel, header = "", None
    for row in _csv_rows(text):
        if row and row[0] == "Kernel Name":
            kernel, header = (row[1] if len(row) > 1 else ""), None
            kernels.setdefault(kernel, [])
            continue
        if row and row[0].lstrip("# ") == "Address" and "Source" in row:
            header = row
            continue
        if header is None or len(row) != len(header):
            continue
        cells = dict(zip(header, row))
        reasons = {}
        for name, cell in cells.items():
            prefix = next((p for p in _REASON_PREFIXES if name.startswith(p)), None)
            if prefix and not name.endswith("not_issued") and number(cell):
                reasons[name[len(prefix):]] = number(cell)
        samples = next((number(cells[c]) for c in _SAMPLES if c in cells), None)
        not_issued = next((number(cells[c]) for c in _NOT_ISSUED if c in cells), None)
        address = cells.get("Address", cells.get("# Address", ""))
        kernels.setdefault(kernel, []).append({"address": address.strip(), "sass": cells.get("Source", "").strip(),
                                               "samples": samples, "not_issued": not_issued, "reasons": reasons})
    return kernels


# ---------------------------------------------------------------- what a kernel's metrics say

_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
_STALL_LATENCY = re.compile(r"smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio")
_PIPE = re.compile(r"sm__(?:inst_executed_pipe_(\w+)|pipe_(\w+?)_cycles_active)\.avg\.pct_of_peak_sustained_active")
TENSOR_PIPE = ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active")
XU_PIPE = ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
           "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active")
ISSUE_ACTIVE = ("smsp__issue_active.avg.pct_of_peak_sustained_active",
                "sm__inst_issued.avg.pct_of_peak_sustained_active")
# Warp cycles per issued instruction: its 2025.4+ ID, then the older one.
CYCLES_PER_ISSUE = ("smsp__average_warp_latency_per_inst_issued.ratio",
                    "smsp__average_warps_active_per_issue_active.ratio")
DRAM_PCT = ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed")
SM_CLOCK = ("sm__cycles_elapsed.avg.per_second", "smsp__cycles_elapsed.avg.per_second",
            "gpc__cycles_elapsed.avg.per_second")


def pick(metrics: dict, *names: str) -> float | None:
    """The value of the first of ``names`` with a number."""
    for name in names:
        value = metrics.get(name, (None, ""))[0]
        if isinstance(value, float):
            return value
    return None


def stalls(metrics: dict) -> dict:
    """``{reason: cycles per issued instruction}`` of the WarpStateStats breakdown (``selected`` included)."""
    found = {}
    for pattern in (_STALL, _STALL_LATENCY):
        for name, (value, _) in metrics.items():
            match = pattern.fullmatch(name)
            if match and isinstance(value, float) and "not_issued" not in name:
                found.setdefault(match.group(1), value)
        if found:
            break
    return found


def pipes(metrics: dict) -> dict:
    """``{pipe: % of peak}``, the busiest reading of each pipe (instructions issued to it or its active cycles)."""
    found: dict = {}
    for name, (value, _) in metrics.items():
        match = _PIPE.fullmatch(name)
        if match and isinstance(value, float):
            pipe = match.group(1) or match.group(2)
            found[pipe] = max(value, found.get(pipe, value))
    return dict(sorted(found.items(), key=lambda item: -item[1]))


def summarize(kernel: dict) -> dict:
    """The numbers the table prints, from one kernel's metrics (None where ncu did not collect one)."""
    m = kernel["metrics"]
    duration_s = pick(m, "gpu__time_duration.sum", "gpu__time_duration.avg")
    cycles = stalls(m)
    cpi = pick(m, *CYCLES_PER_ISSUE) or (sum(cycles.values()) or None)
    ranked = sorted(((r, c) for r, c in cycles.items() if r != "selected"), key=lambda item: -item[1])
    pipe_use = pipes(m)
    tensor = pick(m, *TENSOR_PIPE)
    if tensor is None:
        tensor = max((v for p, v in pipe_use.items() if "tensor" in p), default=None)
    issue = pick(m, *ISSUE_ACTIVE)
    per_cycle = pick(m, "smsp__issue_active.avg.per_cycle_active")
    if issue is None and per_cycle is not None:
        issue = 100 * per_cycle
    clock = pick(m, *SM_CLOCK)
    dram = pick(m, "dram__bytes.sum.per_second")
    return {
        "kernel": kernel["kernel"],
        "duration_ms": None if duration_s is None else duration_s * 1e3,
        "sm_clock_ghz": None if clock is None else clock / 1e9,
        "tensor_pipe_pct": tensor,
        "xu_pipe_pct": pick(m, *XU_PIPE),
        "issue_active_pct": issue,
        "cycles_per_issue": cpi,
        "eligible_warps_per_scheduler": pick(m, "smsp__warps_eligible.avg.per_cycle_active"),
        "active_warps_per_scheduler": pick(m, "smsp__warps_active.avg.per_cycle_active"),
        "stalls": [{"reason": r, "cycles": c, "share": c / cpi if cpi else None} for r, c in ranked],
        "pipes_pct": pipe_use,
        "registers_per_thread": pick(m, "launch__registers_per_thread"),
        "achieved_occupancy_pct": pick(m, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        "theoretical_occupancy_pct": pick(m, "sm__maximum_warps_per_active_cycle_pct"),
        "dram_tbps": None if dram is None else dram / 1e12,
        "dram_pct": pick(m, *DRAM_PCT),
        "inst_executed": pick(m, "smsp__inst_executed.sum", "sm__inst_executed.sum"),
        "grid": kernel["launch"].get("Grid Size"),
        "block": kernel["launch"].get("Block Size"),
    }


# ---------------------------------------------------------------- tables


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1f}%"


def case_table(case: Case, kernels: list[dict]) -> str:
    """One column a kernel (the longest first, at most 4), one row a number."""
    shown = kernels[:4]
    headers = ["metric"] + [k["kernel"] if len(k["kernel"]) <= 32 else k["kernel"][:29] + "..." for k in shown]
    main = shown[0]

    def row(label, cell):
        return [label] + [cell(k) for k in shown]

    rate_label = "GB/s (K, V bytes)" if case.cache_bytes else "TFLOP/s"
    rate = (common.gbps(case.cache_bytes, main["duration_ms"]) if case.cache_bytes
            else common.tflops(case.flops, main["duration_ms"]))
    rows = [
        row("duration ms", lambda k: common.fmt(k["duration_ms"], 4)),
        [rate_label, common.fmt(rate, 1)] + ["-"] * (len(shown) - 1),
        row("SM clock GHz", lambda k: common.fmt(k["sm_clock_ghz"], 2)),
        row("tensor pipe", lambda k: _pct(k["tensor_pipe_pct"])),
        row("XU (MUFU) pipe", lambda k: _pct(k["xu_pipe_pct"])),
        row("issue slots busy", lambda k: _pct(k["issue_active_pct"])),
        row("warp cycles / issued inst", lambda k: common.fmt(k["cycles_per_issue"], 2)),
        row("eligible / active warps a scheduler", lambda k: f"{common.fmt(k['eligible_warps_per_scheduler'], 2)} / "
                                                            f"{common.fmt(k['active_warps_per_scheduler'], 2)}"),
    ]
    for i in range(TOP_STALLS):
        rows.append(row(f"stall {i + 1}", lambda k, i=i: _stall_cell(k["stalls"], i)))
    rows += [
        row("busiest pipes", lambda k: ", ".join(f"{p} {v:.0f}%" for p, v in list(k["pipes_pct"].items())[:3]) or "-"),
        row("registers / thread", lambda k: common.fmt(k["registers_per_thread"], 0)),
        row("occupancy achieved / theoretical", lambda k: f"{_pct(k['achieved_occupancy_pct'])} / "
                                                         f"{_pct(k['theoretical_occupancy_pct'])}"),
        row("DRAM TB/s (% of peak)", lambda k: f"{common.fmt(k['dram_tbps'], 2)} ({_pct(k['dram_pct'])})"),
        row("instructions executed (M)", lambda k: common.fmt(None if k["inst_executed"] is None
                                                              else k["inst_executed"] / 1e6, 1)),
        row("grid x block", lambda k: f"{k['grid']} x {k['block']}"),
    ]
    return common.markdown_table(headers, rows)


def _stall_cell(stalls_: list, i: int) -> str:
    if i >= len(stalls_):
        return "-"
    stall = stalls_[i]
    share = "-" if stall["share"] is None else f"{100 * stall['share']:.0f}%"
    return f"{stall['reason']} {share} ({stall['cycles']:.2f})"


def source_table(rows: list[dict]) -> str:
    """The :data:`TOP_SOURCE` SASS instructions with the most warp-state samples, with their top reasons."""
    total = sum(r["samples"] or 0 for r in rows) or 1
    hot = sorted((r for r in rows if r["samples"]), key=lambda r: -r["samples"])[:TOP_SOURCE]
    lines = []
    for r in hot:
        reasons = sorted(r["reasons"].items(), key=lambda item: -item[1])[:3]
        why = ", ".join(f"{name} {100 * n / r['samples']:.0f}%" for name, n in reasons) or "-"
        sass = r["sass"] if len(r["sass"]) <= 60 else r["sass"][:57] + "..."
        lines.append([r["address"], f"{100 * r['samples'] / total:.1f}%", common.fmt(r["not_issued"], 0), why, sass])
    return common.markdown_table(["address", "samples", "not issued", "top reasons", "SASS"], lines)


# ---------------------------------------------------------------- running ncu


class ProfileError(Exception):
    """ncu ran but produced nothing to read: the message is the reason, one line."""


def _run(cmd: list, timeout: int = 300) -> subprocess.CompletedProcess:
    """``cmd``'s exit status and output (undecodable bytes replaced), run in the repository root."""
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=ROOT)


def _reason(log: str) -> str:
    """What ncu's output says went wrong: its first error (or its no-kernel warning) and the child's last line
    (a Python error's message), in one line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    ncu = [line for line in lines if line.startswith("==ERROR==")] or [
        line for line in lines if "No kernels were profiled" in line]
    child = [line for line in lines if not line.startswith("==")][-1:]
    return " | ".join(ncu[:1] + child)[:400] or "no output"


def run_case(ncu: str, case: Case, stem: Path, args) -> dict:
    """Profile one case; its result (kernels longest first, their summaries and metrics, the source rows)."""
    report, meta, log_path = (Path(f"{stem}-{case.slug}{suffix}") for suffix in (".ncu-rep", ".meta.json", ".log"))
    cmd = profile_command(ncu, case, report, meta, warmup=args.warmup, source=args.source, kernel=args.kernel,
                          metrics=args.metrics)
    common.log(f"ncu_profile: profiling {case.describe()}:\n  {' '.join(cmd)}")
    try:
        done = _run(cmd, args.timeout)
        status, log = f"exit {done.returncode}", done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        status, log = "timed out", f"==ERROR== ncu ran past --timeout {args.timeout} s"
    log_path.write_text(log)
    if status != "exit 0" or not report.is_file():
        raise ProfileError(f"ncu {status}, no usable report: {_reason(log)} (log: {log_path})")
    raw = _run(import_command(ncu, report, "raw"))
    kernels = parse_raw(raw.stdout)
    if not kernels:
        raise ProfileError(f"the report's raw page holds no kernel: {_reason(raw.stdout + raw.stderr)}")
    summaries = [dict(summarize(k), metrics={name: value for name, (value, _) in k["metrics"].items()})
                 for k in kernels]
    if all(s["duration_ms"] is None for s in summaries):
        raise ProfileError("ncu wrote the kernels but no counter values (gpu__time_duration.sum is n/a): no access "
                           "to the GPU's performance counters?")
    summaries.sort(key=lambda s: -(s["duration_ms"] or 0.0))
    result = {"case": case.text, "describe": case.describe(), "shape": asdict(case), "flops": case.flops,
              "cache_bytes": case.cache_bytes, "report": report.name, "kernels": summaries,
              "child": json.loads(meta.read_text()) if meta.is_file() else {}}
    main = summaries[0]
    result["tflops"] = None if case.cache_bytes else common.tflops(case.flops, main["duration_ms"])
    result["gbps"] = common.gbps(case.cache_bytes, main["duration_ms"]) if case.cache_bytes else None
    if args.source:
        page = _run(import_command(ncu, report, "source"))
        blocks = parse_source(page.stdout)
        name = main["kernel"] if main["kernel"] in blocks else next(iter(blocks), main["kernel"])
        result["source"] = {name: blocks.get(name, [])}
    return result


def case_text(case: Case, result: dict) -> str:
    """A case's Markdown: what ran, the kernels' table and, with ``--source``, the hottest SASS instructions."""
    parts = [f"## {case.text}: {case.describe()}\n"]
    planned = result["child"].get("planned")
    if planned:
        parts.append(f"flashtile ran: {', '.join(planned)}")
    parts += [f"{len(result['kernels'])} kernel(s) profiled; TFLOP/s and GB/s are the longest kernel's. {WS_NOTE}.\n",
              case_table(case, result["kernels"])]
    for name, rows in result.get("source", {}).items():
        if not any(r["samples"] for r in rows):
            parts.append(f"\n(no warp-state samples on the source page of {name}: its columns were not recognised; "
                         f"read {result['report']} in Nsight Compute)")
            continue
        parts += [f"\nHottest SASS instructions of {name} (share of all samples; reasons: share of that "
                  "instruction's samples):\n", source_table(rows)]
    return "\n".join(parts) + "\n"


def unique_name(out: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... when a file under ``out`` holds it: a run never overwrites another's
    reports."""
    n, unique = 1, name
    while any(out.glob(f"*{unique}*")):
        n += 1
        unique = f"{name}-{n}"
    return unique


def ncu_version(ncu: str) -> str:
    try:
        out = _run([ncu, "--version"], 60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    # "Version 2025.3.1.0 (build 36273991) (public-release)" under the banner lines.
    return next((line for line in lines if line.startswith("Version")), lines[-1] if lines else "unknown")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", metavar="CASE", help="KIND:dD:N[:causal] or decode[-fp8]:BxL")
    parser.add_argument("--out", default=common.DEFAULT_OUT, help="where the JSON, reports and logs go")
    parser.add_argument("--source", action="store_true",
                        help="also sample warp states at every SASS instruction; print the 20 hottest")
    parser.add_argument("--kernel", help="profile only the kernels whose names match this regex")
    parser.add_argument("--metrics", help="more metric IDs to collect, comma-separated (kept in the JSON; a name "
                                          "this ncu does not know fails the run: `ncu --query-metrics` lists them)")
    parser.add_argument("--warmup", type=int, default=3, help="calls before the profiled one")
    parser.add_argument("--timeout", type=int, default=600, help="seconds for one case's ncu run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--meta", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        cases = [parse_case(text) for text in args.cases]
    except ValueError as error:
        parser.error(str(error))
    if args.child:
        run_child(cases[0], args.warmup, Path(args.meta))
        return 0
    ncu = find_ncu()
    if ncu is None:
        print("ncu_profile: ncu not found ($NCU, PATH, $CUDA_HOME/bin, /usr/local/cuda-*/bin, "
              "/opt/nvidia/nsight-compute/*): install Nsight Compute or set NCU", file=sys.stderr)
        return 1
    env = {**common.base_env(), "ncu": ncu_version(ncu), "ncu_path": ncu, "sections": list(SECTIONS),
           "clock_control": "none", "source": args.source, "kernel_filter": args.kernel, "note": WS_NOTE}
    commit = (env["git_commit"] or "nocommit")[:7]
    out = Path(args.out).resolve()  # the child runs in the repository root: its paths must not be relative
    out.mkdir(parents=True, exist_ok=True)
    stem = out / unique_name(out, f"ncu-{env['date']}-{commit}")
    results, failures, texts, path = [], [], [], None
    for case in cases:
        try:
            results.append(run_case(ncu, case, stem, args))
            texts.append(case_text(case, results[-1]))
            print("\n" + texts[-1], flush=True)
        except ProfileError as error:
            failures.append({"case": case.text, "error": str(error)})
            texts.append(f"## {case.text}: FAILED\n\n{error}\n")
            print(f"ncu_profile: {case.text}: {error}", file=sys.stderr)
            if not results:
                # Nothing worked yet: a missing counter access fails every case alike.
                return 1
        # Written after every case: a run stopped by a time limit keeps the cases done.
        gpu = results[0]["child"].get("gpu", "unknown GPU")
        path = stem.with_name(f"{common.gpu_slug(gpu)}-{stem.name}.json")
        common.write_json(path, {"meta": {**env, "gpu": gpu}, "cases": results, "failures": failures})
        title = f"# ncu profile: {gpu}, {env['ncu']}, commit {commit}, {env['date']}\n\n"
        path.with_suffix(".md").write_text(title + "\n".join(texts))
    print(f"\nwrote {path} and {path.with_suffix('.md').name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
