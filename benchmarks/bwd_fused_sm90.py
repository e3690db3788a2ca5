"""Tried and not kept: a one-pass Gluon backward, kernels/bwd_sm90.py given a dQ descriptor. A program of two
warpgroups owns 128 keys; per 64-query step dS^T goes to shared memory, dQ's share dS K is a wgmma, staged in
float32 shared memory and added into a float32 buffer by the TMA's bulk reduce (a cast follows). The kernel
and launcher are a patch on main (measured at 6e110c8; applies since eb70625; ``FLASHTILE_FUSED_BWD=1``
switches it on):

    git show 900e1c4:benchmarks/results/h200-bwd-fused-sm90-2026-11-23.diff | git apply   # the patch, in git history
    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/bwd_fused_sm90.py          # A/B against the pair
    MODES=1 FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/bwd_fused_sm90.py  # where its time goes

Whole backward (preprocess, zeroing, cast included), bf16, d=128, median of alternating rounds; ratios
against the pair's plain rows. Also prints the largest gradient difference fused vs pair per shape.
Results: results/h200-bwd-fused-sm90-2026-11-23.json (the -modes file is in git history at 900e1c4).
"""
import json
import os
import sys

import torch
import triton

from flashtile.backends.triton import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_fused_dq  # noqa: E402
from d256_fwd_tiles import time_it  # noqa: E402


def make(B, S, H, Hk, causal, softcap, seed=0):
    """bwd_fused_dq's inputs (bf16, d=128, forward run) for full or causal rows."""
    return bwd_fused_dq.make(B, S, H, Hk, (-1, 0 if causal else -1), torch.bfloat16, seed=seed, softcap=softcap)


def backward(t, fused):
    q, k, v, do, out, lse, args = t
    launch._FUSED_BWD = fused
    grads = tuple(torch.empty_like(x) for x in (q, k, v))
    launch.backward(do, q, k, v, out, lse, args, *grads)
    return grads


if __name__ == "__main__":
    res = dict(torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("FLASHTILE_GIT_COMMIT", ""),
               check=[], time=[])
    for shape in [(2, 1000, 4, 4), (1, 1037, 4, 2), (2, 4096, 8, 2)]:
        for causal in (False, True):
            for cap in (0.0, 30.0):
                t = make(*shape, causal, cap, seed=1)
                a, b = backward(t, False), backward(t, True)
                err = [float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(b, a)]
                res["check"].append(dict(shape=shape, causal=causal, softcap=cap, rel_diff=err))
                print("check", shape, causal, cap, ["%.2e" % e for e in err], flush=True)
    rounds = int(os.environ.get("ROUNDS", "3"))
    if os.environ.get("MODES"):
        # Where the fused kernel's time goes (modes 0-2 give a wrong dQ): 0 no dQ product, 1 the product only,
        # 2 and its staging store, 3 and the TMA reduce (the kernel).
        for causal in (False, True):
            for cap in (0.0, 50.0):
                t = make(4, 4096, 16, 16, causal, cap)
                ms = {}
                for _ in range(rounds):
                    for mode in ("pair", 0, 1, 2, 3):
                        launch._DQ_MODE = 3 if mode == "pair" else mode
                        ms.setdefault(mode, []).append(time_it(lambda: backward(t, mode != "pair"), n=5, calls=10))
                launch._DQ_MODE = 3
                row = {str(m): sorted(v)[rounds // 2] for m, v in ms.items()}
                res["time"].append(dict(shape=(4, 4096, 16, 16), causal=causal, softcap=cap, modes=row))
                print("modes 4x4096", "causal" if causal else "full", cap, "  ".join(f"{m}={v:.3f}" for m, v in row.items()),
                      flush=True)
        json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_fused_sm90_modes.json"), "w"), indent=1)
        sys.exit()
    for shape in [(4, 4096, 16, 16), (2, 8192, 16, 16), (4, 4096, 32, 8)]:
        for causal in (False, True):
            rows = {(f, c): make(*shape, causal, c) for f in (False, True) for c in (0.0, 50.0)}
            times = {key: [] for key in rows}
            for _ in range(rounds):
                for (f, c), t in rows.items():
                    times[(f, c)].append(time_it(lambda: backward(t, f), n=5, calls=10))
            med = {key: sorted(ts)[rounds // 2] for key, ts in times.items()}
            base = med[(False, 0.0)]
            row = dict(shape=shape, causal=causal, **{f"{'fused' if f else 'pair'} {'softcap' if c else 'plain'}": ms
                                                       for (f, c), ms in med.items()})
            res["time"].append(row)
            print(shape, "causal" if causal else "full", "  ".join(
                f"{name}={ms:.3f}ms({ms / base:.3f})" for name, ms in row.items() if name not in ("shape", "causal")),
                flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_fused_sm90.json"), "w"), indent=1)
