"""The Gluon Hopper forward at head dims other than 128: tile A/B against the Triton kernel and cuDNN
(evidence for configs._FWD_SM90_GLUON_D256 and gluon_ring).

The kernel is launched directly with each ring plan (key slots, value slots, Q in registers or in shared
memory), checked against the Triton kernel's output and lse, and timed with the Triton kernel (its table
tile, through ``launch.forward``) and SDPA's cuDNN backend in interleaved rounds (CUDA events over 10
back-to-back calls). Head dims: 256 (8 heads), 64 (32 heads), and 192/128 (10 heads) with Q and K read
through a 256-wide TMA box (the columns past 192 arrive as zeros) or in two parts, 128 + 64 columns
("split", the kernel's ``TAIL``). bf16.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/gluon_head_dims.py   # writes $OUT/gluon-head-dims.json

Head dims as arguments (``256 192``) run only those cases. ``gemma``: instead, d=256 calls shaped like Gemma-2's (16/8 heads, softcap 50, causal or a (4095, 0)
window; ALiBi and a sink too) through ``launch.forward``, the dispatcher's Gluon tile against the Triton
kernel's table tile; writes $OUT/gluon-d256-gemma.json.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.backends import AttnArgs
from flashtile.backends.triton import launch
from flashtile.backends.triton.configs import fixed_row_max, fwd_config
from flashtile.backends.triton.kernels.common import LOG2E
from flashtile.backends.triton.kernels.fwd_sm90 import attn_fwd_sm90

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from d256_fwd_tiles import time_it  # noqa: E402

REGS = {}
# name: (BLOCK_M, BLOCK_N, key slots, value slots, Q in registers[, split])
VARIANTS = {
    256: {"64x64 qs 2/2": (64, 64, 2, 2, False), "64x64 qs 1/1": (64, 64, 1, 1, False),
          "64x64 qs 2/1": (64, 64, 2, 1, False), "64x64 qs 1/2": (64, 64, 1, 2, False),
          "64x64 qr 2/2": (64, 64, 2, 2, True), "64x128 qs 1/2": (64, 128, 1, 2, False)},
    192: {"64x64 qs 2/2": (64, 64, 2, 2, False), "64x64 qs 1/1": (64, 64, 1, 1, False),
          "64x64 qs 1/2": (64, 64, 1, 2, False), "64x128 qs 1/2": (64, 128, 1, 2, False),
          "split 64x64 qr 2/2": (64, 64, 2, 2, True, True), "split 64x64 qs 2/2": (64, 64, 2, 2, False, True),
          "split 64x64 qs 1/2": (64, 64, 1, 2, False, True), "split 64x128 qs 1/2": (64, 128, 1, 2, False, True),
          "split 64x128 qs 1/1": (64, 128, 1, 1, False, True)},
    64: {"64x64 qr 2/2": (64, 64, 2, 2, True), "64x128 qr 2/2": (64, 128, 2, 2, True),
         "64x128 qr 3/3": (64, 128, 3, 3, True), "64x128 qs 2/2": (64, 128, 2, 2, False)},
}
# (head dim qk, head dim v, heads, batch, seqlen, mask)
CASES = [(256, 256, 8, 8, 2048, "full"), (256, 256, 8, 2, 8192, "full"), (256, 256, 8, 8, 2048, "causal"),
         (256, 256, 8, 2, 8192, "causal"), (256, 256, 8, 1, 16384, "window4096"), (256, 256, 8, 2, 8192, "softcap"),
         (192, 128, 10, 8, 2048, "full"), (192, 128, 10, 2, 8192, "full"), (192, 128, 10, 8, 2048, "causal"),
         (192, 128, 10, 2, 8192, "causal"),
         (64, 64, 32, 8, 2048, "full"), (64, 64, 32, 1, 16384, "full"), (64, 64, 32, 8, 2048, "causal"),
         (64, 64, 32, 1, 16384, "causal")]


def desc(t, rows):
    """The launcher's TMA descriptor, its box widened to a power of two (zero-filled past the head dim)."""
    width = 1 << (t.shape[3] - 1).bit_length()
    tile = (1, rows, 1, width)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(tile), launch._tma_layout(tile, t.dtype))


def gluon(q, k, v, a, BM, BN, KS, VS, QREGS, split=False):
    """The kernel on one ring plan; ``split``: a 192-wide q/k read as 128 + 64 columns (``TAIL``), else
    through a box padded to 256."""
    b, s, h, d = q.shape
    out, lse = q.new_empty(b, s, h, v.shape[-1]), torch.empty(b, h, s, device=q.device)
    if a.softcap > 0:
        qk_scale, softcap2 = a.softmax_scale / a.softcap, a.softcap * LOG2E
    else:
        qk_scale, softcap2 = a.softmax_scale * LOG2E, 0.0
    row_max = fixed_row_max(a.softcap, q.dtype, {"softcap"} if a.softcap > 0 else set())
    if split:
        descs = (desc(q[..., :128], BM), desc(k[..., :128], BN), desc(v, BN), desc(q[..., 128:], BM),
                 desc(k[..., 128:], BN))
    else:
        descs = (desc(q, BM), desc(k, BN), desc(v, BN), desc(q, BM), desc(k, BN))
    handle = attn_fwd_sm90[(-(-s // BM), h, b)](
        *descs, out, lse, qk_scale, softcap2, row_max or 0.0, a.window_left,
        a.window_right, q, 0, q, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), s,
        k.shape[1], h // k.shape[2], MASK_LEFT=a.window_left >= 0, MASK_RIGHT=a.window_right >= 0,
        SOFTCAP=a.softcap > 0, ALIBI=False, HAS_SINK=False, K_STAGES=KS, V_STAGES=VS, Q_IN_REGS=QREGS,
        FIXED_MAX=row_max is not None, TAIL=split, num_warps=4)
    REGS[f"d={d}/{v.shape[-1]} {BM}x{BN} {KS}/{VS} q_in_regs={QREGS} split={split}"] = (handle.n_regs,
                                                                                      handle.n_spills)
    return out, lse


def ibench(fns, rounds=7, n=10):
    """Median over interleaved rounds of the mean time of ``n`` back-to-back calls, in us."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(time_it(f, n=1, calls=n) * 1e3)
    return {name: round(sorted(t)[len(t) // 2], 1) for name, t in times.items()}


def main(head_dims):
    res = {"torch": torch.__version__, "triton": __import__("triton").__version__,
           "commit": os.environ.get("FLASHTILE_GIT_COMMIT", "?"), "device": torch.cuda.get_device_name(),
           "rows": [], "errors": {}}
    torch.manual_seed(0)
    for d, dv, h, b, s, mode in CASES:
        if head_dims and d not in head_dims:
            continue
        q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
        causal = mode == "causal"
        left, right = (4096, 0) if mode == "window4096" else ((-1, 0) if causal else (-1, -1))
        a = AttnArgs(softmax_scale=d ** -0.5, causal=causal, window_left=left, window_right=right,
                     softcap=50.0 if mode == "softcap" else 0.0)
        # The Triton kernel's table tile (the dispatcher would pick the Gluon kernel at d=256).
        table = fwd_config(max(d, dv), q.dtype, q.device, s, left, right, softcap=a.softcap > 0, head_dim_v=dv)
        ref_out, ref_lse = launch.forward(q, k, v, a, config=table)
        fns = {"triton": lambda: launch.forward(q, k, v, a, config=table)}
        if mode in ("full", "causal"):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            fns["cudnn"] = cudnn
        for name, plan in VARIANTS[d].items():
            key = f"d={d} {name}"
            if key in res["errors"]:
                continue
            try:
                out, lse = gluon(q, k, v, a, *plan)
                torch.cuda.synchronize()
            except Exception as e:  # a plan that does not compile is reported, not fatal
                res["errors"][key] = str(e)[-300:]
                print("failed:", key, str(e)[-200:], flush=True)
                continue
            err = float((out.float() - ref_out.float()).abs().max())
            if not (err < 0.05 and float((lse - ref_lse).abs().max()) < 0.01):
                res["errors"][key] = f"mismatch on {mode}: max |out - triton| {err}"
                print("mismatch:", key, mode, err, flush=True)
                continue
            fns[name] = (lambda p: (lambda: gluon(q, k, v, a, *p)))(plan)
        t = ibench(fns)
        i = torch.arange(s, device="cuda")
        lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
        hi = (i + right).clamp(max=s - 1) if right >= 0 else torch.full_like(i, s - 1)
        pairs = float((hi - lo + 1).sum())
        row = dict(head_dims=f"{d}/{dv}", heads=h, batch=b, seqlen=s, mask=mode, us=t,
                   tflops={n: round(2 * b * h * pairs * (d + dv) / us / 1e6, 1) for n, us in t.items()})
        res["rows"].append(row)
        print(row, flush=True)
    res["registers_spills"] = REGS
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon-head-dims.json"), "w"), indent=1)
    for r in res["rows"]:
        cells = " | ".join(f"{n} {tf}" for n, tf in r["tflops"].items())
        print(f"{r['head_dims']:>7} {r['batch']} x {r['seqlen']:>5} {r['mask']:>10} | {cells}")


def gemma():
    rows = []
    torch.manual_seed(0)
    for b, s, h, hk, mode in [(1, 8192, 16, 8, "causal softcap"), (1, 8192, 16, 8, "window softcap"),
                              (4, 4096, 16, 8, "causal softcap"), (4, 4096, 16, 8, "window softcap"),
                              (1, 8192, 16, 8, "causal"), (2, 4096, 8, 8, "full"),
                              (1, 16384, 8, 8, "window alibi sink")]:
        q = torch.randn(b, s, h, 256, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hk, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        left, right = (4095, 0) if "window" in mode else ((-1, 0) if "causal" in mode else (-1, -1))
        a = AttnArgs(softmax_scale=256 ** -0.5, causal="causal" in mode, window_left=left, window_right=right,
                     softcap=50.0 if "softcap" in mode else 0.0,
                     alibi_slopes=(torch.rand(h, device="cuda") * 0.1).expand(b, h) if "alibi" in mode else None,
                     sink=torch.randn(h, device="cuda") if "sink" in mode else None)
        table = fwd_config(256, q.dtype, q.device, s, left, right, softcap=a.softcap > 0, head_dim_v=256)
        out_t, lse_t = launch.forward(q, k, v, a, config=table)
        out_g, lse_g = launch.forward(q, k, v, a)
        t = ibench({"triton": lambda: launch.forward(q, k, v, a, config=table),
                    "gluon": lambda: launch.forward(q, k, v, a)})
        i = torch.arange(s, device="cuda")
        lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
        hi = (i + right).clamp(max=s - 1) if right >= 0 else torch.full_like(i, s - 1)
        pairs = float((hi - lo + 1).sum())
        row = dict(batch=b, seqlen=s, heads=f"{h}/{hk}", mode=mode, us=t,
                   tflops={n: round(4 * b * h * pairs * 256 / us / 1e6, 1) for n, us in t.items()},
                   max_out_diff=float((out_t.float() - out_g.float()).abs().max()),
                   max_lse_diff=float((lse_t - lse_g).abs().max()))
        rows.append(row)
        print(row, flush=True)
    json.dump({"torch": torch.__version__, "commit": os.environ.get("FLASHTILE_GIT_COMMIT", "?"), "rows": rows},
              open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon-d256-gemma.json"), "w"), indent=1)
    for r in rows:
        print(f"{r['batch']} x {r['seqlen']} {r['heads']} {r['mode']:>18}: Triton {r['tflops']['triton']} "
              f"Gluon {r['tflops']['gluon']} (|out diff| {r['max_out_diff']:.1e})")


if __name__ == "__main__":
    gemma() if sys.argv[1:] == ["gemma"] else main([int(d) for d in sys.argv[1:]])
