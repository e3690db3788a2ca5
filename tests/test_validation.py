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
