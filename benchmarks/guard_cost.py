"""What the kernels' index guards (docs/reliability.md: clamps of cu_seqlens, seqused_k, cache_seqlens, cache_leftpad,
cache_batch_idx and block-table entries, and the device error record) cost on the benchmark shapes that take
them: run under benchmarks/ab_trees.sh against a tree without them (the branch ``tried/noguards-ab``), rounds
interleaved.

    git archive tried/noguards-ab flashtile | tar -x -C /tmp/noguards
    bash benchmarks/ab_trees.sh /tmp/noguards benchmarks/guard_cost.py 3

Rows (bf16, d128, GPU ms per call by CUDA events, median of 7 repeats of 20 calls): the varlen benchmark (16
documents of 128..4096 tokens, causal) forward and forward+backward; the same with ``seqused_k``; decode over a
KV cache (batch 16, 8192 keys, GQA 32/8), contiguous with ``cache_seqlens``, with ``cache_batch_idx`` and
``cache_leftpad``, and paged (256-token pages), each with one new token appended and rotary; a dense causal
forward+backward (no guards on its path: the noise floor). Writes ``$OUT/h200-guard-cost-<date>.json``.
"""
import os
import sys

import torch

import flashtile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import events_us, save_results  # noqa: E402


def varlen(seqused: bool):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 4097, (16,), generator=g)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to("cuda", torch.int32)
    total, longest = int(lengths.sum()), int(lengths.max())
    q, k, v, do = (torch.randn(total, 16, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = dict(seqused_k=(lengths * 7 // 8).to("cuda", torch.int32)) if seqused else {}

    def forward():
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, **extra)

    def both():
        forward().backward(do)

    return forward, both


def decode(kind: str):
    batch, keys, heads, heads_kv, page = 16, 8192, 32, 8, 256
    q = torch.randn(batch, 1, heads, 128, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 1, heads_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(keys + 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((batch,), keys - 1, device="cuda", dtype=torch.int32)
    extra = {}
    if kind == "paged":
        blocks = batch * keys // page
        k_cache, v_cache = (torch.randn(blocks, page, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        extra["block_table"] = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    else:
        rows = batch + 4 if kind == "batch_idx" else batch
        k_cache, v_cache = (torch.randn(rows, keys, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        if kind == "batch_idx":
            extra["cache_batch_idx"] = torch.randperm(rows, device="cuda", dtype=torch.int32)[:batch]
            extra["cache_leftpad"] = torch.randint(0, 64, (batch,), device="cuda", dtype=torch.int32)

    def step():
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                 cache_seqlens=lengths, **extra)

    return step


def dense():
    q, k, v, do = (torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    return lambda: flashtile.flash_attn_func(q, k, v, causal=True).backward(do)


def main():
    rows = []
    cases = [("varlen fwd", varlen(False)[0]), ("varlen fwd+bwd", varlen(False)[1]),
             ("varlen seqused fwd", varlen(True)[0]), ("varlen seqused fwd+bwd", varlen(True)[1]),
             ("decode contiguous", decode("contiguous")), ("decode batch_idx+leftpad", decode("batch_idx")),
             ("decode paged", decode("paged")), ("dense causal fwd+bwd (no guards)", dense())]
    for name, fn in cases:
        flashtile.reset_stats()
        fn()
        torch.cuda.synchronize()
        kernels = sorted(flashtile.stats()["kernels"])
        rows.append(dict(case=name, ms=events_us(fn) / 1e3, kernels=kernels))
        print(f"{name:36s} {rows[-1]['ms']:.4f} ms  {kernels}", flush=True)
    save_results("guard-cost", rows, "bash benchmarks/ab_trees.sh /tmp/noguards benchmarks/guard_cost.py 3")


if __name__ == "__main__":
    main()
