#!/usr/bin/env bash
# Run the test suite: bash scripts/test.sh [pytest args...]
# The default grid takes about 10 minutes on 2 CPU cores; FLASHTILE_TESTS=all (below) runs every grid point.
#
# Sets up .venv in the repo root on first use (reused after), with the pinned dev stack:
# torch==2.13.0, triton==3.6.0, numpy<2.4, pytest, pytest-xdist, transformers==5.17.0 (the H200's version,
# for tests/test_transformers.py), matplotlib (the bench suite's plots), and flashtile installed editable. Without a CUDA GPU the Triton kernels run under TRITON_INTERPRET=1.
#
# Environment:
#   FLASHTILE_NO_VENV=1  use the current python as it is (e.g. a GPU machine whose python
#                        already has torch and triton); flashtile is put on PYTHONPATH.
#   FLASHTILE_NO_VENV=0  always use .venv. Unset: the current python when its torch sees a
#                        CUDA GPU, else .venv.
#   FLASHTILE_VENV=DIR   the virtualenv's place (default: <repo>/.venv).
#   PYTHON=python3.X     the interpreter that creates the virtualenv (default: python3).
#   FLASHTILE_TEST_WORKERS=N  pytest-xdist workers (default: 2 when there are 2+ cores; 0 = off).
#   FLASHTILE_TESTS=all  every point of every test grid. By default a covering set of each big grid runs (every
#                        feature, length, head dim and dtype on both backends; tests/conftest.py); the points
#                        it leaves out are marked exhaustive: FLASHTILE_TESTS=all bash scripts/test.sh -m exhaustive
#
# scripts/bench.sh sources this file for flashtile_setup_python; sourcing runs no tests.
set -euo pipefail

FLASHTILE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLASHTILE_PINS=("torch==2.13.0" "triton==3.6.0" "numpy<2.4")

# Sets FLASHTILE_PY to a python that can import flashtile; extra pip requirements as arguments.
flashtile_setup_python() {
  local base_python="${PYTHON:-python3}"
  local no_venv="${FLASHTILE_NO_VENV:-}"
  if [[ -z "$no_venv" ]]; then
    no_venv=0
    if "$base_python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
      echo "flashtile: $base_python already has torch with a CUDA GPU; using it (FLASHTILE_NO_VENV=0 forces .venv)" >&2
      no_venv=1
    fi
  fi
  if [[ "$no_venv" == 1 ]]; then
    FLASHTILE_PY="$(command -v "$base_python")"
    export PYTHONPATH="$FLASHTILE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    return
  fi

  local venv="${FLASHTILE_VENV:-$FLASHTILE_ROOT/.venv}"
  if [[ -e "$venv" ]] && ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "flashtile: $venv exists but its python does not run; recreating it" >&2
    rm -rf "$venv"
  fi
  if [[ ! -e "$venv" ]]; then
    echo "flashtile: creating $venv with $base_python" >&2
    if ! "$base_python" -m venv "$venv"; then
      echo "flashtile: '$base_python -m venv' failed; install the venv module (e.g. apt-get install python3-venv)" \
           "or set FLASHTILE_NO_VENV=1 to use a python that already has torch" >&2
      return 1
    fi
  fi
  FLASHTILE_PY="$venv/bin/python"
  # Skip pip when this exact set of requirements was installed into this venv before.
  local stamp="$venv/.flashtile-installed" want
  want="${FLASHTILE_PINS[*]} $* | $FLASHTILE_ROOT | $(cksum < "$FLASHTILE_ROOT/pyproject.toml")"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    return
  fi
  # Pinned together so pip never upgrades torch to a default (CUDA) wheel of gigabytes.
  echo "flashtile: installing ${FLASHTILE_PINS[*]}${*:+ $*} and flashtile (editable) into $venv;" \
       "pip is quiet and this takes a couple of minutes on first use" >&2
  "$FLASHTILE_PY" -m pip install --quiet --disable-pip-version-check "${FLASHTILE_PINS[@]}" "$@"
  "$FLASHTILE_PY" -m pip install --quiet --disable-pip-version-check --no-deps -e "$FLASHTILE_ROOT"
  printf '%s' "$want" > "$stamp"
}

flashtile_run_tests() {
  flashtile_setup_python pytest pytest-xdist "transformers==5.17.0" matplotlib
  cd "$FLASHTILE_ROOT"
  if ! "$FLASHTILE_PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    export TRITON_INTERPRET=1  # no CUDA GPU: the Triton kernels run in Triton's interpreter
  fi
  local workers="${FLASHTILE_TEST_WORKERS:-}"
  if [[ -z "$workers" ]]; then
    workers=0
    if [[ "$(nproc 2>/dev/null || echo 1)" -ge 2 ]]; then workers=2; fi
  fi
  # One BLAS thread per xdist worker: more only add system time. (Set after nproc, which honours it.)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  local xdist=()
  if [[ "$workers" != 0 ]] && "$FLASHTILE_PY" -c 'import xdist' >/dev/null 2>&1; then
    xdist=(-n "$workers")
  fi
  local grid="the default grid (FLASHTILE_TESTS=all: every point)"
  if [[ "${FLASHTILE_TESTS:-}" == all ]]; then grid="FLASHTILE_TESTS=all: every grid point"; fi
  echo "flashtile: $("$FLASHTILE_PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')," \
       "TRITON_INTERPRET=${TRITON_INTERPRET:-0}, pytest ${xdist[*]:-(no xdist)}, $grid" >&2
  exec "$FLASHTILE_PY" -m pytest -q ${xdist[@]+"${xdist[@]}"} tests "$@"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  flashtile_run_tests "$@"
fi
