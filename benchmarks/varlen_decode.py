"""Decode steps of a continuous batch through ``flash_attn_varlen_func`` (one or a few queries per packed
sequence): the forward kernel the call took before (forced by passing the tile the dispatcher picked for it)
against the KV-cache kernel that ``configs.dense_takes_decode`` now sends it to, with two other ways to run
the same step: ``flash_attn_with_kvcache`` over a padded cache (the lengths as ``cache_seqlens``) and SDPA
over the padded batch with a key-padding mask.

bf16, d=128, 32/8 heads, causal (bottom-right aligned), fresh random inputs. Columns: GPU us per call by
CUDA-graph replay (``triton.testing.do_bench_cudagraph``); the new path's achieved bandwidth (every
sequence's K and V read once); wall us per eager call through the public API; max |out - fp32 reference|
of each flashtile path.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/varlen_decode.py   # writes $OUT/h200-varlen-decode-<date>.json
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton

import flashtile
from flashtile.backends import AttnArgs
from flashtile.backends.triton import configs, launch
from flashtile.testing import attention_varlen_ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import measure_all, per_call_us, save_results  # noqa: E402

NHEADS, NHEADS_KV, HEADDIM = 32, 8, 128
# (name, queries a sequence, key lengths)
SHAPES = [
    ("8 x 4096", 1, [4096] * 8),
    ("32 x 2048", 1, [2048] * 32),
    ("64 x 1024", 1, [1024] * 64),
    ("4 x 32768", 1, [32768] * 4),
    ("16 mixed 512..16384", 1, None),
    ("8 x 8192, 4 queries", 4, [8192] * 8),
]


def graph_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def measure(name, seqlen_q, lengths, dtype=torch.bfloat16):
    if lengths is None:
        lengths = torch.randint(512, 16385, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    batch, max_k = len(lengths), max(lengths)
    dev = torch.device("cuda")
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(batch * seqlen_q, NHEADS, HEADDIM, device=dev, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), NHEADS_KV, HEADDIM, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    args = AttnArgs(softmax_scale=HEADDIM ** -0.5, causal=True, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=seqlen_q, max_seqlen_k=max_k)
    features = frozenset({"varlen"})
    before = (configs.gluon_fwd_config(HEADDIM, HEADDIM, dtype, dev, batch * NHEADS * seqlen_q, max_k, -1, 0, features)
              or configs.fwd_config(HEADDIM, dtype, dev, max_k, -1, 0))
    forward = lambda: launch.forward(q, k, v, args, config=before)  # noqa: E731
    routed = lambda: launch.forward(q, k, v, args)  # noqa: E731
    api = lambda: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqlen_q, max_k, causal=True)  # noqa: E731
    # The same step over a padded cache (batch, max_k) and a padded dense batch.
    k_pad = torch.zeros(batch, max_k, NHEADS_KV, HEADDIM, device=dev, dtype=dtype)
    v_pad = torch.zeros_like(k_pad)
    for b, n in enumerate(lengths):
        k_pad[b, :n], v_pad[b, :n] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
    q_pad = q.view(batch, seqlen_q, NHEADS, HEADDIM)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    kvcache = lambda: flashtile.flash_attn_with_kvcache(  # noqa: E731
        q_pad, k_pad, v_pad, cache_seqlens=seqlens, causal=True)
    keep = torch.arange(max_k, device=dev)[None, :] < seqlens[:, None]
    diag = seqlens[:, None] - seqlen_q + torch.arange(seqlen_q, device=dev)[None, :]  # each query's last key
    mask = (keep[:, None, :] & (torch.arange(max_k, device=dev)[None, None, :] <= diag[:, :, None]))[:, None]
    qt, kt, vt = q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2)
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)  # noqa: E731
    ref = attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True)[0]
    row = dict(name=name, batch=batch, seqlen_q=seqlen_q, max_seqlen_k=max_k, keys=int(cu_k[-1]),
               kernel=flashtile.explain(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        max_seqlen_q=seqlen_q, max_seqlen_k=max_k).kernel,
               forward_tile=vars(before),
               err_forward=(forward()[0].float() - ref).abs().max().item(),
               err_routed=(routed()[0].float() - ref).abs().max().item(),
               err_kvcache=(kvcache().reshape(ref.shape).float() - ref).abs().max().item())
    with torch.no_grad():
        row["gpu_us_forward"] = graph_us(forward)
        row["gpu_us_routed"] = graph_us(routed)
        row["gpu_us_kvcache_padded"] = graph_us(kvcache)
        row["gpu_us_sdpa_padded"] = graph_us(sdpa)
        row["eager_us_api"] = per_call_us(api, n=300)
    row["routed_GBps"] = 2 * row["keys"] * NHEADS_KV * HEADDIM * q.element_size() / (row["gpu_us_routed"] * 1e3)
    return row


def main():
    rows = measure_all(measure, SHAPES)
    save_results("varlen-decode", rows, "python benchmarks/varlen_decode.py", heads=f"{NHEADS}/{NHEADS_KV}",
                 headdim=HEADDIM)
    header = ("sequences", "forward", "routed", "kvcache", "sdpa", "GB/s", "api")
    print("{:24s} {:>8s} {:>7s} {:>7s} {:>7s} {:>6s} {:>7s}".format(*header))
    for r in rows:
        print(f"{r['name']:24s} {r['gpu_us_forward']:8.1f} {r['gpu_us_routed']:7.1f} {r['gpu_us_kvcache_padded']:7.1f} "
              f"{r['gpu_us_sdpa_padded']:7.1f} {r['routed_GBps']:6.0f} {r['eager_us_api']:7.1f}")


if __name__ == "__main__":
    main()
