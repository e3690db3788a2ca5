"""The Gluon dK/dV backward (kernels/bwd_sm90.py) against bwd.py's Triton dK/dV kernel it replaces, and
against cuDNN's backward (SDPA's backend), in one run: evidence for configs.gluon_dkdv_config.

bf16, d=128, through ``flash_attn_func`` and autograd (the dQ kernel is the Triton one either way); the
Triton variant runs with ``launch.gluon_dkdv_config`` returning None. Each variant's gradients are first
checked against float32 attention of KV head 0 and its query heads. Timing: interleaved rounds of CUDA events over 20
back-to-back backward calls on one retained graph; per-kernel times from the profiler.

    python benchmarks/bwd_dkdv_gluon.py --rounds 3 -> $OUT (default /tmp)/h200-bwd-dkdv-gluon-<date>.json
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.backends.triton import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import events_us, measure_all, rounds_option, save_results  # noqa: E402

# (batch, seqlen, query heads, KV heads, window (left, right), feature: "", "softcap" (50) or "alibi")
SHAPES = [(4, 4096, 16, 16, (-1, -1), ""), (4, 4096, 16, 16, (-1, 0), ""), (2, 8192, 16, 16, (-1, 0), ""),
          (1, 16384, 16, 16, (-1, 0), ""), (16, 1024, 16, 16, (-1, -1), ""), (8, 2048, 16, 16, (-1, 0), ""),
          (4, 4096, 32, 8, (-1, 0), ""), (1, 16384, 32, 8, (-1, -1), ""), (1, 16384, 16, 16, (1024, 0), ""),
          (4, 4096, 16, 16, (-1, -1), "softcap"), (4, 4096, 16, 16, (-1, -1), "alibi"),
          (2, 8192, 16, 16, (-1, 0), "softcap"), (2, 8192, 16, 16, (-1, 0), "alibi")]


def reference_grads(q, k, v, dout, window, softcap, slopes):
    """float32 dq, dk, dv of KV head 0 and its query heads."""
    group = q.shape[2] // k.shape[2]
    leaves = [q[:, :, :group].float(), k[:, :, :1].float(), v[:, :, :1].float()]
    leaves = [t.detach().requires_grad_() for t in leaves]
    qf, kf, vf = (t.transpose(1, 2) for t in leaves)
    s = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    idx = torch.arange(s.shape[-1], device=s.device)
    if slopes is not None:
        s = s - slopes[:group].view(1, group, 1, 1) * (idx[:, None] - idx[None, :]).abs()
    if window[1] >= 0:
        s = s.masked_fill(idx[None, :] > idx[:, None] + window[1], float("-inf"))
    if window[0] >= 0:
        s = s.masked_fill(idx[None, :] < idx[:, None] - window[0], float("-inf"))
    out = (s.softmax(-1) @ vf).transpose(1, 2)
    return torch.autograd.grad(out, leaves, dout[:, :, :group].float())


def kernel_us(fn):
    """Mean device time per call of each of the backward's kernels, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and ("bwd" in event.key or "dkdv" in event.key):
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            times[event.key[:32]] = round(total / event.count, 1)
    return times


def measure(batch, seqlen, heads, heads_kv, window, feature, rounds):
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    softcap = 50.0 if feature == "softcap" else 0.0
    slopes = (2.0 ** (-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)) if feature == "alibi" else None
    options = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    rule = launch.gluon_dkdv_config
    variants = {"gluon": rule, "triton": lambda *args: None}
    ref = reference_grads(q, k, v, dout, window, softcap, slopes)
    row = dict(shape=f"{batch}x{seqlen}", heads=f"{heads}/{heads_kv}", window=list(window), feature=feature)
    graphs, us, kernels = {}, {name: [] for name in variants}, {}
    for name, choose in variants.items():
        launch.gluon_dkdv_config = choose
        out = flashtile.flash_attn_func(q, k, v, **options)
        graphs[name] = out
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        mine = (grads[0][:, :, :heads // heads_kv], grads[1][:, :, :1], grads[2][:, :, :1])
        row[f"{name} max err"] = round(max((a.float() - b).abs().max().item() for a, b in zip(mine, ref)), 4)
        kernels[name] = kernel_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    # cuDNN: plain rows only (SDPA takes no window, softcap or ALiBi).
    cudnn = None
    if not feature and window[0] < 0 and heads == heads_kv:
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = F.scaled_dot_product_attention(qt, kt, vt, is_causal=window[1] == 0)
        us["cudnn"] = []
    for _ in range(rounds):
        for name in variants:
            launch.gluon_dkdv_config = variants[name]
            out = graphs[name]
            us[name].append(events_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)))
        if cudnn is not None:
            grad = dout.transpose(1, 2)
            us["cudnn"].append(events_us(lambda: torch.autograd.grad(cudnn, (qt, kt, vt), grad, retain_graph=True)))
    launch.gluon_dkdv_config = rule
    causal = window == (-1, 0)
    keys = seqlen if window[0] < 0 else window[0] + 1
    pairs = batch * heads * seqlen * (seqlen / (2 if causal else 1) if window[0] < 0 else keys)
    flops = 2.5 * 4 * pairs * 128
    row.update(us={name: [round(t, 1) for t in times] for name, times in us.items()}, kernels_us=kernels,
               **{"median TFLOP/s": {name: round(flops / sorted(t)[len(t) // 2] / 1e6) for name, t in us.items()}})
    return row


if __name__ == "__main__":
    rounds = rounds_option(3)
    rows = measure_all(lambda *shape: measure(*shape, rounds), SHAPES)
    path = save_results("bwd-dkdv-gluon", rows, f"python benchmarks/bwd_dkdv_gluon.py --rounds {rounds}",
                        flashtile=flashtile.__version__)
    for r in rows:
        tf = r["median TFLOP/s"]
        print(f"{r['shape']:>8} {r['heads']:>6} {str(r['window']):>11} {r['feature']:<8}",
              " ".join(f"{n}={v}" for n, v in tf.items()))
    print(path)
