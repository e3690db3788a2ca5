"""The one-pass backward's knobs at d192/dv128 bf16 on one Hopper GPU.

Shapes: the headline's 16k row (B=1, H=10, N=16384) full and causal, the DeepSeek model row (B=2, H=16, N=4096,
causal), and DeepSeek's training batch as packed documents (16384 tokens in 8 sequences of 263 to 4096, H=16,
causal; kernels/bwd_sm90_wide96.py's IS_VARLEN). Each variant (configs.OnePassConfig through launch.backward's
``one_pass``) is compiled first in parallel processes (one per variant, mask and dense/packed, filling Triton's disk
cache), then checked -- out, LSE, dQ, dK, dV of the
first CHECK_HEADS heads against the float32 reference under the tolerance rule, gradients poisoned first -- and
then the backward alone is timed with triton.testing.do_bench, interleaved over ROUNDS rounds.

    python benchmarks/bwd_one_pass_192.py     # table on stdout, JSON to $OUT/bwd192_sweep.json (or ./)
    SWEEP_SHAPES=packed SWEEP_VARIANTS=keys96 python benchmarks/bwd_one_pass_192.py
        # the shapes whose label contains a word, the variants named (and main, the 64-key kernel, always)

Evidence for configs.ONE_PASS_96. BUDGET_S (default 200) bounds the run's seconds.

TFLOP/s: the suite's convention (flashtile/bench/common.py): 2.5 x 2 B H N^2 (d + dv), halved when causal.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import torch

T0 = time.time()
ROUNDS = 2
CHECK_HEADS = 2
# Seconds after which timing stops (the lead's call is limited to 120 s).
BUDGET_S = int(os.environ.get("BUDGET_S", 200))
# (label, batch, heads, seqlen, causal, packed sequence lengths or None): packed shapes' batch and seqlen are their
# sequences' count and the longest.
PACKED_16K = [4096, 1537, 3000, 263, 2048, 1999, 3073, 368]
SHAPES = [("16k full", 1, 10, 16384, False, None), ("16k causal", 1, 10, 16384, True, None),
          ("deepseek 2x4k causal", 2, 16, 4096, True, None),
          ("deepseek packed 16k causal", len(PACKED_16K), 16, max(PACKED_16K), True, PACKED_16K)]
# OnePassConfig fields over the 64-key wide kernel's ("main": configs.one_pass_config(192), what 192/128 calls with
# softcap, ALiBi or a window on packed sequences run).
# keys96: the 96-key kernel (kernels/bwd_sm90_wide96.py) with its own registers (configs.one_pass_config).
VARIANTS = {
    "main": {},
    "dq_first": dict(dq_first=True),
    "release_each": dict(release_each=True),
    "rotate": dict(rotate=True),
    "all3": dict(dq_first=True, release_each=True, rotate=True),
    "stages1": dict(stages=1),
    "keys96": dict(keys96=True),
    "keys96+ds2": dict(keys96=True, ds_bufs=2),
}
# Seconds the parallel compiles may take before a variant is dropped (a hang, or a compile that slow).
WARM_S = 75
D, DV = 192, 128
# SWEEP_DRY=1: the script's own plumbing on the CPU (interpreter, float32, tiny shapes, the default backward, a
# wall-clock timer), to catch its bugs before a device call.
DRY = os.environ.get("SWEEP_DRY") == "1"
DEVICE, DTYPE = ("cpu", torch.float32) if DRY else ("cuda", torch.bfloat16)
if DRY:
    SHAPES = [("dry full", 1, 3, 97, False, None), ("dry causal", 2, 2, 65, True, None),
              ("dry packed causal", 4, 2, 65, True, [37, 0, 65, 1])]
    VARIANTS = {"main": {}, "dq_first": dict(dq_first=True)}
if os.environ.get("SWEEP_SHAPES"):
    SHAPES = [shape for shape in SHAPES if os.environ["SWEEP_SHAPES"] in shape[0]]
if os.environ.get("SWEEP_VARIANTS"):
    VARIANTS = {name: knobs for name, knobs in VARIANTS.items()
                if name == "main" or name in os.environ["SWEEP_VARIANTS"].split(",")}


def _cu(lengths):
    from flashtile.testing import cu_seqlens_of
    return cu_seqlens_of(lengths, DEVICE)


def _args(causal, lengths=None):
    """The call's arguments; ``lengths``: packed sequences' (the same for queries and keys)."""
    from flashtile.backends import AttnArgs
    packed = {}
    if lengths:
        packed = dict(cu_seqlens_q=_cu(lengths), cu_seqlens_k=_cu(lengths), max_seqlen_q=max(lengths),
                      max_seqlen_k=max(lengths), total_k=sum(lengths))
    return AttnArgs(softmax_scale=D ** -0.5, causal=causal, window_right=0 if causal else -1, **packed)


def _inputs(batch, heads, seqlen, lengths=None, seed=0):
    """q, k, v, dout: ``(batch, seqlen, heads, d)``, or packed ``(tokens, heads, d)`` of ``lengths``."""
    from flashtile.testing import make_qkv
    gen = torch.Generator().manual_seed(seed)
    if lengths:
        batch, seqlen = 1, sum(lengths)
    q, k, v = make_qkv(batch, seqlen, seqlen, heads, heads, D, DTYPE, DEVICE, requires_grad=False, generator=gen)
    v = v[..., :DV].contiguous()
    dout = torch.randn(batch, seqlen, heads, DV, generator=gen).to(DEVICE, DTYPE)
    if lengths:
        return tuple(t[0] for t in (q, k, v, dout))
    return q, k, v, dout


def _tiles(name):
    from flashtile.backends.triton import configs
    return replace(configs.one_pass_config(D, VARIANTS[name].get("keys96", False)), **VARIANTS[name])


def _backward(q, k, v, dout, out, lse, args, tiles, grads=None):
    from flashtile.backends.triton import launch
    grads = grads or [torch.empty_like(t) for t in (q, k, v)]
    launch.backward(dout, q, k, v, out, lse, args, *grads, one_pass=None if DRY else tiles)
    return grads


def warm(name, causal, packed):
    """One variant and mask (dense or packed) on a small call of the same specialization: Triton's disk cache gets
    its kernels."""
    from flashtile.backends.triton import launch
    lengths = ([65, 1, 40] if DRY else [2048, 1000, 3000, 2000, 200]) if packed else None
    q, k, v, dout = _inputs(1, 2, 65, lengths) if DRY else _inputs(1, 10, 2048, lengths)
    args = _args(causal, lengths)
    out, lse = launch.forward(q, k, v, args)
    _backward(q, k, v, dout, out, lse, args, _tiles(name))
    if not DRY:
        torch.cuda.synchronize()


def _bench(fn):
    """Milliseconds a call: do_bench's median on the GPU, one timed call in a dry run."""
    import triton
    if DRY:
        start = time.time()
        fn()
        return (time.time() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def main():
    import triton

    from flashtile.backends.triton import launch
    from flashtile.bench.common import BWD_FLOPS_FACTOR, attn_flops
    from flashtile.testing import assert_results_close, reference_results

    out_dir = os.environ.get("OUT", ".")
    # Compile every (variant, mask) at once, one process each; then this process reads Triton's disk cache.
    kinds = sorted({(causal, lengths is not None) for *_, causal, lengths in SHAPES})
    warms = [(name, causal, packed) for name in VARIANTS for causal, packed in kinds]
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", name, str(int(causal)), str(int(packed))],
                              stderr=subprocess.PIPE) for name, causal, packed in warms]
    warm_errors, failed = {}, set()
    for p, (name, causal, packed) in zip(procs, warms):
        try:
            _, err = p.communicate(timeout=max(1.0, WARM_S - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = b"timed out (killed): " + err
        if p.returncode:
            warm_errors[f"{name} causal={causal} packed={packed}"] = err.decode()[-400:]
            failed.add((name, causal, packed))
    print(f"[{time.time() - T0:.0f}s] warm done; failures: {list(warm_errors) or 'none'}", flush=True)
    for key, err in warm_errors.items():
        print(key, err, flush=True)

    cases, results = [], {}
    for label, batch, heads, seqlen, causal, lengths in SHAPES:
        packed = lengths is not None
        q, k, v, dout = _inputs(batch, heads, seqlen, lengths)
        args = _args(causal, lengths)
        out, lse = launch.forward(q, k, v, args)
        # The first CHECK_HEADS heads: dim 2 of (batch, seqlen, heads, d), 1 of packed (tokens, heads, d); lse's
        # heads lead packed (heads, tokens).
        h = slice(0, CHECK_HEADS)
        heads_of = (lambda t: t[:, h]) if packed else (lambda t: t[:, :, h])
        lse_heads = (lambda t: t[h]) if packed else (lambda t: t[:, h])
        sequences = dict(cu_seqlens_q=args.cu_seqlens_q, cu_seqlens_k=args.cu_seqlens_k) if packed else {}
        sub = [heads_of(t) for t in (q, k, v, dout)]
        ref_hi = reference_results(*sub, hi=True, causal=causal, **sequences)
        ref_lo = reference_results(*sub, hi=False, causal=causal, **sequences)
        ref_hi = {n: t.detach() for n, t in ref_hi.items()}
        ref_lo = {n: t.detach() for n, t in ref_lo.items()}
        flops = sum(attn_flops(1, heads, n, n, D, causal, DV) for n in lengths or [seqlen] * batch) * BWD_FLOPS_FACTOR
        case = dict(label=label, q=q, k=k, v=v, dout=dout, out=out, lse=lse, args=args, flops=flops, ok=[])
        for name in VARIANTS:
            row = results.setdefault((label, name), dict(shape=label, variant=name, knobs=asdict(_tiles(name)),
                                                         ms=[], check=None))
            if (name, causal, packed) in failed:
                row["check"] = "not run: its compile failed or timed out"
                continue
            if time.time() - T0 > BUDGET_S - 25:
                row["check"] = "not run: out of time"
                continue
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            try:
                _backward(q, k, v, dout, out, lse, args, _tiles(name), grads)
                ours = {"out": heads_of(out), "lse": lse_heads(lse),
                        **dict(zip(("dq", "dk", "dv"), (heads_of(g) for g in grads)))}
                assert_results_close(ours, ref_hi, ref_lo, DTYPE)
                row["check"] = "ok"
                case["ok"].append(name)
            except Exception as e:  # a failing variant is reported and not timed; the sweep goes on
                row["check"] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
        del ref_hi, ref_lo
        torch.cuda.empty_cache()
        cases.append(case)
        print(f"[{time.time() - T0:.0f}s] checked {label}: {case['ok']}", flush=True)

    for rnd in range(ROUNDS):
        for case in cases:
            for name in case["ok"]:
                if time.time() - T0 > BUDGET_S:
                    break
                grads = [torch.empty_like(t) for t in (case["q"], case["k"], case["v"])]
                tiles = _tiles(name)
                fn = lambda: _backward(case["q"], case["k"], case["v"], case["dout"], case["out"],  # noqa: E731
                                       case["lse"], case["args"], tiles, grads)
                results[(case["label"], name)]["ms"].append(_bench(fn))
        print(f"[{time.time() - T0:.0f}s] round {rnd} done", flush=True)

    flops = {c["label"]: c["flops"] for c in cases}
    print(f"\n{'shape':22s} {'variant':18s} {'ms':>8s} {'TFLOP/s':>8s} {'vs main':>8s}  check")
    for (label, name), row in results.items():
        ms = sum(row["ms"]) / len(row["ms"]) if row["ms"] else None
        row["ms_mean"] = ms
        row["tflops"] = flops[label] / (ms * 1e-3) / 1e12 if ms else None
        main_ms = results[(label, "main")].get("ms_mean")
        row["ratio_to_main"] = main_ms / ms if ms and main_ms else None
        fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
        print(f"{label:22s} {name:18s} {fmt(ms, '8.3f')} {fmt(row['tflops'], '8.1f')} "
              f"{fmt(row['ratio_to_main'], '8.3f')}  {row['check'][:60]}")
    doc = dict(device="cpu (dry run)" if DRY else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               flops="2.5 x 2 B H N^2 (d + dv), halved when causal", rounds=ROUNDS, warm_errors=warm_errors,
               elapsed_s=time.time() - T0, rows=list(results.values()))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bwd192_sweep.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[{time.time() - T0:.0f}s] wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--warm":
        warm(sys.argv[2], bool(int(sys.argv[3])), bool(int(sys.argv[4])))
    else:
        main()
