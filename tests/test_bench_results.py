"""The results policy (flashtile/bench/results.py): BENCHMARKS.md is exactly what ``python -m flashtile bench
--report`` makes from benchmarks/results/index.json, under 45 KB; every indexed file exists; no experiment
patch (.diff) is committed; backward numbers of the wrong one-pass kernel are withdrawn, never shown."""
import json
import re

from flashtile.bench import results
from flashtile.testing import run_cli as cli

ROOT = results.ROOT


def test_benchmarks_md_is_the_report_of_the_index():
    committed = (ROOT / results.OUTPUT).read_text()
    assert committed == results.render(ROOT), "BENCHMARKS.md drifted: run `python -m flashtile bench --report`"
    assert len(committed.encode()) < results.MAX_BYTES


def test_every_table_names_gpu_date_versions_and_commit():
    index = json.loads((ROOT / results.INDEX).read_text())
    text = results.render(ROOT)
    assert len(re.findall(r"^GPU NVIDIA .* · \d{4}-\d\d-\d\d · torch \S+ · triton \S+ · flashtile commit `[0-9a-f]{7,}`",
                          text, flags=re.M)) == len(index["sections"])
    for entry in index["sections"]:
        assert (ROOT / results.INDEX.parent / entry["file"]).is_file() and entry["renderer"] in results.RENDERERS


def test_no_experiment_patches_in_results():
    assert not list((ROOT / results.INDEX.parent).glob("*.diff"))


def test_one_pass_backward_numbers_are_withdrawn():
    text = results.render(ROOT)
    assert results.WITHDRAWN in text  # the variants run's MHA d128 backward (466f66a)
    ok = {"err": 0.001, "bound": 0.03}
    checked = {"prov": "flashtile", "D": 128, "H": 16, "Hkv": 16, "config": "c", "bwd_ms": 1.0,
               "ranges": {"bwd": ["flashtile.bwd[gluon-sm90-ws d=128 one-pass]"]},
               "check": dict.fromkeys(("dq", "dk", "dv"), ok)}
    wrong = {**checked, "check": {**checked["check"], "dk": {"err": 0.5, "bound": 0.03}}}
    # A backward whose gradients were checked before timing stands, one-pass kernel or not; one that failed does not.
    assert [r.get("bwd_err") for r in results.withdraw([checked, wrong], "2026-11-27")] == [None, results.WITHDRAWN]
    rows = [{"prov": "flashtile", "D": 128, "H": 16, "Hkv": 16, "config": "c", "bwd_ms": 1.0, "bwd_tflops": 500.0},
            {"prov": "flashtile", "D": 128, "H": 32, "Hkv": 8, "config": "g", "bwd_ms": 1.0},
            {"prov": "flashtile", "D": 64, "H": 32, "Hkv": 32, "config": "s", "bwd_ms": 1.0,
             "ranges": {"bwd": ["flashtile.bwd[gluon-sm90-ws d=64 one-pass]"]}},
            {"prov": "flashtile", "D": 64, "H": 32, "Hkv": 32, "config": "s", "bwd_ms": 1.0},
            {"prov": "cudnn", "D": 128, "H": 16, "Hkv": 16, "config": "c", "bwd_ms": 1.0}]
    before, after = results.withdraw(rows, "2026-11-22"), results.withdraw(rows, "2026-11-27")
    assert [r.get("bwd_err") == results.WITHDRAWN for r in before] == [False, False, True, True, False]
    assert [r.get("bwd_err") == results.WITHDRAWN for r in after] == [True, False, True, True, False]
    assert "bwd_tflops" not in after[0] and "bwd_ms" not in after[0]


def test_report_on_the_command_line(capsys, tmp_path, monkeypatch):
    (tmp_path / results.INDEX).parent.mkdir(parents=True)
    for name in ("index.json", "qualify-llama-h200.json"):
        (tmp_path / results.INDEX.parent / name).write_bytes((ROOT / results.INDEX.parent / name).read_bytes())
    index = json.loads((tmp_path / results.INDEX).read_text())
    index["sections"] = [e for e in index["sections"] if e["renderer"] == "qualify"]
    (tmp_path / results.INDEX).write_text(json.dumps(index))
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.setattr(results.write_report, "__defaults__", (tmp_path,))
    status, out, _ = cli(capsys, "bench", "--report")
    assert status == 0 and "wrote" in out
    assert (tmp_path / "BENCHMARKS.md").read_text().startswith("# Benchmarks")
