"""Randomized differential tests: feature combinations drawn by a seeded generator, run forward and backward on
each backend and held to the float64 reference by the tolerance rule (:func:`flashtile.testing.assert_close_to_ref`).

A case is drawn from ``(FLASHTILE_FUZZ_SEED, case index)`` alone, so a failure names its case (the test id is
``seed<seed>-case<index>``, the message prints the drawn options) and reruns alone with ``-k``. Each case is one
kind of call: dense (causal, window, softcap, ALiBi, sink, float or bool bias, dropout with the mask rebuilt
from the call's RNG counters, GQA, headdim_v != headdim), varlen (empty and length-1 sequences, seqused_k,
dropout) or KV cache (contiguous or paged, appended tokens, cache_batch_idx, left padding, splits; forward
only). Shapes are awkward and small. The budget is ``FLASHTILE_FUZZ_CASES`` (default: 24 on CPU, where Triton
runs through its interpreter; 200 on a GPU, about 3 minutes of the GPU suite).

    FLASHTILE_FUZZ_CASES=500 FLASHTILE_FUZZ_SEED=7 pytest tests/test_fuzz.py
"""
import math
import os
import random

import pytest
import torch

import flashtile
from flashtile import rng as frng
from flashtile.testing import (ATOL, assert_close_to_ref, attention_ref, cu_seqlens_of, reference_results,
                               assert_results_close)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SEED = int(os.environ.get("FLASHTILE_FUZZ_SEED", "0"))
CASES = int(os.environ.get("FLASHTILE_FUZZ_CASES", "200" if HAS_CUDA else "24"))
# bfloat16 only on a GPU: Triton's interpreter computes it wrongly.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])


def draw_case(index: int) -> dict:
    """The options of case ``index``: plain Python values, printed on failure."""
    r = random.Random(SEED * 1_000_003 + index)
    big = HAS_CUDA and r.random() < 0.3
    longest = 700 if big else 70
    case = dict(kind=r.choice(["dense", "dense", "varlen", "kvcache"]), dtype=r.choice(DTYPES),
                headdim=r.choice([16, 32, 40, 64] + ([128] if HAS_CUDA else [])),
                nheads_kv=r.choice([1, 2]), group=r.choice([1, 2, 3]),
                causal=r.random() < 0.4, softcap=r.choice([0.0, 0.0, 5.0]),
                alibi=r.random() < 0.2, sink=r.random() < 0.2)
    case["headdim_v"] = case["headdim"] if r.random() < 0.7 else r.choice([8, 24, 48])
    # A row that sees one key has a softmax of 1, which PyTorch's 16-bit backward turns into an exactly-0 dK,
    # while ours (as flash-attn's) takes rowsum(dO * O) from the rounded O: the 2x rule would compare an error of
    # a few 1e-3 with 0. So rows of one key (a left bound of 0, sequences of one key) are drawn in float32 only.
    one_key = 1 if case["dtype"] == torch.float32 else 2
    left = [-1, 0, 5, 33] if one_key == 1 else [-1, 5, 33]
    case["window"] = (r.choice(left), r.choice([-1, 0, 7])) if r.random() < 0.3 else (-1, -1)
    if case["kind"] == "dense":
        case.update(batch=r.choice([1, 2]), seqlen_q=r.randint(1, longest), seqlen_k=r.randint(one_key, longest),
                    bias=r.choice([None, None, "float", "bool"]), dropout_p=r.choice([0.0, 0.0, 0.17]))
    elif case["kind"] == "varlen":
        batch = r.randint(1, 4)
        lengths_q = [r.choice([0, 1, r.randint(1, longest)]) for _ in range(batch)]
        lengths_k = [r.choice([0, one_key, r.randint(one_key, longest)]) for _ in range(batch)]
        seqused = [r.choice([0, n, r.randint(min(one_key, n), n)]) for n in lengths_k] if r.random() < 0.3 else None
        case.update(lengths_q=lengths_q, lengths_k=lengths_k, seqused_k=seqused,
                    dropout_p=r.choice([0.0, 0.0, 0.1]))
    else:
        batch, capacity = r.randint(1, 3), r.randint(1, longest)
        seqlen_new = r.choice([0, 1, 3])
        capacity = max(capacity, seqlen_new)
        lengths = [r.randint(0, capacity - seqlen_new) for _ in range(batch)]
        case.update(batch=batch, capacity=capacity, seqlen_new=seqlen_new, cache_seqlens=lengths,
                    seqlen_q=r.choice([1, 1, 2, 5]), num_splits=r.choice([0, 1, 3]),
                    paged=r.random() < 0.4, page_size=r.choice([4, 16]),
                    batch_idx=r.random() < 0.3, leftpad=r.random() < 0.2)
        if case["paged"]:
            case.update(batch_idx=False, leftpad=False)
    return case


def case_id(index: int) -> str:
    return f"seed{SEED}-case{index}"


def randn(generator, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype)


def features(case: dict, generator, batch: int, nheads: int) -> tuple:
    """``(options for flashtile, options for the reference)`` of the features every kind shares."""
    ours = dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"])
    ref = dict(ours)
    if case["alibi"]:
        ours["alibi_slopes"] = ref["alibi_slopes"] = (torch.rand(nheads, generator=generator) * 0.5).to(DEVICE)
    if case["sink"]:
        ours["sink"] = randn(generator, nheads, scale=2.0).requires_grad_(case["kind"] != "kvcache")
    return ours, ref


def run_dense(case, generator):
    batch, seqlen_q, seqlen_k = case["batch"], case["seqlen_q"], case["seqlen_k"]
    nheads_kv, dtype = case["nheads_kv"], case["dtype"]
    nheads = nheads_kv * case["group"]
    q = randn(generator, batch, seqlen_q, nheads, case["headdim"], dtype=dtype).requires_grad_()
    k = randn(generator, batch, seqlen_k, nheads_kv, case["headdim"], dtype=dtype).requires_grad_()
    v = randn(generator, batch, seqlen_k, nheads_kv, case["headdim_v"], dtype=dtype).requires_grad_()
    dout = randn(generator, batch, seqlen_q, nheads, case["headdim_v"], dtype=dtype)
    ours, ref = features(case, generator, batch, nheads)
    if case["bias"] == "float":
        ours["attn_bias"] = randn(generator, 1, nheads, seqlen_q, seqlen_k).requires_grad_()
    elif case["bias"] == "bool":
        ours["attn_bias"] = (torch.rand(batch, 1, seqlen_q, seqlen_k, generator=generator) < 0.8).to(DEVICE)
    if case["dropout_p"]:
        ours["dropout_p"] = ref["dropout_p"] = case["dropout_p"]
        # The call draws its counters from torch's default generator: seed it and draw the same ones here.
        torch.manual_seed(SEED + batch * seqlen_q)
        seed, offset = frng.draw_seed_offset()
        torch.manual_seed(SEED + batch * seqlen_q)
        ref["dropout_mask"] = frng.dropout_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, case["dropout_p"],
                                                device=DEVICE)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **ours)
    leaves = [q, k, v] + [ours[name] for name in ("sink", "attn_bias") if name in ours and ours[name].requires_grad]
    grads = torch.autograd.grad(out, leaves, dout)
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in ("sink", "bias") if n.replace("bias", "attn_bias") in ours
                                  and ours[n.replace("bias", "attn_bias")].requires_grad]
    results = {"out": out, "lse": lse, **dict(zip(names, grads))}
    refs = [reference_results(q, k, v, dout, hi=hi, sink=ours.get("sink"), attn_bias=ours.get("attn_bias"), **ref)
            for hi in (True, False)]
    assert_results_close(results, *refs, dtype)


def run_varlen(case, generator):
    nheads_kv, dtype = case["nheads_kv"], case["dtype"]
    nheads = nheads_kv * case["group"]
    lengths_q, lengths_k = case["lengths_q"], case["lengths_k"]
    batch = len(lengths_q)
    options, ref = features(case, generator, batch, nheads)
    if case["dropout_p"]:
        torch.manual_seed(SEED + sum(lengths_q))
        counters = frng.draw_seed_offset()
        torch.manual_seed(SEED + sum(lengths_q))
        options["dropout_p"] = case["dropout_p"]
        options_ref_extra = dict(dropout_seed_offset=counters)
    else:
        options_ref_extra = {}
    check = _packed_check if options_ref_extra else None
    if check is None:
        from flashtile.testing import check_packed

        sink = options.pop("sink", None)
        check_packed(generator, lengths_q, lengths_k, nheads, nheads_kv, dtype,
                     head_dims=(case["headdim"], case["headdim_v"]), seqused_k=case["seqused_k"], sink=sink,
                     device=DEVICE, **options)
    else:
        check(generator, case, options, options_ref_extra, nheads)


def _packed_check(generator, case, options, ref_extra, nheads):
    """Varlen with dropout: :func:`flashtile.testing.check_packed`'s comparison with the reference given the
    call's dropout counters."""
    lengths_q, lengths_k, dtype = case["lengths_q"], case["lengths_k"], case["dtype"]
    cu_q, cu_k = cu_seqlens_of(lengths_q, DEVICE), cu_seqlens_of(lengths_k, DEVICE)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = randn(generator, total_q, nheads, case["headdim"], dtype=dtype).requires_grad_()
    k = randn(generator, total_k, case["nheads_kv"], case["headdim"], dtype=dtype).requires_grad_()
    v = randn(generator, total_k, case["nheads_kv"], case["headdim_v"], dtype=dtype).requires_grad_()
    dout = randn(generator, total_q, nheads, case["headdim_v"], dtype=dtype)
    seqused = None if case["seqused_k"] is None else torch.tensor(case["seqused_k"], dtype=torch.int32, device=DEVICE)
    sink = options.pop("sink", None)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   seqused_k=seqused, sink=sink, return_attn_probs=True, **options)
    leaves = (q, k, v) if sink is None else (q, k, v, sink)
    grads = torch.autograd.grad(out, leaves, dout) if total_q else [torch.zeros_like(t) for t in leaves]
    results = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv", "dsink"), grads))}
    options.pop("dropout_p")
    refs = [reference_results(q, k, v, dout, hi=hi, sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              seqused_k=seqused, dropout_p=case["dropout_p"], **ref_extra, **options)
            for hi in (True, False)]
    assert_results_close(results, *refs, dtype)


def run_kvcache(case, generator):
    batch, capacity, seqlen_new, seqlen_q = case["batch"], case["capacity"], case["seqlen_new"], case["seqlen_q"]
    nheads_kv, dtype, headdim, headdim_v = case["nheads_kv"], case["dtype"], case["headdim"], case["headdim_v"]
    nheads = nheads_kv * case["group"]
    rows = batch + 1 if case["batch_idx"] else batch
    k_cache = randn(generator, rows, capacity, nheads_kv, headdim, dtype=dtype)
    v_cache = randn(generator, rows, capacity, nheads_kv, headdim_v, dtype=dtype)
    q = randn(generator, batch, seqlen_q, nheads, headdim, dtype=dtype)
    k_new = randn(generator, batch, seqlen_new, nheads_kv, headdim, dtype=dtype) if seqlen_new else None
    v_new = randn(generator, batch, seqlen_new, nheads_kv, headdim_v, dtype=dtype) if seqlen_new else None
    lengths = case["cache_seqlens"]
    options, ref = features(case, generator, batch, nheads)
    cache_rows = list(range(batch))
    if case["batch_idx"]:
        cache_rows = torch.randperm(rows, generator=generator)[:batch].tolist()
        options["cache_batch_idx"] = torch.tensor(cache_rows, dtype=torch.int32, device=DEVICE)
    starts = [0] * batch
    if case["leftpad"]:
        starts = [random.Random(SEED + b).randint(0, n) for b, n in enumerate(lengths)]
        options["cache_leftpad"] = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    # The keys each batch row sees, as the reference takes them: its cache row's, then the new ones.
    keys = [(torch.cat([k_cache[r, s:n]] + ([k_new[b]] if seqlen_new else [])),
             torch.cat([v_cache[r, s:n]] + ([v_new[b]] if seqlen_new else [])))
            for b, (r, s, n) in enumerate(zip(cache_rows, starts, lengths))]
    if case["paged"]:
        page_size = case["page_size"]
        pages_per_row = math.ceil(capacity / page_size)
        num_blocks = batch * pages_per_row + 2
        order = torch.randperm(num_blocks, generator=generator)[: batch * pages_per_row]
        k_pages = randn(generator, num_blocks, page_size, nheads_kv, headdim, dtype=dtype)
        v_pages = randn(generator, num_blocks, page_size, nheads_kv, headdim_v, dtype=dtype)
        table = order.view(batch, pages_per_row).to(DEVICE, torch.int32)
        padded = pages_per_row * page_size
        for b in range(batch):
            for cache, pages in ((k_cache, k_pages), (v_cache, v_pages)):
                row = torch.zeros(padded, *cache.shape[2:], dtype=dtype, device=DEVICE)
                row[:capacity] = cache[b]
                pages[table[b].long()] = row.view(pages_per_row, page_size, *cache.shape[2:])
        k_cache, v_cache = k_pages, v_pages
        options["block_table"] = table
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                 cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                                                 num_splits=case["num_splits"], return_softmax_lse=True, **options)
    sink = options.get("sink")
    for b, (kb, vb) in enumerate(keys):
        row_ref = dict(ref, alibi_slopes=ref.get("alibi_slopes"))
        hi, lo = (attention_ref(q[b:b + 1], kb[None], vb[None], upcast=up, sink=sink, **row_ref) for up in (True, False))
        assert_close_to_ref(f"out[{b}]", out[b:b + 1], hi[0], lo[0], ATOL[dtype][0])
        assert_close_to_ref(f"lse[{b}]", lse[b:b + 1], hi[1], lo[1], ATOL[dtype][0])


RUNS = {"dense": run_dense, "varlen": run_varlen, "kvcache": run_kvcache}


@pytest.mark.parametrize("index", range(CASES), ids=case_id)
def test_fuzz(backend, index):
    case = draw_case(index)
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + index)
    try:
        RUNS[case["kind"]](case, generator)
    except Exception as error:
        raise AssertionError(f"fuzz {case_id(index)} on {backend} failed: {case}") from error
