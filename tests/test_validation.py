"""Bad arguments raise ValueError/TypeError naming the argument and the actual value; features
not implemented yet raise NotImplementedError naming the feature. No backend runs in these tests."""
import pytest
import torch

import flashtile
from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


def qkv(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_kv=2, headdim=16, dtype=torch.float16):
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, dtype=dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def no_backend_runs():
    """A call that fails validation must neither run nor be counted."""
    flashtile.reset_stats()
    yield
    assert flashtile.stats()["calls"] == {}


@pytest.mark.parametrize(
    "name, shape, match",
    [
        ("q", (2, 5, 4), r"q must have 4 dims.*got 3 dims"),
        ("q", (1, 2, 5, 4, 16), r"q must have 4 dims.*got 5 dims"),
        ("k", (7, 2, 16), r"k must have 4 dims.*got 3 dims"),
        ("v", (2, 7, 2, 16, 1), r"v must have 4 dims.*got 5 dims"),
    ],
)
def test_wrong_rank(name, shape, match):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = torch.randn(shape, dtype=torch.float16)
    with pytest.raises(ValueError, match=match):
        flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


def test_batch_mismatch():
    q, _, _ = qkv(batch=2)
    _, k, v = qkv(batch=3)
    with pytest.raises(ValueError, match=r"batch.*2.*3"):
        flash_attn_func(q, k, v)


def test_zero_batch():
    q, k, v = qkv(batch=0)
    with pytest.raises(ValueError, match=r"batch must be >= 1.*\(0, 5, 4, 16\)"):
        flash_attn_func(q, k, v)


def test_seqlen_k_v_mismatch():
    q, k, _ = qkv(seqlen_k=7)
    _, _, v = qkv(seqlen_k=8)
    with pytest.raises(ValueError, match=r"k and v must have the same shape.*\(2, 7, 2, 16\).*\(2, 8, 2, 16\)"):
        flash_attn_func(q, k, v)


def test_headdim_mismatch_q_k():
    q, _, _ = qkv(headdim=16)
    _, k, v = qkv(headdim=24)
    with pytest.raises(ValueError, match=r"headdim.*16.*24"):
        flash_attn_func(q, k, v)


def test_headdim_mismatch_k_v():
    q, k, _ = qkv(headdim=16)
    _, _, v = qkv(headdim=24)
    with pytest.raises(ValueError, match=r"k and v.*\(2, 7, 2, 16\).*\(2, 7, 2, 24\)"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("nheads, nheads_kv", [(4, 3), (3, 2), (2, 4)])
def test_nheads_not_multiple(nheads, nheads_kv):
    q, k, v = qkv(nheads=nheads, nheads_kv=nheads_kv)
    with pytest.raises(ValueError, match=rf"nheads.*q nheads={nheads}.*k/v nheads={nheads_kv}"):
        flash_attn_func(q, k, v)


def test_zero_kv_heads():
    q, k, v = qkv(nheads=4, nheads_kv=0)
    with pytest.raises(ValueError, match=r"nheads.*k/v nheads=0"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("headdim", [4, 12, 17, 63, 264, 512])
def test_bad_headdim(headdim):
    q, k, v = qkv(headdim=headdim)
    with pytest.raises(ValueError, match=rf"headdim must be a multiple of 8.*got {headdim}"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.int8, torch.bool, torch.complex64])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_unsupported_dtype(name, dtype):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = torch.ones(tensors[name].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{name} has unsupported dtype {dtype}"):
        flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float16, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32, torch.float16),
        (torch.bfloat16, torch.float16, torch.bfloat16),
    ],
)
def test_mixed_dtypes(dtypes):
    q, k, v = (t.to(d) for t, d in zip(qkv(dtype=torch.float32), dtypes))
    with pytest.raises(TypeError, match=rf"q={dtypes[0]}, k={dtypes[1]}, v={dtypes[2]}"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor(name):
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = tensors[name].tolist()
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_different_devices(name):
    # A 'meta' tensor stands in for a second device on a CPU-only machine.
    tensors = dict(zip("qkv", qkv()))
    tensors[name] = tensors[name].to("meta")
    with pytest.raises(ValueError, match=rf"one device.*{name}=meta"):
        flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.parametrize(
    "softmax_scale, error, match",
    [
        (float("nan"), ValueError, r"softmax_scale.*got nan"),
        (float("inf"), ValueError, r"softmax_scale.*got inf"),
        (0.0, ValueError, r"softmax_scale.*got 0.0"),
        (-0.5, ValueError, r"softmax_scale.*got -0.5"),
        ("0.1", TypeError, r"softmax_scale.*got str"),
        (torch.tensor(0.1), TypeError, r"softmax_scale.*got Tensor"),
    ],
)
def test_bad_softmax_scale(softmax_scale, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        flash_attn_func(q, k, v, softmax_scale=softmax_scale)


def test_qkvpacked_bad_shapes():
    with pytest.raises(ValueError, match=r"qkv must have 5 dims.*got 4 dims"):
        flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\).*size 2"):
        flash_attn_qkvpacked_func(torch.randn(2, 5, 2, 4, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"qkv has unsupported dtype torch.float64"):
        flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"headdim must be a multiple of 8.*got 12"):
        flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 4, 12, dtype=torch.float16))


def test_kvpacked_bad_shapes():
    q = torch.randn(2, 5, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"kv must have 5 dims.*got 4 dims"):
        flash_attn_kvpacked_func(q, torch.randn(2, 7, 2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen_k, 2, nheads_kv, headdim\).*size 3"):
        flash_attn_kvpacked_func(q, torch.randn(2, 7, 3, 2, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"kv has unsupported dtype torch.int32"):
        flash_attn_kvpacked_func(q, torch.ones(2, 7, 2, 2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"nheads.*q nheads=4.*k/v nheads=3"):
        flash_attn_kvpacked_func(q, torch.randn(2, 7, 2, 3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"batch.*2.*1"):
        flash_attn_kvpacked_func(q, torch.randn(1, 7, 2, 2, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"q has unsupported dtype torch.float64"):
        flash_attn_kvpacked_func(q.double(), torch.randn(2, 7, 2, 2, 16, dtype=torch.float16))


NOT_YET = [
    (dict(dropout_p=0.1), r"dropout"),
    (dict(window_size=(16, 0)), r"window_size=\(16, 0\).*sliding-window"),
    (dict(window_size=(-1, 4)), r"window_size=\(-1, 4\).*sliding-window"),
    (dict(softcap=30.0), r"softcap"),
    (dict(alibi_slopes=torch.ones(4)), r"alibi_slopes"),
]


@pytest.mark.parametrize("kwargs, match", NOT_YET, ids=["dropout", "window_left", "window_right", "softcap", "alibi"])
def test_not_yet_supported(kwargs, match):
    q, k, v = qkv(nheads=4, nheads_kv=4, seqlen_k=5)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), **kwargs)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **kwargs)
