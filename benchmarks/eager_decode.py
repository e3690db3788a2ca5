"""Eager decode steps as a model without CUDA graphs makes them: host time per attention call.

Every step calls attention once per layer (``--layers``, each with its own cache) at one cache length,
and the next step at the next length. Three ways a loop keeps its cache, Llama-3-8B heads (32 query /
8 KV, head dim 128), bf16, batch ``--batch``, one query a step, against torch SDPA on the same tensors:

- ``dynamic``: transformers' DynamicCache. Each layer's cache is ``(batch, heads_kv, L, 128)`` grown by
  a token a step (here: views of a larger buffer with exactly that layout, so no copy is timed), passed
  to ``flash_attn_func`` transposed: new strides and a new key count every step.
- ``static``: a preallocated cache ``(batch, capacity, heads_kv, 128)``; ``flash_attn_with_kvcache``
  appends the step's key and value in place and attends over ``cache_seqlens`` (what
  :class:`flashtile.KVCache` does). SDPA: the same append by ``index_copy_`` and attention over the
  filled prefix.
- ``paged``: the same on 256-token pages through a block table.

Wall time of ``--steps`` steps of every layer after a warm-up, divided by the calls: while the kernels
are shorter than the host's work, that is the host's time per call. GPU time per call, by CUDA-graph
replay of one layer's call, is printed next to it (the floor when the host keeps up).

    python benchmarks/eager_decode.py -> $OUT (default /tmp)/h200-eager-decode-<date>.json
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.bench.decode import capture_graph
from host_time import save_results

HEADS, HEADS_KV, HEADDIM = 32, 8, 128


def timed(step, steps):
    """us per call of ``step(i)`` (which makes ``calls`` calls) over ``steps`` steps, after a warm-up."""
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    calls = 0
    for i in range(3, 3 + steps):
        calls += step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def gpu_us(call):
    """GPU us of one call by CUDA-graph replay of 20 (no L2 flush)."""
    graph = capture_graph(lambda: [call() for _ in range(20)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 200


def dynamic(batch, length, layers, steps):
    dt = torch.bfloat16
    q = torch.randn(batch, HEADS, 1, HEADDIM, device="cuda", dtype=dt)
    most = length + steps + 8
    # Each layer's K and V storage; step i sees (batch, heads_kv, L_i, 128) contiguous views of it.
    bases = [[torch.randn(batch * HEADS_KV * most * HEADDIM, device="cuda", dtype=dt) for _ in range(2)]
             for _ in range(layers)]

    def cache(base, n):
        return base.as_strided((batch, HEADS_KV, n, HEADDIM), (HEADS_KV * n * HEADDIM, n * HEADDIM, HEADDIM, 1))

    def flashtile_step(i):
        for k, v in bases:
            flashtile.flash_attn_func(q.transpose(1, 2), cache(k, length + i).transpose(1, 2),
                                      cache(v, length + i).transpose(1, 2), causal=True)
        return layers

    def sdpa_step(i):
        for k, v in bases:
            F.scaled_dot_product_attention(q, cache(k, length + i), cache(v, length + i), enable_gqa=True)
        return layers

    k, v = bases[0]
    return dict(flashtile=timed(flashtile_step, steps), sdpa=timed(sdpa_step, steps),
                flashtile_gpu=gpu_us(lambda: flashtile_step(0) and None) / layers,
                sdpa_gpu=gpu_us(lambda: sdpa_step(0) and None) / layers)


def cached(batch, length, layers, steps, page_size=0):
    dt = torch.bfloat16
    capacity = length + steps + 8
    q = torch.randn(batch, 1, HEADS, HEADDIM, device="cuda", dtype=dt)
    k_new = torch.randn(batch, 1, HEADS_KV, HEADDIM, device="cuda", dtype=dt)
    v_new = torch.randn_like(k_new)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    if page_size:
        pages = -(-capacity // page_size)
        table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
        caches = [[torch.randn(batch * pages, page_size, HEADS_KV, HEADDIM, device="cuda", dtype=dt)
                   for _ in range(2)] for _ in range(layers)]
    else:
        table = None
        caches = [[torch.randn(batch, capacity, HEADS_KV, HEADDIM, device="cuda", dtype=dt) for _ in range(2)]
                  for _ in range(layers)]

    def flashtile_step(i):
        for k, v in caches:
            flashtile.flash_attn_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                              causal=True)
        seqlens.add_(1)
        return layers

    # SDPA on a contiguous (batch, heads_kv, capacity, 128) cache: append by index_copy_, attend to the prefix.
    sdpa_caches = [[torch.randn(batch, HEADS_KV, capacity, HEADDIM, device="cuda", dtype=dt) for _ in range(2)]
                   for _ in range(layers)]
    qt, kt, vt = q.transpose(1, 2), k_new.transpose(1, 2), v_new.transpose(1, 2)

    def sdpa_step(i):
        n = length + i
        position = torch.tensor([n], device="cuda")
        for k, v in sdpa_caches:
            k.index_copy_(2, position, kt)
            v.index_copy_(2, position, vt)
            F.scaled_dot_product_attention(qt, k[:, :, :n + 1], v[:, :, :n + 1], enable_gqa=True)
        return layers

    row = dict(flashtile=timed(flashtile_step, steps), sdpa=timed(sdpa_step, steps))
    seqlens.fill_(length)
    row["flashtile_gpu"] = gpu_us(lambda: flashtile.flash_attn_with_kvcache(
        q, *caches[0], k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True))
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--label", default="")
    opts = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    # SDPA without cuDNN, which builds a plan for each new cache length (tens of ms a call).
    with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        for batch, length in [(1, 1024), (1, 8192), (8, 4096)]:
            for cache, run in [("dynamic", dynamic), ("static", cached),
                               ("paged", lambda *a: cached(*a, page_size=256))]:
                row = dict(cache=cache, batch=batch, length=length,
                           **{name: round(x, 1) for name, x in run(batch, length, opts.layers, opts.steps).items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
    path = save_results(f"eager-decode{opts.label}", rows, "python benchmarks/eager_decode.py",
                        layers=opts.layers, steps=opts.steps, unit="us per attention call")
    print(f"{'cache':8s} {'batch x keys':>12s} {'flashtile us':>12s} {'sdpa us':>8s} {'GPU us':>7s}")
    for row in rows:
        print(f"{row['cache']:8s} {row['batch']:>4d} x {row['length']:<6d} {row['flashtile']:12.1f} {row['sdpa']:8.1f} "
              f"{row['flashtile_gpu']:7.1f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
