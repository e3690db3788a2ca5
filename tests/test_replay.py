"""Replays (flashtile/replay.py): a call like an earlier one runs as that call's recorded launches.

Each replayed call is compared, bit for bit, with the same call made on copies of its inputs through
the ordinary path (validation, dispatch, launchers), which the rest of the suite holds to the
reference. The test suite checks index values on the host (``FLASHTILE_VALIDATE_VALUES=1``; always for
CPU tensors), which keeps calls from being keyed at all: the ``unchecked`` fixture turns that off, as
it is by default on a GPU. Every case draws new values for each step, index tensors (cache lengths,
block tables) included, so a replay that kept any of the first call's tensors would fail.
"""
import pytest
import torch

import flashtile
from flashtile import dispatch, interface, replay, testing, validation
from flashtile.backends.triton import configs, launch
from flashtile.interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                 flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                 flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.float16


@pytest.fixture
def unchecked(monkeypatch):
    """Index values are not read on the host, as for CUDA tensors by default: repeated calls are keyed."""
    monkeypatch.delenv("FLASHTILE_VALIDATE_VALUES", raising=False)
    monkeypatch.delenv("FLASHTILE_VALIDATE_VARLEN", raising=False)
    if DEVICE == "cpu":
        monkeypatch.setattr(validation, "values_checked", lambda device: False)


def ordinary(function, *args, **kwargs):
    """``function`` through the ordinary path: a call without a key is validated and dispatched afresh,
    and never recorded or replayed."""
    keys = interface._signature, interface._kvcache_signature
    interface._signature = interface._kvcache_signature = lambda *a: None
    try:
        return function(*args, **kwargs)
    finally:
        interface._signature, interface._kvcache_signature = keys


def randn(rng, *shape, dtype=DTYPE):
    return torch.randn(*shape, generator=rng).to(device=DEVICE, dtype=dtype)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _kvcache_case(rng, *, batch=2, seqlen_q=1, seqlen_new=1, nheads=4, nheads_kv=2, headdim=32, headdim_v=None,
                  capacity=80, page_size=0, leftpad=False, batch_idx=False, rotary=False, alibi=False, sink=False,
                  **options):
    """Positional tensors and keyword arguments of one KV-cache step, with new values (and lengths) each call."""
    headdim_v = headdim_v or headdim
    q = randn(rng, batch, seqlen_q, nheads, headdim)
    k = randn(rng, batch, seqlen_new, nheads_kv, headdim) if seqlen_new else None
    v = randn(rng, batch, seqlen_new, nheads_kv, headdim_v) if seqlen_new else None
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=rng).tolist()
    kwargs = dict(options, cache_seqlens=int32(lengths))
    if page_size:
        pages = -(-capacity // page_size)
        k_cache = randn(rng, batch * pages + 3, page_size, nheads_kv, headdim)
        v_cache = randn(rng, batch * pages + 3, page_size, nheads_kv, headdim_v)
        kwargs["block_table"] = torch.randperm(batch * pages + 3, generator=rng)[:batch * pages].view(batch, pages).to(
            device=DEVICE, dtype=torch.int32)
    else:
        rows = batch + 1 if batch_idx else batch
        k_cache = randn(rng, rows, capacity, nheads_kv, headdim)
        v_cache = randn(rng, rows, capacity, nheads_kv, headdim_v)
    if leftpad:
        kwargs["cache_leftpad"] = int32([torch.randint(0, n + 1, (1,), generator=rng).item() for n in lengths])
    if batch_idx:
        kwargs["cache_batch_idx"] = torch.randperm(batch + 1, generator=rng)[:batch].to(device=DEVICE,
                                                                                         dtype=torch.int32)
    if rotary:
        kwargs["rotary_cos"] = randn(rng, capacity, headdim // 4, dtype=torch.float32)
        kwargs["rotary_sin"] = randn(rng, capacity, headdim // 4, dtype=torch.float32)
    if alibi:
        kwargs["alibi_slopes"] = torch.rand(nheads, generator=rng).to(DEVICE)
    if sink:
        kwargs["sink"] = randn(rng, nheads, dtype=torch.float32)
    return (q, k_cache, v_cache, k, v), kwargs


def _copies(tensors, kwargs):
    clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(map(clone, tensors)), {name: clone(value) for name, value in kwargs.items()}


KVCACHE_CASES = {
    "decode": dict(seqlen_new=0, causal=True),
    "append": dict(causal=True),
    "append_chunk": dict(seqlen_q=3, seqlen_new=3, causal=True, return_softmax_lse=True),
    "gqa_splits": dict(nheads=6, nheads_kv=2, num_splits=3, causal=True, return_softmax_lse=True),
    "no_split": dict(num_splits=1),
    "paged": dict(page_size=16, causal=True),
    "paged_odd_pages": dict(page_size=7, seqlen_new=2, seqlen_q=2, causal=True),
    "leftpad_batch_idx": dict(leftpad=True, batch_idx=True, causal=True),
    "rotary": dict(rotary=True, rotary_interleaved=False, causal=True),
    "alibi_sink_softcap": dict(alibi=True, sink=True, softcap=20.0, causal=True),
    "window": dict(window_size=(24, 0), causal=True),
    "headdim_v": dict(headdim=32, headdim_v=16, causal=True),
}


@pytest.mark.parametrize("case", KVCACHE_CASES)
def test_kvcache_steps_replay(rng, unchecked, served, case):
    """Steps after the first are replayed, and each equals the ordinary call on copies of its inputs,
    out, lse and the caches after the append."""
    for step in range(3):
        tensors, kwargs = _kvcache_case(rng, **KVCACHE_CASES[case])
        expected_tensors, expected_kwargs = _copies(tensors, kwargs)
        got = flash_attn_with_kvcache(*tensors, **kwargs)
        expected = ordinary(flash_attn_with_kvcache, *expected_tensors, **expected_kwargs)
        assert len(served) == step, f"step {step}: {len(served)} replayed calls"
        for name, ours, theirs in zip(("out", "lse"), *(x if isinstance(x, tuple) else (x,) for x in (got, expected))):
            assert torch.equal(ours, theirs), f"step {step}: {name} differs from the ordinary call"
        for name, ours, theirs in zip(("k_cache", "v_cache"), tensors[1:3], expected_tensors[1:3]):
            assert torch.equal(ours, theirs), f"step {step}: {name} differs after the append"


@pytest.mark.parametrize("shape", [(2, 37, 70, 4, 4), (1, 1, 75, 8, 2), (3, 2, 33, 6, 3)],
                         ids=["dense", "decode", "decode_rows"])
def test_attention_calls_replay(rng, unchecked, served, shape):
    """Repeated no-grad flash_attn_func calls: dense rows on the forward kernel, and decode-shaped calls on
    the KV-cache kernel; with the ordinary path's outputs."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    for step in range(3):
        q = randn(rng, batch, seqlen_q, nheads, 32)
        k, v = (randn(rng, batch, seqlen_k, nheads_kv, 32) for _ in range(2))
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        expected, expected_lse, _ = ordinary(flash_attn_func, q.clone(), k.clone(), v.clone(), causal=True,
                                             return_attn_probs=True)
        assert len(served) == step
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def test_growing_cache_records_each_length(rng, unchecked, served):
    """A cache grown by a token between steps (transformers' DynamicCache: new strides and key count) is
    recorded again at each length, and the calls of one length (the other layers) replay it."""
    base_k, base_v = (randn(rng, 2 * 90 * 2 * 32) for _ in range(2))
    q = randn(rng, 2, 1, 4, 32)
    for length in (70, 71, 72):
        # (batch, nheads_kv, length, headdim) storage, seen as (batch, length, nheads_kv, headdim).
        k, v = (base.as_strided((2, 2, length, 32), (2 * length * 32, length * 32, 32, 1)).transpose(1, 2)
                for base in (base_k, base_v))
        before = len(served)
        for layer in range(3):
            out = flash_attn_func(q, k, v, causal=True)
            assert torch.equal(out, ordinary(flash_attn_func, q, k, v, causal=True))
        assert len(served) - before == 2, f"length {length}: the second and third calls replay"


def test_length_changing_every_call_is_recorded_every_other_call(rng, unchecked, monkeypatch):
    """A key count that changes on every call: a recording that served no call is not followed by another
    at the next count, and the one after is recorded again; every call is right."""
    recorded = []
    record = replay.record
    monkeypatch.setattr(replay, "record", lambda run, inputs, replays, *counters: (
        recorded.append(replays is not None), record(run, inputs, replays, *counters))[1])
    q = randn(rng, 1, 1, 4, 32)
    for length in range(60, 66):
        k, v = randn(rng, 1, length, 2, 32), randn(rng, 1, length, 2, 32)
        assert torch.equal(flash_attn_func(q, k, v, causal=True), ordinary(flash_attn_func, q, k, v, causal=True))
    assert recorded == [True, False, True, False, True, False]


def test_packed_inputs_replay_as_views(rng, unchecked, served):
    """q, k and v as views of one packed tensor: the launches' tensors are views of the one input."""
    for step in range(2):
        qkv = randn(rng, 2, 41, 3, 4, 32)
        out = flash_attn_qkvpacked_func(qkv, causal=True)
        assert torch.equal(out, ordinary(flash_attn_qkvpacked_func, qkv.clone(), causal=True))
    assert len(served) == 1


def test_alignment_change_is_not_replayed(rng, unchecked, served):
    """An input that starts off a 16-byte boundary (Triton specializes on it) is run and recorded anew."""
    flat = randn(rng, 2 * 40 * 4 * 32 + 1)
    aligned = flat[:-1].view(2, 40, 4, 32)
    shifted = flat[1:].view(2, 40, 4, 32)
    k, v = randn(rng, 2, 40, 4, 32), randn(rng, 2, 40, 4, 32)
    flash_attn_func(aligned, k, v)
    out = flash_attn_func(shifted, k, v)
    assert not served
    assert torch.equal(out, ordinary(flash_attn_func, shifted.clone(), k, v))
    flash_attn_func(shifted, k, v)
    assert len(served) == 1


def test_same_tensor_twice_is_not_replayed(rng, unchecked, served):
    """k passed as v too: a replay could not tell which input a later call's launch should read."""
    q = randn(rng, 1, 20, 2, 32)
    kv = randn(rng, 1, 20, 2, 32)
    flash_attn_func(q, kv, kv)
    k, v = randn(rng, 1, 20, 2, 32), randn(rng, 1, 20, 2, 32)
    out = flash_attn_func(q, k, v)
    assert not served
    assert torch.equal(out, ordinary(flash_attn_func, q, k, v))


def test_copied_input_is_not_replayed(rng, unchecked, served):
    """q with a strided head dim is copied on the way to the kernel: not an input, not replayable."""
    for _ in range(2):
        q = randn(rng, 1, 20, 2, 64)[..., ::2]
        k, v = randn(rng, 1, 20, 2, 32), randn(rng, 1, 20, 2, 32)
        out = flash_attn_func(q, k, v)
        assert torch.equal(out, ordinary(flash_attn_func, q, k, v))
    assert not served


def _training_step(function, inputs, dout, **kwargs):
    """``(out, *gradients of inputs)`` of one call of ``function``, ``dout`` the output's gradient."""
    out = function(*inputs, **kwargs)
    return (out, *torch.autograd.grad(out, inputs, dout))


TRAINING_CASES = {
    "gqa_causal": (flash_attn_func, ((2, 45, 4, 32), (2, 45, 2, 32), (2, 45, 2, 32)), dict(causal=True)),
    # transformers' layout: (batch, nheads, seqlen, headdim) tensors seen transposed; the gradients keep it.
    "transposed": (flash_attn_func, ((2, 4, 45, 32), (2, 2, 45, 32), (2, 2, 45, 32)), dict(causal=True)),
    "rect_window_dv": (flash_attn_func, ((1, 37, 2, 32), (1, 70, 2, 32), (1, 70, 2, 16)),
                       dict(window_size=(20, 5))),
    "softcap_scale": (flash_attn_func, ((2, 33, 3, 32), (2, 33, 1, 32), (2, 33, 1, 32)),
                      dict(softcap=10.0, softmax_scale=0.3)),
    "qkvpacked": (flash_attn_qkvpacked_func, ((2, 41, 3, 2, 32),), dict(causal=True)),
    "kvpacked": (flash_attn_kvpacked_func, ((1, 30, 4, 32), (1, 50, 2, 2, 32)), dict()),
}


@pytest.mark.parametrize("case", TRAINING_CASES)
def test_training_steps_replay(rng, unchecked, served, case):
    """Steps after the first replay both the forward and the backward; out and every gradient equal the
    ordinary path's on copies of the step's inputs."""
    function, shapes, kwargs = TRAINING_CASES[case]
    for step in range(3):
        inputs = tuple(randn(rng, *shape).requires_grad_() for shape in shapes)
        if case == "transposed":
            inputs = tuple(t.detach().transpose(1, 2).requires_grad_() for t in inputs)
        dout = randn(rng, *ordinary(function, *(t.detach() for t in inputs), **kwargs).shape)
        before = len(served)
        got = _training_step(function, inputs, dout, **kwargs)
        assert len(served) - before == (2 if step else 0), f"step {step}: forward and backward replayed"
        copies = tuple(t.detach().clone().requires_grad_() for t in inputs)
        expected = ordinary(_training_step, function, copies, dout.clone(), **kwargs)
        for name, ours, theirs in zip(("out", *(f"grad {i}" for i in range(len(inputs)))), got, expected):
            assert torch.equal(ours, theirs), f"step {step}: {name} differs from the ordinary call"


BIAS_CASES = {
    "alibi_heads": dict(alibi=(4,), causal=True),
    "alibi_batch_heads_window": dict(alibi=(2, 4), window_size=(9, 3)),
    "bias_broadcast": dict(bias=(1, 4, 1, 45)),
    "bias_full_softcap": dict(bias=(2, 4, 45, 45), softcap=6.0, causal=True),
    "mask_bool": dict(bias=(2, 1, 45, 45), mask=True, causal=True),
    "bias_with_grad": dict(bias=(2, 4, 45, 45), bias_grad=True),
}


def _bias_call(rng, grad, alibi=None, bias=None, mask=False, bias_grad=False, **options):
    """q, k, v (GQA 4/2, 45 tokens) and the options of one call with new ALiBi slopes or bias values."""
    inputs = tuple(randn(rng, 2, 45, heads, 32) for heads in (4, 2, 2))
    if grad:
        inputs = tuple(t.requires_grad_() for t in inputs)
    if alibi:
        options["alibi_slopes"] = torch.rand(*alibi, generator=rng).to(DEVICE)
    if bias and mask:
        options["attn_bias"] = (torch.rand(*bias, generator=rng) > 0.3).to(DEVICE)
    elif bias:
        options["attn_bias"] = randn(rng, *bias).requires_grad_(bias_grad)
    return inputs, options


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
@pytest.mark.parametrize("case", BIAS_CASES)
def test_alibi_and_bias_calls_replay(rng, unchecked, served, case, grad):
    """Calls with ALiBi slopes or a bias (float, broadcast; a bool mask, read as bytes) replay with this call's
    slopes or bias, no-grad calls and training steps alike; a bias that wants its gradient replays the forward
    only (the backward zeroes the gradient first). Out, lse and every gradient equal the ordinary path's."""
    bias_grad = BIAS_CASES[case].get("bias_grad", False)
    if bias_grad and not grad:
        pytest.skip("a bias that wants a gradient makes a training call")
    for step in range(3):
        inputs, options = _bias_call(rng, grad, **BIAS_CASES[case])
        before = len(served)
        if grad:
            dout = randn(rng, 2, 45, 4, 32)
            wrt = (*inputs, options["attn_bias"]) if bias_grad else inputs
            out = flash_attn_func(*inputs, **options)
            got = (out, *torch.autograd.grad(out, wrt, dout))
            copies = _copies(tuple(t.detach().requires_grad_() for t in inputs), options)
            if bias_grad:
                copies[1]["attn_bias"].requires_grad_()
            expected_out = ordinary(flash_attn_func, *copies[0], **copies[1])
            expected_wrt = (*copies[0], copies[1]["attn_bias"]) if bias_grad else copies[0]
            expected = (expected_out, *torch.autograd.grad(expected_out, expected_wrt, dout))
        else:
            got = flash_attn_func(*inputs, return_attn_probs=True, **options)[:2]
            expected = ordinary(flash_attn_func, *_copies(inputs, options)[0], return_attn_probs=True,
                                **_copies(inputs, options)[1])[:2]
        replayed = 0 if not step else (1 if bias_grad or not grad else 2)
        assert len(served) - before == replayed, f"step {step}: {len(served) - before} replayed"
        for i, (ours, theirs) in enumerate(zip(got, expected)):
            assert torch.equal(ours, theirs), f"step {step}: output {i} differs from the ordinary call"


def test_packed_alibi_calls_replay(rng, unchecked, served):
    """Packed sequences with ALiBi slopes, new slopes and lengths each call, replay as dense ones do."""
    for step in range(3):
        function, tensors, kwargs = _varlen_call(rng, "separate", causal=True)
        kwargs["alibi_slopes"] = torch.rand(4, generator=rng).to(DEVICE)
        out = function(*tensors, **kwargs)
        assert torch.equal(out, ordinary(function, *(t.clone() for t in tensors), **_same_offsets(kwargs)))
        assert len(served) == step


GLUON_CASES = {
    "causal_gqa": (flash_attn_func, ((2, 70, 4, 128), (2, 70, 2, 128), (2, 70, 2, 128)), dict(causal=True)),
    "transposed": (flash_attn_func, ((2, 4, 45, 128), (2, 2, 45, 128), (2, 2, 45, 128)), dict(causal=True)),
    "qkvpacked": (flash_attn_qkvpacked_func, ((1, 41, 3, 2, 128),), dict(window_size=(17, 3))),
    "tail_192_128": (flash_attn_func, ((1, 50, 2, 192), (1, 90, 2, 192), (1, 90, 2, 128)), dict(softcap=9.0)),
    # Full rows take the warp-specialized forward here (gluon_everywhere lowers its floor): a persistent grid.
    "warp_specialized": (flash_attn_func, ((2, 300, 4, 128), (2, 333, 2, 128), (2, 333, 2, 128)), dict(softcap=9.0)),
}


@pytest.fixture
def gluon_everywhere(monkeypatch):
    """Every 16-bit call the Gluon forward can run takes it, however small; kernel names described under the
    usual thresholds are forgotten before and after."""
    from flashtile.backends.triton import configs

    monkeypatch.setattr(configs, "GLUON_MIN_PAIRS", 0)
    monkeypatch.setattr(configs, "GLUON_KV_MIN_QUERIES", 1)
    monkeypatch.setattr(configs, "GLUON_KV_MIN_PAIRS", 0)
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", 0)
    dispatch._describe.cache_clear()
    yield
    dispatch._describe.cache_clear()


@pytest.mark.skipif(not testing.HOPPER, reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
@pytest.mark.parametrize("case", GLUON_CASES)
def test_gluon_forward_replays(rng, unchecked, served, gluon_everywhere, clean_dispatch_state, case, grad):
    """Calls on the Gluon Hopper forward (TMA descriptors, remade on each replay's tensors; views of one packed
    input among them) replay after the first, no-grad calls and training steps alike, with the ordinary path's
    out, lse and gradients."""
    function, shapes, kwargs = GLUON_CASES[case]
    for step in range(3):
        inputs = tuple(randn(rng, *shape) for shape in shapes)
        if case == "transposed":
            inputs = tuple(t.transpose(1, 2) for t in inputs)
        before = len(served)
        if grad:
            inputs = tuple(t.requires_grad_() for t in inputs)
            dout = randn(rng, *ordinary(function, *(t.detach() for t in inputs), **kwargs).shape)
            got = _training_step(function, inputs, dout, **kwargs)
            copies = tuple(t.detach().clone().requires_grad_() for t in inputs)
            expected = ordinary(_training_step, function, copies, dout.clone(), **kwargs)
        else:
            got = function(*inputs, return_attn_probs=True, **kwargs)[:2]
            expected = ordinary(function, *(t.clone() for t in inputs), return_attn_probs=True, **kwargs)[:2]
        assert len(served) - before == (1 + grad if step else 0), f"step {step}: {len(served) - before} replayed"
        for i, (ours, theirs) in enumerate(zip(got, expected)):
            assert torch.equal(ours, theirs), f"step {step}: output {i} differs from the ordinary call"
    family = "[gluon-sm90-ws " if case == "warp_specialized" else "gluon-sm90"
    assert any(family in name for name in flashtile.stats()["kernels"])


@pytest.mark.skipif(not testing.HOPPER, reason="the Gluon forward runs on sm_90 only")
def test_gluon_varlen_and_chunked_prefill_replay(rng, unchecked, served, gluon_everywhere, clean_dispatch_state):
    """Packed sequences (descriptors of the packed tensors seen as one batch row) and a chunked prefill into a
    contiguous cache (descriptors of the caches) replay on the Gluon forward."""
    for step in range(3):
        function, tensors, kwargs = _varlen_call(rng, "separate", headdim=128, causal=True)
        out = function(*tensors, **kwargs)
        assert torch.equal(out, ordinary(function, *(t.clone() for t in tensors), **_same_offsets(kwargs)))
        assert len(served) == step
    for step in range(3):
        tensors, kwargs = _kvcache_case(rng, seqlen_q=9, seqlen_new=9, headdim=128, causal=True,
                                        return_softmax_lse=True)
        expected_tensors, expected_kwargs = _copies(tensors, kwargs)
        got = flash_attn_with_kvcache(*tensors, **kwargs)
        expected = ordinary(flash_attn_with_kvcache, *expected_tensors, **expected_kwargs)
        assert len(served) == 2 + step
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(got, expected)), f"step {step}"
        assert torch.equal(tensors[1], expected_tensors[1]) and torch.equal(tensors[2], expected_tensors[2])
    names = flashtile.stats()["kernels"]
    assert any(name.startswith("flashtile.fwd[gluon-sm90") for name in names), names
    assert any(name.startswith("flashtile.decode[gluon-sm90") for name in names), names


def _offsets(rng, count, longest, total):
    """int32 offsets of ``count`` sequences of new random lengths (one of them empty, one ``longest`` long)
    that fill at most ``total`` rows, and the longest length: the same ``longest`` every call."""
    lengths = torch.randint(1, longest + 1, (count,), generator=rng)
    lengths[torch.randperm(count, generator=rng)[:2]] = torch.tensor([0, longest])
    while int(lengths.sum()) > total:
        lengths[int(lengths.argmax())] -= 1
        lengths[torch.randperm(count, generator=rng)[0]] = longest
        lengths = lengths.clamp(max=longest)
    return int32([0, *torch.cumsum(lengths, 0).tolist()])


def _varlen_call(rng, kind, *, count=4, longest_q=19, longest_k=23, total_q=60, total_k=70, nheads=4, nheads_kv=2,
                 headdim=32, headdim_v=None, seqused=False, grad=False, **options):
    """``(function, tensors, kwargs)`` of one packed call with new values and lengths; the longest lengths and
    the numbers of rows stay put (the rows past the last sequence hold NaN: they must reach no result)."""
    headdim_v = headdim_v or headdim

    def rows(*shape):
        t = randn(rng, *shape)
        return t.requires_grad_() if grad else t

    cu_q = _offsets(rng, count, longest_q, total_q)
    if kind == "qkvpacked":
        qkv = randn(rng, total_q, 3, nheads, headdim)
        qkv[int(cu_q[-1]):] = float("nan")
        return (flash_attn_varlen_qkvpacked_func, (qkv.requires_grad_() if grad else qkv,),
                dict(options, cu_seqlens=cu_q, max_seqlen=longest_q))
    cu_k = _offsets(rng, count, longest_k, total_k)
    q = randn(rng, total_q, nheads, headdim)
    q[int(cu_q[-1]):] = float("nan")
    kwargs = dict(options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=longest_q, max_seqlen_k=longest_k)
    if seqused:
        used = [int(torch.randint(0, int(n) + 1, (1,), generator=rng)) for n in cu_k.diff().tolist()]
        kwargs["seqused_k"] = int32(used)
    if kind == "kvpacked":
        kv = randn(rng, total_k, 2, nheads_kv, headdim)
        kv[int(cu_k[-1]):] = float("nan")
        return flash_attn_varlen_kvpacked_func, (q.requires_grad_() if grad else q, kv.requires_grad_() if grad else kv), kwargs
    k, v = randn(rng, total_k, nheads_kv, headdim), randn(rng, total_k, nheads_kv, headdim_v)
    k[int(cu_k[-1]):], v[int(cu_k[-1]):] = float("nan"), float("nan")
    tensors = (q, k, v)
    return flash_attn_varlen_func, tuple(t.requires_grad_() for t in tensors) if grad else tensors, kwargs


VARLEN_CASES = {
    "gqa_causal": ("separate", dict(causal=True)),
    "seqused_window": ("separate", dict(seqused=True, window_size=(6, 2), causal=False)),
    "softcap_dv": ("separate", dict(softcap=8.0, headdim_v=16, causal=True)),
    "qkvpacked": ("qkvpacked", dict(causal=True)),
    "kvpacked": ("kvpacked", dict()),
    "decode_rows": ("separate", dict(count=5, longest_q=1, total_q=6, causal=True)),
}


def _same_offsets(kwargs):
    """``kwargs`` with the offsets cloned (the ordinary call gets its own tensors), qkvpacked's one offset once."""
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_calls_replay(rng, unchecked, served, case):
    """Packed batches of new lengths (the same longest ones): calls after the first replay, with the ordinary
    path's out and lse; no-grad calls, then training steps (forward and backward replayed, every gradient equal)."""
    kind, options = VARLEN_CASES[case]
    for step in range(3):
        function, tensors, kwargs = _varlen_call(rng, kind, **options)
        out, lse, _ = function(*tensors, return_attn_probs=True, **kwargs)
        expected, expected_lse, _ = ordinary(function, *(t.clone() for t in tensors), return_attn_probs=True,
                                             **_same_offsets(kwargs))
        assert len(served) == step, f"step {step}: {len(served)} replayed calls"
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse), f"step {step}"
    dispatch.forget_plans()
    for step in range(3):
        function, tensors, kwargs = _varlen_call(rng, kind, grad=True, **options)
        dout = randn(rng, *ordinary(function, *(t.detach() for t in tensors), **kwargs).shape)
        before = len(served)
        got = _training_step(function, tensors, dout, **kwargs)
        assert len(served) - before == (2 if step else 0), f"step {step}: forward and backward replayed"
        copies = tuple(t.detach().clone().requires_grad_() for t in tensors)
        expected = ordinary(_training_step, function, copies, dout.clone(), **_same_offsets(kwargs))
        for name, ours, theirs in zip(("out", *(f"grad {i}" for i in range(len(tensors)))), got, expected):
            assert torch.equal(ours, theirs), f"step {step}: {name} differs from the ordinary call"


def test_varlen_longest_length_change_is_planned_again(rng, unchecked, served):
    """A batch whose longest sequence differs (its grids differ) is planned and recorded again, and the calls
    like it after it (the other layers) replay that recording. Offsets given as one tensor (a replay takes it
    once) and then as two tensors of other values: the second kind is not served by the first's replay."""
    for longest in (19, 19, 12, 12, 12, 19):
        function, tensors, kwargs = _varlen_call(rng, "separate", longest_q=longest, longest_k=longest, total_k=60)
        before = len(served)
        out = function(*tensors, **kwargs)
        assert torch.equal(out, ordinary(function, *tensors, **_same_offsets(kwargs)))
        replayed = len(served) - before
    assert replayed == 0, "19 after 12: planned again"
    dispatch.forget_plans()
    q, k, v = tensors
    k, v = (randn(rng, q.shape[0], *t.shape[1:]) for t in (k, v))
    one = dict(kwargs, cu_seqlens_k=kwargs["cu_seqlens_q"], max_seqlen_k=kwargs["max_seqlen_q"])
    two = dict(one, cu_seqlens_k=_offsets(rng, 4, one["max_seqlen_q"], q.shape[0]))
    assert not torch.equal(two["cu_seqlens_k"], one["cu_seqlens_q"])
    before = len(served)
    for given in (one, one, two, two):
        out = function(q, k, v, **given)
        assert torch.equal(out, ordinary(function, q, k, v, **_same_offsets(given)))
    assert len(served) - before == 2, "the second call of each kind replays"


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.float16], ids=["sink_fp32", "sink_fp16"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_sink_steps_replay(rng, unchecked, served, sink_dtype, packed):
    """Calls with a sink (gpt-oss keeps it in the model's dtype): no-grad calls, then training steps whose
    sink requires grad (its gradient summed by a kernel), replay after the first; equal to the ordinary path."""
    def step(grad):
        if packed:
            function, tensors, kwargs = _varlen_call(rng, "separate", grad=grad, causal=True)
        else:
            function, kwargs = flash_attn_func, dict(causal=True, window_size=(17, 0))
            tensors = tuple(randn(rng, *shape) for shape in ((2, 33, 4, 32), (2, 40, 2, 32), (2, 40, 2, 32)))
            tensors = tuple(t.requires_grad_() for t in tensors) if grad else tensors
        sink = randn(rng, 4, dtype=sink_dtype)
        return function, (*tensors, sink.requires_grad_() if grad else sink), kwargs

    def call(function, tensors, **kwargs):
        *qkv, sink = tensors
        return function(*qkv, sink=sink, **kwargs)

    for step_index in range(3):
        function, tensors, kwargs = step(grad=False)
        out = call(function, tensors, **kwargs)
        copies = tuple(t.clone() for t in tensors)
        assert torch.equal(out, ordinary(call, function, copies, **_same_offsets(kwargs)))
        assert len(served) == step_index
    dispatch.forget_plans()
    for step_index in range(3):
        function, tensors, kwargs = step(grad=True)
        dout = randn(rng, *ordinary(call, function, tuple(t.detach() for t in tensors), **kwargs).shape)
        before = len(served)
        out = call(function, tensors, **kwargs)
        got = (out, *torch.autograd.grad(out, tensors, dout))
        assert len(served) - before == (2 if step_index else 0), f"step {step_index}: forward and backward replayed"
        copies = tuple(t.detach().clone().requires_grad_() for t in tensors)
        out = ordinary(call, function, copies, **_same_offsets(kwargs))
        expected = (out, *torch.autograd.grad(out, copies, dout))
        assert got[-1].dtype == sink_dtype
        for name, ours, theirs in zip(("out", "dq", "dk", "dv", "dsink"), got, expected):
            assert torch.equal(ours, theirs), f"step {step_index}: {name} differs from the ordinary call"


def test_sink_alone_requiring_grad_is_not_served_a_no_grad_replay(rng, unchecked, served):
    """Only the sink requires grad (a frozen model with learnable sinks): each call builds the graph, so its
    gradient reaches the sink on every call, not only on the first."""
    q, k, v = (randn(rng, 1, 30, 4, 32) for _ in range(3))
    for step in range(3):
        sink = randn(rng, 4, dtype=torch.float32).requires_grad_()
        out = flash_attn_func(q, k, v, sink=sink, causal=True)
        assert out.requires_grad, f"step {step}: the output has no graph to the sink"
        (grad,) = torch.autograd.grad(out, sink, torch.ones_like(out))
        copy = sink.detach().clone().requires_grad_()
        expected = ordinary(flash_attn_func, q, k, v, sink=copy, causal=True)
        assert torch.equal(grad, torch.autograd.grad(expected, copy, torch.ones_like(expected))[0])


def test_backward_of_a_copied_gradient_is_not_replayed(rng, unchecked, served):
    """``out.sum().backward()`` hands the backward an expanded gradient (stride 0), copied on the way to
    the kernels: the forward replays, the backward does not, and the gradients are right."""
    for step in range(3):
        q, k, v = (randn(rng, 1, 24, 2, 32).requires_grad_() for _ in range(3))
        before = len(served)
        flash_attn_func(q, k, v).sum().backward()
        assert len(served) - before == (1 if step else 0)
        copies = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        ordinary(flash_attn_func, *copies).sum().backward()
        assert all(torch.equal(t.grad, c.grad) for t, c in zip((q, k, v), copies))


@pytest.mark.parametrize("alongside", [False, True], ids=["split", "split_alongside"])
@pytest.mark.parametrize("transposed", [False, True], ids=["bshd", "bhsd"])
def test_split_backward_replays(rng, unchecked, served, monkeypatch, alongside, transposed):
    """Split key blocks (their partial sums added by a kernel into gradients of the inputs' strides), with
    the dQ kernel on a second stream on a GPU: the fork and join replay with the launches."""
    monkeypatch.setattr(configs, "bwd_plan", lambda *args: (2, alongside))
    for step in range(3):
        shapes = ((1, 150, 4, 32), (1, 150, 1, 32), (1, 150, 1, 32))
        inputs = tuple(randn(rng, *shape) for shape in shapes)
        if transposed:
            inputs = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs)
        inputs = tuple(t.requires_grad_() for t in inputs)
        dout = randn(rng, 1, 150, 4, 32)
        before = len(served)
        got = _training_step(flash_attn_func, inputs, dout, causal=True)
        assert len(served) - before == (2 if step else 0)
        copies = tuple(t.detach().clone().requires_grad_() for t in inputs)
        expected = ordinary(_training_step, flash_attn_func, copies, dout, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(t.stride() == g.stride() for t, g in zip(inputs, got[1:]))


def test_output_without_gradient_gives_none(rng, unchecked):
    """Autograd hands the backward no output gradient (an output whose gradient is cut off): the inputs
    get none from the attention, and no zeros are made for it."""
    class Cut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    q, k, v = (randn(rng, 1, 20, 2, 32).requires_grad_() for _ in range(3))
    (Cut.apply(flash_attn_func(q, k, v)).sum() + q.sum()).backward()
    assert torch.equal(q.grad, torch.ones_like(q)) and k.grad is None and v.grad is None


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_dropout_calls_replay_with_new_counters(rng, unchecked, served, grad, packed):
    """A call with dropout replays on the counters drawn for it: under one torch seed the replayed call keeps
    the same elements as the ordinary path (out and every gradient bit-equal), and calls in a row keep other
    elements (a replay that kept the recorded counters would repeat the first call's mask)."""
    outs = []
    for step in range(3):
        if packed:
            function, tensors, kwargs = _varlen_call(rng, "separate", grad=grad, causal=True, dropout_p=0.3)
            copies = lambda: (tuple(t.detach().clone().requires_grad_(grad) for t in tensors),  # noqa: E731
                              _same_offsets(kwargs))
        else:
            function, kwargs = flash_attn_func, dict(dropout_p=0.3, window_size=(20, 0))
            tensors = tuple(randn(rng, 2, 37, heads, 32).requires_grad_(grad) for heads in (4, 2, 2))
            copies = lambda: (tuple(t.detach().clone().requires_grad_(grad) for t in tensors), kwargs)  # noqa: E731
        before = len(served)
        torch.manual_seed(1000 + step)
        if grad:
            dout = randn(rng, *ordinary(function, *(t.detach() for t in tensors), **kwargs).shape)
            torch.manual_seed(1000 + step)
            got = _training_step(function, tensors, dout, **kwargs)
            expected_tensors, expected_kwargs = copies()
            torch.manual_seed(1000 + step)
            expected = ordinary(_training_step, function, expected_tensors, dout.clone(), **expected_kwargs)
        else:
            got = (function(*tensors, **kwargs),)
            expected_tensors, expected_kwargs = copies()
            torch.manual_seed(1000 + step)
            expected = (ordinary(function, *expected_tensors, **expected_kwargs),)
        assert len(served) - before == (0 if not step else 1 + grad), f"step {step}: {len(served) - before} replayed"
        for i, (ours, theirs) in enumerate(zip(got, expected)):
            assert torch.equal(ours, theirs), f"step {step}: output {i} differs from the ordinary call"
        outs.append(got[0])
    # The same inputs twice in a row: two draws of counters, two masks.
    first, second = (function(*tensors, **kwargs) for _ in range(2))
    assert len(served) == 2 * (1 + grad) + 2  # the forwards of the last two (no backward asked)
    assert not torch.equal(first, second)


def test_profiled_calls_are_not_replayed(rng, unchecked, served):
    """Under a profiler the call takes the ordinary path, which names its kernel."""
    q, k, v = (randn(rng, 1, 24, 2, 32) for _ in range(3))
    flash_attn_func(q, k, v)
    with torch.profiler.profile() as profiler:
        flash_attn_func(q, k, v)
    assert not served
    names = [event.name for event in profiler.events()]
    assert any(name.startswith(("flashtile.fwd[", "flashtile.decode[")) for name in names), names


def test_replayed_calls_are_counted(rng, unchecked, served, clean_dispatch_state):
    q, k, v = (randn(rng, 1, 24, 2, 32) for _ in range(3))
    for _ in range(3):
        flash_attn_func(q, k, v)
    stats = flashtile.stats()
    assert len(served) == 2
    assert sum(stats["calls"].values()) == 3 and sum(stats["kernels"].values()) == 3


class _Launch:
    def __init__(self):
        self.calls = []

    def __call__(self, args):
        self.calls.append(args)


def _recorded(*launches, buffers=()):
    recorder = replay.Recorder()
    recorder.buffers.extend(buffers)
    recorder.launches.extend(launches)
    return recorder


def test_build_maps_inputs_buffers_and_views():
    """Each tensor argument is found as an input, a buffer or a view of one; other arguments are kept."""
    a, b = torch.randn(4, 6), torch.randn(3)
    buffer = torch.empty(10)
    launch = _Launch()
    recorder = _recorded((launch, [a, 7, b, buffer[2:5], a[1:].t(), None, 0.5]), buffers=[buffer])
    again = replay.build(recorder, (a, None, b), (buffer,))
    assert isinstance(again, replay.Replay)
    a2, b2 = torch.randn(4, 6), torch.randn(3)
    (out,) = again((a2, None, b2))
    args = launch.calls[0]
    assert args[0] is a2 and args[2] is b2 and args[1] == 7 and args[5] is None and args[6] == 0.5
    assert args[3].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert (args[3].storage_offset(), out.shape, args[3].shape) == (2, (10,), (3,))
    assert torch.equal(args[4], a2[1:].t())
    assert again((torch.randn(4, 7), None, b2)) is None, "another shape must not replay"
    assert again((a2.t().contiguous().t(), None, b2)) is None, "other strides must not replay"


def test_buffers_keep_their_strides():
    """A buffer made like a transposed input (``empty_like`` keeps its strides) is allocated again with them."""
    a = torch.randn(3, 5).t()
    buffer = torch.empty_like(a)
    launch = _Launch()
    again = replay.build(_recorded((launch, [a, buffer]), buffers=[buffer]), (a,), (buffer,))
    (out,) = again((torch.randn(3, 5).t(),))
    assert out.shape == (5, 3) and out.stride() == (1, 5) and launch.calls[0][1] is out


def test_compiled_launches_take_addresses():
    """A compiled launch gets each tensor as its address, a view as an address past its base's."""
    a = torch.randn(4, 6)
    buffer = torch.empty(10)
    launch = _Launch()
    launch.pointers = True
    recorder = _recorded((launch, [a, buffer, buffer[3:], a[1:], 5]), buffers=[buffer])
    again = replay.build(recorder, (a,), (buffer,))
    a2 = torch.randn(4, 6)
    (out,) = again((a2,))
    assert launch.calls[0] == (a2.data_ptr(), out.data_ptr(), out.data_ptr() + 12, a2.data_ptr() + 24, 5)


def _descriptor(base, tile=(4,)):
    """A stand-in for a TMA descriptor of ``base``: the attributes a launcher reads of one."""
    fields = dict(base=base, shape=list(base.shape), strides=list(base.stride()), block_shape=list(tile),
                  layout="nvmma", padding="zero")
    return type("TensorDescriptor", (), fields)()


def test_dropout_counters_are_taken_by_name():
    """A call's dropout seed and offset are given to each replay and land where the launches take arguments
    named seed and offset; a call with counters whose launches do not name them is not replayed."""
    a = torch.randn(8)
    launch = _Launch()
    launch.names = ("X", "seed", "n", "offset")
    again = replay.build(_recorded((launch, [a, 123456789, 8, 77])), (a,), (a,), counters=(123456789, 77))
    again((a,), (5, 6))
    assert launch.calls[0][1:] == (5, 8, 6)
    assert again((a,)) is None, "a replay of a call with dropout needs its counters"
    unnamed = _Launch()
    assert isinstance(replay.build(_recorded((unnamed, [a, 123456789, 8, 77])), (a,), (a,), counters=(123456789, 77)),
                      str)


def test_descriptors_are_made_again_on_the_new_addresses():
    """A TMA descriptor of an input or of a view of one is replayed as a descriptor of the same layout on the
    new tensor's address, and holds none of the recorded tensors."""
    a = torch.randn(4, 6)
    buffer = torch.empty(10)
    launch = _Launch()
    launch.pointers = True
    recorder = _recorded((launch, [_descriptor(a), buffer, _descriptor(a[1:, 2:], (2, 2)), 7]), buffers=[buffer])
    again = replay.build(recorder, (a,), (buffer,))
    a2 = torch.randn(4, 6)
    (out,) = again((a2,))
    whole, pointer, view, seven = launch.calls[0]
    assert (pointer, seven) == (out.data_ptr(), 7)
    assert whole.base.data_ptr() == a2.data_ptr() and view.base.data_ptr() == a2.data_ptr() + 8 * 4
    assert (whole.shape, whole.strides, whole.block_shape) == ([4, 6], [6, 1], [4])
    assert (view.shape, view.strides, view.block_shape, view.padding) == ([3, 4], [6, 1], [2, 2], "zero")
    assert not any(isinstance(item, torch.Tensor) for _, layout in again.descriptors for item in layout)


@pytest.mark.parametrize("reason", ["stranger", "shared", "same", "descriptor", "gapped_buffer", "output",
                                    "nothing", "marked"])
def test_build_refuses(reason):
    a, b = torch.randn(8), torch.randn(8)
    inputs, outputs, buffers, args = (a, b), (a,), [], [a, b]
    if reason == "stranger":
        args = [a, torch.randn(8)]
    elif reason == "shared":
        whole = torch.randn(16)
        inputs, args = (whole[:8], whole[8:]), [whole[2:6]]
    elif reason == "same":
        inputs = (a, a)
    elif reason == "descriptor":
        args = [a, _descriptor(torch.randn(8))]
    elif reason == "gapped_buffer":
        buffers = [torch.empty(4, 8)[:, :4]]
    elif reason == "output":
        outputs = (a[1:],)
    recorder = _recorded() if reason == "nothing" else _recorded((_Launch(), args), buffers=buffers)
    if reason == "marked":
        recorder.unreplayable = "a fallback: test"
    assert isinstance(replay.build(recorder, inputs, outputs), str)


def test_fallback_marks_the_recording_unreplayable():
    recorder = replay.Recorder()
    with replay.recording(recorder):
        with pytest.warns(RuntimeWarning):
            dispatch.record_fallback("a test's reason", "torch")
    assert recorder.unreplayable == "a fallback: a test's reason"


@pytest.mark.cuda
def test_replayed_step_in_a_cuda_graph(rng, unchecked, served):
    """A replayed decode step captured in a CUDA graph reads the graph's tensors on every replay."""
    tensors, kwargs = _kvcache_case(rng, causal=True)
    flash_attn_with_kvcache(*tensors, **kwargs)
    q = tensors[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(*tensors, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(*tensors, **kwargs)
    assert len(served) == 2
    for _ in range(2):
        q.copy_(randn(rng, *q.shape))
        kwargs["cache_seqlens"].copy_(torch.randint(0, 60, kwargs["cache_seqlens"].shape, generator=rng))
        copies = _copies(tensors, kwargs)
        graph.replay()
        assert torch.equal(out, ordinary(flash_attn_with_kvcache, *copies[0], **copies[1]))
