"""Every ```python block of README.md and docs/*.md runs as written.

A block runs on its own (fresh globals, stats reset, strict mode off), so it must import what it uses. A
block marked GPU-only (``<!-- gpu-only -->`` on the line before it, or ``gpu-only`` in the fence's info
string: ```` ```python gpu-only ````) runs only where CUDA is available and is skipped elsewhere. On CPU
the Triton kernels run under Triton's interpreter (tests/conftest.py), so snippets keep their shapes tiny.
"""
import re
from pathlib import Path

import pytest
import torch

import flashtile
from flashtile import dispatch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GPU_ONLY = "gpu-only"
_FENCE = re.compile(r"^```(\S*)(.*)$")


def python_blocks(path: Path) -> list:
    """``(first line number, code, gpu_only)`` of each ```python block of a Markdown file."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None or not fence.group(1):
            i += 1
            continue
        language, info = fence.group(1), fence.group(2)
        previous = lines[i - 1].strip() if i else ""
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.name}:{i + 1}: a code block is never closed"
        if language == "python":
            gpu_only = GPU_ONLY in info or previous == f"<!-- {GPU_ONLY} -->"
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n", gpu_only))
        i = end + 1
    return blocks


SNIPPETS = [pytest.param(path, line, code, gpu_only, id=f"{path.relative_to(ROOT)}:{line}")
            for path in DOCS for line, code, gpu_only in python_blocks(path)]


PAGES = ("api.md", "benchmarks.md", "design.md", "serving.md", "training.md")


def test_docs_have_snippets():
    """Every page the README links to exists, and the README has snippets that run on a CPU."""
    assert {path.name for path in DOCS} >= set(PAGES)
    assert any(not gpu_only for _, _, gpu_only in python_blocks(ROOT / "README.md"))


def test_block_parser_marks_gpu_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n<!-- gpu-only -->\n```python\ny = 2\n```\n"
                    "```python gpu-only\nz = 3\n```\n```bash\nls\n```\n")
    assert python_blocks(page) == [(3, "x = 1\n", False), (7, "y = 2\n", True), (10, "z = 3\n", True)]


@pytest.fixture
def clean_state():
    flashtile.reset_stats()
    flashtile.set_strict(False)
    dispatch.forget_plans()
    torch.manual_seed(0)
    yield
    flashtile.set_strict(False)
    flashtile.reset_stats()


@pytest.mark.parametrize("path, line, code, gpu_only", SNIPPETS)
def test_snippet_runs(path, line, code, gpu_only, clean_state, capsys):
    if gpu_only and not torch.cuda.is_available():
        pytest.skip("GPU-only snippet; no CUDA here")
    exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), {"__name__": "__doc_snippet__"})


def test_api_reference_covers_the_public_names():
    """docs/api.md documents every name of ``flashtile.__all__`` and ``flashtile.nn.__all__``."""
    text = (ROOT / "docs" / "api.md").read_text()
    names = [name for name in flashtile.__all__ if name not in ("nn", "__version__")]
    names += [f"flashtile.nn.{name}" for name in flashtile.nn.__all__]
    assert [name for name in names if f"`{name}" not in text] == []
