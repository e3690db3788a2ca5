"""The one-pass warp-specialized backward (kernels/bwd_sm90_ws.py) against the pair (Gluon dK/dV + Triton dQ):
gradient differences on awkward shapes, then whole-backward times (preprocess, zeroing and cast included),
bf16, d=128, median of alternating rounds.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/bwd_ws.py [check] [time] [varlen] [ab OLD=path] [ROUNDS=3]
    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/bwd_ws.py knobs [D=128,64] [ROUNDS=3]

The pair is what ``deterministic=True`` runs. ``varlen``: packed sequences (16 lengths drawn from 128..4096) with
the features, through ``flash_attn_varlen_func``'s backward. ``ab``: the one-pass kernel against an earlier
version of kernels/bwd_sm90_ws.py (the file at ``OLD``, e.g. from ``git show REV:path``), whole backwards in
alternating rounds. ``knobs``: the kernel at head dims ``D`` with each of configs.OnePassConfig's knobs of
bwd_sm90_ws.py (KNOBS; dq_rows at 64 only, s_ahead at 128 only) against every knob off ("default"), the backward alone on the suite's dense shapes
(16384 tokens, 2048 // D heads, N 1k/4k/16k, full and causal), alternating rounds; every variant's dQ, dK, dV
compared with the default's first. Results: BENCHMARKS.md, results/h200-bwd-one-pass-*.json.
"""
import json
import os
import sys
from dataclasses import replace

import torch
import triton

import flashtile
from flashtile.backends import AttnArgs
from flashtile.backends.triton import launch
from flashtile.bench.variants import visible_pairs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from d256_fwd_tiles import time_it  # noqa: E402
from host_time import kernel_copy  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, S, H, Hk, window, softcap, seed=0, dtype=torch.bfloat16, alibi=False, D=128):
    """Seeded q, k, v, dO of ``(B, S, heads, D)``, their forward's out and lse, and the arguments."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, S, H, D, device=DEV, dtype=dtype, generator=g)
    k, v = (torch.randn(B, S, Hk, D, device=DEV, dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn(B, S, H, D, device=DEV, dtype=dtype, generator=g)
    left, right = window
    args = AttnArgs(softmax_scale=D ** -0.5, causal=right == 0 and left < 0, window_left=left, window_right=right,
                    softcap=softcap)
    if not alibi:
        return (q, k, v, do, *launch.forward(q, k, v, args), args)
    # ALiBi: geometric slopes per head.
    slopes = (2.0 ** (-8.0 * torch.arange(1, H + 1, device=q.device) / H)).expand(B, H)
    args = replace(args, alibi_slopes=slopes)
    return (q, k, v, do, *launch.forward(q, k, v, args), args)


def backward(t, one_pass):
    """The whole backward as the launcher runs it: the one-pass kernel, or (``deterministic``) the pair."""
    q, k, v, do, out, lse, args = t
    grads = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    launch.backward(do, q, k, v, out, lse, replace(args, deterministic=not one_pass), *grads)
    return grads


# The knobs of kernels/bwd_sm90_ws.py (configs.OnePassConfig fields over the head dim's with every knob off,
# "default"); dq_rows at head dim 64 alone (128-row steps), s_ahead at 128 alone.
KNOBS = {"default": {}, "dq_first": dict(dq_first=True), "dk_rs": dict(dk_rs=True),
         "both": dict(dq_first=True, dk_rs=True), "dq_rows": dict(dq_rows=True),
         "fa3": dict(dq_first=True, dk_rs=True, dq_rows=True), "s_ahead": dict(s_ahead=True),
         "s_ahead_dq_first": dict(s_ahead=True, dq_first=True)}


def knob_applies(knobs: dict, head_dim: int) -> bool:
    """Whether the launcher takes ``knobs`` at ``head_dim``: dq_rows at 64 alone, s_ahead at 128 alone."""
    return (head_dim == 64 or "dq_rows" not in knobs) and (head_dim == 128 or "s_ahead" not in knobs)


def one_pass_backward(t, tiles):
    """The backward with the one-pass kernel's knobs ``tiles`` (a configs.OnePassConfig)."""
    q, k, v, do, out, lse, args = t
    grads = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    launch.backward(do, q, k, v, out, lse, args, *grads, one_pass=tiles)
    return grads


def reference(t):
    """float32 attention's gradients on upcast inputs (small shapes only)."""
    q, k, v, do, out, lse, args = t
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    B, S, H, D = q.shape
    g = H // k.shape[2]
    kr, vr = (x.repeat_interleave(g, dim=2) for x in (kf, vf))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kr) * args.softmax_scale
    if args.softcap > 0:
        s = args.softcap * torch.tanh(s / args.softcap)
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    keep = torch.ones(S, S, dtype=torch.bool, device=q.device)
    if args.window_right >= 0:
        keep &= j <= i + args.window_right
    if args.window_left >= 0:
        keep &= j >= i - args.window_left
    s = s.masked_fill(~keep, float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vr)
    o.backward(do.float())
    return qf.grad, kf.grad, vf.grad


def packed(options, seed=0, nheads=16, nheads_kv=16):
    """Packed sequences of 16 lengths drawn from 128..4096, their inputs and dO; ``seqused`` in ``options``:
    each sequence uses 7/8 of its keys."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(128, 4097, (16,), generator=g)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to("cuda", torch.int32)
    total, longest = int(lengths.sum()), int(lengths.max())
    q, k, v, do = (torch.randn(total, h, 128, generator=g).to("cuda", torch.bfloat16)
                   for h in (nheads, nheads_kv, nheads_kv, nheads))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    options = dict(options)
    if options.pop("seqused", False):
        options["seqused_k"] = (lengths * 7 // 8).to("cuda", torch.int32)
    if options.pop("alibi", False):
        options["alibi_slopes"] = 2.0 ** (-8.0 * torch.arange(1, nheads + 1, device="cuda") / nheads)
    window = options.get("window_size", (-1, 0))[0]
    visible = sum(visible_pairs(n, True, window) for n in lengths.tolist())
    return (q, k, v, cu, longest, do, options), visible


def packed_backward(t, one_pass):
    """Forward, then the backward alone (``retain_graph``): one-pass, or (``deterministic``) the pair."""
    q, k, v, cu, longest, do, options = t
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True,
                                           deterministic=not one_pass, **options)
    return lambda: out.backward(do, retain_graph=True)


def old_kernel(path: str):
    """The one-pass launch with the kernel source at ``path``."""
    from flashtile.backends.triton.fastlaunch import CachedLaunch
    module = kernel_copy(path, "_bwd_sm90_ws_old")
    return CachedLaunch(module.attn_bwd_sm90_ws, launch._BWD_WS.dynamic_names)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


if __name__ == "__main__":
    res = dict(torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(),
               commit=os.environ.get("FLASHTILE_GIT_COMMIT", ""), check=[], time=[])
    modes = [a for a in sys.argv[1:] if "=" not in a] or ["check", "time"]
    rounds = int(dict(a.split("=") for a in sys.argv[1:] if "=" in a).get("ROUNDS", 3))
    ok = True
    if "check" in modes:
        for shape in [(2, 1000, 4, 4), (1, 1037, 4, 2), (2, 384, 8, 2), (1, 77, 2, 1), (1, 2048, 4, 4)]:
            for window in ((-1, -1), (-1, 0), (200, 0), (100, 37)):
                for cap in (0.0, 30.0):
                    t = make(*shape, window, cap, seed=1)
                    ref = reference(t) if shape[1] <= 1100 else None
                    pair, one = backward(t, False), backward(t, True)
                    d_pair = [rel(a, b) for a, b in zip(one, pair)]
                    row = dict(shape=shape, window=window, softcap=cap, one_vs_pair=d_pair)
                    if ref is not None:
                        row["one_vs_ref"] = [rel(a, r) for a, r in zip(one, ref)]
                        row["pair_vs_ref"] = [rel(a, r) for a, r in zip(pair, ref)]
                        bad = any(not (e <= 2 * p + 1e-3) for e, p in zip(row["one_vs_ref"], row["pair_vs_ref"]))
                    else:
                        bad = any(not (e <= 2e-2) for e in d_pair)
                    bad = bad or any(torch.isnan(x).any().item() for x in one)
                    ok &= not bad
                    row["ok"] = not bad
                    res["check"].append(row)
                    print("check", shape, window, cap, "one/pair", ["%.1e" % e for e in d_pair],
                          "one/ref", ["%.1e" % e for e in row.get("one_vs_ref", [])],
                          "pair/ref", ["%.1e" % e for e in row.get("pair_vs_ref", [])], "BAD" if bad else "", flush=True)
        print("checks", "pass" if ok else "FAIL", flush=True)
    if "time" in modes:
        variants = [("pair", False, 0.0), ("pair_sc", False, 50.0), ("one", True, 0.0), ("one_sc", True, 50.0),
                    ("pair_alibi", False, "alibi"), ("one_alibi", True, "alibi")]
        shapes = [(shape, window) for shape in [(4, 4096, 16, 16), (2, 8192, 16, 16), (4, 4096, 32, 8),
                                                (8, 2048, 16, 16)] for window in ((-1, -1), (-1, 0))]
        shapes += [((1, 16384, 16, 16), (-1, 0)), ((1, 16384, 16, 16), (1024, 0))]
        for shape, window in shapes:
            inputs = {c: make(*shape, window, 0.0 if c == "alibi" else c, alibi=c == "alibi")
                      for c in (0.0, 50.0, "alibi")}
            times = {v[0]: [] for v in variants}
            for _ in range(rounds):
                for name, o, c in variants:
                    times[name].append(time_it(lambda: backward(inputs[c], o), n=5, calls=10))
            med = {key: sorted(ts)[rounds // 2] for key, ts in times.items()}
            B, S, H, _ = shape
            # Visible pairs: all, half (causal), or about a window's width a row.
            keys = S if window[0] < 0 else window[0] + 1
            flops = 2.5 * 4 * B * H * S * keys * 128 / (2 if window == (-1, 0) else 1)
            row = dict(shape=shape, window=window, ms=med, tflops={k: flops / v / 1e9 for k, v in med.items()})
            res["time"].append(row)
            print("time", shape, window, "  ".join(
                f"{k}={v:.3f}({row['tflops'][k]:.0f}, x{v / med['pair']:.2f})" for k, v in med.items()),
                "| sc/one %.2f alibi/one %.2f" % (med["one_sc"] / med["one"], med["one_alibi"] / med["one"]),
                flush=True)
    if "varlen" in modes:
        res["varlen"] = []
        for name, options in [("causal", {}), ("window-1024", dict(window_size=(1024, 0))),
                              ("softcap-50", dict(softcap=50.0)), ("alibi", dict(alibi=True)),
                              ("seqused", dict(seqused=True)), ("window-softcap", dict(window_size=(4095, 0), softcap=50.0))]:
            t, visible = packed(options)
            runs = {"pair": packed_backward(t, False), "one": packed_backward(t, True)}
            kernels = {}
            for key, fn in runs.items():
                flashtile.reset_stats()
                fn()
                kernels[key] = [k for k in flashtile.stats()["kernels"] if k.startswith("flashtile.bwd")]
            times = {key: [] for key in runs}
            for _ in range(rounds):
                for key, fn in runs.items():
                    times[key].append(time_it(fn, n=5, calls=5))
            med = {key: sorted(ts)[rounds // 2] for key, ts in times.items()}
            flops = 2.5 * 4 * 16 * visible * 128
            row = dict(case=name, ms=med, tflops={key: flops / v / 1e9 for key, v in med.items()}, kernels=kernels)
            res["varlen"].append(row)
            print("varlen", name, "  ".join(f"{key}={v:.3f}({row['tflops'][key]:.0f})" for key, v in med.items()),
                  "one/pair %.2f" % (med["one"] / med["pair"]), kernels, flush=True)
    if "ab" in modes:
        options = dict(a.split("=") for a in sys.argv[1:] if "=" in a)
        launches = {"new": launch._BWD_WS, "old": old_kernel(options["OLD"])}
        res["ab"] = []
        for shape, window, cap in [((1, 16384, 16, 16), (1024, 0), 0.0), ((1, 16384, 16, 16), (-1, 0), 0.0),
                                   ((4, 4096, 16, 16), (-1, 0), 0.0), ((4, 4096, 16, 16), (-1, -1), 0.0),
                                   ((2, 8192, 32, 8), (4095, 0), 50.0), ((8, 2048, 16, 16), (-1, 0), 0.0)]:
            t = make(*shape, window, cap)
            grads = {}
            times = {key: [] for key in launches}
            for _ in range(rounds):
                for key, fn in launches.items():
                    launch._BWD_WS = fn
                    grads[key] = backward(t, True)
                    times[key].append(time_it(lambda: backward(t, True), n=5, calls=10))
            launch._BWD_WS = launches["new"]
            med = {key: sorted(ts)[rounds // 2] for key, ts in times.items()}
            # dQ's reduce order varies run to run; dK and dV must not change.
            same = [rel(a, b) for a, b in zip(grads["new"], grads["old"])]
            row = dict(shape=shape, window=window, softcap=cap, ms=med, new_over_old=med["new"] / med["old"],
                       rel_diff_dq_dk_dv=same)
            res["ab"].append(row)
            print("ab", shape, window, cap, "  ".join(f"{k}={v:.3f}" for k, v in med.items()),
                  "new/old %.3f" % row["new_over_old"], "rel diff", ["%.1e" % d for d in same], flush=True)
    if "knobs" in modes:
        options = dict(a.split("=") for a in sys.argv[1:] if "=" in a)
        res["knobs"] = []
        for D in (int(d) for d in options.get("D", "128,64").split(",")):
            off = replace(launch.configs.one_pass_config(D), dq_first=False, dk_rs=False, dq_rows=False,
                          s_ahead=False)
            tiles = {name: replace(off, **knobs) for name, knobs in KNOBS.items() if knob_applies(knobs, D)}
            for S in (1024, 4096, 16384):
                for window in ((-1, -1), (-1, 0)):
                    B, H = 16384 // S, 2048 // D
                    t = make(B, S, H, H, window, 0.0, D=D)
                    grads = {name: one_pass_backward(t, c) for name, c in tiles.items()}
                    # dQ's reduce order varies run to run; each variant's gradients against the default's.
                    diff = {name: [rel(a, b) for a, b in zip(g, grads["default"])] for name, g in grads.items()}
                    good = all(d <= 2e-2 for ds in diff.values() for d in ds)
                    ok &= good
                    times = {name: [] for name in tiles}
                    for _ in range(rounds):
                        for name, c in tiles.items():
                            times[name].append(time_it(lambda: one_pass_backward(t, c), n=5, calls=10))
                    med = {name: sorted(ts)[rounds // 2] for name, ts in times.items()}
                    flops = 2.5 * 4 * B * H * S * S * D / (2 if window == (-1, 0) else 1)
                    row = dict(head_dim=D, shape=(B, S, H, H), window=window, ms=med,
                               tflops={name: flops / v / 1e9 for name, v in med.items()}, rel_diff_dq_dk_dv=diff,
                               ok=good)
                    res["knobs"].append(row)
                    print("knobs", f"d{D}", (B, S, H), "causal" if window == (-1, 0) else "full", "  ".join(
                        f"{name}={v:.3f}({row['tflops'][name]:.0f}, x{med['default'] / v:.3f})"
                        for name, v in med.items()), "" if good else "BAD " + str(diff), flush=True)
        print("knobs", "pass" if ok else "FAIL", flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_ws.json"), "w"), indent=1)
