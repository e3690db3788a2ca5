#!/usr/bin/env bash
# Run the benchmark: bash scripts/bench.sh [python -m flashtile bench args...]
#
# The benchmark suite (flashtile/bench/suite.py). On a CUDA GPU: dense attention (forward, backward,
# forward+backward) vs torch SDPA (flash, cuDNN, efficient, math), FlexAttention, flash-attn when
# installed and naive attention; the variants (window, varlen, softcap); decode over KV caches; and
# end to end with transformers. Writes ./flashtile-results/<gpu>-suite-<grid>-<date>T<time>Z.{json,md}
# and PNG plots (--out DIR elsewhere; never overwrites). On a CPU-only machine: the tiled CPU backend vs naive attention and torch SDPA,
# saying that the GPU rows were skipped. --quick is the default; see --help.
# Environment set-up (the .venv with pinned torch/triton/numpy, FLASHTILE_NO_VENV, ...) is
# the one of scripts/test.sh; see its header.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/test.sh"
flashtile_setup_python matplotlib "transformers==5.17.0"
cd "$FLASHTILE_ROOT"
exec "$FLASHTILE_PY" -m flashtile bench "$@"
