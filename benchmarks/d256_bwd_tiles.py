"""Backward tiles for head dim 256 (and 192/128, padded to it) on one GPU: every tile pair is compiled first
in parallel processes, then timed one at a time (bf16, 4 x 4096, median of 5 CUDA-event timings) and
checked against the old pair's gradients.

    python benchmarks/d256_bwd_tiles.py            # dK/dV tiles with the old dQ tile, then dQ tiles
    python benchmarks/d256_bwd_tiles.py --pairs    # the leading dK/dV x dQ tiles together

-> $OUT (default /tmp)/h200-bwd-d256-sweep[2]-<date>.json; configs.py keeps the summary."""
import datetime, json, os, sys, time, torch, multiprocessing as mp
from flashtile.backends import AttnArgs
from flashtile.backends.triton import launch
from flashtile.backends.triton.configs import TileConfig as T, BwdConfig, bwd_config
from d256_fwd_tiles import time_it  # this script's folder is on sys.path

DKDV = [(32, 64, 8, 1), (32, 64, 8, 2), (32, 64, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 3),
        (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 8, 1), (16, 128, 8, 2), (32, 128, 8, 1)]
DQ = [(64, 32, 8, 1), (64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2),
      (64, 16, 4, 2), (32, 32, 4, 3), (128, 64, 8, 1), (64, 64, 8, 1), (128, 32, 8, 1)]
BASE_DKDV, BASE_DQ = DKDV[0], DQ[0]
SHAPES = [(4, 4096, 8, 256, 256), (4, 4096, 10, 192, 128)]


DKDV2 = [(64, 32, 4, 2), (64, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (128, 32, 4, 2), (64, 32, 4, 1)]
DQ2 = [(128, 64, 8, 1), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 2), (256, 32, 8, 1)]


PAIRS = "--pairs" in sys.argv


def cfgs():
    if PAIRS:
        return [(BASE_DKDV, BASE_DQ)] + [(a, b) for a in DKDV2 for b in DQ2]
    return [(a, BASE_DQ) for a in DKDV] + [(BASE_DKDV, b) for b in DQ[1:]]


def make(shape, causal, seed=0):
    B, S, H, dqk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, S, H, dqk, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    args = AttnArgs(softmax_scale=dqk ** -0.5, causal=causal, window_right=0 if causal else -1)
    out, lse = launch.forward(q, k, v, args)
    return q, k, v, do, out, lse, args


def bwd(t, cfg):
    q, k, v, do, out, lse, args = t
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch.backward(do, q, k, v, out, lse, args, dq, dk, dv, config=cfg)
    return dq, dk, dv


def compile_one(job):
    (a, b), shape, causal = job
    try:
        t = make((1, 256) + shape[2:], causal)
        bwd(t, BwdConfig(T(*a), T(*b)))
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{a} {b} {shape} {causal}: {type(e).__name__} {str(e)[:200]}"


if __name__ == "__main__":
    t0 = time.time()
    jobs = [(c, s, causal) for c in cfgs() for s in SHAPES for causal in (False, True)]
    with mp.get_context("spawn").Pool(14) as pool:
        errs = [e for e in pool.map(compile_one, jobs, chunksize=1) if e]
    print("compiled", len(jobs), "in", round(time.time() - t0), "s; errors:", errs[:10], flush=True)
    res = {"torch": torch.__version__, "triton": __import__("triton").__version__,
           "device": torch.cuda.get_device_name(),
           "commit": os.environ.get("FLASHTILE_GIT_COMMIT", "?"), "rows": []}
    for shape in SHAPES:
        for causal in (False, True):
            t = make(shape, causal)
            B, S, H, dqk, dv = shape
            flops = 2.5 * 2 * B * H * S * S * (dqk + dv) * (0.5 if causal else 1.0)
            ref = bwd(t, BwdConfig(T(*BASE_DKDV), T(*BASE_DQ)))
            for a, b in cfgs():
                cfg = BwdConfig(T(*a), T(*b))
                try:
                    got = bwd(t, cfg)
                    err = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, ref))
                    ms = time_it(lambda: bwd(t, cfg), n=5, calls=1)
                except Exception as e:
                    print("fail", a, b, type(e).__name__, flush=True)
                    continue
                row = dict(shape=shape, causal=causal, dkdv=a, dq=b, ms=round(ms, 3),
                           tflops=round(flops / ms / 1e9, 1), err=err)
                res["rows"].append(row)
                print(row, flush=True)
    name = f"h200-bwd-d256-sweep{2 if PAIRS else ''}-{datetime.date.today()}.json"
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w"), indent=1)
