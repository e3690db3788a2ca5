#!/usr/bin/env bash
# The whole test suite on a CUDA GPU: bash scripts/gpu_tests.sh [--part I/N] [pytest args...]
#
# Every file in tests/ runs with the GPU as the device (the Gluon kernels' tests on sm_90 only), across
# FLASHTILE_GPU_WORKERS pytest-xdist workers (default 16 a GPU, at most one a core: the kernels' compiles are
# CPU-bound). On a machine of several GPUs each worker takes one of them, round robin (tests/conftest.py reads
# FLASHTILE_GPUS, set here), so the suite's worker-seconds spread over all of them; tests that need several GPUs
# see one each and skip (run them on their own: pytest tests/test_distributed.py -k cuda).
# --part I/N runs the I-th of N slices of the test files (weighed below); the slices together are the whole suite.
# On a fresh H200 at 3346a9c, four slices by file took about 1250 s in all; plan the device budget with --part I/3
# (each slice under a call's 10-minute limit). FLASHTILE_FAILURE_LOG=path records each failure as it happens.
# The python that has torch with CUDA is used as it is (FLASHTILE_NO_VENV=1). The log and a JUnit file go to
# $OUT (or ./flashtile-results); the last line is the summary: "GPU suite [part I/N] at <commit> on <GPU>: ...".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part="1/1"
if [[ "${1:-}" == "--part" ]]; then part="$2"; shift 2; fi
index="${part%/*}"; count="${part#*/}"
out="${OUT:-flashtile-results}"
mkdir -p "$out"
# FLASHTILE_GPU_TESTS="tests/a.py tests/b.py" runs those files instead of all.
# --part I/N: the files are dealt out heaviest first, each to the slice with the least weight so far, by the
# worker-seconds each took on an H200 at 3346a9c (2026-11-27, 14 workers; the gloo cases of test_distributed left to
# CI); a file not listed weighs 30. Three slices take about 4000 worker-seconds each, 5-7 minutes of wall time.
weights="paths 4167 fwd_sm90 1716 fuzz 1352 attention 947 bwd_one_pass 568 bench_variants 429 variants 407
bwd_sm90 366 cli 339 fp8 238 distributed 120 varlen 189 kvcache 164 sdpa 149 benchmark_tools 131 bwd_split 116
compile 110 replay 91 docs 87 nn 70 transformers 68 fwd_fp8_sm90 61 fastlaunch 58 reliability 47 kvcache_kernels 47"
mapfile -t selected < <(if [[ -n "${FLASHTILE_GPU_TESTS:-}" ]]; then printf "%s\n" $FLASHTILE_GPU_TESTS; else
  python3 - "$index" "$count" $weights <<'PY'
import pathlib, sys
index, count, pairs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
weight = {f"tests/test_{name}.py": float(w) for name, w in zip(pairs[::2], pairs[1::2])}
files = sorted((str(p) for p in pathlib.Path("tests").glob("test_*.py")), key=lambda f: (-weight.get(f, 30), f))
load, mine = [0.0] * count, []
for f in files:
    part = load.index(min(load))
    load[part] += weight.get(f, 30)
    if part == index - 1:
        mine.append(f)
print("\n".join(mine))
PY
fi)
# FLASHTILE_COMMIT names the commit when the checkout's git does not (a copied tree).
commit="${FLASHTILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
gpu="$(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo "no GPU")"
gpus="$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)"
workers="${FLASHTILE_GPU_WORKERS:-$(( $(nproc) < 16 * gpus ? $(nproc) : 16 * gpus ))}"
[[ "$gpus" -gt 1 ]] && gpu="$gpus x $gpu"
FLASHTILE_GPU_SUITE=1 FLASHTILE_GPUS="$gpus" FLASHTILE_NO_VENV=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup \
  --junitxml="$out/gpu-tests-${index}of${count}.xml" "${selected[@]}" "$@" \
  2>&1 | tee "$out/gpu-tests-${index}of${count}.log"
status=${PIPESTATUS[0]}
# The counts from the JUnit file (pytest's own summary line is gone under -qq).
summary="$(python3 - "$out/gpu-tests-${index}of${count}.xml" <<'PY' 2>/dev/null
import sys, xml.etree.ElementTree as ET
counts = {"passed": 0, "failed": 0, "skipped": 0}
for case in ET.parse(sys.argv[1]).iter("testcase"):
    tags = {child.tag for child in case}
    counts["failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"] += 1
print(", ".join(f"{n} {name}" for name, n in counts.items()))
PY
)"
echo "GPU suite part $part at $commit on $gpu: ${summary:-no summary (exit $status)}"
exit "$status"
