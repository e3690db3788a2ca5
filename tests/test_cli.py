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
BUNDLED = ["deepseek-v3", "gemma-2-9b", "gpt-oss-120b", "gpt-oss-20b", "llama-3-70b", "llama-3-8b", "mistral-7b", "qwen3-8b", "tiny-llama"]



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


def test_memory_of_llama_3_8b_is_4_gib(capsys):
    # The bundled Llama-3-8B: 2 (K, V) x 32 layers x 8 KV heads x 128 x 8192 tokens x 4 sequences x 2 B (bf16).
    status, out, _ = cli(capsys, "memory", "--config", "llama-3-8b", "--seqlen", 8192, "--batch", 4)
    assert status == 0
    assert "4,294,967,296" in out and "4.00 GiB" in out and "32 layers (32 full), 32 heads, 8 KV heads, head dim 128" in out
    status, out, _ = cli(capsys, "memory", "--config", "llama", "--seqlen", 8192, "--batch", 4, "--json")  # old name
    result = json.loads(out)
    assert result["model"] == "llama-3-8b"
    assert result["kv_cache"]["bytes_total"] == 2 * 32 * 8 * 128 * 8192 * 4 * 2 == 4 * 1024**3


def test_memory_windowed_cache_of_gemma_2_9b(capsys):
    # Gemma-2-9B: 42 layers alternating sliding (window 4096) / global, 8 KV heads, head dim 256, bf16.
    status, out, _ = cli(capsys, "memory", "--config", "gemma-2-9b", "--seqlen", 10000, "--batch", 3, "--json")
    assert status == 0
    kv = json.loads(out)["kv_cache"]
    per_token_layer = 2 * 8 * 256 * 2  # 8192 B
    assert kv["bytes_per_token_per_layer"] == per_token_layer
    assert kv["bytes_total"] == 3 * 42 * 10000 * per_token_layer == 10_321_920_000  # every layer keeps every token
    assert kv["windowed"]["tokens_kept_per_layer"] == [4096, 10000] * 21
    assert kv["windowed"]["bytes_total"] == 3 * 21 * (4096 + 10000) * per_token_layer == 7_274_889_216


def test_memory_flags_override_the_config(capsys):
    status, out, _ = cli(capsys, "memory", "--config", "tiny-llama", "--dtype", "fp32", "--seqlen", 10, "--json")
    result = json.loads(out)
    assert status == 0 and result["shape"]["dtype"] == "float32"
    assert result["kv_cache"]["bytes_per_token_per_layer"] == 2 * 2 * 64 * 4  # the toy: 2 KV heads, head dim 64


# ---------------------------------------------------------------- qualify


def test_qualify_bundled_toy_passes(capsys, tmp_path):
    status, out, _ = cli(capsys, "qualify", "--config", "tiny-llama", *TINY, "--out", tmp_path)
    assert status == 0, out
    assert "PASS (exit 0)" in out and "fallback" not in out
    payload = json.loads(next(tmp_path.glob("qualify-tiny-llama-*.json")).read_text())
    rows = {row["phase"]: row for row in payload["rows"]}
    assert [r["status"] for r in payload["rows"]] == ["ok", "ok", "ok"]
    assert rows["prefill"]["backend"] == "triton" and rows["prefill"]["kernel"].startswith("flashtile.fwd[triton")
    assert set(rows["prefill"]["errors"]) == {"out", "lse", "dq", "dk", "dv"}
    assert set(rows["decode"]["errors"]) == {"out", "lse"} and rows["decode"]["seqlen_q"] == 1
    assert rows["prefill"]["fwd_ms"] > 0 and rows["prefill"]["fwd_bwd_ms"] > 0
    assert set(rows["varlen"]["errors"]) == {"out", "lse", "dq", "dk", "dv"} and rows["varlen"]["seqlens"] == [64, 32, 21]
    assert rows["varlen"]["kernel"].startswith("flashtile.fwd[triton") and "varlen" in rows["varlen"]["kernel"]
    markdown = next(tmp_path.glob("qualify-tiny-llama-*.md")).read_text()
    assert markdown.startswith("# flashtile qualify: tiny-llama") and "| prefill" in markdown


def test_qualify_json_output_parses(capsys, tmp_path):
    status, out, err = cli(capsys, "qualify", "--heads", 2, "--head-dim", 16, "--prefill", 33, "--decode", 5,
                           "--runs", 1, "--out", tmp_path, "--json")
    payload = json.loads(out)
    assert status == payload["exit_status"] == 0
    assert payload["model"] == "h2-kv2-d16" and "| status" in err  # the table goes to stderr with --json
    assert len(list(tmp_path.glob(f"qualify-h2-kv2-d16-{payload['device']['slug']}-*T*Z.json"))) == 1


def test_qualify_forced_fallback_exits_1(capsys, tmp_path):
    with dispatch.disable_backends("triton"):
        status, out, _ = cli(capsys, "qualify", "--config", "tiny-llama", *TINY, "--out", tmp_path)
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
    proc = run_module("qualify", "--config", "tiny-llama", *TINY, "--out", tmp_path, **env)
    assert proc.returncode == 1, proc.stderr
    assert "| fallback" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, feature", [
    ("deepseek-v3", "causal"),
    ("mistral-7b", "window 15,0"),
    ("gemma-2-9b", "softcap 50"),
    ("gpt-oss-20b", "sinks"),
])
def test_qualify_models_with_windows_softcap_and_sinks_pass(capsys, tmp_path, name, feature):
    # The real configs' head dims, windows, softcap and sinks with 2 query heads / 1 KV head, so the interpreter
    # takes seconds; --sliding-window 16 so the 64-token prefill really slides (the bundled windows are 128 and up).
    extra = ["--sliding-window", "16"] if name == "mistral-7b" else []
    status, out, _ = cli(capsys, "qualify", "--config", name, "--heads", 2, "--kv-heads", 1, *TINY, *extra,
                         "--out", tmp_path, "--json")
    payload = json.loads(out)
    assert status == payload["exit_status"] == 0, payload["rows"]
    assert all(r["status"] == "ok" for r in payload["rows"])
    assert all(feature in r["features"] for r in payload["rows"] if r["layer"] != "full")
    if name == "gpt-oss-20b":  # the sink is learnable: its gradient is checked too
        assert all("dsink" in r["errors"] for r in payload["rows"] if r["phase"] != "decode")
    if name == "deepseek-v3":  # multi-head latent attention: values narrower than queries and keys
        assert all((r["headdim"], r["headdim_v"]) == (192, 128) for r in payload["rows"])
    if name == "gemma-2-9b":
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
                           f"and not a bundled config (bundled: {', '.join(BUNDLED)})")


def test_bad_path_in_a_shell_has_no_traceback():
    proc = run_module("memory", "--config", "missing.json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith(f"missing.json: no such file, and not a bundled config (bundled: {', '.join(BUNDLED)})")


@pytest.mark.parametrize("argv, expected", [
    (["memory", "--heads", "8"], "--head-dim --layers missing"),
    (["qualify"], "give --config PATH|NAME"),
    (["qualify", "--heads", "2", "--head-dim", "8", "--prefill", "0"], "must be positive"),
    (["memory", "--config", "tiny-llama", "--dtype", "int8"], "unsupported dtype 'int8'"),
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
    shape = model_config.load("gpt-oss-20b")
    assert shape.layer_types == ("sliding", "full") * 12 and shape.sinks and shape.sliding_window == 128
    gemma = model_config.load("gemma-2-9b")
    assert gemma.softcap == 50.0 and gemma.softmax_scale == 256 ** -0.5 and not gemma.sinks


def test_config_nested_text_config():
    shape = shape_of({"model_type": "llava", "text_config": {"num_hidden_layers": 2, "num_attention_heads": 8,
                                                             "num_key_value_heads": 2, "head_dim": 64,
                                                             "torch_dtype": "float16"}})
    assert (shape.num_heads, shape.num_kv_heads, shape.dtype) == (8, 2, "float16")


def test_bundled_configs_are_found_by_name_and_path():
    assert model_config.bundled_names() == BUNDLED
    by_name = model_config.load("mistral-7b")
    by_path = model_config.load(str(model_config.BUNDLED_DIR / "mistral-7b.json"))
    assert by_name.num_heads == by_path.num_heads == 32 and by_name.head_dim == 128  # hidden_size 4096 / 32 heads
    assert model_config.load("mistral") == by_name  # the old name is an alias


# The real models' attention as their Hub config.json files give it: layers, heads, KV heads, head dim,
# {layer kind: count}, window, softcap, sinks.
REAL_MODELS = {
    "llama-3-8b": (32, 32, 8, 128, {"full": 32}, None, None, False),
    "llama-3-70b": (80, 64, 8, 128, {"full": 80}, None, None, False),
    "mistral-7b": (32, 32, 8, 128, {"sliding": 32}, 4096, None, False),
    "gemma-2-9b": (42, 16, 8, 256, {"sliding": 21, "full": 21}, 4096, 50.0, False),
    "gpt-oss-20b": (24, 64, 8, 64, {"sliding": 12, "full": 12}, 128, None, True),
    "gpt-oss-120b": (36, 64, 8, 64, {"sliding": 18, "full": 18}, 128, None, True),
    "qwen3-8b": (36, 32, 8, 128, {"full": 36}, None, None, False),
    "deepseek-v3": (61, 128, 128, 192, {"full": 61}, None, None, False),  # values: head dim 128
}


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_bundled_configs_carry_the_real_models_shapes(name):
    shape = model_config.load(name)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.layer_counts(),
            shape.sliding_window, shape.softcap, shape.sinks) == REAL_MODELS[name]
    assert shape.dtype == "bfloat16" and shape.value_dim == (128 if name == "deepseek-v3" else shape.head_dim)


def test_memory_of_deepseek_v3_counts_192_wide_keys_and_128_wide_values(capsys):
    status, out, _ = cli(capsys, "memory", "--config", "deepseek-v3", "--seqlen", 1000, "--json")
    kv = json.loads(out)["kv_cache"]
    assert status == 0 and kv["bytes_per_token_per_layer"] == 128 * (192 + 128) * 2  # 80 KiB
    assert kv["bytes_total"] == 61 * 1000 * 81_920


def test_the_toy_is_named_a_toy():
    assert [name for name in BUNDLED if name not in REAL_MODELS] == ["tiny-llama"]
    assert "a toy" in json.loads((model_config.BUNDLED_DIR / "tiny-llama.json").read_text())["_comment"]
