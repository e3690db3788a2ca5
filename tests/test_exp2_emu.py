"""exp2 on the FMA pipe (kernels/common.py ``exp2_poly`` / ``exp2_split``: the warp-specialized forward's EXP2_EMU).

``exp2_poly`` (Triton ops) runs everywhere, through the interpreter on CPU; ``exp2_split``'s inline PTX, which the
kernels run, on a CUDA GPU only, where with every element on the polynomial it must equal ``exp2_poly`` bit for
bit. The bound, against float64: relative error at most ``REL_BOUND`` (the cubic's 1.02e-4 and float32's
roundings) where 2^x is a normal float32 (x >= -126); below that at most 2^-126; -inf and anything under -127
give exactly 0, and NaN stays NaN. Inputs: a dense sweep of [-130, 9] (9 > FP8's P_LOG2 of 8.807, the largest
argument a kernel passes) with the integers, the halves (where rounding to the nearest integer ties) and
awkward values on top.
"""
import pytest
import torch
import triton
import triton.language as tl

from flashtile.backends.triton.kernels.common import EXP2_MIN, exp2_poly, exp2_split, exp2_split_asm
from flashtile.backends.triton.kernels.fwd_sm90_ws import P_LOG2

REL_BOUND = 1.05e-4
SMALLEST_NORMAL = 2.0 ** -126
BLOCK = 1024


@triton.jit
def _exp2_kernel(X, Y, n, EXP2_EMU: tl.constexpr, POLY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    if POLY:
        y = exp2_poly(x)
    else:
        y = exp2_split(x, EXP2_EMU)
    tl.store(Y + offs, y, mask=offs < n)


# Named groups of float64 arguments (rounded to float32 on the way in).
INPUTS = {
    "sweep": torch.linspace(-130.0, 9.0, 5003, dtype=torch.float64),
    "integers": torch.arange(-130.0, 9.0, dtype=torch.float64),
    "halves": torch.arange(-130.0, 9.0, dtype=torch.float64) + 0.5,
    "awkward": torch.tensor([0.0, -0.0, 1e-30, -1e-30, -0.5, 0.5, -1.5, -126.0, -126.3, -126.5, -126.7, -127.0, -127.5,
                             -128.0, -149.0, -1000.0, -1e30, -3.4e38, float("-inf"), P_LOG2.value, P_LOG2.value - 0.5,
                             -P_LOG2.value], dtype=torch.float64),
}


def inputs(device, names=tuple(INPUTS)) -> torch.Tensor:
    """float32 arguments of the groups ``names``, on ``device``."""
    return torch.cat([INPUTS[name] for name in names]).to(torch.float32).to(device)


def run(x: torch.Tensor, exp2_emu: int = 0, poly: bool = True) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))
    _exp2_kernel[(triton.cdiv(x.numel(), BLOCK), )](x, y, x.numel(), EXP2_EMU=exp2_emu, POLY=poly, BLOCK=BLOCK)
    return y


def assert_exp2(x: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` within the bounds above of exp2(``x``) in float64."""
    x64, y64 = x.double().cpu(), y.double().cpu()
    ref = torch.exp2(x64)
    assert not y64.isnan().any(), f"NaN at x = {x64[y64.isnan()][:4].tolist()}"
    zero = x64 < EXP2_MIN.value
    assert torch.all(y64[zero] == 0), f"not 0 at x = {x64[zero & (y64 != 0)][:4].tolist()}"
    normal = x64 >= -126.0
    rel = ((y64 - ref).abs() / ref)[normal]
    worst = rel.argmax()
    assert rel[worst] <= REL_BOUND, f"relative error {rel[worst].item():.3g} at x = {x64[normal][worst].item()}"
    tiny = ~normal & ~zero
    assert torch.all((y64 - ref)[tiny].abs() <= SMALLEST_NORMAL), "error over 2^-126 below 2^-126"


@pytest.mark.parametrize("group", list(INPUTS))
def test_exp2_poly(device, group):
    """The polynomial's math (the interpreter on CPU) against float64."""
    x = inputs(device, (group, ))
    assert_exp2(x, run(x))


def test_exp2_poly_keeps_nan(device):
    y = run(torch.tensor([float("nan"), 0.0, float("nan")], device=device))
    assert y[0].isnan() and y[2].isnan() and y[1].item() == 1.0


def test_exp2_poly_is_exact_at_integers(device):
    """2^k with the cubic's constant 1: a row's max (x = 0) gives 1 exactly, as the MUFU's ex2 does."""
    k = torch.arange(-126.0, 9.0, device=device)
    assert torch.equal(run(k).cpu().double(), torch.exp2(k.cpu().double()))


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_exp2_split_asm_takes_one_element_in_n(n):
    """One polynomial and n - 1 ex2 a call, each of the n outputs written once and each input read once."""
    asm = exp2_split_asm.fn(n) if hasattr(exp2_split_asm, "fn") else exp2_split_asm(n)
    assert asm.count("ex2.approx") == n - 1 and asm.count("fma.rn.f32") == 3
    operands = [token.strip(",;") for token in asm.split() if token.startswith("$")]
    assert sorted(operands, key=lambda op: int(op[1:])) == [f"${i}" for i in range(2 * n)]


@pytest.mark.cuda
@pytest.mark.parametrize("exp2_emu", [1, 2, 4, 8])
def test_exp2_split_on_the_gpu(exp2_emu):
    """The inline PTX: one element in ``exp2_emu`` on the polynomial, the others on the MUFU, all within the bound;
    with every element on the polynomial (1), the same bits as exp2_poly wherever 2^x is normal."""
    x = inputs("cuda")
    y = run(x, exp2_emu, poly=False)
    assert_exp2(x, y)
    assert run(torch.tensor([float("nan")] * 64, device="cuda"), exp2_emu, poly=False).isnan().all()
    if exp2_emu == 1:
        normal = x >= -126.0
        assert torch.equal(y[normal], run(x)[normal])

