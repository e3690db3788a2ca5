"""The attention variants of issue 3 through the public API: sliding windows, softcap, ALiBi, attention
sinks, additive bias / boolean masks, dropout and a value head dim of its own, alone and combined.

Forward out and lse and every gradient (dq, dk, dv, and dsink / dbias when those require grad) are
held to :func:`flashtile.testing.attention_ref` with the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref` (``max|ours - ref| <= 2 * max|ref in the input dtype -
ref| + atol``). Lengths are the awkward ones of test_attention.py (not multiples of any tile, a
single query or key, seqlen_q > seqlen_k so some rows see no key); shapes stay small for Triton's
interpreter.
"""
import math

import pytest
import torch

import flashtile
from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashtile.dispatch import force_backend
from flashtile.rng import draw_seed_offset, dropout_mask
from flashtile.testing import assert_results_close, make_qkv, random_like, reference_results

HAS_CUDA = torch.cuda.is_available()
# bfloat16 runs on the torch backend and on GPU (conftest skips it for Triton's interpreter).
DTYPES = [torch.float16, torch.float32, torch.bfloat16]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def randn(rng, *shape, device="cpu", dtype=torch.float32, scale=1.0, requires_grad=False):
    x = (torch.randn(*shape, generator=rng) * scale).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)


def upstream_gradient(q, v, rng):
    """A fresh random dout of the output's shape ``q.shape[:-1] + (headdim_v,)``."""
    return randn(rng, *q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)


def run(q, k, v, dout, function=flash_attn_func, sink=None, attn_bias=None, **options):
    """flashtile's out, lse and the gradients of every input that requires grad."""
    before = [t.detach().clone() for t in (q, k, v, sink, attn_bias) if t is not None]
    out, lse, probs = function(q, k, v, return_attn_probs=True, sink=sink, attn_bias=attn_bias, **options)
    after = [t for t in (q, k, v, sink, attn_bias) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "the call modified one of its inputs"
    assert probs is None and out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape[:-1] + v.shape[-1:] and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    leaves = {"dq": q, "dk": k, "dv": v, "dsink": sink, "dbias": attn_bias}
    leaves = {name: t for name, t in leaves.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    results = {"out": out, "lse": lse, **dict(zip(leaves, grads))}
    for name, t in leaves.items():
        assert results[name].shape == t.shape and results[name].dtype == t.dtype, name
    return results


def check(q, k, v, rng, sink=None, attn_bias=None, dropout_mask=None, **options):
    """Run flashtile and both references on the same inputs; apply the tolerance rule to everything."""
    dout = upstream_gradient(q, v, rng)
    ours = run(q, k, v, dout, sink=sink, attn_bias=attn_bias, **options)
    ref_options = {name: value for name, value in options.items() if name != "deterministic"}
    if dropout_mask is not None:
        ref_options["dropout_mask"] = dropout_mask
    elif ref_options.get("dropout_p", 0) > 0:
        raise ValueError("a dropout check needs the mask")
    ref_hi = reference_results(q, k, v, dout, hi=True, sink=sink, attn_bias=attn_bias, **ref_options)
    ref_lo = reference_results(q, k, v, dout, hi=False, sink=sink, attn_bias=attn_bias, **ref_options)
    assert_results_close(ours, ref_hi, ref_lo, q.dtype)
    return ours


# ---------------------------------------------------------------- sliding window

WINDOWS = [(0, 0), (17, -1), (-1, 9), (30, 5), (-1, 0)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=["0-0", "left17", "right9", "30-5", "minus1-0"])
def test_window(backend, device, rng, window, causal):
    # GQA 2/1, 70 x 131: the window's band crosses several key blocks and the diagonal offset is 61.
    q, k, v = make_qkv(1, 70, 131, 2, 1, 32, torch.float16, device, generator=rng)
    check(q, k, v, rng, causal=causal, window_size=window)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (239, 1), (1, 239), (64, 75), (200, 64)],
                         ids=["1x1", "239x1", "1x239", "64x75", "200x64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_awkward_lengths(backend, device, rng, causal, seqlen_q, seqlen_k):
    # seqlen_q > seqlen_k: rows whose window lies left of key 0 see no key (out 0, lse -inf, dq 0).
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 40, torch.float16, device, generator=rng)
    ours = check(q, k, v, rng, causal=causal, window_size=(20, 3))
    assert torch.isfinite(ours["dq"]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_window_dtypes(backend, device, rng, dtype):
    q, k, v = make_qkv(2, 77, 64, 2, 2, 64, dtype, device, generator=rng)
    check(q, k, v, rng, window_size=(8, 8))


def test_window_zero_is_the_diagonal_only(backend, device, rng):
    """window (0, 0) with seqlen_q == seqlen_k: each query sees only its own key, so out = v."""
    q, k, v = make_qkv(1, 50, 50, 2, 2, 32, torch.float32, device, requires_grad=False, generator=rng)
    out = flash_attn_func(q, k, v, window_size=(0, 0))
    torch.testing.assert_close(out, v, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- softcap, ALiBi


@pytest.mark.parametrize("dtype, causal", [(torch.float16, False), (torch.float16, True), (torch.float32, True),
                                           (torch.bfloat16, True)], ids=["float16-full", "float16-causal",
                                                                          "float32-causal", "bfloat16-causal"])
def test_softcap(backend, device, rng, dtype, causal):
    # Scores around +-20 against a cap of 5: tanh is well into saturation for many of them.
    q, k, v = make_qkv(1, 113, 203, 2, 1, 64, dtype, device, requires_grad=False, generator=rng)
    q = (q * 3).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    check(q, k, v, rng, causal=causal, softcap=5.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_softcap_below_the_softmax_scale(backend, device, rng, dtype):
    """softmax_scale / softcap = 2.5 > 1: a cap far below the scores (the Gluon forward keeps its multiply a
    score here rather than fold the scale into Q: see test_fwd_sm90)."""
    q, k, v = make_qkv(1, 75, 130, 2, 1, 64, dtype, device, generator=rng)
    check(q, k, v, rng, causal=True, softcap=0.05)


@pytest.mark.parametrize("slopes_shape", ["nheads", "batch-nheads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(backend, device, rng, slopes_shape, causal):
    batch, nheads = 2, 2
    q, k, v = make_qkv(batch, 61, 90, nheads, 1, 32, torch.float16, device, generator=rng)
    slopes = 2.0 ** (-8.0 * torch.arange(1, nheads + 1) / nheads)  # the ALiBi paper's geometric slopes
    if slopes_shape == "batch-nheads":
        slopes = slopes * (1 + torch.rand(batch, 1, generator=rng))
    check(q, k, v, rng, causal=causal, alibi_slopes=slopes.to(device=device, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_alibi_dtypes(backend, device, rng, dtype):
    q, k, v = make_qkv(1, 64, 75, 2, 2, 32, dtype, device, generator=rng)
    check(q, k, v, rng, causal=True, alibi_slopes=torch.tensor([0.5, 0.03125], device=device))


# ---------------------------------------------------------------- attention sinks


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sink(backend, device, rng, dtype):
    q, k, v = make_qkv(1, 113, 203, 2, 1, 32, dtype, device, generator=rng)
    sink = randn(rng, 2, device=device, scale=2.0, requires_grad=True)
    check(q, k, v, rng, sink=sink)


@pytest.mark.parametrize("sink_dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_sink_in_a_16_bit_dtype(backend, device, rng, sink_dtype):
    """A model's sink parameter in its own dtype (gpt-oss keeps it in bfloat16): dsink comes back in it."""
    q, k, v = make_qkv(1, 64, 75, 4, 1, 32, torch.float16, device, generator=rng)
    sink = randn(rng, 4, device=device, dtype=sink_dtype, requires_grad=True)
    check(q, k, v, rng, sink=sink, causal=True)


def test_sink_rows_that_see_no_key(backend, device, rng):
    """Causal 200 x 64: the first 136 rows see no key. With a sink their lse is the sink's logit,
    their output 0; the sink's gradient counts every row that sees a key."""
    q, k, v = make_qkv(1, 200, 64, 2, 1, 32, torch.float16, device, generator=rng)
    sink = randn(rng, 2, device=device, requires_grad=True)
    ours = check(q, k, v, rng, sink=sink, causal=True)
    hidden = 200 - 64
    torch.testing.assert_close(ours["lse"][0, :, :hidden], sink.detach()[:, None].expand(2, hidden), atol=1e-6, rtol=1e-6)
    assert torch.equal(ours["out"][:, :hidden], torch.zeros_like(ours["out"][:, :hidden]))


def test_sink_without_grad_is_a_constant(backend, device, rng):
    q, k, v = make_qkv(1, 33, 47, 2, 2, 16, torch.float16, device, generator=rng)
    sink = randn(rng, 2, device=device)
    check(q, k, v, rng, sink=sink, causal=True)


# ---------------------------------------------------------------- bias and boolean masks

BIAS_SHAPES = {
    "qk": lambda b, h, sq, sk: (sq, sk),
    "b11k": lambda b, h, sq, sk: (b, 1, 1, sk),
    "1hqk": lambda b, h, sq, sk: (1, h, sq, sk),
    "bhqk": lambda b, h, sq, sk: (b, h, sq, sk),
    "h1k": lambda b, h, sq, sk: (h, 1, sk),
}


@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_float_bias(backend, device, rng, shape):
    batch, nheads, seqlen_q, seqlen_k = 2, 2, 61, 90
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, 1, 32, torch.float16, device, generator=rng)
    bias = randn(rng, *BIAS_SHAPES[shape](batch, nheads, seqlen_q, seqlen_k), device=device, dtype=torch.float16,
                 scale=2.0, requires_grad=True)
    ours = check(q, k, v, rng, attn_bias=bias, causal=shape == "bhqk")
    assert ours["dbias"].shape == bias.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_float32_bias(backend, device, rng, dtype):
    """A float32 bias on inputs of any dtype: its gradient comes back in float32."""
    q, k, v = make_qkv(1, 61, 90, 2, 2, 32, dtype, device, generator=rng)
    bias = randn(rng, 1, 2, 61, 90, device=device, requires_grad=True)
    check(q, k, v, rng, attn_bias=bias)


def test_bias_without_grad_gets_no_dbias(backend, device, rng, monkeypatch):
    """dbias is allocated (and the backend asked for it) only when the bias requires grad."""
    from flashtile import autograd

    seen = []
    real = autograd.get_backend

    class Spy:
        def __init__(self, module):
            self.module = module

        def forward(self, *args):
            return self.module.forward(*args)

        def backward(self, *args):
            seen.append((args[-2], args[-1]))  # dsink, dbias
            return self.module.backward(*args)

    monkeypatch.setattr(autograd, "get_backend", lambda name: Spy(real(name)))
    q, k, v = make_qkv(1, 20, 30, 2, 2, 16, torch.float16, device, generator=rng)
    bias = randn(rng, 20, 30, device=device, dtype=torch.float16)
    check(q, k, v, rng, attn_bias=bias, sink=randn(rng, 2, device=device))
    assert seen == [(None, None)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bool_mask(backend, device, rng, causal):
    """True = may attend. Rows 3 and 40 of batch entry 0 are masked out entirely: output 0, lse -inf."""
    batch, seqlen_q, seqlen_k = 2, 57, 70
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, 2, 2, 32, torch.float16, device, generator=rng)
    mask = torch.rand(batch, 1, seqlen_q, seqlen_k, generator=rng) > 0.4
    mask[0, :, [3, 40]] = False
    ours = check(q, k, v, rng, attn_bias=mask.to(device), causal=causal)
    assert (ours["lse"][0, :, [3, 40]] == float("-inf")).all()
    assert torch.equal(ours["dq"][0, [3, 40]], torch.zeros_like(ours["dq"][0, [3, 40]]))


def test_key_padding_mask_equals_shorter_keys(backend, device, rng):
    """A (batch, 1, 1, seqlen_k) bool mask hiding the last keys is the call on the shorter keys."""
    q, k, v = make_qkv(1, 45, 80, 2, 2, 32, torch.float32, device, requires_grad=False, generator=rng)
    keep = torch.arange(80, device=device) < 51
    masked = flash_attn_func(q, k, v, attn_bias=keep.view(1, 1, 1, 80))
    shorter = flash_attn_func(q, k[:, :51], v[:, :51])
    torch.testing.assert_close(masked, shorter, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- value head dim


# 40/8 and 72/8: values of 8 columns with a q/k head dim that is not a multiple of 16 (once wrong on the H200).
@pytest.mark.parametrize("headdim, headdim_v, causal", [(64, 32, False), (32, 64, True), (24, 128, True),
                                                        (40, 8, False), (72, 8, True)],
                         ids=["64-32-full", "32-64-causal", "24-128-causal", "40-8-full", "72-8-causal"])
def test_headdim_v(backend, device, rng, headdim, headdim_v, causal):
    q, k, _ = make_qkv(2, 77, 101, 2, 1, headdim, torch.float16, device, generator=rng)
    v = randn(rng, 2, 101, 1, headdim_v, device=device, dtype=torch.float16, requires_grad=True)
    ours = check(q, k, v, rng, causal=causal)
    assert ours["out"].shape == (2, 77, 2, headdim_v)


def test_headdim_v_fp32(backend, device, rng):
    q, k, _ = make_qkv(1, 64, 75, 2, 1, 48, torch.float32, device, generator=rng)
    v = randn(rng, 1, 75, 1, 16, device=device, requires_grad=True)
    check(q, k, v, rng, causal=True)


# ---------------------------------------------------------------- q/k head dim 192

# The Triton backward pair works a q/k head dim of 192 as 128 columns plus a 64-column tail instead of padding it
# to 256 (launch._BWD_TAILS): DeepSeek's 192/128 and 192/192, GQA 2, with each feature the pair serves.
HEAD_DIM_192 = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(20, 7)),
    "softcap-causal": dict(softcap=5.0, causal=True),
    "alibi-causal": dict(alibi=True, causal=True),
    "bias": dict(bias=True),
    "dropout-causal": dict(dropout_p=0.2, causal=True),
}


# 129x37: the interpreter's 8 pretend SMs split each key block's query rows in two (float32 partial dK and dV).
@pytest.mark.parametrize("case", HEAD_DIM_192)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(37, 65), (129, 37)], ids=["37x65", "129x37"])
@pytest.mark.parametrize("headdim_v", [128, 192])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_dim_192(backend, device, rng, bwd_pair_head_dims, dtype, headdim_v, seqlen_q, seqlen_k, case):
    batch, nheads, nheads_kv = 2, 4, 2
    options = dict(HEAD_DIM_192[case])
    q, k, _ = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, 192, dtype, device, generator=rng)
    v = randn(rng, batch, seqlen_k, nheads_kv, headdim_v, device=device, dtype=dtype, requires_grad=True)
    if options.pop("alibi", False):
        options["alibi_slopes"] = randn(rng, nheads, device=device).abs()
    if options.pop("bias", False):
        options["attn_bias"] = randn(rng, batch, nheads, seqlen_q, seqlen_k, device=device, dtype=dtype,
                                     requires_grad=True)
    described = dict(options)
    if options.get("dropout_p"):
        torch.manual_seed(7)
        options["dropout_mask"] = dropout_mask(*draw_seed_offset(), batch, nheads, seqlen_q, seqlen_k,
                                               options["dropout_p"], device=device)
        torch.manual_seed(7)
    check(q, k, v, rng, **options)
    if backend == "triton":
        kernel = flashtile.explain(q, k, v, **described).backward_kernel
        assert kernel.startswith("flashtile.bwd[triton d=192") and "dkdv=BM" in kernel, kernel
        assert bwd_pair_head_dims and set(bwd_pair_head_dims) == {(128, 64)}, bwd_pair_head_dims


# ---------------------------------------------------------------- everything at once


@pytest.mark.parametrize("dtype, seqlen_q, seqlen_k", [(torch.float16, 113, 203), (torch.float32, 239, 64),
                                                       (torch.bfloat16, 113, 203)],
                         ids=["float16-113x203", "float32-239x64", "bfloat16-113x203"])
def test_all_features_combined(backend, device, rng, dtype, seqlen_q, seqlen_k):
    """Window + causal + softcap + ALiBi + sink + float bias + GQA + a value head dim of its own."""
    batch, nheads, nheads_kv = 2, 2, 1
    q, k, _ = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, 32, dtype, device, generator=rng)
    v = randn(rng, batch, seqlen_k, nheads_kv, 48, device=device, dtype=dtype, requires_grad=True)
    sink = randn(rng, nheads, device=device, requires_grad=True)
    bias = randn(rng, batch, 1, seqlen_q, seqlen_k, device=device, dtype=dtype, requires_grad=True)
    slopes = torch.rand(batch, nheads, generator=rng).to(device) * 0.1
    check(q, k, v, rng, sink=sink, attn_bias=bias, causal=True, window_size=(40, -1), softcap=8.0,
          alibi_slopes=slopes, softmax_scale=0.3)


def test_all_features_with_bool_mask_and_dropout(backend, device, rng):
    batch, nheads, seqlen_q, seqlen_k, p = 1, 2, 70, 90, 0.2
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, 1, 32, torch.float32, device, generator=rng)
    sink = randn(rng, nheads, device=device, requires_grad=True)
    mask = (torch.rand(seqlen_q, seqlen_k, generator=rng) > 0.2).to(device)
    options = dict(window_size=(25, 10), softcap=6.0, alibi_slopes=torch.tensor([0.2, 0.05], device=device))
    torch.manual_seed(1234)
    keep = dropout_mask(*draw_seed_offset(), batch, nheads, seqlen_q, seqlen_k, p, device=device)
    dout = random_like(q, rng)
    torch.manual_seed(1234)
    ours = run(q, k, v, dout, sink=sink, attn_bias=mask, dropout_p=p, **options)
    ref_hi = reference_results(q, k, v, dout, hi=True, sink=sink, attn_bias=mask, dropout_p=p, dropout_mask=keep, **options)
    ref_lo = reference_results(q, k, v, dout, hi=False, sink=sink, attn_bias=mask, dropout_p=p, dropout_mask=keep, **options)
    assert_results_close(ours, ref_hi, ref_lo, q.dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_with_sink_and_bias(backend, device, rng, causal):
    qkv = make_qkv(1, 77, 77, 2, 2, 32, torch.float16, device, packed="qkv", generator=rng)
    sink = randn(rng, 2, device=device, requires_grad=True)
    bias = randn(rng, 77, 77, device=device, dtype=torch.float16, requires_grad=True)
    options = dict(causal=causal, window_size=(30, -1), softcap=10.0)
    dout = random_like(qkv[:, :, 0], rng)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, sink=sink, attn_bias=bias, return_attn_probs=True, **options)
    dqkv, dsink, dbias = torch.autograd.grad(out, (qkv, sink, bias), dout)
    assert dqkv.shape == qkv.shape
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ours = {"out": out, "lse": lse, "dq": dqkv[:, :, 0], "dk": dqkv[:, :, 1], "dv": dqkv[:, :, 2], "dsink": dsink, "dbias": dbias}
    ref = [reference_results(q, k, v, dout, hi=hi, sink=sink, attn_bias=bias, **options) for hi in (True, False)]
    assert_results_close(ours, *ref, q.dtype)
    # Bit-identical to the unpacked call on contiguous copies.
    unpacked = run(q, k, v, dout, sink=sink, attn_bias=bias, **options)
    assert torch.equal(out, unpacked["out"]) and torch.equal(dsink, unpacked["dsink"])
    assert torch.equal(dqkv, torch.stack([unpacked[n] for n in ("dq", "dk", "dv")], dim=2))


def test_kvpacked_with_features(backend, device, rng):
    q, kv = make_qkv(2, 70, 45, 2, 1, 32, torch.float16, device, packed="kv", generator=rng)
    sink = randn(rng, 2, device=device, requires_grad=True)
    bias = randn(rng, 2, 1, 1, 45, device=device, requires_grad=True)
    options = dict(causal=True, window_size=(20, -1), alibi_slopes=torch.full((2,), 0.1, device=device))
    dout = random_like(q, rng)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, sink=sink, attn_bias=bias, return_attn_probs=True, **options)
    dq, dkv, dsink, dbias = torch.autograd.grad(out, (q, kv, sink, bias), dout)
    k, v = (t.detach().clone().requires_grad_() for t in kv.unbind(2))
    ours = {"out": out, "lse": lse, "dq": dq, "dk": dkv[:, :, 0], "dv": dkv[:, :, 1], "dsink": dsink, "dbias": dbias}
    ref = [reference_results(q, k, v, dout, hi=hi, sink=sink, attn_bias=bias, **options) for hi in (True, False)]
    assert_results_close(ours, *ref, q.dtype)


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_reference_with_its_mask(backend, device, rng, dtype, causal):
    """The mask is flashtile.rng's for the (seed, offset) that torch.manual_seed makes the forward draw."""
    batch, nheads, seqlen_q, seqlen_k, p = 2, 2, 37, 53, 0.17
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, 1, 32, dtype, device, generator=rng)
    torch.manual_seed(7)
    keep = dropout_mask(*draw_seed_offset(), batch, nheads, seqlen_q, seqlen_k, p, device=device)
    torch.manual_seed(7)
    check(q, k, v, rng, causal=causal, dropout_p=p, dropout_mask=keep)


def test_dropout_same_seed_reproduces(backend, device, rng):
    q, k, v = make_qkv(1, 45, 60, 2, 2, 32, torch.float16, device, generator=rng)
    dout = random_like(q, rng)
    results = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        results.append(run(q, k, v, dout, dropout_p=0.3, causal=True))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), f"{name} differs under the same torch.manual_seed"
    assert not torch.equal(results[0]["out"], results[2]["out"])
    # lse is that of the softmax before dropout: the same for every seed.
    assert torch.equal(results[0]["lse"], results[2]["lse"])


def test_dropout_keep_rate_and_independence(backend, device, rng):
    """v = a positive diagonal: output column j of row i is nonzero iff weight (i, j) was kept, and
    then equals p_ij * v_jj / (1 - dropout_p). 2 x 2 x 64 x 64 = 16384 draws: the kept fraction is
    within 5 standard deviations of 1 - dropout_p, and heads, batch entries and calls differ."""
    batch, nheads, seqlen, p = 2, 2, 64, 0.3
    q, k, _ = make_qkv(batch, seqlen, seqlen, nheads, nheads, 16, torch.float32, device, requires_grad=False, generator=rng)
    diagonal = 1 + torch.rand(seqlen, generator=rng)
    v = torch.diag(diagonal).to(device).expand(batch, nheads, seqlen, seqlen).transpose(1, 2).contiguous()
    out = flash_attn_func(q, k, v, dropout_p=p)  # (batch, seqlen_q, nheads, seqlen_k) as the mask
    kept = (out != 0).transpose(1, 2)  # (batch, nheads, seqlen_q, seqlen_k)
    rate, sigma = kept.double().mean().item(), math.sqrt(p * (1 - p) / kept.numel())
    assert abs(rate - (1 - p)) < 5 * sigma, f"kept {rate:.4f}, expected {1 - p} +- {5 * sigma:.4f}"
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0, 0], kept[1, 0])
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 4.0, dim=-1)
    expected = probs * diagonal.double().to(device) / (1 - p)
    torch.testing.assert_close(out.transpose(1, 2).double()[kept], expected[kept], atol=1e-5, rtol=1e-4)
    again = flash_attn_func(q, k, v, dropout_p=p)
    assert not torch.equal(again != 0, out != 0), "two calls drew the same mask"


def test_dropout_zero_draws_nothing(backend, device, rng):
    """dropout_p=0 does not touch torch's generator (and is plain attention)."""
    q, k, v = make_qkv(1, 20, 20, 2, 2, 16, torch.float16, device, requires_grad=False, generator=rng)
    torch.manual_seed(5)
    flash_attn_func(q, k, v, dropout_p=0.0)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))


# ---------------------------------------------------------------- dispatch sees the features


def test_explain_accepts_every_feature(device, rng):
    q, k, _ = make_qkv(2, 37, 41, 4, 2, 32, torch.float16, device, requires_grad=False, generator=rng)
    v = randn(rng, 2, 41, 2, 64, device=device, dtype=torch.float16)
    report = flashtile.explain(q, k, v, dropout_p=0.1, causal=True, window_size=(8, -1), softcap=5.0,
                               alibi_slopes=torch.ones(4, device=device), sink=torch.zeros(4, device=device),
                               attn_bias=torch.zeros(37, 41, device=device))
    assert report.error is None and report.backend is not None, str(report)
    invalid = flashtile.explain(q, k, v, window_size=(-2, 0))
    assert invalid.backend is None and "window_size" in invalid.error


# ---------------------------------------------------------------- decode-shaped dense calls

# (seqlen_q, seqlen_k, nheads, nheads_kv, headdim_v, options): at most 32 query rows per KV head, so the
# Triton backend runs them on the KV-cache kernel over k and v as a full cache (split over several key
# ranges once seqlen_k passes two interpreter splits of 32 keys).
DECODE_SHAPED = {
    "gqa-causal-splits": (1, 300, 8, 2, 32, dict(causal=True)),
    "mha-full": (4, 77, 4, 4, 32, dict()),
    "window": (5, 100, 6, 2, 32, dict(window_size=(20, 3))),
    "mqa-softcap": (1, 130, 4, 1, 32, dict(softcap=5.0)),
    "rows-see-no-key": (7, 3, 4, 2, 32, dict(causal=True)),
    "alibi-causal": (2, 150, 4, 2, 32, dict(causal=True, alibi=True)),
    "sink": (1, 90, 4, 2, 32, dict(sink=True)),
    "headdim-v": (3, 70, 4, 2, 16, dict(causal=True)),
}


@pytest.mark.parametrize("case", DECODE_SHAPED.values(), ids=DECODE_SHAPED.keys())
def test_decode_shaped_calls(backend, device, rng, case, no_dense_decode_threshold):
    """A decode step through flash_attn_func (transformers' path): out, lse and every gradient against the
    reference, and on the Triton backend the KV-cache kernel runs it (explain names it)."""
    seqlen_q, seqlen_k, nheads, nheads_kv, headdim_v, options = case
    options = dict(options)
    q, k, _ = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, 32, torch.float16, device, generator=rng)
    v = randn(rng, 2, seqlen_k, nheads_kv, headdim_v, device=device, dtype=torch.float16, requires_grad=True)
    if options.pop("alibi", False):
        options["alibi_slopes"] = randn(rng, nheads, device=device).abs()
    if options.pop("sink", False):
        options["sink"] = randn(rng, nheads, device=device, requires_grad=True)
    check(q, k, v, rng, **options)
    if backend == "triton":
        kernel = flashtile.explain(q, k, v, **options).kernel
        assert kernel.startswith("flashtile.decode[triton"), kernel


def test_decode_shaped_calls_take_the_kv_cache_kernel_once_the_forward_would_be_slow(monkeypatch):
    """On a GPU (132 SMs here) a call takes the KV-cache kernel when its rows fit a decode tile and the forward
    kernel's programs would walk DENSE_DECODE_MIN_KEYS keys (waves x keys)."""
    from flashtile.backends.triton import configs

    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    gpu, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16

    def takes(batch, seqlen_q, seqlen_k, nheads, nheads_kv, features=frozenset(), dtype=bf16, device=gpu):
        return configs.dense_takes_decode(batch, seqlen_q, seqlen_k, nheads, nheads_kv, features, dtype, device)

    assert takes(1, 1, 256, 32, 8) and not takes(1, 1, 255, 32, 8)
    assert takes(8, 1, 128, 32, 8)  # 256 programs: two waves of 128 keys
    assert takes(1, 8, 8192, 32, 8, frozenset({"window", "sink"}))  # 8 tokens x 4 heads: 32 rows
    assert takes(8, 1, 2048, 32, 8, frozenset({"varlen"}))  # packed: max_seqlen_q rows a sequence
    assert not takes(1, 9, 8192, 32, 8)  # 36 rows: the forward kernel
    assert not takes(1, 1, 8192, 32, 8, frozenset({"bias"})) and not takes(1, 1, 8192, 32, 8, frozenset({"dropout"}))
    assert not takes(70000, 1, 8192, 1, 1)  # past the KV-cache grid's batch x KV heads
    assert not takes(1, 1, 8192, 32, 8, dtype=torch.float32)  # not measured
    assert takes(1, 1, 3, 4, 2, device=cpu) and not takes(1, 1, 0, 4, 2, device=cpu)


@pytest.mark.parametrize("options", [dict(dropout_p=0.1), dict(attn_bias=True)], ids=["dropout", "bias"])
def test_decode_shaped_calls_the_kv_cache_kernel_lacks_keep_the_forward_kernel(device, rng, options):
    q, k, v = make_qkv(1, 1, 40, 4, 2, 32, torch.float16, device, requires_grad=False, generator=rng)
    if options.pop("attn_bias", False):
        options["attn_bias"] = randn(rng, 1, 40, device=device)
    with force_backend("triton"):
        kernel = flashtile.explain(q, k, v, **options).kernel
    assert kernel.startswith("flashtile.fwd[triton"), kernel


# ---------------------------------------------------------------- SDPA drop-in and nn.MultiheadAttention


def sdpa_against_torch(rng, query, key, value, **kwargs):
    """flashtile.scaled_dot_product_attention against torch's (math backend, float64 and input dtype):
    out and the gradients of every input that requires grad (a float attn_mask included)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.testing import ATOL, assert_close_to_ref
    from flashtile.sdpa import TORCH_SDPA

    mask = kwargs.pop("attn_mask", None)
    inputs = [query, key, value] + ([mask] if mask is not None and mask.requires_grad else [])
    out = flashtile.scaled_dot_product_attention(query, key, value, attn_mask=mask, **kwargs)
    # torch's math kernel refuses a mask together with is_causal: the reference gets them merged.
    top_left = None
    if mask is not None and kwargs.pop("is_causal", False):
        top_left = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    dout = random_like(out, rng)
    grads = torch.autograd.grad(out, inputs, dout)
    refs = []
    for dtype in (torch.float64, query.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        ref_mask = leaves[3] if len(leaves) == 4 else (None if mask is None else mask.to(dtype) if mask.is_floating_point() else mask)
        if top_left is not None:
            ref_mask = ref_mask & top_left if ref_mask.dtype == torch.bool else ref_mask.masked_fill(~top_left, float("-inf"))
        with sdpa_kernel(SDPBackend.MATH):
            ref = TORCH_SDPA(*leaves[:3], attn_mask=ref_mask, **kwargs)
        refs.append((ref, torch.autograd.grad(ref, leaves, dout.to(dtype))))
    (hi, hi_grads), (lo, lo_grads) = refs
    atol_out, atol_grad = ATOL[query.dtype]
    assert_close_to_ref("out", out, hi, lo, atol_out)
    for name, ours, ref_hi, ref_lo in zip(("dq", "dk", "dv", "dmask"), grads, hi_grads, lo_grads):
        assert_close_to_ref(name, ours, ref_hi, ref_lo, atol_grad)


SDPA_MASKS = {
    "bool-qk": lambda rng, b, h, sq, sk: torch.rand(sq, sk, generator=rng) > 0.3,
    "bool-b1qk": lambda rng, b, h, sq, sk: torch.rand(b, 1, sq, sk, generator=rng) > 0.3,
    "float-bhqk": lambda rng, b, h, sq, sk: torch.randn(b, h, sq, sk, generator=rng),
    "float-1hq1": lambda rng, b, h, sq, sk: torch.randn(1, h, sq, 1, generator=rng),
}


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 17), (17, 9)], ids=["9x17", "17x9"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask", SDPA_MASKS)
def test_sdpa_attn_mask_runs_on_flashtile(backend, device, rng, mask, is_causal, seqlen_q, seqlen_k):
    """torch's attn_mask (bool: True = attend; float: added, with its gradient) goes to attn_bias; with
    is_causal as well both apply, top-left aligned, as torch does on CPU. No fallback."""
    flashtile.reset_stats()
    query = randn(rng, 2, 4, seqlen_q, 16, device=device, requires_grad=True)
    key, value = (randn(rng, 2, 2, seqlen_k, 16, device=device, requires_grad=True) for _ in range(2))
    attn_mask = SDPA_MASKS[mask](rng, 2, 4, seqlen_q, seqlen_k).to(device)
    if attn_mask.dtype == torch.bool:
        attn_mask[..., 0] = True  # no all-masked row
    else:
        attn_mask.requires_grad_()
    sdpa_against_torch(rng, query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    assert flashtile.stats()["fallbacks"] == {} and flashtile.stats()["calls"] == {backend: 1}


def test_sdpa_value_head_dim_and_dropout_run_on_flashtile(backend, device, rng):
    flashtile.reset_stats()
    query, key = (randn(rng, 1, 2, 12, 16, device=device, requires_grad=True) for _ in range(2))
    value = randn(rng, 1, 2, 12, 32, device=device, requires_grad=True)
    sdpa_against_torch(rng, query, key, value, is_causal=True)
    torch.manual_seed(0)
    first = flashtile.scaled_dot_product_attention(query, key, value, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(first, flashtile.scaled_dot_product_attention(query, key, value, dropout_p=0.5))
    assert first.shape == (1, 2, 12, 32)
    assert not torch.equal(first, flashtile.scaled_dot_product_attention(query, key, value))
    assert flashtile.stats()["fallbacks"] == {}


def test_sdpa_mask_not_broadcastable_raises_like_torch(device):
    query = torch.randn(1, 2, 5, 16, device=device)
    with pytest.raises(RuntimeError):
        flashtile.sdpa.TORCH_SDPA(query, query, query, attn_mask=torch.ones(3, 5, dtype=torch.bool, device=device))
    with pytest.raises(RuntimeError, match=r"attn_mask of shape \(3, 5\) is not broadcastable.*\(1, 2, 5, 5\)"):
        flashtile.scaled_dot_product_attention(query, query, query, attn_mask=torch.ones(3, 5, dtype=torch.bool, device=device))


@pytest.mark.parametrize("masks", ["key_padding_mask", "both-bool", "both-float"])
def test_multihead_attention_masks_run_on_flashtile(backend, device, rng, masks):
    """torch.nn.MultiheadAttention's masks (bool: True = masked out) merged and passed to flashtile: the
    same output and input gradients as torch's module, and no fallback."""
    flashtile.reset_stats()
    embed, heads, batch, seqlen = 32, 2, 2, 7
    theirs = torch.nn.MultiheadAttention(embed, heads, batch_first=True, device=device)
    ours = flashtile.nn.MultiheadAttention(embed, heads, batch_first=True, device=device)
    ours.load_state_dict(theirs.state_dict())
    x = randn(rng, batch, seqlen, embed, device=device, requires_grad=True)
    padding = torch.zeros(batch, seqlen, dtype=torch.bool)
    padding[1, 4:] = True
    options = {"key_padding_mask": padding.to(device)}
    if masks != "key_padding_mask":
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1).to(device)
        options["attn_mask"] = causal
        if masks == "both-float":
            options = {name: torch.zeros(m.shape, device=device).masked_fill(m, -1e4) + 0.1 * torch.randn(m.shape, generator=rng).to(device)
                       for name, m in options.items()}
    out, _ = ours(x, x, x, need_weights=False, **options)
    expected, _ = theirs(x, x, x, need_weights=False, **options)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    (expected_grad,) = torch.autograd.grad(expected, x, torch.ones_like(out))
    torch.testing.assert_close(grad, expected_grad, atol=1e-4, rtol=1e-4)
    assert flashtile.stats()["fallbacks"] == {} and flashtile.stats()["calls"] == {backend: 1}


@pytest.mark.parametrize("mask_shape", [(3, 1, 1, 5, 7), (2, 1, 7)], ids=["leading-dims", "no-leading-dims"])
def test_sdpa_mask_with_several_leading_dims(device, rng, mask_shape):
    """A 5-d query: its leading dims merge into flashtile's batch, and so do the mask's."""
    query = randn(rng, 3, 2, 2, 5, 16, device=device, requires_grad=True)
    key, value = (randn(rng, 3, 2, 2, 7, 16, device=device, requires_grad=True) for _ in range(2))
    mask = randn(rng, *mask_shape, device=device, requires_grad=True)
    sdpa_against_torch(rng, query, key, value, attn_mask=mask)
