"""The Hopper head-dim-128 backward's two dK/dV tiles (``configs.bwd_config``): rows of at least
``LONG_BWD_KEYS`` keys take 64x128 programs of 8 warps; shorter rows, narrow windows, ALiBi, a bias or
dropout take 32x64. The rule is checked for the shapes it names; on the GPU the long-rows tile (forced onto
short, awkward shapes) meets the float64 reference for every feature it serves."""
import pytest
import torch

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.backends.triton import configs
from flashtile.testing import assert_results_close, make_qkv, random_like, reference_results

HOPPER = torch.device("cuda", 0)


@pytest.mark.parametrize("row_keys, features, dtype, headdim, expected", [
    (4096, (), torch.bfloat16, 128, (64, 128, 8)),
    (16384, ("sink", "softcap", "varlen"), torch.float16, 128, (64, 128, 8)),
    (4095, (), torch.bfloat16, 128, (32, 64, 4)),  # short rows
    (1025, ("window",), torch.bfloat16, 128, (32, 64, 4)),  # a window (1024, 0)
    (16384, ("alibi",), torch.bfloat16, 128, (32, 64, 4)),
    (16384, ("bias",), torch.bfloat16, 128, (32, 64, 4)),
    (16384, ("dropout",), torch.bfloat16, 128, (32, 64, 4)),
    (16384, (), torch.bfloat16, 64, (64, 64, 4)),  # other head dims keep their tiles
    (16384, (), torch.float32, 128, (32, 32, 8)),  # float32: 8 warps up to head dim 128 (no spills)
    (16384, (), torch.float32, 256, (16, 32, 4)),
])
def test_tile_rule(monkeypatch, row_keys, features, dtype, headdim, expected):
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    dkdv = configs.bwd_config(headdim, dtype, HOPPER, headdim, row_keys, frozenset(features)).dkdv
    assert (dkdv.BLOCK_M, dkdv.BLOCK_N, dkdv.num_warps) == expected


CASES = {
    "causal_gqa": dict(shape=(2, 203, 203, 8, 2), causal=True),
    "full_rect": dict(shape=(1, 150, 333, 4, 4)),
    "window": dict(shape=(1, 300, 280, 4, 2), window_size=(90, 17)),
    "softcap": dict(shape=(1, 190, 190, 4, 1), causal=True, softcap=15.0),
    "sink": dict(shape=(1, 211, 211, 4, 2), causal=True, sink=True),
    "headdim_v": dict(shape=(1, 177, 177, 4, 2), causal=True, headdim_v=64),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_long_rows_tile_against_reference(rng, monkeypatch, case):
    """bf16 through the API with the long-rows tile forced on every call."""
    monkeypatch.setattr(configs, "LONG_BWD_KEYS", 0)
    options = dict(CASES[case])
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = options.pop("shape")
    headdim_v = options.pop("headdim_v", 128)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, 128, dtype=torch.bfloat16, device="cuda",
                       generator=rng)
    if headdim_v != 128:
        v = torch.randn(*v.shape[:-1], headdim_v, generator=rng).to("cuda", torch.bfloat16).requires_grad_()
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(nheads, generator=rng).to("cuda")
    if options.pop("sink", False):
        options["sink"] = torch.randn(nheads, generator=rng).to("cuda").requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    dout = random_like(out, rng)
    leaves = (q, k, v) + ((options["sink"],) if "sink" in options else ())
    grads = torch.autograd.grad(out, leaves, dout)
    ours = dict(zip(("out", "lse", "dq", "dk", "dv", "dsink"), (out, lse, *grads)))
    refs = [reference_results(q, k, v, dout, hi=hi, **options) for hi in (True, False)]
    assert_results_close(ours, *refs, torch.bfloat16)


@pytest.mark.cuda
def test_long_rows_tile_varlen(rng, monkeypatch):
    """Packed sequences (one empty, NaN rows past the last) on the long-rows tile."""
    monkeypatch.setattr(configs, "LONG_BWD_KEYS", 0)
    cu = torch.tensor([0, 130, 130, 401], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(420, h, 128, generator=rng).to("cuda", torch.bfloat16) for h in (8, 2, 2))
    for t in (q, k, v):
        t[401:] = float("nan")
        t.requires_grad_()
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 271, 271, causal=True, return_attn_probs=True)
    dout = random_like(out, rng)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(g[401:], torch.zeros_like(g[401:])) for g in grads)
    ours = {"out": out[:401], "lse": lse[:, :401], "dq": grads[0][:401], "dk": grads[1][:401], "dv": grads[2][:401]}
    qs, ks, vs = (t.detach()[:401].requires_grad_() for t in (q, k, v))
    refs = [reference_results(qs, ks, vs, dout[:401], hi=hi, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
            for hi in (True, False)]
    assert_results_close(ours, *refs, torch.bfloat16)
