"""CachedLaunch (flashtile/backends/triton/fastlaunch.py): the first launch of a key goes through
Triton, later ones reuse its compiled kernel with only the dynamic arguments replaced. Triton's
interpreter never takes the cached path, so these tests drive it with a stand-in kernel."""
import pytest
import torch

from flashtile.backends.triton import fastlaunch


class FakeCompiled:
    """Records the positional arguments each cached launch passes to the launcher."""

    def __init__(self):
        self.launches = []
        self.function = "fn"
        self.packed_metadata = "meta"

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
        self.launches.append(((gx, gy, gz), args))

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid}


class FakeJit:
    """Stands in for a @triton.jit function with arguments (X, n, scale, BLOCK)."""

    arg_names = ["X", "n", "scale", "BLOCK"]

    def __init__(self):
        self.compiles = []
        self.compiled = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.compiles.append((grid, kwargs))
            kernel = FakeCompiled()
            self.compiled.append(kernel)
            return kernel
        return launch


@pytest.fixture
def cached(monkeypatch):
    monkeypatch.setattr(fastlaunch, "_interpreting", lambda: False)
    monkeypatch.setattr(fastlaunch, "_current_stream", lambda: 7)
    fn = FakeJit()
    return fn, fastlaunch.CachedLaunch(fn, ("X", "scale"))


def test_static_arguments_are_worked_out_once_per_key(cached):
    fn, launch = cached
    calls = []

    def static():
        calls.append(1)
        return dict(n=5, BLOCK=16, num_warps=4)

    x1, x2 = torch.zeros(8), torch.ones(8)
    launch(("shape", 8), (2,), dict(X=x1, scale=0.5), static)
    launch(("shape", 8), (2,), dict(X=x2, scale=0.25), static)
    assert len(calls) == 1 and len(fn.compiles) == 1
    grid, args = fn.compiled[0].launches[0]
    # Positional order of the kernel's parameters; the new tensor and scale, the cached n and BLOCK.
    assert grid == (2, 1, 1) and args[0] is x2 and args[1:] == (5, 0.25, 16)
    launch(("shape", 9), (3, 1), dict(X=x1, scale=0.5), static)
    assert len(calls) == 2 and len(fn.compiles) == 2


def test_cache_keeps_no_tensor_of_the_first_call(cached):
    fn, launch = cached
    launch("k", (1,), dict(X=torch.zeros(4), scale=1.0), lambda: dict(n=1, BLOCK=16))
    (_, args), = launch._cache.values()
    assert args[0] is None and args[2] is None


def test_alignment_and_dtype_are_part_of_the_key(cached):
    fn, launch = cached
    static = lambda: dict(n=1, BLOCK=16)  # noqa: E731
    base = torch.zeros(64)
    launch("k", (1,), dict(X=base, scale=1.0), static)
    launch("k", (1,), dict(X=base[1:], scale=1.0), static)  # 4-byte offset: not 16-byte aligned
    launch("k", (1,), dict(X=base.half(), scale=1.0), static)
    assert len(fn.compiles) == 3


def test_unknown_dynamic_name_is_rejected():
    with pytest.raises(ValueError, match="no arguments"):
        fastlaunch.CachedLaunch(FakeJit(), ("Y",))
