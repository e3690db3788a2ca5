"""The Triton KV-cache kernels (``flashtile/backends/triton/decode.py``) called directly with hand-built
:class:`~flashtile.backends.KVCacheArgs`: append (with rotary), split-KV attention over contiguous
and paged caches, and the state merge.

Attention is held to :func:`flashtile.testing.attention_ref` run on every batch row alone over the
keys it sees (gathered from the cache), with the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref`. Caches are ragged (a row with no key, a full row),
paged caches use shuffled block tables with spare pages, and key counts are not multiples of the
16-key tiles the interpreter runs. Appends are compared element by element with the expected cache,
and everything outside the written rows must be left as it was (bit for bit).
"""
import math

import pytest
import torch

from flashtile.backends import KVCacheArgs
from flashtile.testing import ATOL, assert_close_to_ref, attention_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA:
    pytest.importorskip("triton")
from flashtile.backends.triton import describe  # noqa: E402
from flashtile.backends.triton.decode import append_kv, attention_kv, merge_states, plan  # noqa: E402

# bfloat16 only on a GPU: Triton's interpreter computes it wrongly.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def randn(rng, *shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape, generator=rng) * scale).to(device=DEVICE, dtype=dtype)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def kv_args(headdim, capacity, causal=False, window=(-1, -1), **fields):
    left, right = window
    return KVCacheArgs(softmax_scale=1.0 / math.sqrt(headdim), causal=causal, window_left=left,
                       window_right=0 if causal else right, max_seqlen_k=capacity, **fields)


def to_paged(cache, page_size, rng, spare=3):
    """A contiguous ``(batch, capacity, h, d)`` cache as ``(num_blocks, page_size, h, d)`` pages in shuffled
    order, plus ``spare`` pages no table points to, and the int32 block table ``(batch, capacity / page_size)``."""
    batch, capacity, nheads_kv, headdim = cache.shape
    per_row = capacity // page_size
    num_blocks = batch * per_row + spare
    table = torch.randperm(num_blocks, generator=rng)[: batch * per_row]
    pages = randn(rng, num_blocks, page_size, nheads_kv, headdim, dtype=cache.dtype)
    pages[table.to(DEVICE)] = cache.reshape(batch * per_row, page_size, nheads_kv, headdim)
    return pages, table.view(batch, per_row).to(device=DEVICE, dtype=torch.int32)


def from_paged(pages, table):
    """The logical contiguous ``(batch, capacity, h, d)`` view of a paged cache."""
    batch, per_row = table.shape
    return pages[table.long().flatten()].reshape(batch, per_row * pages.shape[1], *pages.shape[2:])


def reference(q, k_cache, v_cache, args, seqlen_new=0, cache_batch_idx=None, upcast=True):
    """attention_ref of every batch row alone over its keys ``[leftpad, cache_seqlens + seqlen_new)``
    of a contiguous (logical) cache; returns out, lse like the kernels."""
    batch, _, nheads, _ = q.shape
    seqlens = args.cache_seqlens.tolist()
    leftpad = args.cache_leftpad.tolist() if args.cache_leftpad is not None else [0] * batch
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(batch))
    window = (args.window_left, -1 if args.causal else args.window_right)
    outs, lses = [], []
    for b in range(batch):
        end = min(seqlens[b] + seqlen_new, args.max_seqlen_k)
        keys = slice(leftpad[b], max(end, leftpad[b]))
        slopes = None if args.alibi_slopes is None else args.alibi_slopes[b : b + 1]
        row = slice(rows[b], rows[b] + 1)
        out, lse = attention_ref(q[b : b + 1], k_cache[row, keys], v_cache[row, keys], causal=args.causal,
                                 softmax_scale=args.softmax_scale, upcast=upcast, window_size=window,
                                 softcap=args.softcap, alibi_slopes=slopes, sink=args.sink)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check_attention(q, k_cache, v_cache, args, logical=None, config=None, **ref_options):
    """Run attention_kv and hold out and lse to the tolerance rule; ``logical``: the contiguous (k, v)
    the reference reads when the kernels get a paged cache; ``config``: tiles instead of the table's."""
    out, lse = attention_kv(q, k_cache, v_cache, args, config)
    assert out.shape == (*q.shape[:3], v_cache.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    k_ref, v_ref = logical if logical is not None else (k_cache, v_cache)
    hi = reference(q, k_ref, v_ref, args, **ref_options)
    lo = reference(q, k_ref, v_ref, args, upcast=False, **ref_options)
    atol = ATOL[q.dtype][0]
    assert_close_to_ref("out", out, hi[0], lo[0], atol)
    assert_close_to_ref("lse", lse, hi[1], lo[1], atol)
    return out, lse


def caches(rng, batch, capacity, nheads_kv, headdim, headdim_v=None, dtype=torch.float16):
    return (randn(rng, batch, capacity, nheads_kv, headdim, dtype=dtype),
            randn(rng, batch, capacity, nheads_kv, headdim_v or headdim, dtype=dtype))


# Ragged rows: an empty cache, a full one, lengths off the 16-key tiles.
SEQLENS = [37, 0, 70, 5]
CAPACITY = 70


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (3, True), (3, False)], ids=["decode", "causal3", "full3"])
def test_attention(rng, dtype, group, seqlen_q, causal):
    nheads_kv, headdim = 2, 64
    k_cache, v_cache = caches(rng, len(SEQLENS), CAPACITY, nheads_kv, headdim, dtype=dtype)
    q = randn(rng, len(SEQLENS), seqlen_q, nheads_kv * group, headdim, dtype=dtype)
    check_attention(q, k_cache, v_cache, kv_args(headdim, CAPACITY, causal=causal, cache_seqlens=int32(SEQLENS)))


def test_attention_gqa8_splits(rng):
    """Group 8 (half a 16-row tile per token) with three queries and three splits: rows of one
    tile hold two tokens' heads."""
    k_cache, v_cache = caches(rng, 2, 90, 1, 32)
    q = randn(rng, 2, 3, 8, 32)
    args = kv_args(32, 90, causal=True, cache_seqlens=int32([80, 9]), num_splits=3)
    chosen = plan(q, k_cache, v_cache, args)
    # A split never gets less than a key block: on a GPU's wider tiles 90 keys make fewer blocks.
    assert chosen.num_splits == min(3, -(-90 // chosen.config.BLOCK_N))
    check_attention(q, k_cache, v_cache, args)


@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=["one", "three", "auto"])
def test_splits(rng, num_splits):
    """Split-KV against the reference; the 90-key row leaves the last split a partial block, the
    5-key row empty splits, the 0-key row nothing but empty splits."""
    capacity, headdim = 100, 64
    k_cache, v_cache = caches(rng, 3, capacity, 1, headdim)
    q = randn(rng, 3, 1, 4, headdim)
    args = kv_args(headdim, capacity, cache_seqlens=int32([90, 5, 0]), num_splits=num_splits)
    chosen = plan(q, k_cache, v_cache, args)
    blocks = -(-capacity // chosen.config.BLOCK_N)
    if num_splits:
        assert chosen.num_splits == min(num_splits, blocks), chosen
    elif not torch.cuda.is_available():
        # The interpreter's pretend GPU is small enough that auto splits these three rows.
        assert chosen.num_splits > 1, chosen
    check_attention(q, k_cache, v_cache, args)


def test_combine_in_chunks(rng, monkeypatch):
    """More splits than the combine kernel loads at once: it merges them chunk by chunk, the last
    chunk partial, with empty splits (the 5-key row) in every chunk."""
    from flashtile.backends.triton import decode

    # headdim 64 and a 128-element tile: 2 splits per load, so 7 splits take 4 loads.
    monkeypatch.setattr(decode, "_COMBINE_TILE", 128)
    capacity, headdim = 112, 64
    k_cache, v_cache = caches(rng, 2, capacity, 1, headdim)
    q = randn(rng, 2, 1, 4, headdim)
    args = kv_args(headdim, capacity, cache_seqlens=int32([111, 5]), num_splits=7)
    assert plan(q, k_cache, v_cache, args).num_splits == min(7, -(-capacity // plan(q, k_cache, v_cache,
                                                                                       args).config.BLOCK_N))
    check_attention(q, k_cache, v_cache, args)


@pytest.mark.parametrize("capacity,batch,headdim,page_size,num_splits,expected", [
    (1024, 1, 128, 0, 0, (64, 2, 16)),  # 128-key splits leave SMs idle: 64-key blocks, one a split
    (2048, 1, 128, 0, 0, (128, 2, 16)),  # 16 splits of one 128-key block fill the SMs
    (8192, 1, 128, 0, 0, (128, 3, 16)),  # four blocks a split keep the third stage
    (1024, 1, 128, 256, 0, (64, 2, 16)),  # pages of 256 hold whole 64-key blocks
    (1024, 1, 128, 16, 0, (32, 3, 8)),  # small pages keep their row-gather tile and splits
    (1024, 1, 128, 0, 8, (128, 2, 8)),  # a given split count keeps the table's tile
    (1024, 8, 128, 0, 0, (128, 3, 2)),  # enough programs: the table's tile
    (1024, 1, 64, 0, 0, (64, 2, 16)),  # head dim 64's table tile is 64 keys already: it splits finer
])
def test_short_cache_plan(monkeypatch, capacity, batch, headdim, page_size, num_splits, expected):
    """The KV-cache kernel's tiles and splits on an H200 (132 SMs, sm_90), bf16, 32/8 heads, one query:
    ``configs.decode_plan``'s short-cache rules."""
    from flashtile.backends.triton import configs

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cfg, splits = configs.decode_plan(headdim, torch.bfloat16, torch.device("cuda", 0), rows=4, programs=batch * 8,
                                      capacity=capacity, num_splits=num_splits, page_size=page_size)
    assert (cfg.BLOCK_N, cfg.num_stages, splits) == expected


def test_splits_agree(rng):
    """One split and several give the same result to within fp32 rounding of the merge."""
    k_cache, v_cache = caches(rng, 2, 100, 2, 32)
    q = randn(rng, 2, 2, 4, 32)
    results = [attention_kv(q, k_cache, v_cache, kv_args(32, 100, causal=True, cache_seqlens=int32([99, 50]),
                                                          num_splits=n)) for n in (1, 4, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-3, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged(rng, page_size):
    """Shuffled pages give the reference's result, and bit for bit the contiguous cache's."""
    capacity, headdim = 128, 32
    k_logical, v_logical = caches(rng, 3, capacity, 2, headdim)
    k_pages, table = to_paged(k_logical, page_size, rng)
    v_pages = torch.empty_like(k_pages)
    v_pages[table.long().flatten()] = v_logical.reshape(-1, page_size, 2, headdim)
    q = randn(rng, 3, 2, 4, headdim)
    seqlens = int32([100, 0, 128])
    args = kv_args(headdim, capacity, causal=True, cache_seqlens=seqlens, block_table=table, num_splits=2)
    out, lse = check_attention(q, k_pages, v_pages, args, logical=(k_logical, v_logical))
    contiguous = attention_kv(q, k_logical, v_logical, kv_args(headdim, capacity, causal=True, cache_seqlens=seqlens,
                                                               num_splits=2))
    assert torch.equal(out, contiguous[0]) and torch.equal(lse, contiguous[1])


def test_paged_256(rng):
    """One 256-key page per row, longer than any key tile."""
    k_logical, v_logical = caches(rng, 1, 512, 1, 16)
    k_pages, table = to_paged(k_logical, 256, rng, spare=1)
    v_pages = torch.empty_like(k_pages)
    v_pages[table.long().flatten()] = v_logical.reshape(-1, 256, 1, 16)
    q = randn(rng, 1, 1, 2, 16)
    args = kv_args(16, 512, cache_seqlens=int32([300]), block_table=table)
    check_attention(q, k_pages, v_pages, args, logical=(k_logical, v_logical))


def test_batch_idx_and_leftpad(rng):
    """Batch rows read rows of a larger cache through cache_batch_idx; left padding shifts their first
    key (and the causal alignment) to cache_leftpad."""
    k_cache, v_cache = caches(rng, 5, 60, 2, 32)
    q = randn(rng, 3, 2, 4, 32)
    batch_idx = int32([4, 0, 2])
    args = kv_args(32, 60, causal=True, cache_seqlens=int32([50, 7, 60]), cache_leftpad=int32([13, 7, 0]),
                   cache_batch_idx=batch_idx, num_splits=2)
    check_attention(q, k_cache, v_cache, args, cache_batch_idx=batch_idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_variants(rng, dtype):
    """Sliding window, softcap, ALiBi and a sink together, with split-KV (the sink joins once)."""
    nheads_kv, group, headdim = 2, 2, 32
    k_cache, v_cache = caches(rng, 3, 80, nheads_kv, headdim, dtype=dtype)
    q = randn(rng, 3, 3, nheads_kv * group, headdim, dtype=dtype, scale=2.0)
    slopes = torch.rand(3, nheads_kv * group, generator=rng).to(DEVICE) * 0.3
    sink = randn(rng, nheads_kv * group, dtype=torch.float32)
    args = kv_args(headdim, 80, window=(20, 1), cache_seqlens=int32([75, 0, 33]), softcap=5.0, alibi_slopes=slopes,
                   sink=sink, num_splits=3)
    check_attention(q, k_cache, v_cache, args)


# Several KV heads a program (TileConfig.heads): rows of 1 (group 3 x 1 token x 4 heads = 12 of a 16-row tile) or
# 3 row blocks (3 tokens: 36 rows, blocks holding rows of two heads); head dim 40 (padded 64) masks q's and the
# output's padded features in each head's columns.
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("case", ["decode", "causal3", "paged", "variants"])
def test_heads_per_program(rng, heads, case):
    from flashtile.backends.triton.configs import TileConfig

    nheads_kv, group, headdim, capacity = 4, 3, 40, 96
    seqlen_q = 1 if case in ("decode", "paged") else 3
    k_cache, v_cache = caches(rng, 3, capacity, nheads_kv, headdim)
    q = randn(rng, 3, seqlen_q, nheads_kv * group, headdim)
    fields = dict(cache_seqlens=int32([77, 0, 96]), num_splits=3)
    logical = None
    if case == "paged":
        k_pages, table = to_paged(k_cache, 16, rng)
        v_pages = torch.empty_like(k_pages)
        v_pages[table.long().flatten()] = v_cache.reshape(-1, 16, nheads_kv, headdim)
        logical, k_cache, v_cache = (k_cache, v_cache), k_pages, v_pages
        fields["block_table"] = table
    if case == "variants":
        fields.update(alibi_slopes=torch.rand(3, nheads_kv * group, generator=rng).to(DEVICE) * 0.3,
                      sink=randn(rng, nheads_kv * group, dtype=torch.float32), softcap=5.0)
    args = kv_args(headdim, capacity, causal=case != "variants", window=(20, 1) if case == "variants" else (-1, -1),
                   **fields)
    config = TileConfig(16, 16, 4, 1, heads=heads)
    chosen = plan(q, k_cache, v_cache, args, config)
    assert chosen.grid[:2] == (-(-seqlen_q * group * heads // 16), 3 * nheads_kv // heads)
    out, lse = check_attention(q, k_cache, v_cache, args, logical=logical, config=config)
    one_head = attention_kv(q, k_cache, v_cache, args, TileConfig(16, 16, 4, 1))
    torch.testing.assert_close(out, one_head[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, one_head[1], atol=1e-5, rtol=0)


def test_heads_per_program_must_divide(rng):
    from flashtile.backends.triton.configs import TileConfig

    k_cache, v_cache = caches(rng, 1, 32, 3, 32)
    q = randn(rng, 1, 1, 6, 32)
    with pytest.raises(ValueError, match="takes 2 KV heads a program, which must divide nheads_kv=3"):
        attention_kv(q, k_cache, v_cache, kv_args(32, 32), TileConfig(16, 16, 4, 1, heads=2))


def test_window_causal_empty_rows(rng):
    """A causal left window on a cache shorter than the queries: the first rows see no key (out 0,
    lse -inf), and a sink gives them lse = sink."""
    k_cache, v_cache = caches(rng, 2, 40, 1, 32)
    q = randn(rng, 2, 5, 2, 32)
    args = kv_args(32, 40, causal=True, window=(2, 0), cache_seqlens=int32([3, 30]), num_splits=2)
    out, lse = check_attention(q, k_cache, v_cache, args)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isinf(lse[0, :, :2]).all()
    sink = randn(rng, 2, dtype=torch.float32)
    _, lse = check_attention(q, k_cache, v_cache, kv_args(32, 40, causal=True, cache_seqlens=int32([0, 30]), sink=sink,
                                                          num_splits=2))
    torch.testing.assert_close(lse[0], sink[:, None].expand(2, 5))


@pytest.mark.parametrize("headdim,headdim_v", [(40, 40), (72, 24)])
def test_awkward_headdims(rng, headdim, headdim_v):
    k_cache, v_cache = caches(rng, 2, 50, 2, headdim, headdim_v)
    q = randn(rng, 2, 2, 4, headdim)
    check_attention(q, k_cache, v_cache, kv_args(headdim, 50, causal=True, cache_seqlens=int32([48, 17]),
                                                 num_splits=2))


def test_strided_q(rng):
    """q as a view with a gap between heads (e.g. sliced from a fused projection)."""
    k_cache, v_cache = caches(rng, 2, 40, 2, 32)
    q = randn(rng, 2, 1, 6, 32)[:, :, 1:5]
    check_attention(q, k_cache, v_cache, kv_args(32, 40, cache_seqlens=int32([33, 40])))


# --- append ----------------------------------------------------------------------------------------

def rotate_ref(x, cos, sin, positions, interleaved):
    """x ``(batch, seqlen, h, d)`` rotated in float64 at integer ``positions`` ``(batch, seqlen)``."""
    x = x.double().clone()
    half = cos.shape[1]
    c = cos.double()[positions][:, :, None]  # (batch, seqlen, 1, half)
    s = sin.double()[positions][:, :, None]
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2].clone(), x[..., 1 : 2 * half : 2].clone()
        x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].clone(), x[..., half : 2 * half].clone()
        x[..., :half], x[..., half : 2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def rotary_tables(rng, seqlen_ro, rotary_dim, dtype):
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=rng, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angle).to(DEVICE, dtype), torch.sin(angle).to(DEVICE, dtype)


def expected_append(k_cache, v_cache, k, v, seqlens, rows=None):
    """The contiguous caches after writing ``k``/``v`` (already rotated, any dtype) at rows ``seqlens[b] + t``
    of cache row ``rows[b]``, dropping rows past the capacity."""
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    capacity = k_cache.shape[1]
    for b, start in enumerate(seqlens.tolist()):
        row = rows[b] if rows is not None else b
        for t in range(k.shape[1]):
            if start + t < capacity:
                k_exp[row, start + t] = k[b, t].to(k_exp.dtype)
                v_exp[row, start + t] = v[b, t].to(v_exp.dtype)
    return k_exp, v_exp


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("rotary", ["none", "interleaved", "neox"])
def test_append_contiguous(rng, dtype, rotary):
    """New tokens land at cache_seqlens[b] + t of cache row cache_batch_idx[b]; rows past the capacity
    (the tensor's own rows there are kept in a wider buffer) and every other row stay as they were.
    Rotary (rotary_dim 24 < headdim 40) turns k before it is written and returns the turned q."""
    batch, capacity, nheads_kv, nheads, headdim, seqlen_new = 3, 30, 2, 4, 40, 3
    buffer = randn(rng, 4, capacity + 5, nheads_kv, 2 * headdim, dtype=dtype)
    k_cache, v_cache = buffer[:, :capacity, :, :headdim], buffer[:, :capacity, :, headdim:]
    before = buffer.clone()
    q = randn(rng, batch, seqlen_new, nheads, headdim, dtype=dtype)
    k = randn(rng, batch, seqlen_new, nheads_kv, headdim, dtype=dtype)
    v = randn(rng, batch, seqlen_new, nheads_kv, headdim, dtype=dtype)
    seqlens, rows, leftpad = int32([4, 28, 0]), int32([3, 0, 1]), int32([2, 0, 0])
    options = dict(cache_seqlens=seqlens, cache_batch_idx=rows, cache_leftpad=leftpad, seqlen_new=seqlen_new)
    if rotary != "none":
        cos, sin = rotary_tables(rng, capacity + 8, 24, dtype)
        options.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary == "interleaved")
    args = kv_args(headdim, capacity, causal=True, **options)
    q_out = append_kv(q, k_cache, v_cache, k, v, args)
    k_written = k
    if rotary != "none":
        # Positions are key rows (flash-attn's rule): the left padding does not shift them.
        positions = seqlens.long()[:, None] + torch.arange(seqlen_new, device=DEVICE)
        k_written = rotate_ref(k, cos, sin, positions, rotary == "interleaved")
        torch.testing.assert_close(q_out.double(), rotate_ref(q, cos, sin, positions, rotary == "interleaved"),
                                   atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=0)
    else:
        assert q_out is q
    k_exp, v_exp = expected_append(before[:, :capacity, :, :headdim], before[:, :capacity, :, headdim:], k_written, v,
                                   seqlens, rows.tolist())
    tol = dict(atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=0)
    torch.testing.assert_close(k_cache.double(), k_exp.double(), **tol)
    assert torch.equal(v_cache, v_exp)
    # Past the capacity (row 0 would write rows 30 and 31 there): untouched.
    assert torch.equal(buffer[:, capacity:], before[:, capacity:])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_append_rotary_q_position(rng, causal):
    """Without a causal mask or window every query is turned at position cache_seqlens; with one,
    query t at cache_seqlens + t (flash-attn's rule)."""
    k_cache, v_cache = caches(rng, 2, 20, 1, 16, dtype=torch.float32)
    q = randn(rng, 2, 3, 2, 16, dtype=torch.float32)
    cos, sin = rotary_tables(rng, 24, 16, torch.float32)
    seqlens = int32([5, 11])
    args = kv_args(16, 20, causal=causal, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin,
                   rotary_interleaved=False)
    q_out = append_kv(q, k_cache, v_cache, None, None, args)
    offsets = torch.arange(3, device=DEVICE) if causal else torch.zeros(3, dtype=torch.long, device=DEVICE)
    positions = seqlens.long()[:, None] + offsets
    torch.testing.assert_close(q_out.double(), rotate_ref(q, cos, sin, positions, False), atol=1e-5, rtol=0)


def test_append_nothing(rng):
    """No new tokens and no rotary: q comes back as it is and nothing is launched or written."""
    k_cache, v_cache = caches(rng, 1, 8, 1, 16)
    q = randn(rng, 1, 1, 1, 16)
    assert append_kv(q, k_cache, v_cache, None, None, kv_args(16, 8, cache_seqlens=int32([3]))) is q


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_append_paged(rng, page_size):
    """Paged appends (page sizes that are not powers of two too) go through the block table; a table
    entry outside [0, num_blocks) is skipped, and spare pages stay untouched."""
    batch, per_row, nheads_kv, headdim, seqlen_new = 2, 4, 2, 16, 3
    capacity = per_row * page_size
    k_logical, v_logical = caches(rng, batch, capacity, nheads_kv, headdim)
    k_pages, table = to_paged(k_logical, page_size, rng)
    v_pages = randn(rng, *k_pages.shape)
    v_pages[table.long().flatten()] = v_logical.reshape(-1, page_size, nheads_kv, headdim)
    seqlens = int32([capacity - 2, min(page_size, capacity - seqlen_new)])
    # Row 1's last page points outside the cache: tokens landing there are dropped.
    table[1, -1] = k_pages.shape[0] + 7
    spare = sorted(set(range(k_pages.shape[0])) - set(table.flatten().tolist()))
    k_before, v_before = k_pages.clone(), v_pages.clone()
    k = randn(rng, batch, seqlen_new, nheads_kv, headdim)
    v = randn(rng, batch, seqlen_new, nheads_kv, headdim)
    args = kv_args(headdim, capacity, cache_seqlens=seqlens, block_table=table, seqlen_new=seqlen_new)
    append_kv(randn(rng, batch, seqlen_new, 4, headdim), k_pages, v_pages, k, v, args)
    k_exp, v_exp = expected_append(k_logical, v_logical, k, v, seqlens)
    valid = table.clone()
    valid[1, -1] = spare[0]  # read back the dropped page's logical rows from a page that was not written
    k_got, v_got = from_paged(k_pages, valid), from_paged(v_pages, valid)
    last_rows = slice(capacity - page_size, capacity)
    k_exp[1, last_rows], v_exp[1, last_rows] = k_before[spare[0]], v_before[spare[0]]
    assert torch.equal(k_got, k_exp) and torch.equal(v_got, v_exp)
    assert torch.equal(k_pages[spare], k_before[spare]) and torch.equal(v_pages[spare], v_before[spare])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step(rng, paged):
    """A decode step as flash_attn_with_kvcache runs it: append two tokens with rotary, then attend
    over the cache including them (causal, GQA 4, split-KV)."""
    batch, capacity, nheads_kv, headdim, seqlen_new, page_size = 3, 48, 2, 32, 2, 16
    k_logical, v_logical = caches(rng, batch, capacity, nheads_kv, headdim)
    if paged:
        k_cache, table = to_paged(k_logical, page_size, rng)
        v_cache = randn(rng, *k_cache.shape)
        v_cache[table.long().flatten()] = v_logical.reshape(-1, page_size, nheads_kv, headdim)
    else:
        k_cache, v_cache, table = k_logical.clone(), v_logical.clone(), None
    q = randn(rng, batch, seqlen_new, nheads_kv * 4, headdim)
    k = randn(rng, batch, seqlen_new, nheads_kv, headdim)
    v = randn(rng, batch, seqlen_new, nheads_kv, headdim)
    cos, sin = rotary_tables(rng, capacity, headdim, torch.float16)
    seqlens = int32([17, 0, 40])
    args = kv_args(headdim, capacity, causal=True, cache_seqlens=seqlens, seqlen_new=seqlen_new, block_table=table,
                   rotary_cos=cos, rotary_sin=sin, num_splits=0)
    q_rot = append_kv(q, k_cache, v_cache, k, v, args)
    positions = seqlens.long()[:, None] + torch.arange(seqlen_new, device=DEVICE)
    k_exp, v_exp = expected_append(k_logical, v_logical, rotate_ref(k, cos, sin, positions, True), v, seqlens)
    logical = (from_paged(k_cache, table), from_paged(v_cache, table)) if paged else (k_cache, v_cache)
    torch.testing.assert_close(logical[0].double(), k_exp.double(), atol=2e-3, rtol=0)
    check_attention(q_rot, k_cache, v_cache, args, logical=logical, seqlen_new=seqlen_new)


# --- merge -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_merge_states(rng, dtype):
    """Two partial results (keys [0, 15) and [15, 30) of one causal, 12-key-window attention) merge into
    the attention over all 30 keys: rows 2.. see nothing in the first half, and row 0 of batch 1 is
    made empty on both sides (out 0, lse -inf). Outs may be strided views, lses too."""
    batch, seqlen, nheads, headdim, keys = 2, 5, 3, 24, 30
    q = randn(rng, batch, seqlen, nheads, headdim, dtype=dtype)
    k = randn(rng, batch, keys, nheads, headdim, dtype=dtype)
    v = randn(rng, batch, keys, nheads, headdim, dtype=dtype)
    rows = torch.arange(seqlen)[:, None] + keys - seqlen
    cols = torch.arange(keys)[None, :]
    mask = (cols <= rows) & (cols >= rows - 12)
    a_out, a_lse = masked_ref(q, k[:, :15], v[:, :15], mask[:, :15])
    b_out, b_lse = masked_ref(q, k[:, 15:], v[:, 15:], mask[:, 15:])
    ref_out, ref_lse = masked_ref(q, k, v, mask)
    for out_, lse_ in ((a_out, a_lse), (b_out, b_lse), (ref_out, ref_lse)):
        out_[1, 0], lse_[1, :, 0] = 0.0, float("-inf")
    assert torch.isinf(a_lse[:, :, 2:]).all() and torch.isfinite(b_lse[0]).all()
    wide = torch.full((batch, seqlen, nheads, headdim + 8), float("nan"), dtype=dtype, device=DEVICE)
    wide[..., :headdim] = a_out.to(dtype)
    lse_b = b_lse.float().transpose(1, 2).contiguous().transpose(1, 2)  # (batch, nheads, seqlen), seqlen-major
    out, lse = merge_states(wide[..., :headdim], a_lse.float(), b_out.to(dtype), lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (batch, seqlen, nheads, headdim)
    # The inputs were rounded to dtype: allow that rounding on top of the merge's own.
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))



@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_merge_states_into(rng, dtype, backend):
    """``out=``/``lse=``: a merge in place over some rows of out_a and lse_a (as ring attention merges a block
    over part of its rows), and one into float32 tensors of its own, give the merge's own result."""
    from flashtile.backends import torch_decode

    merge = merge_states if backend == "triton" else torch_decode.merge_states
    batch, seqlen, nheads, headdim = 2, 37, 3, 24
    a_out, b_out = (randn(rng, batch, seqlen, nheads, headdim, dtype=dtype) for _ in range(2))
    a_lse, b_lse = (randn(rng, batch, nheads, seqlen, dtype=torch.float32) * 3 for _ in range(2))
    a_lse[0, 1, 5] = b_lse[0, 1, 5] = float("-inf")  # a row that saw no key on either side: out 0, lse -inf
    rows = slice(11, 30)
    want_out, want_lse = merge(a_out[:, rows], a_lse[:, :, rows], b_out[:, rows], b_lse[:, :, rows])
    out = torch.full(want_out.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    lse = torch.full(want_lse.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    merge(a_out[:, rows], a_lse[:, :, rows], b_out[:, rows], b_lse[:, :, rows], out, lse)
    torch.testing.assert_close(out.to(dtype), want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    untouched_out, untouched_lse = a_out.clone(), a_lse.clone()
    merged_out, merged_lse = merge(a_out[:, rows], a_lse[:, :, rows], b_out[:, rows], b_lse[:, :, rows],
                                   a_out[:, rows], a_lse[:, :, rows])
    assert merged_out.data_ptr() == a_out[:, rows].data_ptr()
    torch.testing.assert_close(a_out[:, rows], want_out, atol=0, rtol=0)
    torch.testing.assert_close(a_lse[:, :, rows], want_lse, atol=0, rtol=0)
    # The rows outside the merge are left as they were.
    assert torch.equal(a_out[:, :11], untouched_out[:, :11]) and torch.equal(a_out[:, 30:], untouched_out[:, 30:])
    assert torch.equal(a_lse[:, :, 30:], untouched_lse[:, :, 30:])

def masked_ref(q, k, v, mask):
    """float64 out, lse of q over k, v where ``mask`` ``(seqlen_q, seqlen_k)`` says which keys each row sees."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask.to(DEVICE), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.double()), lse


# --- names -----------------------------------------------------------------------------------------

def test_describe_names_decode_kernel(rng):
    from flashtile.backends import AttentionCall

    q = randn(rng, 2, 1, 8, 64)
    k_cache, v_cache = caches(rng, 2, 40, 2, 64)
    k_pages, table = to_paged(k_cache, 8, rng)
    args = kv_args(64, 40, causal=True, cache_seqlens=int32([3, 4]), block_table=table)
    fwd_name, bwd_name, config = describe(AttentionCall.of(q, k_pages, k_pages, args))
    assert fwd_name.startswith("flashtile.decode[triton d=64 gqa=4 causal paged splits=auto BM=16 BN=")
    assert bwd_name == "" and config["decode"]["BLOCK_M"] == 16


# --- GPU only: the cached launch path and CUDA graphs ----------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cached_launch_matches_first_call(rng, paged):
    """The first call of a shape binds Triton's arguments, later ones reuse them (fastlaunch.py):
    a second call with other tensors (and other lengths) must give what a fresh first call gives."""
    from flashtile.backends.triton import decode

    def step(seed_rng):
        k_logical, v_logical = caches(seed_rng, 4, 256, 2, 128, dtype=torch.bfloat16)
        table = None
        if paged:
            k_cache, table = to_paged(k_logical, 16, seed_rng)
            v_cache = randn(seed_rng, *k_cache.shape, dtype=torch.bfloat16)
            v_cache[table.long().flatten()] = v_logical.reshape(-1, 16, 2, 128)
        else:
            k_cache, v_cache = k_logical, v_logical
        q = randn(seed_rng, 4, 1, 8, 128, dtype=torch.bfloat16)
        seqlens = torch.randint(0, 257, (4,), generator=seed_rng).to(DEVICE, torch.int32)
        return q, k_cache, v_cache, kv_args(128, 256, causal=True, cache_seqlens=seqlens, block_table=table)

    first = step(rng)
    attention_kv(*first[:3], first[3])
    second = step(rng)
    cached = attention_kv(*second[:3], second[3])
    for launcher in (decode._DECODE, decode._COMBINE):
        launcher._cache.clear()
    fresh = attention_kv(*second[:3], second[3])
    assert torch.equal(cached[0], fresh[0]) and torch.equal(cached[1], fresh[1])
    check_attention(*second[:3], second[3], logical=None if not paged else (
        from_paged(second[1], second[3].block_table), from_paged(second[2], second[3].block_table)))


@pytest.mark.cuda
def test_cuda_graph_decode_step(rng):
    """Append + split-KV attention captured once replay with new lengths and new tokens."""
    batch, capacity, nheads_kv, headdim = 4, 1024, 2, 128
    k_cache, v_cache = caches(rng, batch, capacity, nheads_kv, headdim, dtype=torch.bfloat16)
    q = randn(rng, batch, 1, nheads_kv * 4, headdim, dtype=torch.bfloat16)
    k = randn(rng, batch, 1, nheads_kv, headdim, dtype=torch.bfloat16)
    v = randn(rng, batch, 1, nheads_kv, headdim, dtype=torch.bfloat16)
    cos, sin = rotary_tables(rng, capacity, headdim, torch.bfloat16)
    seqlens = int32([10, 0, 700, 1023])
    args = kv_args(headdim, capacity, causal=True, cache_seqlens=seqlens, seqlen_new=1, rotary_cos=cos,
                   rotary_sin=sin, num_splits=0)

    def decode_step():
        return attention_kv(append_kv(q, k_cache, v_cache, k, v, args), k_cache, v_cache, args)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = decode_step()
    seqlens.copy_(int32([500, 3, 0, 1000]))
    q.copy_(randn(rng, *q.shape, dtype=torch.bfloat16))
    k.copy_(randn(rng, *k.shape, dtype=torch.bfloat16))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    k_cache_eager, v_cache_eager = k_before.clone(), v_before.clone()
    expected = attention_kv(append_kv(q, k_cache_eager, v_cache_eager, k, v, args), k_cache_eager, v_cache_eager, args)
    assert torch.equal(k_cache, k_cache_eager) and torch.equal(v_cache, v_cache_eager)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
