"""The head-dim-128 dQ kernel's tile with softcap on the H200: every candidate forced in turn (through
``launch.bwd_config``) on softcap-50 calls, against plain attention on the default tiles, in interleaved rounds.
bf16, 16 heads; whole backward time (``torch.autograd.grad`` on a retained graph, ``do_bench`` median) and the
dQ kernel's own time (profiler). Each candidate's dQ is checked against the default tile's first.

    python benchmarks/bwd_softcap_dq_tiles.py -> $OUT (default /tmp)/h200-bwd-softcap-dq-tiles-<date>.json
"""
import os
import sys
from dataclasses import replace

import torch
from triton.testing import do_bench

import flashtile
from flashtile import dispatch
from flashtile.backends.triton import launch
from flashtile.backends.triton.configs import TileConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_dkdv_gluon import kernel_us  # noqa: E402
from host_time import save_results  # noqa: E402

SHAPES = [(4, 4096, False), (4, 4096, True), (2, 8192, False), (2, 8192, True)]
TILES = {"default": None, "64x64 w4 s3": TileConfig(64, 64, 4, 3), "64x64 w4 s2": TileConfig(64, 64, 4, 2),
         "128x32 w8 s3": TileConfig(128, 32, 8, 3), "64x32 w4 s3": TileConfig(64, 32, 4, 3),
         "128x64 w8 s2": TileConfig(128, 64, 8, 2), "64x128 w4 s2": TileConfig(64, 128, 4, 2)}
ROUNDS = 2


def forced(tile):
    rule = launch.bwd_config
    if tile is None:
        return rule
    return lambda *args, **kwargs: replace(rule(*args, **kwargs), dq=tile)


def main():
    rule = launch.bwd_config
    rows = []
    for batch, seqlen, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        row = dict(shape=f"{batch}x{seqlen}", causal=causal, ms={}, dq_us={}, dq_err={})
        outs = {"plain": flashtile.flash_attn_func(q, k, v, causal=causal),
                "softcap": flashtile.flash_attn_func(q, k, v, causal=causal, softcap=50.0)}
        calls = {"plain": (None, outs["plain"])}
        calls.update({name: (tile, outs["softcap"]) for name, tile in TILES.items()})
        ref = None
        for name, (tile, out) in calls.items():
            dispatch.forget_plans()
            launch.bwd_config = forced(tile)
            try:
                dq = torch.autograd.grad(out, (q, ), dout, retain_graph=True)[0]
                if name == "default":
                    ref = dq
                elif ref is not None:
                    row["dq_err"][name] = (dq.float() - ref.float()).abs().max().item()
                times = kernel_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                row["dq_us"][name] = next((t for key, t in times.items() if "dq" in key), None)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a marked cell
                row["dq_us"][name] = f"{type(exc).__name__}: {str(exc)[:80]}"
            finally:
                launch.bwd_config = rule
        for _ in range(ROUNDS):
            for name, (tile, out) in calls.items():
                if isinstance(row["dq_us"].get(name), str):
                    continue
                dispatch.forget_plans()
                launch.bwd_config = forced(tile)
                try:
                    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup=10,
                                  rep=60)
                finally:
                    launch.bwd_config = rule
                row["ms"].setdefault(name, []).append(round(ms, 4))
        rows.append(row)
        print(row, flush=True)
    path = save_results("bwd-softcap-dq-tiles", rows, "python benchmarks/bwd_softcap_dq_tiles.py",
                        flashtile=flashtile.__version__)
    for r in rows:
        plain = min(r["ms"]["plain"])
        print(r["shape"], "causal" if r["causal"] else "full", " ".join(
            f"{name}={min(ms) / plain:.3f}({r['dq_us'][name]})" for name, ms in r["ms"].items()))
    print(path)


if __name__ == "__main__":
    main()
