"""FP8 forward tiles per head dim (backends/triton/fp8.py FP8_TILES), and the d=64 forward on the Triton, warp-
specialized Gluon and Gluon 64x128 kernels (the kernels that ran are read from the profiler).

FP8: 2 x 8192 tokens, 2048 // d heads, bf16 inputs quantized once, the FP8 kernel alone per tile candidate, RMSE of
the first two heads against fp32 attention; d64: three shapes, causal and not. Times: flashtile.bench.common's GPU
timer (L2 flushed, median).

    python benchmarks/fp8_tiles.py [fp8|ws64|all]
"""
import sys

import torch

import flashtile
from flashtile import fp8, validation
from flashtile.backends.triton import quant, launch, configs
from flashtile.backends.triton import fp8 as kfp8
from flashtile.bench import common
from flashtile.testing import attention_ref

CANDS = {64: [(128, 4, True), (128, 4, False), (128, 6, False), (64, 4, True)],
         128: [(128, 4, False), (64, 4, True), (128, 3, False), (128, 2, False), (64, 6, False)],
         256: [(64, 4, False), (64, 3, False), (64, 2, False), (128, 2, False)]}


def main(which: str) -> None:
    timer = common.gpu_timer()
    if which in ("all", "fp8"):
        for d, cands in CANDS.items():
            chosen = kfp8.FP8_TILES[d]
            for causal in (False, True):
                b, n, h = 2, 8192, 2048 // d
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                args = validation.attn_args(q, k, v, causal=causal)
                with torch.no_grad():
                    qz = quant.quantize(q, k, v)
                    ref = attention_ref(*(t[:, :, :2] for t in (q, k, v)), causal=causal)[0]
                    flops = common.fwd_flops(b, h, n, d, causal)
                    for tile in cands:
                        kfp8.FP8_TILES[d] = tile
                        try:
                            out = fp8.attention(*qz, args, v_transposed=True)[0]
                            torch.cuda.synchronize()
                            rmse = float(((out[:, :, :2].float() - ref.float()) ** 2).mean().sqrt())
                            t = common.timing_fields("x", timer(lambda: fp8.attention(*qz, args, v_transposed=True)))["x_ms"]
                            print(f"fp8 d{d} causal={causal} tile={tile}: {t:.3f} ms {common.tflops(flops, t):.0f} TF rmse {rmse:.2e}", flush=True)
                        except Exception as e:
                            print(f"fp8 d{d} causal={causal} tile={tile}: ERROR {repr(e)[:150]}", flush=True)
                    kfp8.FP8_TILES[d] = chosen
    if which in ("all", "ws64"):
        from torch.profiler import profile, ProfilerActivity
        orig = launch.forward
        for b, n, h in ((1, 16384, 32), (4, 4096, 32), (8, 2048, 32)):
            for causal in (False, True):
                q, k, v = (torch.randn(b, n, h, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = common.fwd_flops(b, h, n, 64, causal)
                res = []
                for name, cfg in (("triton", None), ("ws", configs._FWD_SM90_GLUON_WS), ("gluon64x128", configs._FWD_SM90_GLUON_WIDE)):
                    launch.forward = lambda q_, k_, v_, a, config=None, c=cfg: orig(q_, k_, v_, a, config or c)
                    from flashtile import dispatch
                    dispatch.forget_plans(); dispatch._describe.cache_clear()
                    with torch.no_grad():
                        out = flashtile.flash_attn_func(q, k, v, causal=causal)
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            flashtile.flash_attn_func(q, k, v, causal=causal); torch.cuda.synchronize()
                        kern = sorted({e.name[:24] for e in prof.events() if "attn" in e.name})
                        ok = ""
                        if b * n <= 16384 and n <= 4096:
                            ref = attention_ref(q[:, :, :2], k[:, :, :2], v[:, :, :2], causal=causal)[0]
                            err = float((out[:, :, :2].float() - ref.float()).abs().max())
                            ok = f"maxerr {err:.2e}"
                        t = common.timing_fields("x", timer(lambda: flashtile.flash_attn_func(q, k, v, causal=causal)))["x_ms"]
                    res.append(f"{name} {common.tflops(flops, t):.0f} TF {kern} {ok}")
                launch.forward = orig
                print(f"d64 fwd b{b} n{n} h{h} causal={causal}: " + " | ".join(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
