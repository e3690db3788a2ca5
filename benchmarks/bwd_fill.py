"""Backward on shapes that leave the GPU under-filled: few KV heads per GPU (GQA, tensor-parallel
shards of Llama-3-8B / 70B) and short batches, head dim 128, bf16. flashtile, SDPA's cuDNN backend and
FlexAttention in the same run, through the suite's own measurement (``flashtile.bench.gpu.measure``:
``triton.testing.do_bench``, L2 flushed, backward alone on a retained graph), and flashtile twice more:
with its key blocks unsplit and the dQ kernel after the dK/dV one (the backward before splits), and
split whenever the GPU is under-filled, whatever the work (``configs.BWD_SPLIT_MIN_PAIRS`` = 0).

    python benchmarks/bwd_fill.py -> $OUT (default /tmp)/<gpu>-bwd-fill-<date>.json
"""
import contextlib
import datetime
import json
import os
import sys

import torch

from flashtile import dispatch
from flashtile.backends.triton import configs, launch
from flashtile.bench import common, gpu, providers

# (batch, seqlen, query heads, KV heads, causal)
SHAPES = [(1, 8192, 4, 1, True), (1, 8192, 8, 1, True), (1, 16384, 4, 1, True), (1, 4096, 4, 1, True),
          (2, 4096, 8, 2, True), (1, 4096, 32, 8, True), (1, 2048, 32, 8, True), (1, 8192, 4, 4, True),
          (1, 8192, 4, 1, False), (4, 4096, 32, 8, True), (1, 2048, 4, 1, True), (1, 4096, 8, 2, False),
          (2, 2048, 8, 2, True)]
PROVIDERS = ["flashtile", "flashtile-unsplit", "flashtile-nofloor", "cudnn", "flex"]


@contextlib.contextmanager
def no_floor():
    """Split key blocks whenever the GPU is under-filled, however little work the backward has."""
    floor = configs.BWD_SPLIT_MIN_PAIRS
    configs.BWD_SPLIT_MIN_PAIRS = 0
    try:
        yield
    finally:
        configs.BWD_SPLIT_MIN_PAIRS = floor


@contextlib.contextmanager
def unsplit():
    """flashtile's backward as before: one dK/dV program per key block, the dQ kernel after it."""
    rule = launch.bwd_plan
    launch.bwd_plan = lambda *args: (1, False)
    try:
        yield
    finally:
        launch.bwd_plan = rule


def main():
    timer = common.gpu_timer()
    rows = []
    for batch, seqlen, heads, heads_kv, causal in SHAPES:
        shape = providers.DenseShape(batch, seqlen, heads, heads_kv, 128, 128, causal, "bf16")
        inputs = providers.make_inputs(batch, seqlen, heads, heads_kv, 128, 128, torch.bfloat16, "cuda")
        for name in PROVIDERS:
            scope = {"flashtile-unsplit": unsplit, "flashtile-nofloor": no_floor}.get(name, contextlib.nullcontext)()
            # A repeated backward replays its first launches: plan each variant's calls afresh.
            dispatch.forget_plans()
            with scope:
                row = gpu.measure(name.split("-")[0], inputs, shape, timer, stages=("fwd", "bwd"), memory=False)
            row["prov"] = name
            rows.append(row)
            print({k: row.get(k) for k in ("prov", "B", "N", "H", "Hkv", "causal", "fwd_ms", "bwd_ms")}, flush=True)
    env = gpu._env("bf16")  # versions, GPU, and git_commit (FLASHTILE_GIT_COMMIT names a copied tree's)
    date = datetime.date.today().isoformat()
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"{common.gpu_slug(env.get('gpu', 'gpu'))}-bwd-fill-{date}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "shapes": SHAPES, "rows": rows}, f, indent=1)
    print(f"\nbwd TFLOP/s (fwd TFLOP/s), bf16, d128 -> {path}")
    print("| batch x seqlen | heads q/kv | mask | " + " | ".join(PROVIDERS) + " | now / unsplit |")
    print("|---" * (len(PROVIDERS) + 4) + "|")
    for i in range(0, len(rows), len(PROVIDERS)):
        group = rows[i:i + len(PROVIDERS)]
        first = group[0]
        cells = [f"{r.get('bwd_tflops') or 0:.0f} ({r.get('fwd_tflops') or 0:.0f})" for r in group]
        gain = group[1]["bwd_ms"] / group[0]["bwd_ms"] if group[0].get("bwd_ms") and group[1].get("bwd_ms") else 0
        print(f"| {first['B']} x {first['N']} | {first['H']}/{first['Hkv']} | {'causal' if first['causal'] else 'full'}"
              f" | " + " | ".join(cells) + f" | {gain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
