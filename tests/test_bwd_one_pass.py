"""The one-pass Hopper backward (kernels/bwd_sm90_ws.py, and bwd_sm90_wide.py at 192/128, 192/192 and 256, with
bwd_sm90_wide96.py's 96-key CTAs at 192/128 unless softcap, ALiBi, or a window on packed sequences) through the
public API, on an sm_90 GPU only.

The dispatcher gives it 16-bit calls at head dim 128, 192 with values of 128 or 192, and 256 (windows, softcap, ALiBi,
sinks, packed sequences, alone and together) once its CTAs fill the GPU, unless the call is deterministic. These
shapes are small, so the GPU is made to look one SM wide. The tests check which backward ran (by its name in the
kernel counter) and hold out, lse and every gradient to the tolerance rule against the float32 reference, on awkward
lengths: not multiples of 64 or 128, seqlen_q != seqlen_k, rows that see no key, a last key block past the
sequence end, GQA groups of 1 to 4; packed sequences of length 0, 1 and either side of a 64-row tile, NaN in the
rows past the last one and in the keys seqused_k leaves out. Its dQ is added up in float32 in an order that
varies; dK and dV do not, and ``deterministic=True`` takes the dK/dV + dQ pair, bit-identical run to run.
"""
import pytest
import torch

import flashtile
from flashtile import testing
from flashtile.backends.triton import configs
from flashtile.testing import assert_results_close, make_qkv, reference_results

pytestmark = [pytest.mark.skipif(not testing.HOPPER, reason="the one-pass backward runs on sm_90 only"),
              pytest.mark.usefixtures("clean_dispatch_state")]
ONE_PASS, PAIR = "one-pass", "dkdv=gluon-sm90 BM64xBN64"
# The wide kernel's name, and the (q/k, v) head dims the tests below run on each kernel.
WIDE = "gluon-sm90-wide"
WIDE_HEAD_DIMS = [(192, 128), (192, 192), (256, 256)]
WIDE_HEAD_DIM_IDS = ["d192", "d192v192", "d256"]
HEAD_DIMS = [(128, 128)] + WIDE_HEAD_DIMS
HEAD_DIM_IDS = ["d128"] + WIDE_HEAD_DIM_IDS


@pytest.fixture(autouse=True)
def one_sm(monkeypatch):
    """Small shapes fill a GPU of one SM, unsplit."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 1)
    monkeypatch.setattr(configs, "BWD_SPLIT_MIN_PAIRS", 1 << 62)
    monkeypatch.setattr(configs, "ONE_PASS_D64_MIN_PAIRS", 1)


def ran(name: str) -> bool:
    return testing.ran_backward(name)


def one_pass_kernel(head_dim: int) -> str:
    """The name of the one-pass backward the dispatcher gives a 16-bit call at ``head_dim``."""
    return WIDE if head_dim > 128 else ONE_PASS


def run(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype=torch.bfloat16, kernel=ONE_PASS, **options):
    """Forward and backward; assert ``kernel`` ran the backward, hold every result to the tolerance rule."""
    return testing.check_dense_16bit(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, kernel, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal",
                         testing.SM90_BWD_SHAPES + [(1, 77, 77, 2, 1, True)],
                         ids=testing.SM90_BWD_SHAPE_IDS + ["tiny"])  # tiny: one CTA, one partial query block
def test_one_pass(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    run(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal",
                         testing.SM90_BWD_SHAPES + [(1, 77, 77, 2, 1, True), (2, 4200, 4200, 2, 2, True)],
                         ids=testing.SM90_BWD_SHAPE_IDS + ["tiny", "long"])
def test_one_pass_d64(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    """Head dim 64 steps 128 query rows (one_pass_rows): partial 128-row steps, rows that see no key, GQA."""
    assert configs.one_pass_rows(64, frozenset()) == 128
    run(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, kernel="one-pass BM128", causal=causal, head_dim=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal",
                         testing.SM90_BWD_SHAPES + [(1, 77, 77, 2, 1, True), (2, 4200, 4200, 2, 2, True)],
                         ids=testing.SM90_BWD_SHAPE_IDS + ["tiny", "long"])
@pytest.mark.parametrize("head_dim, head_dim_v", WIDE_HEAD_DIMS, ids=WIDE_HEAD_DIM_IDS)
def test_one_pass_wide(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, head_dim, head_dim_v):
    """Head dim 192 with values of 128 or 192, and 256, on the wide kernel (64-key CTAs, the consumers splitting dK,
    dV and dQ by columns, each tensor read as 128 + 64 or 128 + 128 columns; one Q/dO slot at 256): partial blocks,
    rows that see no key, GQA, a long causal row."""
    run(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, kernel=WIDE, causal=causal, head_dim=head_dim,
        head_dim_v=head_dim_v)


@pytest.mark.parametrize("window, causal", testing.SM90_BWD_WINDOWS, ids=testing.SM90_BWD_WINDOW_IDS)
@pytest.mark.parametrize("head_dim, head_dim_v", [(64, 64)] + HEAD_DIMS, ids=["d64"] + HEAD_DIM_IDS)
def test_one_pass_windows(rng, window, causal, head_dim, head_dim_v):
    """Query blocks wholly outside a CTA's window are skipped; the ones straddling an edge are masked."""
    run(rng, 2, 777, 900, 4, 2, window_size=window, causal=causal, head_dim=head_dim, head_dim_v=head_dim_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature", ["softcap", "softcap-below-scale", "softcap-window", "sink"])
@pytest.mark.parametrize("head_dim, head_dim_v", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_features(rng, dtype, causal, feature, head_dim, head_dim_v):
    """Softcap (dS takes 1 - tanh^2, kept in float16 at d128), below the softmax scale too, with a two-sided window
    and GQA 3; a sink (only through the lse; its gradient comes from the preprocess's delta)."""
    options = {}
    nheads, nheads_kv = 4, 2
    if feature == "softcap":
        options["softcap"] = 30.0
    elif feature == "softcap-below-scale":
        options["softcap"] = 0.05
    elif feature == "softcap-window":
        options.update(softcap=20.0, window_size=(150, 40) if not causal else (150, 0))
        nheads, nheads_kv = 6, 2
    else:
        options["sink"] = torch.randn(nheads, generator=rng).to("cuda").requires_grad_()
    run(rng, 2, 900, 1100, nheads, nheads_kv, dtype, kernel=one_pass_kernel(head_dim), causal=causal,
        head_dim=head_dim, head_dim_v=head_dim_v, **options)


@pytest.mark.parametrize("case", ["full", "causal", "causal-more-keys", "causal-rows-see-none", "left-window",
                                  "causal-window-softcap"])
@pytest.mark.parametrize("head_dim, head_dim_v", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_alibi(rng, case, head_dim, head_dim_v):
    """ALiBi with geometric slopes per (batch row, head), as models use them, GQA 2: full rows take the absolute
    distance; causal ones at d128 (keys past the diagonal never seen) the bias as a key term and a query term in the
    lse, with the diagonal moved either way (the wide kernel takes the exact distance everywhere)."""
    slopes = (2.0 ** (-8.0 * torch.arange(1, 5) / 4) * torch.tensor([[1.0], [0.5]])).to("cuda")
    shape, options = {"full": ((2, 900, 1100), {}), "causal": ((2, 1037, 1037), dict(causal=True)),
                      "causal-more-keys": ((2, 700, 1290), dict(causal=True)),
                      "causal-rows-see-none": ((2, 1290, 700), dict(causal=True)),
                      "left-window": ((2, 700, 700), dict(window_size=(200, -1))),
                      "causal-window-softcap": ((2, 900, 1000), dict(window_size=(300, 0), softcap=30.0))}[case]
    run(rng, *shape, 4, 2, kernel=one_pass_kernel(head_dim), alibi_slopes=slopes, head_dim=head_dim,
        head_dim_v=head_dim_v, **options)


def test_alibi_right_window_keeps_the_pair(rng):
    """A right bound past the diagonal: ALiBi's distance changes sign inside the window; the pair runs it at head
    dim 128, the wide kernel (exact distance) at 192 and 256."""
    slopes = (2.0 ** (-8.0 * torch.arange(1, 5) / 4)).to("cuda")
    run(rng, 1, 700, 700, 4, 2, kernel="dkdv=BM", window_size=(100, 50), alibi_slopes=slopes)
    for head_dim, head_dim_v in WIDE_HEAD_DIMS:
        run(rng, 1, 700, 700, 4, 2, kernel=WIDE, window_size=(100, 50), alibi_slopes=slopes, head_dim=head_dim,
            head_dim_v=head_dim_v)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads, nheads_kv", [(4, 2), (3, 3), (4, 1)], ids=["gqa-2", "mha", "gqa-4"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_varlen(rng, dtype, causal, nheads, nheads_kv, head_dims):
    testing.check_packed(rng, *testing.PACKED_LENGTHS, nheads, nheads_kv, dtype, head_dims, causal=causal)
    assert ran(one_pass_kernel(head_dims[0])), flashtile.stats()["kernels"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_varlen_seqused_k(rng, causal, head_dims):
    """seqused_k: the keys it leaves out (NaN and infinite values) are zeroed in shared memory, so they get zero
    gradients and add nothing to dQ."""
    testing.check_packed(rng, *testing.PACKED_LENGTHS, 4, 2, torch.bfloat16, head_dims, causal=causal,
                         seqused_k=testing.PACKED_SEQUSED_K)
    assert ran(one_pass_kernel(head_dims[0])), flashtile.stats()["kernels"]


@pytest.mark.parametrize("options", [dict(window_size=(200, 0)), dict(window_size=(150, 40), softcap=20.0),
                                     dict(causal=True, softcap=30.0, sink=True), dict(causal=True, alibi=True),
                                     dict(alibi=True), dict(window_size=(100, 0), seqused=True)],
                         ids=["window", "two-sided-softcap", "causal-softcap-sink", "causal-alibi", "full-alibi",
                              "window-seqused"])
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_varlen_features(rng, options, head_dims):
    """Packed sequences with the other features, each sequence's masks and ALiBi distances counted from its own
    first row and key."""
    options = dict(options)  # each head dim's run gets its own copy of the parametrized dict
    if options.pop("sink", False):
        options["sink"] = torch.randn(4, generator=rng).to("cuda").requires_grad_()
    if options.pop("alibi", False):
        options["alibi_slopes"] = (2.0 ** (-8.0 * torch.arange(1, 5) / 4)).to("cuda")
    if options.pop("seqused", False):
        options["seqused_k"] = testing.PACKED_SEQUSED_K
    testing.check_packed(rng, *testing.PACKED_LENGTHS, 4, 2, torch.bfloat16, head_dims, **options)
    assert ran(one_pass_kernel(head_dims[0])), flashtile.stats()["kernels"]


@pytest.mark.parametrize("head_dim, head_dim_v", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_large_logits(rng, head_dim, head_dim_v):
    """q x 30: logits near +-100, where only the saved lse keeps exp2 finite."""
    q, k, v = make_qkv(1, 513, 513, 2, 2, head_dim, torch.bfloat16, "cuda", generator=rng)
    q = (q * 30).requires_grad_()
    v = v[..., :head_dim_v].contiguous()
    k.requires_grad_(), v.requires_grad_()
    dout = torch.randn(*q.shape[:3], head_dim_v, generator=rng).to("cuda", torch.bfloat16)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert ran(one_pass_kernel(head_dim)), flashtile.stats()["kernels"]
    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))}
    assert_results_close(ours, reference_results(q, k, v, dout, hi=True, causal=True),
                         reference_results(q, k, v, dout, hi=False, causal=True), torch.bfloat16)


@pytest.mark.parametrize("head_dim, head_dim_v", HEAD_DIMS, ids=HEAD_DIM_IDS)
def test_one_pass_dk_dv_repeat_exactly(rng, head_dim, head_dim_v):
    """dK and dV have no reduce between CTAs: bit-identical run to run; dQ only up to float32 rounding."""
    q, k, v = make_qkv(2, 1100, 1100, 8, 2, head_dim, torch.bfloat16, "cuda", requires_grad=True, generator=rng)
    v = v[..., :head_dim_v].detach().contiguous().requires_grad_()
    dout = torch.randn(*q.shape[:3], head_dim_v, generator=rng).to("cuda", torch.bfloat16)
    first = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    assert ran(one_pass_kernel(head_dim))
    for _ in range(3):
        again = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
        assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])
        assert torch.allclose(first[0].float(), again[0].float(), rtol=1e-2, atol=1e-3)


# The wide kernel's tuning variants (configs.OnePassConfig fields over the head dim's), as sweeps pass them.
WIDE_VARIANTS = {"dq_first": dict(dq_first=True), "release_each": dict(release_each=True), "rotate": dict(rotate=True),
                 "all": dict(dq_first=True, release_each=True, rotate=True), "stages1": dict(stages=1, rotate=True)}


@pytest.mark.parametrize("variant", list(WIDE_VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, head_dim_v", WIDE_HEAD_DIMS[:2], ids=WIDE_HEAD_DIM_IDS[:2])
def test_wide_variants(rng, variant, causal, head_dim, head_dim_v):
    """launch.backward's ``one_pass`` runs the wide kernel with a sweep's knobs (dQ's product first, each dQ buffer
    released once read, walks rotated per CTA, one Q/dO slot): every gradient (poisoned first) to the tolerance rule,
    on a GQA call of uneven lengths whose last key block and query block are partial."""
    from dataclasses import replace

    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import launch

    q, k, v = make_qkv(2, 333, 461, 4, 2, head_dim, torch.bfloat16, "cuda", generator=rng)
    v = v[..., :head_dim_v].contiguous()
    dout = torch.randn(*q.shape[:3], head_dim_v, generator=rng).to("cuda", torch.bfloat16)
    args = AttnArgs(softmax_scale=head_dim ** -0.5, causal=causal, window_right=0 if causal else -1)
    out, lse = launch.forward(q, k, v, args)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    tiles = replace(configs.one_pass_config(head_dim), **WIDE_VARIANTS[variant])
    launch.backward(dout, q, k, v, out, lse, args, *grads, one_pass=tiles)
    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))}
    assert_results_close(ours, reference_results(q, k, v, dout, hi=True, causal=causal),
                         reference_results(q, k, v, dout, hi=False, causal=causal), torch.bfloat16)


# The knobs of the kernel at head dims 64 and 128 (kernels/bwd_sm90_ws.py; configs.OnePassConfig fields over the head
# dim's): FA3's order (dQ's product before dK's, dQ staged under dK's), dK's product from registers, both, at head
# dim 64's 128-row steps dQ split by rows, alone and with the other two (FA3's plan), and at 128 the next step's S^T
# issued before this step's products are waited on, alone and with FA3's order.
# dK's product from registers does not take s_ahead (head dim 128's default): those variants turn it off.
WS_VARIANTS = {"dq_first": dict(dq_first=True), "dk_rs": dict(dk_rs=True, s_ahead=False),
               "both": dict(dq_first=True, dk_rs=True, s_ahead=False), "dq_rows": dict(dq_rows=True),
               "fa3": dict(dq_first=True, dk_rs=True, dq_rows=True, s_ahead=False),
               "s_ahead": dict(s_ahead=True), "s_ahead-dq_first": dict(s_ahead=True, dq_first=True)}
# (variant, head dim): dq_rows at head dim 64 only, s_ahead at 128 only.
WS_CASES = [(variant, head_dim) for head_dim in (64, 128) for variant in WS_VARIANTS
            if (head_dim == 64 or "dq_rows" not in WS_VARIANTS[variant])
            and (head_dim == 128 or not WS_VARIANTS[variant].get("s_ahead"))]
WS_CASE_IDS = [f"{variant}-d{head_dim}" for variant, head_dim in WS_CASES]


def variant_configs(monkeypatch, knobs: dict) -> None:
    """Make every one-pass call at head dims 64 and 128 run with ``knobs`` (OnePassConfig fields over the default's)."""
    from dataclasses import replace

    default = configs.one_pass_config
    monkeypatch.setattr(configs, "one_pass_config", lambda head_dim, keys96=False, features=frozenset(): replace(
        default(head_dim, keys96, features), **knobs))


@pytest.mark.parametrize("variant, head_dim", WS_CASES, ids=WS_CASE_IDS)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal",
                         testing.SM90_BWD_SHAPES + [(1, 77, 77, 2, 1, True)],
                         ids=testing.SM90_BWD_SHAPE_IDS + ["tiny"])
def test_ws_variants(rng, monkeypatch, variant, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    """The knobs through the public API (d64: 128-row steps): out, lse and every gradient to the tolerance rule on
    partial blocks, rows that see no key, GQA groups of 1 to 4."""
    variant_configs(monkeypatch, WS_VARIANTS[variant])
    run(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal=causal, head_dim=head_dim,
        kernel="one-pass BM128" if head_dim == 64 else ONE_PASS)


@pytest.mark.parametrize("variant, head_dim", WS_CASES, ids=WS_CASE_IDS)
@pytest.mark.parametrize("options", [dict(causal=True, softcap=30.0), dict(window_size=(257, 33)),
                                     dict(causal=True, alibi=True)],
                         ids=["causal-softcap", "two-sided", "causal-alibi"])
def test_ws_variants_features(rng, monkeypatch, variant, head_dim, options):
    """The knobs with softcap (its 1 - tanh^2 factor in dS; 64-row steps at d64), a two-sided window and causal ALiBi,
    on a GQA call with partial blocks, dense and packed (64-row steps); dq_rows where the steps have 128 rows."""
    rows_split = "dq_rows" in WS_VARIANTS[variant]
    if rows_split and "softcap" in options:
        pytest.skip("softcap takes 64-row steps, which dq_rows does not split")
    variant_configs(monkeypatch, WS_VARIANTS[variant])
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = (2.0 ** (-8.0 * torch.arange(1, 5) / 4)).to("cuda")
    run(rng, 2, 333, 461, 4, 2, head_dim=head_dim, **options)
    if not rows_split:
        testing.check_packed(rng, *testing.PACKED_LENGTHS, 4, 2, torch.bfloat16, (head_dim, head_dim), **options)
    assert ran(ONE_PASS), flashtile.stats()["kernels"]


@pytest.mark.parametrize("head_dim, options", [(64, dict(causal=True, softcap=30.0)), (128, dict(causal=True))],
                         ids=["d64-softcap", "d128"])
def test_dq_rows_is_refused_on_64_row_steps(rng, head_dim, options):
    """dq_rows splits 128-row steps: a call of 64-row steps given it is refused, not run without it."""
    from dataclasses import replace

    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import launch

    q, k, v = make_qkv(1, 200, 200, 2, 2, head_dim, torch.bfloat16, "cuda", generator=rng)
    args = AttnArgs(softmax_scale=head_dim ** -0.5, causal=True, window_right=0, softcap=options.get("softcap", 0.0))
    out, lse = launch.forward(q, k, v, args)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="dq_rows"):
        launch.backward(torch.randn_like(out), q, k, v, out, lse, args, *grads,
                        one_pass=replace(configs.one_pass_config(head_dim), dq_rows=True))


# test_s_ahead's variants: the knob on, with FA3's order, and off (on by default at 128: configs.ONE_PASS_S_AHEAD).
S_AHEAD_VARIANTS = {"no-s_ahead": dict(s_ahead=False), "s_ahead": WS_VARIANTS["s_ahead"],
                    "s_ahead-dq_first": WS_VARIANTS["s_ahead-dq_first"]}


@pytest.mark.parametrize("variant", list(S_AHEAD_VARIANTS))
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal",
                         [(2, 4200, 4200, 2, 2, True), (1, 2048, 2048, 4, 1, False), (1, 1, 1, 1, 1, False),
                          (1, 63, 65, 2, 2, False), (1, 129, 64, 2, 1, True)],
                         ids=["long-causal", "2k-gqa-4", "one-row", "63x65", "129x64-causal"])
def test_s_ahead(rng, monkeypatch, variant, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    """s_ahead (each step's S^T computed under the previous step's last products; the first before the loop, and
    one after the last step onto a slot nobody reads): walks of one step, of a partial one, and of many (4200 rows:
    the ring's slots and phases wrap), GQA; out, lse and every gradient to the tolerance rule. ``no-s_ahead`` on the
    same shapes tells a fault of the knob (on by default: configs.ONE_PASS_S_AHEAD) from one of the kernel."""
    variant_configs(monkeypatch, S_AHEAD_VARIANTS[variant])
    run(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal=causal)


@pytest.mark.parametrize("head_dim, knobs", [(64, dict(s_ahead=True)), (128, dict(s_ahead=True, dk_rs=True))],
                         ids=["d64", "d128-dk_rs"])
def test_s_ahead_is_refused_where_it_serializes(rng, head_dim, knobs):
    """s_ahead at head dim 64, or with dk_rs, does not fit the registers (ptxas would serialize every wgmma): refused,
    not run without it."""
    from dataclasses import replace

    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import launch

    q, k, v = make_qkv(1, 200, 200, 2, 2, head_dim, torch.bfloat16, "cuda", generator=rng)
    args = AttnArgs(softmax_scale=head_dim ** -0.5)
    out, lse = launch.forward(q, k, v, args)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="s_ahead"):
        launch.backward(torch.randn_like(out), q, k, v, out, lse, args, *grads,
                        one_pass=replace(configs.one_pass_config(head_dim), **knobs))


def test_dk_rs_is_refused_on_wide_heads(rng):
    """dk_rs is a knob of kernels/bwd_sm90_ws.py alone: a wide call given it is refused, not run without it."""
    from dataclasses import replace

    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import launch

    q, k, v = make_qkv(1, 200, 200, 2, 2, 192, torch.bfloat16, "cuda", generator=rng)
    v = v[..., :128].contiguous()
    args = AttnArgs(softmax_scale=192 ** -0.5)
    out, lse = launch.forward(q, k, v, args)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="dk_rs"):
        launch.backward(torch.randn_like(out), q, k, v, out, lse, args, *grads,
                        one_pass=replace(configs.one_pass_config(192), dk_rs=True))


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0), (50, 70)], ids=["full", "causal", "local", "window"])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(333, 461), (500, 300)])
@pytest.mark.parametrize("ds_bufs", [1, 2])
def test_wide96(rng, window, seqlen_q, seqlen_k, ds_bufs):
    """The 96-key variant at 192/128 (kernels/bwd_sm90_wide96.py, launch.backward's ``one_pass``), with one or two
    dS buffers: every gradient (poisoned first) to the tolerance rule on GQA calls whose last key block (CTAs of 96
    keys, the third consumer's keys all past the end at 461) and query block are partial, more queries than keys
    too."""
    from dataclasses import replace

    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import launch

    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 192, torch.bfloat16, "cuda", generator=rng)
    v = v[..., :128].contiguous()
    dout = torch.randn(*q.shape[:3], 128, generator=rng).to("cuda", torch.bfloat16)
    causal = window == (-1, 0)
    args = AttnArgs(softmax_scale=192 ** -0.5, causal=causal, window_left=window[0], window_right=window[1])
    out, lse = launch.forward(q, k, v, args)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    tiles = replace(configs.one_pass_config(192, keys96=True), ds_bufs=ds_bufs)
    launch.backward(dout, q, k, v, out, lse, args, *grads, one_pass=tiles)
    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))}
    ref = dict(causal=causal, window_size=window)
    assert_results_close(ours, reference_results(q, k, v, dout, hi=True, **ref),
                         reference_results(q, k, v, dout, hi=False, **ref), torch.bfloat16)


# Packed 192/128 lengths (queries, keys) awkward for 96-key CTAs of three 32-key consumers: keys ending one into a
# CTA (97), inside the first consumer (5), in the second at its first key (33), off 16-key boundaries in the third
# (461 = 4 x 96 + 77, 650), on a CTA's end (96), none (0); queries of 0, 1, one past a 64-row block (129), more queries
# than keys and fewer. seqused_k leaves out the second CTA and 7 keys of the first (90 of 97), all of a sequence's
# (0 of 5), all but one (1 of 96), and none (33 of 33).
WIDE96_PACKED = ([129, 0, 1, 96, 333, 64, 700], [97, 5, 0, 96, 461, 33, 650])
WIDE96_SEQUSED_K = [90, 0, 0, 1, 400, 33, 641]


@pytest.mark.parametrize("options, keys", [(dict(), 96), (dict(causal=True), 96), (dict(causal=True, sink=True), 96),
                                           (dict(window_size=(100, 0)), 64)],
                         ids=["full", "causal", "causal-sink", "local"])
@pytest.mark.parametrize("seqused", [False, True], ids=["all-keys", "seqused_k"])
@pytest.mark.parametrize("nheads, nheads_kv", [(3, 3), (6, 2)], ids=["mha", "gqa-3"])
@pytest.mark.parametrize("ds_bufs", [1, 2])
def test_wide96_varlen(rng, monkeypatch, options, keys, seqused, nheads, nheads_kv, ds_bufs):
    """Packed sequences on the 96-key variant (kernels/bwd_sm90_wide96.py), with one or two dS buffers, through the
    public API: each CTA's sequence and keys, key rows past its used keys zeroed by their consumer, query rows past
    its queries by consumer 0 once for each head of the GQA group (NaN and infinite values past the last sequence and
    in the keys seqused_k leaves out); out, lse and every gradient (poisoned first) to the tolerance rule. With a
    window, packed calls keep the 64-key kernel (configs.ONE_PASS_96_APART)."""
    from dataclasses import replace

    one_pass_config = configs.one_pass_config
    monkeypatch.setattr(configs, "one_pass_config", lambda head_dim, keys96=False, features=frozenset(): replace(
        one_pass_config(head_dim, keys96, features), **(dict(ds_bufs=ds_bufs) if keys96 else {})))
    options = dict(options)
    if options.pop("sink", False):
        options["sink"] = torch.randn(nheads, generator=rng).to("cuda").requires_grad_()
    if seqused:
        options["seqused_k"] = WIDE96_SEQUSED_K
    testing.check_packed(rng, *WIDE96_PACKED, nheads, nheads_kv, torch.bfloat16, (192, 128), **options)
    assert ran(f"{WIDE} d=192") and ran(f"BM64xBN{keys}]"), flashtile.stats()["kernels"]


@pytest.mark.parametrize("how", ["argument", "torch"])
def test_deterministic_takes_the_pair(rng, how):
    """``deterministic=True``, or torch's deterministic mode, runs the dK/dV + dQ pair: every gradient
    bit-identical run to run."""
    q, k, v = make_qkv(2, 1100, 1100, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, generator=rng)
    dout = torch.randn(*q.shape, generator=rng).to("cuda", torch.bfloat16)
    options = dict(causal=True, deterministic=how == "argument")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how == "torch")
    try:
        first = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, **options), (q, k, v), dout)
        for _ in range(2):
            again = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, **options), (q, k, v), dout)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert ran(PAIR) and not ran(ONE_PASS), flashtile.stats()["kernels"]
    run(rng, 1, 500, 600, 4, 2, kernel=PAIR, causal=True, deterministic=True)
    run(rng, 1, 500, 600, 4, 2, kernel="triton d=192", causal=True, deterministic=True, head_dim=192, head_dim_v=128)
    run(rng, 1, 500, 600, 4, 2, kernel="triton d=256", causal=True, deterministic=True, head_dim=256)


def test_unfilled_gpu_keeps_the_pair(rng, monkeypatch):
    """Fewer 128-key CTAs than SMs (64-key ones at 256): the pair, whose key blocks (and dQ kernel) spread wider."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    run(rng, 1, 1000, 1000, 4, 4, kernel=PAIR)
    run(rng, 1, 1000, 1000, 4, 4, kernel="triton d=256", head_dim=256)


def test_one_pass_training_steps_replay(rng, served):
    """Repeated training steps replay the backward's launches (the preprocess zeroes the float32 dQ buffer, whose
    TMA descriptor is made again on the new buffer): every step's results meet the tolerance rule."""
    for step in range(3):
        before = len(served)
        run(rng, 2, 333, 333, 4, 2, causal=True, softcap=20.0)
        assert len(served) - before == (2 if step else 0), f"step {step}: forward and backward replayed"
