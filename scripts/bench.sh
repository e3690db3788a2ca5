#!/usr/bin/env bash
# Run the benchmark: bash scripts/bench.sh [python -m flashtile bench args...]
#
# On a CUDA GPU: flashtile vs torch SDPA (flash, cuDNN, efficient) and FlexAttention, forward
# and backward, written to benchmarks/results/<gpu>-<date>.json. On a CPU-only machine: the
# tiled CPU backend vs naive attention and torch SDPA, written to benchmarks/results/cpu-<date>.json.
# Environment set-up (the .venv with pinned torch/triton/numpy, FLASHTILE_NO_VENV, ...) is
# the one of scripts/test.sh; see its header.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/test.sh"
flashtile_setup_python
cd "$FLASHTILE_ROOT"
exec "$FLASHTILE_PY" -m flashtile bench "$@"
