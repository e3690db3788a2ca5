"""Bad arguments raise ValueError/TypeError naming the argument and the actual value; a combination
no backend serves (attn_bias on packed sequences) raises NotImplementedError naming both. No backend
runs in these tests."""
import pytest
import torch

import flashtile
from flashtile import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.interface import flash_attn_with_kvcache, merge_attention_states


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
    with pytest.raises(ValueError, match=r"k and v must have the same batch, seqlen and nheads.*\(2, 7, 2, 16\).*\(2, 8, 2, 16\)"):
        flash_attn_func(q, k, v)


def test_nheads_k_v_mismatch():
    q, k, _ = qkv(nheads_kv=2)
    v = torch.randn(2, 7, 1, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"k and v must have the same batch, seqlen and nheads.*\(2, 7, 1, 16\)"):
        flash_attn_func(q, k, v)


def test_headdim_mismatch_q_k():
    q, _, _ = qkv(headdim=16)
    _, k, v = qkv(headdim=24)
    with pytest.raises(ValueError, match=r"headdim.*16.*24"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("headdim_v", [4, 12, 264])
def test_bad_headdim_v(headdim_v):
    # A value head dim of its own is fine (headdim_v), but it follows the same rule as headdim.
    q, k, _ = qkv(headdim=16)
    _, _, v = qkv(headdim=headdim_v)
    with pytest.raises(ValueError, match=rf"head dim of v \(headdim_v\) must be a multiple of 8.*got {headdim_v}"):
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


# ---------------------------------------------------------------- variant arguments


def dense_calls(q, k, v):
    """The three dense entry points on the same q, k, v (nheads == nheads_kv, seqlen_q == seqlen_k)."""
    return [
        lambda **kw: flash_attn_func(q, k, v, **kw),
        lambda **kw: flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), **kw),
        lambda **kw: flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **kw),
    ]


BAD_OPTIONS = {
    "window-below-minus-1": (dict(window_size=(-2, 0)), ValueError, r"window_size entries must be -1.*\(-2, 0\)"),
    "window-right-below": (dict(window_size=(3, -5)), ValueError, r"window_size.*\(3, -5\)"),
    "window-float": (dict(window_size=(2.0, 0)), TypeError, r"window_size must be a pair of ints.*\(2.0, 0\).*float"),
    "window-bool": (dict(window_size=(True, 0)), TypeError, r"window_size must be a pair of ints.*bool"),
    "window-three": (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a pair \(left, right\).*\(1, 2, 3\)"),
    "window-int": (dict(window_size=4), TypeError, r"window_size must be a pair.*4"),
    "softcap-negative": (dict(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0.*-1.0"),
    "softcap-nan": (dict(softcap=float("nan")), ValueError, r"softcap.*nan"),
    "softcap-tensor": (dict(softcap=torch.tensor(3.0)), TypeError, r"softcap must be a Python float, got Tensor"),
    "dropout-one": (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    "dropout-negative": (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    "dropout-str": (dict(dropout_p="0.1"), TypeError, r"dropout_p must be a Python float, got str"),
    "alibi-shape": (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\) or "
                                                                 r"\(batch, nheads\) = \(2, 4\).*got \(3,\)"),
    "alibi-batch": (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"alibi_slopes must have shape.*got \(3, 4\)"),
    "alibi-dtype": (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError,
                    r"alibi_slopes must have dtype torch.float32, got torch.float16"),
    "alibi-device": (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, r"alibi_slopes must be on q's device cpu, got meta"),
    "alibi-list": (dict(alibi_slopes=[1.0] * 4), TypeError, r"alibi_slopes must be a torch.Tensor or None, got list"),
    "sink-shape": (dict(sink=torch.zeros(2)), ValueError, r"sink must have shape \(nheads,\) = \(4,\).*got \(2,\)"),
    "sink-2d": (dict(sink=torch.zeros(1, 4)), ValueError, r"sink must have shape.*got \(1, 4\)"),
    "sink-dtype": (dict(sink=torch.zeros(4, dtype=torch.int32)), TypeError, r"sink must have dtype.*got torch.int32"),
    "sink-float64": (dict(sink=torch.zeros(4, dtype=torch.float64)), TypeError, r"sink must have dtype.*got torch.float64"),
    "sink-device": (dict(sink=torch.zeros(4, device="meta")), ValueError, r"sink must be on q's device cpu, got meta"),
    "bias-not-broadcastable": (dict(attn_bias=torch.zeros(5, 6)), ValueError,
                               r"attn_bias of shape \(5, 6\) is not broadcastable to \(batch, nheads, seqlen_q, "
                               r"seqlen_k\) = \(2, 4, 5, 5\)"),
    "bias-heads": (dict(attn_bias=torch.zeros(2, 3, 5, 5)), ValueError, r"attn_bias of shape \(2, 3, 5, 5\) is not broadcastable"),
    "bias-5d": (dict(attn_bias=torch.zeros(1, 2, 4, 5, 5)), ValueError, r"attn_bias of shape \(1, 2, 4, 5, 5\) is not broadcastable"),
    "bias-dtype": (dict(attn_bias=torch.zeros(5, 5, dtype=torch.int64)), TypeError, r"attn_bias must have dtype.*got torch.int64"),
    "bias-device": (dict(attn_bias=torch.zeros(5, 5, device="meta")), ValueError, r"attn_bias must be on q's device cpu, got meta"),
    "bias-array": (dict(attn_bias=[[0.0] * 5] * 5), TypeError, r"attn_bias must be a torch.Tensor or None, got list"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_variant_arguments(case):
    kwargs, error, match = BAD_OPTIONS[case]
    q, k, v = qkv(nheads=4, nheads_kv=4, seqlen_q=5, seqlen_k=5)
    for call in dense_calls(q, k, v):
        with pytest.raises(error, match=match):
            call(**kwargs)


def test_bad_arguments_are_reported_by_explain():
    q, k, v = qkv()
    report = flashtile.explain(q, k, v, attn_bias=torch.zeros(3, 7))
    assert report.backend is None and "attn_bias of shape (3, 7) is not broadcastable" in report.error


# ---------------------------------------------------------------- varlen arguments


def varlen_inputs(lengths_q=(3, 0, 4), lengths_k=(5, 2, 0), nheads=4, nheads_kv=2, headdim=16):
    q = torch.randn(sum(lengths_q), nheads, headdim, dtype=torch.float16)
    k = torch.randn(sum(lengths_k), nheads_kv, headdim, dtype=torch.float16)
    v = torch.randn(sum(lengths_k), nheads_kv, headdim, dtype=torch.float16)
    cu = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) for lengths in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def varlen(q, k, v, cu_q, cu_k, max_q=4, max_k=5, **kwargs):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


I32 = torch.int32
BAD_VARLEN = {
    "cu-q-int64": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q.long(), cu_k), TypeError,
                   r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    "cu-k-float": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k.float()), TypeError,
                   r"cu_seqlens_k must have dtype torch.int32, got torch.float32"),
    "cu-q-list": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q.tolist(), cu_k), TypeError,
                  r"cu_seqlens_q must be a torch.Tensor.*got list"),
    "cu-q-2d": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q[None], cu_k), ValueError,
                r"cu_seqlens_q must be 1-d \(batch \+ 1,\), got 2 dims.*shape=\(1, 4\)"),
    "cu-q-one-entry": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q[:1], cu_k[:1]), ValueError,
                       r"cu_seqlens_q must hold batch \+ 1 >= 2 offsets.*\(1,\)"),
    "cu-lengths-differ": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k[:3]), ValueError,
                          r"cu_seqlens_q and cu_seqlens_k must both hold batch \+ 1 offsets, got shapes \(4,\) and \(3,\)"),
    "cu-not-monotone": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, torch.tensor([0, 3, 2, 7], dtype=I32), cu_k), ValueError,
                        r"cu_seqlens_q must be non-decreasing.*length -1"),
    "cu-first-not-0": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, torch.tensor([1, 5, 7, 7], dtype=I32)), ValueError,
                       r"cu_seqlens_k\[0\] must be 0, got 1"),
    "cu-last-too-big": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, torch.tensor([0, 3, 3, 8], dtype=I32), cu_k), ValueError,
                        r"cu_seqlens_q\[-1\]=8 exceeds the 7 tokens of q \(shape \(7, 4, 16\)\)"),
    "cu-device": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q.to("meta"), cu_k), ValueError,
                  r"cu_seqlens_q must be on q's device cpu, got meta"),
    "max-negative": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, max_q=-1), ValueError,
                     r"max_seqlen_q must be >= 0, got -1"),
    "max-too-small": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, max_k=4), ValueError,
                      r"max_seqlen_k=4 is less than the longest sequence in cu_seqlens_k \(5\)"),
    "max-float": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, max_q=4.0), TypeError,
                  r"max_seqlen_q must be a Python int or a 0-d integer tensor, got float"),
    "max-tensor-1d": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, max_q=torch.tensor([4])), TypeError,
                      r"max_seqlen_q must be a Python int or a 0-d integer tensor, got a tensor \(shape=\(1,\)"),
    "max-tensor-negative": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, max_k=torch.tensor(-3)), ValueError,
                            r"max_seqlen_k must be >= 0, got -3"),
    "seqused-dtype": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, seqused_k=torch.zeros(3, dtype=torch.int64)),
                      TypeError, r"seqused_k must have dtype torch.int32, got torch.int64"),
    "seqused-shape": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, seqused_k=torch.zeros(4, dtype=I32)),
                      ValueError, r"seqused_k must have shape \(batch,\) = \(3,\), got \(4,\)"),
    "seqused-too-long": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, seqused_k=torch.tensor([5, 3, 0], dtype=I32)),
                         ValueError, r"seqused_k must be between 0 and each sequence's number of keys.*above"),
    "seqused-list": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, seqused_k=[1, 1, 0]), TypeError,
                     r"seqused_k must be a torch.Tensor.*got list"),
    "q-4d": (lambda q, k, v, cu_q, cu_k: varlen(q[None], k, v, cu_q, cu_k), ValueError,
             r"q must have 3 dims \(total_tokens, nheads, headdim\), got 4 dims"),
    "kv-tokens-differ": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v[:-1], cu_q, cu_k), ValueError,
                         r"k and v must have the same tokens and nheads.*\(7, 2, 16\).*\(6, 2, 16\)"),
    "alibi-batch": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, alibi_slopes=torch.ones(2, 4)), ValueError,
                    r"alibi_slopes must have shape.*\(batch, nheads\) = \(3, 4\).*got \(2, 4\)"),
    "window": (lambda q, k, v, cu_q, cu_k: varlen(q, k, v, cu_q, cu_k, window_size=(-3, -1)), ValueError,
               r"window_size entries must be -1"),
}


@pytest.mark.parametrize("case", BAD_VARLEN)
def test_bad_varlen_arguments(case):
    call, error, match = BAD_VARLEN[case]
    with pytest.raises(error, match=match):
        call(*varlen_inputs())


def test_varlen_with_attn_bias_names_both():
    q, k, v, cu_q, cu_k = varlen_inputs()
    bias = torch.zeros(3, 4, 4, 5)
    with pytest.raises(NotImplementedError, match=r"attn_bias with variable-length sequences \(cu_seqlens_q/cu_seqlens_k\)"):
        varlen(q, k, v, cu_q, cu_k, attn_bias=bias)
    with pytest.raises(NotImplementedError, match=r"attn_bias with variable-length"):
        flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), cu_q, cu_k, 4, 5, attn_bias=bias)
    qkv_packed = torch.randn(7, 3, 4, 16, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match=r"attn_bias with variable-length"):
        flash_attn_varlen_qkvpacked_func(qkv_packed, cu_q, 4, attn_bias=bias)


def test_varlen_packed_bad_shapes():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"qkv must have 4 dims \(total_tokens, 3, nheads, headdim\), got 5 dims"):
        flash_attn_varlen_qkvpacked_func(torch.randn(1, 7, 3, 4, 16, dtype=torch.float16), cu, 4)
    with pytest.raises(ValueError, match=r"qkv must have shape \(total_tokens, 3, nheads, headdim\).*dim 1 of size 2"):
        flash_attn_varlen_qkvpacked_func(torch.randn(7, 2, 4, 16, dtype=torch.float16), cu, 4)
    with pytest.raises(ValueError, match=r"kv must have shape \(total_k, 2, nheads_kv, headdim\).*dim 1 of size 3"):
        flash_attn_varlen_kvpacked_func(torch.randn(7, 4, 16, dtype=torch.float16), torch.randn(7, 3, 2, 16, dtype=torch.float16),
                                        cu, cu, 4, 4)


# ---------------------------------------------------------------- flash_attn_with_kvcache arguments


def kv_inputs(batch=2, capacity=64, nheads=4, nheads_kv=2, headdim=32, seqlen_new=3, page_size=None, num_blocks=6):
    """q, k_cache, v_cache, k, v and the keyword arguments of a valid call (contiguous, or paged)."""
    q = torch.randn(batch, seqlen_new, nheads, headdim, dtype=torch.float16)
    k = torch.randn(batch, seqlen_new, nheads_kv, headdim, dtype=torch.float16)
    v = torch.randn(batch, seqlen_new, nheads_kv, headdim, dtype=torch.float16)
    kwargs = dict(cache_seqlens=torch.tensor([4, 20], dtype=torch.int32)[:batch])
    if page_size is None:
        cache_shape = (batch, capacity, nheads_kv, headdim)
    else:
        cache_shape = (num_blocks, page_size, nheads_kv, headdim)
        kwargs["block_table"] = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2)
    return q, torch.randn(cache_shape, dtype=torch.float16), torch.randn(cache_shape, dtype=torch.float16), k, v, kwargs


def kv_call(change):
    """A callable running flash_attn_with_kvcache on kv_inputs() after ``change(inputs, kwargs)``."""
    def call(**inputs_options):
        q, k_cache, v_cache, k, v, kwargs = kv_inputs(**inputs_options)
        tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
        change(tensors, kwargs)
        return flash_attn_with_kvcache(**tensors, **kwargs)
    return call


def _set(**values):
    return lambda tensors, kwargs: (tensors.update((n, x) for n, x in values.items() if n in tensors),
                                    kwargs.update((n, x) for n, x in values.items() if n not in tensors))


I32 = torch.int32
PAGED = dict(page_size=16)
BAD_KVCACHE = {
    "headdim": (_set(k_cache=torch.randn(2, 64, 2, 64, dtype=torch.float16)), {}, ValueError,
                r"headdim mismatch: q has headdim 32 but k_cache has headdim 64"),
    "heads": (_set(k_cache=torch.randn(2, 64, 3, 32, dtype=torch.float16), v_cache=torch.randn(2, 64, 3, 32, dtype=torch.float16)),
              {}, ValueError, r"nheads of q must be a multiple of nheads_kv of k_cache/v_cache, got q nheads=4 and "
                              r"k_cache nheads_kv=3"),
    "dtype": (_set(v_cache=torch.randn(2, 64, 2, 32)), {}, TypeError,
              r"q, k_cache, v_cache \(and k, v\) must share one dtype, got q=torch.float16, k_cache=torch.float16, "
              r"v_cache=torch.float32"),
    "device": (_set(k_cache=torch.randn(2, 64, 2, 32, dtype=torch.float16, device="meta")), {}, ValueError,
               r"must be on one device, got q=cpu, k_cache=meta"),
    "cache-rank": (_set(k_cache=torch.randn(2, 64, 64, dtype=torch.float16)), {}, ValueError,
                   r"k_cache must have 4 dims \(batch_cache, seqlen_cache, nheads_kv, headdim\), got 3 dims"),
    "cache-not-unit-stride": (_set(k_cache=torch.randn(2, 64, 2, 64, dtype=torch.float16)[..., ::2]), {}, ValueError,
                              r"k_cache must have a contiguous last dim \(stride\(-1\) == 1\), got strides \(8192, 128, 64, 2\)"),
    "k-without-v": (_set(v=None), {}, ValueError, r"the new tokens k and v must be given together, got k but v=None"),
    "k-batch": (_set(k=torch.randn(1, 3, 2, 32, dtype=torch.float16), v=torch.randn(1, 3, 2, 32, dtype=torch.float16)), {},
                ValueError, r"batch mismatch: q has batch 2 but k has batch 1"),
    "k-heads": (_set(k=torch.randn(2, 3, 4, 32, dtype=torch.float16)), {}, ValueError,
                r"k must have the nheads_kv and headdim of k_cache \(2, 32\), got k \(2, 3, 4, 32\)"),
    "v-seqlen": (_set(v=torch.randn(2, 2, 2, 32, dtype=torch.float16)), {}, ValueError,
                 r"v must have k's batch, seqlen_new and nheads_kv"),
    "small-cache-batch": (_set(k_cache=torch.randn(1, 64, 2, 32, dtype=torch.float16), v_cache=torch.randn(1, 64, 2, 32, dtype=torch.float16)),
                          {}, ValueError, r"k_cache holds 1 sequences \(batch_cache of \(1, 64, 2, 32\)\) but q has batch 2; "
                                          r"pass cache_batch_idx"),
    "seqlens-int64": (_set(cache_seqlens=torch.tensor([4, 20])), {}, TypeError,
                      r"cache_seqlens must have dtype torch.int32, got torch.int64"),
    "seqlens-shape": (_set(cache_seqlens=torch.tensor([4, 20, 1], dtype=I32)), {}, ValueError,
                      r"cache_seqlens must have shape an int or \(batch,\) = \(2,\), got \(3,\)"),
    "seqlens-negative": (_set(cache_seqlens=torch.tensor([4, -2], dtype=I32)), {}, ValueError,
                         r"cache_seqlens\[1\] = -2 is negative"),
    "seqlens-past-capacity": (_set(cache_seqlens=torch.tensor([4, 62], dtype=I32)), {}, ValueError,
                              r"cache_seqlens\[1\] \+ seqlen_new = 62 \+ 3 = 65 exceeds the cache capacity of 64 tokens "
                              r"per sequence \(seqlen_cache of k_cache \(2, 64, 2, 32\)\); nothing was written"),
    "seqlens-int-past-capacity": (_set(cache_seqlens=62), {}, ValueError,
                                  r"cache_seqlens=62 plus seqlen_new=3 new tokens is 65, past the cache capacity of 64"),
    "seqlens-none-with-new": (_set(cache_seqlens=None), {}, ValueError,
                              r"cache_seqlens=None \(the cache is full: 64 tokens\) plus seqlen_new=3 new tokens is 67"),
    "paged-past-capacity": (_set(cache_seqlens=torch.tensor([4, 30], dtype=I32)), PAGED, ValueError,
                            r"cache_seqlens\[1\] \+ seqlen_new = 30 \+ 3 = 33 exceeds the cache capacity of 32 tokens per "
                            r"sequence \(block_table \(2, 2\) gives each sequence 2 pages of page_size=16 tokens\)"),
    "more-new-than-capacity": (_set(k=torch.randn(2, 70, 2, 32, dtype=torch.float16), v=torch.randn(2, 70, 2, 32, dtype=torch.float16)),
                               {}, ValueError, r"k and v hold seqlen_new=70 new tokens per sequence, more than the cache "
                                               r"capacity of 64"),
    "table-int64": (_set(block_table=torch.zeros(2, 2, dtype=torch.int64)), PAGED, TypeError,
                    r"block_table must have dtype torch.int32, got torch.int64"),
    "table-shape": (_set(block_table=torch.zeros(3, 2, dtype=I32)), PAGED, ValueError,
                    r"block_table must have shape \(batch, max_blocks_per_seq\) = \(2, >= 1\), got \(3, 2\)"),
    "table-past-blocks": (_set(block_table=torch.tensor([[0, 1], [9, 2]], dtype=I32)), PAGED, ValueError,
                          r"block_table\[1, 0\] = 9 is not a page of k_cache \(num_blocks = 6, shape \(6, 16, 2, 32\)\)"),
    "table-negative": (_set(block_table=torch.tensor([[0, 1], [2, -1]], dtype=I32)), PAGED, ValueError,
                       r"block_table\[1, 1\] = -1 is not a page of k_cache"),
    "page-size-mismatch": (_set(v_cache=torch.randn(6, 8, 2, 32, dtype=torch.float16)), PAGED, ValueError,
                           r"k_cache and v_cache must have the same page_size \(dim 1 of \(num_blocks, page_size, nheads_kv, "
                           r"headdim\)\), got k_cache \(6, 16, 2, 32\) \(page_size 16\) and v_cache \(6, 8, 2, 32\) \(page_size 8\)"),
    "leftpad-paged": (_set(cache_leftpad=torch.zeros(2, dtype=I32)), PAGED, NotImplementedError,
                      r"cache_leftpad with a paged KV cache \(block_table\) is not supported"),
    "batch-idx-paged": (_set(cache_batch_idx=torch.zeros(2, dtype=I32)), PAGED, NotImplementedError,
                        r"cache_batch_idx with a paged KV cache \(block_table\) is not supported"),
    "batch-idx-range": (_set(cache_batch_idx=torch.tensor([0, 2], dtype=I32)), {}, ValueError,
                        r"cache_batch_idx\[1\] = 2 is not a row of k_cache \(batch_cache = 2"),
    "batch-idx-dtype": (_set(cache_batch_idx=torch.tensor([0, 1])), {}, TypeError,
                        r"cache_batch_idx must have dtype torch.int32, got torch.int64"),
    "leftpad-past-seqlens": (_set(cache_leftpad=torch.tensor([5, 0], dtype=I32)), {}, ValueError,
                             r"cache_leftpad\[0\] = 5 must be between 0 and cache_seqlens\[0\] = 4"),
    "rotary-short": (_set(rotary_cos=torch.ones(20, 8), rotary_sin=torch.zeros(20, 8)), {}, ValueError,
                     r"rotary_cos/rotary_sin have 20 positions \(shape \(20, 8\)\) but batch row 1 needs position 22 "
                     r"\(the new key 2 sits at cache_seqlens\[1\] \+ 2 = 22\); give tables of at least 23 rows"),
    "rotary-short-causal-q": (_set(rotary_cos=torch.ones(22, 8), rotary_sin=torch.zeros(22, 8),
                                   k=torch.randn(2, 1, 2, 32, dtype=torch.float16),
                                   v=torch.randn(2, 1, 2, 32, dtype=torch.float16), causal=True), {}, ValueError,
                              r"needs position 22 \(query 2 sits at cache_seqlens\[1\] \+ 2 = 22\)"),
    "rotary-without-k": (_set(rotary_cos=torch.ones(80, 8), rotary_sin=torch.zeros(80, 8), k=None, v=None), {}, ValueError,
                         r"rotary_cos/rotary_sin rotate q and the new tokens k .* need k and v; got k=None"),
    "rotary-cos-only": (_set(rotary_cos=torch.ones(80, 8)), {}, ValueError,
                        r"rotary_cos and rotary_sin must be given together, got rotary_cos but rotary_sin=None"),
    "rotary-too-wide": (_set(rotary_cos=torch.ones(80, 20), rotary_sin=torch.zeros(80, 20)), {}, ValueError,
                        r"rotary_dim <= headdim = 32, got \(80, 20\) \(rotary_dim = 40\)"),
    "rotary-shapes-differ": (_set(rotary_cos=torch.ones(80, 8), rotary_sin=torch.zeros(80, 4)), {}, ValueError,
                             r"rotary_cos and rotary_sin must have one shape and dtype"),
    "num-splits-negative": (_set(num_splits=-1), {}, ValueError, r"num_splits must be >= 0 \(0 = chosen from the shapes\), got -1"),
    "num-splits-float": (_set(num_splits=2.0), {}, TypeError, r"num_splits must be a Python int.*got float"),
    "window": (_set(window_size=(-2, 0)), {}, ValueError, r"window_size entries must be -1"),
    "sink-shape": (_set(sink=torch.zeros(2)), {}, ValueError, r"sink must have shape \(nheads,\) = \(4,\)"),
}


@pytest.mark.parametrize("case", BAD_KVCACHE)
def test_bad_kvcache_arguments(case):
    change, layout, error, match = BAD_KVCACHE[case]
    with pytest.raises(error, match=match):
        kv_call(change)(**layout)


def test_refused_kvcache_call_writes_nothing():
    q, k_cache, v_cache, k, v, kwargs = kv_inputs(page_size=16)
    before = k_cache.clone(), v_cache.clone()
    kwargs["cache_seqlens"] = torch.tensor([4, 31], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"31 \+ 3 = 34 exceeds the cache capacity of 32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_kvcache_query_shapes():
    q, k_cache, v_cache, _, _, kwargs = kv_inputs()
    with pytest.raises(ValueError, match=r"q must have batch >= 1 and seqlen_q >= 1, got q \(2, 0, 4, 32\)"):
        flash_attn_with_kvcache(q[:, :0], k_cache, v_cache, **kwargs)
    with pytest.raises(ValueError, match=r"q must have 4 dims"):
        flash_attn_with_kvcache(q[0], k_cache, v_cache, **kwargs)


# ---------------------------------------------------------------- merge_attention_states arguments

BAD_MERGE = {
    "lse-dtype": (dict(lse_b=torch.zeros(2, 4, 3, dtype=torch.float16)), TypeError,
                  r"lse_b must have dtype torch.float32 \(the lse flashtile returns\), got torch.float16"),
    "lse-layout": (dict(lse_a=torch.zeros(2, 3, 4)), ValueError,
                   r"lse_a must have shape \(batch, nheads, seqlen\) = \(2, 4, 3\) to match out_a \(2, 3, 4, 16\), got \(2, 3, 4\)"),
    "out-shapes": (dict(out_b=torch.zeros(2, 3, 4, 8, dtype=torch.float16)), ValueError,
                   r"out_a and out_b must have one shape .* got \(2, 3, 4, 16\) and \(2, 3, 4, 8\)"),
    "out-dtypes": (dict(out_b=torch.zeros(2, 3, 4, 16)), TypeError, r"out_a and out_b must share one dtype"),
    "out-rank": (dict(out_a=torch.zeros(3, 4, 16, dtype=torch.float16)), ValueError, r"out_a must have 4 dims"),
    "lse-list": (dict(lse_a=[0.0]), TypeError, r"lse_a must be a torch.Tensor, got list"),
    "device": (dict(lse_b=torch.zeros(2, 4, 3, device="meta")), ValueError, r"must be on one device.*lse_b=meta"),
}


@pytest.mark.parametrize("case", BAD_MERGE)
def test_bad_merge_arguments(case):
    changes, error, match = BAD_MERGE[case]
    inputs = dict(out_a=torch.zeros(2, 3, 4, 16, dtype=torch.float16), lse_a=torch.zeros(2, 4, 3),
                  out_b=torch.zeros(2, 3, 4, 16, dtype=torch.float16), lse_b=torch.zeros(2, 4, 3))
    inputs.update(changes)
    with pytest.raises(error, match=match):
        merge_attention_states(**inputs)
