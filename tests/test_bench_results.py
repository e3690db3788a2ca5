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


def test_fp8_renderer_is_the_suite_tables():
    from flashtile.bench import fp8

    forward = {"D": 128, "N": 4096, "causal": True, "bf16_tflops": 500.0, "fp8_kernel_tflops": 650.0,
               "fp8_kernel_speedup_vs_bf16": 1.3, "fp8_e2e_tflops": 400.0, "fp8_e2e_speedup_vs_bf16": 0.8,
               "quantize_ms": 0.4, "fp8_e2e_rmse": 3e-3, "status": "ok"}
    decode = {"B": 16, "L": 32768, "bf16_graph_ms": 0.5, "bf16_graph_GBps": 4300.0, "fp8_graph_ms": 0.4,
              "fp8_graph_GBps": 2700.0, "fp8_over_bf16_graph": 0.8, "status": "ok"}
    packed = {**forward, "lengths": [3000, 1000], "N": 4000}
    rows = {"forward": [forward, {"D": 256, "N": 8192, "causal": False, "status": "wrong: rmse 0.5"}],
            "varlen": [packed], "decode": [decode]}
    text = results.RENDERERS["fp8"]({"rows": rows}, {})
    assert "| 128 | 4096 | True | 500 | 650 | 1.30 | 400 | 0.80 | 0.400 | 3.00e-03 | ok |" in text
    assert "| 256 | 8192 | False | - | - | - | - | - | - | - | wrong: rmse 0.5 |" in text
    assert "| 16 x 32768 | 500.0 | 4300 | 400.0 | 2700 | 0.80 | ok |" in text
    assert "| 128 | packed 3000 + 1000 | True | 500 | 650 | 1.30 |" in text
    assert results.RENDERERS["fp8"]({"rows": {"forward": [forward], "decode": [decode]}}, {})  # files before varlen
    assert text in fp8.markdown(rows, "GPU")  # the suite's own tables, not a copy


def test_cp_renderer_per_method_cells_best_and_long_run():
    row = {"world": 2, "tokens_per_gpu": 8192, "N": 16384, "nheads": 32, "nheads_kv": 8, "flashtile_1gpu_ms": 13.0,
           "ring_ms": 9.0, "ring_efficiency": 13.0 / 18.0, "ring_mem_gb": 1.5, "ring_status": "ok",
           "ulysses_rel_err": 0.3, "ulysses_status": "wrong",
           "torch_cp_ms": 8.5, "torch_cp_efficiency": 13.0 / 17.0, "torch_cp_mem_gb": 2.3, "torch_cp_status": "ok"}
    slow = {**row, "tokens_per_gpu": 16384, "flashtile_1gpu_ms": 52.0, "ring_ms": 30.0, "ring_efficiency": 52 / 60,
            "torch_cp_status": "error: OutOfMemoryError: CUDA out of memory", "ulysses_status": "wrong",
            "ulysses_rel_err": None, "ulysses_max_err": 0.0625}
    del slow["torch_cp_ms"]
    text = results.RENDERERS["cp"]({"rows": [row, slow]}, {})
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "tokens/GPU", "heads", "T1 ms", "ring ms / eff / GB", "ulysses ms / eff / GB", "torch_cp ms / eff / GB", "fastest"]
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == [
        "8,192", "32/8", "13.0", "9.0 / 0.72 / 1.5", "wrong (rel err 0.3)", "8.5 / 0.76 / 2.3", "torch_cp"]
    assert [c.strip() for c in lines[3].split("|")[1:-1]] == [
        "16,384", "32/8", "52.0", "30.0 / 0.87 / 1.5", "wrong (abs err 0.0625)", "ERR(OutOfMemoryError)", "ring"]
    long = {"world": 4, "tokens_per_gpu": 262144, "N": 1048576, "nheads": 32, "nheads_kv": 8, "headdim": 128,
            "ring_ms": 15666.9, "ring_mem_gb": 37.08, "sampled_rows": list(range(16)), "max_err": 8.27e-5}
    assert results.RENDERERS["cp"]({"rows": [long]}, {}) == (
        "1,048,576 tokens on 4 GPUs (262,144 a GPU), 32/8 heads, d128, causal forward + backward: ring 15.7 s, "
        "37.1 GB per GPU; 16 rows of out spread over the sequence within 8.3e-05 of a float32 reference.")


def test_facts_of_files_without_env_and_of_other_commands(tmp_path):
    """A context-parallel file names its GPU, date, versions and commit at its top level; a file whose env
    names its own command shows that command."""
    (tmp_path / results.INDEX).parent.mkdir(parents=True)
    cp = {"gpu": "NVIDIA H200", "date": "2026-11-27", "torch": "2.11", "triton": "3.6", "commit": "56f0e72",
          "rows": [{"world": 4, "tokens_per_gpu": 8, "N": 32, "nheads": 4, "nheads_kv": 2, "headdim": 16,
                    "ring_ms": 1.0, "ring_mem_gb": 0.5, "sampled_rows": [0, 31], "max_err": 1e-5}]}
    later = {**cp, "env": {"date": "2026-11-28", "torch": "2.12", "triton": "3.7", "git_commit": "abcdef0123",
                           "argv": ["--gpus", "4"], "command": "python -m flashtile.distributed.bench --gpus 4"}}
    for name, data in (("a.json", cp), ("b.json", later)):
        (tmp_path / results.INDEX.parent / name).write_text(json.dumps(data))
    sections = [{"file": name, "renderer": "cp", "title": name} for name in ("a.json", "b.json")]
    (tmp_path / results.INDEX).write_text(json.dumps({"title": "B", "sections": sections}))
    text = results.render(tmp_path)
    assert ("GPU NVIDIA H200 · 2026-11-27 · torch 2.11 · triton 3.6 · flashtile commit `56f0e72` · data "
            "`benchmarks/results/a.json`\n") in text
    assert ("GPU NVIDIA H200 · 2026-11-28 · torch 2.12 · triton 3.7 · flashtile commit `abcdef0123` · data "
            "`benchmarks/results/b.json` · `python -m flashtile.distributed.bench --gpus 4`\n") in text
