"""flashtile.scaled_dot_product_attention against torch's own SDPA, its fallbacks, and patch_sdpa().

Reference: torch's SDPA (the original function, math backend) in float64 (``ref_hi``) and in the
input dtype (``ref_lo``), with the tolerance rule of :func:`flashtile.testing.assert_close_to_ref`.
The length pairs cover seqlen_q <, = and > seqlen_k, where torch's top-left causal mask differs
from flash_attn_func's bottom-right one, and single queries or keys.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import dispatch, sdpa
from flashtile.testing import ATOL, assert_close_to_ref, random_like

HAS_CUDA = torch.cuda.is_available()
SEQLENS = [(1, 1), (3, 3), (5, 17), (17, 5), (1, 9), (9, 1)]


@pytest.fixture(autouse=True)
def clean_state(clean_dispatch_state):
    yield
    assert not sdpa.is_patched(), "a test left torch.nn.functional.scaled_dot_product_attention patched"


def draw(rng, device, dtype, *shape):
    return torch.randn(*shape, generator=rng).to(device=device, dtype=dtype).requires_grad_()


def torch_sdpa(*tensors, dtype, **kwargs):
    """torch's own SDPA (math backend) on leaf copies in ``dtype``: (out, leaves)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa.TORCH_SDPA(*leaves, **kwargs), leaves


def check_against_torch(rng, query, key, value, **kwargs):
    """Forward and gradients of flashtile's SDPA against torch's, float64 and input-dtype references."""
    out = flashtile.scaled_dot_product_attention(query, key, value, **kwargs)
    assert out.shape == torch_sdpa(query, key, value, dtype=query.dtype, **kwargs)[0].shape
    assert out.dtype == query.dtype
    dout = random_like(out, rng)
    grads = torch.autograd.grad(out, (query, key, value), dout)
    atol_out, atol_grad = ATOL[query.dtype]
    refs = []
    for dtype in (torch.float64, query.dtype):
        ref, leaves = torch_sdpa(query, key, value, dtype=dtype, **kwargs)
        refs.append((ref, torch.autograd.grad(ref, leaves, dout.to(dtype))))
    (hi, hi_grads), (lo, lo_grads) = refs
    assert_close_to_ref("out", out, hi, lo, atol_out)
    for name, ours, ref_hi, ref_lo in zip(("dq", "dk", "dv"), grads, hi_grads, lo_grads):
        assert_close_to_ref(name, ours, ref_hi, ref_lo, atol_grad)
    return out


def flash_calls():
    """Calls flashtile's own backends ran (not torch's SDPA)."""
    return sum(n for name, n in flashtile.stats()["calls"].items() if name in dispatch.BACKENDS)


@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS, ids=[f"{q}x{k}" for q, k in SEQLENS])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_matches_torch(backend, device, rng, is_causal, seqlen_q, seqlen_k):
    # GQA (4 query heads on 2 KV heads) throughout: torch's enable_gqa head mapping.
    query = draw(rng, device, torch.float32, 2, 4, seqlen_q, 16)
    key, value = (draw(rng, device, torch.float32, 2, 2, seqlen_k, 16) for _ in range(2))
    check_against_torch(rng, query, key, value, is_causal=is_causal, enable_gqa=True)
    assert flashtile.stats()["fallbacks"] == {}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 12), (12, 7)], ids=["7x12", "12x7"])
def test_16_bit(backend, device, rng, dtype, seqlen_q, seqlen_k):
    query = draw(rng, device, dtype, 1, 2, seqlen_q, 32)
    key, value = (draw(rng, device, dtype, 1, 2, seqlen_k, 32) for _ in range(2))
    check_against_torch(rng, query, key, value, is_causal=True)


@pytest.mark.parametrize("nheads_kv, enable_gqa", [(4, False), (1, False), (2, True), (1, True)],
                         ids=["mha", "broadcast-1", "gqa-2", "mqa-1"])
def test_head_layouts(backend, device, rng, nheads_kv, enable_gqa):
    # One KV head without enable_gqa is torch broadcasting it: flashtile serves it as MQA.
    query = draw(rng, device, torch.float32, 1, 4, 6, 8)
    key, value = (draw(rng, device, torch.float32, 1, nheads_kv, 6, 8) for _ in range(2))
    check_against_torch(rng, query, key, value, is_causal=True, enable_gqa=enable_gqa)
    assert flash_calls() == 1 and flashtile.stats()["fallbacks"] == {}


def test_custom_scale(backend, device, rng):
    query, key, value = (draw(rng, device, torch.float32, 1, 2, 9, 16) for _ in range(3))
    check_against_torch(rng, query, key, value, scale=0.7)
    check_against_torch(rng, query, key, value, scale=2, is_causal=True)


@pytest.mark.parametrize("shape_q, shape_k", [((2, 5, 16), (2, 7, 16)), ((3, 2, 2, 5, 16), (3, 2, 2, 7, 16)), ((5, 16), (7, 16))],
                         ids=["unbatched-3d", "5d", "2d"])
def test_other_ranks(device, rng, shape_q, shape_k):
    query = draw(rng, device, torch.float32, *shape_q)
    key, value = (draw(rng, device, torch.float32, *shape_k) for _ in range(2))
    out = check_against_torch(rng, query, key, value, is_causal=True)
    assert out.shape == shape_q
    assert flashtile.stats()["fallbacks"] == {}


def test_reads_inputs_as_views_and_counts_calls(device, rng, monkeypatch):
    seen = []
    original = sdpa.flash_attn_func

    def spy(q, k, v, **kwargs):
        seen.append((q, k, v))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(sdpa, "flash_attn_func", spy)
    query, key, value = (draw(rng, device, torch.float32, 2, 3, 4, 8) for _ in range(3))
    flashtile.scaled_dot_product_attention(query, key, value)
    q, k, v = seen[0]
    assert q.shape == (2, 4, 3, 8) and q.data_ptr() == query.data_ptr() and q._base is query
    assert k._base is key and v._base is value
    assert flash_calls() == 1
    # seqlen_q > seqlen_k, causal: one windowed call (window_size=(-1, seqlen_q - seqlen_k)).
    flashtile.scaled_dot_product_attention(query, key[:, :, :2], value[:, :, :2], is_causal=True)
    assert flash_calls() == 2


def test_top_left_differs_from_flash_attn_func(device, rng):
    """The documented difference: torch's causal mask is top-left, flash_attn_func's bottom-right."""
    query = draw(rng, device, torch.float32, 1, 1, 2, 8)
    key, value = (draw(rng, device, torch.float32, 1, 1, 5, 8) for _ in range(2))
    ours = flashtile.scaled_dot_product_attention(query, key, value, is_causal=True)
    # Row 0 sees key 0 only: its output is value row 0.
    torch.testing.assert_close(ours[0, 0, 0], value[0, 0, 0], atol=1e-6, rtol=0)
    bottom_right = flashtile.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True)
    assert (bottom_right.transpose(1, 2) - ours).abs().max() > 1e-2


# (what differs from a plain (1, 2, 6, 16) float32 call, the reason's words)
FALLBACKS = {
    "headdim-12": (dict(headdim=12), "head dim 12"),
    "headdim-264": (dict(headdim=264), "head dim 264"),
    "float64": (dict(dtype=torch.float64), "dtype torch.float64"),
    "value-headdim": (dict(value_headdim=12), "value head dim 12"),
    "kv-heads-differ": (dict(value_heads=1, enable_gqa=True), "different numbers of heads"),
    "batch-broadcast": (dict(key_batch=1, query_batch=2), "leading (batch) dims"),
    "scale-negative": (dict(scale=-0.5), "scale is not a finite positive float"),
    "empty-batch": (dict(query_batch=0, key_batch=0), "empty batch"),
    "meta-device": (dict(device="meta"), "device type 'meta'"),
}


def fallback_inputs(rng, device, options):
    options = dict(options)
    dtype = options.pop("dtype", torch.float32)
    device = options.pop("device", device)
    headdim = options.pop("headdim", 16)
    query_batch, key_batch = options.pop("query_batch", 1), options.pop("key_batch", 1)
    value_headdim, value_heads = options.pop("value_headdim", headdim), options.pop("value_heads", 2)
    query = torch.randn(query_batch, 2, 6, headdim, generator=rng).to(device=device, dtype=dtype)
    key = torch.randn(key_batch, 2, 6, headdim, generator=rng).to(device=device, dtype=dtype)
    value = torch.randn(key_batch, value_heads, 6, value_headdim, generator=rng).to(device=device, dtype=dtype)
    options = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in options.items()}
    return (query, key, value), options


@pytest.mark.parametrize("case", FALLBACKS)
def test_fallback_runs_torch_and_is_recorded(device, rng, case):
    options, words = FALLBACKS[case]
    (query, key, value), kwargs = fallback_inputs(rng, device, options)
    with pytest.warns(RuntimeWarning, match="to the torch_sdpa backend") as record:
        out = flashtile.scaled_dot_product_attention(query, key, value, **kwargs)
    assert [w.filename for w in record if "torch_sdpa" in str(w.message)] == [__file__]  # it points at the caller
    expected = sdpa.TORCH_SDPA(query, key, value, **kwargs)
    assert out.shape == expected.shape
    if "dropout_p" not in kwargs and out.device.type != "meta":
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    snapshot = flashtile.stats()
    assert snapshot["calls"] == {"torch_sdpa": 1}
    [(reason, count)] = snapshot["fallbacks"].items()
    assert words in reason and count == 1


@pytest.mark.parametrize("case", FALLBACKS)
def test_fallback_raises_in_strict_mode(device, rng, case):
    options, words = FALLBACKS[case]
    (query, key, value), kwargs = fallback_inputs(rng, device, options)
    flashtile.set_strict(True)
    with pytest.raises(flashtile.FallbackError, match="strict mode") as error:
        flashtile.scaled_dot_product_attention(query, key, value, **kwargs)
    assert words in str(error.value)
    assert flashtile.stats()["calls"] == {} and flashtile.stats()["fallbacks"] == {}


def test_fallback_warns_once_per_reason(device, rng):
    query, key, value = (torch.randn(1, 2, 4, 16, generator=rng).double() for _ in range(3))
    with pytest.warns(RuntimeWarning):
        flashtile.scaled_dot_product_attention(query, key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        flashtile.scaled_dot_product_attention(query, key, value)
    assert list(flashtile.stats()["fallbacks"].values()) == [2]


@pytest.mark.parametrize("shapes, kwargs, match", [
    (((1, 4, 3, 16), (1, 2, 3, 16)), {}, "pass enable_gqa=True"),
    (((1, 3, 3, 16), (1, 2, 3, 16)), {"enable_gqa": True}, "must be a multiple"),
    (((1, 2, 3, 16), (1, 2, 3, 32)), {}, "same head dim"),
    (((1, 2, 3, 16), (1, 2, 3, 16)), {"attn_mask": torch.zeros(3, 3, dtype=torch.float64)}, "attn_mask must be bool or have query's dtype"),
    (((1, 2, 3, 16), (1, 2, 3, 16)), {"attn_mask": torch.ones(2, 3, dtype=torch.bool)}, r"attn_mask of shape \(2, 3\) is not broadcastable"),
], ids=["heads-without-gqa", "gqa-not-divisible", "qk-headdim", "mask-dtype", "mask-shape"])
def test_invalid_calls_raise_like_torch(device, shapes, kwargs, match):
    query, key = torch.randn(*shapes[0], device=device), torch.randn(*shapes[1], device=device)
    kwargs = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
    with pytest.raises(RuntimeError):
        sdpa.TORCH_SDPA(query, key, key, **kwargs)
    with pytest.raises(RuntimeError, match=match):
        flashtile.scaled_dot_product_attention(query, key, key, **kwargs)
    assert flashtile.stats()["calls"] == {}


def test_mixed_dtypes_raise_like_torch(device):
    query = torch.randn(1, 2, 3, 16, device=device)
    with pytest.raises(RuntimeError, match="share one dtype"):
        flashtile.scaled_dot_product_attention(query, query.half(), query)


def test_record_fallback_counts_warns_once_and_honours_strict(caplog):
    expected = "from the triton to the x backend: why"
    with caplog.at_level("INFO", logger="flashtile"), pytest.warns(RuntimeWarning, match=expected) as record:
        dispatch.record_fallback("why", "x", preferred="triton", stacklevel=1)  # 1: this line
    assert [w.filename for w in record] == [__file__] and "why" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        dispatch.record_fallback("why", "x")
    assert flashtile.stats()["calls"] == {"x": 2} and flashtile.stats()["fallbacks"] == {"why": 2}
    flashtile.set_strict(True)
    with pytest.raises(flashtile.FallbackError, match="the preferred backend cannot run this call: why"):
        dispatch.record_fallback("why", "x")
    assert flashtile.stats()["calls"] == {"x": 2}


# patch_sdpa()

def test_patch_replaces_and_restores():
    original = F.scaled_dot_product_attention
    assert original is sdpa.TORCH_SDPA
    with flashtile.patch_sdpa() as patch:
        assert F.scaled_dot_product_attention is flashtile.scaled_dot_product_attention and patch.active
    assert F.scaled_dot_product_attention is original and not patch.active


def test_patch_restores_after_an_exception():
    with pytest.raises(ZeroDivisionError), flashtile.patch_sdpa():
        1 / 0
    assert F.scaled_dot_product_attention is sdpa.TORCH_SDPA


def test_patches_nest_in_any_order():
    outer, inner = flashtile.patch_sdpa(), flashtile.patch_sdpa()
    with outer:
        with inner:
            assert sdpa.is_patched()
        assert sdpa.is_patched()  # the inner exit leaves the outer patch in place
    assert not sdpa.is_patched()
    first, second = flashtile.patch_sdpa().start(), flashtile.patch_sdpa().start()
    first.stop()
    assert sdpa.is_patched()
    second.stop()
    assert F.scaled_dot_product_attention is sdpa.TORCH_SDPA


def test_patch_start_stop_misuse_is_an_error():
    patch = flashtile.patch_sdpa()
    with pytest.raises(RuntimeError, match="not started"):
        patch.stop()
    patch.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            patch.start()
    finally:
        patch.stop()


def test_patched_sdpa_falls_back_without_recursing(device, rng):
    query = torch.randn(1, 2, 4, 16, generator=rng).to(device)
    double = query.double()  # float64: torch's own kernel
    with flashtile.patch_sdpa(), pytest.warns(RuntimeWarning, match="float64"):
        out = F.scaled_dot_product_attention(double, double, double)
    torch.testing.assert_close(out, sdpa.TORCH_SDPA(double, double, double), atol=1e-12, rtol=0)
    assert flashtile.stats()["calls"] == {"torch_sdpa": 1}


def test_patch_routes_multihead_attention(backend, device, rng):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 2, batch_first=True, device=device)
    x = torch.randn(2, 5, 32, generator=rng).to(device).requires_grad_()
    expected, _ = mha(x, x, x, need_weights=False)
    with flashtile.patch_sdpa():
        out, _ = mha(x, x, x, need_weights=False)
        out.sum().backward()
    assert flashtile.stats()["calls"] == {backend: 1} and flashtile.stats()["fallbacks"] == {}
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_patch_routes_transformer_encoder_layer(backend, device, rng):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True, device=device)
    x = torch.randn(2, 6, 32, generator=rng).to(device)
    causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(6, device=device)
    expected = layer(x, src_mask=causal_mask, is_causal=True)
    with flashtile.patch_sdpa():
        out = layer(x, src_mask=causal_mask, is_causal=True)
        plain = layer(x)
    assert flashtile.stats()["calls"] == {backend: 2} and flashtile.stats()["fallbacks"] == {}
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, layer(x), atol=1e-5, rtol=1e-5)
