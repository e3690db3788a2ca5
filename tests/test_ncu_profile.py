"""scripts/ncu_profile.py on CPU: the case grammar (a bad case names itself), the ncu command lines, the parsers of
ncu's raw and source pages (their real column layout: launch columns, then metric IDs with a row of units; a
``"Kernel Name"`` row ahead of each kernel's SASS rows), units and thousands separators, the numbers a kernel's
table shows, and whole runs against a stand-in ``ncu``: one that reads like a profile, one without counter access."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ncu_profile", ROOT / "scripts" / "ncu_profile.py")
ncu_profile = importlib.util.module_from_spec(_spec)
sys.modules["ncu_profile"] = ncu_profile  # dataclasses look their module up there
_spec.loader.exec_module(ncu_profile)

# ncu's own launch columns, as its raw page prints them ahead of the metric IDs.
LAUNCH = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC"')
METRICS = ["gpu__time_duration.sum", "launch__registers_per_thread",
           "sm__warps_active.avg.pct_of_peak_sustained_active",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
           "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
           "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__average_warp_latency_per_inst_issued.ratio",
           "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
           "dram__bytes.sum.per_second", "smsp__inst_executed.sum", "sass__inst_executed_per_opcode"]
UNITS = ["msecond", "register/thread", "%", "%", "%", "%", "%", "", "", "", "", "", "Tbyte/second", "inst", ""]
MAIN = ["1.25", "168", "12.4", "61.5", "20.25", "35", "48.0", "8.00", "2.00", "3.00", "1.00", "1.00", "1.5",
        "1,234,567", "1;2;3"]
SMALL = ["0.0755", "32", "40", "n/a", "1", "2", "3", "4.00", "1.00", "0.50", "0.25", "1.00", "2", "9,000", ""]
RAW = "\n".join([
    '==PROF== Connected to process 4242 (/usr/bin/python3)',
    LAUNCH + "," + ",".join(f'"{m}"' for m in METRICS),
    ",".join(['""'] * 11 + [f'"{u}"' for u in UNITS]),
    '"0","4242","python3","h200","bwd_preprocess","1","7","(128, 1, 1)","(64, 16, 1)","0","9.0",'
    + ",".join(f'"{v}"' for v in SMALL),
    '"1","4242","python3","h200","attn_bwd_sm90_ws","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
    + ",".join(f'"{v}"' for v in MAIN),
    '==PROF== Disconnected from process 4242',
])
SOURCE = "\n".join([
    '"Kernel Name","attn_bwd_sm90_ws"',
    '"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","smsp__pcsamp_warps_issue_stalled_long_scoreboard",'
    '"smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued","smsp__pcsamp_warps_issue_stalled_gmma",'
    '"smsp__pcsamp_warps_issue_stalled_selected"',
    '"0x7f0000000100","      HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","1,200","900","4096","0","0","1,000","200"',
    '"0x7f0000000110","      MUFU.EX2 R3, R3","300","100","65536","250","80","0","50"',
    '"0x7f0000000120","      SYNCS.ARRIVE.TRANS64 RZ, [UR8], RZ","0","0","128","0","0","0","0"',
    '"0x7f0000000130","      LDG.E R5, [R2.64]","500","450","32","450","420","0","50"',
])


def test_cases_follow_the_headline_shapes():
    case = ncu_profile.parse_case("fwd:d64:16k")
    assert (case.kind, case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.head_dim) == ("fwd", 1, 16384,
                                                                                                   16384, 32, 64)
    assert case.flops == 4 * 1 * 32 * 16384 * 16384 * 64 and not case.causal
    causal = ncu_profile.parse_case("fwd:d128:4096:causal")
    assert (causal.batch, causal.nheads, causal.causal) == (4, 16, True)
    assert causal.flops == 4 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert ncu_profile.parse_case("bwd:d128:4k:causal").flops == 2.5 * causal.flops
    mla = ncu_profile.parse_case("fwd:d192:4k")
    assert (mla.batch, mla.nheads, mla.head_dim, mla.head_dim_v) == (2, 16, 192, 128)
    decode = ncu_profile.parse_case("decode-fp8:1x128k")
    assert (decode.batch, decode.seqlen_q, decode.seqlen_k, decode.nheads, decode.nheads_kv) == (1, 1, 131072, 32, 8)
    assert decode.cache_bytes == 131072 * 8 * 2 * 128 and ncu_profile.parse_case("decode:1x128k").cache_bytes == \
        2 * decode.cache_bytes
    assert ncu_profile.parse_case("fwd-fp8:d128:16k:full").slug == "fwd-fp8-d128-16k-full"


@pytest.mark.parametrize("text, why", [
    ("fwdx:d64:16k", "unknown kind"), ("fwd:64:16k", "fwd:dD:N"), ("fwd:d64", "fwd:dD:N"),
    ("fwd:d65:16k", "head dim 65"), ("fwd-fp8:d192:4k", "head dim 192"), ("fwd:d64:0", "positive"),
    ("fwd:d64:16q", "positive"), ("bwd:d64:16k:sideways", "causal or full"), ("decode:16", "BxL"),
    ("decode-fp8:1xk", "positive"), ("decode:d128:1k", "BxL"),
])
def test_bad_cases_name_themselves(text, why):
    with pytest.raises(ValueError, match=why) as error:
        ncu_profile.parse_case(text)
    assert repr(text) in str(error.value)


def test_bad_case_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        ncu_profile.main(["fwd:d128:16k", "bwd:d128:banana"])
    assert exit_.value.code == 2 and "'bwd:d128:banana'" in capsys.readouterr().err


def test_profile_command():
    case = ncu_profile.parse_case("fwd:d128:16k:causal")
    cmd = ncu_profile.profile_command("/opt/ncu", case, Path("/o/r.ncu-rep"), Path("/o/m.json"), warmup=5)
    text = " ".join(cmd)
    for part in ("--clock-control none", "--target-processes all", "--profile-from-start off",
                 "--export /o/r.ncu-rep --force-overwrite"):
        assert part in text
    sections = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--section"]
    assert sections == list(ncu_profile.SECTIONS) and "SourceCounters" not in sections and "--kernel-name" not in cmd
    child = cmd[cmd.index(sys.executable):]
    assert child[1].endswith("scripts/ncu_profile.py")
    assert child[2:] == ["--child", "fwd:d128:16k:causal", "--warmup", "5", "--meta", "/o/m.json"]
    narrowed = ncu_profile.profile_command("ncu", case, Path("r"), Path("m"), source=True, kernel="attn_fwd",
                                           metrics="sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active")
    assert narrowed[narrowed.index("--kernel-name") + 1] == "regex:attn_fwd"
    assert narrowed[narrowed.index("--metrics") + 1] == "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
    assert "--metrics" not in cmd
    assert [narrowed[i + 1] for i, w in enumerate(narrowed) if w == "--section"][-1] == "SourceCounters"
    assert ncu_profile.import_command("ncu", Path("r.ncu-rep"), "raw") == [
        "ncu", "--import", "r.ncu-rep", "--page", "raw", "--csv", "--print-units", "base"]
    assert ncu_profile.import_command("ncu", Path("r"), "source") == [
        "ncu", "--import", "r", "--page", "source", "--csv", "--print-source", "sass"]


@pytest.mark.parametrize("value, unit, expected", [
    (1.5, "msecond", (1.5e-3, "second")), (250.0, "usecond", (2.5e-4, "second")), (75.0, "nsecond", (7.5e-8, "second")),
    (2.0, "us", (2e-6, "second")), (1.5, "Tbyte/second", (1.5e12, "byte/second")), (3.0, "byte/usecond",
                                                                                   (3e6, "byte/second")),
    (1.98, "Ghz", (1.98e9, "hz")), (61.5, "%", (61.5, "%")), (168.0, "register/thread", (168.0, "register/thread")),
])
def test_units_to_base(value, unit, expected):
    got, base = ncu_profile.to_base(value, unit)
    assert base == expected[1] and got == pytest.approx(expected[0])


@pytest.mark.parametrize("text, expected", [
    ("1,234,567", 1234567.0), ("1,205.50", 1205.5), ("0.5", 0.5), ("-3", -3.0), ("1e+06", 1e6), ("n/a", None),
    ("", None), ("1;2;3", None), ("(128, 1, 1)", None), ("NVIDIA H200", None),
])
def test_number(text, expected):
    assert ncu_profile.number(text) == expected


def test_raw_page():
    kernels = ncu_profile.parse_raw(RAW)
    assert [k["kernel"] for k in kernels] == ["bwd_preprocess", "attn_bwd_sm90_ws"]
    main = kernels[1]
    assert main["launch"]["Grid Size"] == "(132, 1, 1)" and main["launch"]["CC"] == "9.0"
    assert main["metrics"]["gpu__time_duration.sum"][0] == pytest.approx(1.25e-3)
    assert main["metrics"]["smsp__inst_executed.sum"] == (1234567.0, "inst")
    assert main["metrics"]["sass__inst_executed_per_opcode"] == ("1;2;3", "")
    assert kernels[0]["metrics"]["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"][0] is None
    assert ncu_profile.parse_raw("==PROF== Disconnected\n") == []


def test_summary_of_a_kernel():
    summary = ncu_profile.summarize(ncu_profile.parse_raw(RAW)[1])
    assert summary["duration_ms"] == pytest.approx(1.25) and summary["registers_per_thread"] == 168
    assert (summary["tensor_pipe_pct"], summary["xu_pipe_pct"], summary["issue_active_pct"]) == (61.5, 20.25, 48.0)
    assert summary["dram_tbps"] == pytest.approx(1.5) and summary["cycles_per_issue"] == 8.0
    # Shares of the 8 cycles per issued instruction; "selected" (the issue itself) is not a stall.
    assert [(s["reason"], s["share"]) for s in summary["stalls"]] == [
        ("gmma", 3 / 8), ("long_scoreboard", 2 / 8), ("barrier", 1 / 8)]
    assert list(summary["pipes_pct"]) == ["tensor_op_hmma", "fma", "xu"]  # busiest first
    small = ncu_profile.summarize(ncu_profile.parse_raw(RAW)[0])
    assert small["duration_ms"] == pytest.approx(0.0755) and small["tensor_pipe_pct"] is None


def test_case_table_reads_the_longest_kernel_first():
    case = ncu_profile.parse_case("bwd:d128:16k")
    kernels = sorted((ncu_profile.summarize(k) for k in ncu_profile.parse_raw(RAW)), key=lambda s: -s["duration_ms"])
    table = ncu_profile.case_table(case, kernels)
    lines = table.splitlines()
    assert "attn_bwd_sm90_ws" in lines[0] and lines[0].index("attn_bwd_sm90_ws") < lines[0].index("bwd_preprocess")
    tflops = case.flops / 1.25e-3 / 1e12
    assert "| TFLOP/s " in table and f"{tflops:.1f}" in table
    assert "gmma 38% (3.00)" in table and "61.5%" in table and "| 168 " in table


def test_source_page():
    blocks = ncu_profile.parse_source("==PROF== x\n" + SOURCE)
    rows = blocks["attn_bwd_sm90_ws"]
    assert len(rows) == 4 and rows[0]["samples"] == 1200 and rows[0]["not_issued"] == 900
    assert rows[1]["reasons"] == {"long_scoreboard": 250, "selected": 50}
    table = ncu_profile.source_table(rows).splitlines()
    assert "HGMMA" in table[2] and "gmma 83%" in table[2] and "LDG" in table[3] and "MUFU.EX2" in table[4]
    assert len(table) == 5  # the instruction without samples is left out


FAKE_NCU = """#!{python}
import sys
from pathlib import Path
args = sys.argv[1:]
if "--version" in args:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2025.3.1.0 (build 1)")
elif "--import" in args:
    page = args[args.index("--page") + 1]
    print(Path({data!r}, page + ".csv").read_text())
elif {counters}:
    Path(args[args.index("--export") + 1]).write_bytes(b"report")
    print("==PROF== Disconnected from process 1")
else:
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters")
    sys.exit(1)
"""


def _fake_ncu(tmp_path, counters: bool) -> Path:
    data = tmp_path / "pages"
    data.mkdir()
    (data / "raw.csv").write_text(RAW)
    (data / "source.csv").write_text(SOURCE)
    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU.format(python=sys.executable, data=str(data), counters=counters))
    ncu.chmod(0o755)
    return ncu


def test_run_against_a_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NCU", str(_fake_ncu(tmp_path, counters=True)))
    out = tmp_path / "out"
    assert ncu_profile.main(["bwd:d128:16k", "--out", str(out), "--source"]) == 0
    printed = capsys.readouterr().out
    assert "## bwd:d128:16k" in printed and "gmma 38%" in printed and "Hottest SASS" in printed
    assert "producer" in printed  # the warp-specialized caveat
    (path,) = out.glob("*-ncu-*.json")
    result = json.loads(path.read_text())
    case = result["cases"][0]
    assert result["meta"]["ncu"].startswith("Version 2025.3") and result["meta"]["clock_control"] == "none"
    assert [k["kernel"] for k in case["kernels"]] == ["attn_bwd_sm90_ws", "bwd_preprocess"]
    assert case["tflops"] == pytest.approx(case["flops"] / 1.25e-3 / 1e12)
    assert case["kernels"][0]["metrics"]["launch__registers_per_thread"] == 168
    assert case["source"]["attn_bwd_sm90_ws"][0]["samples"] == 1200 and result["failures"] == []
    assert "gmma 38%" in path.with_suffix(".md").read_text()  # the tables as a file too
    # A second run into the same directory keeps the first's files.
    assert ncu_profile.main(["fwd:d64:1k", "--out", str(out)]) == 0
    assert len(list(out.glob("*.json"))) == 2 and len(list(out.glob("*.md"))) == 2
    assert len(list(out.glob("*.ncu-rep"))) == 2


def test_no_counters_is_one_line_and_no_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NCU", str(_fake_ncu(tmp_path, counters=False)))
    assert ncu_profile.main(["fwd:d64:16k", "fwd:d128:16k", "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    (failure,) = [line for line in captured.err.splitlines() if "ERR_NVGPUCTRPERM" in line]
    assert failure.startswith("ncu_profile: fwd:d64:16k: ncu exit 1, no usable report: ==ERROR== ERR_NVGPUCTRPERM")
    assert "fwd:d128:16k" not in captured.err  # nothing worked: the second case is not tried
    assert "|" not in captured.out and not list((tmp_path / "out").glob("*.json"))


def test_no_ncu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(ncu_profile, "find_ncu", lambda: None)
    assert ncu_profile.main(["fwd:d64:16k", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("kind, head_dim, causal", [("fwd", 64, True), ("bwd", 64, False), ("fwd-fp8", 64, True),
                                                     ("decode", 128, False), ("decode-fp8", 128, False)])
def test_each_kind_makes_its_call(kind, head_dim, causal, device):
    """The calls the child profiles, at an awkward small shape in fp16 (on CPU through the interpreter): they run
    and write finite outputs (the backward: the gradients held in its closure)."""
    import torch

    case = ncu_profile.Case("t", kind, 2, 1 if kind.startswith("decode") else 37, 65, 4, 2 if kind.startswith(
        "decode") else 4, head_dim, head_dim, causal)
    call = ncu_profile.make_call(case, device=device, dtype=torch.float16)
    with torch.no_grad():
        result = call()
    if kind == "bwd":
        grads = [cell.cell_contents for cell in call.__closure__ if isinstance(cell.cell_contents, torch.Tensor)]
        assert grads and all(torch.isfinite(g.float()).all() for g in grads)
        return
    out = result[0] if isinstance(result, tuple) else result
    expected_rows = 1 if kind.startswith("decode") else 37
    assert out.shape == (2, expected_rows, 4, head_dim) and torch.isfinite(out.float()).all()


def test_documented():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "scripts/ncu_profile.py" in text and all(kind in text for kind in ncu_profile.KINDS)
