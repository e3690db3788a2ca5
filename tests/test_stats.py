"""flashtile.stats() / reset_stats(): which backend served each call, and fallbacks by reason."""
import warnings

import pytest
import torch

import flashtile
from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashtile.dispatch import force_backend
from flashtile.testing import attention_ref, attention_varlen_ref, cu_seqlens_of, make_qkv

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def clean_stats():
    flashtile.reset_stats()
    yield
    flashtile.reset_stats()


def counts():
    """stats() without the per-kernel names (tests/test_dispatch.py checks those)."""
    snapshot = flashtile.stats()
    return {"calls": snapshot["calls"], "fallbacks": snapshot["fallbacks"]}


def small_inputs(device, rng, requires_grad=False):
    return make_qkv(1, 3, 5, 2, 1, 8, torch.float16 if device == "cuda" else torch.float32, device, requires_grad=requires_grad, generator=rng)


def test_reset_clears_everything(device, rng):
    with force_backend("torch"):
        flash_attn_func(*small_inputs(device, rng))
    assert flashtile.stats()["calls"] == {"torch": 1}
    flashtile.reset_stats()
    assert flashtile.stats() == {"calls": {}, "kernels": {}, "fallbacks": {}, "device_errors": []}


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_forced_backend_is_counted(name, device, rng):
    q, k, v = small_inputs(device, rng, requires_grad=True)
    with force_backend(name):
        for _ in range(3):
            out = flash_attn_func(q, k, v, causal=True)
        out.sum().backward()  # the backward is part of a call, not a call of its own
    assert counts() == {"calls": {name: 3}, "fallbacks": {}}


def test_every_public_function_is_counted(device, rng):
    q, k, v = small_inputs(device, rng)
    qkv = make_qkv(1, 4, 4, 2, 2, 8, q.dtype, device, packed="qkv", requires_grad=False, generator=rng)
    with force_backend("torch"):
        flash_attn_func(q, k, v)
        flash_attn_qkvpacked_func(qkv)
        flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2))
    assert flashtile.stats()["calls"] == {"torch": 3}


def test_stats_returns_a_snapshot(device, rng):
    with force_backend("torch"):
        flash_attn_func(*small_inputs(device, rng))
    snapshot = flashtile.stats()
    snapshot["calls"]["torch"] = 100
    snapshot["fallbacks"]["made up"] = 1
    assert counts() == {"calls": {"torch": 1}, "fallbacks": {}}


def test_nested_force_backend_uses_innermost(device, rng):
    q, k, v = small_inputs(device, rng)
    with force_backend("triton"):
        with force_backend("torch"):
            flash_attn_func(q, k, v)
        flash_attn_func(q, k, v)
    assert flashtile.stats()["calls"] == {"torch": 1, "triton": 1}


def test_force_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"backend must be one of.*'cudnn'"):
        with force_backend("cudnn"):
            pass


@pytest.mark.skipif(HAS_CUDA, reason="CPU dispatch rules")
def test_cpu_under_interpreter_goes_to_triton(rng, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    flash_attn_func(*small_inputs("cpu", rng))
    assert counts() == {"calls": {"triton": 1}, "fallbacks": {}}


@pytest.mark.skipif(HAS_CUDA, reason="CPU dispatch rules")
@pytest.mark.parametrize("value", ["0", ""])
def test_cpu_without_interpreter_goes_to_torch(value, rng, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    q, k, v = small_inputs("cpu", rng, requires_grad=True)
    flash_attn_func(q, k, v).sum().backward()
    flash_attn_qkvpacked_func(make_qkv(1, 4, 4, 2, 2, 8, torch.float32, "cpu", packed="qkv", generator=rng))
    # CPU tensors belong to the torch backend: this is not a fallback.
    assert counts() == {"calls": {"torch": 2}, "fallbacks": {}}


@pytest.mark.cuda
def test_cuda_goes_to_triton(rng):
    flash_attn_func(*small_inputs("cuda", rng))
    assert counts() == {"calls": {"triton": 1}, "fallbacks": {}}


@pytest.mark.cuda
def test_cpu_tensors_on_a_cuda_machine_go_to_torch(rng, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    flash_attn_func(*small_inputs("cpu", rng))
    assert counts() == {"calls": {"torch": 1}, "fallbacks": {}}


def test_failed_validation_is_not_counted(device, rng):
    q, k, v = small_inputs(device, rng)
    with pytest.raises(ValueError):
        flash_attn_func(q, k[:, :, :, :4].contiguous(), v)
    assert flashtile.stats()["calls"] == {}


def test_fallback_is_counted_warned_once_and_logged(monkeypatch, caplog):
    """A CUDA call that the Triton backend cannot take runs on torch, and says so."""
    from flashtile import dispatch
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend

    reason = "GPU compute capability 7.5 is below 8.0 (Ampere), which the Triton kernels need"
    monkeypatch.setattr(triton_backend, "supports", lambda call: reason)
    monkeypatch.setattr(dispatch, "_warned", set())
    call_on_cuda = AttentionCall(torch.device("cuda", 0), torch.float16, 1, 3, 5, 2, 1, 64, False)
    with caplog.at_level("INFO", logger="flashtile"), pytest.warns(RuntimeWarning, match="compute capability 7.5"):
        assert dispatch.dispatch(call_on_cuda).backend == "torch"
    assert reason in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning for the same reason would raise here
        assert dispatch.dispatch(call_on_cuda).backend == "torch"
    assert counts() == {"calls": {"torch": 2}, "fallbacks": {reason: 2}}


# ---------------------------------------------------------------- remembered plans of repeated calls


def test_repeated_call_skips_validation_but_is_counted(device, rng, monkeypatch):
    from flashtile import validation

    checked = []
    real = validation.check_qkv
    monkeypatch.setattr(validation, "check_qkv", lambda *a, **kw: (checked.append(1), real(*a, **kw))[1])
    q, k, v = small_inputs(device, rng)
    with force_backend("torch"):
        first = flash_attn_func(q, k, v, causal=True)
        again = flash_attn_func(q, k, v, causal=True)
        flash_attn_func(q, k, v, causal=False)  # other options: planned afresh
    assert len(checked) == 2
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    snapshot = flashtile.stats()
    assert snapshot["calls"] == {"torch": 3} and sum(snapshot["kernels"].values()) == 3


def test_growing_keys_reuse_validation_and_replan(device, rng, monkeypatch):
    """A KV cache grown by a token a step: validation runs once, the plan is redone for each key count
    (its tiles may depend on it), every call is counted, and k and v that disagree on it still raise."""
    from flashtile import validation

    checked = []
    real = validation.check_qkv
    monkeypatch.setattr(validation, "check_qkv", lambda *a, **kw: (checked.append(1), real(*a, **kw))[1])
    q = torch.randn(1, 1, 4, 16, generator=rng).to(device, torch.float16)
    with force_backend("torch"):
        for seqlen_k in (5, 6, 7):
            k, v = (torch.randn(1, seqlen_k, 2, 16, generator=rng).to(device, torch.float16) for _ in range(2))
            out = flash_attn_func(q, k, v, causal=True)
            ref, _ = attention_ref(q, k, v, causal=True)
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)
        assert [plan.call.seqlen_k for _, plan, _ in flashtile.dispatch._remembered.values()] == [7]
        with pytest.raises(ValueError, match="k and v must have the same"):
            flash_attn_func(q, k, v[:, :5])
    assert len(checked) == 2
    assert counts()["calls"] == {"torch": 3}


def test_packed_steps_reuse_validation_and_replan(device, rng, monkeypatch):
    """Decode steps of a continuous batch through flash_attn_varlen_func (new offsets every step, keys grown by
    a token): validation runs once, each step attends with its own offsets, the plan is redone when a longest
    length changes, and offsets of the wrong dtype or a length given as a tensor are validated afresh."""
    from flashtile import validation

    monkeypatch.setattr(validation, "values_checked", lambda device: False)  # as for CUDA tensors by default
    checked = []
    real = validation.check_varlen
    monkeypatch.setattr(validation, "check_varlen", lambda *a, **kw: (checked.append(1), real(*a, **kw))[1])
    q = torch.randn(3, 4, 16, generator=rng).to(device, torch.float16)
    cu_q = cu_seqlens_of([1, 1, 1], device)
    with force_backend("torch"):
        for step in range(3):
            lengths = [5 + step, 2 + step, 9 + step]
            cu_k = cu_seqlens_of(lengths, device)
            k, v = (torch.randn(sum(lengths), 2, 16, generator=rng).to(device, torch.float16) for _ in range(2))
            out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lengths), causal=True)
            ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=0)
        assert [plan.call.seqlen_k for _, plan, _ in flashtile.dispatch._remembered.values()] == [max(lengths)]
        assert len(checked) == 1
        with pytest.raises(TypeError, match="cu_seqlens_k must have dtype torch.int32"):
            flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k.long(), 1, max(lengths), causal=True)
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, torch.tensor(max(lengths)), causal=True)
    assert len(checked) == 3
    assert counts()["calls"] == {"torch": 4}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter: the CPU suite's test")
def test_remembered_plan_follows_disabled_backends(rng, monkeypatch, clean_dispatch_state):
    """A plan made before a backend was disabled is not reused after (the fallback is recorded)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = small_inputs("cpu", rng)
    flash_attn_func(q, k, v)
    monkeypatch.setenv("FLASHTILE_DISABLE_BACKENDS", "triton")
    with pytest.warns(RuntimeWarning, match="disabled"):
        flash_attn_func(q, k, v)
    with flashtile.dispatch.disable_backends("torch"):
        with pytest.raises(RuntimeError, match="no flashtile backend"):
            flash_attn_func(q, k, v)
    snapshot = counts()
    assert snapshot["calls"] == {"triton": 1, "torch": 1} and len(snapshot["fallbacks"]) == 1


def test_fallbacks_are_recorded_on_every_repeat(rng, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_DISABLE_BACKENDS", "triton")
    q, k, v = small_inputs("cpu", rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            flash_attn_func(q, k, v)
    assert counts()["calls"] == {"torch": 3} and list(counts()["fallbacks"].values()) == [3]


@pytest.mark.parametrize("bad, error", [(dict(softcap=False), TypeError), (dict(window_size=(2.0, 0)), TypeError),
                                        (dict(causal=True, softmax_scale=-1.0), ValueError)])
def test_remembered_plan_does_not_admit_bad_options(bad, error, device, rng):
    """``False == 0`` and ``2.0 == 2`` in Python: the options' types are part of the remembered key."""
    q, k, v = small_inputs(device, rng)
    good = dict(softcap=0.0, window_size=(2, 0), causal=True, softmax_scale=1.0)
    with force_backend("torch"):
        flash_attn_func(q, k, v, **{name: good[name] for name in bad})
        with pytest.raises(error):
            flash_attn_func(q, k, v, **bad)


@pytest.mark.parametrize("grad", ["no_grad", "no_input_requires_grad", "requires_grad"])
def test_autograd_graph_only_when_a_gradient_is_wanted(grad, device, rng):
    q, k, v = small_inputs(device, rng, requires_grad=grad != "no_input_requires_grad")
    with force_backend("torch"), torch.set_grad_enabled(grad != "no_grad"):
        out = flash_attn_func(q, k, v, causal=True)
        packed = flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), causal=True)
    torch.testing.assert_close(packed, out, rtol=0, atol=0)
    assert (out.grad_fn is not None) == (grad == "requires_grad") == out.requires_grad
