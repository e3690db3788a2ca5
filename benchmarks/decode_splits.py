"""Split counts of the KV-cache kernel on short caches (evidence for configs.DECODE_MIN_KEYS_PER_SPLIT): GPU us
per call by CUDA-graph replay for num_splits 0 (auto) and 1-32, against SDPA; bf16, 32/8 heads, d=128, one query,
batch 1 and 4, a full contiguous cache.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/decode_splits.py   # writes $OUT/split-sweep.json
"""
import json
import os
import subprocess

import torch
import torch.nn.functional as F
import triton

from flashtile.backends import KVCacheArgs
from flashtile.backends.triton import decode

def main():
    rows = []
    for b in (1, 4):
        for L in (512, 1024, 2048, 4096, 8192, 16384):
            q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, L, 8, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            row = {"batch": b, "keys": L}
            for n in (0, 1, 2, 4, 8, 16, 32):
                args = KVCacheArgs(softmax_scale=128 ** -0.5, causal=True, window_right=0, max_seqlen_q=1, max_seqlen_k=L,
                                   num_splits=n)
                row[f"s{n}"] = round(
                    triton.testing.do_bench_cudagraph(lambda: decode.attention_kv(q, k, v, args), rep=60) * 1e3, 2)
            auto = KVCacheArgs(softmax_scale=128 ** -0.5, causal=True, window_right=0, max_seqlen_q=1, max_seqlen_k=L)
            row["auto"] = decode.plan(q, k, v, auto).num_splits
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            row["sdpa"] = round(triton.testing.do_bench_cudagraph(
                lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), rep=60) * 1e3, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    commit = os.environ.get("FLASHTILE_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(), commit=commit,
                command="python benchmarks/decode_splits.py")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "split-sweep.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
