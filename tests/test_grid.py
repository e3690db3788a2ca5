"""The default run's covering set (tests/conftest.py): every grid point it leaves out is marked exhaustive, and
every value of every parameter still runs on each backend by default."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Collects the whole suite with every point kept (FLASHTILE_TESTS=all) and prints, per test function, its points'
# parameters, whether each is marked exhaustive, and whether this machine skips it.
COLLECT = """
import json, sys
import pytest

class Collect:
    def pytest_collection_finish(self, session):
        from conftest import grid_point, skipped_here
        self.rows = [(item.nodeid.split("[")[0], grid_point(item),
                      bool(item.get_closest_marker("exhaustive")), skipped_here(item))
                     for item in session.items if hasattr(item, "callspec")]

plugin = Collect()
status = pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", "-n", "0", "tests"], plugins=[plugin])
print("ROWS" + json.dumps(plugin.rows))
sys.exit(status)
"""


def collected() -> list:
    env = {**os.environ, "FLASHTILE_TESTS": "all", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-c", COLLECT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(result.stdout.split("ROWS", 1)[1])


def test_default_run_covers_every_parameter_value_on_each_backend():
    rows = collected()
    exhaustive = [r for r in rows if r[2]]
    assert len(exhaustive) > 300  # the big grids are thinned
    functions: dict = {}
    for function, params, marked, skipped in rows:
        functions.setdefault(function, []).append((params, marked, skipped))
    for function, points in functions.items():
        runnable = [params for params, marked, skipped in points if not skipped]
        kept = [params for params, marked, skipped in points if not marked and not skipped]
        wanted = {(p.get("backend"), name, value) for p in runnable for name, value in p.items() if name != "backend"}
        have = {(p.get("backend"), name, value) for p in kept for name, value in p.items() if name != "backend"}
        assert wanted <= have, f"{function}: the default run leaves out {sorted(wanted - have)[:5]}"
