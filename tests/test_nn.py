"""flashtile.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same state_dict, and
flashtile.nn.Attention against the same block written in plain torch ops.

Reference: torch's module in float64 (``ref_hi``) and in the input dtype (``ref_lo``), tolerance rule
of :func:`flashtile.testing.assert_close_to_ref`, on the output and the gradients of the inputs and
of every parameter. Every parameter is drawn at random (torch initializes biases to 0, which would
hide a bias wired to the wrong projection).
"""
import copy
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import dispatch
from flashtile.testing import ATOL, assert_close_to_ref, random_like

EMBED, HEADS, BATCH, SEQLEN_Q, SEQLEN_K = 32, 2, 2, 5, 7


pytestmark = pytest.mark.usefixtures("clean_dispatch_state")


def torch_module(rng, device, **kwargs):
    """A torch MultiheadAttention with every parameter drawn from ``rng``."""
    module = torch.nn.MultiheadAttention(EMBED, HEADS, device=device, **kwargs)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=rng) * 0.3)
    return module


def flashtile_copy(module):
    """flashtile's module built with the same arguments, loaded from ``module``'s state_dict."""
    ours = flashtile.nn.MultiheadAttention(
        module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
        kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first, device=module.out_proj.weight.device,
        dtype=module.out_proj.weight.dtype,
    )
    ours.load_state_dict(module.state_dict())
    return ours


def inputs(rng, device, kind, batch_first, kdim=EMBED, vdim=EMBED):
    """(query, key, value) for ``kind``: "self" (one tensor), "cross" (key is value), "kdim-vdim", "unbatched"."""
    def draw(seqlen, features):
        shape = (BATCH, seqlen, features) if batch_first else (seqlen, BATCH, features)
        shape = shape[1:] if kind == "unbatched" else shape
        return torch.randn(*shape, generator=rng).to(device).requires_grad_()

    if kind == "self":
        x = draw(SEQLEN_Q, EMBED)
        return x, x, x
    if kind == "cross":
        memory = draw(SEQLEN_K, EMBED)
        return draw(SEQLEN_Q, EMBED), memory, memory
    return draw(SEQLEN_Q, EMBED), draw(SEQLEN_K, kdim), draw(SEQLEN_K, vdim)


def run(module, tensors, dout, **kwargs):
    """Output and gradients (inputs by position, parameters by name) of ``module(*tensors, **kwargs)``."""
    out, _ = module(*tensors, **kwargs)
    leaves = list(dict.fromkeys(tensors))  # self-attention passes one tensor three times
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(out, leaves + list(params.values()), dout)
    return out, dict(zip([f"input{i}" for i in range(len(leaves))] + list(params), grads))


def in_dtype(tensors, dtype):
    """Leaf copies in ``dtype``, keeping which positions share one tensor."""
    copies = {}
    for t in tensors:
        copies.setdefault(id(t), t.detach().to(dtype).requires_grad_())
    return tuple(copies[id(t)] for t in tensors)


def check_against_torch(rng, module, tensors, masks=None, **kwargs):
    """flashtile's module (float32) against torch's in float64 and float32, output and every gradient."""
    masks = masks or {}
    ours = flashtile_copy(module)
    dtype = tensors[0].dtype
    dout = random_like(tensors[0], rng)  # the output has the query's shape
    out, grads = run(ours, tensors, dout, **masks, **kwargs)
    refs = []
    for ref_dtype in (torch.float64, dtype):
        reference = copy.deepcopy(module).to(ref_dtype)
        ref_masks = {name: m.to(ref_dtype) if torch.is_floating_point(m) else m for name, m in masks.items()}
        refs.append(run(reference, in_dtype(tensors, ref_dtype), dout.to(ref_dtype), need_weights=False, **ref_masks, **kwargs))
    (hi, hi_grads), (lo, lo_grads) = refs
    atol_out, atol_grad = ATOL[dtype]
    assert_close_to_ref("out", out, hi, lo, atol_out)
    assert set(grads) == set(hi_grads)
    for name in grads:
        assert_close_to_ref(name, grads[name], hi_grads[name], lo_grads[name], atol_grad)
    return out


def flash_calls():
    return sum(n for name, n in flashtile.stats()["calls"].items() if name in dispatch.BACKENDS)


@pytest.mark.parametrize("kind", ["self", "cross", "kdim-vdim", "unbatched"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_matches_torch(backend, device, rng, batch_first, kind):
    dims = dict(kdim=24, vdim=40) if kind == "kdim-vdim" else {}
    module = torch_module(rng, device, batch_first=batch_first, **dims)
    check_against_torch(rng, module, inputs(rng, device, kind, batch_first, **dims))
    assert flashtile.stats()["calls"] == {backend: 1} and flashtile.stats()["fallbacks"] == {}


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_is_causal_hint_runs_flashtile(backend, device, rng, batch_first):
    # As in torch, is_causal=True marks attn_mask as the causal mask: flashtile applies it itself.
    module = torch_module(rng, device, batch_first=batch_first)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(SEQLEN_Q, device=device)
    check_against_torch(rng, module, inputs(rng, device, "self", batch_first), masks={"attn_mask": mask}, is_causal=True)
    assert flashtile.stats()["calls"] == {backend: 1} and flashtile.stats()["fallbacks"] == {}


def test_float16(backend, device, rng):
    module = torch_module(rng, device, batch_first=True).half()
    check_against_torch(rng, module, in_dtype(inputs(rng, device, "cross", True), torch.float16))


def test_no_bias(device, rng):
    module = torch_module(rng, device, bias=False)
    check_against_torch(rng, module, inputs(rng, device, "cross", False))


@pytest.mark.parametrize("dims", [{}, {"kdim": 24, "vdim": 40}], ids=["packed", "kdim-vdim"])
def test_state_dict_loads_both_ways(device, rng, dims):
    theirs = torch_module(rng, device, **dims)
    ours = flashtile_copy(theirs)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    back = torch.nn.MultiheadAttention(EMBED, HEADS, device=device, **dims)
    back.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), theirs.state_dict().values()))


def bool_mask(rng, *shape):
    mask = torch.rand(*shape, generator=rng) < 0.3
    mask[..., 0] = False  # every query keeps at least one key: no all-masked row
    return mask


# name: masks drawn from rng
MASKS = {
    "key_padding_mask": lambda rng: {"key_padding_mask": bool_mask(rng, BATCH, SEQLEN_K)},
    "bool-attn_mask": lambda rng: {"attn_mask": bool_mask(rng, SEQLEN_Q, SEQLEN_K)},
    "float-attn_mask-3d": lambda rng: {"attn_mask": torch.randn(BATCH * HEADS, SEQLEN_Q, SEQLEN_K, generator=rng)},
    "both-bool": lambda rng: {"key_padding_mask": bool_mask(rng, BATCH, SEQLEN_K), "attn_mask": bool_mask(rng, SEQLEN_Q, SEQLEN_K)},
    "both": lambda rng: {"key_padding_mask": torch.randn(BATCH, SEQLEN_K, generator=rng),
                         "attn_mask": torch.randn(SEQLEN_Q, SEQLEN_K, generator=rng)},
}


@pytest.mark.parametrize("case", MASKS)
def test_masks_run_on_flashtile(backend, device, rng, case):
    """key_padding_mask and attn_mask are merged as torch merges them and run by flashtile: no fallback."""
    masks = {name: m.to(device) for name, m in MASKS[case](rng).items()}
    module = torch_module(rng, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check_against_torch(rng, module, inputs(rng, device, "cross", False), masks=masks)
    assert flashtile.stats()["calls"] == {backend: 1} and flashtile.stats()["fallbacks"] == {}


def test_causal_hint_with_padding_mask_uses_the_mask(device, rng):
    # With a key_padding_mask, torch merges it into attn_mask and ignores the hint; so does flashtile.
    module = torch_module(rng, device)
    masks = {"attn_mask": torch.ones(SEQLEN_Q, SEQLEN_Q, dtype=torch.bool, device=device).triu(1),  # True = masked
             "key_padding_mask": torch.tensor([[False] * (SEQLEN_Q - 1) + [True], [False] * SEQLEN_Q], device=device)}
    check_against_torch(rng, module, inputs(rng, device, "self", False), masks=masks, is_causal=True)
    assert flashtile.stats()["fallbacks"] == {}


def test_strict_mode_refuses_need_weights_but_not_masks(device, rng):
    module = flashtile_copy(torch_module(rng, device))
    query, key, value = inputs(rng, device, "self", False)
    flashtile.set_strict(True)
    module(query, key, value, key_padding_mask=torch.zeros(BATCH, SEQLEN_Q, dtype=torch.bool, device=device))
    flashtile.reset_stats()
    with pytest.raises(flashtile.FallbackError, match="need_weights=True"):
        module(query, key, value, need_weights=True)
    assert flashtile.stats()["calls"] == {}


def test_need_weights_runs_torch_and_is_recorded(device, rng):
    theirs = torch_module(rng, device)
    ours = flashtile_copy(theirs)
    query, key, value = inputs(rng, device, "cross", False)
    with pytest.warns(RuntimeWarning, match="need_weights=True"):
        out, weights = ours(query, key, value, need_weights=True, average_attn_weights=False)
    expected_out, expected_weights = theirs(query, key, value, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=0, rtol=0)
    assert weights.shape == (BATCH, HEADS, SEQLEN_Q, SEQLEN_K)
    assert flashtile.stats()["calls"] == {"torch_mha": 1}
    [reason] = flashtile.stats()["fallbacks"]
    assert reason == "MultiheadAttention need_weights=True: flashtile never materializes attention weights"


def test_dropout_in_training_only_runs_on_flashtile(device, rng):
    ours = flashtile_copy(torch_module(rng, device, dropout=0.5))
    query, key, value = inputs(rng, device, "self", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.manual_seed(0)
        dropped = ours(query, key, value)[0]
        torch.manual_seed(0)
        assert torch.equal(dropped, ours(query, key, value)[0])  # flashtile's RNG follows torch.manual_seed
        ours.eval()
        assert not torch.equal(dropped, ours(query, key, value)[0])
    assert flash_calls() == 3 and flashtile.stats()["fallbacks"] == {}


def test_unsupported_options_raise(device):
    with pytest.raises(NotImplementedError, match="add_bias_kv=True"):
        flashtile.nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match="add_zero_attn=True"):
        flashtile.nn.MultiheadAttention(EMBED, HEADS, add_zero_attn=True)
    module = flashtile.nn.MultiheadAttention(EMBED, HEADS, device=device)
    x = torch.randn(SEQLEN_Q, BATCH, EMBED, device=device)
    with pytest.raises(RuntimeError, match="is_causal=True needs attn_mask"):
        module(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=r"query must be 3-d \(as query\) with 32 features, got shape \(5, 2, 16\)"):
        module(x[..., :16], x, x)


def test_drop_in_for_a_transformer_layer(backend, device, rng):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True, device=device)
    x = torch.randn(BATCH, SEQLEN_Q, EMBED, generator=rng).to(device)
    expected = layer(x)
    layer.self_attn = flashtile_copy(layer.self_attn)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert flashtile.stats()["calls"] == {backend: 1}


# flashtile.nn.Attention

def reference_attention(module, x):
    """``module``'s forward in plain torch ops (rotary through complex multiplication, torch's SDPA)."""
    heads, kv_heads, head_dim = module.num_heads, module.num_kv_heads, module.head_dim
    qkv = module.qkv_proj(x).unflatten(-1, (heads + 2 * kv_heads, head_dim))
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    if module.rotary:  # feature i pairs with i + half: one complex number, turned by position * frequency
        half = head_dim // 2
        frequencies = module.rope_theta ** (-2 * torch.arange(half, dtype=x.dtype, device=x.device) / head_dim)
        angles = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)[:, None] * frequencies
        turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # (seqlen, 1, half)
        q, k = (torch.view_as_real(torch.complex(t[..., :half], t[..., half:]) * turn).transpose(-1, -2).flatten(-2)
                for t in (q, k))
    with sdpa_kernel(SDPBackend.MATH):
        out = flashtile.sdpa.TORCH_SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=module.causal,
                                        enable_gqa=True)
    return module.out_proj(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_module_matches_reference(backend, device, rng, causal, rotary):
    module = flashtile.nn.Attention(EMBED, 4, num_kv_heads=2, head_dim=8, bias=True, causal=causal, rotary=rotary, device=device)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=rng) * 0.3)
    x = torch.randn(BATCH, 9, EMBED, generator=rng).to(device).requires_grad_()
    out = module(x)
    dout = random_like(out, rng)
    names = ["x"] + [name for name, _ in module.named_parameters()]
    grads = torch.autograd.grad(out, [x, *module.parameters()], dout)
    refs = []
    for dtype in (torch.float64, torch.float32):
        reference, leaf = copy.deepcopy(module).to(dtype), x.detach().to(dtype).requires_grad_()
        ref_out = reference_attention(reference, leaf)
        refs.append((ref_out, torch.autograd.grad(ref_out, [leaf, *reference.parameters()], dout.to(dtype))))
    (hi, hi_grads), (lo, lo_grads) = refs
    assert_close_to_ref("out", out, hi, lo, ATOL[torch.float32][0])
    for name, ours, ref_hi, ref_lo in zip(names, grads, hi_grads, lo_grads):
        assert_close_to_ref(name, ours, ref_hi, ref_lo, ATOL[torch.float32][1])
    assert flashtile.stats()["calls"] == {backend: 1}


def test_attention_module_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        flashtile.nn.Attention(EMBED, 4, num_kv_heads=3)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_attention_module_decodes_with_a_kv_cache(backend, device, rng, rotary):
    """A prompt, then one token at a time through a KVCache, gives the rows of one full forward (rotary
    positions continue from the cache, a window still applies)."""
    module = flashtile.nn.Attention(EMBED, 4, num_kv_heads=2, head_dim=8, bias=True, causal=True, rotary=rotary,
                                    window_size=(3, 0), device=device)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=rng) * 0.3)
    x = torch.randn(BATCH, 9, EMBED, generator=rng).to(device)
    with torch.no_grad():
        full = module(x)
        cache = flashtile.KVCache(BATCH, max_seqlen=16, nheads_kv=2, headdim=8, dtype=x.dtype, device=device)
        steps = [module(x[:, :5], cache)] + [module(x[:, t:t + 1], cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.seqlens.tolist() == [9] * BATCH


def test_attention_module_cache_needs_causal(device):
    module = flashtile.nn.Attention(EMBED, 4, causal=False, device=device)
    cache = flashtile.KVCache(1, max_seqlen=8, nheads_kv=4, headdim=EMBED // 4, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="needs causal=True"):
        module(torch.randn(1, 2, EMBED, device=device), cache)
