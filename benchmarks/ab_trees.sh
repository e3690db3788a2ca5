#!/bin/bash
# Interleaved A/B of one benchmark script on two flashtile trees: the package of an earlier commit against
# the working tree, ROUNDS rounds (default 2) of base then new; arguments after ROUNDS go to the script.
# Each run's JSON lands in $OUT/<tree><round>/.
#
#   git archive <commit> flashtile | tar -x -C /tmp/base      # the base tree
#   bash benchmarks/ab_trees.sh /tmp/base benchmarks/dense_decode.py
#   bash benchmarks/ab_trees.sh /tmp/base benchmarks/host_time.py 3 --only varlen
set -euo pipefail
base=$(cd "$1" && pwd); script=$2; rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
export FLASHTILE_NO_VENV=1
for round in $(seq 1 "$rounds"); do
  for tree in base new; do
    root=$PWD; [ "$tree" = base ] && root=$base
    dir=${OUT:-/tmp}/$tree$round; mkdir -p "$dir"
    echo "== round $round $tree"
    OUT=$dir PYTHONPATH=$root:$PWD/benchmarks FLASHTILE_GIT_COMMIT=${FLASHTILE_GIT_COMMIT:-}$tree \
      timeout 300 python "$script" "$@" 2>&1 | tail -8
  done
done
