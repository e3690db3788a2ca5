"""Reference attention, input generators and the tolerance rule used by the tests and benchmarks.

The tolerance rule follows flash-attention's tests: a kernel may be off from the high-precision
reference by at most twice what PyTorch itself is off when it does the same computation in the
input dtype, plus a small absolute slack::

    max|ours - ref_hi| <= 2 * max|ref_lo - ref_hi| + atol

``ref_hi`` is :func:`attention_ref` with ``upcast=True`` (float64 on CPU, float32 on CUDA) and
``ref_lo`` is :func:`attention_ref` with ``upcast=False`` (the input dtype).
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "ATOL",
    "attention_ref",
    "reference_dtype",
    "causal_lower_right_mask",
    "make_qkv",
    "random_like",
    "max_abs_error",
    "assert_close_to_ref",
]


# Absolute slack of the tolerance rule: (out and lse, gradients), by input dtype.
ATOL = {
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 2e-2),
    torch.float32: (1e-5, 1e-4),
}


def reference_dtype(device) -> torch.dtype:
    """The high-precision dtype of the reference: float64 on CPU, float32 on CUDA (fast enough there)."""
    return torch.float32 if torch.device(device).type == "cuda" else torch.float64


def causal_lower_right_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query ``i`` may see key ``j``.

    Bottom-right aligned: ``j <= i + seqlen_k - seqlen_q``; with ``seqlen_q > seqlen_k`` the first
    ``seqlen_q - seqlen_k`` rows see no key at all.
    """
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True):
    """Plain softmax attention, written for clarity rather than speed.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; ``nheads % nheads_kv == 0``. K and V are
            repeated over the query-head group here (the reference only; the kernels never copy).
        causal: bottom-right aligned mask (see :func:`causal_lower_right_mask`).
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        upcast: compute in float64 on CPU / float32 on CUDA (the "hi" reference) when True, in
            the input dtype (the "lo" reference of the tolerance rule) when False.

    Returns:
        ``(out, lse)``: ``out`` ``(batch, seqlen_q, nheads, headdim)`` and ``lse``
        ``(batch, nheads, seqlen_q)`` (natural log), both in the computed dtype; the caller casts.
        A row that sees no key has ``out`` 0 and ``lse`` ``-inf``, and its gradients are 0, never NaN.
        Differentiable with respect to q, k and v through ``out``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-d (batch, seqlen, nheads, headdim), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads={nheads} must be a multiple of nheads_kv={nheads_kv}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    compute_dtype = reference_dtype(q.device) if upcast else q.dtype
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    group = nheads // nheads_kv
    if group > 1:
        k = k.repeat_interleave(group, dim=2)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * softmax_scale, k)
    if causal:
        visible = causal_lower_right_mask(seqlen_q, seqlen_k, device=q.device)
    else:
        visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    row_empty = ~visible.any(dim=-1, keepdim=True)  # (seqlen_q, 1)
    lse = torch.logsumexp(scores.detach(), dim=-1)  # -inf on empty rows
    # An all -inf row would make softmax NaN (and its backward NaN): give it finite scores, then zero it.
    probs = torch.softmax(scores.masked_fill(row_empty, 0.0), dim=-1).masked_fill(row_empty, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def make_qkv(
    batch,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_kv,
    headdim,
    dtype=torch.float16,
    device="cpu",
    packed=None,
    requires_grad=True,
    scale=1.0,
    generator=None,
):
    """Fresh standard-normal inputs (times ``scale``), never zeros.

    Args:
        packed: ``None`` returns ``(q, k, v)``, separate contiguous tensors
            ``(batch, seqlen_q, nheads, headdim)`` and ``(batch, seqlen_k, nheads_kv, headdim)``.
            ``"qkv"`` returns one tensor ``qkv`` ``(batch, seqlen, 3, nheads, headdim)`` (needs
            ``seqlen_q == seqlen_k`` and ``nheads == nheads_kv``).
            ``"kv"`` returns ``(q, kv)`` with ``kv`` ``(batch, seqlen_k, 2, nheads_kv, headdim)``.
        requires_grad: the returned tensors are leaves with ``requires_grad`` set.
        scale: multiplies the values (e.g. 30 for large logits).
        generator: a CPU ``torch.Generator`` for reproducible draws; values are drawn on the CPU
            and moved to ``device`` so that a seed gives the same inputs on every device.
    """

    def draw(*shape):
        x = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
        x = x.to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    if packed is None:
        return (
            draw(batch, seqlen_q, nheads, headdim),
            draw(batch, seqlen_k, nheads_kv, headdim),
            draw(batch, seqlen_k, nheads_kv, headdim),
        )
    if packed == "qkv":
        if seqlen_q != seqlen_k or nheads != nheads_kv:
            raise ValueError(
                f"packed='qkv' needs seqlen_q == seqlen_k and nheads == nheads_kv, got seqlen_q={seqlen_q}, "
                f"seqlen_k={seqlen_k}, nheads={nheads}, nheads_kv={nheads_kv}"
            )
        return draw(batch, seqlen_q, 3, nheads, headdim)
    if packed == "kv":
        return draw(batch, seqlen_q, nheads, headdim), draw(batch, seqlen_k, 2, nheads_kv, headdim)
    raise ValueError(f"packed must be None, 'qkv' or 'kv', got {packed!r}")


def random_like(t, generator=None, scale=1.0):
    """A fresh standard-normal tensor (times ``scale``) with ``t``'s shape, dtype and device, e.g. an upstream gradient."""
    x = torch.randn(t.shape, generator=generator, dtype=torch.float32) * scale
    return x.to(device=t.device, dtype=t.dtype)


def max_abs_error(a, b) -> float:
    """``max|a - b|`` in float64 over positions where ``b`` is finite (0 for empty tensors)."""
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    finite = torch.isfinite(b)
    if not finite.any():
        return 0.0
    return (a[finite] - b[finite]).abs().max().item()


def assert_close_to_ref(name, ours, ref_hi, ref_lo, atol):
    """Assert ``max|ours - ref_hi| <= 2 * max|ref_lo - ref_hi| + atol``.

    Args:
        name: what is compared (``"out"``, ``"lse"``, ``"dq"``...), quoted in the message.
        ours: the tensor under test, any dtype.
        ref_hi: the high-precision reference, same shape.
        ref_lo: the same computation done by PyTorch in the input dtype, same shape.
        atol: absolute slack added to the bound.

    Non-finite reference entries (``-inf`` lse of rows that see no key) must be matched exactly;
    a NaN anywhere in ``ours``, or a non-finite ``ours`` where the reference is finite, fails.
    A non-finite ``ref_lo`` where ``ref_hi`` is finite raises, so a broken "lo" reference can never
    loosen the bound into a test that always passes.
    """
    if tuple(ours.shape) != tuple(ref_hi.shape):
        raise AssertionError(f"{name}: shape {tuple(ours.shape)} differs from the reference's {tuple(ref_hi.shape)}")
    if tuple(ref_lo.shape) != tuple(ref_hi.shape):
        raise AssertionError(f"{name}: ref_lo shape {tuple(ref_lo.shape)} differs from ref_hi's {tuple(ref_hi.shape)}")
    ours64 = ours.detach().to(torch.float64).cpu()
    hi = ref_hi.detach().to(torch.float64).cpu()
    lo = ref_lo.detach().to(torch.float64).cpu()
    if torch.isnan(ours64).any():
        raise AssertionError(f"{name}: {int(torch.isnan(ours64).sum())} NaN entries of {ours64.numel()} (shape {tuple(ours.shape)})")
    hi_finite = torch.isfinite(hi)
    if not torch.equal(ours64[~hi_finite], hi[~hi_finite]):
        raise AssertionError(f"{name}: entries where the reference is +-inf differ from it")
    ours_bad = ~torch.isfinite(ours64) & hi_finite
    if ours_bad.any():
        first = tuple(i.item() for i in ours_bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(ours_bad.sum())} non-finite entries where the reference is finite, first at {first}")
    if (~torch.isfinite(lo) & hi_finite).any():
        raise AssertionError(f"{name}: the input-dtype reference overflowed; choose inputs it can represent")
    if not hi_finite.any():
        return
    err_ours = (ours64 - hi)[hi_finite].abs().max().item()
    err_lo = (lo - hi)[hi_finite].abs().max().item()
    bound = 2 * err_lo + atol
    if not err_ours <= bound:
        where = ((ours64 - hi).abs() * hi_finite).flatten().argmax().item()
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(where), hi.shape))
        raise AssertionError(
            f"{name}: max|ours - ref| = {err_ours:.3e} exceeds 2 * max|ref_lo - ref| + atol = "
            f"2 * {err_lo:.3e} + {atol:.1e} = {bound:.3e} (shape {tuple(ours.shape)}, worst at {index}: "
            f"ours={ours64[index].item():.6g}, ref={hi[index].item():.6g})"
        )
