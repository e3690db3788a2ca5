"""The pure-PyTorch backend called directly through the backend contract (``AttnArgs``,
``forward``, ``backward``), and the dropout RNG it shares with the Triton kernels.

Every result is checked against :func:`flashtile.testing.attention_ref` (through
``reference_results``, gradients by autograd) with the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref`: ``max|ours - ref_hi| <= 2 * max|ref_lo - ref_hi|
+ atol``, ``ref_hi`` in float64 and ``ref_lo`` the same computation in the input dtype. Gradient
buffers start as NaN, so an element the backend forgets to write fails. Dropout is compared
exactly: the reference gets the keep mask from :func:`flashtile.rng.dropout_mask`.

Shapes are awkward on purpose: single query / key, lengths that are not multiples of anything,
seqlen_q > seqlen_k (causal rows that see no key), and (600, 700) to cross the 512 tiles.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

import flashtile.backends.torch_tiled as tb
from flashtile import rng as frng
from flashtile.backends import AttnArgs
from flashtile.testing import assert_results_close, cu_seqlens_of, reference_results

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Feature sets, as keyword arguments of ``check_dense`` (named so test ids read well).
FEATURES = {
    "causal": dict(causal=True),
    "window": dict(window_size=(40, 7)),
    "causal_window": dict(causal=True, window_size=(30, -1)),
    "window_left_only": dict(window_size=(25, -1)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi="batch"),
    "alibi_per_head": dict(alibi="heads"),
    "sink": dict(sink=True),
    "bias_float": dict(bias="float"),
    "bias_float_full": dict(bias="float_full"),
    "bias_float_keys": dict(bias="float_keys"),
    "bias_bool": dict(bias="bool"),
    "dropout": dict(dropout_p=0.17),
    "window_softcap_alibi_sink": dict(window_size=(50, 20), softcap=2.0, alibi="batch", sink=True),
    "causal_bias_float_sink": dict(causal=True, bias="float", sink=True),
    "everything": dict(causal=True, window_size=(60, -1), softcap=3.0, alibi="heads", sink=True, bias="bool",
                       dropout_p=0.25),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are small: with pytest-xdist, torch's intra-op threads would only fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def randn(generator, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=generator).to(dtype)


def draw_seed(generator):
    """A seed above 2**32, so both words of the Philox key matter."""
    return int(torch.randint(2**32, 2**62, (), generator=generator)), int(torch.randint(0, 2**31, (), generator=generator))


def nan_like(t):
    """A gradient buffer that fails the test wherever the backend does not write it."""
    return torch.full(t.shape, float("nan"), dtype=t.dtype)


def features_for(generator, dtype, batch, nheads, seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi=None, sink=False, bias=None, dropout_p=0.0):
    """Random feature tensors, as ``(reference kwargs, AttnArgs kwargs)``.

    ``bias``: ``"float"`` fp32 ``(1, nheads, seqlen_q, seqlen_k)``, ``"float_full"`` the full shape in
    the input dtype, ``"float_keys"`` fp32 ``(batch, 1, 1, seqlen_k)`` (a key-padding bias), ``"bool"``
    ``(batch, 1, seqlen_q, seqlen_k)`` with some rows that see no key. The backend gets them expanded
    to the full shape (stride 0 where broadcast), as the API hands them over.
    """
    ref, args = {}, {}
    if causal or window_size != (-1, -1):
        ref.update(causal=causal, window_size=window_size)
        args.update(causal=causal, window_left=window_size[0], window_right=0 if causal else window_size[1])
    if softcap:
        ref["softcap"] = args["softcap"] = softcap
    if alibi == "batch":
        ref["alibi_slopes"] = args["alibi_slopes"] = torch.rand(batch, nheads, generator=generator) * 0.5
    elif alibi == "heads":
        slopes = torch.rand(nheads, generator=generator) * 0.5
        ref["alibi_slopes"], args["alibi_slopes"] = slopes, slopes.expand(batch, nheads)  # batch stride 0
    if sink:
        args["sink"] = randn(generator, nheads) * 2
        ref["sink"] = args["sink"].clone().requires_grad_()  # the reference differentiates what requires grad
    bias_shapes = {"float": (1, nheads, seqlen_q, seqlen_k), "float_full": (batch, nheads, seqlen_q, seqlen_k),
                   "float_keys": (batch, 1, 1, seqlen_k)}
    if bias in bias_shapes:
        values = randn(generator, *bias_shapes[bias], dtype=dtype if bias == "float_full" else torch.float32)
        args["attn_bias"] = values.expand(batch, nheads, seqlen_q, seqlen_k)
        ref["attn_bias"] = values.clone().requires_grad_()
    elif bias == "bool":
        keep = torch.rand(batch, 1, seqlen_q, seqlen_k, generator=generator) < 0.7
        keep[:, :, : max(1, seqlen_q // 5)] = False  # rows that see no key at all
        ref["attn_bias"], args["attn_bias"] = keep, keep.expand(batch, nheads, seqlen_q, seqlen_k)
    if dropout_p:
        seed, offset = draw_seed(generator)
        args.update(dropout_p=dropout_p, seed=seed, offset=offset)
        ref.update(dropout_p=dropout_p,
                   dropout_mask=frng.dropout_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p))
    return ref, args


def run_ours(q, k, v, dout, args, dsink=False, dbias=False):
    """The backend's out, lse and every gradient it is asked for, through the raw contract."""
    out, lse = tb.forward(q, k, v, args)
    grads = {"dq": nan_like(q), "dk": nan_like(k), "dv": nan_like(v)}
    grads["dsink"] = torch.full(args.sink.shape, float("nan")) if dsink else None
    grads["dbias"] = torch.full(args.attn_bias.shape, float("nan")) if dbias else None
    tb.backward(dout, q, k, v, out, lse, args, grads["dq"], grads["dk"], grads["dv"], grads["dsink"], grads["dbias"])
    return {"out": out, "lse": lse, **{name: g for name, g in grads.items() if g is not None}}


def check_dense(generator, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, headdim_v=None, **features):
    """Forward and backward of the backend against both references; returns the backend's results."""
    headdim_v = headdim_v or headdim
    q = randn(generator, batch, seqlen_q, nheads, headdim, dtype=dtype)
    k = randn(generator, batch, seqlen_k, nheads_kv, headdim, dtype=dtype)
    v = randn(generator, batch, seqlen_k, nheads_kv, headdim_v, dtype=dtype)
    dout = randn(generator, batch, seqlen_q, nheads, headdim_v, dtype=dtype)
    ref_kwargs, args_kwargs = features_for(generator, dtype, batch, nheads, seqlen_q, seqlen_k, **features)
    scale = 1.0 / math.sqrt(headdim)
    args = AttnArgs(softmax_scale=scale, **args_kwargs)
    inputs = [q, k, v, dout] + [t for t in args_kwargs.values() if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in inputs]
    float_bias = features.get("bias", "bool") != "bool"
    ours = run_ours(q, k, v, dout, args, dsink=features.get("sink", False), dbias=float_bias)
    assert all(torch.equal(t, copy) for t, copy in zip(inputs, before)), "the backend modified one of its inputs"
    assert ours["out"].shape == (batch, seqlen_q, nheads, headdim_v) and ours["out"].dtype == dtype
    assert ours["lse"].shape == (batch, nheads, seqlen_q) and ours["lse"].dtype == torch.float32
    if float_bias:
        ours["dbias"] = ours["dbias"].sum_to_size(ref_kwargs["attn_bias"].shape)  # summed over broadcast dims
    ref_hi = reference_results(q, k, v, dout, True, softmax_scale=scale, **ref_kwargs)
    ref_lo = reference_results(q, k, v, dout, False, softmax_scale=scale, **ref_kwargs)
    assert_results_close(ours, ref_hi, ref_lo, dtype)
    return ours


# ---------------------------------------------------------------------------------------------
# The RNG


@triton.jit
def _philox_kernel(seed, counters_ptr, out_ptr, BLOCK: tl.constexpr):
    """Stores the four words of ``tl.philox(seed, c0, c1, c2, c3)`` for BLOCK counter quadruples."""
    offs = tl.arange(0, BLOCK) * 4
    c0 = tl.load(counters_ptr + offs)
    c1 = tl.load(counters_ptr + offs + 1)
    c2 = tl.load(counters_ptr + offs + 2)
    c3 = tl.load(counters_ptr + offs + 3)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    tl.store(out_ptr + offs, r0.to(tl.int32, bitcast=True))
    tl.store(out_ptr + offs + 1, r1.to(tl.int32, bitcast=True))
    tl.store(out_ptr + offs + 2, r2.to(tl.int32, bitcast=True))
    tl.store(out_ptr + offs + 3, r3.to(tl.int32, bitcast=True))


@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF, 2**32 + 12345, 2**63 - 1])
def test_philox_matches_triton(seed, rng, device):
    # Counters over the whole uint32 range (int32 bit patterns), plus the ones dropout uses: small and 0.
    counters = torch.randint(-2**31, 2**31, (512, 4), dtype=torch.int32, generator=rng)
    counters[:16] = torch.arange(64, dtype=torch.int32).view(16, 4)
    counters = counters.to(device)
    expected = torch.empty_like(counters)
    _philox_kernel[(1,)](seed, counters, expected, BLOCK=512)
    ours = frng.philox(seed, *counters.long().unbind(1))
    for word, (got, want) in enumerate(zip(ours, expected.long().unbind(1))):
        assert got.dtype == torch.int64 and got.min() >= 0 and got.max() < 2**32
        assert torch.equal(got, want & 0xFFFFFFFF), f"word {word} differs from tl.philox for seed {seed}"


def test_philox_broadcasts_scalars_and_tensors():
    cols = torch.arange(5).view(1, 5)
    rows = torch.arange(3).view(3, 1)
    words = frng.philox(7, cols, rows, 2, 9)
    assert all(w.shape == (3, 5) for w in words)
    assert torch.equal(words[0][2, 4], frng.philox(7, 4, 2, 2, 9)[0])


def test_dropout_keep_rate(rng):
    """200k draws keep 1 - p of the elements within 5 standard deviations."""
    dropout_p = 0.17
    seed, offset = draw_seed(rng)
    keep = frng.dropout_mask(seed, offset, 2, 4, 125, 200, dropout_p)
    n = keep.numel()
    rate = 1.0 - frng.keep_threshold(dropout_p) / 2**31
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(keep.sum().item() - n * rate) < 5 * sigma
    assert frng.keep_threshold(0.0) == 0 and frng.dropout_mask(seed, offset, 1, 2, 3, 4, 0.0).all()


def test_dropout_mask_counters(rng):
    """Element (b, h, i, j) of the mask reads word j % 4 of the counters (j // 4, i, b * nheads + h, offset)."""
    seed, offset = draw_seed(rng)
    batch, nheads, dropout_p = 2, 3, 0.4
    mask = frng.dropout_mask(seed, offset, batch, nheads, 7, 9, dropout_p)
    assert mask.shape == (batch, nheads, 7, 9) and mask.dtype == torch.bool
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 5, 8), (0, 1, 6, 3), (1, 0, 2, 6)]:
        word = frng.philox(seed, j // 4, i, b * nheads + h, offset)[j % 4]
        assert mask[b, h, i, j].item() == ((word.item() >> 1) >= frng.keep_threshold(dropout_p)), (b, h, i, j)
    assert not torch.equal(mask, frng.dropout_mask(seed, offset + 1, batch, nheads, 7, 9, dropout_p))


def test_draw_seed_offset_follows_manual_seed():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        first = frng.draw_seed_offset()
        torch.manual_seed(123)
        assert frng.draw_seed_offset() == first
    seed, offset = first
    assert 0 <= seed < 2**63 and 0 <= offset < 2**31


# ---------------------------------------------------------------------------------------------
# Dense calls


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seqlens", [(1, 1), (3, 3), (113, 203), (239, 1), (200, 64), (600, 700)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_dense_shapes(seqlens, group, causal, dtype, rng):
    seqlen_q, seqlen_k = seqlens
    batch = 1 if seqlen_q * seqlen_k > 10**5 else 2
    check_dense(rng, dtype, batch, seqlen_q, seqlen_k, 2 * group, 2, 32, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("seqlens", [(113, 203), (203, 113)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("feature", FEATURES)
def test_dense_features(feature, seqlens, dtype, rng):
    check_dense(rng, dtype, 2, *seqlens, 6, 2, 32, **FEATURES[feature])


@pytest.mark.parametrize("feature", ["window_softcap_alibi_sink", "everything", "bias_float"])
def test_dense_features_across_tiles(feature, rng):
    """Several 512-row blocks and key chunks, the window reaching across chunk borders."""
    check_dense(rng, torch.float16, 1, 600, 1100, 3, 1, 16, **FEATURES[feature])


@pytest.mark.parametrize("bias", ["float", "float_full", "float_keys"])
@pytest.mark.parametrize("group", [1, 3])
def test_float_bias_tiles_are_views(group, bias, rng):
    """fp32 bias with one KV head: the backend's bias tile is often a view of the caller's tensor
    (stride 0 where broadcast); it must read it, never write it."""
    check_dense(rng, torch.float32, 2, 45, 70, group, 1, 16, bias=bias, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("feature", ["none", "causal", "dropout", "everything"])
def test_headdim_v(feature, dtype, rng):
    """v's head dim (48) differs from q's and k's (32)."""
    check_dense(rng, dtype, 2, 70, 90, 4, 2, 32, headdim_v=48, **FEATURES.get(feature, {}))


def test_rows_without_keys_are_zero():
    """Causal with seqlen_q > seqlen_k and a window that hides everything: out 0, lse -inf, gradients 0."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (randn(generator, 1, n, 2, 16) for n in (9, 3, 3))
    args = AttnArgs(softmax_scale=0.25, causal=True, window_left=0, window_right=0)
    ours = run_ours(q, k, v, randn(generator, 1, 9, 2, 16), args)
    hidden = slice(0, 6)  # query i sees key i - 6 only
    assert torch.equal(ours["out"][:, hidden], torch.zeros_like(ours["out"][:, hidden]))
    assert torch.isinf(ours["lse"][:, :, hidden]).all() and torch.isfinite(ours["lse"][:, :, 6:]).all()
    assert torch.equal(ours["dq"][:, hidden], torch.zeros_like(ours["dq"][:, hidden]))
    for name in ("dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all(), name


def test_dropout_is_reproducible_and_uses_the_counters(rng):
    q, k, v = (randn(rng, 1, 50, 2, 16) for _ in range(3))
    seed, offset = draw_seed(rng)
    args = AttnArgs(softmax_scale=0.25, dropout_p=0.3, seed=seed, offset=offset)
    out, lse = tb.forward(q, k, v, args)
    again, lse_again = tb.forward(q, k, v, args)
    assert torch.equal(out, again) and torch.equal(lse, lse_again)
    other, other_lse = tb.forward(q, k, v, AttnArgs(softmax_scale=0.25, dropout_p=0.3, seed=seed, offset=offset + 1))
    assert not torch.equal(out, other)
    assert torch.equal(lse, other_lse)  # the denominator sums the undropped probabilities


def test_window_skips_hidden_key_chunks(monkeypatch, rng):
    """Time grows with the window, not the sequence: key chunks outside the window are never computed."""
    tiles = []
    fill = tb._ScoreTiles.fill
    monkeypatch.setattr(tb._ScoreTiles, "fill", lambda self, s, *a, **kw: (tiles.append(s.shape), fill(self, s, *a, **kw)))
    seqlen = 8 * tb.BLOCK_ROWS
    q, k, v = (randn(rng, 1, seqlen, 1, 8) for _ in range(3))
    tb.forward(q, k, v, AttnArgs(softmax_scale=0.3, causal=True, window_left=64, window_right=0))
    blocks = seqlen // tb.BLOCK_ROWS
    assert len(tiles) <= 2 * blocks
    assert sum(shape[-1] for shape in tiles) <= blocks * (tb.BLOCK_ROWS + 64)


def test_strided_views_and_determinism(rng):
    """q, k, v and dq, dk, dv as views of packed tensors; two backward runs agree bit for bit."""
    qkv = randn(rng, 2, 77, 3, 4, 24, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    dout = randn(rng, 2, 77, 4, 24, dtype=torch.float16)
    args = AttnArgs(softmax_scale=0.2, causal=True, softcap=4.0)
    out, lse = tb.forward(q, k, v, args)
    packed_grads = []
    for _ in range(2):
        dqkv = torch.full(qkv.shape, float("nan"), dtype=qkv.dtype)
        tb.backward(dout, q, k, v, out, lse, args, *dqkv.unbind(2), None, None)
        packed_grads.append(dqkv)
    assert torch.equal(packed_grads[0], packed_grads[1])
    ref_hi = reference_results(q, k, v, dout, True, softmax_scale=0.2, causal=True, softcap=4.0)
    ref_lo = reference_results(q, k, v, dout, False, softmax_scale=0.2, causal=True, softcap=4.0)
    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), packed_grads[0].unbind(2)))}
    assert_results_close(ours, ref_hi, ref_lo, torch.float16)


# ---------------------------------------------------------------------------------------------
# Varlen calls


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("feature", ["none", "causal", "seqused_k", "window_softcap_alibi_sink", "dropout",
                                     "headdim_v", "everything"])
def test_varlen(feature, dtype, rng):
    """Packed sequences, including empty ones, with tokens past cu_seqlens[-1] that belong to none."""
    seqlens_q = [5, 0, 130, 1, 40, 3]
    seqlens_k = [7, 4, 150, 0, 40, 1]
    nheads, nheads_kv, headdim = 6, 2, 32
    headdim_v = 48 if feature == "headdim_v" else headdim
    batch = len(seqlens_q)
    extra_q, extra_k = 3, 5
    q = randn(rng, sum(seqlens_q) + extra_q, nheads, headdim, dtype=dtype)
    k = randn(rng, sum(seqlens_k) + extra_k, nheads_kv, headdim, dtype=dtype)
    v = randn(rng, sum(seqlens_k) + extra_k, nheads_kv, headdim_v, dtype=dtype)
    dout = randn(rng, q.shape[0], nheads, headdim_v, dtype=dtype)
    shared = dict(softmax_scale=1.0 / math.sqrt(headdim), cu_seqlens_q=cu_seqlens_of(seqlens_q),
                  cu_seqlens_k=cu_seqlens_of(seqlens_k))
    args = dict(max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k))
    ref = {}
    if feature in ("seqused_k", "everything"):
        shared["seqused_k"] = torch.tensor([3, 0, 101, 0, 40, 1], dtype=torch.int32)
    if feature in ("causal", "everything"):
        args.update(causal=True, window_right=0)
        ref["causal"] = True
    if feature in ("window_softcap_alibi_sink", "everything"):
        window = (20, 6 if feature == "window_softcap_alibi_sink" else -1)
        args.update(window_left=window[0], window_right=0 if feature == "everything" else window[1])
        ref["window_size"] = window
        shared.update(softcap=2.0, alibi_slopes=torch.rand(batch, nheads, generator=rng) * 0.5)
        args["sink"] = randn(rng, nheads) * 2
        ref["sink"] = args["sink"].clone().requires_grad_()
    if feature in ("dropout", "everything"):
        seed, offset = draw_seed(rng)
        shared["dropout_p"] = 0.2
        args.update(seed=seed, offset=offset)
        ref["dropout_seed_offset"] = (seed, offset)
    args = AttnArgs(**shared, **args)
    ours = run_ours(q, k, v, dout, args, dsink=args.sink is not None)
    assert ours["out"].shape == (q.shape[0], nheads, headdim_v) and ours["lse"].shape == (nheads, q.shape[0])
    ref_hi = reference_results(q, k, v, dout, True, **shared, **ref)
    ref_lo = reference_results(q, k, v, dout, False, **shared, **ref)
    assert_results_close(ours, ref_hi, ref_lo, dtype)
    # Keys a sequence does not use and tokens of no sequence: exactly zero gradient.
    assert torch.equal(ours["dk"][sum(seqlens_k):], torch.zeros_like(ours["dk"][sum(seqlens_k):]))
    assert torch.equal(ours["dq"][sum(seqlens_q):], torch.zeros_like(ours["dq"][sum(seqlens_q):]))
