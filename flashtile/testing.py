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
import os

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
    "attention_varlen_ref",
    "cu_seqlens_of",
    "reference_results",
    "assert_results_close",
    "check_packed",
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


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, sink=None, attn_bias=None, dropout_p=0.0, dropout_mask=None):
    """Plain softmax attention with every variant, written for clarity rather than speed.

    The math is the one stated in ``flashtile/backends/__init__.py``.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k: ``(batch, seqlen_k, nheads_kv, headdim)``, v: ``(batch, seqlen_k, nheads_kv, headdim_v)``;
            ``nheads % nheads_kv == 0``. K and V are repeated over the query-head group here (the
            reference only; the kernels never copy).
        causal: bottom-right aligned mask (see :func:`causal_lower_right_mask`); with a window,
            the window's right side becomes 0.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        upcast: compute in float64 on CPU / float32 on CUDA (the "hi" reference) when True, in
            the input dtype (the "lo" reference of the tolerance rule) when False.
        window_size: ``(left, right)``, -1 = unbounded.
        softcap: ``> 0`` caps the scaled scores with ``softcap * tanh(s / softcap)``.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``.
        sink: ``(nheads,)`` logits that join each row's denominator.
        attn_bias: broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``; float adds, bool keeps.
        dropout_p, dropout_mask: the output uses ``p * dropout_mask / (1 - dropout_p)``;
            ``dropout_mask`` ``(batch, nheads, seqlen_q, seqlen_k)`` bool (True = keep).

    Returns:
        ``(out, lse)``: ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` and ``lse``
        ``(batch, nheads, seqlen_q)`` (natural log), both in the computed dtype; the caller casts.
        A row that sees no key (and has no sink) has ``out`` 0 and ``lse`` ``-inf``, and its
        gradients are 0, never NaN. Differentiable with respect to q, k, v, sink and a float
        attn_bias through ``out``.
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
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(seqlen_q, device=q.device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=q.device).unsqueeze(0)
    distance = rows + (seqlen_k - seqlen_q) - cols  # i + diag - j
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype).expand(batch, nheads)
        scores = scores - slopes[:, :, None, None] * distance.abs().to(compute_dtype)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        visible &= distance <= left
    if right >= 0:
        visible &= distance >= -right
    visible = visible.expand(batch, nheads, seqlen_q, seqlen_k)
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            visible = visible & attn_bias
        else:
            scores = scores + attn_bias.to(compute_dtype)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        # The sink is one more logit per row with no value vector: append it, softmax, drop it.
        sink_col = sink.to(compute_dtype)[None, :, None, None].expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    row_empty = ~torch.isfinite(scores).any(dim=-1, keepdim=True)
    lse = torch.logsumexp(scores.detach(), dim=-1)  # -inf on empty rows
    # An all -inf row would make softmax NaN (and its backward NaN): give it finite scores, then zero it.
    probs = torch.softmax(scores.masked_fill(row_empty, 0.0), dim=-1).masked_fill(row_empty, 0.0)
    if sink is not None:
        probs = probs[..., :-1]
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(compute_dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def cu_seqlens_of(lengths, device=None) -> torch.Tensor:
    """int32 ``(len(lengths) + 1,)`` offsets ``[0, l0, l0 + l1, ...]`` of packed sequences."""
    lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, alibi_slopes=None, dropout_p=0.0,
                         dropout_seed_offset=None, **kwargs):
    """:func:`attention_ref` of every packed sequence on its own, packed again.

    Args:
        q: ``(total_q, nheads, headdim)``; k: ``(total_k, nheads_kv, headdim)``; v: ``(total_k, nheads_kv, headdim_v)``.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` offsets; seqused_k: optional ``(batch,)`` keys used per sequence.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``.
        dropout_p, dropout_seed_offset: with ``dropout_p > 0``, the ``(seed, offset)`` of the call; sequence
            ``b`` uses the mask :mod:`flashtile.rng` draws for it (batch index ``b``, positions local to it).
        kwargs: the other arguments of :func:`attention_ref` (no ``attn_bias``).

    Returns:
        ``(out, lse)``: ``out`` ``(total_q, nheads, headdim_v)`` and ``lse`` ``(nheads, total_q)``
        in the computed dtype; rows past ``cu_seqlens_q[-1]`` have ``out`` 0 and ``lse`` ``-inf``
        (and so gradients 0). Differentiable like :func:`attention_ref`.
    """
    from . import rng

    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch, nheads = len(starts_q) - 1, q.shape[1]
    used = None if seqused_k is None else seqused_k.tolist()
    outs, lses = [], []
    for b in range(batch):
        q_b = q[starts_q[b] : starts_q[b + 1]]
        keys = starts_k[b + 1] - starts_k[b] if used is None else used[b]
        k_b, v_b = (t[starts_k[b] : starts_k[b] + keys] for t in (k, v))
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, nheads)[b : b + 1]
        mask = None
        if dropout_p > 0:
            seed, offset = dropout_seed_offset
            mask = rng.dropout_mask(seed, offset, b + 1, nheads, q_b.shape[0], keys, dropout_p, device=q.device)[b : b + 1]
        out, lse = attention_ref(q_b[None], k_b[None], v_b[None], alibi_slopes=slopes, dropout_p=dropout_p,
                                 dropout_mask=mask, **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    rest = q.shape[0] - starts_q[-1]  # rows that belong to no sequence
    dtype = reference_dtype(q.device) if kwargs.get("upcast", True) else q.dtype
    outs.append(torch.zeros(rest, nheads, v.shape[-1], dtype=dtype, device=q.device))
    lses.append(torch.full((nheads, rest), float("-inf"), dtype=dtype, device=q.device))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def reference_results(q, k, v, dout, hi=True, sink=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      **kwargs) -> dict:
    """The reference's ``out``, ``lse`` and gradients for upstream gradient ``dout``, the two sides of
    the tolerance rule: ``hi`` computes in float64 (float32 on CUDA for 16-bit inputs), else everything
    (q, k, v, sink, a float attn_bias) is cast to q's dtype first.

    Gradients: ``dq``, ``dk``, ``dv`` always, ``dsink`` when ``sink`` requires grad, ``dbias`` when a
    float ``attn_bias`` requires grad. With ``cu_seqlens_q`` / ``cu_seqlens_k`` it runs
    :func:`attention_varlen_ref` on packed tensors; other ``kwargs`` go to the reference as they are.
    """
    dtype = q.dtype
    if hi:
        dtype = torch.float64 if (q.device.type == "cpu" or q.dtype == torch.float32) else torch.float32
    names = ["q", "k", "v"]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if sink is not None:
        sink = sink.detach().to(dtype).requires_grad_(sink.requires_grad)
        if sink.requires_grad:
            names.append("sink")
            leaves.append(sink)
    if attn_bias is not None and attn_bias.dtype != torch.bool:
        attn_bias = attn_bias.detach().to(dtype).requires_grad_(attn_bias.requires_grad)
        if attn_bias.requires_grad:
            names.append("bias")
            leaves.append(attn_bias)
    with torch.enable_grad():
        if cu_seqlens_q is not None:
            out, lse = attention_varlen_ref(*leaves[:3], cu_seqlens_q, cu_seqlens_k, sink=sink, upcast=False, **kwargs)
        else:
            out, lse = attention_ref(*leaves[:3], sink=sink, attn_bias=attn_bias, upcast=False, **kwargs)
        grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    results = {"out": out, "lse": lse}
    results.update((f"d{name}", grad) for name, grad in zip(names, grads))
    return results


def assert_results_close(ours: dict, ref_hi: dict, ref_lo: dict, dtype) -> None:
    """:func:`assert_close_to_ref` on every entry of ``ref_hi`` (``out``, ``lse``, gradients), with the
    :data:`ATOL` of input dtype ``dtype``; ``ours`` must have the same keys."""
    if set(ours) != set(ref_hi):
        raise AssertionError(f"results {sorted(ours)} differ from the reference's {sorted(ref_hi)}")
    atol_out, atol_grad = ATOL[dtype]
    for name in ref_hi:
        assert_close_to_ref(name, ours[name], ref_hi[name], ref_lo[name], atol_out if name in ("out", "lse") else atol_grad)


# Whether a Hopper (sm_90) GPU is here: the Gluon kernels' tests run on it alone.
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# Whether this is scripts/gpu_tests.sh's run: tests that run on the CPU device whatever the machine (gloo
# collectives, CPU benchmark smoke runs) are CI's there.
GPU_SUITE = os.environ.get("FLASHTILE_GPU_SUITE") == "1"


def ran_backward(name: str) -> bool:
    """Whether a backward whose profiler name contains ``name`` has run (the kernel counter of flashtile.stats)."""
    import flashtile

    return any(kernel.startswith("flashtile.bwd[") and name in kernel for kernel in flashtile.stats()["kernels"])


def check_dense_16bit(generator, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype=torch.bfloat16, kernel=None,
                      dout=None, head_dim=128, head_dim_v=None, **options) -> dict:
    """Run :func:`flashtile.flash_attn_func` forward and backward on CUDA inputs, assert a backward named with
    ``kernel`` ran (unless None), hold out, lse and every gradient (the sink's too) to the tolerance rule against
    the float32 reference; returns ours. ``head_dim_v``: the values' head dim (None: ``head_dim``);
    ``deterministic`` goes to flashtile alone."""
    import flashtile

    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, "cuda", requires_grad=True,
                       generator=generator)
    if head_dim_v not in (None, head_dim):
        v = torch.randn(*v.shape[:3], head_dim_v, generator=generator).to("cuda", dtype).requires_grad_()
    if dout is None:
        dout = torch.randn(*q.shape[:3], v.shape[3], generator=generator).to("cuda", dtype)
    sink = options.get("sink")
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    leaves = (q, k, v) if sink is None else (q, k, v, sink)
    grads = torch.autograd.grad(out, leaves, dout)
    assert kernel is None or ran_backward(kernel), flashtile.stats()["kernels"]
    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv", "dsink"), grads))}
    options = {name: value for name, value in options.items() if name not in ("sink", "deterministic")}
    ref_hi = reference_results(q, k, v, dout, hi=True, sink=sink, **options)
    ref_lo = reference_results(q, k, v, dout, hi=False, sink=sink, **options)
    assert_results_close(ours, ref_hi, ref_lo, dtype)
    return ours


# Dense shapes for the Hopper backward kernels' tests, (batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal), and
# windows, (window_size, causal).
SM90_BWD_SHAPES = [
    (2, 1000, 1000, 4, 4, False),
    (1, 1037, 1037, 4, 2, True),  # the last key and query blocks partial
    (2, 700, 1290, 6, 2, True),  # more keys than queries: the diagonal moves right
    (1, 1290, 700, 4, 4, True),  # fewer: the first 590 rows see no key (lse -inf, P 0)
    (3, 40, 900, 4, 1, False),  # one query block for many key blocks, a group of 4
    (1, 300, 4100, 2, 2, False),  # a key block of 4 keys past 4096
]
SM90_BWD_SHAPE_IDS = ["full", "causal", "causal-more-keys", "causal-rows-see-none", "short-q", "partial-block"]
SM90_BWD_WINDOWS = [((300, 0), False), ((257, 33), False), ((0, 0), False), ((100, -1), False), ((500, 0), True)]
SM90_BWD_WINDOW_IDS = ["left-300", "two-sided", "diagonal-only", "left-only", "causal-left-500"]


# Packed-sequence lengths for the GPU kernels' tests: empty sequences, one row, a tile's width and one either side,
# and long ones, so that a key block past a sequence's end holds the next one's keys and a query block its queries.
PACKED_LENGTHS_Q = [300, 0, 1, 1000, 63, 64, 65, 1500]
PACKED_LENGTHS_K = [300, 7, 130, 1000, 0, 200, 65, 1400]
PACKED_LENGTHS = (PACKED_LENGTHS_Q, PACKED_LENGTHS_K)
# seqused_k for those lengths: some keys of most sequences left out, none of one, all of another.
PACKED_SEQUSED_K = [299, 0, 1, 1000, 0, 77, 65, 1337]


def check_packed(generator, lengths_q, lengths_k, nheads, nheads_kv, dtype, head_dims=(128, 128), seqused_k=None,
                 sink=None, device="cuda", deterministic=False, **options) -> dict:
    """Run :func:`flashtile.flash_attn_varlen_func` forward and backward on packed sequences of these lengths
    and hold every result to the tolerance rule; returns ours. ``deterministic`` goes to flashtile alone.

    Five rows past ``cu_seqlens[-1]`` hold NaN (and infinite values), and so do the keys ``seqused_k`` (a list)
    leaves out: a tile that reads them must hide them. out and lse are compared on the sequences' rows, the
    gradients on all (0 past the end).
    """
    import flashtile

    cu_q, cu_k = cu_seqlens_of(lengths_q, device), cu_seqlens_of(lengths_k, device)
    end_q, end_k = sum(lengths_q), sum(lengths_k)
    q, k, v = (torch.randn(end + 5, heads, dim, generator=generator).to(device, dtype)
               for end, heads, dim in ((end_q, nheads, head_dims[0]), (end_k, nheads_kv, head_dims[0]),
                                       (end_k, nheads_kv, head_dims[1])))
    unused = [slice(end_k, None)]
    if seqused_k is not None:
        unused += [slice(start + used, end) for start, used, end in zip(cu_k[:-1].tolist(), seqused_k, cu_k[1:].tolist())]
        seqused_k = torch.tensor(seqused_k, dtype=torch.int32, device=device)
    q[end_q:] = float("nan")
    for rows in unused:
        k[rows], v[rows] = float("nan"), float("inf")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn(end_q + 5, nheads, head_dims[1], generator=generator).to(device, dtype)
    if sink is not None:
        options["sink"] = sink
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   seqused_k=seqused_k, deterministic=deterministic,
                                                   return_attn_probs=True, **options)
    leaves = (q, k, v) if sink is None else (q, k, v, sink)
    grads = torch.autograd.grad(out, leaves, dout)
    ours = {"out": out[:end_q], "lse": lse[:, :end_q], **dict(zip(("dq", "dk", "dv", "dsink"), grads))}
    refs = [reference_results(q, k, v, dout, hi=hi, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k,
                              **options) for hi in (True, False)]
    for ref in refs:
        ref["out"], ref["lse"] = ref["out"][:end_q], ref["lse"][:, :end_q]
    assert_results_close(ours, *refs, dtype)
    return ours


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


def run_cli(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``python -m flashtile *argv`` run in-process, with pytest's
    ``capsys`` fixture capturing its output."""
    from .cli import main

    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err
