"""The benchmark refuses a wrong kernel (flashtile/bench/validate.py, gpu.measure, the reports) on CPU:
the chunked per-head reference equals the whole one; a provider whose output is 1% off, or whose dK
alone is wrong, is marked invalid and never timed, in the row, the tables and the summary; a correct
provider passes with its LSE, dQ, dK and dV checked."""
import pytest
import torch

from flashtile.bench import common, gpu, providers, report, validate
from flashtile.testing import attention_ref, reference_results


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# GQA 4/2 at 37 tokens (a chunk boundary inside the rows), MHA 2/2 at 65.
SHAPES = [providers.DenseShape(2, 37, 4, 2, 16, 16, True, "fp32"),
          providers.DenseShape(1, 65, 2, 2, 8, 8, False, "fp32"),
          providers.DenseShape(2, 37, 4, 2, 16, 16, True, "fp32", sink=True, softcap=5.0)]


def _inputs(shape):
    return providers.make_inputs(shape.batch, shape.seqlen, shape.nheads, shape.nheads_kv, shape.headdim,
                                 shape.headdim_v, torch.float32, "cpu")


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa-causal", "mha-full", "sink-softcap"])
def test_reference_in_row_chunks_equals_the_whole(shape, monkeypatch):
    inputs = _inputs(shape)
    q, k, v = inputs["bshd"]
    dout = inputs["dout_bshd"]
    features = shape.features(inputs)
    monkeypatch.setattr(validate, "CHUNK_BYTES", 4 * shape.batch * shape.seqlen * 10)  # 10 rows a chunk
    assert len(validate._row_chunks(shape.batch, shape.seqlen, shape.seqlen, features)) > 1
    ref = validate.reference(q, k, v, dout, kv_heads=1, **features)
    group = shape.nheads // shape.nheads_kv
    whole = reference_results(q[:, :, :group], k[:, :, :1], v[:, :, :1], dout[:, :, :group], hi=True,
                              **{**features, **({"sink": features["sink"][:group]} if shape.sink else {})})
    assert ref.heads == group and ref.kv_heads == 1
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.allclose(ref.hi[name].double(), whole[name].double(), atol=1e-10), name


def _wrong(kind):
    """A provider computing attention with the reference, its output scaled by 1.01 or its dK doubled."""

    class DoubleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    def build(inputs, shape):
        q, k, v = inputs["bshd"]

        def fwd():
            kk = DoubleGrad.apply(k) if kind == "dk" else k
            out = attention_ref(q, kk, v, causal=shape.causal, upcast=False)[0]
            return out * 1.01 if kind == "out" else out

        return providers.Provider(fwd, (q, k, v), inputs["dout_bshd"], torch.enable_grad(), heads_first=False)

    return build


def _measured(shape, names) -> dict:
    """Each provider of ``names`` measured on ``shape`` against its reference: ``{name: row}``."""
    inputs = _inputs(shape)
    q, k, v = inputs["bshd"]
    ref = validate.reference(q, k, v, inputs["dout_bshd"], **shape.features(inputs))
    return {name: {**gpu.measure(name, inputs, shape, common.cpu_timer(), reference=ref), "config": "c", "group": "g"}
            for name in names}


def test_a_wrong_provider_is_invalid_and_never_a_speed(monkeypatch):
    monkeypatch.setitem(providers.BUILDERS, "out_1pct", _wrong("out"))
    monkeypatch.setitem(providers.BUILDERS, "wrong_dk", _wrong("dk"))
    rows = _measured(SHAPES[0], ("flashtile", "math", "out_1pct", "wrong_dk"))
    assert common.row_status(rows["flashtile"]) == "ok" and common.row_status(rows["math"]) == "ok"
    assert set(rows["flashtile"]["check"]) == {"out", "lse", "dq", "dk", "dv"}  # flashtile returns its LSE
    assert set(rows["math"]["check"]) == {"out", "dq", "dk", "dv"}
    for name, culprit in (("out_1pct", "out"), ("wrong_dk", "dk")):
        row = rows[name]
        assert common.row_status(row) == "invalid" and row["invalid"].startswith(culprit)
        assert not any(key.endswith("_ms") or key.endswith("_tflops") for key in row), row
    assert "dq" not in rows["wrong_dk"]["invalid"] and "dv" not in rows["wrong_dk"]["invalid"]
    tables = report.dense_tables(list(rows.values()))
    assert f"invalid (err {rows['wrong_dk']['invalid_err']:.1e})" in tables
    assert f"invalid (err {rows['out_1pct']['invalid_err']:.1e})" in tables
    summary = report.summary({"dense": list(rows.values())})
    assert {e["best_peer"] for e in summary} == {"math"}  # an invalid peer is never the best


def test_an_invalid_flashtile_is_noted_not_compared(monkeypatch):
    monkeypatch.setitem(providers.BUILDERS, "flashtile", _wrong("dk"))
    rows = list(_measured(SHAPES[1], ("flashtile", "math")).values())
    entries = report.summary({"dense": rows})
    assert entries and all(e["ratio"] is None and e["note"].startswith("flashtile: invalid (err") for e in entries)


@pytest.mark.parametrize("group", ["mods", "varlen_mixed"])
def test_a_wrong_variant_provider_is_invalid(monkeypatch, group):
    """The variants suite checks the same way: dense and packed rows, a provider with a wrong dK is invalid."""
    from flashtile.bench import variants

    case = next(c for c in variants.build_cases(variants.SMOKE, [group], ["flashtile"])
                if c.causal and c.variant in ("softcap", "varlen"))
    inputs = variants.make_block_inputs(case, torch.float32, "cpu")
    right = variants.measure(case, inputs, common.cpu_timer(), ref_heads=2)
    assert not right.get("invalid") and {"out", "dq", "dk", "dv"} <= set(right["check"]) and right["fwd_ms"] > 0

    build = variants.BUILDERS["flashtile"]

    def wrong(case, inputs):
        p = build(case, inputs)
        return p._replace(fwd=lambda: _OneMoreOnK.apply(p.fwd(), p.leaves[1]), with_lse=None)

    monkeypatch.setitem(variants.BUILDERS, "flashtile", wrong)
    row = variants.measure(case, inputs, common.cpu_timer(), ref_heads=2)
    assert row["invalid"].startswith("dk") and "fwd_ms" not in row and "bwd_ms" not in row
    assert "invalid (err" in variants.format_report([row], [])


class _OneMoreOnK(torch.autograd.Function):
    """Identity on the output, and 1 more on every entry of dK: a wrong dK, a right output, dQ and dV."""

    @staticmethod
    def forward(ctx, out, k):
        ctx.k_shape = k.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(ctx.k_shape)


def test_a_wrong_decode_provider_is_invalid(monkeypatch):
    from flashtile.bench import decode

    shape = decode.DecodeShape(2, 40, nheads=4, nheads_kv=2, headdim=16, dtype="fp32")
    cache = decode.make_cache(shape, "cpu")
    ref = decode.reference(cache)
    right = decode.measure("math", cache, shape, "contiguous", common.cpu_timer(), reference=ref)
    assert common.row_status(right) in ("ok", "partial") and right["step_ms"] > 0
    build = decode.build

    def off_by_one_percent(prov, cache, layout):
        p = build("math", cache, layout)
        return p._replace(fwd=lambda: p.fwd() * 1.01)

    monkeypatch.setattr(decode, "build", off_by_one_percent)
    row = decode.measure("math", cache, shape, "contiguous", common.cpu_timer(), reference=ref)
    assert common.row_status(row) == "invalid" and "step_ms" not in row and "graph_ms" not in row
    assert "invalid (err" in report.decode_table([row], None)


def test_a_wrong_cpu_provider_is_invalid(monkeypatch):
    """The CPU comparison's worker (run in-process here) checks before it times."""
    from flashtile.bench import cpu

    spec = dict(provider="sdpa", batch=1, seqlen=65, nheads=2, headdim=16, causal=True, dtype="fp32", check=True)
    right = cpu.worker(spec)
    assert right["fwd_ms"] > 0 and right["max_abs_err"] < 1e-5 and not right.get("invalid")
    forward = cpu._forward
    monkeypatch.setattr(cpu, "_forward", lambda *args: (lambda f: (lambda: f() * 1.01))(forward(*args)))
    wrong = cpu.worker(spec)
    assert wrong["invalid"].startswith("out") and "fwd_ms" not in wrong
    row = {"D": 16, "N": 65, "B": 1, "H": 2, "causal": True, "prov": "sdpa", **wrong}
    assert "invalid (err" in cpu.format_table([row]) and common.row_status(row) == "invalid"
