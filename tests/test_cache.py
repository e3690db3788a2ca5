"""The KV cache helpers (:class:`flashtile.cache.KVCache`, :class:`flashtile.cache.PagedKVCache`): generation
loops give what attention over the whole sequence so far gives, the page allocator hands out, shares,
copies and returns pages as documented, and the module docstring's example runs."""
import pytest
import torch

import flashtile
import flashtile.cache
from flashtile.cache import KVCache, PagedKVCache
from flashtile.dispatch import force_backend
from flashtile.interface import flash_attn_func

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.float16 if HAS_CUDA else torch.float32
NHEADS, NHEADS_KV, HEADDIM = 4, 2, 32


@pytest.fixture(autouse=True)
def quick_backend():
    """The allocator's tests do not depend on the kernels: on CPU run them on the torch backend (tests that
    take the ``backend`` fixture run on every backend, its choice being the innermost)."""
    if HAS_CUDA:
        yield
    else:
        with force_backend("torch"):
            yield


def randn(rng, *shape):
    return torch.randn(*shape, generator=rng).to(DEVICE, DTYPE)


def tokens(rng, batch, seqlen):
    """q, k, v of ``seqlen`` new tokens per sequence."""
    return (randn(rng, batch, seqlen, NHEADS, HEADDIM), randn(rng, batch, seqlen, NHEADS_KV, HEADDIM),
            randn(rng, batch, seqlen, NHEADS_KV, HEADDIM))


def full_attention(q, k_all, v_all):
    """The last ``q.shape[1]`` tokens of a sequence of ``k_all.shape[1]`` attending causally to all of them."""
    return flash_attn_func(q, k_all, v_all, causal=True)


TOL = dict(atol=2e-3, rtol=2e-3) if DTYPE == torch.float16 else dict(atol=1e-5, rtol=1e-5)


def test_module_example_runs(monkeypatch, capsys):
    """The generation loop of flashtile/cache.py's docstring runs and prints what it says."""
    monkeypatch.setattr(flashtile, "KVCache", KVCache, raising=False)
    monkeypatch.setattr(flashtile, "PagedKVCache", PagedKVCache, raising=False)
    code = flashtile.cache.__doc__.split("::\n", 1)[1]
    code = "\n".join(line[4:] for line in code.splitlines())
    exec(compile(code, "flashtile/cache.py docstring", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "tensor([29, 29], dtype=torch.int32)" or printed[0].startswith("tensor([29, 29], device=")
    assert printed[1] == "20 29"


def test_kvcache_generation_matches_full_attention(backend, rng):
    """Prefill 7 tokens, then decode 5: every step's output is attention over the whole sequence so far."""
    cache = KVCache(2, 32, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    seen_k, seen_v = [], []
    for seqlen in (7, 1, 1, 1, 1, 1):
        q, k, v = tokens(rng, 2, seqlen)
        out = cache.attend(q, k, v)
        seen_k.append(k)
        seen_v.append(v)
        torch.testing.assert_close(out, full_attention(q, torch.cat(seen_k, 1), torch.cat(seen_v, 1)), **TOL)
    assert cache.seqlens.tolist() == [12, 12]
    assert torch.equal(cache.k[:, :12], torch.cat(seen_k, 1)) and torch.equal(cache.v[:, :12], torch.cat(seen_v, 1))
    cache.reset()
    assert cache.seqlens.tolist() == [0, 0]


def test_kvcache_right_padded_prompts(backend, rng):
    """Prompts of 6 and 3 tokens prefilled as one right-padded batch (new_lengths), then decoded together:
    the shorter sequence never sees its padding."""
    cache = KVCache(2, 16, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    q, k, v = tokens(rng, 2, 6)
    cache.attend(q, k, v, new_lengths=torch.tensor([6, 3], dtype=torch.int32, device=DEVICE))
    assert cache.seqlens.tolist() == [6, 3]
    q1, k1, v1 = tokens(rng, 2, 1)
    out = cache.attend(q1, k1, v1)
    short = full_attention(q1[1:], torch.cat([k[1:, :3], k1[1:]], 1), torch.cat([v[1:, :3], v1[1:]], 1))
    long = full_attention(q1[:1], torch.cat([k[:1], k1[:1]], 1), torch.cat([v[:1], v1[:1]], 1))
    torch.testing.assert_close(out[1:], short, **TOL)
    torch.testing.assert_close(out[:1], long, **TOL)


def test_kvcache_smaller_batch_and_errors(rng):
    cache = KVCache(3, 8, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    q, k, v = tokens(rng, 2, 2)
    cache.attend(q, k, v)
    assert cache.seqlens.tolist() == [2, 2, 0]
    with pytest.raises(ValueError, match=r"q has batch 4 but this KVCache holds 3 sequences"):
        cache.attend(*tokens(rng, 4, 1))
    with pytest.raises(TypeError, match=r"attend\(\) fills cache_seqlens"):
        cache.attend(q, k, v, cache_seqlens=0)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] \+ seqlen_new = 2 \+ 7 = 9 exceeds the cache capacity of 8"):
        cache.attend(*tokens(rng, 2, 7))
    assert cache.seqlens.tolist() == [2, 2, 0], "a refused call must not advance the lengths"
    with pytest.raises(ValueError, match=r"KVCache needs batch >= 1 and max_seqlen >= 1"):
        KVCache(0, 8, NHEADS_KV, HEADDIM)


def test_paged_generation_matches_contiguous(backend, rng):
    """Three sequences of different lengths on 4-token pages, their pages interleaved as they grow: the
    same outputs as a contiguous cache."""
    paged = PagedKVCache(16, 4, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    contiguous = KVCache(3, 24, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    seqs = [paged.allocate() for _ in range(3)]
    q, k, v = tokens(rng, 3, 5)
    lengths = torch.tensor([5, 2, 3], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(paged.attend(q, k, v, seqs, new_lengths=lengths),
                               contiguous.attend(q, k, v, new_lengths=lengths), **TOL)
    for _ in range(4):
        q, k, v = tokens(rng, 3, 1)
        torch.testing.assert_close(paged.attend(q, k, v, seqs), contiguous.attend(q, k, v), **TOL)
    assert [paged.length(seq) for seq in seqs] == contiguous.seqlens.tolist() == [9, 6, 7]
    assert [len(paged.pages(seq)) for seq in seqs] == [3, 2, 2]
    # The pages were handed out as the sequences grew, so they interleave.
    assert paged.pages(seqs[0]) != sorted(paged.pages(seqs[0])) or paged.pages(seqs[1])[0] < paged.pages(seqs[0])[-1]


def test_paged_allocator(rng):
    paged = PagedKVCache(6, 4, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE, max_blocks_per_seq=3)
    a, b = paged.allocate(), paged.allocate("b")
    assert a == 0 and b == "b" and paged.allocate() == 1
    assert paged.num_free_pages == 6 and paged.pages(a) == []  # pages are taken only as sequences grow
    paged.reserve(a, 9)
    assert paged.pages(a) == [0, 1, 2] and paged.num_free_pages == 3
    with pytest.raises(ValueError, match=r"would need 4 pages for 0 \+ 13 tokens, more than max_blocks_per_seq=3"):
        paged.reserve(a, 13)
    paged.reserve(b, 12)
    with pytest.raises(RuntimeError, match=r"out of pages: 1 more needed, 0 free of 6 \(page_size=4\)"):
        paged.reserve(1, 1)
    paged.free(a)
    assert paged.num_free_pages == 3
    paged.reserve(1, 1)
    assert paged.pages(1) == [2]  # the most recently freed page is handed out first
    with pytest.raises(KeyError, match=r"sequence 0 is not in this PagedKVCache"):
        paged.length(a)
    with pytest.raises(ValueError, match=r"sequence 'b' is already allocated"):
        paged.allocate("b")
    with pytest.raises(ValueError, match=r"PagedKVCache needs num_blocks >= 1 and page_size >= 1"):
        PagedKVCache(4, 0, NHEADS_KV, HEADDIM)


def test_block_table_and_seqlens(rng):
    paged = PagedKVCache(8, 4, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    a, b = paged.allocate(), paged.allocate()
    paged.attend(*tokens(rng, 2, 6), [a, b], new_lengths=[6, 1])
    table = paged.block_table([b, a])
    assert table.dtype == torch.int32 and table.device.type == DEVICE
    assert table.tolist() == [[paged.pages(b)[0], paged.pages(b)[1]], paged.pages(a)]
    assert paged.block_table([a, b], width=4).tolist() == [paged.pages(a) + [0, 0], paged.pages(b) + [0, 0]]
    assert paged.seqlens([a, b]).tolist() == [6, 1]
    with pytest.raises(ValueError, match=r"more than the width 1"):
        paged.block_table([a], width=1)
    with pytest.raises(ValueError, match=r"seqs must be distinct sequences"):
        paged.attend(*tokens(rng, 2, 1), [a, a])
    with pytest.raises(ValueError, match=r"q has batch 2 but 1 sequences were given"):
        paged.attend(*tokens(rng, 2, 1), [a])
    with pytest.raises(ValueError, match=r"new_lengths must hold one int between 0 and seqlen_new=1"):
        paged.attend(*tokens(rng, 2, 1), [a, b], new_lengths=[2, 1])


def test_fork_shares_full_pages_and_copies_the_partial_one(backend, rng):
    """A fork of a 10-token prefix on 4-token pages shares the parent's two full pages and copies the third;
    both sequences then grow independently, and each sees its own tokens only."""
    paged = PagedKVCache(12, 4, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    parent = paged.allocate()
    q, k, v = tokens(rng, 1, 11)
    paged.attend(q, k, v, [parent])
    free_before = paged.num_free_pages
    child = paged.fork(parent, prefix_len=10)
    shared, own = paged.pages(child)[:2], paged.pages(child)[2]
    assert shared == paged.pages(parent)[:2] and own not in paged.pages(parent)
    assert paged.length(child) == 10 and paged.num_free_pages == free_before - 1
    assert torch.equal(paged.k[own, :2], paged.k[paged.pages(parent)[2], :2])

    q_child, k_child, v_child = tokens(rng, 1, 3)
    q_parent, k_parent, v_parent = tokens(rng, 1, 1)
    parent_page = paged.k[paged.pages(parent)[2]].clone()
    out_child = paged.attend(q_child, k_child, v_child, [child])
    assert torch.equal(paged.k[paged.pages(parent)[2]], parent_page), "the child wrote into its parent's page"
    out_parent = paged.attend(q_parent, k_parent, v_parent, [parent])
    expected_child = full_attention(q_child, torch.cat([k[:, :10], k_child], 1), torch.cat([v[:, :10], v_child], 1))
    expected_parent = full_attention(q_parent, torch.cat([k, k_parent], 1), torch.cat([v, v_parent], 1))
    torch.testing.assert_close(out_child, expected_child, **TOL)
    torch.testing.assert_close(out_parent, expected_parent, **TOL)

    # Shared pages return to the free list only when the last sequence using them is freed.
    paged.free(parent)
    assert not set(shared) & set(paged._free)
    paged.free(child)
    assert paged.num_free_pages == 12


def test_fork_on_a_page_boundary_and_errors(rng):
    paged = PagedKVCache(6, 4, NHEADS_KV, HEADDIM, dtype=DTYPE, device=DEVICE)
    parent = paged.allocate()
    paged.attend(*tokens(rng, 1, 8), [parent])
    child = paged.fork(parent, new_seq="child")
    assert child == "child" and paged.pages(child) == paged.pages(parent) and paged.num_free_pages == 4
    paged.attend(*tokens(rng, 1, 1), [child])
    assert paged.pages(child)[:2] == paged.pages(parent) and len(paged.pages(child)) == 3
    with pytest.raises(ValueError, match=r"prefix_len must be between 0 and the 8 tokens of sequence 0, got 9"):
        paged.fork(parent, prefix_len=9)
