"""Whether the backward runs at the GPU's power cap: the time per call of back-to-back backwards with the
Gluon and the Triton dK/dV kernel in turn, and the SM clock, power draw and throttle reasons nvidia-smi
reports meanwhile (sampled every half second).

bf16, 4 x 4096, 16 heads, d=128, full rows; four batches of 300 calls per variant, Gluon, Triton, Gluon.

    python benchmarks/bwd_power.py -> $OUT (default /tmp)/h200-bwd-power-<date>.json
"""
import os
import subprocess
import sys
import threading
import time

import torch

import flashtile
from flashtile.backends.triton import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import save_results  # noqa: E402

QUERY = "clocks.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"


def main():
    samples, stop = [], threading.Event()
    start = time.perf_counter()

    def sample():
        while not stop.is_set():
            line = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout.strip()
            samples.append(dict(t=round(time.perf_counter() - start, 2), **dict(zip(QUERY.split(","), line.split(", ")))))
            time.sleep(0.5)

    q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    rule = launch.gluon_dkdv_config
    thread = threading.Thread(target=sample)
    thread.start()
    time.sleep(1.0)
    rows = []
    for name, choose in (("gluon", rule), ("triton", lambda *args: None), ("gluon", rule)):
        launch.gluon_dkdv_config = choose
        for batch in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
            rows.append(dict(variant=name, batch=batch, us_per_call=round(1e6 * (time.perf_counter() - t0) / 300, 1),
                             t_end=round(time.perf_counter() - start, 2)))
            print(rows[-1], flush=True)
    launch.gluon_dkdv_config = rule
    stop.set()
    thread.join()
    for s in samples[::4]:
        print(s)
    print(save_results("bwd-power", rows, "python benchmarks/bwd_power.py", samples=samples))


if __name__ == "__main__":
    main()
