"""The head-dim-128 backward's two dK/dV tiles on the H200, forced in turn on every shape: 32x64 w4 s3
("narrow") and 64x128 w8 s3 ("wide", which ``configs.bwd_config`` gives rows of ``LONG_BWD_KEYS``+ keys
without ALiBi, bias or dropout). Whole backward (bf16, ``torch.autograd.grad`` on a retained graph,
``triton.testing.do_bench``), two interleaved rounds, FlexAttention on the dense shapes for reference.

    python benchmarks/bwd_dkdv_tiles.py -> $OUT (default /tmp)/<gpu>-bwd-dkdv-tiles-<date>.json
"""
import contextlib
import datetime
import json
import os

import torch
from triton.testing import do_bench

import flashtile
from flashtile import dispatch
from flashtile.backends.triton import configs
from flashtile.bench import common, gpu, providers

# (batch, seqlen, query heads, KV heads, causal, window left or -1)
SHAPES = [(1, 16384, 16, 16, False, -1), (1, 16384, 16, 16, True, -1), (1, 16384, 32, 8, False, -1),
          (1, 16384, 32, 8, True, -1), (4, 4096, 16, 16, False, -1), (4, 4096, 16, 16, True, -1),
          (2, 8192, 32, 8, True, -1), (1, 8192, 4, 1, True, -1), (1, 4096, 4, 1, True, -1), (2, 4096, 8, 2, True, -1),
          (1, 8192, 4, 1, False, -1), (1, 2048, 32, 8, True, -1), (4, 1024, 32, 8, True, -1),
          (16, 512, 32, 8, True, -1), (1, 16384, 16, 16, True, 1024), (1, 16384, 16, 16, True, 4096),
          (4, 4096, 32, 8, True, 1024)]


@contextlib.contextmanager
def tile(name):
    """Every d=128 call on the named dK/dV tile."""
    floor = configs.LONG_BWD_KEYS
    configs.LONG_BWD_KEYS = 0 if name == "wide" else 1 << 62
    try:
        yield
    finally:
        configs.LONG_BWD_KEYS = floor


def backward_ms(b, n, h, hk, causal, left):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for heads in (h, hk, hk))
    dout = torch.randn_like(q)
    window = (left, 0) if left >= 0 else (-1, -1)
    out = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
    return do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup=10, rep=60)


def main():
    timer = common.gpu_timer()
    rows = []
    for rnd in range(2):
        for b, n, h, hk, causal, left in SHAPES:
            row = dict(round=rnd, B=b, N=n, H=h, Hkv=hk, causal=causal, window_left=left)
            pairs = b * h * (n * (left + 1) - left * (left + 1) // 2 if left >= 0 else n * n // (2 if causal else 1))
            for name in ("narrow", "wide"):
                dispatch.forget_plans()
                with tile(name):
                    row[f"{name}_ms"] = backward_ms(b, n, h, hk, causal, left)
                row[f"{name}_tflops"] = 4 * 2.5 * pairs * 128 / row[f"{name}_ms"] / 1e9
            if rnd == 0 and left < 0:
                shape = providers.DenseShape(b, n, h, hk, 128, 128, causal, "bf16")
                inputs = providers.make_inputs(b, n, h, hk, 128, 128, torch.bfloat16, "cuda")
                flex = gpu.measure("flex", inputs, shape, timer, stages=("bwd",), memory=False)
                row["flex_tflops"] = flex.get("bwd_tflops")
            rows.append(row)
            print({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}, flush=True)
    env = gpu._env("bf16")
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"{common.gpu_slug(env.get('gpu', 'gpu'))}-bwd-dkdv-tiles-"
                        f"{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "shapes": SHAPES, "rows": rows}, f, indent=1)
    print(f"\nbackward TFLOP/s, bf16, d=128, rounds 1 / 2 -> {path}")
    print("| batch x seqlen | heads | mask | narrow 32x64 | wide 64x128 | Flex |")
    print("|---|---|---|---|---|---|")
    half = len(rows) // 2
    for a, c in zip(rows[:half], rows[half:]):
        mask = f"window ({a['window_left']}, 0)" if a["window_left"] >= 0 else ("causal" if a["causal"] else "full")
        flex = f"{a['flex_tflops']:.0f}" if a.get("flex_tflops") else "-"
        print(f"| {a['B']} x {a['N']} | {a['H']}/{a['Hkv']} | {mask} | {a['narrow_tflops']:.0f} / "
              f"{c['narrow_tflops']:.0f} | {a['wide_tflops']:.0f} / {c['wide_tflops']:.0f} | {flex} |")


if __name__ == "__main__":
    main()
