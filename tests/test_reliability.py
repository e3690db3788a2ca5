"""Reliability (docs/reliability.md): no index value makes a kernel read or write outside the tensors it was
given, and none passes in silence.

With the host value checks on (always on CPU; ``FLASHTILE_VALIDATE_VALUES=1`` on CUDA) a bad value is a
``ValueError`` naming the argument and the value. With them off (the ``unchecked`` fixture: what a CUDA call
does by default) the kernels clamp or drop what a bad value points at, and note it in the device-side error
record that :func:`flashtile.check_device_errors` reads. Caches are views into larger buffers whose rows
outside the view are compared bit for bit, so a write past the view is seen (the GPU sanitizer cannot see
it: the buffer is one allocation). On CPU both backends run (Triton through its interpreter); on CUDA Triton.
"""
import pytest
import torch

import flashtile
from flashtile import device_errors, validation
from flashtile.testing import HOPPER, attention_varlen_ref, cu_seqlens_of

HEADDIM = 16


@pytest.fixture
def unchecked(monkeypatch):
    """Bad values reach the kernels: the host value checks are off, as on CUDA by default."""
    monkeypatch.setattr(validation, "values_checked", lambda device: False)
    device_errors.clear()
    yield
    device_errors.clear()


def randn(rng, *shape, device="cpu"):
    return torch.randn(*shape, generator=rng).to(device)


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def recorded() -> dict:
    """The first recorded error (there must be one); the records are cleared by reading."""
    with pytest.raises(ValueError) as raised:
        flashtile.check_device_errors()
    found = device_errors.last_raised
    return dict(found, message=str(raised.value))


def cache_in_buffer(rng, batch, capacity, device, spare=2):
    """``(k_cache, v_cache, k_buffer, v_buffer)``: caches of ``batch`` rows, views into buffers of ``batch + spare``."""
    k_buf = randn(rng, batch + spare, capacity, 2, HEADDIM, device=device)
    v_buf = randn(rng, batch + spare, capacity, 2, HEADDIM, device=device)
    return k_buf[:batch], v_buf[:batch], k_buf, v_buf


# ---------------------------------------------------------------- host checks (items 1-4)

@pytest.mark.parametrize("bad", [2, -1, 7])
def test_cache_batch_idx_out_of_range_is_a_value_error(backend, device, rng, bad):
    k_cache, v_cache, _, _ = cache_in_buffer(rng, 2, 8, device)
    q, k, v = (randn(rng, 2, 1, 2, HEADDIM, device=device) for _ in range(3))
    with pytest.raises(ValueError, match=rf"cache_batch_idx\[1\] = {bad}"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32([0, 0], device),
                                          cache_batch_idx=int32([0, bad], device))


def test_duplicate_cache_batch_idx_is_a_value_error_when_appending(backend, device, rng):
    k_cache, v_cache, _, _ = cache_in_buffer(rng, 2, 8, device)
    q, k, v = (randn(rng, 2, 1, 2, HEADDIM, device=device) for _ in range(3))
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] and cache_batch_idx\[1\] are both 0"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32([1, 1], device),
                                          cache_batch_idx=int32([0, 0], device))
    # Reading one cache row from two batch rows (nothing appended) is fine, and both get the same answer.
    out = flashtile.flash_attn_with_kvcache(q[:1].expand(2, -1, -1, -1), k_cache, v_cache,
                                            cache_seqlens=int32([3, 3], device), cache_batch_idx=int32([1, 1], device))
    torch.testing.assert_close(out[0], out[1])


@pytest.mark.parametrize("cu, match", [([0, 4, 30], r"cu_seqlens_q\[-1\]=30 exceeds the 24 tokens"),
                                       ([0, 30, 24], r"cu_seqlens_q must be non-decreasing"),
                                       ([0, 20, 24], r"max_seqlen_q=8 is less than the longest")])
def test_bad_cu_seqlens_is_a_value_error(backend, device, rng, cu, match):
    q, k, v = (randn(rng, 24, 2, HEADDIM, device=device) for _ in range(3))
    max_seqlen = 8 if "max_seqlen" in match else 30
    with pytest.raises(ValueError, match=match):
        flashtile.flash_attn_varlen_func(q, k, v, int32(cu, device), int32(cu, device), max_seqlen, max_seqlen)


def test_seqused_k_past_the_sequence_is_a_value_error(backend, device, rng):
    q, k, v = (randn(rng, 24, 2, HEADDIM, device=device) for _ in range(3))
    cu = int32([0, 4, 24], device)
    with pytest.raises(ValueError, match="seqused_k"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, seqused_k=int32([10, 20], device))


# ---------------------------------------------------------------- kernels with the checks off (items 1-3)

@pytest.mark.parametrize("bad", [2, -1, 1000])
def test_cache_batch_idx_out_of_range_writes_nothing_and_is_recorded(backend, device, rng, unchecked, bad):
    k_cache, v_cache, k_buf, v_buf = cache_in_buffer(rng, 2, 8, device)
    before = k_buf.clone(), v_buf.clone()
    q, k, v = (randn(rng, 2, 1, 2, HEADDIM, device=device) for _ in range(3))
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32([0, 0], device),
                                            cache_batch_idx=int32([0, bad], device))
    for buf, old in zip((k_buf, v_buf), before):
        assert torch.equal(buf[1:], old[1:]), "a write landed outside batch row 0's cache row"
        torch.testing.assert_close(buf[0, 0], (k if buf is k_buf else v)[0, 0])
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0, "a batch row with no cache row attends to nothing"
    found = recorded()
    assert (found["argument"], found["index"], found["value"]) == ("cache_batch_idx", 1, bad)
    assert "cache_batch_idx[1] = " + str(bad) in found["message"]
    flashtile.check_device_errors()  # cleared by the read


def test_cache_seqlens_past_capacity_drops_the_tokens_and_is_recorded(backend, device, rng, unchecked):
    k_cache, v_cache, k_buf, v_buf = cache_in_buffer(rng, 2, 8, device)
    before = k_buf.clone()
    q, k, v = (randn(rng, 2, 3, 2, HEADDIM, device=device) for _ in range(3))
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32([2, 6], device))
    assert torch.equal(k_buf[2:], before[2:]) and torch.equal(k_buf[1, :6], before[1, :6])
    torch.testing.assert_close(k_buf[1, 6:8], k[1, :2])
    found = recorded()
    assert (found["argument"], found["index"], found["value"]) == ("cache_seqlens", 1, 6)


@pytest.mark.parametrize("bad", [-1, 11])
def test_block_table_entry_outside_the_cache_is_recorded(backend, device, rng, unchecked, bad):
    page_size, num_blocks = 4, 6
    buf = randn(rng, num_blocks + 2, page_size, 2, HEADDIM, device=device)
    v_buf = randn(rng, num_blocks + 2, page_size, 2, HEADDIM, device=device)
    before = buf.clone(), v_buf.clone()
    table = int32([[0, 1], [2, bad]], device)
    q, k, v = (randn(rng, 2, 1, 2, HEADDIM, device=device) for _ in range(3))
    out = flashtile.flash_attn_with_kvcache(q, buf[:num_blocks], v_buf[:num_blocks], k, v,
                                            cache_seqlens=int32([3, 5], device), block_table=table)
    assert torch.isfinite(out).all()
    assert torch.equal(buf[num_blocks:], before[0][num_blocks:]) and torch.equal(v_buf[num_blocks:], before[1][num_blocks:])
    found = recorded()
    assert (found["argument"], found["value"]) == ("block_table", bad)


def test_block_table_entry_outside_the_cache_is_recorded_without_appending(backend, device, rng, unchecked):
    pages = randn(rng, 6, 4, 2, HEADDIM, device=device)
    q = randn(rng, 2, 1, 2, HEADDIM, device=device)
    out = flashtile.flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=int32([3, 7], device),
                                            block_table=int32([[0, 1], [2, 40]], device))
    assert torch.isfinite(out).all()
    found = recorded()
    assert (found["argument"], found["index"], found["value"]) == ("block_table", 1, 40)
    assert "block_table[1, :] holds 40" in found["message"]


@pytest.mark.parametrize("cu", [[0, 4, 30], [0, 30, 24], [-5, 4, 24], [0, 30, 4]])
def test_varlen_offsets_past_the_tokens_stay_inside_and_are_recorded(backend, device, rng, unchecked, cu):
    q, k, v = (randn(rng, 24, 2, HEADDIM, device=device).requires_grad_() for _ in range(3))
    out = flashtile.flash_attn_varlen_func(q, k, v, int32(cu, device), int32(cu, device), 30, 30)
    out.sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    found = recorded()
    assert found["argument"] in ("cu_seqlens_q", "cu_seqlens_k")
    # Each sequence's bad offset as (index, value); GPU programs race to record first, so any one of them.
    bad = {(b, cu[b]) if cu[b] < 0 else (b + 1, cu[b + 1]) for b in range(len(cu) - 1)
           if cu[b] < 0 or cu[b + 1] < cu[b] or cu[b + 1] > 24}
    assert (found["index"], found["value"]) in bad


def test_seqused_k_past_the_sequence_never_reads_the_next_one(backend, device, rng, unchecked):
    lengths = [4, 20]
    q, k, v = (randn(rng, 24, 2, HEADDIM, device=device) for _ in range(3))
    cu = cu_seqlens_of(lengths, device)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, seqused_k=int32([10, 20], device))
    ref, _ = attention_varlen_ref(q, k, v, cu, cu, seqused_k=int32([4, 20], device))
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-4, rtol=1e-4)
    found = recorded()
    assert (found["argument"], found["index"], found["value"]) == ("seqused_k", 0, 10)


def test_max_seqlen_below_a_sequence_is_recorded(backend, device, rng, unchecked):
    """The kernels' grids are sized by max_seqlen_q: the rows past it are not computed, and that is recorded.
    The torch backend computes every row (nothing is lost, nothing recorded)."""
    q, k, v = (randn(rng, 24, 2, HEADDIM, device=device) for _ in range(3))
    cu = cu_seqlens_of([4, 20], device)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 8, 20)
    if backend == "torch":
        ref, _ = attention_varlen_ref(q, k, v, cu, cu)
        torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-4, rtol=1e-4)
        assert flashtile.stats()["device_errors"] == []
    else:
        found = recorded()
        assert (found["argument"], found["index"], found["value"]) == ("max_seqlen_q", 1, 20)
        assert "max_seqlen_q (sequence 1) has length 20" in found["message"]


def test_cache_leftpad_out_of_range_is_recorded(backend, device, rng, unchecked):
    k_cache, v_cache, _, _ = cache_in_buffer(rng, 2, 8, device)
    q = randn(rng, 2, 1, 2, HEADDIM, device=device)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=int32([5, 5], device),
                                            cache_leftpad=int32([-3, 2], device))
    assert torch.isfinite(out).all()
    found = recorded()
    assert (found["argument"], found["index"], found["value"]) == ("cache_leftpad", 0, -3)


def test_strict_mode_raises_at_a_synchronizing_point(backend, device, rng, unchecked, monkeypatch):
    k_cache, v_cache, _, _ = cache_in_buffer(rng, 2, 8, device)
    q, k, v = (randn(rng, 2, 1, 2, HEADDIM, device=device) for _ in range(3))
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32([0, 0], device),
                                      cache_batch_idx=int32([0, 5], device))
    assert flashtile.stats()["device_errors"][0]["argument"] == "cache_batch_idx"
    # A later call whose values are checked on the host waits for the device anyway: strict mode raises there.
    monkeypatch.undo()
    monkeypatch.setenv("FLASHTILE_VALIDATE_VALUES", "1")
    flashtile.set_strict(True)
    try:
        with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 5"):
            flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=int32([1, 1], device))
    finally:
        flashtile.set_strict(False)
    assert flashtile.stats()["device_errors"] == []


def test_good_values_record_nothing(backend, device, rng, unchecked):
    k_cache, v_cache, _, _ = cache_in_buffer(rng, 3, 8, device)
    q, k, v = (randn(rng, 2, 2, 2, HEADDIM, device=device) for _ in range(3))
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=int32([6, 0], device),
                                      cache_batch_idx=int32([2, 0], device), cache_leftpad=int32([1, 0], device))
    cu = cu_seqlens_of([0, 1, 23], device)
    packed = randn(rng, 24, 2, HEADDIM, device=device)
    flashtile.flash_attn_varlen_func(packed, packed, packed, cu, cu, 23, 23, seqused_k=int32([0, 1, 9], device))
    assert flashtile.stats()["device_errors"] == []
    flashtile.check_device_errors()


# ---------------------------------------------------------------- items 5-9

def test_kvcache_new_lengths_are_checked(device, rng):
    cache = flashtile.KVCache(1, 8, 2, HEADDIM, dtype=torch.float32, device=device)
    q, k, v = (randn(rng, 1, 2, 2, HEADDIM, device=device) for _ in range(3))
    for bad in ([5], [-3]):
        with pytest.raises(ValueError, match=rf"new_lengths must lie between 0 and seqlen_new=2 .*got {bad[0]}"):
            cache.attend(q, k, v, new_lengths=int32(bad, device))
    assert cache.seqlens.tolist() == [0]
    with pytest.raises(ValueError, match=r"new_lengths must have shape \(batch,\) = \(1,\)"):
        cache.attend(q, k, v, new_lengths=int32([1, 1], device))
    cache.attend(q, k, v, new_lengths=int32([1], device))
    assert cache.seqlens.tolist() == [1]


def test_kvcache_new_lengths_unchecked_are_clamped_and_recorded(device, rng, unchecked):
    cache = flashtile.KVCache(1, 8, 2, HEADDIM, dtype=torch.float32, device=device)
    q, k, v = (randn(rng, 1, 2, 2, HEADDIM, device=device) for _ in range(3))
    cache.attend(q, k, v, new_lengths=int32([5], device))
    assert cache.seqlens.tolist() == [2]
    found = recorded()
    assert (found["argument"], found["value"]) == ("new_lengths", 5)


def test_unpad_input_checks_the_mask():
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, seqlen\) = \(2, 5\).*got \(2, 4\)"):
        flashtile.unpad_input(x, torch.ones(2, 4, dtype=torch.int32))
    for value in (2, 0.5, -1):
        mask = torch.ones(2, 5)
        mask[1, 3] = value
        with pytest.raises(ValueError, match=rf"attention_mask\[1, 3\] = {value}"):
            flashtile.unpad_input(x, mask)
    packed, indices, cu, max_seqlen, _ = flashtile.unpad_input(x, torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]))
    assert cu.tolist() == [0, 2, 7] and max_seqlen == 5 and torch.equal(packed, x.flatten(0, 1)[indices])


def test_pad_input_index_past_the_batch_is_a_value_error():
    with pytest.raises(ValueError, match=r"indices must be positions .* got values from 0 to 12"):
        flashtile.pad_input(torch.randn(3, 4), torch.tensor([0, 5, 12]), 2, 5)


def test_double_backward_is_refused(backend, device, rng):
    q, k, v = (randn(rng, 1, 5, 2, HEADDIM, device=device).requires_grad_() for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    # The first-order gradient is still there for the ordinary backward.
    flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_paged_fork_that_raises_takes_no_page(device):
    paged = flashtile.PagedKVCache(num_blocks=4, page_size=4, nheads_kv=2, headdim=HEADDIM, dtype=torch.float32,
                                   device=device)
    seq = paged.allocate()
    other = paged.allocate()
    paged.reserve(seq, 3)
    paged._lengths[seq] = 3
    free = paged.num_free_pages
    with pytest.raises(ValueError, match="already allocated"):
        paged.fork(seq, new_seq=other)
    assert paged.num_free_pages == free


def test_paged_attend_out_of_pages_changes_nothing(device, rng):
    paged = flashtile.PagedKVCache(num_blocks=3, page_size=4, nheads_kv=2, headdim=HEADDIM, dtype=torch.float32,
                                   device=device)
    seqs = [paged.allocate(), paged.allocate()]
    q, k, v = (randn(rng, 2, 6, 2, HEADDIM, device=device) for _ in range(3))
    with pytest.raises(RuntimeError, match="out of pages.*nothing was changed"):
        paged.attend(q, k, v, seqs)
    assert paged.num_free_pages == 3 and [paged.length(s) for s in seqs] == [0, 0]
    assert [paged.pages(s) for s in seqs] == [[], []]
    # A call that raises after the pages were taken (a bad option) gives them back too.
    with pytest.raises(TypeError):
        paged.attend(q[:, :1], k[:, :1], v[:, :1], seqs, softcap="x")
    assert paged.num_free_pages == 3 and [paged.pages(s) for s in seqs] == [[], []]


def test_attention_module_on_2d_input_names_the_shape():
    layer = flashtile.nn.Attention(64, 4)
    with pytest.raises(ValueError, match=r"x must be \(batch, seqlen, embed_dim\) = \(\*, \*, 64\), got \(5, 64\)"):
        layer(torch.randn(5, 64))


@pytest.mark.parametrize("name, value", [("causal", "no"), ("deterministic", "x"), ("causal", 1)])
def test_flags_must_be_real_bools(rng, name, value):
    q, k, v = (randn(rng, 1, 4, 2, HEADDIM) for _ in range(3))
    with pytest.raises(TypeError, match=rf"{name} must be a bool .*got {value!r}"):
        flashtile.flash_attn_func(q, k, v, **{name: value})


def test_set_strict_needs_a_bool():
    with pytest.raises(TypeError, match="strict must be a bool .*got 'no'"):
        flashtile.set_strict("no")


def test_qualify_fails_before_running_when_out_is_unwritable(tmp_path, capsys, monkeypatch):
    from flashtile.tools import qualify

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = []
    monkeypatch.setattr(qualify, "qualify_call", lambda *a, **k: ran.append(a))
    from flashtile.testing import run_cli

    code, out, err = run_cli(capsys, "qualify", "--config", "llama", "--batch", "1", "--prefill", "16", "--decode", "16",
                             "--out", str(blocker / "results"))
    assert code == 2 and not ran
    assert "--out" in out + err and "cannot write" in out + err


# ---------------------------------------------------------------- item 10

def test_huge_finite_bias_swamps_the_scores_a_bool_mask_does_not(rng):
    """An additive bias of -1e30 in float32 rounds every score of its row to the same value (the scores'
    differences are below its ulp): that row attends uniformly, as torch's SDPA does. To mask keys use a bool
    mask (or -inf), which is exact (docs/reliability.md)."""
    q, k, v = (randn(rng, 1, 3, 1, HEADDIM) for _ in range(3))
    bias = torch.zeros(1, 1, 3, 3)
    bias[..., 1, :] = -1e30
    out = flashtile.flash_attn_func(q, k, v, attn_bias=bias)
    torch.testing.assert_close(out[0, 1, 0], v[0, :, 0].mean(0), atol=1e-5, rtol=1e-5)
    keep = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    keep[..., 1, 2] = False
    masked = flashtile.flash_attn_func(q, k, v, attn_bias=keep)
    expected = torch.softmax(q[0, 1, 0] @ k[0, :2, 0].T / HEADDIM ** 0.5, -1) @ v[0, :2, 0]
    torch.testing.assert_close(masked[0, 1, 0], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the Hopper kernels (GPU only)

@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernels need an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [True, False], ids=["gluon-dkdv", "one-pass"])
@pytest.mark.parametrize("cu", [[0, 1000, 5000], [0, 3000, 2500, 4000], [-7, 1000, 4000]])
def test_gluon_kernels_keep_bad_offsets_inside(unchecked, deterministic, cu):
    """Packed d128 bf16 sequences long enough for the Gluon forward and (deterministic or not) the Gluon dK/dV or
    the one-pass backward, with offsets past the 4000 tokens, decreasing or negative: finite results, recorded."""
    gen = torch.Generator().manual_seed(len(cu))
    q, k, v = (torch.randn(4000, 8, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    cu_t = int32(cu, "cuda")
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_t, cu_t, 4000, 4000, deterministic=deterministic)
    out.float().sum().backward()
    torch.cuda.synchronize()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t.float()).all()
    assert recorded()["argument"] in ("cu_seqlens_q", "cu_seqlens_k")


@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernels need an sm_90 GPU")
def test_gluon_kvcache_forward_skips_a_bad_cache_row(unchecked):
    """Chunked prefill on the Gluon forward over a contiguous cache: a batch row whose cache_batch_idx names no
    row attends to nothing; the cache past the view is untouched."""
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(4, 2048, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    before = buf.clone()
    q, k, v = (torch.randn(2, 300, 8, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    out = flashtile.flash_attn_with_kvcache(q, buf[:2], buf[:2].clone(), k, v, cache_seqlens=int32([100, 100], "cuda"),
                                            cache_batch_idx=int32([0, 3], "cuda"), causal=True)
    assert torch.equal(buf[1:], before[1:])
    assert out[1].abs().max() == 0 and torch.isfinite(out.float()).all()
    assert recorded()["argument"] == "cache_batch_idx"
