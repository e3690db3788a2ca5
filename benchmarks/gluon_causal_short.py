"""Short causal rows: the Gluon forward's 64x64 tile against its 64x128 one at d=128, and against the Triton
kernel at d=64 (full rows and longer ones for contrast), each forced through launch.forward.

bf16, batch x seqlen = 16384 tokens; forward TFLOP/s by triton.testing.do_bench (the suite's warm-up and
repetitions), ``--rounds`` interleaved rounds; each row also records the largest difference from the first
variant's output (the same attention, other tiles).

    python benchmarks/gluon_causal_short.py --rounds 2 -> $OUT (default /tmp)/h200-gluon-causal-short-<date>.json
"""
import os, sys

import torch
import triton

from flashtile.backends.triton import configs, launch
from flashtile.validation import attn_args

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import measure_all, rounds_option, save_results  # noqa: E402

NARROW, WIDE = configs._FWD_SM90_GLUON, configs._FWD_SM90_GLUON_WIDE
CASES = [(128, 16384 // s, s, hq, hk, True) for s in (512, 1024, 2048, 4096) for hq, hk in ((16, 16), (32, 8))]
CASES += [(64, 16384 // s, s, 32, 32, causal) for s in (512, 1024, 2048, 8192) for causal in (False, True)]


def variants(head_dim, seqlen, causal):
    if head_dim == 128:
        return {"gluon 64x64": NARROW, "gluon 64x128": WIDE}
    triton_tile = configs.fwd_config(64, torch.bfloat16, torch.device("cuda"), seqlen, -1, 0 if causal else -1)
    return {"triton": triton_tile, "gluon 64x64": NARROW, "gluon 64x128": WIDE}


def measure(head_dim, batch, seqlen, hq, hk, causal, rounds):
    q = torch.randn(batch, seqlen, hq, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, hk, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    args = attn_args(q, k, v, causal=causal)
    flops = 4 * batch * hq * seqlen * seqlen * head_dim / (2 if causal else 1)
    row = dict(headdim=head_dim, shape=f"{batch}x{seqlen}", heads=f"{hq}/{hk}", mask="causal" if causal else "full")
    first = None
    for _ in range(rounds):
        for name, cfg in variants(head_dim, seqlen, causal).items():
            fn = lambda: launch.forward(q, k, v, args, config=cfg)  # noqa: E731
            out = fn()[0].float()
            first = out if first is None else first
            row.setdefault(name, []).append(round(flops / triton.testing.do_bench(fn, warmup=25, rep=100) / 1e9, 1))
            row[f"{name} max_abs_diff"] = (out - first).abs().max().item()
    return row


if __name__ == "__main__":
    rounds = rounds_option()
    rows = measure_all(lambda *case: measure(*case, rounds), CASES)
    path = save_results("gluon-causal-short", rows, f"python benchmarks/gluon_causal_short.py --rounds {rounds}")
    for r in rows:
        tiles = "  ".join(f"{name} {r[name]}" for name in ("triton", "gluon 64x64", "gluon 64x128") if name in r)
        print(f"d={r['headdim']:<4} {r['shape']:>8} {r['heads']:>6} {r['mask']:>6}  {tiles}")
    print("wrote", path)
