"""scripts/racecheck_report.py sorts racecheck's reports by the kernel source lines they name: the one-pass
backward's lse/delta hand-over and Triton's warp_specialize dispatch are explained, anything else is not."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("racecheck_report", ROOT / "scripts" / "racecheck_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def line_of(text: str, file: str = "bwd_sm90_ws.py") -> int:
    source = (report.KERNELS / file).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(source) if text in line)


def block(first: tuple, others: list, file: str = "bwd_sm90_ws.py") -> str:
    lines = [f"========= Error: Race reported between Write access at kernel+0x66e0 in {file}:{first[0]}"]
    lines += [f"=========     and Read access at kernel+0x1950 in {file}:{line} [{n} hazards]" for line, n in others]
    return "\n".join(lines + ["========= "])


def test_the_explained_kinds_and_the_rest():
    store = line_of("rows_smem.index(slot * 2).store")
    lse_load = line_of("lse2 = rows_smem.index(slot * 2).load")
    delta_load = line_of("delta = rows_smem.index(slot * 2 + 1).load")
    kernel_def = line_of("def attn_bwd_sm90_ws(")
    dispatch = line_of("gl.warp_specialize(")
    other = line_of("ds_own.store(")
    text = "\n".join([
        "========= COMPUTE-SANITIZER",
        block((store,), [(lse_load, 128), (delta_load, 64)]),
        block((kernel_def,), [(kernel_def, 20), (dispatch, 8)]),
        block((store,), [(other, 3)]),
        # The forward starts its partitions in a helper: the dispatch write is on the helper's call.
        block((line_of("def attn_fwd_sm90_ws(", "fwd_sm90_ws.py"),),
              [(line_of("    run_partitions(", "fwd_sm90_ws.py"), 6)], "fwd_sm90_ws.py"),
        "========= RACECHECK SUMMARY: 5 hazards displayed (5 errors, 0 warnings)",
    ])
    counts = report.classify(text)
    assert counts == {"lse/delta hand-over": 192, "warp_specialize dispatch": 34, "unexplained": 3}


def test_exit_status(tmp_path, capsys):
    clean = tmp_path / "clean.txt"
    clean.write_text("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    assert report.main(str(clean)) == 0 and "no hazards" in capsys.readouterr().out
    bad = tmp_path / "bad.txt"
    bad.write_text(block((line_of("ds_own.store("),), [(line_of("dq_smem.index"), 5)]) + "\n")
    assert report.main(str(bad)) == 1 and "5 unexplained" in capsys.readouterr().out
