"""Module imports: no circle between flashtile's modules at import time (alloc, recording, replay)."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flashtile"


def module_imports(name: str) -> set[str]:
    """The flashtile modules that ``flashtile/<name>.py`` imports at module level (not inside functions)."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashtile."):
            found.add(node.module.split(".")[1])
    return {m for m in found if (PACKAGE / f"{m}.py").exists()}


def reachable(name: str) -> set[str]:
    """Every top-level flashtile module that importing ``name`` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for m in module_imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


@pytest.mark.parametrize("name", ["alloc", "recording", "replay"])
def test_no_import_circle(name):
    assert name not in reachable(name), f"flashtile.{name} imports itself through {sorted(reachable(name))}"


def test_alloc_and_recording_do_not_import_replay():
    assert module_imports("recording") == set()
    assert "replay" not in reachable("alloc")


@pytest.mark.parametrize("name", ["alloc", "recording", "replay"])
def test_imports_alone(name):
    """Each module imports first in a fresh interpreter (the order a user's script may take)."""
    code = f"import flashtile.{name} as m; assert m.__file__.startswith({str(PACKAGE)!r}), m.__file__"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
