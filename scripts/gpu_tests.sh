#!/usr/bin/env bash
# The whole test suite on a CUDA GPU: bash scripts/gpu_tests.sh [--part I/N] [pytest args...]
#
# Every file in tests/ runs with the GPU as the device (the Gluon kernels' tests on sm_90 only), across
# FLASHTILE_GPU_WORKERS pytest-xdist workers (default 14 of a 16-core machine: the kernels' compiles are CPU-bound).
# --part I/N runs the I-th of N slices of the test files; the slices together are the whole suite. On a fresh H200
# (2026-11-27, 14 workers, at 3346a9c) --part I/4 took 498, 223 and 192 s for parts 1-3 and over 245 s for part 4
# (about 340 s at 7e2cf2c): about 1250 s in all, so plan the device budget for it; each part stays under a call's
# 10-minute limit. FLASHTILE_FAILURE_LOG=path records each failure as it happens.
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
# The heaviest files first (worker-seconds on an H200, 2026-11-27: paths 3911, fwd_sm90 1398, fuzz 810 at 100 cases,
# attention 760, bwd_one_pass 474, variants 471, bwd_sm90 360), so that the slices below share them out.
heavy="tests/test_paths.py tests/test_fwd_sm90.py tests/test_fuzz.py tests/test_attention.py tests/test_bwd_one_pass.py
tests/test_variants.py tests/test_bwd_sm90.py tests/test_fp8.py tests/test_varlen.py tests/test_fwd_fp8_sm90.py"
mapfile -t files < <(if [[ -n "${FLASHTILE_GPU_TESTS:-}" ]]; then printf "%s\n" $FLASHTILE_GPU_TESTS; else
  printf "%s\n" $heavy; ls tests/test_*.py | sort | grep -vxF -f <(printf "%s\n" $heavy); fi)
selected=()
for i in "${!files[@]}"; do
  if (( i % count == index - 1 )); then selected+=("${files[$i]}"); fi
done
# FLASHTILE_COMMIT names the commit when the checkout's git does not (a copied tree).
commit="${FLASHTILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
gpu="$(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo "no GPU")"
FLASHTILE_NO_VENV=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider \
  -n "${FLASHTILE_GPU_WORKERS:-14}" --dist loadgroup --junitxml="$out/gpu-tests-${index}of${count}.xml" "${selected[@]}" "$@" \
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
