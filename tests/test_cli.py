"""``python -m flashtile info | memory | qualify``: run in-process through ``flashtile.cli.main``
(stdout captured), plus a few subprocesses for the exit status a shell sees.

Shapes are tiny so the file runs in well under a minute on two CPU cores, where conftest puts
the Triton kernels under the interpreter (the preferred backend for CPU tensors there).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile import dispatch
from flashtile.testing import run_cli as cli
from flashtile.tools import model_config

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parent.parent
# The smallest qualify run that still has a prefill (fwd + bwd over two key blocks) and a decode.
TINY = ["--prefill", "64", "--decode", "40", "--runs", "1"]



def run_module(*argv, **env):
    """``python -m flashtile *argv`` in a subprocess from the checkout, with extra environment."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "flashtile", *map(str, argv)], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=120)


@pytest.fixture(autouse=True)
def fresh_fallback_warnings(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set(), raising=False)


# ---------------------------------------------------------------- info


def test_info_reports_versions_gpu_and_backends(capsys):
    status, out, _ = cli(capsys, "info")
    assert status == 0
    assert "flashtile 0." in out and "torch " in out and "triton " in out
    assert ("GPU 0:" in out) if HAS_CUDA else ("no CUDA GPU" in out)
    assert "TRITON_INTERPRET: " in out

    status, out, _ = cli(capsys, "info", "--json")
    report = json.loads(out)
    assert status == 0 and report["versions"]["torch"] == torch.__version__
    probes = {(p["device"], p["dtype"]): p for p in report["probes"]}
    if not HAS_CUDA:
        # conftest runs CPU tests under the interpreter: Triton serves CPU fp16, and bf16 falls back with the reason.
        assert report["triton_interpret"] and report["gpus"] == []
        assert probes["cpu", "float16"]["backend"] == "triton" and not probes["cpu", "float16"]["fallback"]
        assert probes["cpu", "bfloat16"]["fallback"] and "bfloat16" in probes["cpu", "bfloat16"]["rejected"]["triton"]
        assert "Triton's interpreter computes bfloat16" in cli(capsys, "info")[1]
    else:
        assert probes["cuda", "bfloat16"]["backend"] == "triton"


def test_info_names_a_disabled_backend(capsys):
    with dispatch.disable_backends("torch"):
        status, out, _ = cli(capsys, "info", "--json")
    assert status == 0
    for p in json.loads(out)["probes"]:
        assert "torch" not in p["usable"] and p["rejected"]["torch"].startswith("disabled")


# ---------------------------------------------------------------- memory


def test_memory_matches_hand_computation(capsys):
    # Llama-3-8B's attention: 32 layers, 32 heads, 8 KV heads, head dim 128, bf16 (2 bytes); 4096 tokens, batch 2.
    status, out, _ = cli(capsys, "memory", "--layers", 32, "--heads", 32, "--kv-heads", 8, "--head-dim", 128,
                         "--dtype", "bf16", "--seqlen", 4096, "--batch", 2, "--json")
    assert status == 0
    result = json.loads(out)
    kv = result["kv_cache"]
    assert kv["bytes_per_token_per_layer"] == 2 * 8 * 128 * 2 == 4096  # K and V x 8 heads x 128 x 2 B
    assert kv["bytes_per_token"] == 4096 * 32 == 131_072  # 128 KiB
    assert kv["bytes_per_sequence"] == 131_072 * 4096 == 536_870_912  # 512 MiB
    assert kv["bytes_total"] == 536_870_912 * 2 == 1_073_741_824  # 1 GiB
    assert kv["windowed"] is None  # no sliding layer
    attn = result["attention_per_layer"]
    assert attn["standard"]["scores_bytes"] == 2 * 32 * 4096**2 * 2 == 2_147_483_648  # B x H x N^2 x 2 B = 2 GiB
    assert attn["standard"]["probs_bytes"] == 2_147_483_648
    assert attn["standard"]["total_bytes"] == 4_294_967_296
    assert attn["flashtile"]["lse_bytes"] == 2 * 32 * 4096 * 4 == 1_048_576  # B x H x N x fp32 = 1 MiB
    assert attn["flashtile"]["backward_stats_bytes"] == 2 * 1_048_576  # delta and lse2
    assert attn["flashtile"]["total_bytes"] == 3_145_728
    assert attn["ratio"] == pytest.approx(4_294_967_296 / 3_145_728)  # 1365.3x
    saved = result["saved_for_backward_all_layers"]
    assert saved == {"standard_probs_bytes": 32 * 2_147_483_648, "flashtile_lse_bytes": 32 * 1_048_576}

    status, out, _ = cli(capsys, "memory", "--layers", 32, "--heads", 32, "--kv-heads", 8, "--head-dim", 128,
                         "--seqlen", 4096, "--batch", 2)
    assert status == 0
    assert "536,870,912" in out and "512 MiB" in out and "1,365.3x" in out and "2 (K,V) x 8 kv heads x 128 x 2 B" in out


def test_memory_windowed_cache_of_gemma2(capsys):
    # Bundled gemma2: 4 layers alternating sliding (window 128) / global, 2 KV heads, head dim 256, bf16.
    status, out, _ = cli(capsys, "memory", "--config", "gemma2", "--seqlen", 1000, "--batch", 3, "--json")
    assert status == 0
    kv = json.loads(out)["kv_cache"]
    per_token_layer = 2 * 2 * 256 * 2  # 2048 B
    assert kv["bytes_per_token_per_layer"] == per_token_layer
    assert kv["bytes_total"] == 3 * 4 * 1000 * per_token_layer == 24_576_000  # every layer keeps every token
    assert kv["windowed"]["tokens_kept_per_layer"] == [128, 1000, 128, 1000]
    assert kv["windowed"]["bytes_total"] == 3 * (128 + 1000 + 128 + 1000) * per_token_layer == 13_860_864


def test_memory_flags_override_the_config(capsys):
    status, out, _ = cli(capsys, "memory", "--config", "llama", "--dtype", "fp32", "--seqlen", 10, "--json")
    result = json.loads(out)
    assert status == 0 and result["shape"]["dtype"] == "float32"
    assert result["kv_cache"]["bytes_per_token_per_layer"] == 2 * 2 * 64 * 4  # llama: 2 KV heads, head dim 64


# ---------------------------------------------------------------- qualify


def test_qualify_bundled_llama_passes(capsys, tmp_path):
    status, out, _ = cli(capsys, "qualify", "--config", "llama", *TINY, "--out", tmp_path)
    assert status == 0, out
    assert "PASS (exit 0)" in out and "fallback" not in out
    payload = json.loads(next(tmp_path.glob("qualify-llama-cpu-*.json" if not HAS_CUDA else "qualify-llama-*.json")).read_text())
    rows = {row["phase"]: row for row in payload["rows"]}
    assert [r["status"] for r in payload["rows"]] == ["ok", "ok", "ok"]
    assert rows["prefill"]["backend"] == "triton" and rows["prefill"]["kernel"].startswith("flashtile.fwd[triton")
    assert set(rows["prefill"]["errors"]) == {"out", "lse", "dq", "dk", "dv"}
    assert set(rows["decode"]["errors"]) == {"out", "lse"} and rows["decode"]["seqlen_q"] == 1
    assert rows["prefill"]["fwd_ms"] > 0 and rows["prefill"]["fwd_bwd_ms"] > 0
    assert set(rows["varlen"]["errors"]) == {"out", "lse", "dq", "dk", "dv"} and rows["varlen"]["seqlens"] == [64, 32, 21]
    assert rows["varlen"]["kernel"].startswith("flashtile.fwd[triton") and "varlen" in rows["varlen"]["kernel"]
    markdown = next(tmp_path.glob("qualify-llama-*.md")).read_text()
    assert markdown.startswith("# flashtile qualify: llama") and "| prefill" in markdown


def test_qualify_json_output_parses(capsys, tmp_path):
    status, out, err = cli(capsys, "qualify", "--heads", 2, "--head-dim", 16, "--prefill", 33, "--decode", 5,
                           "--runs", 1, "--out", tmp_path, "--json")
    payload = json.loads(out)
    assert status == payload["exit_status"] == 0
    assert payload["model"] == "h2-kv2-d16" and "| status" in err  # the table goes to stderr with --json
    assert len(list(tmp_path.glob(f"qualify-h2-kv2-d16-{payload['device']['slug']}-*T*Z.json"))) == 1


def test_qualify_forced_fallback_exits_1(capsys, tmp_path):
    with dispatch.disable_backends("triton"):
        status, out, _ = cli(capsys, "qualify", "--config", "llama", *TINY, "--out", tmp_path)
    assert status == 1
    table_rows = [line for line in out.splitlines() if line.startswith("| ") and ("prefill" in line or "decode" in line)]
    assert table_rows and all("| fallback" in line and "| torch" in line for line in table_rows)
    assert "fell back from triton to torch: disabled" in out and "FAIL (exit 1)" in out


def test_qualify_tolerance_miss_exits_1(capsys, tmp_path, monkeypatch):
    from flashtile.backends.triton import launch

    forward = launch.forward

    def off_by_a_bit(*args, **kwargs):
        out, lse = forward(*args, **kwargs)
        return out + 0.05, lse  # far beyond 2 x the fp16 reference's error + 1e-3

    monkeypatch.setattr(launch, "forward", off_by_a_bit)
    status, out, _ = cli(capsys, "qualify", "--heads", 2, "--head-dim", 16, "--prefill", 33, "--decode", 5,
                         "--runs", 1, "--out", tmp_path, "--json")
    rows = json.loads(out)["rows"]
    assert status == 1 and [r["status"] for r in rows] == ["tolerance", "tolerance", "tolerance"]
    assert all(r["errors"]["out"] == pytest.approx(0.05, rel=0.2) for r in rows)
    assert "out: max|ours - ref|" in rows[0]["reasons"][0]


def test_qualify_fallback_from_the_environment_in_a_shell(tmp_path):
    env = {"FLASHTILE_DISABLE_BACKENDS": "triton"}
    if not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    proc = run_module("qualify", "--config", "llama", *TINY, "--out", tmp_path, **env)
    assert proc.returncode == 1, proc.stderr
    assert "| fallback" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, feature", [
    ("mistral", "window 15,0"),
    ("gemma2", "softcap 50"),
    ("gpt-oss", "sinks"),
])
def test_qualify_models_with_windows_softcap_and_sinks_pass(capsys, tmp_path, name, feature):
    # --sliding-window 16 so the 64-token prefill really slides (the bundled windows are 128 and up).
    extra = ["--sliding-window", "16"] if name == "mistral" else []
    status, out, _ = cli(capsys, "qualify", "--config", name, *TINY, *extra, "--out", tmp_path, "--json")
    payload = json.loads(out)
    assert status == payload["exit_status"] == 0, payload["rows"]
    assert all(r["status"] == "ok" for r in payload["rows"])
    assert all(feature in r["features"] for r in payload["rows"] if r["layer"] != "full")
    if name == "gpt-oss":  # the sink is learnable: its gradient is checked too
        assert all("dsink" in r["errors"] for r in payload["rows"] if r["phase"] != "decode")
    if name == "gemma2":
        assert {r["layer"] for r in payload["rows"]} == {"sliding", "full", "all"}


# ---------------------------------------------------------------- errors, help


BAD_CONFIGS = {
    "truncated.json": ('{"num_hidden_layers": 2, "hidden_size": 64', "not valid JSON"),
    "no_heads.json": ('{"num_hidden_layers": 2, "hidden_size": 64}', "missing field 'num_attention_heads'"),
    "no_head_dim.json": ('{"num_hidden_layers": 2, "num_attention_heads": 4}', "missing field 'head_dim'"),
    "bad_gqa.json": ('{"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": 64}',
                     "not a multiple of num_key_value_heads=4"),
    "no_window.json": ('{"num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 64, '
                       '"layer_types": ["sliding_attention"]}', "missing field 'sliding_window'"),
    "list.json": ("[1, 2]", "expected a JSON object"),
}


@pytest.mark.parametrize("command", ["memory", "qualify"])
@pytest.mark.parametrize("filename", list(BAD_CONFIGS))
def test_bad_config_is_exit_2_with_one_line(capsys, tmp_path, command, filename):
    text, expected = BAD_CONFIGS[filename]
    path = tmp_path / filename
    path.write_text(text)
    status, out, err = cli(capsys, command, "--config", path, "--out", tmp_path) if command == "qualify" else \
        cli(capsys, command, "--config", path)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and str(path) in err and expected in err, err


@pytest.mark.parametrize("command", ["memory", "qualify"])
def test_bad_path_is_exit_2_with_one_line(capsys, command):
    status, out, err = cli(capsys, command, "--config", "/no/such/dir/config.json")
    assert status == 2 and out == ""
    assert err.strip() == (f"python -m flashtile {command}: error: /no/such/dir/config.json: no such file, "
                           "and not a bundled config (bundled: gemma2, gpt-oss, llama, mistral)")


def test_bad_path_in_a_shell_has_no_traceback():
    proc = run_module("memory", "--config", "missing.json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("missing.json: no such file, and not a bundled config "
                                        "(bundled: gemma2, gpt-oss, llama, mistral)")


@pytest.mark.parametrize("argv, expected", [
    (["memory", "--heads", "8"], "--head-dim --layers missing"),
    (["qualify"], "give --config PATH|NAME"),
    (["qualify", "--heads", "2", "--head-dim", "8", "--prefill", "0"], "must be positive"),
    (["memory", "--config", "llama", "--dtype", "int8"], "unsupported dtype 'int8'"),
])
def test_bad_arguments_are_exit_2(capsys, argv, expected):
    status, _, err = cli(capsys, *argv)
    assert status == 2 and expected in err


@pytest.mark.parametrize("command", ["info", "memory", "qualify"])
def test_help_has_examples(capsys, command):
    status, out, _ = cli(capsys, command, "--help")
    assert status == 0 and "examples:" in out and f"python -m flashtile {command}" in out


# ---------------------------------------------------------------- reading configs


def shape_of(config: dict) -> model_config.ModelShape:
    return model_config.from_hf_config(config, "config.json", "test")


def test_config_defaults_and_derived_fields():
    shape = shape_of({"num_hidden_layers": 2, "num_attention_heads": 12, "hidden_size": 768})  # GPT-2-like
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype, shape.layer_types) == (12, 64, "bfloat16", ("full", "full"))
    assert any("MHA" in note for note in shape.notes)


def test_config_layer_type_rules():
    base = {"num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 32, "sliding_window": 16}
    assert shape_of(base).layer_types == ("sliding",) * 6  # Mistral: every layer
    assert shape_of({**base, "use_sliding_window": False}).layer_types == ("full",) * 6  # Qwen2 default
    assert shape_of({**base, "sliding_window_pattern": 3}).layer_types == ("sliding", "sliding", "full") * 2  # Gemma-3
    assert shape_of({**base, "model_type": "gemma2"}).layer_types == ("sliding", "full") * 3
    assert shape_of({**base, "sliding_window": None}).layer_types == ("full",) * 6
    shape = model_config.load("gpt-oss")
    assert shape.layer_types == ("sliding", "full") * 2 and shape.sinks and shape.sliding_window == 128
    gemma = model_config.load("gemma2")
    assert gemma.softcap == 50.0 and gemma.softmax_scale == 256 ** -0.5 and not gemma.sinks


def test_config_nested_text_config():
    shape = shape_of({"model_type": "llava", "text_config": {"num_hidden_layers": 2, "num_attention_heads": 8,
                                                             "num_key_value_heads": 2, "head_dim": 64,
                                                             "torch_dtype": "float16"}})
    assert (shape.num_heads, shape.num_kv_heads, shape.dtype) == (8, 2, "float16")


def test_bundled_configs_are_found_by_name_and_path():
    assert model_config.bundled_names() == ["gemma2", "gpt-oss", "llama", "mistral"]
    by_name = model_config.load("mistral")
    by_path = model_config.load(str(model_config.BUNDLED_DIR / "mistral.json"))
    assert by_name.num_heads == by_path.num_heads == 8 and by_name.head_dim == 64  # hidden_size 512 / 8 heads
