#!/usr/bin/env bash
# The whole test suite on CUDA GPUs: bash scripts/gpu_tests.sh [--part I/N] [pytest args...]
#
# Every file in tests/ runs with the GPU as the device (the Gluon kernels' tests on sm_90 only), in pytest-xdist
# workers: FLASHTILE_GPU_WORKERS a GPU (default 16, at most the cores a GPU has; the kernels' compiles are CPU-bound).
# On a machine of several GPUs the files are dealt out to the GPUs and each GPU runs its own pytest, its own workers
# and CUDA_VISIBLE_DEVICES set to it: one pytest of 64 workers over 4 H200s (each worker given a GPU) ran ten times
# slower than 16 workers on one, its workers idle (a quarter of the suite in 570 s). Tests that need several GPUs
# skip here; run them on their own: pytest tests/test_distributed.py -k cuda.
# --part I/N runs the I-th of N slices of the test files (weighed below); the slices together are the whole suite.
# On one H200 the suite is about 13300 worker-seconds (~1100 s in three slices, --part I/3, each under a call's
# 10-minute limit).
# FLASHTILE_SUITE_DEADLINE=seconds interrupts each pytest then (SIGINT: it still writes its JUnit file and summary).
# Each test stops after FLASHTILE_TEST_TIMEOUT seconds (default 420, where pytest-timeout is installed) with every
# thread's stack in the log. $OUT/progress-*.txt has a line as each test starts and ends (what hung, what took long);
# FLASHTILE_FAILURE_LOG=path records each failure as it happens.
# The python that has torch with CUDA is used as it is (FLASHTILE_NO_VENV=1). The logs and JUnit files go to
# $OUT (or ./flashtile-results); the last line is the summary: "GPU suite [part I/N] at <commit> on <GPU>: ...".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part="1/1"
if [[ "${1:-}" == "--part" ]]; then part="$2"; shift 2; fi
index="${part%/*}"; count="${part#*/}"
out="${OUT:-flashtile-results}"
mkdir -p "$out"
# --part I/N: the files are dealt out heaviest first, each to the slice with the least weight so far, by the
# worker-seconds each took on an H200 with 16 workers at 3784a1a (fp8, bwd_sm90, varlen, kvcache* at c55a40a; fuzz,
# attention, variants, benchmark_tools, bwd_split, docs, nn, fastlaunch from 3346a9c with 14); paths and bench_variants
# are estimates after their cuts (paths: 5158 measured, less 52 float32 cases of ~49 s for 16 of ~35 s). A file not
# listed weighs 30. About 13300 worker-seconds in all. The same dealing splits a slice over the GPUs.
weights="paths 3020 fwd_sm90 2169 bwd_one_pass 1552 fuzz 1352 attention 947 fp8 568 bwd_sm90 510 variants 407
cli 394 replay 272 varlen 228 fwd_fp8_sm90 181 compile 177 sdpa 164 transformers 155 benchmark_tools 131
bwd_split 116 reliability 115 kvcache_kernels 99 docs 87 kvcache 81 bwd_tiles 74 nn 70 fastlaunch 58 grid 42
bench_variants 30 torch_backend 23 configs_golden 18 distributed 5 bwd_preprocess 1 bench_validate 1 validation 1
bench_results 1 racecheck_report 1 env 1"

# deal I N FILE...: the files of the I-th of N slices.
deal() {
  python3 - "$@" $weights <<'PY'
import sys
index, count = int(sys.argv[1]), int(sys.argv[2])
args = sys.argv[3:]
files = [a for a in args if a.startswith("tests/")]
pairs = args[len(files):]
weight = {f"tests/test_{name}.py": float(w) for name, w in zip(pairs[::2], pairs[1::2])}
load, mine = [0.0] * count, []
for f in sorted(files, key=lambda f: (-weight.get(f, 30), f)):
    part = load.index(min(load))
    load[part] += weight.get(f, 30)
    if part == index - 1:
        mine.append(f)
print("\n".join(mine))
PY
}
# FLASHTILE_GPU_TESTS="tests/a.py tests/b.py" runs those files instead of all.
if [[ -n "${FLASHTILE_GPU_TESTS:-}" ]]; then
  mapfile -t selected < <(printf "%s\n" $FLASHTILE_GPU_TESTS)
else
  mapfile -t selected < <(deal "$index" "$count" tests/test_*.py)
fi
# FLASHTILE_COMMIT names the commit when the checkout's git does not (a copied tree).
commit="${FLASHTILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
gpu="$(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo "no GPU")"
gpus="$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)"
IFS=, read -r -a ids <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}"
per_gpu=$(( $(nproc) / gpus )); (( per_gpu < 1 )) && per_gpu=1
workers="${FLASHTILE_GPU_WORKERS:-$(( per_gpu < 16 ? per_gpu : 16 ))}"
[[ "$gpus" -gt 1 ]] && gpu="$gpus x $gpu"
# Compiled kernels go to a git-ignored folder of the checkout, which stays on a warm device machine between calls: the
# next slice reuses what this one compiled (Triton keys its cache by the kernel's source, constants and compiler).
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton-cache}"
# One CPU thread a worker: the workers already fill the cores (64 workers of 64 torch threads each drove a 4-GPU
# host's load average past 1400).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
limit=()
[[ -n "${FLASHTILE_SUITE_DEADLINE:-}" ]] && limit=(timeout -s INT -k 60 "$FLASHTILE_SUITE_DEADLINE")
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout="${FLASHTILE_TEST_TIMEOUT:-420}" --timeout-method=thread)
name="gpu-tests-${index}of${count}"
pids=(); names=()
for ((g = 0; g < gpus; g++)); do
  mapfile -t files < <(deal $((g + 1)) "$gpus" "${selected[@]}")
  [[ ${#files[@]} -eq 0 || -z "${files[0]}" ]] && continue
  tag="$name"; [[ "$gpus" -gt 1 ]] && tag="$name-gpu$g"
  CUDA_VISIBLE_DEVICES="${ids[$g]}" FLASHTILE_GPU_SUITE=1 FLASHTILE_NO_VENV=1 \
    FLASHTILE_PROGRESS_LOG="$out/progress-$tag.txt" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "${limit[@]}" python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup "${per_test[@]}" \
    --junitxml="$out/$tag.xml" "${files[@]}" "$@" > "$out/$tag.log" 2>&1 &
  pids+=($!); names+=("$tag")
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  (( rc != 0 )) && status=$rc
  echo "${names[$i]}: exit $rc, $(tail -1 "$out/${names[$i]}.log")"
done
# The counts from the JUnit files (a pytest interrupted by the deadline still writes its own).
summary="$(python3 - "${names[@]/#/$out/}" <<'PY' 2>/dev/null
import os, sys, xml.etree.ElementTree as ET
counts = {"passed": 0, "failed": 0, "skipped": 0}
missing = 0
for stem in sys.argv[1:]:
    if not os.path.exists(stem + ".xml"):
        missing += 1
        continue
    for case in ET.parse(stem + ".xml").iter("testcase"):
        tags = {child.tag for child in case}
        counts["failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"] += 1
print(", ".join(f"{n} {name}" for name, n in counts.items()) + (f", {missing} pytest runs without a JUnit file" if missing else ""))
PY
)"
[[ "$status" -eq 124 || "$status" -eq 130 ]] && summary="$summary (cut off by FLASHTILE_SUITE_DEADLINE)"
echo "GPU suite part $part at $commit on $gpu: ${summary:-no summary (exit $status)}"
exit "$status"
