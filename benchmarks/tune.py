"""Tile-config sweep for the Triton kernels on one GPU (evidence for configs.py).

Runs, in one process: a correctness pass of the current table over head dims 8..256
(bf16, fwd + bwd, against an fp32-upcast reference), then timed sweeps of forward,
dK/dV and dQ tile configs at batch x seqlen = 16384 tokens, nheads x headdim = 2048,
next to torch SDPA's flash and cuDNN backends. Prints a short table last and writes JSON.

    python benchmarks/tune.py --out results_dir [--budget-s 480]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashtile.backends import AttnArgs  # noqa: E402
from flashtile.backends.triton import launch  # noqa: E402
from flashtile.backends.triton.configs import BwdConfig, TileConfig, bwd_config  # noqa: E402

T = TileConfig
FWD_CANDIDATES = [T(128, 64, 4, 3), T(128, 128, 4, 3), T(128, 64, 8, 3), T(128, 128, 8, 3), T(128, 128, 8, 2),
                  T(256, 64, 8, 3), T(64, 64, 4, 3), T(128, 64, 8, 4), T(128, 32, 4, 3), T(256, 128, 8, 2)]
DKDV_CANDIDATES = [T(64, 128, 8, 2), T(64, 128, 8, 3), T(32, 128, 8, 2), T(32, 128, 4, 2), T(64, 64, 4, 2),
                   T(64, 128, 4, 2), T(128, 128, 8, 2), T(32, 64, 4, 3), T(64, 64, 4, 3)]
DQ_CANDIDATES = [T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 32, 8, 2), T(64, 64, 4, 2), T(128, 128, 8, 2),
                 T(64, 128, 4, 2), T(64, 32, 4, 3), T(128, 64, 4, 2)]


def tflops(ms, b, h, n, d, causal, mult=1.0):
    return 4 * b * h * n * n * d * (0.5 if causal else 1.0) * mult / (ms * 1e-3) / 1e12


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def ref_attention(q, k, v, causal, scale):
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    g = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.arange(sk, device=s.device)[None] > torch.arange(sq, device=s.device)[:, None] + sk - sq, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2)


def check_headdims(rows):
    """Every head dim of the table compiles and matches the fp32 reference (fwd and grads)."""
    for d in (8, 40, 64, 72, 96, 128, 160, 192, 256):
        for causal in (False, True):
            torch.manual_seed(d)
            q = torch.randn(2, 1023, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(2, 1024, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            scale = 1 / math.sqrt(d)
            row = {"phase": "check", "d": d, "causal": causal}
            try:
                import flashtile
                out = flashtile.flash_attn_func(q, k, v, causal=causal)
                do = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), do)
                qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
                ref = ref_attention(qr, kr, vr, causal, scale)
                rgrads = torch.autograd.grad(ref, (qr, kr, vr), do.float())
                row["out_err"] = (out.float() - ref).abs().max().item()
                for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
                    row[name + "_err"] = (g.float() - rg).abs().max().item()
                # A coarse compile-and-sanity gate; the test suite applies the real tolerance rule.
                row["ok"] = all(math.isfinite(x) and x < 0.05 for k_, x in row.items() if k_.endswith("_err"))
            except Exception as e:  # noqa: BLE001 - a failing head dim is a row, not a crash
                row["error"] = repr(e)[:300]
                row["ok"] = False
            rows.append(row)
            print("check", row, flush=True)


def sweep(rows, deadline):
    for d in (128, 64):
        for causal in (False, True):
            n, b, h = 4096, 4, 2048 // d
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            scale = 1 / math.sqrt(d)
            shape = {"d": d, "causal": causal, "N": n, "B": b, "H": h}
            # Peers, same inputs, same run.
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
            for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        ms = bench(f)
                        o = f()
                        g = torch.randn_like(o)
                        msb = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
                    rows.append({"phase": "peer", "prov": name, **shape, "fwd_tflops": tflops(ms, b, h, n, d, causal),
                                 "bwd_tflops": tflops(msb, b, h, n, d, causal, 2.5)})
                except Exception as e:  # noqa: BLE001
                    rows.append({"phase": "peer", "prov": name, **shape, "error": repr(e)[:200]})
                print(rows[-1], flush=True)
            args = AttnArgs(softmax_scale=scale, causal=causal, window_right=0 if causal else -1)
            ref_out, ref_lse = launch.forward(q, k, v, args)
            for cfg in FWD_CANDIDATES:
                if time.time() > deadline:
                    return
                row = {"phase": "fwd", **shape, "cfg": cfg.__dict__}
                try:
                    out, _ = launch.forward(q, k, v, args, config=cfg)
                    row["err_vs_default"] = (out.float() - ref_out.float()).abs().max().item()
                    ms = bench(lambda: launch.forward(q, k, v, args, config=cfg))
                    row["tflops"] = tflops(ms, b, h, n, d, causal)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:200]
                rows.append(row)
                print(row, flush=True)
            do = torch.randn_like(q)
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            launch.backward(do, q, k, v, ref_out, ref_lse, args, dq, dk, dv)
            ref_grads = [t.clone() for t in (dq, dk, dv)]
            default = bwd_config(d, q.dtype, q.device)
            for which, cands in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
                for cfg in cands:
                    if time.time() > deadline:
                        return
                    full = BwdConfig(cfg, default.dq) if which == "dkdv" else BwdConfig(default.dkdv, cfg)
                    row = {"phase": which, **shape, "cfg": cfg.__dict__}
                    try:
                        launch.backward(do, q, k, v, ref_out, ref_lse, args, dq, dk, dv, config=full)
                        row["err_vs_default"] = max((a.float() - r.float()).abs().max().item() for a, r in zip((dq, dk, dv), ref_grads))
                        ms = bench(lambda: launch.backward(do, q, k, v, ref_out, ref_lse, args, dq, dk, dv, config=full))
                        row["bwd_ms"] = ms
                        row["bwd_tflops"] = tflops(ms, b, h, n, d, causal, 2.5)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = repr(e)[:200]
                    rows.append(row)
                    print(row, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    start = time.time()
    rows = []
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        if not args.skip_check:
            check_headdims(rows)
        sweep(rows, start + args.budget_s)
    finally:
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    print("\n== summary ==")
    for r in rows:
        if r["phase"] == "check" and not r["ok"]:
            print("CHECK FAILED", r)
    best = {}
    for r in rows:
        if r["phase"] in ("fwd", "dkdv", "dq") and "error" not in r:
            key = (r["phase"], r["d"], r["causal"])
            val = r.get("tflops") or r.get("bwd_tflops")
            if key not in best or val > best[key][0]:
                best[key] = (val, r["cfg"])
    for r in rows:
        if r["phase"] == "peer" and "error" not in r:
            print(f"peer {r['prov']:11s} d={r['d']} causal={r['causal']}: fwd {r['fwd_tflops']:.0f} bwd {r['bwd_tflops']:.0f}")
    for key, (val, cfg) in sorted(best.items()):
        print(f"best {key}: {val:.0f} TFLOP/s  {cfg}")
    print(f"elapsed {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
