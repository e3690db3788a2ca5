"""The Gluon forward's slim 64x64 tile (Q in shared memory, one key slot: three programs an SM) against the
plain 64x64 plan (Q in registers, two slots each: two programs) and the tile the table gives, on causal rows
and sliding windows (evidence for configs._FWD_SM90_GLUON_SLIM).

Through ``launch.forward(config=...)``, bf16, d=128, 16 heads (and GQA rows), plain and with softcap or a
sink; each tile is first
checked against the table's on the same inputs, then timed in ``--rounds`` interleaved rounds (CUDA events
over 20 back-to-back calls, so host time is hidden). Reports median and best TFLOP/s of visible pairs.

    python benchmarks/gluon_slim.py --rounds 5 -> $OUT (default /tmp)/h200-gluon-slim-<date>.json
"""
import os
import sys

import torch

from flashtile.backends import AttnArgs
from flashtile.backends.triton import configs, launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import events_us, measure_all, rounds_option, save_results  # noqa: E402

# (batch, seqlen, query heads, KV heads, causal, window left or -1, feature: "", "softcap" (30) or "sink")
SHAPES = [(b, s, 16, 16, True, -1, "") for b, s in ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192))]
SHAPES += [(1, 16384, 16, 16, False, w, "") for w in (512, 1024, 2048, 4096)]
SHAPES += [(2, 8192, 16, 16, False, 1024, ""), (4, 4096, 16, 16, False, 1024, ""), (4, 4096, 32, 8, False, 1024, "")]
# Softcap (Gemma-2: windows of 4096 with softcap 30) and sinks (gpt-oss: windows of 128), which fit three
# programs an SM too (159 and 162 registers; ALiBi takes 182).
SHAPES += [(b, s, 16, 16, True, -1, feature) for b, s in ((16, 1024), (8, 2048)) for feature in ("softcap", "sink")]
SHAPES += [(1, 16384, 16, 16, False, w, "softcap") for w in (1024, 4096)]
SHAPES += [(1, 16384, 64, 8, False, 128, "sink"), (1, 16384, 16, 16, False, 1024, "sink")]
TILES = {"64x64": configs._FWD_SM90_GLUON, "slim": configs._FWD_SM90_GLUON_SLIM}


def measure(batch, seqlen, heads, heads_kv, causal, left, feature, rounds):
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    softcap = 30.0 if feature == "softcap" else 0.0
    sink = torch.randn(heads, device="cuda") if feature == "sink" else None
    args = AttnArgs(softmax_scale=128 ** -0.5, causal=causal, window_left=left, window_right=0 if causal or left >= 0
                    else -1, softcap=softcap, sink=sink)
    features = frozenset(({"window"} if left >= 0 else set()) | ({feature} if feature else set()))
    table = configs.gluon_fwd_config(128, 128, q.dtype, q.device, batch * heads * seqlen, seqlen, args.window_left,
                                     args.window_right, features, softcap, min_pairs=0)
    tiles = {"table": table, **TILES}
    base, _ = launch.forward(q, k, v, args, config=table)
    row = dict(shape=f"{batch}x{seqlen}", heads=f"{heads}/{heads_kv}", mask="causal" if causal else f"window ({left}, 0)",
               feature=feature, table=f"{table.kernel} {table.BLOCK_M}x{table.BLOCK_N}")
    for name, cfg in TILES.items():
        out, _ = launch.forward(q, k, v, args, config=cfg)
        row[f"{name} max diff"] = float((out.float() - base.float()).abs().max())
    if left >= 0:
        pairs = sum(min(i, left) + 1 for i in range(seqlen))
    else:
        pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    flops = 4 * batch * heads * 128 * pairs
    times = {name: [] for name in tiles}
    for _ in range(rounds):
        for name, cfg in tiles.items():
            times[name].append(events_us(lambda: launch.forward(q, k, v, args, config=cfg)))
    row["us"] = {name: [round(t, 1) for t in ts] for name, ts in times.items()}
    row["median TFLOP/s"] = {name: round(flops / sorted(ts)[len(ts) // 2] / 1e6) for name, ts in times.items()}
    row["best TFLOP/s"] = {name: round(flops / min(ts) / 1e6) for name, ts in times.items()}
    return row


if __name__ == "__main__":
    rounds = rounds_option(5)
    rows = measure_all(lambda *shape: measure(*shape, rounds), SHAPES)
    save_results("gluon-slim", rows, f"python benchmarks/gluon_slim.py --rounds {rounds}")
