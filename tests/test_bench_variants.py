"""``python -m flashtile bench --suite variants`` (flashtile/bench/variants.py) on CPU: the case list,
the FLOP model, the criteria, the tables and the result file. The GPU timings cannot run here; the
smoke run (tiny shapes, wall clock) goes through the same measuring code.

flashtile's variants are being written alongside this benchmark, so the end-to-end runs stand a
reference-backed fake in for ``flash_attn_func`` / ``flash_attn_varlen_func`` where they need numbers,
and only ask the real ones not to crash the run.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashtile
from flashtile.bench import variants
from flashtile.testing import GPU_SUITE, attention_ref
from flashtile.testing import run_cli as cli

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {"group", "prov", "variant", "N", "B", "H", "D", "causal", "visible_pairs"}



def fake_flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sink=None,
                         attn_bias=None, return_attn_probs=False):
    """The reference in the input dtype: differentiable in q, k, v, sink and a float bias."""
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, sink=sink, attn_bias=attn_bias, upcast=False)
    return (out.to(q.dtype), lse.float(), None) if return_attn_probs else out.to(q.dtype)


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    bounds = cu_seqlens_q.tolist()
    return torch.cat([fake_flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], causal=causal)[0]
                      for s, e in zip(bounds[:-1], bounds[1:])])


@pytest.fixture
def fake_flashtile(monkeypatch):
    monkeypatch.setattr(flashtile, "flash_attn_func", fake_flash_attn_func)
    monkeypatch.setattr(flashtile, "flash_attn_varlen_func", fake_flash_attn_varlen_func, raising=False)


# ---------------------------------------------------------------- cases and FLOPs


@pytest.mark.parametrize("seqlen", [1, 5, 33, 130])
@pytest.mark.parametrize("window", [None, 0, 3, 40, 200])
def test_visible_pairs_counts_the_reference_mask(seqlen, window):
    rows = torch.arange(seqlen)[:, None]
    cols = torch.arange(seqlen)[None, :]
    causal = cols <= rows
    if window is not None:
        causal &= cols >= rows - window
    assert variants.visible_pairs(seqlen, True, window) == int(causal.sum())
    assert variants.visible_pairs(seqlen, False) == seqlen * seqlen


def test_window_flops_at_16k_leave_room_for_8x():
    full, window = variants.visible_pairs(16384, True), variants.visible_pairs(16384, True, 1024)
    assert 8.0 < full / window < 8.5  # the bar is 8x; the visible pairs allow 8.25x


def test_default_cases_are_the_issues_shapes():
    cases = variants.build_cases(variants.DEFAULT)
    by_group = {g: [c for c in cases if c.group == g] for g in variants.GROUP_NAMES}
    assert all(by_group.values())
    assert all((c.H, c.D) == (16, 128) for c in cases)
    window = by_group["window"]
    assert sorted({c.N for c in window}) == [4096, 8192, 16384] and {c.B for c in window} == {1}
    assert {(c.prov, c.variant) for c in window} == {("flashtile", "window"), ("flashtile", "causal"),
                                                      ("flex", "window"), ("flex", "causal"), ("flash", "causal"),
                                                      ("fa4", "window"), ("fa4", "causal")}
    assert all(c.window == 1024 and c.causal for c in window if c.variant == "window")
    assert {c.seqlens for c in by_group["varlen_equal"]} == {(2048,) * 16}
    (mixed,) = {c.seqlens for c in by_group["varlen_mixed"]}
    assert len(mixed) == 16 and all(128 <= n <= 4096 for n in mixed)
    assert mixed == variants.mixed_seqlens(16, 128, 4096)  # fixed seed: the same lengths every run
    for group in ("mods", "bias"):
        assert all(c.B * c.N == 16384 for c in by_group[group])
    mods = by_group["mods"]
    assert sorted({c.N for c in mods}) == [4096, 8192] and {c.causal for c in mods} == {False, True}
    assert {c.N for c in mods if c.prov == "flex"} == {8192}  # Flex compiles are the slow part
    assert {c.variant for c in by_group["bias"] if c.prov == "efficient"} == {"bias", "bias_grad"}
    assert {c.softcap for c in mods if c.variant == "softcap"} == {50.0}
    assert {c.variant for c in mods if c.prov == "fa4"} == {"plain", "softcap", "sink"}  # FA4 has no ALiBi
    assert {c.variant for c in by_group["varlen_mixed"] if c.prov == "fa4"} == {"varlen"}


def test_cases_of_a_block_are_adjacent_and_providers_filter():
    cases = variants.build_cases(variants.DEFAULT)
    seen, previous = set(), None
    for c in cases:
        if c.block() != previous:
            assert c.block() not in seen, "a block's inputs are made once: its cases must run together"
            seen.add(c.block())
            previous = c.block()
    no_flex = variants.build_cases(variants.DEFAULT, providers=("flashtile", "flash"))
    assert no_flex and {c.prov for c in no_flex} == {"flashtile", "flash"}
    assert {c.group for c in variants.build_cases(variants.DEFAULT, groups=("bias",))} == {"bias"}


def test_case_key_carries_the_flop_model_inputs():
    (case,) = [c for c in variants.build_cases(variants.DEFAULT, groups=("varlen_mixed",))
               if c.prov == "flashtile" and c.variant == "padded" and c.causal]
    row = case.key()
    assert ROW_KEYS <= set(row) and row["seqlens"] == list(case.seqlens)
    assert row["pad_frac"] == pytest.approx(1 - sum(case.seqlens) / (16 * max(case.seqlens)))
    # Padded rows are credited with the real sequences' pairs only.
    assert row["visible_pairs"] == sum(n * (n + 1) // 2 for n in case.seqlens)
    assert variants.fwd_flops(case) == 4.0 * 16 * 128 * row["visible_pairs"]


# ---------------------------------------------------------------- criteria and tables


def _row(group, prov, variant, fwd, bwd, N=16384, B=1, causal=True, **extra):
    return {"group": group, "prov": prov, "variant": variant, "N": N, "B": B, "H": 16, "D": 128, "causal": causal,
            "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": 1.0, "bwd_tflops": 1.0, **extra}


def _verdicts(rows):
    return {c["id"]: c["verdict"] for c in variants.evaluate(rows)}


def test_flex_window_is_compared_with_its_own_causal():
    """The window table's ratio for Flex is Flex's window against Flex's causal (its own ratio, same run); the bar
    stays on flashtile's rows."""
    pairs = dict(window=[1024, 0], visible_pairs=variants.visible_pairs(16384, True, 1024))
    rows = [_row("window", "flashtile", "window", 1.0, 2.0, **pairs), _row("window", "flashtile", "causal", 6.0, 12.0),
            _row("window", "flex", "window", 2.0, 4.0, **pairs), _row("window", "flex", "causal", 14.0, 30.0)]
    lines = variants.group_table(rows, "window").splitlines()
    assert "7.00 / 7.50" in next(line for line in lines if "flex window" in line)
    assert "6.00 / 6.00" in next(line for line in lines if "flashtile window" in line)
    (window,) = [c for c in variants.evaluate(rows) if c["id"] == "window"]
    assert [round(ch["value"], 2) for ch in window["checks"]] == [6.0, 6.0]


def test_criteria_verdicts():
    rows = [
        _row("window", "flashtile", "window", 1.0, 3.0),
        _row("window", "flashtile", "causal", 9.0, 20.0),  # fwd 9x passes, bwd 6.7x fails
        _row("window", "flashtile", "window", 1.0, 1.0, N=4096),  # only the longest seqlen is judged
        _row("window", "flashtile", "causal", 1.0, 1.0, N=4096),
        _row("mods", "flashtile", "plain", 1.0, 2.0, N=8192, B=2),
        _row("mods", "flashtile", "softcap", 1.1, 2.2, N=8192, B=2),
        _row("mods", "flashtile", "alibi", 1.1, None, N=8192, B=2, bwd_err="NotImplementedError: x"),
        _row("varlen_mixed", "flashtile", "varlen", 0.5, 1.0, N=4000, B=16, pad_frac=0.5),
        _row("varlen_mixed", "flashtile", "padded", 1.0, 1.9, N=4000, B=16, pad_frac=0.5),
        _row("bias", "flashtile", "bias", 1.0, 2.0, N=4096, B=4, causal=False),
        _row("bias", "efficient", "bias", 2.0, 4.0, N=4096, B=4, causal=False),
    ]
    verdicts = _verdicts(rows)
    assert verdicts == {"window": "FAIL", "varlen_equal": "no data", "varlen_mixed": "pass", "softcap": "pass",
                        "alibi": "incomplete", "sink": "no data", "bias": "info"}
    results = {c["id"]: c for c in variants.evaluate(rows)}
    assert [ch["N"] for ch in results["window"]["checks"]] == [16384, 16384]
    # varlen mixed: value = varlen / padded / (1 - pad): fwd 0.5 / 1.0 / 0.5 = 1.0, bwd 1.0 / 1.9 / 0.5 = 1.05, both <= 1.1
    assert [round(ch["value"], 3) for ch in results["varlen_mixed"]["checks"]] == [1.0, 1.053]
    rows[-3]["bwd_ms"] = 1.7  # bwd 1.0 / 1.7 / 0.5 = 1.18 > 1.1
    assert _verdicts(rows)["varlen_mixed"] == "FAIL"
    rows[-3]["bwd_ms"] = 2.0
    rows[1]["bwd_ms"] = 30.0
    assert _verdicts(rows)["window"] == "pass"
    assert results["bias"]["checks"][0]["value"] == pytest.approx(0.5)


def test_bars_are_judged_on_paired_ratios_where_measured():
    """A row timed in alternation with its baseline carries ``paired_*`` ratios; the bar takes them over the
    ratio of the two medians (kept as ``unpaired_value``), stage by stage."""
    rows = [_row("mods", "flashtile", "plain", 1.0, 2.0, N=4096, B=4),
            {**_row("mods", "flashtile", "alibi", 1.22, 2.1, N=4096, B=4), "paired_fwd": 1.1}]
    alibi = next(c for c in variants.evaluate(rows) if c["id"] == "alibi")
    check = {ch["stage"]: ch for ch in alibi["checks"]}
    assert check["fwd"]["paired"] and check["fwd"]["value"] == pytest.approx(1.1)
    assert check["fwd"]["unpaired_value"] == pytest.approx(1.22) and check["fwd"]["ok"]
    assert not check["bwd"]["paired"] and check["bwd"]["value"] == pytest.approx(1.05)
    rows[1]["paired_bwd"] = 1.2
    assert _verdicts(rows)["alibi"] == "FAIL"
    # A speedup bar inverts the ratio: window / causal time 0.1 -> 10x.
    window = [_row("window", "flashtile", "causal", 1.0, 1.0), {**_row("window", "flashtile", "window", 0.2, 0.2),
                                                                 "paired_fwd": 0.1, "paired_bwd": 0.1}]
    assert [ch["value"] for ch in variants.evaluate(window)[0]["checks"]] == [pytest.approx(10.0)] * 2
    report = variants.format_report(rows, variants.evaluate(rows))
    assert "1.22 / 1.05 (paired 1.10 / 1.20)" in next(line for line in report.splitlines() if "flashtile alibi" in line)


def test_alternate_cancels_a_steady_drift():
    """Two equal functions on a clock that slows by 0.05 ms per timing: back to back, the second looks 4-5%
    slower; alternating the order each round, the median ratio is 1 (to a few tenths of a percent)."""
    clock = {"t": 0}

    def timer(fn, grad_to_none=None):
        clock["t"] += 1
        return [1.0 + 0.05 * clock["t"]] * 3

    first, second = (lambda: None, None), (lambda: None, None)
    assert variants.alternate(timer, first, second, 6) == pytest.approx(1.0, abs=0.005)
    clock["t"] = 0
    assert variants.alternate(timer, first, second, 1) == pytest.approx(1.10 / 1.05)


def test_only_flashtile_rows_with_a_bar_are_paired():
    case = variants.Case("mods", "flashtile", "alibi", 4096, 4, 16, 128, False)
    assert variants.bar_baselines(case) == [("flashtile", "plain")]
    assert variants.bar_baselines(variants.Case("mods", "flex", "alibi", 4096, 4, 16, 128, False)) == []
    assert variants.bar_baselines(variants.Case("mods", "flashtile", "plain", 4096, 4, 16, 128, False)) == []
    assert variants.bar_baselines(variants.Case("bias", "flashtile", "bias", 4096, 4, 16, 128, False)) == []


def test_failed_or_skipped_baseline_gives_no_verdict():
    rows = [_row("mods", "flashtile", "plain", None, None, N=4096, B=4, fwd_err="OOM: x"),
            _row("mods", "flashtile", "sink", 1.0, 1.0, N=4096, B=4)]
    assert _verdicts(rows)["sink"] == "no data"
    rows[0] = {**rows[0], "fwd_err": None, "fwd_ms": 1.0, "bwd_ms": 1.0, "skipped": "flex budget"}
    assert _verdicts(rows)["sink"] == "no data"


def test_report_marks_failures_and_shows_ratios():
    rows = [
        _row("window", "flashtile", "window", 1.0, 2.0, window=[1024, 0], visible_pairs=16384 * 1025 - 1024 * 1025 // 2),
        _row("window", "flashtile", "causal", 8.5, 17.0),
        _row("window", "flex", "window", None, None, fwd_err="OOM: CUDA out of memory"),
        _row("window", "flash", "causal", 10.0, None, bwd_err="RuntimeError: no kernel"),
        {**_row("mods", "flex", "alibi", None, None, N=8192, B=2), "skipped": "flex time budget (150 s) spent"},
    ]
    report = variants.format_report(rows, variants.evaluate(rows))
    lines = report.splitlines()
    window_line = next(line for line in lines if "flashtile window" in line)
    assert "8.50 / 8.50" in window_line
    assert "OOM" in next(line for line in lines if "flex window" in line)
    assert "ERR(RuntimeError)" in next(line for line in lines if "sdpa flash causal" in line)
    assert "skip" in next(line for line in lines if "flex alibi" in line)
    assert "ideal speedup from visible pairs 8.25x" in report
    assert "| window " in report and "pass" in next(line for line in lines if line.startswith("| window "))


# ---------------------------------------------------------------- smoke runs


# The smoke runs measure on the CPU device on any machine: CI runs them; in scripts/gpu_tests.sh they took ~440 of the
# GPU suite's worker-seconds (16 workers) for nothing the CPU run does not test.
CPU_RUN_IN_CI = pytest.mark.skipif(GPU_SUITE, reason="a benchmark run on the CPU device: CI runs it")


def _smoke_args(tmp_path, **overrides):
    args = dict(out=str(tmp_path), quick=False, groups=None, providers=None, dtype="bf16", device="cpu",
                no_check=False, json=False)
    args.update(overrides)
    return type("Args", (), args)()


@CPU_RUN_IN_CI
def test_smoke_run_measures_every_row_and_judges_every_criterion(tmp_path, fake_flashtile):
    payload, table = variants.run(_smoke_args(tmp_path, providers=["flashtile", "flash", "efficient"]))
    (path,) = tmp_path.glob("cpu-variants-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk["kind"] == "variants" and on_disk["rows"] == json.loads(json.dumps(payload["rows"], default=str))
    assert {"env", "sizes", "note", "flop_model", "rows", "criteria", "flashtile_stats"} <= set(on_disk)
    assert on_disk["env"]["dtype"] == "bf16" and "date" in on_disk["env"]
    rows = on_disk["rows"]
    assert {r["group"] for r in rows} == set(variants.GROUP_NAMES)
    for r in rows:
        assert ROW_KEYS <= set(r)
        if r["prov"] == "flashtile":
            assert r.get("fwd_ms") and r.get("bwd_ms"), r
            assert r.get("fwd_err") is None and r.get("bwd_err") is None
            if r.get("max_abs_err") is not None:
                assert r["max_abs_err"] < 0.05, r  # bf16 against the fp64 reference
        if r["prov"] == "efficient":  # no CPU kernel: a marked cell, not a crash
            assert r["fwd_err"].startswith("RuntimeError")
    checked = [r for r in rows if r["prov"] == "flashtile" and r.get("max_abs_err") is not None]
    assert {r["variant"] for r in checked} == {"window", "causal", "varlen", "padded", "plain", "softcap", "alibi",
                                               "sink", "bias", "bias_grad"}
    padded_full = [r for r in rows if r["group"] == "varlen_mixed" and r["variant"] == "padded" and not r["causal"]]
    assert padded_full and all("check_skipped" in r for r in padded_full)
    verdicts = {c["id"]: c["verdict"] for c in on_disk["criteria"]}
    assert set(verdicts) == {c.id for c in variants.CRITERIA}
    assert all(v in ("pass", "FAIL") for k, v in verdicts.items() if k != "bias")  # every check measured
    assert verdicts["bias"] == "info"
    assert "Criteria" in table and "wrote " in table
    # Every row a flashtile bar compares with another flashtile row was timed again in alternation with it.
    for r in rows:
        case = variants.Case(r["group"], r["prov"], r["variant"], r["N"], r["B"], r["H"], r["D"], r["causal"])
        if variants.bar_baselines(case):
            assert r["paired_rounds"] == 2 and r["paired_fwd"] > 0 and r["paired_bwd"] > 0, r
        else:
            assert "paired_fwd" not in r


@CPU_RUN_IN_CI
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_smoke_flex_runs_forward_only_on_cpu(tmp_path, fake_flashtile):
    payload, _ = variants.run(_smoke_args(tmp_path, groups=["window"], providers=["flex"]))
    rows = payload["rows"]
    assert rows and all(r["prov"] == "flex" for r in rows)
    for r in rows:
        assert r["fwd_ms"] > 0 and r["max_abs_err"] < 0.05  # the sliding-window block mask is the right one
        assert r["bwd_err"]  # Flex has no CPU backward: marked


@CPU_RUN_IN_CI
def test_smoke_run_with_the_real_flashtile_never_crashes(tmp_path):
    """Whatever flashtile implements today, every row is measured or marked."""
    payload, _ = variants.run(_smoke_args(tmp_path, providers=["flashtile"]))
    assert payload["rows"]
    for r in payload["rows"]:
        assert r.get("fwd_ms") is not None or r.get("fwd_err"), r


# ---------------------------------------------------------------- command line


@CPU_RUN_IN_CI
def test_bench_suite_variants_on_the_command_line(tmp_path, capsys, fake_flashtile):
    status, out, err = cli(capsys, "bench", "--suite", "variants", "--device", "cpu", "--groups", "mods",
                           "--providers", "flashtile", "--out", tmp_path, "--json")
    assert status == 0
    payload = json.loads(out)
    assert {r["group"] for r in payload["rows"]} == {"mods"}
    assert "Criteria" in err  # the table goes to stderr with --json


@pytest.mark.parametrize("argv, message", [
    (["--suite", "variants", "--seqlens", "1024"], "--seqlens: not used by --suite variants"),
    (["--suite", "variants", "--groups", "nope"], "--groups nope: choose from"),
    (["--suite", "variants", "--providers", "naive"], "--providers naive: choose from"),
    (["--groups", "window"], "--groups: only with --suite variants"),
])
def test_bench_suite_variants_usage_errors(capsys, argv, message):
    status, _, err = cli(capsys, "bench", *argv)
    assert status == 2 and message in err


def test_module_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "flashtile.bench.variants", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "--groups" in result.stdout and "--out" in result.stdout
