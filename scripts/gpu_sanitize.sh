#!/usr/bin/env bash
# Run flashtile's kernels under NVIDIA compute-sanitizer (GPU only; about 3-4 minutes on an H100):
#
#   bash scripts/gpu_sanitize.sh
#
# 1. scripts/sanitize_launches.py once as it is: compiles every kernel (Triton's disk cache keeps them for the
#    sanitized runs) and checks that each family ran and that bad index values were recorded.
# 2. memcheck over the same launches (fwd, bwd, one-pass bwd, decode/split/combine, append, tail, Gluon and Triton,
#    and the calls with bad index values), with PyTorch's caching allocator off so that each tensor is its own
#    allocation and a read or write past one is seen.
# 3. racecheck (shared-memory hazards) over the warp-specialized kernels: the one-pass backward and the forward;
#    scripts/racecheck_report.py sorts its reports into the two kinds docs/reliability.md explains (mbarrier-ordered
#    hand-overs racecheck does not follow, Triton's warp_specialize dispatch) and the unexplained rest.
#
# Prints one line: "gpu_sanitize: memcheck N errors, racecheck N hazards (by kind), driver ok|FAILED". Exit 0 only
# when memcheck found nothing, no racecheck hazard is unexplained and the driver passed. Environment: PYTHON
# (default python3), SANITIZER (default compute-sanitizer, else the one in $CUDA_HOME/bin), FLASHTILE_SANITIZE_LOG
# (default /tmp/flashtile-sanitize).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SANITIZER="${SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}"
LOG="${FLASHTILE_SANITIZE_LOG:-/tmp/flashtile-sanitize}"
mkdir -p "$LOG"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
DRIVER="$ROOT/scripts/sanitize_launches.py"

"$PY" "$DRIVER" all > "$LOG/plain.txt" 2>&1
driver=$?
cat "$LOG/plain.txt"

export PYTORCH_NO_CUDA_MEMORY_CACHING=1
# API errors that torch and Triton make on purpose (probing) are not memory errors: leave them out of the count.
"$SANITIZER" --tool memcheck --report-api-errors no --print-limit 20 "$PY" "$DRIVER" all > "$LOG/memcheck.txt" 2>&1
memcheck_rc=$?
"$SANITIZER" --tool racecheck --print-limit 200 "$PY" "$DRIVER" ws \
    > "$LOG/racecheck.txt" 2>&1
racecheck_rc=$?

memcheck=$(grep -o 'ERROR SUMMARY: [0-9]* error' "$LOG/memcheck.txt" | grep -o '[0-9]*' | tail -1)
hazards=$(grep -o 'RACECHECK SUMMARY: [0-9]* hazard' "$LOG/racecheck.txt" | grep -o '[0-9]*' | tail -1)
kinds=$("$PY" "$ROOT/scripts/racecheck_report.py" "$LOG/racecheck.txt")
kinds_rc=$?
ok=1
[[ $driver -eq 0 && $memcheck_rc -eq 0 && $racecheck_rc -eq 0 && $kinds_rc -eq 0 ]] || ok=0
[[ "${memcheck:-x}" == 0 && -n "${hazards:-}" ]] || ok=0
echo "gpu_sanitize: memcheck ${memcheck:-?} errors, racecheck ${hazards:-?} hazards (${kinds#racecheck_report: })," \
     "driver $([[ $driver -eq 0 ]] && echo ok || echo FAILED) (exit codes: driver $driver, memcheck $memcheck_rc," \
     "racecheck $racecheck_rc; logs in $LOG)"
[[ $ok -eq 1 ]]
