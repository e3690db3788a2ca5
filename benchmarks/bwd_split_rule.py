"""Backward TFLOP/s of under-filled shapes (few KV heads, short sequences) under other settings of the
dK/dV split rule (``configs.bwd_kv_plan``): rows per part (``BWD_KV_MIN_ROWS_PER_SPLIT``) and the pair
floor (``BWD_SPLIT_MIN_PAIRS``), each setting measured twice, interleaved, through the suite's measurement
(``flashtile.bench.gpu.measure``), next to SDPA's cuDNN backend. H200, bf16, d128.

    python benchmarks/bwd_split_rule.py --settings 2048:32 1024:0 -> $OUT (default /tmp)/bwd-split-rule.json

Each setting is ``rows:floor in Mi pairs``; every row of the JSON names its setting and the plan it gave.
"""
import argparse
import json
import os

import torch

from flashtile import dispatch
from flashtile.backends.triton import configs
from flashtile.bench import common, gpu, providers

SHAPES = [(1, 8192, 4, 1, True), (1, 8192, 8, 1, True), (1, 16384, 4, 1, True), (1, 4096, 4, 1, True),
          (2, 4096, 8, 2, True), (1, 4096, 32, 8, True), (1, 8192, 4, 4, True), (1, 8192, 4, 1, False),
          (4, 4096, 32, 8, True), (1, 4096, 8, 2, False), (1, 16384, 8, 1, False), (1, 32768, 4, 1, True),
          (1, 2048, 8, 1, False), (1, 1024, 32, 8, True), (1, 2048, 4, 1, True), (2, 2048, 8, 2, True),
          (1, 2048, 32, 8, True), (1, 4096, 2, 1, True)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", nargs="+", default=["2048:32", "1024:0"])
    opts = parser.parse_args()
    settings = [(int(rows), int(floor) << 20) for rows, floor in (s.split(":") for s in opts.settings)]
    timer = common.gpu_timer()
    rows = []
    for batch, seqlen, heads, heads_kv, causal in SHAPES:
        shape = providers.DenseShape(batch, seqlen, heads, heads_kv, 128, 128, causal, "bf16")
        inputs = providers.make_inputs(batch, seqlen, heads, heads_kv, 128, 128, torch.bfloat16, "cuda")
        line = []
        for min_rows, floor in settings * 2:
            configs.BWD_KV_MIN_ROWS_PER_SPLIT, configs.BWD_SPLIT_MIN_PAIRS = min_rows, floor
            # A repeated backward replays its first launches: plan each setting's calls afresh.
            dispatch.forget_plans()
            plan = configs.bwd_plan(batch, heads, heads_kv, seqlen, seqlen, (-1, 0) if causal else (-1, -1), 64,
                                    torch.device("cuda"))
            r = gpu.measure("flashtile", inputs, shape, timer, stages=("bwd",), memory=False)
            rows.append(dict(shape=[batch, seqlen, heads, heads_kv, causal], min_rows=min_rows, floor=floor,
                             plan=plan, bwd_ms=r.get("bwd_ms"), bwd_tflops=r.get("bwd_tflops")))
            line.append(f"{min_rows}/{floor >> 20}Mi {plan[0]}: {r.get('bwd_tflops') or 0:.0f}")
        r = gpu.measure("cudnn", inputs, shape, timer, stages=("bwd",), memory=False)
        rows.append(dict(shape=[batch, seqlen, heads, heads_kv, causal], prov="cudnn", bwd_ms=r.get("bwd_ms"),
                         bwd_tflops=r.get("bwd_tflops")))
        print(batch, seqlen, heads, heads_kv, causal, " | ".join(line), f"| cudnn {r.get('bwd_tflops') or 0:.0f}",
              flush=True)
    env = gpu._env("bf16")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd-split-rule.json"), "w") as f:
        json.dump(dict(env=env, settings=opts.settings, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
