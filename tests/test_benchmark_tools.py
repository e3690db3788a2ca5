"""Smoke test of the maintained tools in benchmarks/: each one imports on a CPU-only machine without running
(the timing runs need a GPU), the argparse ones answer ``--help``, and each is documented in docs/benchmarks.md.
A script added to benchmarks/ must be added here and to docs/benchmarks.md, or it fails ``test_listed``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# The maintained tools; those with a --help of their own are marked True.
TOOLS = {
    "bwd_dkdv_gluon.py": False, "bwd_one_pass_192.py": False, "bwd_dkdv_tiles.py": False, "bwd_power.py": False, "bwd_split_rule.py": True,
    "bwd_ws.py": False, "d256_bwd_tiles.py": False, "d256_fwd_tiles.py": False, "decode_fp8_tiles.py": False, "decode_short.py": False,
    "decode_splits.py": False, "dense_decode.py": False, "gluon_causal_short.py": False, "gluon_head_dims.py": False,
    "gluon_short.py": False, "gluon_slim.py": False, "gluon_tiles.py": False, "gluon_ws.py": False,
    "gluon_ws_heads.py": True,
    "host_time.py": True, "kv_prefill.py": False, "sm90_cases.py": False, "sm90_compile.py": False, "tune.py": True,
}
SHELL_TOOLS = ("ab_trees.sh",)


def _env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=os.environ.get("TMPDIR", "/tmp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), str(BENCHMARKS), env.get("PYTHONPATH"))))
    return env


def test_listed():
    """benchmarks/ holds exactly the maintained tools (one-off scripts live in git history, not in the tree)."""
    present = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    assert present == set(TOOLS) | set(SHELL_TOOLS)


@pytest.mark.parametrize("name", sorted(TOOLS) + list(SHELL_TOOLS))
def test_documented(name):
    assert f"benchmarks/{name}" in (ROOT / "docs" / "benchmarks.md").read_text(), f"{name} is not in docs/benchmarks.md"


# Imports every tool in one interpreter (one torch import, not one a tool): each tool's error and output.
_IMPORT_ALL = """
import contextlib, io, json, runpy, sys, traceback
report = {}
for path in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="not_main")
        report[path] = {"error": None, "stdout": out.getvalue()}
    except BaseException:
        report[path] = {"error": traceback.format_exc()[-3000:], "stdout": out.getvalue()}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def imported():
    paths = [str(BENCHMARKS / name) for name in sorted(TOOLS)]
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *paths], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {Path(path).name: result for path, result in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_imports_without_running(name, imported):
    """Importing a tool defines its functions and runs nothing (no GPU needed)."""
    assert imported[name]["error"] is None, imported[name]["error"]
    assert imported[name]["stdout"] == "", f"{name} printed on import: {imported[name]['stdout'][:500]}"


@pytest.mark.parametrize("name", [name for name, has_help in sorted(TOOLS.items()) if has_help])
def test_help(name):
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), "--help"], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout.lower()


def test_ab_trees_syntax():
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "ab_trees.sh")]).returncode == 0


@pytest.mark.parametrize("which, v_tail", [("wide", 0), ("wide-varlen-v192", 64), ("wide-alibi", 0),
                                           ("wide-d256", 128), ("wide-varlen-d256", 128)])
def test_sm90_cases_catch_the_launchers_arguments(monkeypatch, which, v_tail):
    """sm90_compile.py's one-pass cases run the launcher's own host code on CPU tensors and catch its launch: every
    kernel argument is there, the descriptors cut q, k, v, dO and dQ into 128 columns and the rest (64 at 192, 128
    at 256, with one Q/dO slot), and nothing launches."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case(which, True, False, window=True)
    assert set(args) | set(constexprs) == set(fn.arg_names)
    assert constexprs["V_TAIL"] == v_tail and constexprs["MASK_LEFT"] and constexprs["MASK_RIGHT"]
    assert constexprs["IS_VARLEN"] == ("varlen" in which) and constexprs["ALIBI"] == ("alibi" in which)
    tiles = {name: tuple(args[name].block_shape) for name in args if name.endswith("_desc") and args[name] is not None}
    tail = 128 if which.endswith("-d256") else 64
    assert tiles["q_desc"] == tiles["do_desc"] == (1, 64, 1, 128) and tiles["q_tail_desc"] == (1, 64, 1, tail)
    assert tiles["dq_desc"] == (1, 64, 1, 128) and tiles["dq_tail_desc"] == (1, 64, 1, tail)
    assert constexprs["STAGES"] == (1 if tail == 128 else 2)
    assert ("v_tail_desc" in tiles) == (v_tail > 0) and options == dict(num_warps=4, maxnreg=168)


@pytest.mark.parametrize("causal, softcap", [(False, False), (True, True)])
@pytest.mark.parametrize("which, tiles", [
    ("fwd-ws-d256-n64", {"q_desc": (1, 64, 1, 256), "k_desc": (1, 64, 1, 256), "v_desc": (1, 64, 1, 256)}),
    # 192/128: q and k as 128 + 64 columns, 128-key slots of both parts, values of 128.
    ("fwd-ws-d192", {"q_desc": (1, 64, 1, 128), "q_tail_desc": (1, 64, 1, 64), "k_desc": (1, 128, 1, 128),
                     "k_tail_desc": (1, 128, 1, 64), "v_desc": (1, 128, 1, 128)}),
])
def test_sm90_case_of_the_wide_warp_specialized_forwards(monkeypatch, causal, softcap, which, tiles):
    """The d=256 and 192/128 warp-specialized forwards' cases run launch._forward_sm90_ws on CPU tensors and catch
    its launch: every kernel argument, the descriptors' tiles (Q in one consumer's 64 rows; no tail descriptors at
    256), two stages, and nothing launches."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case(which, causal, softcap)
    assert set(args) | set(constexprs) == set(fn.arg_names)
    descriptors = {name: tuple(value.block_shape) for name, value in args.items() if name.endswith("_desc") and value}
    assert descriptors == tiles
    assert constexprs["TAIL"] == ("q_tail_desc" in tiles)
    assert constexprs["STAGES"] == 2 and constexprs["MASK_RIGHT"] == causal and constexprs["SOFTCAP"] == softcap
    assert options == dict(num_warps=4, maxnreg=168)


@pytest.mark.parametrize("which, block_n, consumers, regs", [
    ("fwd-ws-d64", 128, 2, (240, 168)),
    ("fwd-ws-d64-c3", 128, 3, (160, 128)),  # 16 warps (the producer's padded to a warpgroup) of 128 registers
    ("fwd-ws-d64-c3-n64-sink", 64, 3, (160, 128)),
    ("fwd-ws-d64-c3-pp", 128, 3, (160, 128)),
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_case_of_the_d64_warp_specialized_forward(monkeypatch, which, block_n, consumers, regs, causal):
    """``fwd-ws-d64[-c3]``: launch._forward_sm90_ws's arguments for 2 or 3 consumer warpgroups of 64 rows: the CTA's
    tiles of consumers x 64 rows counted over 2 x 4096 rows of 16 heads, the consumers' registers and the cap the
    kernel is compiled under (launch._WS_REGS), one consumer's Q rows a descriptor; nothing launches."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case(which, causal, False)
    assert set(args) | set(constexprs) == set(fn.arg_names)
    assert args["num_tiles"] == -(-4096 // (64 * consumers)) * 16 * 2
    assert constexprs["CONSUMERS"] == consumers and constexprs["CONSUMER_REGS"] == regs[0]
    assert options == dict(num_warps=4, maxnreg=regs[1])
    assert tuple(args["q_desc"].block_shape) == (1, 64, 1, 64)
    assert tuple(args["k_desc"].block_shape) == (1, block_n, 1, 64)
    assert constexprs["MASK_RIGHT"] == causal and constexprs["HAS_SINK"] == which.endswith("-sink")
    assert constexprs["PINGPONG"] == which.endswith("-pp")


def test_warp_specialized_forward_refuses_other_consumer_counts(monkeypatch):
    """A tile of 4 consumer warpgroups (no register split for it) is a ValueError naming the field, not a launch."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    with pytest.raises(ValueError, match="consumers=4"):
        case("fwd-ws-d64-c4", False, False)


@pytest.mark.parametrize("which, block_n, stages", [("fwd-d128", 64, 2), ("fwd-d64-n128-s1", 128, 1)])
def test_sm90_one_warpgroup_forward_case(monkeypatch, which, block_n, stages):
    """``fwd-d<dim>[-n<keys>][-s<slots>]``: kernels/fwd_sm90.py's arguments caught at launch._forward_sm90's launch
    (64-row tiles, the asked key block and ring), nothing launched."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case(which, True, False)
    assert fn.__name__ == "attn_fwd_sm90" and set(args) | set(constexprs) == set(fn.arg_names)
    assert tuple(args["q_desc"].block_shape)[1] == 64 and tuple(args["k_desc"].block_shape)[1] == block_n
    assert constexprs["V_STAGES"] == stages and constexprs["MASK_RIGHT"] and options == dict(num_warps=4)


def test_sm90_compile_taken_path(monkeypatch):
    """``taken``: a key loop's code less what its forward branches inside the loop jump over (the masked softmax the
    forward kernels put first); branches out of the loop (the waits' retries) and back (the loop's) keep all."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_compile import _loop_counts, _taken_path

    # 0x20 skips the masked block (0x30-0x50, which jumps over the unmasked one to the join at 0x70).
    ops = ["FMNMX R1, R2, R3", "@!P0 BRA 0x1f00", "@!P1 BRA 0x60", "FSEL R4, R5, RZ, P2", "ISETP.GE.AND P2, PT, R4",
           "BRA 0x70", "FFMA R1, R2, R3, R4", "MUFU.EX2 R1, R2", "@P3 BRA 0x0"]
    body = [f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops)]
    assert [line.split("*/")[1].split()[0] for line in _taken_path(body)] == ["FMNMX", "@!P0", "@!P1", "FFMA",
                                                                             "MUFU.EX2", "@P3"]
    counts = _loop_counts(_taken_path(body))
    assert counts["n"] == 6 and counts["ex2"] == 1 and counts["ffma"] == 1 and counts["branch"] == 3


def test_sm90_wide_case_takes_one_pass_knobs(monkeypatch):
    """sm90_compile.py's ``knob=value`` arguments reach the wide kernel through the launcher: its constexprs and
    compile options are the knobs given, the rest its head dim's defaults."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    _, _, base, options = case("wide", True, False)
    assert (base["DQ_FIRST"], base["RELEASE_EACH"], base["ROTATE"], base["STAGES"]) == (False, False, False, 2)
    assert base["CONSUMER_REGS"] == 240 and options["maxnreg"] == 168
    _, _, knobs, options = case("wide", True, False, tiles=dict(dq_first=1, rotate=1, stages=1, consumer_regs=232,
                                                                  maxnreg=160))
    assert (knobs["DQ_FIRST"], knobs["RELEASE_EACH"], knobs["ROTATE"], knobs["STAGES"]) == (1, False, 1, 1)
    assert knobs["CONSUMER_REGS"] == 232 and options["maxnreg"] == 160


@pytest.mark.parametrize("head_dim, rows", [(64, 128), (128, 64)])
def test_sm90_fused_case_takes_one_pass_knobs(monkeypatch, head_dim, rows):
    """``fused-d64``/``fused-d128``: kernels/bwd_sm90_ws.py through the launcher, its query steps (128 rows at 64),
    the CTA's two 64-key halves and dQ's halves (at 64 by rows: configs.ONE_PASS_DQ_ROWS; at 128 by columns);
    ``dq_first``/``dk_rs``/``s_ahead`` reach its constexprs (off by default, but ``s_ahead`` at 128:
    configs.ONE_PASS_S_AHEAD), ``dq_rows=0`` gives 64's dQ column halves."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, base, options = case(f"fused-d{head_dim}", True, False)
    assert fn.__name__ == "attn_bwd_sm90_ws" and set(args) | set(base) == set(fn.arg_names)
    tiles = {name: tuple(args[name].block_shape) for name in args if name.endswith("_desc")}
    assert tiles == {"q_desc": (1, rows, 1, head_dim), "k_desc": (1, 64, 1, head_dim), "v_desc": (1, 64, 1, head_dim),
                     "do_desc": (1, rows, 1, head_dim), "dq_desc": (1, 64, 1, 64)}
    assert (base["DQ_FIRST"], base["DK_RS"], base["S_AHEAD"]) == (False, False, head_dim == 128)
    assert options == dict(num_warps=4, maxnreg=168)
    _, _, knobs, _ = case(f"fused-d{head_dim}", True, False, tiles=dict(dq_first=1, dk_rs=1, s_ahead=1))
    assert (knobs["DQ_FIRST"], knobs["DK_RS"], knobs["S_AHEAD"]) == (1, 1, 1)
    if head_dim == 64:
        # Without dq_rows each consumer adds half of dQ's columns, all its rows.
        _, split, _, _ = case("fused-d64", True, False, tiles=dict(dq_rows=0))
        assert tuple(split["dq_desc"].block_shape) == (1, 128, 1, 32)


def test_sm90_wide96_case_catches_the_launchers_arguments(monkeypatch):
    """``keys96=1``: the 96-key kernel's launch through the launcher: three consumers' 32-key K and V tiles, dQ
    added 64 columns at a time, its own registers (160 a worker consumer, 128 the compile cap of 16 warps), packed
    sequences' switches off and none of the 64-key kernel's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case("wide", True, False, tiles=dict(keys96=1))
    assert fn.__name__ == "attn_bwd_sm90_wide96" and set(args) | set(constexprs) == set(fn.arg_names)
    tiles = {name: tuple(args[name].block_shape) for name in args if name.endswith("_desc")}
    assert tiles == {"q_desc": (1, 64, 1, 128), "q_tail_desc": (1, 64, 1, 64), "k_desc": (1, 32, 1, 128),
                     "k_tail_desc": (1, 32, 1, 64), "v_desc": (1, 32, 1, 128), "do_desc": (1, 64, 1, 128),
                     "dq_desc": (1, 64, 1, 64)}
    assert constexprs["CONSUMER_REGS"] == 160 and options == dict(num_warps=4, maxnreg=128)
    assert not constexprs["IS_VARLEN"] and not constexprs["HAS_SEQUSED"] and constexprs["MASK_RIGHT"]
    assert "DQ_FIRST" not in constexprs
    assert constexprs["DS_BUFS"] == 1 and case("wide", True, False, tiles=dict(keys96=1, ds_bufs=2))[2]["DS_BUFS"] == 2


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_wide96_varlen_case_catches_the_launchers_arguments(monkeypatch, causal):
    """``wide-varlen keys96=1``: the 96-key kernel's launch on packed sequences (4096 + 4096 tokens, seqused_k)
    through the launcher: descriptors over one TMA batch row of all tokens, the sequence tensors passed and read
    (IS_VARLEN, HAS_SEQUSED), dK/dV batch strides 0, and a grid of 96-key CTAs over the longest sequence for each
    (KV head, sequence)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torch
    from sm90_cases import case

    from flashtile.backends.triton import launch

    fn, args, constexprs, options = case("wide-varlen", causal, False, tiles=dict(keys96=1))
    assert fn.__name__ == "attn_bwd_sm90_wide96" and set(args) | set(constexprs) == set(fn.arg_names)
    assert constexprs["IS_VARLEN"] and constexprs["HAS_SEQUSED"] and constexprs["MASK_RIGHT"] == causal
    shapes = {name: (*args[name].shape, *args[name].block_shape) for name in args if name.endswith("_desc")}
    # (1 batch row, 8192 tokens, 16 heads, columns), then the tile.
    assert shapes == {"q_desc": (1, 8192, 16, 128, 1, 64, 1, 128), "q_tail_desc": (1, 8192, 16, 64, 1, 64, 1, 64),
                      "k_desc": (1, 8192, 16, 128, 1, 32, 1, 128), "k_tail_desc": (1, 8192, 16, 64, 1, 32, 1, 64),
                      "v_desc": (1, 8192, 16, 128, 1, 32, 1, 128), "do_desc": (1, 8192, 16, 128, 1, 64, 1, 128),
                      "dq_desc": (1, 8192, 16, 192, 1, 64, 1, 64)}
    assert args["CU_SEQLENS_Q"].tolist() == args["CU_SEQLENS_K"].tolist() == [0, 4096, 8192]
    assert args["SEQUSED_K"].tolist() == [4000, 4096] and args["seqlen_q"] == args["seqlen_k"] == 4096
    assert args["stride_dkb"] == args["stride_dvb"] == 0 and options == dict(num_warps=4, maxnreg=128)
    # The grid: sequences of 100 and 8092 tokens, 4 KV heads.
    from flashtile.backends import AttnArgs, present_features
    from flashtile.backends.triton import configs

    grids = []
    monkeypatch.setattr(launch, "_BWD_WIDE96", lambda key, grid, dynamic, static, **_: grids.append(grid))
    cu = torch.tensor([0, 100, 8192], dtype=torch.int32)
    q, k, v = (torch.empty(8192, heads, d, dtype=torch.bfloat16) for heads, d in ((16, 192), (4, 192), (4, 128)))
    lse = torch.empty(16, 8192)
    packed = AttnArgs(softmax_scale=0.1, causal=causal, window_right=0 if causal else -1, cu_seqlens_q=cu,
                      cu_seqlens_k=cu, max_seqlen_q=8092, max_seqlen_k=8092, total_k=8192)
    launch._backward_sm90_ws(q, k, v, torch.empty(8192, 16, 128, dtype=torch.bfloat16),
                             torch.empty(q.shape, dtype=torch.float32), k, v, lse, lse, packed,
                             frozenset(present_features(packed, 192, 128)), None,
                             configs.one_pass_config(192, keys96=True))
    assert grids == [(-(-8092 // 96), 4, 2)]


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_fp8_varlen_case_catches_the_launchers_arguments(monkeypatch, causal):
    """The FP8 varlen case runs fp8.forward_fp8_sm90 on packed CPU tensors and catches its launch: every kernel
    argument, the packed tensors as one TMA batch row, batch strides 0 for out and lse, a CTA per 128-row tile of
    the longest sequence (2 sequences x 16 heads x 32 tiles) and the per-sequence descale blocks."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case("fwd-fp8-blocks-varlen", causal, False)
    assert set(args) | set(constexprs) == set(fn.arg_names)
    assert constexprs["IS_VARLEN"] and constexprs["HAS_SEQUSED"] and constexprs["K_BLOCKS"]
    assert constexprs["MASK_RIGHT"] == causal
    assert args["q_desc"].shape == [1, 8096, 16, 128] and args["vt_desc"].shape == [1, 4, 128, 8096 + 16]
    assert args["stride_ob"] == 0 and args["stride_lse_b"] == 0 and args["stride_lse_h"] == 8096
    assert args["num_tiles"] == 2 * 16 * 32 and args["seqlen_q"] == args["seqlen_k"] == 4096
    assert args["stride_qds_m"] == 1 and args["stride_qds_h"] == 32
    assert options == dict(num_warps=4, maxnreg=168)


@pytest.mark.parametrize("which", ["fwd-fp8-d64", "fwd-fp8-blocks-varlen"])
def test_sm90_fp8_case_takes_tile_knobs(monkeypatch, which):
    """fwd-fp8 knob=value: fp8.Fp8Tile's fields over the head dim's tile, dense and through the launcher (varlen):
    three consumers at 160 registers (cap 128), 64-key blocks in the K and V^T descriptors, 192-row tiles."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sm90_cases import case

    fn, args, constexprs, options = case(which, True, False, tiles=dict(consumers=3, two_level=0, block_n=64))
    assert constexprs["CONSUMERS"] == 3 and constexprs["CONSUMER_REGS"] == 160 and options["maxnreg"] == 128
    assert constexprs["TWO_LEVEL"] is False
    assert args["k_desc"].block_shape[1] == 64 and args["vt_desc"].block_shape[3] == 64
    if which.endswith("-varlen"):
        assert set(args) | set(constexprs) == set(fn.arg_names)
        assert args["num_tiles"] == 2 * 16 * -(-4096 // 192)


def test_gluon_ws_heads_times_the_fp8_candidates(monkeypatch):
    """gluon_ws_heads.py --fp8: the head dim's own tile first (the launcher's default), then fp8.FP8_CANDIDATES' rows
    at that head dim, for the lead's A/B."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gluon_ws_heads
    from flashtile.backends.triton import fp8

    assert gluon_ws_heads.fp8_variants(64) == {"fp8": None, "fp8-c3": fp8.FP8_CANDIDATES["c3"][64]}
    assert list(gluon_ws_heads.fp8_variants(256)) == ["fp8", "fp8-n128"]
    assert gluon_ws_heads.fp8_variants(128)["fp8-c3"].consumers == 3


def test_gluon_ws_heads_times_deepseeks_192_128_rows(monkeypatch):
    """gluon_ws_heads.py --dims 192: DeepSeek's rows (16 heads, values of 128; 2 x 4096 and 1 x 16384) and the kernel
    192/128 ran before (the 64x64 tile) first, then the warp-specialized tile of configs.GLUON_WS_D192's row and its
    64-key variants."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gluon_ws_heads
    from flashtile.backends.triton import configs

    assert [gluon_ws_heads.shape(192, n) for n in (4096, 16384)] == [(2, 16, 128), (1, 16, 128)]
    assert gluon_ws_heads.shape(256, 4096) == (4, 8, 256)
    tiles = gluon_ws_heads.variants(192, 16384, True)
    assert list(tiles) == ["gluon", "ws", "ws-n64", "ws-n64-s3"]
    assert tiles["gluon"] == configs._FWD_SM90_GLUON and tiles["ws"] == configs._FWD_SM90_GLUON_WS_D192
    assert [(t.BLOCK_N, t.num_stages, t.kernel) for t in tiles.values()][2:] == [(64, 2, "gluon-ws"),
                                                                                  (64, 3, "gluon-ws")]


def test_gluon_ws_heads_times_three_consumers_at_head_dim_64(monkeypatch):
    """gluon_ws_heads.py --dims 64: the Triton tile first, then the two-consumer tiles (configs.GLUON_WS_D64's row and
    four slots) and the three-consumer ones (128- and 64-key slots) for the lead's A/B."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gluon_ws_heads
    from flashtile.backends.triton import configs

    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    tiles = gluon_ws_heads.variants(64, 16384, False)
    assert list(tiles) == ["triton", "ws", "ws-s4", "ws-c3", "ws-c3-n64", "ws-c3-pp"]
    assert tiles["triton"].kernel == "triton" and tiles["ws"] == configs._FWD_SM90_GLUON_WS_D64
    assert tiles["ws-c3"] == configs._FWD_SM90_GLUON_WS_D64_C3
    assert [(t.BLOCK_N, t.num_stages, t.consumers, t.pingpong) for t in tiles.values()][1:] == [
        (128, 2, 2, False), (128, 4, 2, False), (128, 2, 3, False), (64, 2, 3, False), (128, 2, 3, True)]


@pytest.mark.parametrize("which, head_dim, group, qk_mode, v_mode", [
    ("quant", 128, 1, "compute", "amax"), ("quant-d256-g4", 256, 4, "compute", "amax"),
    ("quant-d64-v", 64, 1, "skip", "reduce"), ("quant-varlen", 128, 1, "compute", "amax")])
def test_sm90_quant_case_catches_the_quantizers_launch(monkeypatch, which, head_dim, group, qk_mode, v_mode):
    """``quant[-d<dim>][-g<group>][-v][-varlen]``: the FP8 quantizer's launch through quant.quantize on CPU tensors
    (its first launch, q's and k's cast with v's block amaxes, or with -v its second, v's cast): every kernel
    argument, the head dim, GQA group and modes asked."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    # The GPU's launch (e4m3 outputs, the FMA division), caught before it runs.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from sm90_cases import case

    fn, args, constexprs, options = case(which, False, False)
    assert getattr(fn, "__name__", getattr(fn, "fn", fn).__name__) == "quantize_fp8" and set(args) | set(constexprs) == set(fn.arg_names)
    assert (constexprs["HEAD_DIM"], args["group"], constexprs["QK_MODE"], constexprs["V_MODE"]) == (
        head_dim, group, qk_mode, v_mode)
    assert constexprs["VARLEN"] == ("varlen" in which) and constexprs["FMA"] and options["num_stages"] == 1
