"""The benchmark refuses a wrong kernel: before a provider is timed on a shape, its output, its LSE
(where it returns one) and its gradients dQ, dK, dV are checked against the reference at that shape,
under the project's tolerance rule (:func:`flashtile.testing.assert_close_to_ref`: error at most twice
the error of the same computation done by PyTorch in the input dtype, plus :data:`testing.ATOL`). A
provider that fails is an ``invalid`` cell, never a speed.

The reference (:func:`flashtile.testing.reference_results`, float32 on CUDA, float64 on CPU) runs one
query head at a time over every query head that reads the first ``kv_heads`` KV heads, so dK and dV
are complete for those KV heads, and in query-row chunks on long rows, so its memory stays near
:data:`CHUNK_BYTES` of scores whatever the length.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..testing import ATOL, assert_close_to_ref, max_abs_error, reference_results

KV_HEADS = 1  # the dense check covers the query heads of the first KV head (all heads of one GQA group)
CHUNK_BYTES = 2**28  # query rows per reference chunk: their float32 scores stay near this
# Features whose mask or bias depends on the query's absolute row: without causal, the reference runs whole rows.
ROW_BOUND = ("alibi_slopes", "window_size", "attn_bias")


class Reference(NamedTuple):
    """Both sides of the tolerance rule on the checked heads: ``hi`` (upcast) and ``lo`` (input dtype),
    each ``{"out", "lse", "dq", "dk", "dv"}``, bshd layout (``lse`` ``(batch, heads, seqlen)``)."""

    hi: dict
    lo: dict
    heads: int  # query heads checked: 0 .. heads - 1
    kv_heads: int  # KV heads checked (their dK, dV complete)
    dtype: torch.dtype


def _head_features(features: dict, h: int) -> dict:
    """The reference's keyword arguments for query head ``h`` alone (per-head tensors sliced, detached)."""
    out = dict(features)
    for name in ("alibi_slopes", "sink"):
        if out.get(name) is not None:
            out[name] = out[name].detach()[..., h : h + 1]
    if out.get("attn_bias") is not None:
        bias = out["attn_bias"].detach()
        out["attn_bias"] = bias[:, h : h + 1] if bias.shape[1] > 1 else bias
    return out


def _row_chunks(batch: int, seqlen_q: int, seqlen_k: int, features: dict) -> list[tuple[int, int]]:
    """Query-row ranges whose float32 scores fit :data:`CHUNK_BYTES`; one range where the lengths differ or,
    without causal (whose chunks keep each row's distance to every key), a feature depends on the absolute row."""
    row_bound = not features.get("causal") and any(features.get(name) is not None for name in ROW_BOUND)
    if seqlen_q != seqlen_k or row_bound:
        return [(0, seqlen_q)]
    rows = max(1, CHUNK_BYTES // (4 * batch * seqlen_k))
    return [(r, min(r + rows, seqlen_q)) for r in range(0, seqlen_q, rows)]


def _one_head(q, k, v, dout, features: dict, hi: bool) -> dict:
    """out, lse, dq, dk, dv of one query head (``(batch, seqlen, 1, d)`` tensors), row chunk by row chunk:
    a causal chunk of rows ``[r0, r1)`` sees keys ``[0, r1)``, whose bottom-right alignment is the square's."""
    causal = features.get("causal", False)
    parts = []
    bias = features.get("attn_bias")
    for r0, r1 in _row_chunks(q.shape[0], q.shape[1], k.shape[1], features):
        keys = slice(0, r1) if causal else slice(None)
        chunk = features if bias is None else {**features, "attn_bias": bias[..., r0:r1, keys]}
        parts.append((keys, reference_results(q[:, r0:r1], k[:, keys], v[:, keys], dout[:, r0:r1], hi=hi, **chunk)))
    results = {name: torch.cat([p[name] for _, p in parts], dim=2 if name == "lse" else 1) for name in ("out", "lse", "dq")}
    for name in ("dk", "dv"):
        first = parts[0][1][name]  # chunks add up in float64: the sum adds no rounding of its own
        total = first.new_zeros((k.shape[0], k.shape[1], 1, first.shape[-1]), dtype=torch.float64)
        for keys, p in parts:
            total[:, keys] += p[name]
        results[name] = total
    return results


def reference(q, k, v, dout, kv_heads: int = KV_HEADS, **features) -> Reference:
    """The :class:`Reference` of q ``(batch, seqlen_q, nheads, d)``, k ``(batch, seqlen_k, nheads_kv, d)``,
    v ``(..., dv)``, dout ``(batch, seqlen_q, nheads, dv)`` on the query heads of the first ``kv_heads``
    KV heads; ``features`` are :func:`flashtile.testing.attention_ref`'s keyword arguments (causal,
    window_size, softcap, alibi_slopes, sink, attn_bias), per-head tensors covering every head."""
    q, k, v, dout = (x.detach() for x in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kv_heads = min(kv_heads, k.shape[2])
    sides = {}
    for hi in (True, False):
        heads = []
        for h in range(kv_heads * group):
            kv = slice(h // group, h // group + 1)
            heads.append(_one_head(q[:, :, h : h + 1], k[:, :, kv], v[:, :, kv], dout[:, :, h : h + 1],
                                   _head_features(features, h), hi))
        side = {name: torch.cat([r[name] for r in heads], dim=1 if name == "lse" else 2) for name in ("out", "lse", "dq")}
        for name in ("dk", "dv"):  # each KV head's gradient sums over its query-head group
            side[name] = torch.cat([torch.stack([r[name].double() for r in heads[g * group : (g + 1) * group]]).sum(0)
                                    for g in range(kv_heads)], dim=2)
        sides["hi" if hi else "lo"] = side
    return Reference(sides["hi"], sides["lo"], kv_heads * group, kv_heads, q.dtype)


def output_reference(q, k, v, heads: int, **features) -> Reference:
    """The output alone (no backward: decode, forward-only runs) of the first ``heads`` query heads, each
    with its KV head: ``{"out"}`` on both sides of the tolerance rule."""
    from ..testing import attention_ref

    group = q.shape[2] // k.shape[2]
    heads = min(heads, q.shape[2])
    q, k, v = (x.detach() for x in (q, k, v))
    kv = slice(0, (heads - 1) // group + 1)
    with torch.no_grad():
        hi, lo = ({"out": attention_ref(q[:, :, :heads], k[:, :, kv], v[:, :, kv], upcast=upcast, **features)[0]}
                  for upcast in (True, False))
    return Reference(hi, lo, heads, kv.stop, q.dtype)


def packed_reference(q, k, v, dout, cu_seqlens, kv_heads: int = KV_HEADS, **features) -> Reference:
    """The :class:`Reference` of packed sequences (q ``(total, nheads, d)``..., ``cu_seqlens`` their offsets),
    each sequence a batch of one, joined along the rows: ``(1, total, heads, d)``, lse ``(1, heads, total)``."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    parts = [reference(q[None, s:e], k[None, s:e], v[None, s:e], dout[None, s:e], kv_heads, **features)
             for s, e in zip(cu[:-1], cu[1:])]
    join = lambda side: {name: torch.cat([getattr(p, side)[name] for p in parts], dim=2 if name == "lse" else 1)  # noqa: E731
                         for name in parts[0].hi}
    return Reference(join("hi"), join("lo"), parts[0].heads, parts[0].kv_heads, parts[0].dtype)


def provider_results(p, backward: bool, layout=None) -> dict:
    """One call of provider ``p`` (:class:`~flashtile.bench.providers.Provider`) in bshd layout: ``out``,
    ``lse`` when ``p.with_lse`` gives it, and with ``backward`` the gradients of its first three leaves.
    ``layout`` maps the provider's own layout to the reference's (packed or padded rows; LSE not compared)."""
    for t in p.leaves:
        t.grad = None
    lse = None
    if p.with_lse is not None and layout is None:
        out, lse = p.with_lse()
    else:
        out = p.fwd()
    own = lambda t: layout(t) if layout is not None else t.transpose(1, 2) if p.heads_first else t  # noqa: E731
    results = {"out": own(out)}
    if lse is not None:
        results["lse"] = lse
    if backward:
        out.backward(p.dout)
        for name, leaf in zip(("dq", "dk", "dv"), p.leaves[:3]):
            results[name] = own(leaf.grad)
    for t in p.leaves:
        t.grad = None
    return {name: t.detach() for name, t in results.items()}


def verdict(ours: dict, ref: Reference) -> dict:
    """Fields for a result row: ``check`` ``{name: {"err", "bound"}}`` of each compared result, ``max_abs_err``
    (the output's), and ``invalid`` (``"dk: err 2.7e+00 > bound 3.1e-02"``) when one breaks the rule."""
    atol_out, atol_grad = ATOL.get(ref.dtype, ATOL[torch.float32])
    fields: dict = {"check": {}, "ref_heads": ref.heads}
    failures = []
    for name, value in ours.items():
        width = ref.kv_heads if name in ("dk", "dv") else ref.heads
        got = value[:, :width] if name == "lse" else value[:, :, :width]
        hi, lo = ref.hi[name], ref.lo[name]
        atol = atol_out if name in ("out", "lse") else atol_grad
        finite = torch.isfinite(hi)
        err = max_abs_error(got, hi) if got.shape == hi.shape else float("inf")
        bound = 2 * max_abs_error(lo, hi) + atol
        fields["check"][name] = {"err": err, "bound": bound}
        try:
            if not finite.all() or got.shape != hi.shape:
                assert_close_to_ref(name, got, hi, lo, atol)
            elif not err <= bound:
                raise AssertionError(f"{name}: err {err:.1e} > bound {bound:.1e}")
        except AssertionError as exc:
            failures.append((err, str(exc).split(" (")[0]))
    fields["max_abs_err"] = fields["check"].get("out", {}).get("err")
    if failures:
        fields["invalid"] = "; ".join(text for _, text in failures)
        fields["invalid_err"] = max(err for err, _ in failures)
    return fields


def check(p, ref: Optional[Reference], backward: bool, layout=None) -> dict:
    """:func:`verdict` of provider ``p`` against ``ref`` (nothing when ``ref`` is None)."""
    if ref is None:
        return {}
    return verdict(provider_results(p, backward, layout), ref)
