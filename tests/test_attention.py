"""Forward output, lse and all gradients against the float64 reference (float32 on CUDA for 16-bit
inputs), with the tolerance rule of :func:`flashtile.testing.assert_close_to_ref`:
``max|ours - ref| <= 2 * max|ref in input dtype - ref| + atol``.

The grid is chosen for awkward shapes rather than breadth: lengths that are not multiples of any
tile (113, 203, 239), a single query or key (decode, and a causal mask hiding almost every row),
seqlen_q > seqlen_k (causal rows that see no key), head dims that are not powers of two.
Under Triton's interpreter the tiles are small (32/16), so these lengths span several blocks.
"""
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashtile.testing import ATOL, assert_close_to_ref, attention_ref, causal_lower_right_mask, make_qkv, random_like

HAS_CUDA = torch.cuda.is_available()


# (64, 75) and (96, 80): seqlen_q a multiple of every query tile while seqlen_k is not a multiple of
# the key tile, so a causal key block's query range runs past seqlen_q on the "even" (unmasked-rows) path.
SEQLENS = [(1, 1), (3, 3), (113, 203), (239, 1), (1, 239), (128, 128), (200, 64), (64, 75), (96, 80)]
SEQLENS_CUDA = [(1023, 1024), (1024, 1023), (1024, 1000), (2048, 2048), (1, 2048), (2048, 1), (4096, 4096)]
DTYPES_16 = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16]
HEADDIMS = [8, 40, 64, 72, 96, 128, 160, 192, 256]


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def seqlen_id(pair):
    return f"{pair[0]}x{pair[1]}"


def run_flash(q, k, v, dout, **kwargs):
    """flashtile's out, lse and (dq, dk, dv) for upstream gradient ``dout``."""
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert probs is None
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def run_ref(q, k, v, dout, causal=False, softmax_scale=None, hi=True):
    """The reference's out, lse and gradients: ``hi`` in float64 (float32 on CUDA for 16-bit
    inputs), else in the input dtype."""
    dtype = q.dtype
    if hi:
        dtype = torch.float64 if (q.device.type == "cpu" or q.dtype == torch.float32) else torch.float32
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, causal=causal, softmax_scale=softmax_scale, upcast=False)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def check_attention(q, k, v, rng, causal=False, softmax_scale=None, dout=None, **kwargs):
    """Run flashtile and both references on the same inputs and apply the tolerance rule to
    out, lse, dq, dk and dv. Returns flashtile's results."""
    if dout is None:
        dout = random_like(q, rng)
    ours = run_flash(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, **kwargs)
    compare(ours, q, k, v, dout, causal, softmax_scale)
    return ours


def compare(ours, q, k, v, dout, causal=False, softmax_scale=None):
    ref_hi = run_ref(q, k, v, dout, causal, softmax_scale, hi=True)
    ref_lo = run_ref(q, k, v, dout, causal, softmax_scale, hi=False)
    atol_out, atol_grad = ATOL[q.dtype]
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close_to_ref(name, ours[name], ref_hi[name], ref_lo[name], atol_out if name in ("out", "lse") else atol_grad)


def lengths(pairs, cuda_pairs=()):
    """Parametrize (seqlen_q, seqlen_k) over ``pairs``, plus ``cuda_pairs`` that only a GPU runs."""
    params = [pytest.param(*p, id=seqlen_id(p)) for p in pairs]
    params += [pytest.param(*p, id=seqlen_id(p), marks=pytest.mark.cuda) for p in cuda_pairs]
    return pytest.mark.parametrize("seqlen_q, seqlen_k", params)


@lengths(SEQLENS, SEQLENS_CUDA)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [40, 64])
@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
def test_seqlen_grid(backend, device, rng, dtype, headdim, causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 2, 2, headdim, dtype, device, generator=rng)
    check_attention(q, k, v, rng, causal=causal)


@lengths([(3, 3), (113, 203), (239, 1), (200, 64), (64, 75)], [(1023, 1024), (2048, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads, nheads_kv", [(6, 2), (4, 1)], ids=["gqa6-2", "mqa4-1"])
@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
def test_gqa_mqa(backend, device, rng, dtype, nheads, nheads_kv, causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, nheads, nheads_kv, 64, dtype, device, generator=rng)
    check_attention(q, k, v, rng, causal=causal)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal",
    [(97, 145, False), (97, 145, True), (64, 100, True)],
    ids=["97x145-full", "97x145-causal", "64x100-causal"],
)
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
def test_headdim_sweep(backend, device, rng, dtype, headdim, seqlen_q, seqlen_k, causal):
    # Every head dim, padded or not, through ragged tiles (97x145) and through the path where
    # seqlen_q is a multiple of the query tile (64x100); GQA with two query heads per KV head.
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, headdim, dtype, device, generator=rng)
    check_attention(q, k, v, rng, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
def test_headdim_sweep_long(backend, device, rng, dtype, causal, headdim):
    q, k, v = make_qkv(2, 1000, 1537, 4, 2, headdim, dtype, device, generator=rng)
    check_attention(q, k, v, rng, causal=causal)


@lengths([(3, 3), (113, 203), (239, 1), (1, 239)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_at_fp32_precision(backend, device, rng, causal, seqlen_q, seqlen_k):
    # The input-dtype reference is float32 itself, so the bound is about 2 ulp-level errors + 1e-5:
    # a kernel that rounds through tf32 or 16 bits anywhere fails here.
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 4, 2, 72, torch.float32, device, generator=rng)
    check_attention(q, k, v, rng, causal=causal)


@pytest.mark.parametrize("headdim", [8, 256])
def test_fp32_headdim_extremes(backend, device, rng, headdim):
    q, k, v = make_qkv(1, 57, 77, 2, 2, headdim, torch.float32, device, generator=rng)
    check_attention(q, k, v, rng, causal=True)


@lengths([(113, 203), (200, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=dtype_id)
def test_bf16(backend, device, rng, dtype, seqlen_q, seqlen_k):
    # Skipped for Triton's interpreter (conftest); runs on the torch backend and on GPU.
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype, device, generator=rng)
    check_attention(q, k, v, rng, causal=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_batch_entries_are_independent(backend, device, rng, batch):
    """Each batch entry computed alone equals its slice of the batched call (batch strides)."""
    q, k, v = make_qkv(batch, 45, 70, 4, 2, 32, torch.float16, device, generator=rng)
    ours = check_attention(q, k, v, rng, causal=True)
    for b in range(batch):
        single = flash_attn_func(q[b : b + 1], k[b : b + 1], v[b : b + 1], causal=True)
        torch.testing.assert_close(single, ours["out"][b : b + 1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("softmax_scale", [0.05, 0.5, 2.0])
def test_custom_softmax_scale(backend, device, rng, softmax_scale):
    q, k, v = make_qkv(2, 77, 130, 2, 1, 48, torch.float16, device, generator=rng)
    check_attention(q, k, v, rng, causal=softmax_scale > 0.1, softmax_scale=softmax_scale)


def test_default_softmax_scale_is_inverse_sqrt_headdim(backend, device, rng):
    q, k, v = make_qkv(1, 33, 50, 2, 2, 40, torch.float16, device, requires_grad=False, generator=rng)
    default = flash_attn_func(q, k, v)
    explicit = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(40))
    assert torch.equal(default, explicit)
    # And the scale matters: a different one gives a visibly different output.
    assert (flash_attn_func(q, k, v, softmax_scale=1.0) - default).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked(backend, device, rng, causal):
    qkv = make_qkv(1, 113, 113, 3, 3, 64, torch.float16, device, packed="qkv", generator=rng)
    dout = random_like(qkv[:, :, 0], rng)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    compare({"out": out, "lse": lse, "dq": dqkv[:, :, 0], "dk": dqkv[:, :, 1], "dv": dqkv[:, :, 2]}, q, k, v, dout, causal)
    # Same numbers as the unpacked call on contiguous copies.
    unpacked = run_flash(q, k, v, dout, causal=causal)
    torch.testing.assert_close(out, unpacked["out"], atol=0, rtol=0)
    torch.testing.assert_close(dqkv, torch.stack([unpacked[n] for n in ("dq", "dk", "dv")], dim=2), atol=0, rtol=0)


@lengths([(113, 203), (239, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked(backend, device, rng, causal, seqlen_q, seqlen_k):
    q, kv = make_qkv(1, seqlen_q, seqlen_k, 6, 2, 40, torch.float16, device, packed="kv", generator=rng)
    dout = random_like(q, rng)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, causal=causal, return_attn_probs=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert dkv.shape == kv.shape
    k, v = (t.detach().clone() for t in kv.unbind(2))
    compare({"out": out, "lse": lse, "dq": dq, "dk": dkv[:, :, 0], "dv": dkv[:, :, 1]}, q, k, v, dout, causal)
    unpacked = run_flash(q, k.requires_grad_(), v.requires_grad_(), dout, causal=causal)
    torch.testing.assert_close(out, unpacked["out"], atol=0, rtol=0)
    torch.testing.assert_close(dq, unpacked["dq"], atol=0, rtol=0)
    torch.testing.assert_close(dkv, torch.stack([unpacked["dk"], unpacked["dv"]], dim=2), atol=0, rtol=0)


def test_views_of_packed_qkv(backend, device, rng):
    """Non-contiguous q, k, v (strided views of one packed tensor) through flash_attn_func;
    the gradients land in the packed tensor."""
    qkv = make_qkv(2, 70, 70, 4, 4, 64, torch.float16, device, packed="qkv", generator=rng)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = random_like(q, rng)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out.backward(dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    grads = qkv.grad.unbind(2)
    compare({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}, *leaves, dout, causal=True)


@pytest.mark.parametrize("layout", ["bhsd_transposed", "headdim_slice", "headdim_stride2"])
def test_strided_inputs(backend, device, rng, layout):
    """Inputs whose memory layout is not (batch, seqlen, nheads, headdim) contiguous."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = 2, 61, 90, 4, 2, 40

    def view(seqlen, heads):
        if layout == "bhsd_transposed":
            base = make_qkv(batch, heads, heads, seqlen, seqlen, headdim, torch.float16, device, generator=rng)[0]
            return base.transpose(1, 2)  # stored (batch, nheads, seqlen, headdim)
        if layout == "headdim_slice":
            base = make_qkv(batch, seqlen, seqlen, heads, heads, headdim + 24, torch.float16, device, generator=rng)[0]
            return base[..., 8 : 8 + headdim]  # row strides larger than headdim, offset start
        base = make_qkv(batch, seqlen, seqlen, heads, heads, 2 * headdim, torch.float16, device, generator=rng)[0]
        return base[..., ::2]  # headdim stride 2

    q, k, v = view(seqlen_q, nheads), view(seqlen_k, nheads_kv), view(seqlen_k, nheads_kv)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    dout = random_like(q, rng)
    ours = run_flash(q, k, v, dout, causal=True)
    compare(ours, q, k, v, dout, causal=True)


@pytest.mark.parametrize("loss", ["sum", "broadcast_seqlen", "transposed"])
def test_strided_upstream_gradient(backend, device, rng, loss):
    """dout with stride 0 (``out.sum()`` gives a fully expanded gradient) or a transposed layout."""
    q, k, v = make_qkv(2, 75, 40, 2, 2, 32, torch.float16, device, generator=rng)
    if loss == "sum":
        dout = torch.ones((), dtype=q.dtype, device=device).expand(q.shape)
    elif loss == "broadcast_seqlen":
        dout = random_like(q[:, :1], rng).expand(q.shape)
    else:
        dout = random_like(q.transpose(1, 2), rng).transpose(1, 2)
    check_attention(q, k, v, rng, causal=False, dout=dout)


@pytest.mark.parametrize("deterministic", [True, False])
def test_repeat_is_bit_identical(backend, device, rng, deterministic):
    """Run forward and backward twice on the same inputs: every output equal bit for bit. GQA makes
    several query heads feed one dK/dV, where a kernel using atomics would race. The backends
    document that the backward is deterministic whatever the flag says, so both values are held to it."""
    seqlen_q, seqlen_k = (1500, 1300) if HAS_CUDA else (130, 111)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 6, 2, 64, torch.float16, device, generator=rng)
    dout = random_like(q, rng)
    first = run_flash(q, k, v, dout, causal=True, deterministic=deterministic)
    for _ in range(3 if HAS_CUDA else 1):
        again = run_flash(q, k, v, dout, causal=True, deterministic=deterministic)
        for name in first:
            assert torch.equal(first[name], again[name]), f"{name} differs between two identical runs"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_large_logits(backend, device, rng, dtype):
    """q x 30 puts logits around +-100: exp of them overflows fp32 (and fp16 long before), so only an
    online softmax that subtracts the running max stays finite. (Much larger logits are not tested:
    there one ulp of a logit already moves the softmax more than the tolerance.)

    At these logits a float32 gradient sits near that floor: one ulp of a logit |s| moves each probability
    by |s| * 2^-23 relative, so two computations in float32 that only add in another order differ by a few
    such ulps (the float32 reference's own error here, 3e-4 on gradients of 33, is one or two; ours ran 4 on
    an AMD EPYC host with the bound at 3). The gradients' bound gets 4 logit ulps of slack; out and lse keep
    the rule."""
    q, k, v = make_qkv(2, 113, 203, 2, 2, 64, dtype, device, requires_grad=False, generator=rng)
    q = (q * 30).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    dout = random_like(q, rng)
    ours = run_flash(q, k, v, dout, causal=True)
    ref_hi = run_ref(q, k, v, dout, True, hi=True)
    ref_lo = run_ref(q, k, v, dout, True, hi=False)
    atol_out, atol_grad = ATOL[dtype]
    logit = float(torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), k.detach().double()).abs().max())
    logit *= q.shape[-1] ** -0.5
    for name in ("out", "lse", "dq", "dk", "dv"):
        atol = atol_out
        if name not in ("out", "lse"):
            floor = 4 * logit * torch.finfo(dtype).eps * float(ref_hi[name].abs().max())
            atol = atol_grad + (floor if dtype == torch.float32 else 0.0)
        assert_close_to_ref(name, ours[name], ref_hi[name], ref_lo[name], atol)
    assert torch.isfinite(ours["lse"]).all() and ours["lse"].max() > 89  # > log(fp32 max)


@lengths([(239, 64), (5, 2), (200, 1)])
def test_rows_that_see_no_key(backend, device, rng, seqlen_q, seqlen_k):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see no key. Their
    output is exactly 0, their lse exactly -inf, their dq exactly 0; nothing is NaN."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, torch.float16, device, generator=rng)
    ours = check_attention(q, k, v, rng, causal=True)
    hidden = seqlen_q - seqlen_k
    assert not causal_lower_right_mask(seqlen_q, seqlen_k)[hidden - 1].any()
    assert causal_lower_right_mask(seqlen_q, seqlen_k)[hidden].any()
    assert torch.equal(ours["out"][:, :hidden], torch.zeros_like(ours["out"][:, :hidden]))
    assert (ours["lse"][:, :, :hidden] == float("-inf")).all()
    assert torch.isfinite(ours["lse"][:, :, hidden:]).all()
    assert torch.equal(ours["dq"][:, :hidden], torch.zeros_like(ours["dq"][:, :hidden]))
    assert (ours["out"][:, hidden:] != 0).any(dim=-1).all()
    for name in ("dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all()


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 5), (5, 0), (0, 0)], ids=["q0", "k0", "both0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_sequences(backend, device, rng, causal, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 16, torch.float16, device, generator=rng)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, seqlen_q)
    # No key at all: every query outputs 0 with lse -inf.
    assert torch.equal(out, torch.zeros_like(out))
    assert (lse == float("-inf")).all()
    out.backward(random_like(out, rng))
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
        assert torch.equal(t.grad, torch.zeros_like(t)), "nothing attends, so every gradient is 0"


@pytest.mark.parametrize("packed", ["qkv", "kv"])
def test_packed_empty(backend, device, rng, packed):
    if packed == "qkv":
        qkv = make_qkv(1, 0, 0, 2, 2, 16, torch.float16, device, packed="qkv", generator=rng)
        out = flash_attn_qkvpacked_func(qkv)
        out.sum().backward()
        assert out.shape == (1, 0, 2, 16) and qkv.grad.shape == qkv.shape
    else:
        q, kv = make_qkv(1, 3, 0, 2, 2, 16, torch.float16, device, packed="kv", generator=rng)
        out = flash_attn_kvpacked_func(q, kv)
        out.sum().backward()
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(q.grad, torch.zeros_like(q))


def test_torch_backend_multi_block(device, rng):
    """Lengths past the torch backend's tiles (256 query rows, 512 keys), GQA folding query heads
    into rows, causal chunk skipping. Cheap for the torch backend; the interpreter sees several
    blocks at the shorter lengths above."""
    from flashtile.dispatch import force_backend

    for seqlen_q, seqlen_k, causal in [(600, 1100, True), (1100, 600, True), (513, 1025, False)]:
        q, k, v = make_qkv(1, seqlen_q, seqlen_k, 3, 1, 40, torch.float16 if device == "cuda" else torch.float32, device, generator=rng)
        with force_backend("torch"):
            check_attention(q, k, v, rng, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_more_batch_heads_than_a_grid_axis_holds(backend, device, rng, causal):
    """batch x nheads = 70400 programs along one launch axis, past CUDA's 65535 for grid y and z."""
    q, k, v = make_qkv(1100, 5, 7, 64, 64, 32, torch.float16, device, generator=rng)
    check_attention(q, k, v, rng, causal=causal)


def offsets_past_int32():
    """K/V with more than 2**31 elements: key offset x row stride overflows 32-bit index math.
    dK/dV are compared on their first and last keys only, to keep the references' memory in bounds."""
    rng = torch.Generator().manual_seed(0)
    seqlen_k, nheads, headdim = 2**19 + 1000, 32, 128
    past = seqlen_k - 2**31 // (nheads * headdim)  # the last keys start beyond element 2**31
    q, k, v = make_qkv(1, 3, seqlen_k, nheads, nheads, headdim, torch.float16, "cuda", generator=rng)
    dout = random_like(q, rng)
    ours = run_flash(q, k, v, dout)
    keys = torch.cat([torch.arange(64), torch.arange(seqlen_k - past, seqlen_k)]).cuda()

    def kept(results):
        return {name: t.index_select(1, keys) if name in ("dk", "dv") else t for name, t in results.items()}

    ref_hi = kept(run_ref(q, k, v, dout, hi=True))
    ref_lo = kept(run_ref(q, k, v, dout, hi=False))
    atol_out, atol_grad = ATOL[q.dtype]
    for name, ours_t in kept(ours).items():
        assert_close_to_ref(name, ours_t, ref_hi[name], ref_lo[name], atol_out if name in ("out", "lse") else atol_grad)


@pytest.mark.cuda
def test_offsets_past_int32(backend):
    # In a child process: an illegal memory access would poison this process's CUDA context and fail every later test.
    code = "import test_attention; test_attention.offsets_past_int32()"
    tests_dir = pathlib.Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", code], cwd=tests_dir, env=env, capture_output=True, text=True)
    assert child.returncode == 0, f"child exited with {child.returncode}:\n{child.stderr[-3000:]}"
