"""The one-pass Hopper backward at head dim 64 against the dK/dV + dQ pair (configs.ONE_PASS_D64_MIN_PAIRS).

For each shape, causal and not: the backward on the pair (one_pass_bwd refused at d64) and on the one-pass kernel
wherever it would serve d128 (one_pass_bwd asked as if the head dim were 128, no pair floor), out/lse/gradients checked against the fp32 reference on
shapes up to 4096 x 4096 x 16 heads, then forward and forward+backward timed (median of 10 CUDA-event runs);
backward TFLOP/s = 2.5 x the forward's FLOPs over (fwd+bwd - fwd). Prints a line per run, writes JSON to --out.

    python benchmarks/one_pass_d64.py --out benchmarks/results/h200-one-pass-d64.json
"""
import argparse
import json

import torch

import flashtile
from flashtile import dispatch, testing
from flashtile.backends.triton import configs
from flashtile.bench import common

SHAPES = ((1, 4096, 16, 16, False), (1, 16384, 32, 32, False), (4, 4096, 32, 32, False), (2, 4096, 64, 8, True))
_ONE_PASS = configs.one_pass_bwd


def _allow_d64(allow: bool) -> None:
    """one_pass_bwd refusing d=64 (the pair), or taking it wherever it would take d=128."""
    def at_64(head_dim, head_dim_v, *args, **kwargs):
        if head_dim == 64 and not allow:
            return False
        return _ONE_PASS(128 if head_dim == 64 else head_dim, 128 if head_dim_v == 64 else head_dim_v, *args, **kwargs)
    configs.one_pass_bwd = at_64
    dispatch.forget_plans()
    dispatch._describe.cache_clear()


def _median_ms(fn, runs: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[runs // 2]


def run(batch, seqlen, nheads, nheads_kv, sink, causal, one_pass) -> dict:
    _allow_d64(one_pass)
    generator = torch.Generator().manual_seed(0)
    q, k, v = testing.make_qkv(batch, seqlen, seqlen, nheads, nheads_kv, 64, torch.bfloat16, "cuda",
                               generator=generator)
    dout = testing.random_like(q, generator)
    sink_t = (torch.randn(nheads, generator=generator) * 2).cuda().requires_grad_() if sink else None
    options = dict(causal=causal, sink=sink_t)
    leaves = [q, k, v] + ([sink_t] if sink else [])
    flashtile.reset_stats()
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    grads = torch.autograd.grad(out, leaves, dout)
    row = dict(B=batch, N=seqlen, H=nheads, Hkv=nheads_kv, sink=sink, causal=causal, one_pass_allowed=one_pass,
               kernels=sorted(flashtile.stats()["kernels"]), check="not checked (large)")
    if batch * seqlen * seqlen * nheads <= 4096 * 4096 * 16:
        ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv", "dsink"), grads))}
        refs = [testing.reference_results(q, k, v, dout, hi=hi, **options) for hi in (True, False)]
        try:
            testing.assert_results_close(ours, *refs, torch.bfloat16)
            row["check"] = "ok"
        except AssertionError as error:
            row["check"] = f"wrong: {str(error)[:200]}"

    def forward():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v, **options)

    def forward_backward():
        torch.autograd.grad(flashtile.flash_attn_func(q, k, v, **options), leaves, dout)

    fwd_ms, step_ms = _median_ms(forward), _median_ms(forward_backward)
    flops = common.fwd_flops(batch, nheads, seqlen, 64, causal)
    row.update(fwd_ms=fwd_ms, fwd_bwd_ms=step_ms, fwd_tflops=flops / fwd_ms / 1e9,
               bwd_tflops=2.5 * flops / (step_ms - fwd_ms) / 1e9)
    print(f"{batch}x{seqlen} {nheads}/{nheads_kv} sink={sink} causal={causal} one_pass={one_pass}: "
          f"bwd {row['bwd_tflops']:.0f} TFLOP/s, {row['check']}, {row['kernels']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="one-pass-d64.json")
    options = parser.parse_args()
    rows = [run(*shape, causal, one_pass) for shape in SHAPES for causal in (False, True) for one_pass in (False, True)]
    configs.one_pass_bwd = _ONE_PASS
    payload = {"env": common.base_env(), "gpu": torch.cuda.get_device_name(), "rows": rows}
    with open(options.out, "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
