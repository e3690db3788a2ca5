"""Sort a ``compute-sanitizer --tool racecheck`` report (its analysis mode, the default) into the hazards
docs/reliability.md explains and the rest:

    python scripts/racecheck_report.py racecheck.txt    # prints one line; exit 1 if any hazard is unexplained

Each reported pair of accesses is looked up in the kernel source it names (flashtile/backends/triton/kernels/):

- ``lse/delta hand-over``: both accesses are a ring slot's rows (``rows_smem``) of the one-pass backward, the
  producer warp's stores and the consumers' loads, which the ``q_ready``/``q_empty`` mbarriers order and
  racecheck does not follow;
- ``warp_specialize dispatch``: both are on a kernel's ``def`` line or a line that starts its partitions
  (``gl.warp_specialize(``, or a call of a function that holds it): the partition numbers Triton's generated code
  writes before a CTA-wide ``bar.sync`` and reads after it.

Anything else is unexplained.
"""
import re
import sys
from collections import Counter
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "flashtile" / "backends" / "triton" / "kernels"
_FIRST = re.compile(r"Race reported between (?:Read|Write) access at \S+ in (\S+?):(\d+)")
_OTHER = re.compile(r"^=+\s+and (?:Read|Write) access at \S+ in (\S+?):(\d+) \[(\d+) hazards?\]")


def _source(file: str, line: int, kernels: Path) -> str:
    path = kernels / Path(file).name
    lines = path.read_text().splitlines() if path.is_file() else []
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def _launchers(kernels: Path) -> tuple:
    """``gl.warp_specialize(`` and the calls of the kernel functions whose body holds it."""
    names = []
    for path in kernels.glob("*.py"):
        for body in re.split(r"\n(?=@gluon\.jit)", path.read_text()):
            if "gl.warp_specialize(" in body and (name := re.search(r"\ndef (\w+)\(", body)):
                names.append(name[1] + "(")
    return ("gl.warp_specialize(", *names)


def kind(first: str, other: str, launchers: tuple = ("gl.warp_specialize(",)) -> str:
    """The class of a pair of accesses, from their source lines."""
    if "rows_smem" in first and "rows_smem" in other:
        return "lse/delta hand-over"
    if all(line.startswith("def ") or any(call in line for call in launchers) for line in (first, other)):
        return "warp_specialize dispatch"
    return "unexplained"


def classify(report: str, kernels: Path = KERNELS) -> Counter:
    """Hazard counts by class over every pair the report lists."""
    counts: Counter = Counter()
    launchers = _launchers(kernels)
    first = None
    for line in report.splitlines():
        if match := _FIRST.search(line):
            first = _source(match[1], int(match[2]), kernels)
        elif (match := _OTHER.match(line)) and first is not None:
            counts[kind(first, _source(match[1], int(match[2]), kernels), launchers)] += int(match[3])
        elif not line.strip("= "):
            first = None  # the blank line that ends a report
    return counts


def main(path: str) -> int:
    counts = classify(Path(path).read_text())
    print("racecheck_report: " + (", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "no hazards"))
    return 1 if counts["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
