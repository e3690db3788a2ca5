#!/usr/bin/env bash
# The whole test suite on a CUDA GPU: bash scripts/gpu_tests.sh [--part I/N] [pytest args...]
#
# Every file in tests/ runs with the GPU as the device (the Gluon kernels' tests on sm_90 only), across
# FLASHTILE_GPU_WORKERS pytest-xdist workers (default 16 a GPU, at most one a core: the kernels' compiles are
# CPU-bound). On a machine of several GPUs each worker takes one of them, round robin (tests/conftest.py reads
# FLASHTILE_GPUS, set here), so the suite's worker-seconds spread over all of them; tests that need several GPUs
# see one each and skip (run them on their own: pytest tests/test_distributed.py -k cuda).
# --part I/N runs the I-th of N slices of the test files (weighed below); the slices together are the whole suite.
# On one H200 the suite is about 13300 worker-seconds (~1100 s in three slices, --part I/3, each under a call's
# 10-minute limit); a 2-GPU machine halves the wall time, a 4-GPU one quarters it. FLASHTILE_FAILURE_LOG=path
# records each failure as it happens.
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
# worker-seconds each took on an H200 with 16 workers at 3784a1a (fp8, bwd_sm90, varlen, kvcache* at c55a40a; fuzz,
# attention, variants, benchmark_tools, bwd_split, docs, nn, fastlaunch from 3346a9c with 14); paths and bench_variants
# are estimates after their cuts (paths: 5158 measured, less 52 float32 cases of ~49 s for 16 of ~35 s). A file not
# listed weighs 30. About 13300 worker-seconds in all: three slices of ~4400 (5-6 minutes of wall time each); two of
# ~6600 (~8 minutes each) fit a call's 10 minutes on the estimate, unmeasured.
weights="paths 3020 fwd_sm90 2169 bwd_one_pass 1552 fuzz 1352 attention 947 fp8 568 bwd_sm90 510 variants 407
cli 394 replay 272 varlen 228 fwd_fp8_sm90 181 compile 177 sdpa 164 transformers 155 benchmark_tools 131
bwd_split 116 reliability 115 kvcache_kernels 99 docs 87 kvcache 81 bwd_tiles 74 nn 70 fastlaunch 58 grid 42
bench_variants 30 torch_backend 23 configs_golden 18 distributed 5 bwd_preprocess 1 bench_validate 1 validation 1
bench_results 1 racecheck_report 1 env 1"
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
# Compiled kernels go to a git-ignored folder of the checkout, which stays on a warm device machine between calls: the
# next slice reuses what this one compiled (Triton keys its cache by the kernel's source, constants and compiler).
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton-cache}"
# One CPU thread a worker: the workers already fill the cores, and 64 workers of 64 torch threads each drove the load
# average past 1400 on a 64-core 4-GPU host (a quarter of the suite in 570 s; 16 workers on 16 cores hid it).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
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
