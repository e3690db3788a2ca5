"""Decode steps over short and mid-length caches (``flash_attn_with_kvcache``, one query a sequence): GPU us
per call by CUDA-graph replay (``triton.testing.do_bench_cudagraph``) next to SDPA (its default backend,
``enable_gqa``) on the same tensors, and flashtile's max |out - fp32 reference|. bf16, fresh random inputs,
every sequence at the cache length (given as ``cache_seqlens``); rows for head dims 64/128/256, MHA and
paged caches.

Evidence for the short-cache rules in ``configs.decode_plan`` and for launching the split-KV combine as a
programmatic dependent of the split kernel. Run it on two trees with ``benchmarks/ab_trees.sh``:

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/decode_short.py   # writes $OUT/h200-decode-short-<date>.json
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton

import flashtile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import measure_all, save_results  # noqa: E402

# (batch, cache length, query heads, KV heads, head dim, page size or 0)
SHAPES = ([(b, n, 32, 8, 128, 0) for b in (1, 2, 4, 8) for n in (512, 1024, 2048, 4096, 8192)]
          + [(1, n, 32, 8, 64, 0) for n in (1024, 4096)] + [(1, n, 16, 1, 256, 0) for n in (1024, 4096)]
          + [(1, n, 32, 8, 128, 256) for n in (1024, 4096)] + [(1, 2048, 32, 32, 128, 0), (1, 16384, 32, 8, 128, 0)])


def graph_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=60) * 1e3


def measure(batch, seqlen, heads, heads_kv, headdim, page):
    q = torch.randn(batch, 1, heads, headdim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, heads_kv, headdim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True).transpose(1, 2)
    if page:
        # The same keys on shuffled pages.
        pages = seqlen // page
        table = torch.randperm(batch * pages, device="cuda").int().view(batch, pages)
        k_pages = torch.empty(batch * pages, page, heads_kv, headdim, device="cuda", dtype=torch.bfloat16)
        v_pages = torch.empty_like(k_pages)
        k_pages[table.view(-1).long()] = k.view(batch * pages, page, heads_kv, headdim)
        v_pages[table.view(-1).long()] = v.view(batch * pages, page, heads_kv, headdim)
        step = lambda: flashtile.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,  # noqa: E731
                                                         block_table=table)
    else:
        step = lambda: flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)  # noqa: E731
    err = (step().float() - ref).abs().max().item()
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
    return dict(batch=batch, keys=seqlen, heads=f"{heads}/{heads_kv}", headdim=headdim, page=page,
                flashtile_us=graph_us(step), sdpa_us=graph_us(sdpa), max_err=err)


if __name__ == "__main__":
    rows = measure_all(measure, SHAPES)
    print(save_results("decode-short", rows, "python benchmarks/decode_short.py"))
