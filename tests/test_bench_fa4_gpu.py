"""FlashAttention-4 as a benchmark peer, on the GPU with flash_attn.cute installed (skipped elsewhere): the
``fa4`` provider passes the suite's validation (out, its LSE, dQ, dK, dV under the 2x rule) on every feature
the suite gives it, dense and variants, so an FA4 cell is a speed and not an invalid one. Flashtile at the
same shapes for comparison. Run: ``python -m pytest -q tests/test_bench_fa4_gpu.py`` after installing FA4
(../shared/peers/fa4/README.md)."""
import pytest
import torch

from flashtile.bench import common, gpu, providers, validate, variants

try:
    import flash_attn.cute  # noqa: F401

    HAS_FA4 = True
except ImportError:
    HAS_FA4 = False

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FA4), reason="needs a CUDA GPU and FA4")

SHAPES = {
    "mha-d128-full": providers.DenseShape(2, 1024, 16, 16, 128, 128, False, "bf16"),
    "mha-d128-causal": providers.DenseShape(2, 1024, 16, 16, 128, 128, True, "bf16"),
    "gqa-d64-sink": providers.DenseShape(2, 1024, 16, 4, 64, 64, True, "bf16", sink=True),
    "window": providers.DenseShape(1, 2048, 8, 8, 128, 128, True, "bf16", window=256),
    "softcap-gqa": providers.DenseShape(2, 1024, 16, 8, 128, 128, True, "bf16", softcap=50.0),
    "d192-dv128": providers.DenseShape(2, 1024, 16, 16, 192, 128, True, "bf16"),
    "d256": providers.DenseShape(1, 1024, 8, 8, 256, 256, False, "bf16"),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("prov", ["fa4", "flashtile"])
def test_dense_and_model_shapes_validate(name, prov):
    shape = SHAPES[name]
    inputs = providers.make_inputs(shape.batch, shape.seqlen, shape.nheads, shape.nheads_kv, shape.headdim,
                                   shape.headdim_v, torch.bfloat16, "cuda")
    q, k, v = inputs["bshd"]
    ref = validate.reference(q, k, v, inputs["dout_bshd"], **shape.features(inputs))
    row = gpu.measure(prov, inputs, shape, common.gpu_timer(5, 10), ("fwd", "bwd"), ref)
    assert common.row_status(row) == "ok", row.get("invalid") or row.get("fwd_err") or row.get("bwd_err")
    assert set(row["check"]) == {"out", "lse", "dq", "dk", "dv"} and row["fwd_ms"] > 0 and row["bwd_ms"] > 0


@pytest.mark.parametrize("group, variant", [("window", "window"), ("varlen_mixed", "varlen"), ("mods", "softcap"),
                                            ("mods", "sink")])
def test_variants_validate(group, variant):
    sizes = variants.Sizes(nheads=4, tokens=4096, window_seqlens=(2048,), varlen_count=4, varlen_range=(100, 1500),
                           mod_seqlens=(1024,), flex_mod_seqlens=())
    case = next(c for c in variants.build_cases(sizes, [group], ["fa4"]) if c.variant == variant and c.causal)
    inputs = variants.make_block_inputs(case, torch.bfloat16, "cuda")
    row = variants.measure(case, inputs, common.gpu_timer(5, 10), ref_heads=2)
    assert not row.get("invalid") and not row.get("fwd_err"), row
    assert {"out", "dq", "dk", "dv"} <= set(row["check"]) and row["bwd_ms"] > 0
