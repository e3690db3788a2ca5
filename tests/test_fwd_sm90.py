"""The Gluon Hopper forward (kernels/fwd_sm90.py) through the public API, on an sm_90 GPU only.

The dispatcher picks it for 16-bit calls of at least ``GLUON_MIN_PAIRS`` (row, key) pairs at head dim 128
(half as many at 256): at 128 the 64x128 tile for full and causal rows (ALiBi and softcap too; long full
rows with softcap only where the row max is held fixed: bf16, softcap <= 51.9), the 64x64 tile for
sliding windows under 4096 keys, softcap with ALiBi and causal rows under 1024 keys; at 256 and 192/128 the
64x64 tile, at 64 the 64x64 tile on plain causal rows under 1024 keys alone (configs.py).
Full rows of GLUON_WS_FULL_KEYS keys and more and causal rows of GLUON_WS_CAUSAL_KEYS take the warp-specialized
kernel (kernels/fwd_sm90_ws.py) instead; the tests of the one-warpgroup kernel raise those floors, its own tests
(``ws_rows``) lower them. At d=64, 256 and 192/128 it takes them while configs.GLUON_WS_D64 / GLUON_WS_D256 /
GLUON_WS_D192 hold a tile: the ``ws_d64`` and ``wide`` tests make sure they do.
These tests check which kernel and tile ran (by the kernel counter) and hold out, lse and the gradients
(the Triton backward on its lse) to the tolerance rule.
Lengths are awkward: not multiples of the 64-row tiles, seqlen_q != seqlen_k, rows that see no key,
batches whose last key block runs past the sequence end (the TMA zero-fills it). Packed sequences (varlen)
hold NaN in every row past ``cu_seqlens[-1]`` and in the keys ``seqused_k`` leaves out, infinities in those
values: a tile that reads them must hide them. KV caches (chunked prefill through ``flash_attn_with_kvcache``)
hold infinities past each row's keys and before its left padding.
"""
import dataclasses

import pytest
import torch

import flashtile
from flashtile import testing, validation
from flashtile.backends import AttnArgs
from flashtile.backends.triton import configs, launch
from flashtile.testing import ATOL, assert_close_to_ref, assert_results_close, attention_ref, make_qkv
from flashtile.testing import reference_results

pytestmark = [pytest.mark.skipif(not testing.HOPPER, reason="the Gluon forward runs on sm_90 only"),
              pytest.mark.usefixtures("clean_dispatch_state")]
# Shapes here stay below the launch threshold (query rows x keys): lower it for these tests.
TEST_ROWS = 4096


@pytest.fixture(autouse=True)
def small_gluon_threshold(monkeypatch):
    monkeypatch.setattr(configs, "GLUON_MIN_PAIRS", TEST_ROWS)
    monkeypatch.setattr(configs, "GLUON_KV_MIN_PAIRS", TEST_ROWS)
    # The tests of the one-warpgroup kernel keep it on the long rows the warp-specialized one takes;
    # that one's tests (ws_rows) lower its floors instead.
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", 1 << 30)
    monkeypatch.setattr(configs, "GLUON_WS_CAUSAL_KEYS", 1 << 30)


WIDE, NARROW, SLIM, WS = "gluon-sm90 BN=128", "gluon-sm90 BN=64", "gluon-sm90-slim BN=64", "gluon-sm90-ws BN=128"


def ran(kernel: str) -> bool:
    """Whether a forward named like ``kernel`` has run: "<family> BN=<tile>" (that family exactly), or a
    prefix of names ("gluon-sm90": any of the Gluon Hopper kernels)."""
    family, *tile = kernel.split()
    if tile and family.startswith("gluon"):
        family = f"[{family} "
    return any(family in name and all(t + "]" in name for t in tile) for name in flashtile.stats()["kernels"])


def check(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, kernel=WIDE, sink=None, head_dims=(128, 128),
          **options):
    """Run the call, assert ``kernel`` ran, and hold out, lse and every gradient (``dsink`` too when
    a ``sink`` is given) to the tolerance rule. ``head_dims``: of q/k and of v."""
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dims[0], dtype, "cuda", requires_grad=True,
                       generator=rng)
    if head_dims[1] != head_dims[0]:
        v = torch.randn(*v.shape[:3], head_dims[1], generator=rng).to("cuda", dtype).requires_grad_()
    dout = torch.randn(*q.shape[:3], v.shape[3], generator=rng).to(device="cuda", dtype=dtype)
    if sink is not None:
        options["sink"] = sink
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert ran(kernel), flashtile.stats()["kernels"]
    leaves = (q, k, v) if sink is None else (q, k, v, sink)
    grads = torch.autograd.grad(out, leaves, dout)
    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv", "dsink"), grads))}
    ref_hi = reference_results(q, k, v, dout, hi=True, **options)
    ref_lo = reference_results(q, k, v, dout, hi=False, **options)
    assert_results_close(ours, ref_hi, ref_lo, dtype)
    return ours


def feature_options(rng, nheads, softcap=False, alibi=False, sink=False) -> dict:
    """Options for softcap 30, ALiBi slopes and sink logits of ``nheads`` heads, as asked."""
    options = {}
    if softcap:
        options["softcap"] = 30.0
    if alibi:
        options["alibi_slopes"] = torch.rand(nheads, generator=rng).to("cuda") * 0.3
    if sink:
        options["sink"] = torch.randn(nheads, generator=rng).to("cuda").requires_grad_()
    return options


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_causal_gqa(rng, dtype):
    check(rng, 2, TEST_ROWS + 37, TEST_ROWS + 37, 4, 2, dtype, causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_full_rows_gqa(rng, dtype):
    check(rng, 2, TEST_ROWS + 70, 1500, 4, 1, dtype)


@pytest.mark.parametrize("window, kernel", [((300, 0), SLIM), ((257, 33), SLIM), ((0, 0), SLIM),
                                            ((1000, -1), WIDE)])  # a left edge alone leaves rows of 4496 keys
def test_window_with_more_keys_than_queries(rng, window, kernel):
    check(rng, 1, TEST_ROWS + 5, TEST_ROWS + 400, 2, 1, torch.bfloat16, kernel, window_size=window)


@pytest.mark.parametrize("options", [dict(), dict(alibi=True, sink=True)], ids=["plain", "alibi-sink"])
def test_wide_window_takes_the_wide_tile(rng, options):
    features = feature_options(rng, 4, **options)
    check(rng, 1, 4200, 4300, 4, 2, torch.bfloat16, WIDE, window_size=(4000, 200), **features)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(700, 0)), dict(window_size=(-1, 300))],
                         ids=["full", "causal", "window", "right-window"])
@pytest.mark.parametrize("softcap, alibi, sink", [(s, a, k) for s in (False, True) for a in (False, True)
                                                  for k in (False, True) if s + a + k >= 2])
def test_feature_combinations(rng, mask, softcap, alibi, sink):
    """Every pair of softcap, ALiBi and sinks (and all three) on each mask, whichever tile the
    dispatcher picks."""
    check(rng, 1, TEST_ROWS + 11, 1900, 4, 2, torch.bfloat16, "gluon-sm90",
          **mask, **feature_options(rng, 4, softcap, alibi, sink))


def test_window_bounded_on_the_right_only(rng):
    check(rng, 1, TEST_ROWS + 5, TEST_ROWS + 400, 2, 1, torch.bfloat16, WIDE, window_size=(-1, 40))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap(rng, causal):
    # Causal rows of fewer than GLUON_SLIM_CAUSAL_KEYS keys take the slim 64x64 tile.
    check(rng, 2, TEST_ROWS + 100, 1000, 2, 2, torch.bfloat16, SLIM if causal else WIDE, causal=causal,
          softcap=20.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqlens", [(700, 700), (1000, 333), (257, 900)], ids=["square", "rows-see-none", "more-keys"])
def test_head_dim_64_short_causal_rows(rng, dtype, seqlens):
    """At d=64 plain causal rows under 1024 keys take the Gluon 64x64 tile (rows that see no key among them);
    other d=64 calls keep the Triton kernel."""
    check(rng, 3, *seqlens, 4, 2, dtype, NARROW, head_dims=(64, 64), causal=True)


@pytest.mark.parametrize("options", [dict(causal=True, softcap=20.0), dict(), dict(causal=True, seqlen=1500)],
                         ids=["softcap", "full", "long-causal"])
def test_head_dim_64_keeps_the_triton_kernel_elsewhere(rng, options):
    seqlen = options.pop("seqlen", 700)
    check(rng, 2, seqlen, seqlen, 4, 2, torch.bfloat16, "fwd[triton", head_dims=(64, 64), **options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_and_sink(rng, causal):
    slopes = torch.rand(2, 4, generator=rng).to("cuda") * 0.3
    sink = torch.randn(4, generator=rng).to("cuda").requires_grad_()
    check(rng, 2, TEST_ROWS + 3, TEST_ROWS + 3, 4, 2, torch.bfloat16, WIDE if causal else NARROW, sink=sink,
          causal=causal, window_size=(-1, -1) if causal else (700, 0), alibi_slopes=slopes)


@pytest.mark.parametrize("seqlens", [(TEST_ROWS + 70, TEST_ROWS + 70), (TEST_ROWS + 70, 1500), (1300, 3 * TEST_ROWS)],
                         ids=["square", "fewer-keys", "more-keys"])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(-1, 300))],
                         ids=["full", "causal", "right-window"])
def test_alibi_on_the_wide_tile(rng, seqlens, options):
    """The 64x128 tile takes key blocks wholly left or right of every row's diagonal key as a linear bias
    with a bounded row max, and blocks across it exactly: full rows hold all three kinds, and with
    seqlen_q != seqlen_k the diagonal runs off either end. Per-head slopes up to 8 (the bound then sits up
    to 69 above the true max) and down to 1e-6."""
    slopes = torch.cat([torch.tensor([8.0, 1e-6]), torch.rand(2, generator=rng)]).to("cuda")
    check(rng, 1, *seqlens, 4, 2, torch.bfloat16, WIDE, alibi_slopes=slopes, **options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_with_alibi_takes_the_narrow_tile(rng, causal):
    check(rng, 1, TEST_ROWS + 3, 2000, 4, 2, torch.bfloat16, NARROW, causal=causal,
          **feature_options(rng, 4, softcap=True, alibi=True))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_with_alibi_on_the_wide_tile_is_exact(rng, causal):
    """The dispatcher keeps softcap with ALiBi off the 64x128 tile, but the kernel must not depend on it:
    there its linear ALiBi form (raw scores plus a bias) would skip the cap."""
    q, k, v = make_qkv(1, 2000, 2000, 4, 2, 128, torch.bfloat16, "cuda", generator=rng)
    slopes = torch.rand(1, 4, generator=rng).to("cuda") * 0.3
    args = AttnArgs(softmax_scale=128 ** -0.5, causal=causal, window_right=0 if causal else -1, softcap=30.0,
                    alibi_slopes=slopes)
    out, lse = launch.forward(q, k, v, args, config=configs._FWD_SM90_GLUON_WIDE)
    dout = torch.randn_like(q)
    ref_hi, ref_lo = (reference_results(q, k, v, dout, hi=hi, causal=causal, softcap=30.0, alibi_slopes=slopes[0])
                      for hi in (True, False))
    assert_results_close({"out": out, "lse": lse}, *({n: r[n] for n in ("out", "lse")} for r in (ref_hi, ref_lo)),
                         torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(300, 0)), dict(window_size=(200, 40))],
                         ids=["causal", "window", "two-sided-window"])
@pytest.mark.parametrize("feature", ["", "softcap", "sink"])
def test_short_rows_take_the_slim_tile(rng, dtype, options, feature):
    """Causal rows under GLUON_SLIM_CAUSAL_KEYS keys and windows under GLUON_WIDE_WINDOW_KEYS keys, plain or with
    softcap or a sink, run the slim 64x64 tile (Q in shared memory, one key slot: three programs an SM)."""
    extra = feature_options(rng, 4, softcap=feature == "softcap", sink=feature == "sink")
    check(rng, 2, TEST_ROWS // 2 + 37, 2000, 4, 2, dtype, SLIM, **options, **extra)


def test_alibi_keeps_the_64x64_tile_on_short_rows(rng):
    """ALiBi takes more registers than three programs an SM leave: its short causal rows keep the 64x64 plan."""
    check(rng, 1, TEST_ROWS // 2 + 5, 700, 4, 2, torch.bfloat16, NARROW, causal=True,
          **feature_options(rng, 4, alibi=True))
    assert not ran(SLIM)


def test_rows_that_see_no_key(rng):
    """Causal with seqlen_q > seqlen_k: the first rows see nothing (out 0, lse -inf)."""
    ours = check(rng, 1, TEST_ROWS + 900, TEST_ROWS, 2, 2, torch.float16, causal=True)
    assert torch.all(ours["out"][:, :900] == 0) and torch.all(ours["lse"][:, :, :900] == float("-inf"))


def test_long_full_softcap_rows_keep_the_triton_kernel_without_a_fixed_row_max(rng):
    check(rng, 1, TEST_ROWS, TEST_ROWS * 2, 2, 2, torch.float16, kernel="fwd[triton", softcap=20.0)


@pytest.mark.parametrize("softcap", [30.0, 50.0, 51.9])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(-1, 40))],
                         ids=["full", "causal", "right-window"])
def test_softcap_with_a_fixed_row_max(rng, softcap, options):
    """bf16 and softcap <= 51.9: the kernel holds every row's max at configs.fixed_row_max. Long full rows
    (2 x TEST_ROWS keys) take the Gluon kernel then."""
    assert configs.fixed_row_max(softcap, torch.bfloat16, {"softcap"}) is not None
    check(rng, 1, TEST_ROWS + 33, 2 * TEST_ROWS + 100, 4, 2, torch.bfloat16, softcap=softcap, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softcap_below_the_softmax_scale_leaves_q_unscaled(rng, dtype):
    """The kernel folds softcap's scale (softmax_scale / softcap) into Q only when it is at most 1: a larger
    one could overflow 16-bit Q. Here it is 1.77 and Q's entries reach 6e4, which fp16 holds and 1.77 x 6e4
    does not: the output must be finite and right (the tanh saturates, so the softmax is near uniform). A
    call of the same shape with a folded scale runs first: the launch it caches must not serve this one."""
    q, k, v = make_qkv(1, TEST_ROWS + 7, TEST_ROWS + 7, 2, 2, 128, dtype, "cuda", requires_grad=False,
                       generator=rng)
    flashtile.flash_attn_func(q, k, v, softcap=30.0, causal=True)
    q = (q.float().clamp(-3, 3) * 2e4).to(dtype)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, softcap=0.05, causal=True, return_attn_probs=True)
    assert ran(WIDE)
    ref_out, ref_lse = attention_ref(q, k, v, softcap=0.05, causal=True)
    assert torch.isfinite(out).all()
    assert (out.float() - ref_out).abs().max() <= ATOL[dtype][0]
    assert (lse.float() - ref_lse).abs().max() <= ATOL[dtype][0]


@pytest.mark.parametrize("sign", [-1.0, 1.0], ids=["floor", "ceiling"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fixed_row_max_rows_pinned_at_the_cap(rng, sign, causal):
    """Every score at -cap (or +cap): each row's softmax is uniform over the keys it sees, whatever the
    fixed max, with values of 1e20 (no overflow in l or O)."""
    seqlen = TEST_ROWS + 5
    k = (10 + torch.rand(1, seqlen, 2, 128, generator=rng)).to(device="cuda", dtype=torch.bfloat16)
    q = torch.full((1, seqlen, 2, 128), sign * 10.0, device="cuda", dtype=torch.bfloat16)
    v = (torch.randn(1, seqlen, 2, 128, generator=rng) * 1e20).to(device="cuda", dtype=torch.bfloat16)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, softcap=50.0, return_attn_probs=True)
    assert ran(WIDE)
    if causal:
        expected = v.double().cumsum(1) / torch.arange(1, seqlen + 1, device="cuda").view(1, -1, 1, 1)
        keys = torch.arange(1, seqlen + 1, device="cuda", dtype=torch.float64)
    else:
        expected = v.double().mean(1, keepdim=True).expand_as(v)
        keys = torch.full((seqlen,), float(seqlen), device="cuda", dtype=torch.float64)
    scale = 1e20 * 2 ** -7  # bf16 rounding of the output, relative to the values' size
    assert (out.double() - expected).abs().max() <= 4 * scale
    assert torch.allclose(lse.double(), (sign * 50.0 + keys.log()).view(1, 1, -1).expand_as(lse), atol=1e-2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["sink_fp32", "sink_bf16"])
def test_sink_on_the_wide_tile(rng, causal, sink_dtype):
    """A sink in float32 or in the model's bf16 (read as float32 by the kernel; dsink comes back in bf16). Rows
    of GLUON_SLIM_CAUSAL_KEYS keys or more: shorter causal ones take the slim tile."""
    sink = torch.randn(4, generator=rng).to("cuda", sink_dtype).requires_grad_()
    seqlen_k = configs.GLUON_SLIM_CAUSAL_KEYS + 50
    ours = check(rng, 1, seqlen_k + 61, seqlen_k, 4, 4, torch.bfloat16, WIDE, sink=sink, causal=causal)
    assert ours["dsink"].dtype == sink_dtype


@pytest.fixture
def ws_rows(monkeypatch):
    """Rows of these tests' lengths take the warp-specialized kernel (its key floors lowered, and the short
    causal rows' tiles' ceilings)."""
    for floor in ("GLUON_WS_FULL_KEYS", "GLUON_WS_CAUSAL_KEYS"):
        monkeypatch.setattr(configs, floor, 128)
    for ceiling in ("GLUON_SLIM_CAUSAL_KEYS", "GLUON_SHORT_CAUSAL_KEYS"):
        monkeypatch.setattr(configs, ceiling, 0)


def assert_rows_see_none(ours: dict, seqlen_q: int, seqlen_k: int, causal: bool) -> None:
    """Causal rows before the first key (seqlen_q > seqlen_k) come out 0 with lse -inf."""
    if causal and seqlen_q > seqlen_k:
        none = seqlen_q - seqlen_k
        assert torch.all(ours["out"][:, :none] == 0) and torch.all(ours["lse"][:, :, :none] == float("-inf"))


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal) of the warp-specialized kernel's tests at every head dim.
WS_SHAPES = [
    pytest.param(2, 1000, 1000, 4, 4, False, id="full"),
    pytest.param(1, 1037, 1037, 4, 2, True, id="causal"),  # the last tile: 13 rows of consumer 1's 64
    pytest.param(2, 700, 1290, 6, 2, True, id="causal-more-keys"),  # more keys than queries: the diagonal moves right
    # Fewer: the first 590 rows see no key (consumer 0 reads no key block of some tiles).
    pytest.param(1, 1290, 700, 4, 4, True, id="causal-rows-see-none"),
    pytest.param(3, 40, 900, 4, 1, False, id="short-q"),  # one tile, consumer 1's rows all past the end
]


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal", WS_SHAPES + [
    pytest.param(1, 300, 4100, 2, 2, False, id="partial-block"),  # a partial last key block
])
def test_warp_specialized_forward(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    """Full and causal rows at head dim 128 take the warp-specialized kernel (fwd_sm90_ws.py): out, lse and the
    gradients (the Triton backward on its lse) against the reference."""
    ours = check(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, WS, causal=causal)
    assert_rows_see_none(ours, seqlen_q, seqlen_k, causal)


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["sink_fp32", "sink_bf16"])
def test_warp_specialized_forward_with_a_sink(rng, causal, sink_dtype):
    sink = torch.randn(4, generator=rng).to("cuda", sink_dtype).requires_grad_()
    ours = check(rng, 2, 900, 1100, 4, 2, torch.bfloat16, WS, sink=sink, causal=causal)
    assert ours["dsink"].dtype == sink_dtype


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, softcap, alibi, sink", [
    (torch.bfloat16, True, False, False),  # bf16 softcap 30: the row max held fixed, the scale folded into Q
    (torch.float16, True, False, False),  # fp16: a running max
    (torch.bfloat16, True, False, True),
    (torch.bfloat16, False, True, False),
    (torch.float16, False, True, True),
], ids=["softcap-fixed-max", "softcap-fp16", "softcap-sink", "alibi", "alibi-sink-fp16"])
def test_warp_specialized_forward_with_softcap_and_alibi(rng, causal, dtype, softcap, alibi, sink):
    check(rng, 2, 900, 1100, 4, 2, dtype, WS, causal=causal, **feature_options(rng, 4, softcap, alibi, sink))


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", [
    (1000, 1000, False),  # linear blocks left of the diagonal, exact ones on it, linear right, a partial last
    (1290, 700, False),  # fewer keys: the diagonal moves left (before key 0 for the first 590 rows)
    (700, 1290, False),  # more keys: it moves right
    (300, 4100, False),  # many blocks right of the diagonal, then the partial block
    (1037, 1037, True),  # causal: every visible key is left of (or on) the diagonal
], ids=["square", "fewer-keys", "more-keys", "long-right", "causal"])
def test_warp_specialized_alibi_with_model_slopes(rng, dtype, seqlen_q, seqlen_k, causal):
    """ALiBi on the warp-specialized kernel with slopes per batch row and head, geometric as models set them
    (1/4 .. 1/256, halved in the second row), so far keys still count and the linear blocks' bound on the row
    max is tested where it matters."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, 5) / 4) * torch.tensor([[1.0], [0.5]])
    check(rng, 2, seqlen_q, seqlen_k, 4, 2, dtype, WS, causal=causal, alibi_slopes=slopes.to("cuda"))


# A sink, or bf16 softcap 30: the scale folded into each consumer's Q rows in shared memory (FOLD_SCALE), which
# the TMA then overwrites with the CTA's next tile.
WALK_FEATURES = pytest.mark.parametrize("features", [dict(sink=True), dict(softcap=True)], ids=["sink", "softcap"])


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@WALK_FEATURES
def test_warp_specialized_forward_walks_many_tiles_per_cta(rng, monkeypatch, causal, features):
    """Three CTAs walk every tile (persistent): each consumer carries its ring position and Q buffer across
    tiles of different lengths, heads and batch rows."""
    monkeypatch.setattr(configs, "ws_ctas", lambda causal, tiles, sms: min(tiles, 3))
    check(rng, 2, 777, 777 if causal else 1500, 6, 3, torch.bfloat16, WS, causal=causal,
          **feature_options(rng, 6, **features))


WS_FLOORS = {False: configs.GLUON_WS_FULL_KEYS, True: configs.GLUON_WS_CAUSAL_KEYS}


@pytest.mark.parametrize("causal, extra, kernel", [(False, 0, WS), (False, -1, WIDE), (True, 0, WS), (True, -1, WIDE)],
                         ids=["full", "full-short", "causal", "causal-short"])
def test_warp_specialized_forward_takes_long_rows(rng, monkeypatch, causal, extra, kernel):
    """At its own floors: full rows of GLUON_WS_FULL_KEYS keys and causal rows of GLUON_WS_CAUSAL_KEYS
    (the rule looks at the keys: 300 queries keep the reference small)."""
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", WS_FLOORS[False])
    monkeypatch.setattr(configs, "GLUON_WS_CAUSAL_KEYS", WS_FLOORS[True])
    check(rng, 1, 300, WS_FLOORS[causal] + extra, 2, 2, torch.bfloat16, kernel, causal=causal)


def spy_ws_launches(monkeypatch) -> list:
    """``(q's head dim, tile)`` of each launch of the warp-specialized forward from now on (launch._forward_sm90_ws
    spied on), so a test sees the launcher itself run, not only the planned name."""
    launched = []
    real = launch._forward_sm90_ws

    def spy(q, k, v, out, lse, args, cfg, shape, features):
        launched.append((q.shape[-1], cfg))
        return real(q, k, v, out, lse, args, cfg, shape, features)

    monkeypatch.setattr(launch, "_forward_sm90_ws", spy)
    return launched


@pytest.fixture
def ws_d64(monkeypatch):
    """The two-consumer warp-specialized tile at head dim 64 (configs._FWD_SM90_GLUON_WS_D64, the one ALiBi keeps) as
    configs.GLUON_WS_D64, at its own key floors; returns the head dims of its launches (:func:`spy_ws_launches`), so a call that
    silently ran another kernel fails."""
    monkeypatch.setattr(configs, "GLUON_WS_D64", configs._FWD_SM90_GLUON_WS_D64)
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", WS_FLOORS[False])
    monkeypatch.setattr(configs, "GLUON_WS_CAUSAL_KEYS", WS_FLOORS[True])
    return spy_ws_launches(monkeypatch)


WS_D256, WS_D192 = "gluon-sm90-ws BN=64", "gluon-sm90-ws BN=128"
D256, D192 = (256, 256), (192, 128)
# The wide head dims' warp-specialized tiles: (q/k, v) head dims -> (their switch in configs, the tile, its name).
WIDE_WS = {D256: ("GLUON_WS_D256", "_FWD_SM90_GLUON_WS_D256", WS_D256),
           D192: ("GLUON_WS_D192", "_FWD_SM90_GLUON_WS_D192", WS_D192)}
WIDE_HEAD_DIMS = pytest.mark.parametrize("head_dims", [D256, D192], ids=["d256", "d192-128"])


def switch_on_wide_ws(monkeypatch, head_dims: tuple) -> list:
    """The warp-specialized tile of ``head_dims`` switched on (configs.GLUON_WS_D256 / GLUON_WS_D192, whatever the
    table holds); returns its launches (:func:`spy_ws_launches`)."""
    switch, tile, _ = WIDE_WS[head_dims]
    monkeypatch.setattr(configs, switch, getattr(configs, tile))
    return spy_ws_launches(monkeypatch)


def check_ws_d64(rng, launched, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype=torch.bfloat16, tile=None,
                 **options):
    """:func:`check` at head dim 64 on the warp-specialized kernel: its name in the kernel counter and one launch of
    ``tile`` (the d=64 tile, configs._FWD_SM90_GLUON_WS_D64, unless given)."""
    tile = tile or configs._FWD_SM90_GLUON_WS_D64
    ours = check(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, f"gluon-sm90-ws BN={tile.BLOCK_N}",
                 head_dims=(64, 64), **options)
    assert any("fwd[gluon-sm90-ws d=64 " in name for name in flashtile.stats()["kernels"]), flashtile.stats()
    assert launched == [(64, tile)], launched
    return ours


@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, dtype", [
    (2, 4100, 4100, 4, 4, False, torch.bfloat16),  # the full floor and 4 keys: a partial last key block
    (1, 4100, 4100, 8, 2, False, torch.float16),  # GQA 4
    (2, 300, 4100, 2, 1, False, torch.bfloat16),  # three tiles a head, consumer 1's last rows past the end
    (1, 8191, 8195, 4, 2, True, torch.bfloat16),  # causal at the floor: more keys, the diagonal moves right
    (1, 8200, 8192, 4, 4, True, torch.float16),  # fewer keys: the first 8 rows see none
], ids=["full", "full-gqa-fp16", "full-short-q", "causal-gqa", "causal-rows-see-none-fp16"])
def test_warp_specialized_forward_at_head_dim_64(rng, ws_d64, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal,
                                                 dtype):
    """Switched on, head dim 64 takes the warp-specialized kernel on full rows of GLUON_WS_FULL_KEYS keys and causal
    rows of GLUON_WS_CAUSAL_KEYS: out, lse and the gradients (the backward unchanged) against the reference."""
    ours = check_ws_d64(rng, ws_d64, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, causal=causal)
    if causal and seqlen_q > seqlen_k:
        none = seqlen_q - seqlen_k
        assert torch.all(ours["out"][:, :none] == 0) and torch.all(ours["lse"][:, :, :none] == float("-inf"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, softcap, alibi, sink", [
    (torch.bfloat16, False, False, True),
    (torch.bfloat16, True, False, False),  # bf16 softcap 30: the row max held fixed, the scale folded into Q
    (torch.float16, True, False, True),  # a running max
    (torch.bfloat16, False, True, False),
], ids=["sink", "softcap-fixed-max", "softcap-sink-fp16", "alibi"])
def test_warp_specialized_forward_at_head_dim_64_with_features(rng, ws_d64, causal, dtype, softcap, alibi, sink):
    seqlen = WS_FLOORS[causal] + 3
    check_ws_d64(rng, ws_d64, 1, seqlen, seqlen, 4, 2, dtype, causal=causal,
                 **feature_options(rng, 4, softcap, alibi, sink))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_warp_specialized_forward_at_head_dim_64_walks_many_tiles_per_cta(rng, monkeypatch, ws_d64, causal):
    """Three CTAs walk every tile (persistent), carrying ring positions and Q buffers across heads and rows."""
    monkeypatch.setattr(configs, "ws_ctas", lambda causal, tiles, sms: min(tiles, 3))
    seqlen = WS_FLOORS[causal] + 65
    check_ws_d64(rng, ws_d64, 1, seqlen if causal else 777, seqlen, 6, 3, causal=causal,
                 **feature_options(rng, 6, sink=True))


# Three consumer warpgroups (configs._FWD_SM90_GLUON_WS_D64_C3, GLUON_WS_D64's row): CTAs of 192 rows, the same with
# 64-key slots, and with the consumers taking turns at the tensor cores (pingpong: 0, 1, 2, 0, ... at every ring
# position, read or not). 1037 rows end 77 rows into a tile (consumer 1 holds 13, consumer 2 none), 1100 end 140 in
# (consumer 2 holds 12).
C3_TILES = {"c3": configs._FWD_SM90_GLUON_WS_D64_C3,
            "c3-n64": dataclasses.replace(configs._FWD_SM90_GLUON_WS_D64_C3, BLOCK_N=64),
            "c3-pp": dataclasses.replace(configs._FWD_SM90_GLUON_WS_D64_C3, pingpong=True)}


@pytest.fixture(params=list(C3_TILES))
def ws_d64_c3(request, monkeypatch) -> tuple:
    """A three-consumer tile switched on at d=64 (GLUON_WS_D64); returns its launches (:func:`spy_ws_launches`) and
    the tile."""
    tile = C3_TILES[request.param]
    monkeypatch.setattr(configs, "GLUON_WS_D64", tile)
    return spy_ws_launches(monkeypatch), tile


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal", WS_SHAPES + [
    pytest.param(1, 300, 4100, 2, 2, False, id="partial-block"),  # a partial last key block
    pytest.param(2, 1100, 1100, 4, 2, True, id="causal-1100"),  # consumer 2's last 12 rows
    pytest.param(1, 1100, 1037, 4, 4, True, id="causal-1100-rows-see-none"),  # the first 63 rows see no key
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_three_consumers_at_head_dim_64(rng, ws_d64_c3, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    """Awkward lengths on three consumers of 64 rows (its floors lowered): out, lse and the gradients against the
    reference, and rows before the first key 0 with lse -inf."""
    launched, tile = ws_d64_c3
    ours = check_ws_d64(rng, launched, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, tile, causal=causal)
    assert_rows_see_none(ours, seqlen_q, seqlen_k, causal)


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, softcap, sink", [
    (torch.bfloat16, False, True),
    (torch.bfloat16, True, False),  # bf16 softcap 30: the row max held fixed, the scale folded into each consumer's Q
    (torch.float16, True, False),  # fp16: a running max
    (torch.float16, True, True),
], ids=["sink", "softcap-fixed-max", "softcap-fp16", "softcap-sink-fp16"])
def test_three_consumers_at_head_dim_64_with_features(rng, ws_d64_c3, causal, dtype, softcap, sink):
    launched, tile = ws_d64_c3
    check_ws_d64(rng, launched, 2, 900, 1100, 4, 2, dtype, tile, causal=causal,
                 **feature_options(rng, 4, softcap, False, sink))


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_consumers_leave_alibi_to_two(rng, monkeypatch, causal):
    """Switched on, ALiBi (whose linear bias spills in 160 registers) runs two consumers' tile."""
    monkeypatch.setattr(configs, "GLUON_WS_D64", configs._FWD_SM90_GLUON_WS_D64_C3)
    launched = spy_ws_launches(monkeypatch)
    check_ws_d64(rng, launched, 2, 900, 1100, 4, 2, torch.bfloat16, configs._FWD_SM90_GLUON_WS_D64, causal=causal,
                 **feature_options(rng, 4, alibi=True, sink=True))


@pytest.mark.parametrize("tile", [configs._FWD_SM90_GLUON_WS_D64, *C3_TILES.values()], ids=["c2", *C3_TILES])
@pytest.mark.parametrize("seqlens, options, dtype", [
    # A left edge per consumer: each skips the blocks left of its rows.
    ((1037, 1300), dict(window_size=(300, 0)), torch.bfloat16),
    ((1100, 1000), dict(window_size=(257, 33)), torch.float16),  # two-sided, fewer keys
    ((900, 1100), dict(window_size=(700, -1)), torch.bfloat16),  # a left bound alone
    ((1100, 1100), dict(causal=True, alibi=True), torch.bfloat16),
    ((1037, 1300), dict(alibi=True, sink=True), torch.float16),
    ((1100, 1000), dict(window_size=(300, 0), softcap=True, sink=True), torch.bfloat16),
], ids=["window", "two-sided-window-fp16", "left-window", "causal-alibi", "full-alibi-sink-fp16",
        "window-softcap-sink"])
def test_three_consumers_run_what_the_dispatcher_keeps_from_them(rng, monkeypatch, tile, seqlens, options, dtype):
    """Windows and ALiBi never reach the three-consumer tile through the dispatcher, but the kernel takes them (each
    consumer's block range from its own rows, the linear ALiBi bias): through launch.forward's config, out and lse
    against the reference; two consumers (c2) alike, the control."""
    launched = spy_ws_launches(monkeypatch)
    q, k, v = make_qkv(2, *seqlens, 4, 2, 64, dtype, "cuda", generator=rng)
    options = dict(options)  # the parametrized dict is shared by every tile's run
    features = feature_options(rng, 4, options.pop("softcap", False), options.pop("alibi", False),
                               options.pop("sink", False))
    options.update(features)
    args = validation.attn_args(q, k, v, **options)
    out, lse = launch.forward(q, k, v, args, config=tile)
    assert launched == [(64, tile)], launched
    dout = torch.randn_like(q)
    ref_hi, ref_lo = (reference_results(q, k, v, dout, hi=hi, **options) for hi in (True, False))
    assert_results_close({"out": out, "lse": lse}, *({n: r[n] for n in ("out", "lse")} for r in (ref_hi, ref_lo)),
                         dtype)


@pytest.mark.usefixtures("ws_rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@WALK_FEATURES
def test_three_consumers_walk_many_tiles_per_cta(rng, monkeypatch, ws_d64_c3, causal, features):
    """Three CTAs walk every 192-row tile (persistent): three consumers carry ring positions and the Q buffers'
    phases across tiles of other lengths, heads and rows (softcap: each folds the scale into its Q rows, which the
    next tile's TMA overwrites)."""
    monkeypatch.setattr(configs, "ws_ctas", lambda causal, tiles, sms: min(tiles, 3))
    launched, tile = ws_d64_c3
    check_ws_d64(rng, launched, 2, 777, 777 if causal else 1500, 6, 3, torch.bfloat16, tile, causal=causal,
                 **feature_options(rng, 6, **features))


@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, dtype", [
    (2, 4100, 4100, 4, 4, False, torch.bfloat16),  # the full floor and 4 keys: a partial last key block
    (1, 4100, 4100, 8, 2, False, torch.float16),  # GQA 4
    (1, 8191, 8195, 4, 2, True, torch.bfloat16),  # causal at the floor: more keys, the diagonal moves right
    (1, 8200, 8192, 4, 4, True, torch.float16),  # fewer keys: the first 8 rows see none
], ids=["full", "full-gqa-fp16", "causal-gqa", "causal-rows-see-none-fp16"])
def test_three_consumers_at_head_dim_64_at_its_floors(rng, monkeypatch, ws_d64_c3, batch, seqlen_q, seqlen_k, nheads,
                                                     nheads_kv, causal, dtype):
    """At the real floors (GLUON_WS_FULL_KEYS / GLUON_WS_CAUSAL_KEYS): long rows, CTAs walking tiles round robin
    (full) or one a tile, longest first (causal)."""
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", WS_FLOORS[False])
    monkeypatch.setattr(configs, "GLUON_WS_CAUSAL_KEYS", WS_FLOORS[True])
    launched, tile = ws_d64_c3
    ours = check_ws_d64(rng, launched, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, tile, causal=causal)
    assert_rows_see_none(ours, seqlen_q, seqlen_k, causal)


def test_head_dim_64_keeps_the_triton_kernel_while_its_warp_specialized_row_is_off(rng, monkeypatch):
    """Switched off (GLUON_WS_D64 None), long d=64 rows run the Triton kernel."""
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", WS_FLOORS[False])
    monkeypatch.setattr(configs, "GLUON_WS_D64", None)
    check(rng, 1, 300, WS_FLOORS[False] + 4, 4, 2, torch.bfloat16, "fwd[triton", head_dims=(64, 64))


def check_wide_ws(rng, launched, head_dims, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, ws=True,
                  **options):
    """``check`` at head dims 256 or 192/128, and whether the warp-specialized launcher ran it (``ws``: its name in the
    kernel counter and one launch of its tile) or the 64x64 tile did."""
    _, tile, kernel = WIDE_WS[head_dims]
    ours = check(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, kernel if ws else NARROW,
                 head_dims=head_dims, **options)
    assert launched == ([(head_dims[0], getattr(configs, tile))] if ws else [])
    named = any(f"fwd[gluon-sm90-ws d={head_dims[0]} " in name for name in flashtile.stats()["kernels"])
    assert named == ws, flashtile.stats()["kernels"]
    return ours


@pytest.mark.parametrize("head_dims, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, ws", [
    (D256, 2, 1037, 4100, 4, 2, False, True),  # full at the floor, GQA, a partial last key block
    (D256, 1, 8191, 8191, 4, 2, False, True),  # 256 tiles on 132 SMs: CTAs walk two (persistent), the last partial
    (D256, 1, 8200, 8200, 2, 1, True, True),  # causal over the floor
    (D256, 1, 4100, 8192, 4, 2, True, True),  # causal at the floor, more keys than queries
    (D256, 1, 300, 4095, 2, 2, False, False),  # under the floors: the 64x64 tile
    (D256, 1, 300, 8191, 2, 2, True, False),
    (D192, 2, 1037, 4157, 4, 2, False, True),  # full at the floor, GQA, a last key block of 61 keys
    (D192, 2, 4096, 4096, 4, 4, False, True),  # DeepSeek's 2 x 4096, full
    (D192, 1, 16384, 16384, 2, 1, False, True),  # 256 tiles on 132 SMs: CTAs walk two (persistent)
    (D192, 1, 16384, 16384, 2, 2, True, True),  # 1 x 16384 causal: a CTA a tile, longest first
    (D192, 1, 4100, 8192, 4, 2, True, True),  # causal at the floor, more keys than queries
    (D192, 1, 8200, 8195, 2, 2, True, True),  # fewer keys: the first 5 rows see none
    (D192, 2, 4096, 4096, 4, 4, True, False),  # DeepSeek's 2 x 4096 causal: under the causal floor, the 64x64 tile
    (D192, 1, 300, 4095, 2, 2, False, False),  # one key under the full floor
], ids=["d256-full-4100", "d256-full-8191", "d256-causal-8200", "d256-causal-8192-gqa", "d256-full-under",
        "d256-causal-under", "d192-full-4157-gqa", "d192-full-2x4096", "d192-full-16384", "d192-causal-16384",
        "d192-causal-8192-gqa", "d192-causal-rows-see-none", "d192-causal-2x4096-under", "d192-full-under"])
def test_wide_warp_specialized_forward_at_its_floors(rng, monkeypatch, head_dims, batch, seqlen_q, seqlen_k, nheads,
                                                     nheads_kv, causal, ws):
    """Switched on, d=256 (64-key slots) and 192/128 (q and k as 128 + 64 columns, 128-key slots) take the
    warp-specialized kernel, one Q buffer, at d=128's key floors: out, lse and the gradients against the reference."""
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", WS_FLOORS[False])
    monkeypatch.setattr(configs, "GLUON_WS_CAUSAL_KEYS", WS_FLOORS[True])
    launched = switch_on_wide_ws(monkeypatch, head_dims)
    ours = check_wide_ws(rng, launched, head_dims, batch, seqlen_q, seqlen_k, nheads, nheads_kv, torch.bfloat16, ws,
                         causal=causal)
    assert_rows_see_none(ours, seqlen_q, seqlen_k, causal)


@pytest.mark.usefixtures("ws_rows")
@WIDE_HEAD_DIMS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal", WS_SHAPES)
def test_wide_warp_specialized_forward(rng, monkeypatch, head_dims, dtype, batch, seqlen_q, seqlen_k, nheads,
                                       nheads_kv, causal):
    """Awkward lengths at d=256 and 192/128 on the warp-specialized kernel (its floors lowered)."""
    launched = switch_on_wide_ws(monkeypatch, head_dims)
    ours = check_wide_ws(rng, launched, head_dims, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, causal=causal)
    assert_rows_see_none(ours, seqlen_q, seqlen_k, causal)


@pytest.mark.usefixtures("ws_rows")
@WIDE_HEAD_DIMS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, softcap, sink", [
    (torch.bfloat16, True, False),  # bf16 softcap 30: the row max held fixed, the scale folded into Q (both parts)
    (torch.float16, True, False),  # fp16: a running max
    (torch.bfloat16, False, True),
    (torch.bfloat16, True, True),
], ids=["softcap-fixed-max", "softcap-fp16", "sink", "softcap-sink"])
def test_wide_warp_specialized_forward_with_softcap_and_sink(rng, monkeypatch, head_dims, causal, dtype, softcap,
                                                             sink):
    launched = switch_on_wide_ws(monkeypatch, head_dims)
    check_wide_ws(rng, launched, head_dims, 2, 900, 1100, 4, 2, dtype, causal=causal,
                  **feature_options(rng, 4, softcap, False, sink))


@pytest.mark.usefixtures("ws_rows")
@WIDE_HEAD_DIMS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("features, left", [(dict(alibi=True, sink=True), -1), (dict(), 700)],
                         ids=["alibi-sink", "window"])
def test_wide_alibi_and_windows_keep_the_64x64_tile(rng, monkeypatch, head_dims, causal, features, left):
    """ALiBi spills on the warp-specialized kernel at d=256 (configs.GLUON_WS_D256_FEATURES; GLUON_WS_D192_FEATURES
    leave it out too), and windows with a left bound keep the one-warpgroup tiles: switched on or not, the 64x64 tile
    runs them."""
    launched = switch_on_wide_ws(monkeypatch, head_dims)
    mask = dict(window_size=(left, 0 if causal else 300)) if left >= 0 else dict(causal=causal)
    check_wide_ws(rng, launched, head_dims, 1, 900, 1100, 4, 2, torch.bfloat16, False, **mask,
                  **feature_options(rng, 4, **features))


@pytest.mark.usefixtures("ws_rows")
@WIDE_HEAD_DIMS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@WALK_FEATURES
def test_wide_warp_specialized_forward_walks_many_tiles_per_cta(rng, monkeypatch, head_dims, causal, features):
    """Three CTAs walk every tile: with one Q buffer (and at 192/128 its tail) each tile's Q waits for both consumers'
    last S of the tile before (their ring positions and the buffer's phase carried across tiles of other lengths,
    heads and rows)."""
    monkeypatch.setattr(configs, "ws_ctas", lambda causal, tiles, sms: min(tiles, 3))
    launched = switch_on_wide_ws(monkeypatch, head_dims)
    check_wide_ws(rng, launched, head_dims, 2, 777, 777 if causal else 1500, 6, 3, torch.bfloat16, causal=causal,
                  **feature_options(rng, 6, **features))


def test_d192_keeps_the_64x64_tile_while_its_warp_specialized_row_is_off(rng, monkeypatch):
    """Switched off (GLUON_WS_D192 None), long 192/128 rows run the 64x64 tile."""
    monkeypatch.setattr(configs, "GLUON_WS_FULL_KEYS", WS_FLOORS[False])
    monkeypatch.setattr(configs, "GLUON_WS_D192", None)
    launched = spy_ws_launches(monkeypatch)
    check(rng, 1, 300, WS_FLOORS[False] + 61, 4, 2, torch.bfloat16, NARROW, head_dims=D192)
    assert launched == []


def test_inputs_the_tma_cannot_read_fall_back_to_triton_and_are_recorded(rng):
    """A q starting 2 bytes past 16-byte alignment: the Triton kernel runs it, and the fallback is recorded."""
    base = torch.randn(1, TEST_ROWS, 2, 129, generator=rng).to(device="cuda", dtype=torch.bfloat16)
    q = base[..., 1:]
    k, v = (torch.randn(1, TEST_ROWS, 2, 128, generator=rng).to(device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    with pytest.warns(RuntimeWarning, match="TMA"):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert any("TMA" in reason for reason in flashtile.stats()["fallbacks"])
    ref_hi = reference_results(q, k, v, torch.ones_like(q), hi=True, causal=True)["out"]
    ref_lo = reference_results(q, k, v, torch.ones_like(q), hi=False, causal=True)["out"]
    assert (out.float() - ref_hi).abs().max() <= 2 * (ref_lo.float() - ref_hi).abs().max() + 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqlens, options", [
    ((1100, 1100), dict(causal=True)),
    ((1000, 1500), dict()),
    ((1300, 900), dict(causal=True)),  # rows that see no key
    ((1000, 1200), dict(window_size=(300, 0))),
    ((1200, 1000), dict(window_size=(257, 33))),
], ids=["causal", "full-more-keys", "causal-fewer-keys", "window", "two-sided-window"])
@pytest.mark.parametrize("head_dims", [(256, 256), (192, 128)], ids=["256", "192-128"])
def test_head_dims_256_and_192(rng, head_dims, dtype, seqlens, options):
    """Head dim 256 runs the 64x64 tile with Q in shared memory and one key and one value slot; 192/128
    reads q and k as 128 + 64 columns (the kernel's TAIL)."""
    check(rng, 2, *seqlens, 4, 2, dtype, NARROW, head_dims=head_dims, **options)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(700, 0))], ids=["causal", "window"])
@pytest.mark.parametrize("softcap, alibi, sink", [(True, False, False), (False, True, True), (True, True, True)],
                         ids=["softcap", "alibi-sink", "all-three"])
@pytest.mark.parametrize("head_dims", [(256, 256), (192, 128)], ids=["256", "192-128"])
def test_head_dims_256_and_192_features(rng, head_dims, mask, softcap, alibi, sink):
    """Gemma-2's softcap and sliding window, and ALiBi and sinks, at head dims 256 and 192/128."""
    check(rng, 1, 1500, 1500, 4, 2, torch.bfloat16, NARROW, head_dims=head_dims, **mask,
          **feature_options(rng, 4, softcap, alibi, sink))


def check_packed(rng, lengths_q, lengths_k, nheads, nheads_kv, dtype, kernel, **options):
    """testing.check_packed, and ``kernel`` ran the forward."""
    testing.check_packed(rng, lengths_q, lengths_k, nheads, nheads_kv, dtype, **options)
    assert ran(kernel), flashtile.stats()["kernels"]


# Empty sequences, one row, a tile's width and one either side, and long ones.
LENGTHS_Q, LENGTHS_K = testing.PACKED_LENGTHS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(rng, dtype, causal):
    """Causal rows of these lengths (under GLUON_SLIM_CAUSAL_KEYS keys) take the slim tile, full rows the wide one."""
    check_packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, dtype, SLIM if causal else WIDE, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_seqused_k(rng, causal):
    """The keys past seqused_k hold NaN and infinite values, read by the TMA in the last key block."""
    check_packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, torch.bfloat16, SLIM if causal else WIDE,
                 seqused_k=[299, 0, 1, 1000, 0, 77, 65, 1337], causal=causal)


@pytest.mark.parametrize("softcap, alibi, sink", [(False, False, False), (True, True, True), (False, True, True)],
                         ids=["plain", "all-three", "alibi-sink"])
def test_varlen_window_and_features(rng, softcap, alibi, sink):
    options = feature_options(rng, 4, softcap, alibi, sink)
    if alibi:
        options["alibi_slopes"] = torch.rand(len(LENGTHS_Q), 4, generator=rng).to("cuda") * 0.3  # per sequence
    # Plain windows take the slim 64x64 tile; ALiBi keeps the two-program one.
    check_packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, torch.bfloat16, NARROW if alibi else SLIM, window_size=(200, 0),
                 **options)


@pytest.mark.parametrize("head_dims", [(256, 256), (192, 128)], ids=["256", "192-128"])
def test_varlen_head_dims(rng, head_dims):
    check_packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, torch.bfloat16, NARROW, head_dims=head_dims, causal=True,
                 seqused_k=[299, 0, 1, 999, 0, 77, 65, 1337])


def check_kvcache(rng, seqlens, seqlen_q, seqlen_new, capacity, nheads, nheads_kv, dtype, kernel, head_dims=(128, 128),
                  leftpad=None, batch_idx=False, **options):
    """A KV-cache call held to attention_ref of every batch row over its keys ``[leftpad, seqlens + seqlen_new)``;
    the cache rows outside them hold infinities, and the caches after the call must be the expected append."""
    batch = len(seqlens)
    rows = torch.randperm(batch + 2, generator=rng)[:batch] if batch_idx else torch.arange(batch)
    q = torch.randn(batch, seqlen_q, nheads, head_dims[0], generator=rng).to("cuda", dtype)
    k_new, v_new = (torch.randn(batch, seqlen_new, nheads_kv, dim, generator=rng).to("cuda", dtype)
                    for dim in head_dims)
    caches = [torch.randn(batch + 2 if batch_idx else batch, capacity, nheads_kv, dim, generator=rng).to("cuda", dtype)
              for dim in head_dims]
    first = leftpad or [0] * batch
    for b, row in enumerate(rows.tolist()):
        for cache in caches:
            cache[row, seqlens[b] + seqlen_new:] = float("inf")
            cache[row, :first[b]] = float("inf")
    expected = [cache.clone() for cache in caches]
    for b, row in enumerate(rows.tolist()):
        for cache, new in zip(expected, (k_new, v_new)):
            cache[row, seqlens[b]:seqlens[b] + seqlen_new] = new[b]
    kwargs = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"))
    if leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device="cuda")
    if batch_idx:
        kwargs["cache_batch_idx"] = rows.to("cuda", torch.int32)
    out, lse = flashtile.flash_attn_with_kvcache(q, *caches, k_new if seqlen_new else None,
                                                 v_new if seqlen_new else None, return_softmax_lse=True,
                                                 **kwargs, **options)
    assert ran(kernel), flashtile.stats()["kernels"]
    assert all(torch.equal(cache, want) for cache, want in zip(caches, expected)), "the append differs"
    slopes = options.pop("alibi_slopes", None)
    for upcast in (True, False):
        refs = [attention_ref(q[b:b + 1], *(cache[row:row + 1, first[b]:seqlens[b] + seqlen_new] for cache in expected),
                              upcast=upcast, alibi_slopes=None if slopes is None else slopes.expand(batch, -1)[b:b + 1],
                              **options) for b, row in enumerate(rows.tolist())]
        if upcast:
            ref_hi = [torch.cat(parts) for parts in zip(*refs)]
        else:
            ref_lo = [torch.cat(parts) for parts in zip(*refs)]
    assert_close_to_ref("out", out, ref_hi[0], ref_lo[0], ATOL[dtype][0])
    assert_close_to_ref("lse", lse, ref_hi[1], ref_lo[1], ATOL[dtype][0])


KV_WIDE, KV_NARROW, KV_SLIM = "decode[gluon-sm90 BN=128", "decode[gluon-sm90 BN=64", "decode[gluon-sm90-slim BN=64"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kvcache_chunked_prefill(rng, dtype):
    """Chunked prefill: 300 new tokens after an empty cache, after 1200 (filling the capacity) and after 517
    (causal rows of under GLUON_SLIM_CAUSAL_KEYS keys: the slim tile)."""
    check_kvcache(rng, [0, 1200, 517], 300, 300, 1500, 4, 2, dtype, KV_SLIM, causal=True)


def test_kvcache_leftpad_and_batch_idx(rng):
    check_kvcache(rng, [40, 900, 517], 200, 200, 1500, 4, 1, torch.bfloat16, KV_SLIM, leftpad=[0, 333, 517],
                  batch_idx=True, causal=True)


def test_kvcache_queries_without_append(rng):
    """More queries than new tokens: full rows over the cache alone."""
    check_kvcache(rng, [1000, 1, 1499], 257, 0, 1500, 4, 2, torch.bfloat16, KV_WIDE)


def test_kvcache_window_and_features(rng):
    options = feature_options(rng, 4, softcap=True, alibi=True, sink=True)
    check_kvcache(rng, [0, 1200, 517], 300, 300, 1500, 4, 2, torch.bfloat16, KV_NARROW, causal=True,
                  window_size=(200, 0), **options)


def test_kvcache_head_dim_256(rng):
    check_kvcache(rng, [0, 1000, 517], 300, 300, 1500, 4, 2, torch.bfloat16, KV_NARROW, head_dims=(256, 256),
                  causal=True)


def test_kvcache_decode_steps_keep_the_kv_cache_kernel(rng):
    check_kvcache(rng, [0, 1200, 517], 1, 1, 1500, 4, 2, torch.bfloat16, "decode[triton", causal=True)
