"""``flash_attn_with_kvcache`` and ``merge_attention_states`` through the public API, on every backend.

Each call is held to :func:`flashtile.testing.attention_ref` run on every batch row alone over the
keys it sees, in float64 and in the input dtype (the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref`). The expected cache after the append is built here,
independently of flashtile: the new tokens (rotated in fp32 when there are rotary tables) land at
rows ``cache_seqlens[b] + t`` of the row's logical cache, and everything else stays as it was, bit
for bit, including pages no block table points to and cache rows no batch row uses.

Caches are ragged (a row with no key, a full row), paged caches use shuffled block tables with spare
pages, and key counts are not multiples of any tile.
"""
import inspect
import math

import pytest
import torch
from torch._dynamo.utils import counters

import flashtile
from flashtile.interface import flash_attn_func, flash_attn_with_kvcache, merge_attention_states
from flashtile.testing import ATOL, assert_close_to_ref, attention_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def triton_kernels_present(request):
    """The Triton backend serves KV-cache calls once its launchers exist (written alongside this API), and
    merges once it lists ``merge`` in its FEATURES."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "triton":
        launch = pytest.importorskip("flashtile.backends.triton.launch")
        if not hasattr(launch, "attention_kv"):
            pytest.skip("the Triton backend has no attention_kv yet")
        from flashtile.backends import triton as triton_backend

        if "merge" in request.node.name and "merge" not in triton_backend.FEATURES:
            pytest.skip("the Triton backend does not list 'merge' in its FEATURES yet")


def randn(rng, *shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape, generator=rng) * scale).to(device=DEVICE, dtype=dtype)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def rotate(x, cos, sin, positions, interleaved):
    """The test's own rotary embedding: ``x`` ``(batch, seqlen, heads, d)`` at ``positions`` ``(batch, seqlen)``,
    in float32, returned in x's dtype."""
    half = cos.shape[1]
    cos = cos.float()[positions][:, :, None]
    sin = sin.float()[positions][:, :, None]
    x32 = x.float()
    rot, rest = x32[..., : 2 * half], x32[..., 2 * half :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, rest], dim=-1).to(x.dtype)


class Case:
    """The inputs of one call and what it must produce.

    ``logical_k`` / ``logical_v`` ``(batch, capacity, nheads_kv, d)`` are what each batch row's cache holds;
    ``k_cache`` / ``v_cache`` store them contiguously (rows ``batch_idx``) or in shuffled pages.
    """

    def __init__(self, rng, *, batch=3, seqlen_q=1, seqlen_new=1, capacity=96, nheads=4, nheads_kv=2, headdim=32,
                 headdim_v=None, dtype=torch.float16, seqlens=None, page_size=None, batch_idx=False, leftpad=None,
                 rotary_dim=0, interleaved=True, spare=3):
        self.dtype, self.page_size, self.capacity = dtype, page_size, capacity
        headdim_v = headdim_v or headdim
        self.q = randn(rng, batch, seqlen_q, nheads, headdim, dtype=dtype)
        self.k = randn(rng, batch, seqlen_new, nheads_kv, headdim, dtype=dtype) if seqlen_new else None
        self.v = randn(rng, batch, seqlen_new, nheads_kv, headdim_v, dtype=dtype) if seqlen_new else None
        self.logical_k = randn(rng, batch, capacity, nheads_kv, headdim, dtype=dtype)
        self.logical_v = randn(rng, batch, capacity, nheads_kv, headdim_v, dtype=dtype)
        if seqlens is None:
            # A row with no key before the call, a row the call fills to the capacity, one in between.
            seqlens = [0, capacity - seqlen_new] + torch.randint(0, capacity - seqlen_new + 1, (batch - 2,),
                                                                 generator=rng).tolist()
        self.seqlens = seqlens[:batch]
        self.leftpad = leftpad
        self.kwargs = dict(cache_seqlens=int32(self.seqlens))
        if leftpad is not None:
            self.kwargs["cache_leftpad"] = int32(leftpad)
        self.rows = None
        if page_size is not None:
            per_row = capacity // page_size
            num_blocks = batch * per_row + spare
            table = torch.randperm(num_blocks, generator=rng)[: batch * per_row].view(batch, per_row)
            self.table = table.to(DEVICE)
            self.kwargs["block_table"] = self.table.to(torch.int32)
            self.k_cache = randn(rng, num_blocks, page_size, nheads_kv, headdim, dtype=dtype)
            self.v_cache = randn(rng, num_blocks, page_size, nheads_kv, headdim_v, dtype=dtype)
        elif batch_idx:
            self.rows = torch.randperm(batch + 2, generator=rng)[:batch].to(DEVICE)
            self.kwargs["cache_batch_idx"] = self.rows.to(torch.int32)
            self.k_cache = randn(rng, batch + 2, capacity, nheads_kv, headdim, dtype=dtype)
            self.v_cache = randn(rng, batch + 2, capacity, nheads_kv, headdim_v, dtype=dtype)
        else:
            self.k_cache = torch.empty_like(self.logical_k)
            self.v_cache = torch.empty_like(self.logical_v)
        self._store(self.k_cache, self.logical_k)
        self._store(self.v_cache, self.logical_v)

        self.q_rot, self.k_rot = self.q, self.k
        if rotary_dim:
            # Tables cover the capacity plus seqlen_q: every position a causal query can take.
            angle = torch.rand(capacity + seqlen_q, rotary_dim // 2, generator=rng, dtype=torch.float64) * 2 * math.pi
            cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
            self.kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
        self.expected_k = self.expected_v = None

    def _store(self, cache, logical):
        """Write the logical ``(batch, capacity, ...)`` caches into ``cache``'s layout."""
        if self.page_size is not None:
            cache[self.table.flatten()] = logical.reshape(-1, self.page_size, *logical.shape[2:])
        elif self.rows is not None:
            cache[self.rows] = logical
        else:
            cache.copy_(logical)

    def load(self, cache):
        """The logical ``(batch, capacity, ...)`` view of ``cache``."""
        if self.page_size is not None:
            return cache[self.table.flatten()].reshape(self.table.shape[0], self.capacity, *cache.shape[2:])
        if self.rows is not None:
            return cache[self.rows]
        return cache

    def run(self, **options):
        """The call under test; fills the expected caches (from the inputs, before they are written)."""
        causal = options.get("causal", False) or tuple(options.get("window_size", (-1, -1))) != (-1, -1)
        if "rotary_cos" in self.kwargs:
            cos, sin = self.kwargs["rotary_cos"], self.kwargs["rotary_sin"]
            interleaved = self.kwargs["rotary_interleaved"]
            start = torch.tensor(self.seqlens, device=DEVICE)[:, None]
            new_positions = start + torch.arange(self.k.shape[1], device=DEVICE)
            q_positions = start + (torch.arange(self.q.shape[1], device=DEVICE) if causal else 0)
            self.k_rot = rotate(self.k, cos, sin, new_positions, interleaved)
            self.q_rot = rotate(self.q, cos, sin, q_positions.expand(-1, self.q.shape[1]), interleaved)
        self.expected_k, self.expected_v = self.k_cache.clone(), self.v_cache.clone()
        if self.k is not None:
            logical_k, logical_v = self.logical_k.clone(), self.logical_v.clone()
            for b, start in enumerate(self.seqlens):
                logical_k[b, start : start + self.k.shape[1]] = self.k_rot[b]
                logical_v[b, start : start + self.v.shape[1]] = self.v[b]
            self._store(self.expected_k, logical_k)
            self._store(self.expected_v, logical_v)
        return flash_attn_with_kvcache(self.q, self.k_cache, self.v_cache, self.k, self.v, return_softmax_lse=True,
                                       **self.kwargs, **options)

    def reference(self, upcast, **options):
        """attention_ref of every batch row alone over its keys ``[leftpad, cache_seqlens + seqlen_new)``."""
        keys_k, keys_v = self.load(self.expected_k), self.load(self.expected_v)
        seqlen_new = 0 if self.k is None else self.k.shape[1]
        slopes = options.pop("alibi_slopes", None)
        outs, lses = [], []
        for b, start in enumerate(self.seqlens):
            keys = slice(0 if self.leftpad is None else self.leftpad[b], start + seqlen_new)
            out, lse = attention_ref(self.q_rot[b : b + 1], keys_k[b : b + 1, keys], keys_v[b : b + 1, keys],
                                     upcast=upcast, alibi_slopes=None if slopes is None else slopes[b : b + 1],
                                     **options)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def check(self, out, lse, rotary=False, **options):
        """out and lse within the tolerance rule; the caches exactly as expected (to an fp32-rotation rounding
        with rotary tables)."""
        assert out.shape == self.q.shape[:3] + self.v_cache.shape[-1:] and out.dtype == self.dtype
        assert lse.shape == (self.q.shape[0], self.q.shape[2], self.q.shape[1]) and lse.dtype == torch.float32
        assert not out.requires_grad
        ref_hi = self.reference(True, **options)
        ref_lo = self.reference(False, **options)
        atol = ATOL[self.dtype][0]
        assert_close_to_ref("out", out, ref_hi[0], ref_lo[0], atol)
        assert_close_to_ref("lse", lse, ref_hi[1], ref_lo[1], atol)
        if rotary:
            # Ours rotate in fp32 too, but the GPU fuses multiply-adds: one rounding step apart at most.
            tol = dict(atol=2e-3, rtol=2e-3) if self.dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(self.k_cache, self.expected_k, **tol)
        else:
            assert torch.equal(self.k_cache, self.expected_k), "k_cache differs from the expected append"
        assert torch.equal(self.v_cache, self.expected_v), "v_cache differs from the expected append"


# (seqlen_q, seqlen_new, causal): decoding, verification of 4 draft tokens, attention without appending,
# more queries than new tokens (chunked prefill whose first queries see only the cache).
SHAPES = {
    "decode": (1, 1, False),
    "decode-causal": (1, 1, True),
    "verify4": (4, 4, True),
    "no-append": (3, 0, False),
    "q5-new2-causal": (5, 2, True),
}
LAYOUTS = {"contiguous": {}, "paged16": dict(page_size=16), "batch_idx": dict(batch_idx=True)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvcache_matches_reference(backend, rng, layout, shape):
    seqlen_q, seqlen_new, causal = SHAPES[shape]
    case = Case(rng, seqlen_q=seqlen_q, seqlen_new=seqlen_new, **LAYOUTS[layout])
    out, lse = case.run(causal=causal)
    case.check(out, lse, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kvcache_dtypes(backend, rng, dtype):
    case = Case(rng, seqlen_q=2, seqlen_new=2, page_size=16, dtype=dtype)
    out, lse = case.run(causal=True)
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("nheads, nheads_kv", [(4, 4), (4, 1), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_kvcache_gqa(backend, rng, nheads, nheads_kv, layout):
    case = Case(rng, seqlen_q=2, seqlen_new=2, nheads=nheads, nheads_kv=nheads_kv, **LAYOUTS[layout])
    out, lse = case.run(causal=True)
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("page_size, batch, capacity", [(1, 3, 40), (16, 3, 96), (64, 2, 128), (256, 1, 512)])
def test_paged_equals_contiguous(backend, rng, page_size, batch, capacity):
    """The same logical cache, contiguous and in shuffled pages: the same out, lse and appended cache."""
    paged = Case(rng, batch=batch, seqlen_q=2, seqlen_new=2, capacity=capacity, page_size=page_size,
                 seqlens=[capacity - 2, 5, 0][:batch])
    contiguous = Case(rng, batch=batch, seqlen_q=2, seqlen_new=2, capacity=capacity, seqlens=paged.seqlens)
    for name in ("q", "k", "v", "logical_k", "logical_v"):
        setattr(contiguous, name, getattr(paged, name))
    contiguous._store(contiguous.k_cache, paged.logical_k)
    contiguous._store(contiguous.v_cache, paged.logical_v)
    out_paged, lse_paged = paged.run(causal=True)
    out, lse = contiguous.run(causal=True)
    paged.check(out_paged, lse_paged, causal=True)
    torch.testing.assert_close(out_paged, out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse_paged, lse, atol=1e-4, rtol=0)
    assert torch.equal(paged.load(paged.k_cache), contiguous.k_cache)
    assert torch.equal(paged.load(paged.v_cache), contiguous.v_cache)


def test_unused_block_table_entries_are_never_read(backend, rng):
    """Entries past the pages a sequence uses may hold anything, -1 or a page past the cache, as engines pad them."""
    case = Case(rng, seqlen_q=1, seqlen_new=1, page_size=16, seqlens=[0, 20, 47])
    table = case.kwargs["block_table"].clone()
    used = [1, 2, 3]  # ceil((cache_seqlens + 1) / 16)
    for b, pages in enumerate(used):
        table[b, pages:] = -1 if b % 2 else 10_000
    case.kwargs["block_table"] = table
    out, lse = case.run(causal=True)
    case.check(out, lse, causal=True)


@pytest.mark.parametrize("interleaved, causal, rotary_dim, layout", [
    (True, True, 32, "contiguous"),
    (True, False, 16, "paged16"),
    (False, True, 16, "contiguous"),
    (False, False, 32, "batch_idx"),
], ids=["gptj-causal-full", "gptj-partial-paged", "neox-causal-partial", "neox-full-batch_idx"])
def test_rotary(backend, rng, interleaved, causal, rotary_dim, layout):
    """k rotated at its key rows; q at its tokens' rows when causal, else all at cache_seqlens (flash-attn)."""
    case = Case(rng, seqlen_q=3, seqlen_new=3, rotary_dim=rotary_dim, interleaved=interleaved, **LAYOUTS[layout])
    out, lse = case.run(causal=causal)
    case.check(out, lse, rotary=True, causal=causal)


@pytest.mark.parametrize("layout", ["contiguous", "batch_idx"])
def test_cache_leftpad(backend, rng, layout):
    """Keys before cache_leftpad[b] are never seen (a row that is all padding included); causal and ALiBi
    distances are counted in key rows, as flash-attn does."""
    seqlens, leftpad = [10, 40, 7], [3, 0, 7]
    case = Case(rng, seqlen_q=2, seqlen_new=2, capacity=64, seqlens=seqlens, leftpad=leftpad, **LAYOUTS[layout])
    slopes = torch.rand(3, 4, generator=rng).to(DEVICE) * 0.3
    out, lse = case.run(causal=True, alibi_slopes=slopes)
    case.check(out, lse, causal=True, alibi_slopes=slopes)


def test_rotary_positions_are_key_rows_with_leftpad(backend, rng):
    """flash-attn rotates at key rows, left padding included: new token t of row b at cache_seqlens[b] + t."""
    case = Case(rng, seqlen_q=2, seqlen_new=2, capacity=64, seqlens=[10, 40, 7], leftpad=[3, 0, 5], rotary_dim=16)
    out, lse = case.run(causal=True)
    case.check(out, lse, rotary=True, causal=True)


def test_kvcache_variants(backend, rng):
    """Sliding window + softcap + ALiBi + sink + headdim_v on a paged cache, queries longer than the append."""
    case = Case(rng, seqlen_q=3, seqlen_new=2, page_size=16, headdim_v=48)
    slopes = torch.rand(4, generator=rng).to(DEVICE) * 0.3
    sink = torch.randn(4, generator=rng).to(DEVICE)
    options = dict(causal=True, window_size=(20, -1), softcap=5.0, softmax_scale=0.3)
    out, lse = case.run(alibi_slopes=slopes, sink=sink, **options)
    case.check(out, lse, alibi_slopes=slopes.expand(3, 4), sink=sink, **options)


def test_num_splits_agree(backend, rng):
    """One split, the automatic choice and an explicit count give the same result (within rounding)."""
    results = []
    for num_splits in (1, 0, 3):
        case = Case(torch.Generator().manual_seed(5), seqlen_q=1, seqlen_new=1, capacity=320, page_size=16,
                    nheads=2, nheads_kv=1)
        out, lse = case.run(causal=True, num_splits=num_splits)
        case.check(out, lse, causal=True)
        results.append((out, lse))
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-3, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=0)


def test_empty_rows_and_lengths_as_int_or_none(backend, rng):
    """A row with no key outputs 0 with lse -inf; cache_seqlens as an int, and None (the cache is full)."""
    case = Case(rng, seqlen_q=2, seqlen_new=0, seqlens=[0, 0, 0])
    out, lse = case.run()
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    case = Case(rng, seqlen_q=1, seqlen_new=2, seqlens=[17, 17, 17])
    case.kwargs["cache_seqlens"] = 17
    out, lse = case.run(causal=True)
    case.check(out, lse, causal=True)
    case = Case(rng, seqlen_q=1, seqlen_new=0, seqlens=[96, 96, 96])
    case.kwargs["cache_seqlens"] = None
    out, lse = case.run()
    case.check(out, lse)


def test_returns_out_unless_lse_asked(backend, rng):
    case = Case(rng)
    out = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, case.k, case.v, cache_seqlens=int32([0, 95, 3]))
    assert isinstance(out, torch.Tensor) and out.shape == case.q.shape


def test_no_gradient_flows(backend, rng):
    """Inference only, as in flash-attn: inputs that require grad give outputs that do not."""
    case = Case(rng, dtype=torch.float32)
    case.q.requires_grad_()
    out, lse = case.run(causal=True)
    assert not out.requires_grad and not lse.requires_grad


def test_argument_order_matches_flash_attn():
    """flash-attn's parameters in flash-attn's order (``sink``, flashtile's addition, sits before num_splits; the
    FP8 cache's ``k_descale``, ``v_descale`` come last)."""
    flash_attn = ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                  "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap",
                  "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse"]
    ours = list(inspect.signature(flash_attn_with_kvcache).parameters)
    assert [name for name in ours if name not in ("sink", "k_descale", "v_descale")] == flash_attn
    assert ours.index("sink") == ours.index("num_splits") - 1
    # The FP8 cache's descales (FA3's names) come after flash-attn 2's parameters.
    assert ours[-2:] == ["k_descale", "v_descale"]


def test_positional_call_like_flash_attn(rng):
    case = Case(rng, seqlen_q=1, seqlen_new=1, page_size=16)
    out = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, case.k, case.v, None, None,
                                  case.kwargs["cache_seqlens"], None, None, case.kwargs["block_table"], None, True)
    ref = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=case.kwargs["cache_seqlens"] + 1,
                                  block_table=case.kwargs["block_table"], causal=True)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)


def test_append_past_capacity_writes_nothing_out_of_bounds(backend, rng):
    """The backends' own guard (the API refuses such calls first): rows past the capacity and pages past
    num_blocks are dropped, and nothing else changes."""
    from flashtile.dispatch import get_backend
    from flashtile.validation import kvcache_args

    case = Case(rng, batch=2, seqlen_new=4, capacity=32, page_size=8, seqlens=[0, 0], spare=2)
    args = kvcache_args(case.q, case.k_cache, case.v_cache, case.k, case.v, **case.kwargs)
    table = case.kwargs["block_table"].clone()
    table[0, 0] = case.k_cache.shape[0] + 5  # a page past the cache
    args = type(args)(**{**vars(args), "cache_seqlens": int32([5, 30]), "block_table": table})
    before_k, before_v = case.k_cache.clone(), case.v_cache.clone()
    get_backend(backend).append_kv(case.q, case.k_cache, case.v_cache, case.k, case.v, args)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    # Row 0 writes rows 5..8: rows 5..7 sit on the bad page (dropped), row 8 on its second page.
    expected_k[table[0, 1], 0], expected_v[table[0, 1], 0] = case.k[0, 3], case.v[0, 3]
    # Row 1 writes rows 30, 31 (its last page); 32 and 33 are past the capacity (dropped).
    expected_k[table[1, 3], 6:8], expected_v[table[1, 3], 6:8] = case.k[1, :2], case.v[1, :2]
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)


def test_dispatch_is_recorded(backend, rng, clean_dispatch_state):
    case = Case(rng, page_size=16)
    case.run(causal=True)
    stats = flashtile.stats()
    assert stats["calls"] == {backend: 1} and stats["fallbacks"] == {}
    (kernel,) = stats["kernels"]
    assert backend in kernel and "paged" in kernel


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_repeated_steps_reuse_validation(backend, rng, paged, monkeypatch, clean_dispatch_state):
    """A decode loop whose index values are not read on the host (CUDA tensors without
    FLASHTILE_VALIDATE_VALUES; stood in for here) validates and plans its first step only. Later steps take
    their own lengths, pages, sink and ALiBi slopes, match the reference and are counted; another shape or
    option types validate afresh."""
    from flashtile import validation

    monkeypatch.setattr(validation, "values_checked", lambda device: False)
    validated = []
    real = validation.kvcache_args
    monkeypatch.setattr(validation, "kvcache_args", lambda *a, **kw: (validated.append(1), real(*a, **kw))[1])
    batch, nheads, nheads_kv, headdim, capacity = 2, 4, 2, 32, 48
    k_cache, v_cache = (randn(rng, batch, capacity, nheads_kv, headdim) for _ in range(2))
    table = None
    if paged:
        # Pages of 16 rows, shuffled: row b's logical rows r live on page table[b, r // 16].
        table = torch.randperm(2 * batch * 3, generator=rng)[: batch * 3].reshape(batch, 3).to(DEVICE, torch.int32)

        def pages(cache):
            store = torch.zeros(2 * batch * 3, 16, nheads_kv, headdim, dtype=cache.dtype, device=DEVICE)
            return store.index_copy_(0, table.flatten().long(), cache.reshape(-1, 16, nheads_kv, headdim))

        k_store, v_store = pages(k_cache), pages(v_cache)
    else:
        k_store, v_store = k_cache.clone(), v_cache.clone()
    lengths = [11, 30]
    for step in range(3):
        q = randn(rng, batch, 1, nheads, headdim)
        k, v = (randn(rng, batch, 1, nheads_kv, headdim) for _ in range(2))
        sink = randn(rng, nheads, dtype=torch.float32)
        slopes = randn(rng, nheads, dtype=torch.float32).abs()
        out = flash_attn_with_kvcache(q, k_store, v_store, k, v, cache_seqlens=int32(lengths), block_table=table,
                                      causal=True, sink=sink, alibi_slopes=slopes)
        for b in range(batch):
            k_cache[b, lengths[b]], v_cache[b, lengths[b]] = k[b, 0], v[b, 0]
            n = lengths[b] + 1
            hi, _ = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal=True, sink=sink,
                                  alibi_slopes=slopes)
            lo, _ = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal=True, sink=sink,
                                  alibi_slopes=slopes, upcast=False)
            assert_close_to_ref(f"out step {step} row {b}", out[b:b + 1], hi, lo, ATOL[torch.float16][0])
        lengths = [n + 1 for n in lengths]
    assert len(validated) == 1 and flashtile.stats()["calls"] == {backend: 3}
    flash_attn_with_kvcache(q[:1], k_store, v_store, cache_seqlens=int32(lengths[:1]),
                            block_table=None if table is None else table[:1])
    assert len(validated) == 2
    with pytest.raises(TypeError, match="softcap"):
        flash_attn_with_kvcache(q[:1], k_store, v_store, cache_seqlens=int32(lengths[:1]),
                                block_table=None if table is None else table[:1], softcap=False)


# ---------------------------------------------------------------- merge_attention_states


def test_merge_equals_attention_over_the_union(backend, rng):
    """Attention over keys A and over keys B, merged, is attention over A + B (cascade / context parallel)."""
    q = randn(rng, 2, 5, 4, 32)
    k, v = randn(rng, 2, 70, 2, 32), randn(rng, 2, 70, 2, 32)
    out_a, lse_a, _ = flash_attn_func(q, k[:, :30], v[:, :30], return_attn_probs=True)
    out_b, lse_b, _ = flash_attn_func(q, k[:, 30:], v[:, 30:], return_attn_probs=True)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_hi = attention_ref(q, k, v)
    ref_lo = attention_ref(q, k, v, upcast=False)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    # Two rounded halves merged: allow the rounding of each part on top of the rule's bound.
    assert_close_to_ref("out", out, ref_hi[0], ref_lo[0], 2 * ATOL[torch.float16][0])
    assert_close_to_ref("lse", lse, ref_hi[1], ref_lo[1], ATOL[torch.float16][0])


def test_merge_is_stable_and_handles_empty_sides(backend, rng):
    """lses far outside exp's range merge exactly; a -inf side adds nothing; both -inf: out 0, lse -inf."""
    out_a, out_b = randn(rng, 2, 3, 4, 32, dtype=torch.float32), randn(rng, 2, 3, 4, 32, dtype=torch.float32)
    lse_a = (torch.randn(2, 4, 3, generator=rng, dtype=torch.float64) * 1e4).to(DEVICE)
    lse_b = lse_a + torch.randn(2, 4, 3, generator=rng, dtype=torch.float64).to(DEVICE)
    lse_a[0, 0, 0] = float("-inf")
    lse_a[1, 2] = lse_b[1, 2] = float("-inf")
    out, lse = merge_attention_states(out_a, lse_a.float(), out_b, lse_b.float())
    lse_ref = torch.logaddexp(lse_a.float().double(), lse_b.float().double())
    weight_a = torch.exp(lse_a.float().double() - lse_ref).nan_to_num(0.0).transpose(1, 2)[..., None]
    weight_b = torch.exp(lse_b.float().double() - lse_ref).nan_to_num(0.0).transpose(1, 2)[..., None]
    out_ref = weight_a * out_a.double() + weight_b * out_b.double()
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-2, rtol=1e-6)
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2])) and bool((lse[1, 2] == float("-inf")).all())
    assert torch.equal(out[0, 0, 0], out_b[0, 0, 0])


def test_merge_dispatch_is_recorded(backend, rng, clean_dispatch_state):
    out = randn(rng, 1, 2, 2, 16)
    lse = torch.zeros(1, 2, 2, device=DEVICE)
    merge_attention_states(out, lse, out, lse)
    stats = flashtile.stats()
    assert stats["calls"] == {backend: 1} and stats["fallbacks"] == {}
    assert any("merge" in kernel for kernel in stats["kernels"])


# ---------------------------------------------------------------- torch.compile and CUDA graphs


def test_decode_step_compiles_without_graph_break(backend, rng):
    """torch.compile(fullgraph=True) of a decode step: the in-place append survives, values match eager."""
    torch._dynamo.reset()
    counters.clear()

    def step(q, k, v, k_cache, v_cache, cache_seqlens, block_table):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                           block_table=block_table, causal=True, return_softmax_lse=True)
        return out * 2, lse

    case = Case(rng, dtype=torch.float32, page_size=16)
    compiled_cache = (case.k_cache.clone(), case.v_cache.clone())
    eager = step(case.q, case.k, case.v, case.k_cache, case.v_cache, case.kwargs["cache_seqlens"],
                 case.kwargs["block_table"])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(
        case.q, case.k, case.v, *compiled_cache, case.kwargs["cache_seqlens"], case.kwargs["block_table"])
    assert counters["graph_break"] == {}
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(compiled_cache[0], case.k_cache) and torch.equal(compiled_cache[1], case.v_cache)
    torch._dynamo.reset()


def test_merge_compiles_without_graph_break(backend, rng):
    torch._dynamo.reset()
    counters.clear()
    out_a, out_b = randn(rng, 2, 3, 4, 16), randn(rng, 2, 3, 4, 16)
    lse_a, lse_b = torch.randn(2, 4, 3, generator=rng).to(DEVICE), torch.randn(2, 4, 3, generator=rng).to(DEVICE)
    compiled = torch.compile(merge_attention_states, fullgraph=True, backend="aot_eager")(out_a, lse_a, out_b, lse_b)
    eager = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert counters["graph_break"] == {}
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_replays_in_a_cuda_graph(paged):
    """A decode step (append + attention, lengths advanced on the device) captured once and replayed for
    several steps gives what eager calls give, step by step."""
    rng = torch.Generator().manual_seed(0)
    batch, capacity, nheads, nheads_kv, headdim = 4, 256, 8, 2, 64

    def new_cache():
        gen = torch.Generator().manual_seed(1)
        if paged:
            k_cache = randn(gen, batch * capacity // 16 + 3, 16, nheads_kv, headdim)
            table = torch.randperm(k_cache.shape[0], generator=gen)[: batch * capacity // 16]
            table = table.view(batch, -1).to(DEVICE, torch.int32)
        else:
            k_cache, table = randn(gen, batch, capacity, nheads_kv, headdim), None
        return k_cache, randn(gen, *k_cache.shape), int32([0, 17, 100, 200]), table

    def step(q, k, v, k_cache, v_cache, seqlens, table):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                      causal=True, num_splits=0)
        seqlens.add_(1)
        return out

    static = [randn(rng, batch, 1, nheads, headdim), randn(rng, batch, 1, nheads_kv, headdim),
              randn(rng, batch, 1, nheads_kv, headdim)]
    graph_state, eager_state = new_cache(), new_cache()
    # Compile the kernels on a side stream first, on a throwaway cache of the same shapes.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*static, *new_cache())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(*static, *graph_state)
    for _ in range(5):
        inputs = [randn(rng, *t.shape) for t in static]
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        expected = step(*inputs, *eager_state)
        torch.testing.assert_close(static_out, expected, atol=2e-3, rtol=0)
    torch.cuda.synchronize()
    assert torch.equal(graph_state[2], eager_state[2])
    assert torch.equal(graph_state[0], eager_state[0]) and torch.equal(graph_state[1], eager_state[1])
