"""The backward with dQ added by atomics inside the Gluon dK/dV kernel (kernels/bwd_sm90.py, the default on
Hopper) against the deterministic backward (``deterministic=True``: the Triton dQ kernel recomputes S and dP)
and cuDNN's backward (SDPA's backend), in one run.

bf16, d=128, through ``flash_attn_func`` and autograd. Each variant's gradients are first checked against
float32 attention of KV head 0 and its query heads (cuDNN's too, for scale); the atomic variant's dQ is
compared between two runs (``dq run-to-run``: atomics add in no fixed order). Timing: interleaved rounds of
CUDA events over 20 back-to-back backward calls on one retained graph; per-kernel times from the profiler;
peak memory of one backward call beyond what was allocated before it.

    python benchmarks/bwd_gluon_atomic_dq.py --rounds 3 -> $OUT (default /tmp)/h200-bwd-gluon-atomic-dq-<date>.json
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_dkdv_gluon import kernel_us, reference_grads  # noqa: E402
from host_time import events_us, measure_all, rounds_option, save_results  # noqa: E402

# (batch, seqlen, query heads, KV heads, window (left, right), feature: "" or "softcap" (50))
SHAPES = [(4, 4096, 16, 16, (-1, -1), ""), (4, 4096, 16, 16, (-1, 0), ""), (2, 8192, 16, 16, (-1, 0), ""),
          (1, 16384, 16, 16, (-1, 0), ""), (16, 1024, 16, 16, (-1, -1), ""), (8, 2048, 16, 16, (-1, 0), ""),
          (4, 4096, 32, 8, (-1, 0), ""), (1, 16384, 32, 8, (-1, -1), ""), (1, 16384, 16, 16, (1024, 0), ""),
          (4, 4096, 16, 16, (-1, -1), "softcap"), (2, 8192, 16, 16, (-1, 0), "softcap")]


def peak_mib(fn):
    """Memory a call allocates at its peak beyond what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def max_errors(grads, ref):
    return [round((a.float() - b).abs().max().item(), 4) for a, b in zip(grads, ref)]


def measure(batch, seqlen, heads, heads_kv, window, feature, rounds):
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    softcap = 50.0 if feature == "softcap" else 0.0
    ref = reference_grads(q, k, v, dout, window, softcap, None)
    group = heads // heads_kv
    row = dict(shape=f"{batch}x{seqlen}", heads=f"{heads}/{heads_kv}", window=list(window), feature=feature)
    variants = {"atomic": False, "deterministic": True}
    calls, us, kernels, memory = {}, {name: [] for name in variants}, {}, {}
    for name, deterministic in variants.items():
        out = flashtile.flash_attn_func(q, k, v, window_size=window, softcap=softcap, deterministic=deterministic)
        calls[name] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        first, again = calls[name](), calls[name]()
        row[f"{name} max err (dq, dk, dv)"] = max_errors((first[0][:, :, :group], first[1][:, :, :1],
                                                          first[2][:, :, :1]), ref)
        row[f"{name} dq run-to-run"] = (first[0].float() - again[0].float()).abs().max().item()
        kernels[name] = kernel_us(calls[name])
        memory[name] = peak_mib(calls[name])
    if not feature and window[0] < 0 and heads == heads_kv:
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=window[1] == 0)
        calls["cudnn"] = lambda: torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
        theirs = [g.transpose(1, 2) for g in calls["cudnn"]()]
        row["cudnn max err (dq, dk, dv)"] = max_errors((theirs[0][:, :, :1], theirs[1][:, :, :1], theirs[2][:, :, :1]),
                                                       ref)
        memory["cudnn"] = peak_mib(calls["cudnn"])
        us["cudnn"] = []
    for _ in range(rounds):
        for name, call in calls.items():
            us[name].append(events_us(call))
    causal = window == (-1, 0)
    keys = seqlen if window[0] < 0 else window[0] + 1
    pairs = batch * heads * seqlen * (seqlen / (2 if causal else 1) if window[0] < 0 else keys)
    flops = 2.5 * 4 * pairs * 128
    row.update(us={n: [round(t, 1) for t in ts] for n, ts in us.items()}, kernels_us=kernels, peak_mib=memory,
               **{"median TFLOP/s": {n: round(flops / sorted(t)[len(t) // 2] / 1e6) for n, t in us.items()}})
    return row


if __name__ == "__main__":
    rounds = rounds_option(3)
    rows = measure_all(lambda *shape: measure(*shape, rounds), SHAPES)
    path = save_results("bwd-gluon-atomic-dq", rows, f"python benchmarks/bwd_gluon_atomic_dq.py --rounds {rounds}",
                        flashtile=flashtile.__version__)
    for r in rows:
        print(f"{r['shape']:>8} {r['heads']:>6} {str(r['window']):>11} {r['feature']:<8}",
              " ".join(f"{n}={v}" for n, v in r["median TFLOP/s"].items()), "err", r["atomic max err (dq, dk, dv)"],
              r["deterministic max err (dq, dk, dv)"])
    print(path)
