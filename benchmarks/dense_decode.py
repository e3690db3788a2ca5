"""Decode-shaped dense calls (``flash_attn_func`` with a few query rows over a whole KV cache, as transformers
makes them): the forward kernel, forced by passing its table tile, against the KV-cache kernel that
``configs.dense_takes_decode`` sends them to, and SDPA (evidence for configs.DENSE_DECODE_MIN_KEYS).

bf16, d=128, causal (bottom-right aligned), fresh random inputs. Columns: GPU us per call by CUDA-graph replay
(``triton.testing.do_bench_cudagraph``); the KV-cache kernel's achieved bandwidth (K and V read once); wall us
per eager call through the public API and through SDPA (host time included); max |out - fp32 reference| of
each path; whether the dispatch rule takes the KV-cache kernel for the shape.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/dense_decode.py   # writes $OUT/h200-dense-decode-<date>.json
    ... python benchmarks/dense_decode.py --short   # short caches: $OUT/h200-dense-decode-short-<date>.json
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton

import flashtile
from flashtile.backends import AttnArgs
from flashtile.backends.triton import configs, launch
from flashtile.testing import attention_ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import measure_all, per_call_us, save_results  # noqa: E402

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
    (1, 1, 512, 32, 8), (1, 1, 2048, 32, 8), (1, 1, 4096, 32, 8), (1, 1, 32768, 32, 8), (8, 1, 4096, 32, 8),
    (16, 1, 8192, 32, 8), (64, 1, 1024, 32, 8), (1, 4, 8192, 32, 8), (1, 1, 8192, 32, 32), (4, 1, 16384, 64, 8),
    (1, 8, 2048, 32, 8),
]
# Short caches (--short): where the two kernels cross over.
SHORT_SHAPES = [
    (1, 1, 128, 32, 8), (1, 1, 256, 32, 8), (1, 1, 512, 32, 8), (1, 1, 1024, 32, 8), (1, 1, 2048, 32, 8),
    (4, 1, 512, 32, 8), (8, 1, 256, 32, 8), (16, 1, 512, 32, 8), (1, 4, 1024, 32, 8), (1, 8, 512, 32, 8),
    (1, 1, 1024, 32, 32), (1, 1, 512, 16, 1), (2, 1, 1024, 64, 8),
]


def graph_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def measure(batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype=torch.bfloat16):
    q = torch.randn(batch, seqlen_q, nheads, 128, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_kv, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    args = AttnArgs(softmax_scale=128 ** -0.5, causal=True, window_right=0)
    forward_tile = configs.fwd_config(128, dtype, q.device, seqlen_k, -1, 0)
    ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=True)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    # SDPA's causal mask is top-left aligned: one query row sees every key either way, more rows need it off.
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=False, enable_gqa=True)  # noqa: E731
    cache_args = launch._cache_args(args, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
    kv_kernel = lambda: launch.decode.attention_kv(q, k, v, cache_args)  # noqa: E731
    forward = lambda: launch.forward(q, k, v, args, config=forward_tile)  # noqa: E731
    row = dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv,
               takes_kv_kernel=configs.dense_takes_decode(batch, seqlen_q, seqlen_k, nheads, nheads_kv, frozenset(),
                                                          dtype, q.device),
               kernel=flashtile.explain(q, k, v, causal=True).kernel,
               err_forward=(forward()[0].float() - ref).abs().max().item(),
               err_kv_kernel=(kv_kernel()[0].float() - ref).abs().max().item())
    if seqlen_q == 1:
        row["err_sdpa"] = (sdpa().transpose(1, 2).float() - ref).abs().max().item()
    row["gpu_us_forward"] = graph_us(forward)
    row["gpu_us_kv_kernel"] = graph_us(kv_kernel)
    with torch.no_grad():
        row["gpu_us_sdpa"] = graph_us(sdpa)
        row["eager_us_api"] = per_call_us(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
        row["eager_us_sdpa"] = per_call_us(sdpa)
    row["kv_kernel_GBps"] = 2 * batch * seqlen_k * nheads_kv * 128 * q.element_size() / (row["gpu_us_kv_kernel"] * 1e3)
    return row


def main():
    short = "--short" in sys.argv[1:]
    rows = measure_all(measure, SHORT_SHAPES if short else SHAPES)
    save_results("dense-decode" + ("-short" if short else ""), rows,
                 "python benchmarks/dense_decode.py" + (" --short" if short else ""))
    header = ("b x q x k, heads", "forward", "kv", "sdpa", "GB/s", "api", "sdpa")
    print("{:24s} {:>8s} {:>7s} {:>7s} {:>6s} {:>7s} {:>7s} rule".format(*header))
    for r in rows:
        shape = f"{r['batch']}x{r['seqlen_q']}x{r['seqlen_k']} {r['nheads']}/{r['nheads_kv']}"
        print(f"{shape:24s} {r['gpu_us_forward']:8.1f} {r['gpu_us_kv_kernel']:7.1f} {r['gpu_us_sdpa']:7.1f} "
              f"{r['kv_kernel_GBps']:6.0f} {r['eager_us_api']:7.1f} {r['eager_us_sdpa']:7.1f} "
              f"{'kv' if r['takes_kv_kernel'] else 'forward'}")


if __name__ == "__main__":
    main()
