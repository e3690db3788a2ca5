"""Short d=128 forwards: the Gluon Hopper kernel against the Triton one, through the public API, replayed.

Each shape runs both kernels (configs.GLUON_MIN_PAIRS moved out of the way or to 0), ``--rounds`` times
interleaved: forward TFLOP/s (triton.testing.do_bench, the suite's warm-up and repetitions) and the host
time per call of 400 back-to-back no-grad calls (the GPU's time where it is longer). Then the host time
at 1 x 128 tokens, where the GPU waits for the host, of a no-grad forward and a training step (fwd + bwd)
on each kernel, replayed and with replays turned off. bf16, head dim 128, batch x seqlen = 16384 tokens
(16/16 and 32/8 heads, full and causal) and a few smaller GQA batches. ``default`` says which kernel the
dispatcher picks.

    python benchmarks/gluon_short.py --rounds 2 -> $OUT (default /tmp)/h200-gluon-short-<date>.json
"""
import os, sys

import torch
import triton

import flashtile
from flashtile import dispatch, replay
from flashtile.backends.triton import configs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import measure_all, per_call_us, rounds_option, save_results  # noqa: E402

FLOOR = configs.GLUON_MIN_PAIRS
SHAPES = [(16384 // s, s, hq, hk, causal) for s in (512, 1024, 2048, 4096) for hq, hk in ((16, 16), (32, 8))
          for causal in (False, True)]
SHAPES += [(1, 1024, 32, 8, True), (4, 1024, 32, 8, True), (8, 512, 32, 8, True), (2, 2048, 32, 8, True),
           (1, 4096, 32, 8, True)]


def use_gluon(gluon: bool) -> None:
    """Every call the Gluon kernel can run takes it (or none does); plans and kernel names made under the
    other setting are forgotten."""
    configs.GLUON_MIN_PAIRS = 0 if gluon else 1 << 60
    dispatch.forget_plans()
    dispatch._describe.cache_clear()


def measure(batch, seqlen, hq, hk, causal, rounds):
    q = torch.randn(batch, seqlen, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, hk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pairs = batch * hq * seqlen * (seqlen // 2 if causal else seqlen)
    flops = 4 * pairs * 128
    row = dict(shape=f"{batch}x{seqlen}", heads=f"{hq}/{hk}", mask="causal" if causal else "full",
               default="gluon" if pairs >= FLOOR else "triton")
    outs = {}
    for _ in range(rounds):
        for gluon in (False, True):
            use_gluon(gluon)
            flashtile.reset_stats()
            fn = lambda: flashtile.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
            with torch.no_grad():
                outs[gluon] = fn()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                us = per_call_us(fn, 400)
            name = "gluon" if gluon else "triton"
            ran = list(flashtile.stats()["kernels"])
            if not all(("gluon-sm90" in n) == gluon for n in ran):
                raise RuntimeError(f"{name} was asked for, these ran: {ran}")
            row.setdefault(f"{name}_tflops", []).append(round(flops / ms / 1e9, 1))
            row.setdefault(f"{name}_us_per_call", []).append(round(us, 1))
    row["max_abs_diff"] = (outs[True].float() - outs[False].float()).abs().max().item()
    return row


def host_time():
    """us per call at 1 x 128 tokens, 32/8 heads, causal: (no-grad forward, forward + backward)."""
    q = torch.randn(1, 128, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    build, result = replay.build, {}
    try:
        for replayed in (True, False):
            replay.build = build if replayed else (lambda *args: "replays turned off")
            for gluon in (False, True):
                use_gluon(gluon)
                with torch.no_grad():
                    fwd = min(per_call_us(lambda: flashtile.flash_attn_func(q, k, v, causal=True), 400) for _ in range(3))
                step = min(per_call_us(lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True).backward(dout), 200)
                           for _ in range(3))
                name = f"{'gluon' if gluon else 'triton'}, {'replayed' if replayed else 'not replayed'}"
                result[name] = dict(no_grad_fwd_us=round(fwd, 1), fwd_bwd_us=round(step, 1))
    finally:
        replay.build = build
    return result


if __name__ == "__main__":
    rounds = rounds_option()
    try:
        rows = measure_all(lambda *shape: measure(*shape, rounds), SHAPES)
        host = host_time()
    finally:
        configs.GLUON_MIN_PAIRS = FLOOR
        dispatch.forget_plans()
        dispatch._describe.cache_clear()
    path = save_results("gluon-short", rows, f"python benchmarks/gluon_short.py --rounds {rounds}",
                        host_time_1x128_32_8_causal=host, gluon_min_pairs=FLOOR)
    print(f"{'shape':>8} {'heads':>6} {'mask':>6} {'triton TFLOP/s':>16} {'gluon TFLOP/s':>16} default")
    for r in rows:
        print(f"{r['shape']:>8} {r['heads']:>6} {r['mask']:>6} {str(r['triton_tflops']):>16} "
              f"{str(r['gluon_tflops']):>16} {r['default']}")
    for name, times in host.items():
        print(f"host, 1 x 128 32/8 causal, {name:>20}: {times}")
    print("wrote", path)
