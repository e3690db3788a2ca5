"""The Gluon Hopper dK/dV backward (kernels/bwd_sm90.py) through the public API, on an sm_90 GPU only.

The dispatcher gives it 16-bit calls at head dim 128 (q, k and v) whose key blocks of 64 fill the GPU unsplit
(configs.with_gluon_dkdv), with windows, softcap, sinks and packed sequences; ALiBi, dropout, a bias, other
head dims, split key blocks and inputs the TMA cannot read keep the Triton kernel (the last one recorded).
These tests check which dK/dV kernel ran (by the backward's name in the kernel counter) and hold out, lse and
every gradient to the tolerance rule against the float32 reference. Lengths are awkward: not multiples of
64, seqlen_q != seqlen_k, rows that see no key, a last key block past the sequence end (the TMA zero-fills
it), GQA groups of 1 to 4; packed sequences of length 0, 1 and either side of a 64-row tile, NaN in the rows past
the last one and in the keys seqused_k leaves out.
"""
import pytest
import torch

import flashtile
from flashtile.backends.triton import configs
from flashtile import testing
from flashtile.testing import make_qkv

pytestmark = [pytest.mark.skipif(not testing.HOPPER, reason="the Gluon backward runs on sm_90 only"),
              pytest.mark.usefixtures("clean_dispatch_state")]
GLUON, TRITON = "dkdv=gluon-sm90 BM64xBN64", "dkdv=BM"


@pytest.fixture(autouse=True)
def unsplit(monkeypatch):
    """These small shapes would split their key blocks on a GPU this size: keep them whole."""
    monkeypatch.setattr(configs, "BWD_SPLIT_MIN_PAIRS", 1 << 62)


def ran(dkdv: str) -> bool:
    return testing.ran_backward(dkdv)


def check(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype=torch.bfloat16, kernel=GLUON, dout=None,
          **options):
    """Run forward and backward, assert ``kernel`` computed dK/dV (unless None), hold every result to the
    tolerance rule."""
    return testing.check_dense_16bit(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, kernel, dout,
                                     **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal", testing.SM90_BWD_SHAPES,
                         ids=testing.SM90_BWD_SHAPE_IDS)
def test_gluon_dkdv(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    check(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype, causal=causal)


@pytest.mark.parametrize("window, causal", testing.SM90_BWD_WINDOWS, ids=testing.SM90_BWD_WINDOW_IDS)
def test_gluon_dkdv_windows(rng, window, causal):
    """Query blocks wholly outside a key block's window are skipped; the ones straddling an edge are masked."""
    check(rng, 2, 777, 900, 4, 2, window_size=window, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_dkdv_softcap_window(rng, dtype):
    """Softcap with K scaled in place and a two-sided window's masked blocks, GQA 3."""
    check(rng, 1, 1000, 1000, 6, 2, dtype, softcap=20.0, window_size=(200, 70))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature", ["softcap", "softcap-below-scale", "sink"])
def test_gluon_dkdv_features(rng, causal, feature):
    """Softcap's tanh (dS takes 1 - tanh^2), with its scale folded into K (softcap 30) and not (a softcap below
    the softmax scale, 1/sqrt(128), keeps the multiply; the same shapes, so a launch made for one must not
    serve the other), a sink (only through the lse)."""
    options = {}
    if feature == "softcap":
        options["softcap"] = 30.0
    elif feature == "softcap-below-scale":
        options["softcap"] = 0.05
    else:
        options["sink"] = torch.randn(4, generator=rng).to("cuda").requires_grad_()
    check(rng, 2, 900, 1100, 4, 2, causal=causal, **options)




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads, nheads_kv", [(4, 2), (3, 3), (4, 1)], ids=["gqa-2", "mha", "gqa-4"])
def test_gluon_dkdv_varlen(rng, dtype, causal, nheads, nheads_kv):
    """Packed sequences fill the GPU with one-pass CTAs (many short sequences): ``deterministic`` keeps the pair."""
    testing.check_packed(rng, *testing.PACKED_LENGTHS, nheads, nheads_kv, dtype, causal=causal, deterministic=True)
    assert ran(GLUON), flashtile.stats()["kernels"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_dkdv_varlen_seqused_k(rng, causal):
    """Keys past seqused_k (NaN, infinite values) get zero gradients; whole key blocks of them see no query."""
    testing.check_packed(rng, *testing.PACKED_LENGTHS, 4, 2, torch.bfloat16, causal=causal,
                         seqused_k=testing.PACKED_SEQUSED_K, deterministic=True)
    assert ran(GLUON), flashtile.stats()["kernels"]


@pytest.mark.parametrize("options", [dict(window_size=(200, 0)), dict(window_size=(150, 40), softcap=20.0),
                                     dict(causal=True, softcap=30.0, sink=True)],
                         ids=["window", "two-sided-softcap", "causal-softcap-sink"])
def test_gluon_dkdv_varlen_features(rng, options):
    if options.pop("sink", False):
        options["sink"] = torch.randn(4, generator=rng).to("cuda").requires_grad_()
    testing.check_packed(rng, *testing.PACKED_LENGTHS, 4, 2, torch.bfloat16, deterministic=True, **options)
    assert ran(GLUON), flashtile.stats()["kernels"]


@pytest.mark.parametrize("case", ["alibi", "dropout", "head-dim-64", "split", "unaligned-dout"])
def test_other_calls_keep_the_triton_dkdv(rng, monkeypatch, case):
    """What the Gluon kernel does not serve runs bwd.py's dK/dV kernel; a dO the TMA cannot read is recorded."""
    if case == "alibi":
        slopes = 2.0 ** (-8.0 * torch.arange(1, 5) / 4) * torch.tensor([[1.0], [0.5]])
        check(rng, 2, 900, 1100, 4, 2, kernel=TRITON, causal=True, alibi_slopes=slopes.to("cuda"))
        assert not ran("gluon")
        return
    if case == "dropout":
        q, k, v = make_qkv(1, 300, 300, 2, 2, 128, torch.bfloat16, "cuda", requires_grad=True, generator=rng)
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.1)
        out.backward(torch.randn_like(out))
        assert ran(TRITON) and not ran("gluon")
        return
    if case == "head-dim-64":
        q, k, v = make_qkv(1, 300, 300, 2, 2, 64, torch.bfloat16, "cuda", requires_grad=True, generator=rng)
        out = flashtile.flash_attn_func(q, k, v)
        out.backward(torch.randn_like(out))
        assert ran(TRITON) and not ran("gluon")
        return
    if case == "split":
        # One KV head of 65 key blocks: split in parts of 2048 query rows.
        monkeypatch.setattr(configs, "BWD_SPLIT_MIN_PAIRS", 0)
        check(rng, 1, 4200, 4100, 2, 1, kernel=TRITON)
        assert any("parts=" in name for name in flashtile.stats()["kernels"]) and not ran("gluon")
        return
    # dO with rows of 130 elements (260 bytes): its strides are no multiple of 16 bytes. (The backward's
    # recorded name is the plan's; the fallback is what says the Triton kernel ran.)
    dout = torch.randn(2, 300, 4, 130, generator=rng).to("cuda", torch.bfloat16)[..., :128]
    with pytest.warns(RuntimeWarning, match="Gluon Hopper dK/dV backward needs TMA-compatible inputs"):
        check(rng, 2, 300, 300, 4, 2, kernel=None, dout=dout, causal=True)
    assert any("Gluon Hopper dK/dV" in reason for reason in flashtile.stats()["fallbacks"])
