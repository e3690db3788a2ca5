"""Variable-length batches (``flash_attn_varlen_func`` and its packed variants) against the reference run
on every sequence alone (:func:`flashtile.testing.attention_varlen_ref`), with the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref` on out, lse and every gradient.

Batches mix empty sequences (no query, no key, or both), single tokens and lengths that are not
multiples of any tile; the packed tensors have rows past ``cu_seqlens[-1]`` whose gradients must be
exactly 0. :func:`flashtile.unpad_input` / :func:`flashtile.pad_input` are checked against a padded
dense call with the same mask.
"""
import pytest
import torch

import flashtile
from flashtile import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    pad_input,
    unpad_input,
)
from flashtile.rng import draw_seed_offset
from flashtile.testing import assert_results_close, cu_seqlens_of, reference_results

# (lengths of q, lengths of k) per sequence: empty queries, empty keys, both empty, one token,
# seqlen_q > seqlen_k (causal rows that see no key) and the other way round.
LENGTHS = {
    "mixed": ([5, 0, 37, 1, 70, 0], [9, 3, 0, 44, 61, 0]),
    "self": ([33, 1, 0, 90], [33, 1, 0, 90]),
}
EXTRA_ROWS = 3  # rows past cu_seqlens[-1] in every packed tensor


def randn(rng, *shape, device="cpu", dtype=torch.float16, requires_grad=True):
    return torch.randn(*shape, generator=rng).to(device=device, dtype=dtype).requires_grad_(requires_grad)


def packed_inputs(rng, device, lengths_q, lengths_k, nheads=4, nheads_kv=2, headdim=32, headdim_v=None,
                  dtype=torch.float16, extra=EXTRA_ROWS):
    total_q, total_k = sum(lengths_q) + extra, sum(lengths_k) + extra
    q = randn(rng, total_q, nheads, headdim, device=device, dtype=dtype)
    k = randn(rng, total_k, nheads_kv, headdim, device=device, dtype=dtype)
    v = randn(rng, total_k, nheads_kv, headdim_v or headdim, device=device, dtype=dtype)
    return q, k, v, cu_seqlens_of(lengths_q, device), cu_seqlens_of(lengths_k, device)


def run_varlen(q, k, v, cu_q, cu_k, dout, sink=None, **options):
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, sink=sink, **options)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    leaves = {"dq": q, "dk": k, "dv": v, "dsink": sink}
    leaves = {name: t for name, t in leaves.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return {"out": out, "lse": lse, **dict(zip(leaves, grads))}


def check_varlen(q, k, v, cu_q, cu_k, rng, sink=None, seqused_k=None, dropout_seed_offset=None, **options):
    """flashtile against both references; rows past cu_seqlens[-1] are compared only through their
    gradients (0), since the output there belongs to no sequence."""
    dout = randn(rng, *q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype, requires_grad=False)
    ours = run_varlen(q, k, v, cu_q, cu_k, dout, sink=sink, seqused_k=seqused_k, **options)
    ref_options = dict(options, seqused_k=seqused_k, dropout_seed_offset=dropout_seed_offset)
    refs = [reference_results(q, k, v, dout, hi=hi, sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **ref_options)
            for hi in (True, False)]
    end_q, end_k = int(cu_q[-1]), int(cu_k[-1])
    inside = {"out": (slice(0, end_q),), "lse": (slice(None), slice(0, end_q))}
    kept = [{name: t[inside[name]] if name in inside else t for name, t in results.items()} for results in (ours, *refs)]
    assert_results_close(*kept, q.dtype)
    # Tokens that belong to no sequence: gradients exactly 0, never NaN.
    for name, end in (("dq", end_q), ("dk", end_k), ("dv", end_k)):
        rest = ours[name][end:]
        assert torch.equal(rest, torch.zeros_like(rest)), f"{name} of the rows past cu_seqlens[-1] is not 0"
    return ours


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(backend, device, rng, lengths, causal):
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, *LENGTHS[lengths])
    check_varlen(q, k, v, cu_q, cu_k, rng, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_varlen_dtypes(backend, device, rng, dtype):
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, *LENGTHS["mixed"], dtype=dtype)
    check_varlen(q, k, v, cu_q, cu_k, rng, causal=True)


def test_varlen_with_every_feature(backend, device, rng):
    """Window + softcap + per-sequence ALiBi + a learnable sink + GQA + headdim_v, on packed sequences."""
    lengths_q, lengths_k = LENGTHS["mixed"]
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k, headdim=32, headdim_v=48)
    sink = randn(rng, 4, device=device, dtype=torch.float32)
    slopes = (torch.rand(len(lengths_q), 4, generator=rng) * 0.2).to(device)
    check_varlen(q, k, v, cu_q, cu_k, rng, sink=sink, causal=True, window_size=(12, -1), softcap=7.0,
                 alibi_slopes=slopes, softmax_scale=0.2)


@pytest.mark.parametrize("headdim_v", [128, 192])
def test_varlen_head_dim_192(backend, device, rng, bwd_pair_head_dims, headdim_v):
    """The backward pair's 128 + 64-column q/k tiles (launch._BWD_TAILS) on packed sequences with seqused_k (its
    unused keys' dK tail is zeroed too), GQA, a window and softcap."""
    lengths_q, lengths_k = [5, 0, 37, 1, 70], [9, 3, 65, 44, 61]
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k, headdim=192, headdim_v=headdim_v)
    seqused_k = torch.tensor([9, 0, 40, 44, 61], dtype=torch.int32, device=device)
    check_varlen(q, k, v, cu_q, cu_k, rng, seqused_k=seqused_k, causal=True, window_size=(30, -1), softcap=6.0)
    if backend == "triton":
        assert bwd_pair_head_dims and set(bwd_pair_head_dims) == {(128, 64)}, bwd_pair_head_dims


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_seqused_k(backend, device, rng, causal):
    """Sequence b uses only its first seqused_k[b] keys (0 and all of them included)."""
    lengths_q, lengths_k = [7, 20, 1, 30], [40, 25, 8, 30]
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k)
    seqused_k = torch.tensor([13, 0, 8, 29], dtype=torch.int32, device=device)
    check_varlen(q, k, v, cu_q, cu_k, rng, seqused_k=seqused_k, causal=causal)


# Decode steps of a continuous batch, (lengths of q, lengths of k, options): at most 32 query rows per KV head
# (max_seqlen_q x 4 / nheads_kv heads), so the Triton backend runs them on the KV-cache kernel, which reads q
# through cu_seqlens_q and the packed k from cu_seqlens_k[b]. With at most 4 programs (sequences x KV heads)
# and 64+ keys the interpreter splits the keys, so the combine writes the packed rows.
VARLEN_DECODE = {
    "one-query-each-mqa": ([1, 1, 1, 1], [37, 200, 1, 90], dict(causal=True, nheads_kv=1)),
    "empty-sequences": ([1, 0, 1, 1, 0], [0, 64, 130, 5, 0], dict(causal=True)),
    "chunks-longer-than-keys": ([3, 8, 0, 5], [3, 150, 20, 4], dict(causal=True)),
    "window-softcap-mqa": ([2, 1, 4], [100, 260, 33], dict(causal=True, window_size=(40, 2), softcap=6.0,
                                                            nheads_kv=1)),
    "alibi-sink-full-mqa": ([1, 2, 1], [70, 50, 300], dict(alibi=True, sink=True, nheads_kv=1)),
    "headdim-v": ([1, 4], [80, 120], dict(causal=True, headdim_v=48)),
    "seqused-k-mqa": ([1, 2, 1], [60, 90, 140], dict(causal=True, seqused_k=[30, 0, 140], nheads_kv=1)),
}


@pytest.mark.parametrize("case", VARLEN_DECODE.values(), ids=VARLEN_DECODE.keys())
def test_varlen_decode_steps(backend, device, rng, case, no_dense_decode_threshold):
    """out, lse and every gradient of few-query sequences against the reference; on the Triton backend the
    KV-cache kernel runs them (explain names it)."""
    lengths_q, lengths_k, options = case
    options = dict(options)
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k, nheads_kv=options.pop("nheads_kv", 2),
                                        headdim_v=options.pop("headdim_v", None))
    if options.pop("alibi", False):
        options["alibi_slopes"] = (torch.rand(len(lengths_q), 4, generator=rng) * 0.3).to(device)
    if options.pop("sink", False):
        options["sink"] = randn(rng, 4, device=device, dtype=torch.float32)
    if "seqused_k" in options:
        options["seqused_k"] = torch.tensor(options["seqused_k"], dtype=torch.int32, device=device)
    check_varlen(q, k, v, cu_q, cu_k, rng, **options)
    if backend == "triton":
        kernel = flashtile.explain(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                                   max_seqlen_k=max(lengths_k), **options).kernel
        assert kernel.startswith("flashtile.decode[triton") and " varlen" in kernel, kernel


def test_varlen_decode_steps_with_new_offsets(backend, device, rng, no_dense_decode_threshold):
    """Two decode steps of the same shapes whose sequences have other lengths: the second reads its own
    cu_seqlens (on a GPU it reuses the first step's cached launch, which once kept the first call's
    cu_seqlens_q and wrote the second step's rows where the first step's sequences began)."""
    steps = [([2, 1, 0, 1], [37, 200, 1, 90]), ([1, 2, 1, 0], [90, 1, 200, 37]), ([0, 1, 2, 1], [40, 100, 3, 200])]
    for lengths_q, lengths_k in steps:
        q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k, nheads_kv=1)
        with torch.no_grad():
            out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 200, causal=True, return_attn_probs=True)
        dout = torch.zeros_like(out)
        refs = [reference_results(q, k, v, dout, hi=hi, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
                for hi in (True, False)]
        rows = int(cu_q[-1])
        kept = [{"out": r["out"][:rows], "lse": r["lse"][:, :rows]} for r in ({"out": out, "lse": lse}, *refs)]
        assert_results_close(*kept, q.dtype)


def test_varlen_dropout_matches_reference(backend, device, rng):
    """Sequence b draws its mask with batch index b and positions counted from its first token."""
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, [20, 0, 33], [25, 4, 17], dtype=torch.float32)
    torch.manual_seed(11)
    seed_offset = draw_seed_offset()
    torch.manual_seed(11)
    check_varlen(q, k, v, cu_q, cu_k, rng, dropout_p=0.25, dropout_seed_offset=seed_offset, causal=True)


def test_varlen_equals_dense_calls_per_sequence(backend, device, rng):
    """Each sequence of the packed call gives what flash_attn_func gives on that sequence alone."""
    lengths_q, lengths_k = [17, 45, 3], [30, 45, 60]
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k, dtype=torch.float32, extra=0)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 45, 60, causal=True, window_size=(9, -1))
    for b in range(3):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        dense = flash_attn_func(q[None, rows], k[None, keys], v[None, keys], causal=True, window_size=(9, -1))
        torch.testing.assert_close(out[rows], dense[0], atol=1e-5, rtol=1e-5)


def test_max_seqlen_as_int_or_tensor(backend, device, rng):
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, *LENGTHS["mixed"])
    as_int = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 61, causal=True)
    as_tensor = flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(70), torch.tensor(61, dtype=torch.int32),
                                       causal=True)
    end = int(cu_q[-1])
    assert torch.equal(as_int[:end], as_tensor[:end])


def test_varlen_qkvpacked(backend, device, rng):
    lengths = [33, 0, 1, 64]
    total = sum(lengths) + EXTRA_ROWS
    qkv = randn(rng, total, 3, 2, 32, device=device)
    cu = cu_seqlens_of(lengths, device)
    sink = randn(rng, 2, device=device, dtype=torch.float32)
    dout = randn(rng, total, 2, 32, device=device, requires_grad=False)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, 64, causal=True, sink=sink, return_attn_probs=True)
    dqkv, dsink = torch.autograd.grad(out, (qkv, sink), dout)
    assert dqkv.shape == qkv.shape and lse.shape == (2, total)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(1))
    unpacked = run_varlen(q, k, v, cu, cu, dout, sink=sink, causal=True)
    end = int(cu[-1])
    assert torch.equal(out[:end], unpacked["out"][:end]) and torch.equal(dsink, unpacked["dsink"])
    assert torch.equal(dqkv, torch.stack([unpacked[n] for n in ("dq", "dk", "dv")], dim=1))
    check_varlen(q, k, v, cu, cu, rng, sink=sink, causal=True)


@pytest.mark.parametrize("lengths_q", [[5, 40, 0, 1], [1, 1, 0, 1]], ids=["prefill", "decode-step"])
def test_varlen_kvpacked(backend, device, rng, lengths_q, no_dense_decode_threshold):
    """k and v as strided views of one packed tensor; a decode step takes the KV-cache kernel (Triton)."""
    lengths_k = [19, 40, 7, 0]
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, lengths_q, lengths_k, nheads=4, nheads_kv=2)
    kv = torch.stack([k.detach(), v.detach()], dim=1).requires_grad_()
    dout = randn(rng, *q.shape, device=device, requires_grad=False)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lengths_q), 40, causal=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert dkv.shape == kv.shape
    unpacked = run_varlen(q, k, v, cu_q, cu_k, dout, causal=True)
    end = int(cu_q[-1])
    assert torch.equal(out[:end], unpacked["out"][:end]) and torch.equal(dq, unpacked["dq"])
    assert torch.equal(dkv, torch.stack([unpacked["dk"], unpacked["dv"]], dim=1))


# ---------------------------------------------------------------- unpad_input / pad_input


def padding_mask(rng, lengths, seqlen, device):
    return (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).to(device)


def test_unpad_pad_round_trip(device, rng):
    lengths, seqlen = [5, 0, 9, 3], 9
    x = randn(rng, 4, seqlen, 2, 8, device=device, dtype=torch.float32)
    mask = padding_mask(rng, lengths, seqlen, device)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert x_unpad.shape == (sum(lengths), 2, 8) and indices.dtype == torch.int64
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 5, 5, 14, 17]
    assert max_seqlen == 9 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths
    assert torch.equal(x_unpad, x[mask])
    padded = pad_input(x_unpad, indices, 4, seqlen)
    assert torch.equal(padded, x * mask[:, :, None, None])
    # Both directions are differentiable: the gradient of the round trip is the mask.
    (grad,) = torch.autograd.grad(padded.sum(), x)
    assert torch.equal(grad, mask[:, :, None, None].expand_as(x).float())


def test_unpad_with_unused_mask(device, rng):
    """flash-attn's unused_mask: tokens packed and counted in cu_seqlens but not in seqused."""
    x = randn(rng, 2, 6, 4, device=device, dtype=torch.float32, requires_grad=False)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], device=device)
    unused = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]], device=device)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 4, 8] and max_seqlen == 4 and seqused.tolist() == [2, 3]
    assert indices.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unpadded_varlen_equals_padded_dense_with_mask(backend, device, rng, causal):
    """Right-padded self-attention: unpad -> varlen -> pad equals the dense call with a key padding
    mask (bool attn_bias), on the real tokens; gradients agree too and are 0 on the padding."""
    batch, seqlen, nheads = 3, 40, 2
    lengths = [40, 17, 1]
    mask = padding_mask(rng, lengths, seqlen, device)
    q, k, v = (randn(rng, batch, seqlen, nheads, 32, device=device, dtype=torch.float32) for _ in range(3))
    dout = randn(rng, batch, seqlen, nheads, 32, device=device, dtype=torch.float32, requires_grad=False)
    dout = dout * mask[:, :, None, None]  # the loss reads real tokens only
    (q_unpad, indices, cu, max_seqlen, _), k_unpad, v_unpad = unpad_input(q, mask), unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu, cu, max_seqlen, max_seqlen, causal=causal)
    out = pad_input(out_unpad, indices, batch, seqlen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense = flash_attn_func(q, k, v, causal=causal, attn_bias=mask.view(batch, 1, 1, seqlen))
    dense_grads = torch.autograd.grad(dense, (q, k, v), dout)
    real = mask[:, :, None, None]
    torch.testing.assert_close(out, dense * real, atol=1e-5, rtol=1e-5)
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, dense_grads):
        torch.testing.assert_close(ours, theirs * real, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(ours * ~real, torch.zeros_like(ours)), f"{name} is not 0 on the padding"


def test_explain_varlen(device, rng):
    q, k, v, cu_q, cu_k = packed_inputs(rng, device, *LENGTHS["mixed"])
    report = flashtile.explain(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=70,
                               max_seqlen_k=61)
    assert report.error is None and report.backend is not None, str(report)
    bad = flashtile.explain(q, k, v, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k, max_seqlen_q=70, max_seqlen_k=61)
    assert bad.backend is None and "cu_seqlens_q must have dtype torch.int32" in bad.error
