"""``python -m flashtile bench``, the benchmark suite (flashtile/bench/suite.py, report.py, plots.py,
decode.py, e2e.py, gpu.py, providers.py) on CPU.

- The CPU suite end to end through the command line: its JSON against the schema, the Markdown, the
  plot (when matplotlib is installed).
- The GPU suite's own code (dense stages, decode, e2e, reports) on tiny shapes on CPU, with a timer
  of wall clocks: every provider measured or marked, never a crash.
- The pure parts: grids and option parsing, FLOP and byte models, the summary's best-peer ratio,
  marked cells for providers that fail (fakes raising OOM, unsupported, not installed), the schema
  check and merging runs made in parts.
"""
import dataclasses
import importlib.util
import json
import sys

import pytest
import torch

import flashtile
from flashtile.bench import common, decode, e2e, gpu, plots, providers, report, suite, variants
from flashtile.cli import build_parser
from flashtile.testing import run_cli as cli
from flashtile.dispatch import force_backend
from flashtile.testing import attention_ref

HAS_CUDA = torch.cuda.is_available()
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny shapes gain nothing from threads, and two spinning OpenMP threads per xdist worker on a
    shared 2-core machine make each small op tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



# ---------------------------------------------------------------- grids and options


def test_quick_grid_is_small_and_covers_the_main_shapes():
    grid = suite.QUICK
    assert grid.seqlens == (1024, 4096, 16384)
    assert {c.dtype for c in grid.dense} == {"bf16"} and {c.causal for c in grid.dense} == {False, True}
    assert {(c.headdim, c.nheads, c.nheads_kv) for c in grid.dense} == {(64, 32, 32), (128, 16, 16), (128, 32, 8)}
    for config in grid.dense:
        for n in grid.seqlens:
            shape = config.shape(n)
            assert shape.batch * shape.seqlen == 16384
            if shape.nheads == shape.nheads_kv:
                assert shape.nheads * shape.headdim == 2048
    assert "naive" not in grid.dense_providers and "math" in grid.dense_providers  # math is naive attention already
    assert set(grid.decode_shapes) == {(16, 8192), (1, 32768)}
    assert grid.decode_layouts == ("contiguous", "paged16", "paged256")
    assert max(grid.e2e.prompts) == 8192 and grid.e2e.layers < 32


def test_full_grid_covers_the_issue():
    grid = suite.FULL
    assert grid.seqlens == (512, 1024, 2048, 4096, 8192, 16384, 32768)
    dims = {(c.headdim, c.headdim_v) for c in grid.dense}
    assert dims == {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    assert {c.dtype for c in grid.dense} == {"bf16", "fp16"}
    assert {c.dtype for c in grid.dense if (c.nheads, c.nheads_kv) == (32, 8)} == {"bf16", "fp16"}
    assert (1, 131072) in grid.decode_shapes and (16, 32768) in grid.decode_shapes
    assert grid.e2e.prompts == (512, 1024, 2048, 4096, 8192)
    assert set(grid.dense_providers) == set(providers.NAMES)
    assert grid.dense[0].shape(32768).batch == 1  # 16384 // 32768 would be 0


def test_config_labels():
    mha, gqa, dv = suite.DenseConfig("bf16", 128, 128, 16, 16, True), suite.DenseConfig("bf16", 128, 128, 32, 8, False), \
        suite.DenseConfig("fp16", 192, 128, 10, 10, False)
    assert mha.label == "bf16 d128 h16/16 causal" and gqa.label == "bf16 d128 h32/8 full"
    assert dv.group == "fp16 d192/128 h10/10"


def test_stages_and_aliases():
    assert suite.parse_stages(None) == suite.STAGES
    assert suite.parse_stages(["decode", "fwd"]) == ("fwd", "decode")  # run order, not the order given
    assert suite.parse_stages(["dense"]) == ("fwd", "bwd", "fwd_bwd")
    assert suite.parse_stages(["variants", "e2e"]) == ("window", "varlen", "softcap", "e2e")
    with pytest.raises(suite.UsageError, match="--only nope: choose from fwd bwd"):
        suite.parse_stages(["nope"])


def test_headdim_parsing():
    assert suite.parse_headdim("64,192/128") == [(64, 64), (192, 128)]
    for bad in ("x", "128/0", "1/2/3"):
        with pytest.raises(Exception, match="head dims"):
            suite.parse_headdim(bad)


def test_overrides_rebuild_the_dense_grid():
    grid = suite.with_overrides(suite.QUICK, seqlens=[2048], headdims=[(128, 128), (192, 128)], causal="true", dtype="fp16")
    assert grid.seqlens == (2048,) and grid.cpu_seqlens == (2048,)
    assert {c.label for c in grid.dense} == {"fp16 d128 h16/16 causal", "fp16 d128 h32/8 causal",
                                             "fp16 d192/128 h10/10 causal"}
    assert grid.dtype == "fp16" and grid.e2e.dtype == "fp16" and grid.cpu_causal == (True,)
    full = suite.with_overrides(suite.FULL, causal="false")
    assert full.dense and all(not c.causal for c in full.dense) and len(full.dense) == len(suite.FULL.dense) // 2
    # --full run in parts: each part is exactly the full grid's configurations of its head dims.
    parts = [suite.with_overrides(suite.FULL, headdims=dims, dtype=dtype).dense
             for dims, dtype in (([(64, 64), (96, 96)], None), ([(128, 128)], "bf16"), ([(192, 128), (256, 256)], None),
                                 ([(128, 128)], "fp16"))]
    assert sorted(c.label for part in parts for c in part) == sorted(c.label for c in suite.FULL.dense)


def test_each_stage_gets_its_own_providers():
    opts = suite.Options(suite.QUICK, suite.STAGES, ("flashtile", "cudnn", "eager", "sdpa"), "cuda", None)
    assert opts.stage_providers("dense") == ("flashtile", "cudnn")
    assert opts.stage_providers("decode") == ("flashtile", "cudnn")
    assert opts.stage_providers("e2e") == ("flashtile", "sdpa", "eager")
    assert opts.stage_providers("cpu") == ("flashtile", "sdpa")
    default = dataclasses.replace(opts, providers=None)
    assert default.stage_providers("dense") == suite.QUICK.dense_providers
    assert default.stage_providers("variants") == variants.PROVIDERS


def _options(*argv):
    args = build_parser().parse_args(["bench", *argv])
    for name in ("seqlens", "headdims", "providers", "only"):  # as the command does
        setattr(args, name, [x for group in getattr(args, name) or () for x in group] or None)
    return suite.options_from_args(args)


def test_options_name_the_files_after_the_selection(tmp_path):
    opts = _options("--full", "--only", "dense", "--headdims", "64", "96", "--dtype", "fp16", "--device", "cpu",
                    "--out", str(tmp_path))
    assert opts.grid.name == "full" and opts.stages == suite.DENSE_STAGES and opts.device == "cpu"
    assert opts.selection == "-dense-headdims-64-96-dtype-fp16"
    env = {"gpu": None, "date": "2026-11-21", "time_utc": "2026-11-21T10:20:30Z"}
    stem = suite.output_stem(opts, env)
    assert stem.name == "cpu-suite-full-dense-headdims-64-96-dtype-fp16-2026-11-21T102030Z"
    stem.with_suffix(".json").write_text("{}")  # a second run at the same second never overwrites the first
    assert suite.output_stem(opts, env).name == stem.name + "-2"
    gpu_args = dataclasses.make_dataclass("Args", ["only", "seqlens", "headdims", "causal", "dtype"])(
        ["decode"], [2048], [(128, 128), (192, 128)], "true", None)
    assert suite._selection(gpu_args) == "-decode-seqlens-2048-headdims-128-192x128-causal-true"
    quick = _options("--device", "cpu", "--providers", "flashtile,sdpa", "--no-check", "--no-plots")
    assert quick.grid.name == "quick" and quick.selection == "" and quick.providers == ("flashtile", "sdpa")
    assert not quick.check and not quick.plots


@pytest.mark.parametrize("argv, message", [
    (["--only", "nope"], "--only nope: choose from"),
    (["--providers", "bogus"], "--providers bogus: choose from flashtile"),
    (["--quick", "--full"], "not allowed with argument"),
    (["--seqlens", "0"], "must be positive"),
    (["--headdims", "x"], "head dims"),
    (["--device", "cpu", "--headdims", "192/128"], "one head dim for q, k and v"),
    (["--device", "cpu", "--providers", "cudnn"], "none runs on CPU"),
    (["--suite", "variants", "--only", "fwd"], "--only: not used by --suite variants"),
    (["--suite", "variants", "--full"], "--full: not used by --suite variants"),
    (["--merge", "/no/such/file.json"], "--merge /no/such/file.json"),
])
def test_usage_errors(capsys, argv, message):
    status, out, err = cli(capsys, "bench", *argv)
    assert status == 2 and message in err and out == ""


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu_is_a_usage_error(capsys):
    status, _, err = cli(capsys, "bench", "--device", "cuda")
    assert status == 2 and "torch sees no CUDA GPU" in err


def test_help_lists_the_suite_options(capsys):
    status, out, _ = cli(capsys, "bench", "--help")
    assert status == 0
    for text in ("--full", "--only", "--providers", "--out", "--merge", "python -m flashtile bench --full",
                 "python -m flashtile bench --only decode"):
        assert text in out


# ---------------------------------------------------------------- models


def test_flop_model():
    assert common.attn_flops(2, 16, 4096, 4096, 128, False) == 4 * 2 * 16 * 4096 * 4096 * 128
    assert common.attn_flops(2, 16, 4096, 4096, 128, True) == 2 * 2 * 16 * 4096 * 4096 * 128
    assert common.attn_flops(1, 8, 1, 100, 192, False, headdim_v=128) == 2 * 8 * 100 * (192 + 128)
    assert common.fwd_flops(4, 16, 4096, 128, False) == common.attn_flops(4, 16, 4096, 4096, 128, False)
    shape = providers.DenseShape(4, 4096, 16, 16, 128, 128, True, "bf16")
    assert shape.flops("bwd") == 2.5 * shape.flops("fwd") and shape.flops("fwd_bwd") == 3.5 * shape.flops("fwd")


def test_byte_model():
    mha = providers.DenseShape(4, 4096, 16, 16, 128, 128, False, "bf16")
    tensor = 4 * 4096 * 16 * 128  # elements of q (= k = v = o here)
    assert mha.bytes("fwd") == 2 * 4 * tensor  # q, k, v read, o written, 2 bytes each
    assert mha.bytes("bwd") == 2 * mha.bytes("fwd") and mha.bytes("fwd_bwd") == 3 * mha.bytes("fwd")
    gqa = providers.DenseShape(1, 1000, 32, 8, 128, 128, True, "fp16")
    q = 1000 * 32 * 128
    kv = 1000 * 8 * 128
    assert gqa.bytes("fwd") == 2 * (q + kv + kv + q)  # K and V read once per KV head, never per query head
    dec = decode.DecodeShape(16, 8192)
    assert dec.bytes() == 16 * 8192 * 8 * (128 + 128) * 2  # 537 MB of K and V per step
    assert common.gbps(dec.bytes(), 0.2) == pytest.approx(dec.bytes() / 0.2e-3 / 1e9)
    row = {"step_ms": 0.2, "graph_ms": 0.125}
    decode.add_rates(row, dec, decode.bandwidth_ceiling_tbps("NVIDIA H200"))
    assert row["step_frac_peak"] == pytest.approx(row["step_GBps"] / 4265.0)
    assert row["graph_GBps"] > row["step_GBps"]
    assert decode.bandwidth_ceiling_tbps("NVIDIA H100 80GB HBM3") is None
    assert common.H200_COPY_TBPS == 4.265 and "4.265" in common.BANDWIDTH_CEILING_SOURCE


def test_timing_fields_are_the_median_and_its_spread():
    fields = common.timing_fields("fwd", [5.0, 1.0, 2.0, 3.0, 4.0])
    assert fields == {"fwd_ms": 3.0, "fwd_p10_ms": pytest.approx(1.4), "fwd_p90_ms": pytest.approx(4.6), "fwd_reps": 5}
    assert common.timing_fields("x", [2.0])["x_p90_ms"] == 2.0
    with pytest.raises(ValueError):
        common.timing_fields("x", [])


# ---------------------------------------------------------------- summary: flashtile vs the best peer


def _dense_row(prov, ms=None, N=4096, config="bf16 d128 h16/16 causal", **extra):
    row = {"prov": prov, "config": config, "group": config.rsplit(" ", 1)[0], "dtype": "bf16", "D": 128, "Dv": 128,
           "H": 16, "Hkv": 16, "N": N, "B": 16384 // N, "causal": True, **extra}
    if ms is not None:
        row.update(common.timing_fields("fwd", [ms]))
        row["fwd_tflops"] = 100.0 / ms
    return row


def test_summary_ratio_is_against_the_fastest_measured_peer():
    rows = [_dense_row("flashtile", 1.0), _dense_row("flash", 1.5), _dense_row("cudnn", 0.8),
            _dense_row("efficient", fwd_err="OOM: OutOfMemoryError: CUDA out of memory"),
            _dense_row("flex", skipped="flex compile budget (90 s) spent")]
    (entry,) = report.summary({"dense": rows})
    assert (entry["best_peer"], entry["best_peer_value"]) == ("cudnn", 0.8)
    assert entry["ratio"] == pytest.approx(0.8)  # flashtile is 0.8x the speed of cuDNN: behind
    assert entry["flashtile_rate"] == 100.0 and entry["best_peer_rate"] == 125.0
    rows[2]["fwd_ms"] = 2.0  # now flash is the best peer, and flashtile is ahead
    (entry,) = report.summary({"dense": rows})
    assert entry["best_peer"] == "flash" and entry["ratio"] == pytest.approx(1.5)


def test_summary_notes_when_there_is_nothing_to_compare():
    rows = [_dense_row("flashtile", fwd_err="RuntimeError: boom"), _dense_row("flash", 1.0)]
    (entry,) = report.summary({"dense": rows})
    assert entry["ratio"] is None and entry["note"] == "flashtile: ERR(RuntimeError)"
    (entry,) = report.summary({"dense": [_dense_row("flashtile", 1.0), _dense_row("cudnn", fwd_err="Unavailable: x")]})
    assert entry["ratio"] is None and entry["note"] == "no peer measured"


def test_summary_of_throughput_prefers_the_higher_value():
    rows = [{"prov": p, "kind": "decode", "prompt": 512, "new_tokens": 32, "layers": 4, "dtype": "bf16",
             "tokens_per_s": v} for p, v in (("flashtile", 90.0), ("sdpa", 100.0), ("eager", 60.0))]
    (entry,) = report.summary({"e2e": rows})
    assert entry["best_peer"] == "sdpa" and entry["ratio"] == pytest.approx(0.9) and entry["higher_is_better"]


def test_summary_of_decode_and_variants():
    base = {"dtype": "bf16", "B": 16, "L": 8192, "H": 32, "Hkv": 8, "D": 128}
    rows = [{**base, "prov": "flashtile", "layout": "paged16", "step_ms": 0.5, "graph_ms": 0.25},
            {**base, "prov": "cudnn", "layout": "contiguous", "step_ms": 0.4, "graph_ms": 0.3},
            {**base, "prov": "flash", "layout": "contiguous", "err": "RuntimeError: No available kernel."}]
    entries = {e["stage"]: e for e in report.summary({"decode": rows})}
    assert entries["step paged16"]["best_peer"] == "cudnn contiguous"
    assert entries["step paged16"]["ratio"] == pytest.approx(0.8)
    assert entries["graph paged16"]["ratio"] == pytest.approx(1.2)
    var = [{"group": "window", "prov": "flashtile", "variant": "window", "N": 16384, "B": 1, "causal": True,
            "window": [1024, 0], "fwd_ms": 0.5, "bwd_ms": 1.0},
           {"group": "window", "prov": "flex", "variant": "window", "N": 16384, "B": 1, "causal": True,
            "fwd_ms": 0.4, "bwd_ms": 1.2},
           {"group": "window", "prov": "flash", "variant": "causal", "N": 16384, "B": 1, "causal": True,
            "fwd_ms": 0.1, "bwd_ms": 0.1}]  # full causal: not the same function, not a peer of the window
    entries = {e["stage"]: e for e in report.summary({"variants": var})}
    assert entries["fwd"]["best_peer"] == "flex window" and entries["fwd"]["ratio"] == pytest.approx(0.8)
    assert entries["bwd"]["ratio"] == pytest.approx(1.2)


def test_aggregate_is_a_geometric_mean():
    rows = [_dense_row("flashtile", 1.0, N=1024), _dense_row("cudnn", 2.0, N=1024),
            _dense_row("flashtile", 2.0, N=4096), _dense_row("cudnn", 1.0, N=4096)]
    (group,) = report.aggregate(report.summary({"dense": rows}))
    assert group["ratio_geomean"] == pytest.approx(1.0) and (group["ratio_min"], group["ratio_max"]) == (0.5, 2.0)
    assert group["best_peers"] == {"cudnn": 2} and group["compared"] == 2


# ---------------------------------------------------------------- marked cells


@pytest.mark.parametrize("label, kind, cell", [
    ("OOM: OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", "oom", "OOM"),
    ("RuntimeError: No available kernel. Aborting execution.", "unsupported", "unsupported"),
    ("NotImplementedError: headdim 512", "unsupported", "unsupported"),
    ("Unavailable: flash_attn is not installed (ModuleNotFoundError)", "n/a", "n/a"),
    ("ValueError: something else", "error", "ERR(ValueError)"),
])
def test_error_kinds(label, kind, cell):
    assert common.error_kind(label) == kind and common.short_error(label) == cell


def _raise(exc):
    raise exc


@pytest.fixture
def tiny():
    """Inputs of one tiny dense shape on CPU (GQA 4/2), and that shape."""
    shape = providers.DenseShape(2, 48, 4, 2, 16, 16, True, "fp32")
    inputs = providers.make_inputs(2, 48, 4, 2, 16, 16, torch.float32, "cpu")
    return inputs, shape


def test_failing_providers_become_marked_cells(monkeypatch, tiny):
    inputs, shape = tiny
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
    monkeypatch.setitem(providers.BUILDERS, "oom_peer", lambda inputs, shape: providers.Provider(
        lambda: _raise(oom), (), None, torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), True))
    monkeypatch.setitem(providers.BUILDERS, "refuses",
                        lambda inputs, shape: _raise(RuntimeError("No available kernel. Aborting execution.")))
    monkeypatch.setitem(providers.BUILDERS, "missing", lambda inputs, shape: _raise(common.Unavailable("not installed")))
    timer = common.cpu_timer()
    rows = {name: gpu.measure(name, inputs, shape, timer) for name in ("oom_peer", "refuses", "missing")}
    assert {name: common.row_status(r) for name, r in rows.items()} == {
        "oom_peer": "oom", "refuses": "unsupported", "missing": "n/a"}
    assert all("fwd_ms" not in r for r in rows.values())
    for r in rows.values():
        r.update(config="c", group="g")
    table = report.dense_tables(list(rows.values()))
    assert "| OOM" in table and "| unsupported" in table and "| n/a" in table


def test_a_failed_backward_keeps_the_forward(monkeypatch, tiny):
    inputs, shape = tiny
    q, k, v = inputs["bshd"]

    def build(inputs, shape):
        fwd = lambda: attention_ref(q, k, v, causal=True, upcast=False)[0] * 1.0  # noqa: E731
        return providers.Provider(fwd, (q, k, v), torch.full((1,), 1.0), torch.nn.attention.sdpa_kernel(
            torch.nn.attention.SDPBackend.MATH), False)  # a dout of the wrong shape: backward raises

    monkeypatch.setitem(providers.BUILDERS, "half_broken", build)
    row = gpu.measure("half_broken", inputs, shape, common.cpu_timer())
    assert row["fwd_ms"] > 0 and row["bwd_err"] and row["fwd_bwd_err"]
    assert common.row_status(row) == "partial"


def test_naive_and_math_are_skipped_where_the_scores_would_not_fit():
    big = providers.DenseShape(1, 65536, 16, 16, 128, 128, True, "bf16")
    assert "score matrix" in providers.not_applicable("math", big) and providers.not_applicable("flashtile", big) is None
    row = gpu.measure("naive", {}, big, common.cpu_timer())
    assert common.row_status(row) == "skipped"


# ---------------------------------------------------------------- the GPU stages, run on CPU


def fake_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, causal=False,
                                 num_splits=0):
    """flash-attn's decode call computed by the reference; paged caches gathered through the table."""
    if block_table is not None:
        batch, pages = block_table.shape
        gather = lambda pool: pool[block_table.long().flatten()].reshape(  # noqa: E731
            batch, pages * pool.shape[1], *pool.shape[2:])
        k_cache, v_cache = gather(k_cache), gather(v_cache)
    n = int(cache_seqlens[0])
    return attention_ref(q, k_cache[:, :n], v_cache[:, :n], causal=causal, upcast=False)[0].to(q.dtype)


TINY_E2E = e2e.Settings(prompts=(8, 16), new_tokens=3, decode_prompt=8, layers=1, runs=1, dtype="fp32",
                        config_overrides=(("hidden_size", 32), ("num_attention_heads", 4), ("num_key_value_heads", 2),
                                          ("head_dim", 8), ("intermediate_size", 64), ("vocab_size", 512),
                                          ("bos_token_id", 1), ("eos_token_id", 2)))


def tiny_grid():
    return dataclasses.replace(
        suite.QUICK, name="tiny", seqlens=(32, 64), tokens=64, width=32,
        dense=suite.dense_configs(("fp32",), ((16, 16),), (True,), width=32, gqa_heads=(4, 2), gqa_headdims=(16,)),
        variant_sizes=variants.SMOKE._replace(mod_seqlens=(64,), flex_mod_seqlens=()),
        decode_shapes=((2, 40),), dtype="fp32", e2e=TINY_E2E)


def test_gpu_stages_on_cpu_measure_or_mark_every_cell(tmp_path, monkeypatch):
    """The code the H200 runs, on tiny CPU shapes: dense (with a provider that runs out of memory),
    softcap, decode (contiguous and paged, a reference-backed kvcache call), end to end."""
    monkeypatch.setattr(flashtile, "flash_attn_with_kvcache", fake_flash_attn_with_kvcache, raising=False)
    monkeypatch.setitem(providers.BUILDERS, "oom_peer", lambda inputs, shape: _raise(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")))
    monkeypatch.setitem(suite.STAGE_PROVIDERS, "dense", (*providers.NAMES, "oom_peer"))
    chosen = ("flashtile", "flash", "efficient", "math", "naive", "flash_attn", "oom_peer", "sdpa", "eager")
    opts = suite.Options(tiny_grid(), ("fwd", "bwd", "fwd_bwd", "softcap", "decode", "e2e"), chosen, "cpu", tmp_path)
    state = suite._Run(opts, suite._cpu_env())
    with force_backend("torch"):
        suite.run_stages(state, torch.device("cpu"), common.cpu_timer())
    payload = state.payload
    state.save()
    assert suite.validate(payload) == []

    dense = payload["dense"]
    assert len(dense) == 2 * 2 * 7  # 2 configs (MHA, GQA) x 2 seqlens x 7 providers
    status = {(r["prov"], r["config"], r["N"]): r["status"] for r in dense}
    assert {s for (p, _, _), s in status.items() if p in ("flashtile", "flash", "math", "naive")} == {"ok"}
    assert {s for (p, _, _), s in status.items() if p == "efficient"} == {"unsupported"}  # no CPU kernel
    assert {s for (p, _, _), s in status.items() if p == "flash_attn"} <= {"n/a", "ok"}
    assert {s for (p, _, _), s in status.items() if p == "oom_peer"} == {"oom"}
    for r in dense:
        if r["status"] == "ok":
            assert r["max_abs_err"] < 1e-4 and r["ref_heads"] == r["H"] // r["Hkv"]
            assert {"out", "dq", "dk", "dv"} <= set(r["check"])
            assert all(r[f"{s}_ms"] > 0 and r[f"{s}_tflops"] > 0 and r[f"{s}_GBps"] > 0 for s in suite.DENSE_STAGES)
        if r["prov"] == "flashtile":
            assert r["backend"] == ["torch"]
            if r["N"] == 32:  # profiled at the first seqlen of each configuration
                assert any(x.startswith("flashtile.fwd[torch") for x in r["ranges"]["fwd"])
                assert any(x.startswith("flashtile.bwd[torch") for x in r["ranges"]["bwd"])
    assert {r["group"] for r in dense} == {"fp32 d16 h2/2", "fp32 d16 h4/2"}

    rows = payload["variants"]
    assert {(r["prov"], r["variant"]) for r in rows} == {("flashtile", "plain"), ("flashtile", "softcap")}
    assert all(r["status"] == "ok" for r in rows)

    dec = payload["decode"]
    assert {(r["prov"], r["layout"]) for r in dec if r["status"] in ("ok", "partial")} == {
        ("flashtile", "contiguous"), ("flashtile", "paged16"), ("flashtile", "paged256"),
        ("flash", "contiguous"), ("math", "contiguous")}
    for r in dec:
        if r["prov"] == "flashtile":
            assert r["max_abs_err"] < 1e-4 and r["step_ms"] > 0 and r["step_GBps"] > 0
            assert r["graph_err"].startswith("Unavailable: CUDA graphs need")  # no CUDA: marked, not skipped silently
    assert any(r["prov"] == "efficient" and r["status"] == "unsupported" for r in dec)

    rows = payload["e2e"]
    assert len(rows) == 3 * 3  # 3 implementations x (2 prefill + 1 decode)
    if HAS_TRANSFORMERS:
        assert {r["prov"] for r in rows if r["status"] == "ok"} >= {"sdpa", "eager"}
        eager = next(r for r in rows if r["prov"] == "eager" and r["kind"] == "prefill" and r["prompt"] == 8)
        assert eager["logits_max_diff_vs_eager"] == 0.0
    else:
        assert {r["status"] for r in rows} == {"n/a"}

    assert {e["section"] for e in payload["summary"]} >= {"dense", "variants", "decode"}
    assert payload["stages"]["window"]["status"] == "skipped" and payload["stages"]["decode"]["status"] == "ran"
    files = report.write(payload, state.stem, plots=False)
    markdown = (tmp_path / files["markdown"].split("/")[-1]).read_text()
    for heading in ("## Summary: flashtile vs the best peer", "## Dense attention", "### fp32 d16 h4/2 causal",
                    "## Variants", "## Decode", "## End to end", "## Kernels that ran"):
        assert heading in markdown
    assert "| OOM" in markdown and "`flashtile.fwd[torch" in markdown
    assert "Summary: flashtile vs the best peer, by configuration" in report.terminal(payload)


def test_decode_paged_cache_holds_the_same_keys():
    shape = decode.DecodeShape(3, 50, nheads=4, nheads_kv=2, headdim=8, dtype="fp32")
    cache = decode.make_cache(shape, "cpu")
    for page in (16, 256):
        k_pages, v_pages, table = decode.paged_cache(cache, page)
        assert table.dtype == torch.int32 and table.shape == (3, -(-50 // page))
        assert sorted(table.flatten().tolist()) == list(range(k_pages.shape[0]))  # every block used once
        for b in range(3):
            rows = k_pages[table[b].long()].reshape(-1, 2, 8)[:50]
            assert torch.equal(rows, cache["k"][b])
    assert [c[1:] for c in decode.cells([shape], ("contiguous", "paged16"), ("flashtile", "cudnn"))] == [
        ("flashtile", "contiguous"), ("flashtile", "paged16"), ("cudnn", "contiguous")]


def test_decode_without_the_kvcache_api_is_marked_not_available(monkeypatch):
    monkeypatch.delattr(flashtile, "flash_attn_with_kvcache", raising=False)
    shape = decode.DecodeShape(1, 16, nheads=2, nheads_kv=1, headdim=8, dtype="fp32")
    row = decode.measure("flashtile", decode.make_cache(shape, "cpu"), shape, "contiguous", common.cpu_timer())
    assert common.row_status(row) == "n/a" and "flash_attn_with_kvcache" in row["err"]


# ---------------------------------------------------------------- the CPU suite end to end


@pytest.mark.skipif(HAS_CUDA, reason="the CPU mode is what a machine without a GPU runs")
def test_cpu_suite_end_to_end(tmp_path, capsys):
    # Two providers at one seqlen: each cell is a fresh Python process (about 2 s of imports).
    status, out, err = cli(capsys, "bench", "--quick", "--seqlens", "256", "--providers", "flashtile", "sdpa",
                           "--out", tmp_path, "--json")
    assert status == 0, err
    payload = json.loads(out)
    assert suite.validate(payload) == []
    on_disk = json.loads(next(tmp_path.glob("cpu-suite-quick-*.json")).read_text())
    assert suite.validate(on_disk) == [] and on_disk["cpu"] == payload["cpu"]
    assert payload["mode"] == "cpu" and payload["env"]["gpu"] is None and payload["env"]["git_commit"]
    assert payload["stages"]["fwd"]["status"] == "ran"
    assert {s for s, v in payload["stages"].items() if v["status"] == "skipped"} == set(suite.STAGES) - {"fwd"}
    assert "GPU rows skipped" in payload["skipped"][0] and "GPU rows skipped" in err
    rows = payload["cpu"]
    assert {r["prov"] for r in rows} == {"flashtile", "sdpa"} and {r["N"] for r in rows} == {256}
    assert all(r["status"] == "ok" and r["fwd_ms"] > 0 for r in rows)
    (entry,) = payload["summary"]
    assert entry["section"] == "cpu" and entry["best_peer"] == "sdpa" and entry["ratio"] > 0
    assert "[####################] 2/2 100%" in err  # the progress bar
    markdown = (tmp_path / payload["files"]["markdown"].split("/")[-1]).read_text()
    assert "## CPU comparison" in markdown and "GPU rows skipped" in markdown and "## Summary" in markdown
    if HAS_MPL:
        (plot,) = payload["files"]["plots"]
        assert plot.endswith("-cpu.png") and (tmp_path / plot.split("/")[-1]).read_bytes()[:4] == b"\x89PNG"
        assert "![" in markdown
    else:
        assert "matplotlib is not installed" in payload["files"]["plots_note"]


def test_plots_without_matplotlib_are_skipped_and_said(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    payload = _payload(dense=[_dense_row("flashtile", 1.0), _dense_row("flash", 2.0)])
    files = report.write(payload, tmp_path / "x", plots=True)
    assert files["plots"] == [] and "matplotlib is not installed" in files["plots_note"]
    assert "matplotlib is not installed" in (tmp_path / "x.md").read_text()


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_dense_plot_has_a_figure_per_configuration(tmp_path):
    rows = [_dense_row(p, ms, N=n, config=f"bf16 d128 h16/16 {c}")
            for p, ms in (("flashtile", 1.0), ("cudnn", 0.9)) for n in (1024, 4096) for c in ("causal", "full")]
    for r in rows:
        r["causal"] = r["config"].endswith("causal")
    paths, note = plots.write_all(_payload(dense=rows), tmp_path / "run")
    assert note is None and [p.name for p in paths] == ["run-dense-bf16-d128-h16-16.png", "run-headline.png"]


def test_headline_plot_takes_the_longest_causal_rows_of_each_configuration(tmp_path):
    rows = [_dense_row(p, ms * n / 1024, N=n, config=f"bf16 d{d} h16/16 {c}")
            for p, ms in (("flashtile", 1.0), ("cudnn", 0.9)) for n in (1024, 4096) for c in ("causal", "full")
            for d in (64, 128)]
    for r in rows:
        r["causal"] = r["config"].endswith("causal")
    paths = plots.headline(_payload(dense=rows), tmp_path / "run", _RecordingFigure)
    assert [p.name for p in paths] == ["run-headline.png"]
    want = {p: [r["fwd_tflops"] for r in rows if r["prov"] == p and r["causal"] and r["N"] == 4096]
            for p in ("flashtile", "cudnn")}
    assert _RecordingFigure.bars == [("flashtile", want["flashtile"]), ("cudnn", want["cudnn"]),  # forward
                                     ("flashtile", [0, 0]), ("cudnn", [0, 0])]  # no backward rows
    assert plots.headline(_payload(dense=[r for r in rows if r["N"] == 1024]), tmp_path / "one", _RecordingFigure) == []


class _RecordingAxes:
    def __init__(self, bars):
        self.bars = bars

    def bar(self, xs, heights, width, label):
        self.bars.append((label, list(heights)))

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _RecordingFigure:
    """A matplotlib Figure stand-in that records the bars drawn on it."""
    bars: list = []

    def __init__(self, **kwargs):
        type(self).bars = []

    def subplots(self, rows, cols, **kwargs):
        return [_RecordingAxes(type(self).bars) for _ in range(cols)]

    def suptitle(self, *args, **kwargs):
        pass

    def savefig(self, path, **kwargs):
        path.write_bytes(b"png")


# ---------------------------------------------------------------- schema, merge, exit status


def _env(**extra):
    return {"date": "2026-11-21", "time_utc": "2026-11-21T00:00:00Z", "flashtile": "0.1.0", "git_commit": "abc",
            "git_dirty": False, "torch": "2.13", "triton": "3.6.0", "python": "3.11", "platform": "linux", "argv": [],
            "device": "cuda", "gpu": "NVIDIA H200", "driver": "570.0", "cuda": "13.0", "cpu": "x", **extra}


def _payload(env=None, **sections):
    opts = suite.Options(suite.QUICK, suite.STAGES, None, "cuda", None)
    payload = suite.new_payload(opts, env or _env())
    for name, rows in sections.items():
        payload[name] = rows
    for stage in suite.STAGES:
        payload["stages"][stage] = {"status": "ran", "reason": None}
    return suite.finalize(payload)


def test_schema_check_finds_what_is_wrong():
    payload = _payload(dense=[_dense_row("flashtile", 1.0), _dense_row("flash", 2.0)])
    assert suite.validate(payload) == [] and payload["models"]["bandwidth_ceiling_TBps"] == common.H200_COPY_TBPS
    assert "modeled HBM bytes" in payload["models"]["bytes"] and "4 * B * H * Sq * Sk * D" in payload["models"]["flops"]
    broken = json.loads(json.dumps(payload))
    del broken["env"]["driver"]
    broken["dense"][0]["fwd_ms"] = 5.0  # outside its own spread [1.0, 1.0]
    broken["dense"][1]["status"] = "fine"
    del broken["dense"][1]["N"]
    problems = suite.validate(broken)
    assert any("env: missing 'driver'" in p for p in problems)
    assert any("outside its spread" in p for p in problems)
    assert any("status 'fine'" in p for p in problems) and any("missing 'N'" in p for p in problems)
    assert suite.validate({"schema": "x"})[0].startswith("payload: missing")


def test_merge_combines_runs_made_in_parts(tmp_path, capsys):
    first = _payload(dense=[_dense_row("flashtile", 1.0, N=1024), _dense_row("cudnn", 2.0, N=1024)])
    second = _payload(_env(git_commit="def"), dense=[_dense_row("flashtile", 1.0, N=1024, config="bf16 d64 h32/32 full"),
                                                     _dense_row("cudnn", 4.0, N=1024)])  # replaces the first cudnn row
    paths = []
    for i, payload in enumerate((first, second)):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(payload))
    status, out, err = cli(capsys, "bench", "--merge", *paths, "--out", tmp_path / "merged", "--no-plots", "--json")
    assert status == 0, err
    merged = json.loads(out)
    assert suite.validate(merged) == [] and merged["grid"]["name"] == "merged"
    assert len(merged["dense"]) == 3
    assert next(r for r in merged["dense"] if r["prov"] == "cudnn")["fwd_ms"] == 4.0
    assert any("differ in git_commit: abc, def" in line for line in merged["skipped"])
    assert [m["git_commit"] for m in merged["env"]["merged_from"]] == ["abc", "def"]
    assert (tmp_path / "merged" / "h200-suite-merged-2026-11-21.md").is_file()


def test_exit_status():
    ok = _payload(dense=[_dense_row("flashtile", 1.0)])
    assert suite.exit_status(ok) == 0
    failed = _payload(dense=[_dense_row("flashtile", fwd_err="OOM: x"), _dense_row("flash", 1.0)])
    assert suite.exit_status(failed) == 1
    assert suite.exit_status({**ok, "interrupted": True}) == 130


TINY_MODELS = (
    ("tiny GQA 4/2 d16 causal", providers.DenseShape(2, 37, 4, 2, 16, 16, True, "fp32")),
    ("tiny window (8, 0) d16", providers.DenseShape(1, 65, 2, 2, 16, 16, True, "fp32", window=8)),
    ("tiny softcap 5 + sink GQA 4/2", providers.DenseShape(1, 33, 4, 2, 16, 16, True, "fp32", softcap=5.0, sink=True)),
    ("tiny d24/dv16 causal", providers.DenseShape(1, 29, 2, 2, 24, 16, True, "fp32")),
)


def test_models_stage_validates_and_marks_each_peer(tmp_path):
    """The models stage on CPU: flashtile validated and timed on every model shape (windows, softcap, sinks,
    dv != d), FA4 not installed here (n/a), SDPA refusing the features it lacks (unsupported)."""
    grid = dataclasses.replace(tiny_grid(), models=TINY_MODELS)
    opts = suite.Options(grid, ("models",), ("flashtile", "fa4", "flash", "math"), "cpu", tmp_path)
    state = suite._Run(opts, suite._cpu_env())
    with force_backend("torch"):
        suite.run_stages(state, torch.device("cpu"), common.cpu_timer())
    payload = suite.finalize(state.payload)
    assert suite.validate(payload) == []
    status = {(r["config"], r["prov"]): r["status"] for r in payload["dense"]}
    assert len(status) == len(TINY_MODELS) * 4
    for label, shape in TINY_MODELS:
        assert status[(label, "flashtile")] == "ok" and status[(label, "fa4")] == "n/a"
        plain = shape.plain() and shape.headdim == shape.headdim_v  # SDPA flash on CPU has no dv != d
        assert status[(label, "flash")] == ("ok" if plain else "unsupported")
    window = next(r for r in payload["dense"] if r["config"] == "tiny window (8, 0) d16" and r["prov"] == "flashtile")
    assert window["window"] == [8, 0] and set(window["check"]) == {"out", "lse", "dq", "dk", "dv"}
    assert window["fwd_tflops"] == pytest.approx(2 * 2 * sum(min(i, 8) + 1 for i in range(65)) * 32 / 1e12
                                                 / (window["fwd_ms"] * 1e-3))
    text = report.markdown(payload)
    assert "## Model shapes" in text and "flashtile x fa4 fwd/bwd" in text and "| n/a" in text


def test_headline_grid_and_its_stages(tmp_path):
    opts = _options("--headline", "--device", "cpu", "--out", str(tmp_path))
    assert opts.grid.name == "headline" and opts.stages == ("fwd", "bwd", "models")
    dims = {(c.headdim, c.headdim_v, c.nheads, c.causal) for c in opts.grid.dense}
    assert dims == {(d, dv, 2048 // d, causal) for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128))
                    for causal in (False, True)}
    assert opts.grid.seqlens == (1024, 4096, 16384) and opts.stage_providers("dense") == (
        "flashtile", "fa4", "cudnn", "flash", "flex")
    assert len(opts.grid.models) == len(suite.MODEL_SHAPES) == 7


def test_a_busy_machine_and_the_repeats_are_said(tmp_path, monkeypatch):
    load = float(common.machine_load()["cpus"])  # every core busy, on a 2-core runner as on a 64-core GPU host
    monkeypatch.setattr(common.os, "getloadavg", lambda: (load, load, load))
    env = suite._cpu_env()
    assert env["busy"] and env["load_1m"] == load
    payload = suite.new_payload(suite.Options(tiny_grid(), ("fwd",), None, "cpu", tmp_path), env)
    payload["dense"] = [{"prov": "flashtile", "config": "c", "group": "g", "dtype": "fp32", "D": 16, "Dv": 16, "H": 1,
                         "Hkv": 1, "N": 8, "B": 1, "causal": False, "fwd_ms": 1.0, "fwd_reps": 5}]
    payload["stages"] = {"fwd": {"status": "ran", "reason": "CPU comparison"},
                         "decode": {"status": "skipped", "reason": "no CUDA GPU"}}
    text, console = report.markdown(payload), report.terminal(payload)
    assert "BUSY MACHINE" in text and "BUSY MACHINE" in console
    assert "5 timed runs per measurement" in text and "Repeats: 5 timed runs" in console
    assert "| decode" not in text  # the header names the stages that run, no GPU stage on CPU
