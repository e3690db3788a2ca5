"""Hopper d=128 forward tiles, A/B (evidence for configs.gluon_fwd_config).

Through ``launch.forward(config=...)``: the Triton kernel's table tile vs the Gluon kernel's 64x64 and
64x128 tiles. First each is checked against float32 attention on awkward shapes (GQA, windows,
softcap, ALiBi, sinks, seqlen_q != seqlen_k), then timed in three interleaved rounds (CUDA events over
20 back-to-back calls, so host time is hidden) at 16384 tokens x 16 heads.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/gluon_tiles.py [short]   # writes $OUT/gsweep.json

``short``: shorter rows (32 x 512 .. 4 x 4096, plain) and ALiBi on all three tiles instead.
``window``: sliding windows of 512 to 8192 keys (plain, softcap, ALiBi, sink, GQA), writes $OUT/gsweep-window.json.
``softcap``: the softcap calls whose row max is not held fixed (fp16, softcap 60, with a sink) on long full rows,
and softcap windows, writes $OUT/gsweep-softcap.json.
"""
import json
import math
import os
import subprocess
import sys

import torch
from flashtile.backends import AttnArgs
from flashtile.backends.triton import launch
from flashtile.backends.triton.configs import fwd_config, _FWD_SM90_GLUON, _FWD_SM90_GLUON_WIDE
from host_time import events_us

dt = torch.bfloat16
CFG = {"gluon64": _FWD_SM90_GLUON, "gluon128": _FWD_SM90_GLUON_WIDE}
MODE = sys.argv[1] if len(sys.argv) > 1 else ""


def args_for(h, b, causal, window, softcap, alibi, sink, scale):
    left, right = window
    if causal:
        right = 0
    return AttnArgs(softmax_scale=scale, causal=causal, window_left=left, window_right=right, softcap=softcap,
                    alibi_slopes=(torch.rand(h, device="cuda") * 0.5).expand(b, h) if alibi else None,
                    sink=torch.randn(h, device="cuda") if sink else None)


def ref(q, k, v, a):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(h // hk, 1); vf = vf.repeat_interleave(h // hk, 1)
    s = qf @ kf.transpose(-1, -2) * a.softmax_scale
    if a.softcap:
        s = a.softcap * torch.tanh(s / a.softcap)
    i = torch.arange(sq, device=q.device)[:, None] + sk - sq
    j = torch.arange(sk, device=q.device)[None, :]
    if a.alibi_slopes is not None:
        s = s - a.alibi_slopes[:, :, None, None] * (i - j).abs()
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if a.window_right >= 0: ok &= j <= i + a.window_right
    if a.window_left >= 0: ok &= j >= i - a.window_left
    s = s.masked_fill(~ok, -math.inf)
    if a.sink is not None:
        s = torch.cat([s, a.sink[None, :, None, None].expand(b, h, sq, 1)], -1)
        vf = torch.cat([vf, torch.zeros_like(vf[:, :, :1])], 2)
    lse = s.logsumexp(-1)
    o = torch.nan_to_num(s.softmax(-1)) @ vf
    return o.transpose(1, 2), lse


def main():
    res = []
    torch.manual_seed(0)
    bad = 0
    for (b, sq, sk, h, hk, causal, window, softcap, alibi, sink) in [
            (2, 1000, 1000, 8, 2, False, (-1, -1), 0.0, False, False),
            (1, 300, 1000, 4, 4, True, (-1, -1), 0.0, False, False),
            (2, 777, 777, 4, 1, False, (256, 0), 0.0, False, True),
            (1, 700, 900, 4, 2, False, (100, 50), 30.0, False, False),
            (2, 1000, 1000, 8, 8, True, (-1, -1), 30.0, False, True), (1, 1100, 700, 4, 2, True, (-1, -1), 0.0, True, True),
            (1, 513, 1537, 2, 1, False, (-1, -1), 10.0, False, True),
            (3, 129, 4000, 4, 2, True, (-1, -1), 0.0, False, False)] + ([
            (1, 1000, 1000, 4, 2, False, (1024, 0), 0.0, False, False), (2, 1111, 1111, 4, 4, False, (1000, 0), 0.0, True, False),
            (1, 900, 1500, 4, 1, False, (70, 0), 0.0, False, True), (1, 1500, 900, 4, 2, False, (300, 200), 30.0, False, False),
            (2, 640, 640, 2, 2, False, (10, 0), 0.0, False, False), (1, 777, 777, 4, 4, False, (64, 64), 0.0, False, False),
            (1, 1000, 1300, 2, 2, False, (500, -1), 0.0, False, False), (1, 2000, 2000, 4, 2, True, (-1, -1), 30.0, True, True),
            (2, 1000, 1000, 4, 4, False, (128, 0), 0.0, False, False), (1, 2000, 2000, 4, 2, False, (-1, -1), 30.0, True, False),
            (1, 1500, 1500, 4, 2, False, (900, 0), 30.0, True, True)] if MODE == "window" else []):
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hk, 128, device="cuda", dtype=dt)
        v = torch.randn(b, sk, hk, 128, device="cuda", dtype=dt)
        a = args_for(h, b, causal, window, softcap, alibi, sink, 128 ** -0.5)
        ro, rl = ref(q, k, v, a)
        row = dict(check=[b, sq, sk, h, hk, causal, window, softcap, alibi, sink])
        table_tile = fwd_config(128, dt, q.device, sk, a.window_left, a.window_right, softcap > 0)
        for name, cfg in [("triton", table_tile)] + list(CFG.items()):
            o, l = launch.forward(q, k, v, a, config=cfg)
            fin = torch.isfinite(rl)
            e = [round(float((o.float() - ro).abs().max()), 5), round(float((l[fin] - rl[fin]).abs().max()), 5),
                 bool((l[~fin] == float("-inf")).all())]
            row[name] = e
        # With softcap the Gluon kernel folds its scale into Q, rounded to 16 bits: its lse moves by up to ~3e-3.
        lse_tol = 5e-3 if softcap else 1e-3
        ok = all(row[n][0] <= 2 * row["triton"][0] + 2e-3 and row[n][1] < lse_tol and row[n][2] for n in CFG)
        bad += not ok
        row["ok"] = ok
        print(json.dumps(row), flush=True)
        res.append(row)
    print("checks: %d bad" % bad, flush=True)

    H, D = 16, 128
    cases = []
    for feat in ("plain", "softcap", "alibi", "sink"):
        for causal in (False, True):
            for B, S in ((4, 4096), (2, 8192), (1, 16384)):
                cases.append((B, S, H, H, causal, (-1, -1), feat))
    cases += [(4, 4096, 32, 8, False, (-1, -1), "plain"), (4, 4096, 32, 8, True, (-1, -1), "plain"),
              (1, 16384, H, H, False, (1024, 0), "plain"), (2, 8192, H, H, False, (1024, 0), "plain"),
              (1, 16384, H, H, False, (1024, 0), "softcap"), (4, 4096, H, H, False, (2048, 0), "plain")]
    SHORT = MODE == "short"
    if SHORT:
        cases = [(B, S, H, H, causal, (-1, -1), "plain") for causal in (False, True)
                 for B, S in ((32, 512), (16, 1024), (8, 2048), (4, 4096))]
        cases += [(B, S, H, H, causal, (-1, -1), "alibi") for causal in (False, True)
                  for B, S in ((8, 2048), (4, 4096), (1, 16384))]
    if MODE == "window":
        cases = [(B, S, H, H, False, (w, 0), "plain") for B, S, w in
                 ((1, 16384, 512), (1, 16384, 1024), (2, 8192, 1024), (1, 16384, 2048), (4, 4096, 2048), (1, 16384, 4096),
                  (2, 8192, 4096), (1, 16384, 8192))]
        cases += [(1, 16384, H, H, False, (w, 0), feat) for w in (1024, 4096) for feat in ("softcap", "alibi", "sink")]
        cases += [(4, 4096, 32, 8, False, (w, 0), "plain") for w in (1024, 2048)]
    if MODE == "softcap":
        cases = [(B, S, H, H, False, (-1, -1), feat) for feat in ("softcap-fp16", "softcap60", "softcap-sink")
                 for B, S in ((4, 4096), (2, 8192), (1, 16384))]
        cases += [(1, 16384, H, H, False, (w, 0), "softcap") for w in (2048, 4096, 8192)]
    # Feature name -> (dtype, softcap, sink): "softcap" is 30 in bf16, where the row max is held fixed.
    FEATURES = {"softcap": (torch.bfloat16, 30.0, False), "softcap-fp16": (torch.float16, 30.0, False),
                "softcap60": (torch.bfloat16, 60.0, False), "softcap-sink": (torch.bfloat16, 30.0, True),
                "sink": (torch.bfloat16, 0.0, True)}
    table = []
    for (B, S, h, hk, causal, window, feat) in cases:
        dt, softcap, sink = FEATURES.get(feat, (torch.bfloat16, 0.0, False))
        q = torch.randn(B, S, h, D, device="cuda", dtype=dt)
        k, v = (torch.randn(B, S, hk, D, device="cuda", dtype=dt) for _ in range(2))
        a = args_for(h, B, causal, window, softcap, feat == "alibi", sink, D ** -0.5)
        flops = 4 * B * h * S * S * D / (2 if causal else 1)
        if window[0] >= 0:
            flops = 4 * B * h * D * sum(min(i, window[0]) + 1 for i in range(S))
        table_tile = fwd_config(128, dt, q.device, S, a.window_left, a.window_right, softcap > 0)
        cfgs = [("triton", table_tile)] + list(CFG.items())
        if feat == "alibi" and not SHORT and MODE != "window":
            cfgs = cfgs[:2]
        times = {n: [] for n, _ in cfgs}
        for rnd in range(3):
            for n, cfg in cfgs:
                times[n].append(events_us(lambda: launch.forward(q, k, v, a, config=cfg), 20))
        row = dict(B=B, S=S, h=h, hk=hk, causal=causal, window=window, feat=feat,
                   us={n: [round(x, 1) for x in t] for n, t in times.items()},
                   tflops={n: round(flops / min(t) / 1e6) for n, t in times.items()})
        print(json.dumps(row), flush=True)
        table.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = dict(commit=os.environ.get("FLASHTILE_GIT_COMMIT", commit), torch=torch.__version__,
               triton=__import__("triton").__version__, gpu=torch.cuda.get_device_name())
    name = f"gsweep-{MODE}.json" if MODE else "gsweep.json"
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(dict(env=env, checks=res, table=table), f, indent=1)
    print("\nB S h/hk causal window feat | best-of-3 TFLOP/s:", " ".join(["triton"] + list(CFG)))
    for r in table:
        print(r["B"], r["S"], "%d/%d" % (r["h"], r["hk"]), r["causal"], r["window"], r["feat"], "|", r["tflops"])


if __name__ == "__main__":
    main()
