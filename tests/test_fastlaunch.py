"""CachedLaunch (flashtile/backends/triton/fastlaunch.py): the first launch of a key goes through
Triton, later ones reuse its compiled kernel with only the dynamic arguments replaced. Triton's
interpreter never takes the cached path, so these tests drive it with a stand-in kernel."""
import types

import pytest
import torch

import flashtile
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


def test_dynamic_values_as_a_tuple(cached):
    """Values in ``dynamic_names`` order launch as the same arguments by name do."""
    fn, launch = cached
    x1, x2 = torch.zeros(8), torch.ones(8)
    static = lambda: dict(n=5, BLOCK=16)  # noqa: E731
    launch("k", (2,), (x1, 0.5), static)
    launch("k", (2,), (x2, 0.25), static)
    launch("k", (2,), dict(X=x1, scale=0.75), static)
    assert len(fn.compiles) == 1 and fn.compiles[0][1]["X"] is x1
    launches = fn.compiled[0].launches
    assert [(args[0], args[2]) for _, args in launches] == [(x2, 0.25), (x1, 0.75)]


@pytest.mark.parametrize("interpreting", [False, True], ids=["cached", "interpreter"])
def test_tensor_among_static_arguments_is_refused(monkeypatch, interpreting):
    """A tensor the caller forgot to name as dynamic would be kept from the first call and read by every
    later one (the KV-cache kernel once kept a packed call's ``cu_seqlens_q`` that way): it is refused,
    under the interpreter too, so the CPU tests catch it."""
    monkeypatch.setattr(fastlaunch, "_interpreting", lambda: interpreting)
    fn = FakeJit()
    launch = fastlaunch.CachedLaunch(fn, ("scale", ))
    with pytest.raises(TypeError, match="tensor argument X must be among the dynamic arguments"):
        launch("k", (1,), (0.5, ), lambda: dict(X=torch.zeros(4), n=1, BLOCK=16))
    # By name, as an extra dynamic argument the launcher was not told of.
    with pytest.raises(TypeError, match=r"dynamic arguments \['X'\] are not"):
        launch("k", (1,), dict(X=torch.zeros(4), scale=0.5), lambda: dict(n=1, BLOCK=16))
    assert not fn.compiles


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


def test_dynamic_ints_are_keyed_as_triton_specializes_them(cached):
    """A length or stride passed as a dynamic int reuses the launch while Triton would compile the same
    kernel (same width, not 1, same divisibility by 16) and takes Triton's path when it would not."""
    fn, _ = cached
    launch = fastlaunch.CachedLaunch(fn, ("X", "n", "scale"))
    x = torch.zeros(8)
    for n in (17, 33, 48, 64, 1, 2**33, 2**33 + 16):
        launch("k", (1,), dict(X=x, n=n, scale=1.0), lambda: dict(BLOCK=16))
    # 17 and 33: i32; 48 and 64: i32 divisible by 16; 1: a constant; 2**33 and 2**33 + 16: i64 divisible by 16.
    assert [kwargs["n"] for _, kwargs in fn.compiles] == [17, 48, 1, 2**33]
    (_, args), = fn.compiled[0].launches
    assert args[1] == 33
    (_, args), = fn.compiled[1].launches
    assert args[1] == 64


def test_do_not_specialize_ints_are_keyed_by_width_only(cached):
    fn, _ = cached
    fn.params = [types.SimpleNamespace(name=name, do_not_specialize=name == "n", do_not_specialize_on_alignment=False)
                 for name in fn.arg_names]
    launch = fastlaunch.CachedLaunch(fn, ("X", "n", "scale"))
    for n in (17, 32, 1, 2**33):
        launch("k", (1,), dict(X=torch.zeros(8), n=n, scale=1.0), lambda: dict(BLOCK=16))
    assert [kwargs["n"] for _, kwargs in fn.compiles] == [17, 2**33]


@pytest.mark.cuda
@pytest.mark.parametrize("seqlen_q", [1, 33], ids=["decode", "chunk"])
def test_growing_kv_cache_reuses_its_launch(seqlen_q):
    """A transformers-style loop: the cache is concatenated one token a step (new strides and lengths
    every step) and passed transposed. One query a step runs on the KV-cache kernel, a chunk of 33 on the
    forward; either keeps its launches (no Triton binding per step) and every step matches the reference."""
    from flashtile.backends.triton import decode, launch
    from flashtile.testing import ATOL, assert_close_to_ref, attention_ref

    torch.manual_seed(0)
    # One query over 4100 keys: the KV-cache kernel's share (configs.DENSE_DECODE_MIN_KEYS).
    keys, values = (torch.randn(2, 4, 4100 if seqlen_q == 1 else 37, 64, device="cuda", dtype=torch.float16)
                    for _ in range(2))
    cached = decode._DECODE if seqlen_q == 1 else launch._FWD
    cached._cache.clear()
    for _ in range(40):
        query = torch.randn(2, 8, seqlen_q, 64, device="cuda", dtype=torch.float16)
        q, k, v = (x.transpose(1, 2) for x in (query, keys, values))
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        hi, _ = attention_ref(q, k, v, causal=True)
        lo, _ = attention_ref(q, k, v, causal=True, upcast=False)
        assert_close_to_ref("out", out, hi, lo, ATOL[torch.float16][0])
        keys, values = (torch.cat([x, torch.randn_like(x[:, :, :1])], dim=2) for x in (keys, values))
    # One launch per specialization of the lengths and strides (divisible by 16 or not), not one a step.
    assert 1 <= len(cached._cache) <= 4


def test_repeated_values_skip_the_specialization(cached, monkeypatch):
    """A call whose ints equal an earlier call's finds its launch by value; new values are keyed by
    specialization again and reuse the launch while Triton would."""
    fn, _ = cached
    launch = fastlaunch.CachedLaunch(fn, ("X", "n", "scale"))
    x = torch.zeros(8)
    launch("k", (1,), dict(X=x, n=17, scale=1.0), lambda: dict(BLOCK=16))
    launch("k", (1,), dict(X=x, n=17, scale=2.0), lambda: dict(BLOCK=16))
    specialized = []
    monkeypatch.setattr(fastlaunch, "native_specialize_impl", lambda *a: specialized.append(a[1]) or ("i32", ""))
    launch("k", (1,), dict(X=torch.ones(8), n=17, scale=0.5), lambda: dict(BLOCK=16))
    assert specialized == [] and len(fn.compiles) == 1
    launch("k", (1,), dict(X=x, n=33, scale=1.0), lambda: dict(BLOCK=16))
    assert specialized == [33] and len(fn.compiles) == 1
    assert [args[1] for _, args in fn.compiled[0].launches] == [17, 17, 33]
