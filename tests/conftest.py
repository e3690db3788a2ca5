"""Test setup: the device, the backends to run on it, per-test random generators, poisoned outputs.

Without CUDA the Triton kernels run on CPU tensors through Triton's interpreter, which reads
``TRITON_INTERPRET`` when triton is imported: it is set here, before anything imports flashtile.
"""
import os
import pathlib
import sys
import time
import zlib

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Every buffer a kernel must fill starts as NaN (flashtile/alloc.py): an element left unwritten fails.
os.environ["FLASHTILE_POISON"] = "1"
# Check index tensors' values (varlen offsets, cache lengths, block tables) on CUDA too (a host
# sync per call, off by default).
os.environ["FLASHTILE_VALIDATE_VALUES"] = "1"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import pytest  # noqa: E402

from flashtile.dispatch import force_backend  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# On CPU both backends run (Triton through the interpreter); on CUDA the Triton kernels are the product.
BACKENDS = ("triton",) if HAS_CUDA else ("torch", "triton")


# The default run keeps a covering set of each big grid; FLASHTILE_TESTS=all runs every grid point.
RUN_ALL = os.environ.get("FLASHTILE_TESTS", "") == "all"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped on CPU")
    config.addinivalue_line(
        "markers", "exhaustive: a grid point past the default run's covering set (grid_points); deselected unless "
        "FLASHTILE_TESTS=all (run them alone with FLASHTILE_TESTS=all ... -m exhaustive)")
    # Triton's interpreter (not flashtile) trips a numpy deprecation on every scalar load.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


def skipped_here(item) -> bool:
    """Whether pytest_runtest_setup skips the test on this machine."""
    if (item.get_closest_marker("cuda") and not HAS_CUDA) or item.get_closest_marker("skip"):
        return True
    if any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif")):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("dtype") is torch.bfloat16 and params.get("backend") == "triton" and not HAS_CUDA


def grid_point(item) -> dict:
    """An item's parameters, the names that one parametrize gives together (``"seqlen_q, seqlen_k"``) as one."""
    values = {name: repr(value) for name, value in item.callspec.params.items()}
    point = {}
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if len(names) > 1 and all(n in values for n in names):
            point[", ".join(names)] = ", ".join(values.pop(n) for n in names)
    return {**values, **point}


def covering(items: list) -> set:
    """The items of one test function's grid that the default run keeps, picked greedily in collection order: every
    value of every parameter (each length pair, head dim, dtype, mask, feature) at least once, on each backend when
    the backend is a parameter. A grid with one parameter besides the backend is kept whole: each point there is a
    case of its own."""
    params = [grid_point(item) for item in items]
    axes = sorted(name for name in params[0] if name != "backend" and len({p.get(name) for p in params}) > 1)
    if len(axes) < 2:
        return set(range(len(items)))
    pairs = [{(p.get("backend"), a, p.get(a)) for a in axes} for p in params]
    runnable = [i for i, item in enumerate(items) if not skipped_here(item)]
    wanted = set().union(*(pairs[i] for i in runnable)) if runnable else set()
    kept = {i for i, item in enumerate(items) if skipped_here(item)}  # they cost nothing
    while wanted:
        best = max(runnable, key=lambda i: (len(pairs[i] & wanted), -i))
        kept.add(best)
        wanted -= pairs[best]
    return kept


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the grid points past each test function's covering set exhaustive, and deselect every exhaustive
    test unless FLASHTILE_TESTS=all (before -m / -k are applied)."""
    grids: dict = {}
    for item in items:
        if hasattr(item, "callspec") and not item.get_closest_marker("exhaustive"):
            grids.setdefault(item.nodeid.split("[")[0], []).append(item)
    for grid in grids.values():
        kept = covering(grid)
        for i, item in enumerate(grid):
            if i not in kept:
                item.add_marker(pytest.mark.exhaustive)
    if RUN_ALL:
        return
    named = [arg for arg in config.args if "[" in arg]  # a grid point asked for by its id runs whatever its mark
    deselected = [item for item in items if item.get_closest_marker("exhaustive")
                  and not any(arg.endswith(item.nodeid) for arg in named)]
    if deselected:
        dropped = set(map(id, deselected))
        items[:] = [item for item in items if id(item) not in dropped]
        config.hook.pytest_deselected(items=deselected)


def pytest_report_header(config):
    if not RUN_ALL:
        return "flashtile: the default grid (a covering set of each big grid); FLASHTILE_TESTS=all runs every point"


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    params = getattr(getattr(item, "callspec", None), "params", {})
    # Triton's interpreter computes bfloat16 wrongly (numpy has no bf16), so bf16 runs only on GPU or the torch backend.
    if params.get("dtype") is torch.bfloat16 and params.get("backend") == "triton" and not HAS_CUDA:
        pytest.skip("bfloat16 is not supported by Triton's interpreter")


@pytest.fixture
def device():
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return DEVICE


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Runs the test body with every flashtile call forced onto one backend; yields its name."""
    with force_backend(request.param):
        yield request.param


@pytest.fixture
def rng(request):
    """A CPU generator seeded from the test id: fresh inputs per test, the same on every rerun."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test plans and names its calls afresh: tests change what backends support (monkeypatched FEATURES,
    capabilities) and which kernels they pick (monkeypatched thresholds), which the remembered plans and kernel
    names of repeated calls would not see."""
    from flashtile import dispatch

    dispatch.forget_plans()
    dispatch._describe.cache_clear()
    yield
    dispatch.forget_plans()
    dispatch._describe.cache_clear()


@pytest.fixture
def clean_dispatch_state(monkeypatch):
    """Fresh stats, warn-once memory, no strict mode and no disabled backends, before and after."""
    import flashtile
    from flashtile import dispatch

    flashtile.reset_stats()
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.delenv("FLASHTILE_STRICT", raising=False)
    monkeypatch.delenv("FLASHTILE_DISABLE_BACKENDS", raising=False)
    yield
    flashtile.set_strict(False)
    flashtile.reset_stats()


@pytest.fixture
def no_dense_decode_threshold(monkeypatch):
    """On a GPU short decode-shaped calls would take the forward kernel (configs.DENSE_DECODE_MIN_KEYS): lift
    the threshold, and forget kernel names described under either setting."""
    from flashtile import dispatch
    from flashtile.backends.triton import configs

    monkeypatch.setattr(configs, "DENSE_DECODE_MIN_KEYS", 0)
    dispatch._describe.cache_clear()
    yield
    dispatch._describe.cache_clear()


@pytest.fixture
def served(monkeypatch):
    """The replays that served a call, in order."""
    from flashtile import replay

    calls = []
    run = replay.Replay.__call__

    def counted(self, inputs, counters=()):
        outputs = run(self, inputs, counters)
        if outputs is not None:
            calls.append(self)
        return outputs

    monkeypatch.setattr(replay.Replay, "__call__", counted)
    return calls


def _reporting_here() -> bool:
    """Whether this process writes the run's logs: pytest-xdist's controller (or a run without workers), which
    sees every worker's reports, so each line is written once."""
    return not os.environ.get("PYTEST_XDIST_WORKER")


def _progress(line: str) -> None:
    """With FLASHTILE_PROGRESS_LOG=path, one line per test event as it happens (a run cut off or hung still says
    what started, what finished, and how long each took)."""
    log = os.environ.get("FLASHTILE_PROGRESS_LOG")
    if log and _reporting_here():
        with open(log, "a") as f:
            f.write(f"{time.time():.1f} {line}\n")


def pytest_runtest_logstart(nodeid, location):
    _progress(f"start {nodeid}")


def pytest_runtest_logreport(report):
    """With FLASHTILE_FAILURE_LOG=path, each failure's id and last traceback lines go there as it happens (a GPU
    run cut off by its time limit still says what failed)."""
    if report.when == "call" or not report.passed:
        worker = getattr(getattr(report, "node", None), "gateway", None)
        _progress(f"{report.outcome} {report.duration:.1f}s {report.nodeid} ({report.when}"
                  f"{', ' + worker.id if worker else ''})")
    log = os.environ.get("FLASHTILE_FAILURE_LOG")
    if log and report.failed and _reporting_here():
        tail = "\n    ".join(str(report.longrepr).splitlines()[-6:])
        with open(log, "a") as f:
            f.write(f"{report.nodeid} ({report.when}):\n    {tail}\n")


@pytest.fixture
def bwd_pair_head_dims(monkeypatch):
    """The q/k head-dim switches ``(HEAD_DIM_QK, TAIL_DIM)`` of every launch of the Triton backward pair (bwd.py's
    dK/dV and dQ kernels) in the test: their launch caches start empty, so each launch works its switches out."""
    from flashtile.backends.triton import launch

    seen = []
    head_dims = launch._bwd_head_dims

    def spy(head_dim, head_dim_v):
        dims = head_dims(head_dim, head_dim_v)
        seen.append((dims["HEAD_DIM_QK"], dims["TAIL_DIM"]))
        return dims

    monkeypatch.setattr(launch, "_bwd_head_dims", spy)
    for pair in (launch._DKDV, launch._DQ):
        monkeypatch.setattr(pair, "_cache", {})
        monkeypatch.setattr(pair, "_by_value", {})
    return seen
