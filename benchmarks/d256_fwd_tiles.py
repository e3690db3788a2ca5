"""Forward tiles (Triton kernel) for head dim 256 and 192/128 on one GPU: every tile is compiled first in
parallel processes, then timed one at a time (bf16, median of 7 CUDA-event timings) and checked against
the old tile's output.

    python benchmarks/d256_fwd_tiles.py    -> $OUT (default /tmp)/h200-fwd-d256-sweep-<date>.json"""
import datetime, json, os, time, torch, multiprocessing as mp
from flashtile.backends import AttnArgs
from flashtile.backends.triton import launch
from flashtile.backends.triton.configs import TileConfig as T

CFGS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 2),
        (64, 128, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2), (64, 64, 8, 2), (128, 128, 8, 1), (64, 128, 4, 2)]
SHAPES = [(4, 4096, 8, 256, 256), (4, 4096, 10, 192, 128), (1, 16384, 8, 256, 256)]


def make(shape, causal):
    B, S, H, dqk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, S, H, dqk, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, AttnArgs(softmax_scale=dqk ** -0.5, causal=causal, window_right=0 if causal else -1)


def compile_one(job):
    c, shape, causal = job
    try:
        q, k, v, a = make((1, 512) + shape[2:], causal)
        launch.forward(q, k, v, a, config=T(*c)); torch.cuda.synchronize()
    except Exception as e:
        return f"{c} {shape[3:]} {causal}: {type(e).__name__}"


def time_it(fn, n=7, calls=2):
    """Median over ``n`` CUDA-event timings of ``calls`` back-to-back calls, in ms per call."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) / calls)
    return sorted(ts)[n // 2]


if __name__ == "__main__":
    t0 = time.time()
    jobs = [(c, s, causal) for c in CFGS for s in SHAPES[:2] for causal in (False, True)]
    with mp.get_context("spawn").Pool(14) as pool:
        errs = [e for e in pool.map(compile_one, jobs, chunksize=1) if e]
    print("compiled", len(jobs), "in", round(time.time() - t0), "s; errors:", errs, flush=True)
    res = {"torch": torch.__version__, "triton": __import__("triton").__version__,
           "device": torch.cuda.get_device_name(),
           "rows": []}
    for shape in SHAPES:
        for causal in (False, True):
            q, k, v, a = make(shape, causal)
            B, S, H, dqk, dv = shape
            flops = 2 * B * H * S * S * (dqk + dv) * (0.5 if causal else 1.0)
            ref = launch.forward(q, k, v, a, config=T(*CFGS[0]))[0]
            best = None
            for c in CFGS:
                try:
                    o = launch.forward(q, k, v, a, config=T(*c))[0]
                    err = float((o.float() - ref.float()).abs().max())
                    ms = time_it(lambda: launch.forward(q, k, v, a, config=T(*c)))
                except Exception as e:
                    continue
                row = dict(shape=shape, causal=causal, cfg=c, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                           err=err)
                res["rows"].append(row)
                print(row, flush=True)
    name = f"h200-fwd-d256-sweep-{datetime.date.today()}.json"
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w"), indent=1)
