"""The attention variants against their plain counterparts and the peers, in one run, with the
issue's performance criteria checked at the end.

Groups (``--groups``), bf16, headdim 128, 16 heads:

- ``window``: ``flash_attn_func(causal=True, window_size=(1024, 0))`` against full causal
  ``flash_attn_func(causal=True)`` at batch 1, seqlen 4096 / 8192 / 16384; peers FlexAttention
  with a sliding-window block mask and its own full causal (its ratio in the same run), and SDPA flash
  (full causal). Criterion: window >= 8x faster
  than full causal at the longest seqlen.
- ``varlen_equal`` / ``varlen_mixed``: ``flash_attn_varlen_func`` on packed ``(total, H, D)``
  tensors against dense ``flash_attn_func`` on the batch padded to the longest sequence; peer SDPA
  flash on the same padded batch. Equal: 16 x 2048, varlen within 10% of dense. Mixed: 16 lengths
  drawn uniformly from 128..4096 (seed 0); varlen time at most 1.1x the token-proportional ideal
  ``(1 - padding fraction) * padded time``.
- ``mods``: ``softcap=50``, ``alibi_slopes`` and ``sink`` against plain ``flash_attn_func`` at
  seqlen 4096 / 8192 (batch * seqlen = 16384), causal and not; peers Flex with a score_mod
  (seqlen 8192 only: each is a compile) and SDPA efficient / cuDNN with an ALiBi float mask.
  Criterion: at most 15% overhead.
- ``bias``: ``attn_bias`` ``(1, H, S, S)`` bf16 against SDPA efficient with the same mask, at
  seqlen 2048 / 4096, without and with a bias gradient; reported, no bar.

FlashAttention-4 (``fa4``: ``flash_attn.cute``, marked ``n/a`` when not installed) runs its own window,
varlen, plain, softcap and sink (``learnable_sink``) rows beside flashtile's.

Not measured: Flex with a document mask for varlen, and a Flex peer for the sink (an extra logit in
the denominator is not a score_mod). Flex cases stop after ``FLEX_BUDGET_S`` seconds spent in them
(compiles included); the rest are marked ``skip``.

Measurement is :mod:`flashtile.bench.gpu`'s: the providers of :mod:`flashtile.bench.providers` for
the plain rows, its timer (median and spread of CUDA-event times), its backward timing, its
environment. After each shape, every flashtile row a bar compares with another flashtile row
(softcap/ALiBi/sink with plain, window with causal, varlen with padded) is timed again in
alternation with it, ``PAIRED_ROUNDS`` rounds, and the bar is judged on the median of the rounds'
ratios (``paired_fwd`` / ``paired_bwd`` in its row), which the clock's drift over the run cancels out
of; the tables show both ratios. ``--device cpu`` (or no GPU) runs a smoke version: tiny shapes, flashtile on its torch
backend, wall-clock medians, Flex eager and forward only. The benchmark suite
(:mod:`flashtile.bench.suite`) runs a subset of these cases through :func:`run_cases`.

Run: ``python -m flashtile bench --suite variants`` or ``python -m flashtile.bench.variants``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from typing import Callable, NamedTuple, Optional

import torch

from . import common, gpu, providers, validate

PROVIDERS = ("flashtile", "fa4", "flash", "efficient", "cudnn", "flex")
GROUP_NAMES = ("window", "varlen_equal", "varlen_mixed", "mods", "bias")
# Flex compiles one kernel pair per case; past this much time spent in Flex cases the rest are skipped.
FLEX_BUDGET_S = 150.0
# Rows a bar compares are also timed in alternation, this many rounds (see run_cases). Measured one after
# the other, two medians can differ by 10% with no change in the kernels: the GPU's clock drifts over
# seconds (a backward holds it at its power cap), and a row's p10 can sit 10% under its median. The
# ratio within each round of alternating pairs cancels the drift; the bars are judged on it.
PAIRED_ROUNDS = 6

FLOP_MODEL = (
    "effective FLOPs on visible pairs: fwd = 4 * H * D * sum over sequences of the (query, key) pairs "
    "the mask leaves visible (S*(S+1)/2 causal, S*S full, sum_i min(i, W)+1 for window (W, 0)); "
    "bwd = 2.5x fwd. Padded dense rows of the varlen groups are credited with the real sequences' "
    "pairs only, so their TFLOP/s are what the padding leaves useful."
)

NOTE = (
    "triton.testing.do_bench(warmup=25, rep=100, return_mode='all'): median (and p10/p90) of CUDA-event "
    "times; backward timed as in the sweep "
    "(flashtile.bench.gpu: out.backward(dout, retain_graph=True) alone, else fwd+bwd minus fwd; bwd_method). "
    "flex = torch.compile(flex_attention, dynamic=False), torch._dynamo.reset() per case, block mask "
    "built and compile excluded. SDPA rows on (B, H, S, D) contiguous copies under sdpa_kernel(<backend>); "
    "the ALiBi mask for SDPA is bf16 (1, H, S, S) with -inf above the diagonal when causal, so its error "
    "includes the mask's bf16 rounding (its reference adds that very mask). Before timing, each row's out, dq, dk, "
    "dv are checked on the first ref_heads heads against flashtile.testing.reference_results in fp32 (error <= 2x "
    "the same-dtype PyTorch computation's + atol; a failure is 'invalid', never timed); padded non-causal rows are "
    "not checked (the padding keys are visible to them). "
    + FLOP_MODEL
)


class Sizes(NamedTuple):
    """Every shape of a run; ``DEFAULT`` is the issue's, ``QUICK`` and ``SMOKE`` are smaller."""

    headdim: int = 128
    nheads: int = 16
    tokens: int = 16384  # batch * seqlen of the mods and bias groups
    window: int = 1024
    window_seqlens: tuple = (4096, 8192, 16384)
    varlen_count: int = 16
    varlen_equal_len: int = 2048
    varlen_range: tuple = (128, 4096)
    mod_seqlens: tuple = (4096, 8192)
    flex_mod_seqlens: tuple = (8192,)
    bias_seqlens: tuple = (2048, 4096)
    softcap: float = 50.0
    ref_heads: int = 2


DEFAULT = Sizes()
QUICK = Sizes(window_seqlens=(16384,), mod_seqlens=(8192,), bias_seqlens=(4096,))
SMOKE = Sizes(headdim=32, nheads=2, tokens=256, window=32, window_seqlens=(128, 256), varlen_count=3,
              varlen_equal_len=64, varlen_range=(16, 128), mod_seqlens=(128,), flex_mod_seqlens=(128,),
              bias_seqlens=(128,), ref_heads=2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: a provider running one variant on one shape (``N`` is the longest sequence)."""

    group: str
    prov: str
    variant: str  # window, causal, plain, softcap, alibi, sink, bias, bias_grad, varlen, padded
    N: int
    B: int
    H: int
    D: int
    causal: bool
    window: Optional[int] = None
    softcap: Optional[float] = None
    seqlens: Optional[tuple] = None  # varlen groups: the sequence lengths

    def key(self) -> dict:
        row = {"group": self.group, "prov": self.prov, "variant": self.variant, "N": self.N, "B": self.B,
               "H": self.H, "D": self.D, "causal": self.causal}
        if self.window is not None:
            row["window"] = [self.window, 0]
        if self.softcap is not None:
            row["softcap"] = self.softcap
        if self.seqlens is not None:
            row["seqlens"] = list(self.seqlens)
            row["pad_frac"] = padding_fraction(self.seqlens)
        row["visible_pairs"] = visible_pairs_of(self)
        return row

    def block(self) -> tuple:
        """Cases with the same block share their inputs (and references)."""
        return (self.group, self.N, self.B, self.causal, self.seqlens)


# ---------------------------------------------------------------- shapes and FLOPs (pure)


def mixed_seqlens(count: int, low: int, high: int, seed: int = 0) -> tuple:
    """``count`` lengths drawn uniformly from ``low..high`` (inclusive) with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(low, high + 1, (count,), generator=gen).tolist())


def padding_fraction(seqlens) -> float:
    """Share of a batch padded to the longest sequence that is padding."""
    return 1.0 - sum(seqlens) / (len(seqlens) * max(seqlens))


def visible_pairs(seqlen: int, causal: bool, window_left: Optional[int] = None) -> int:
    """(query, key) pairs a square ``seqlen x seqlen`` mask leaves visible, for one (batch, head)."""
    if window_left is None or window_left < 0:
        return seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    # Causal window (W, 0): row i sees min(i, W) + 1 keys.
    full = min(seqlen, window_left + 1)
    return full * (full + 1) // 2 + (seqlen - full) * (window_left + 1)


def visible_pairs_of(case: Case) -> int:
    """Visible pairs summed over the batch; padded rows count only the real sequences."""
    if case.seqlens is not None:
        return sum(visible_pairs(n, case.causal) for n in case.seqlens)
    return case.B * visible_pairs(case.N, case.causal, case.window)


def fwd_flops(case: Case) -> float:
    return 4.0 * case.H * case.D * visible_pairs_of(case)


def build_cases(sizes: Sizes = DEFAULT, groups=GROUP_NAMES, providers=PROVIDERS) -> list[Case]:
    """Every row of a run, in the order it runs (cases of one block together)."""
    H, D = sizes.nheads, sizes.headdim
    cases: list[Case] = []
    add = lambda *a, **kw: cases.append(Case(*a, H=H, D=D, **kw))  # noqa: E731
    if "window" in groups:
        for n in sizes.window_seqlens:
            add("window", "flashtile", "window", n, 1, causal=True, window=sizes.window)
            add("window", "flashtile", "causal", n, 1, causal=True)
            add("window", "fa4", "window", n, 1, causal=True, window=sizes.window)
            add("window", "fa4", "causal", n, 1, causal=True)
            add("window", "flex", "window", n, 1, causal=True, window=sizes.window)
            add("window", "flex", "causal", n, 1, causal=True)
            add("window", "flash", "causal", n, 1, causal=True)
    varlen = {"varlen_equal": (sizes.varlen_equal_len,) * sizes.varlen_count,
              "varlen_mixed": mixed_seqlens(sizes.varlen_count, *sizes.varlen_range)}
    for group, lengths in varlen.items():
        if group in groups:
            for causal in (False, True):
                for prov, variant in (("flashtile", "varlen"), ("flashtile", "padded"), ("fa4", "varlen"),
                                      ("flash", "padded")):
                    add(group, prov, variant, max(lengths), len(lengths), causal=causal, seqlens=lengths)
    if "mods" in groups:
        for n in sizes.mod_seqlens:
            batch = max(1, sizes.tokens // n)
            for causal in (False, True):
                add("mods", "flashtile", "plain", n, batch, causal=causal)
                add("mods", "flashtile", "softcap", n, batch, causal=causal, softcap=sizes.softcap)
                add("mods", "flashtile", "alibi", n, batch, causal=causal)
                add("mods", "flashtile", "sink", n, batch, causal=causal)
                add("mods", "fa4", "plain", n, batch, causal=causal)
                add("mods", "fa4", "softcap", n, batch, causal=causal, softcap=sizes.softcap)
                add("mods", "fa4", "sink", n, batch, causal=causal)
                if n in sizes.flex_mod_seqlens:
                    add("mods", "flex", "softcap", n, batch, causal=causal, softcap=sizes.softcap)
                    add("mods", "flex", "alibi", n, batch, causal=causal)
                add("mods", "efficient", "alibi", n, batch, causal=causal)
                add("mods", "cudnn", "alibi", n, batch, causal=causal)
    if "bias" in groups:
        for n in sizes.bias_seqlens:
            batch = max(1, sizes.tokens // n)
            add("bias", "flashtile", "plain", n, batch, causal=False)
            for variant in ("bias", "bias_grad"):
                add("bias", "flashtile", variant, n, batch, causal=False)
                add("bias", "efficient", variant, n, batch, causal=False)
    return [c for c in cases if c.prov in providers]


# ---------------------------------------------------------------- inputs and references


def alibi_slopes(nheads: int, device=None) -> torch.Tensor:
    """The ALiBi paper's slopes ``2 ** (-8 (h + 1) / nheads)``, float32 ``(nheads,)``."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], dtype=torch.float32, device=device)


def make_block_inputs(case: Case, dtype, device) -> dict:
    """Inputs shared by the cases of ``case``'s block: gpu.py's dense layout (``bshd``, ``bhsd``,
    ``dout_*``; the padded batch in the varlen groups) plus the packed tensors and the variants' extras."""
    H, D = case.H, case.D
    if case.seqlens is None:
        inputs = providers.make_inputs(case.B, case.N, H, H, D, D, dtype, device)
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        total = sum(case.seqlens)
        q, k, v, dout = (torch.randn((total, H, D), generator=gen, device=device, dtype=dtype) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        padded = [_pad(x, case.seqlens, cu) for x in (q, k, v, dout)]
        inputs = {
            "bshd": [x.requires_grad_() for x in padded[:3]],
            "bhsd": [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in padded[:3]],  # leaves too
            "dout_bshd": padded[3],
            "dout_bhsd": padded[3].transpose(1, 2).contiguous(),
            "packed": [x.requires_grad_() for x in (q, k, v)],
            "dout_packed": dout,
            "cu_seqlens": cu,
            "max_seqlen": max(case.seqlens),
        }
    gen = torch.Generator(device=device).manual_seed(1)
    inputs["slopes"] = alibi_slopes(H, device)
    inputs["sink"] = torch.randn((H,), generator=gen, device=device, dtype=torch.float32).requires_grad_()
    if case.group == "bias":
        inputs["bias"] = torch.randn((1, H, case.N, case.N), generator=gen, device=device, dtype=dtype)
        inputs["bias_grad"] = inputs["bias"].clone().requires_grad_()
    inputs["refs"] = {}
    return inputs


def _pad(packed, seqlens, cu):
    """``(total, H, D)`` -> ``(batch, max_seqlen, H, D)``, zeros after each sequence."""
    out = packed.new_zeros((len(seqlens), max(seqlens), *packed.shape[1:]))
    for b, n in enumerate(seqlens):
        out[b, :n] = packed[int(cu[b]) : int(cu[b]) + n]
    return out


def _unpad(padded, seqlens):
    return torch.cat([padded[b, :n] for b, n in enumerate(seqlens)])


def features(case: Case, inputs: dict) -> dict:
    """The variant's keyword arguments of ``flash_attn_func`` (and of ``attention_ref``)."""
    kwargs = {"causal": case.causal}
    if case.window is not None:
        kwargs["window_size"] = (case.window, 0)
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
    if case.variant == "alibi":
        kwargs["alibi_slopes"] = inputs["slopes"]
    if case.variant == "sink":
        kwargs["sink"] = inputs["sink"]
    if case.variant in ("bias", "bias_grad"):
        kwargs["attn_bias"] = inputs[case.variant]
    return kwargs


def reference(case: Case, inputs: dict, heads: int) -> validate.Reference:
    """The :class:`validate.Reference` of a case's block and variant on its first ``heads`` heads (out and the
    gradients, both sides of the tolerance rule): dense ``(B, S, heads, D)``, packed sequences joined along
    the rows ``(1, total, heads, D)``. Cached per block."""
    ref_key = {"causal": "plain", "padded": "varlen", "bias_grad": "bias"}.get(case.variant, case.variant)
    kwargs = features(case, inputs)
    if case.variant == "alibi" and case.prov in providers.SDPA_BACKENDS:  # SDPA computes with its bf16 mask
        ref_key, kwargs = "alibi_mask", {"causal": case.causal, "attn_bias": inputs["alibi_mask"]}
    if ref_key in inputs["refs"]:
        return inputs["refs"][ref_key]
    if case.seqlens is None:
        q, k, v = inputs["bshd"]
        ref = validate.reference(q, k, v, inputs["dout_bshd"], kv_heads=heads, **kwargs)
    else:
        q, k, v = inputs["packed"]
        ref = validate.packed_reference(q, k, v, inputs["dout_packed"], inputs["cu_seqlens"], kv_heads=heads, **kwargs)
    inputs["refs"][ref_key] = ref
    return ref


def _layout(case: Case, heads_first: bool) -> Optional[Callable]:
    """How a provider's outputs map onto the reference's rows: packed and padded rows joined ``(1, total, H, D)``."""
    if case.variant == "varlen":
        return lambda t: t.unsqueeze(0)
    if case.variant == "padded":
        return lambda t: _unpad(t.transpose(1, 2) if heads_first else t, case.seqlens).unsqueeze(0)
    return None


def _checkable(case: Case) -> bool:
    """False where the reference is another function: non-causal dense attention over padding sees the padding keys."""
    return not (case.variant == "padded" and not case.causal and len(set(case.seqlens)) > 1)


# ---------------------------------------------------------------- providers


def _dense_shape(case: Case, inputs: dict) -> providers.DenseShape:
    """The plain dense shape of a case (for the dense providers of :mod:`providers`)."""
    dtype = next(name for name, d in common.DTYPES.items() if d == inputs["bshd"][0].dtype)
    return providers.DenseShape(case.B, case.N, case.H, case.H, case.D, case.D, case.causal, dtype)


def _flashtile(case: Case, inputs: dict) -> providers.Provider:
    import flashtile

    if case.variant in ("causal", "plain", "padded"):
        return providers.BUILDERS["flashtile"](inputs, _dense_shape(case, inputs))
    if case.variant == "varlen":
        q, k, v = inputs["packed"]
        cu, max_seqlen = inputs["cu_seqlens"], inputs["max_seqlen"]
        varlen_func = flashtile.flash_attn_varlen_func  # AttributeError until it exists: a marked cell
        fwd = lambda: varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=case.causal)  # noqa: E731
        return providers.Provider(fwd, (q, k, v), inputs["dout_packed"], contextlib.nullcontext(), heads_first=False)
    q, k, v = inputs["bshd"]
    kwargs = features(case, inputs)
    grads = tuple(t for t in kwargs.values() if isinstance(t, torch.Tensor) and t.requires_grad)
    fwd = lambda: flashtile.flash_attn_func(q, k, v, **kwargs)  # noqa: E731
    return providers.Provider(fwd, (q, k, v, *grads), inputs["dout_bshd"], contextlib.nullcontext(),
                              heads_first=False)


def alibi_mask(slopes, seqlen: int, causal: bool, dtype) -> torch.Tensor:
    """``(1, H, S, S)`` float mask ``-slope[h] * |i - j|``, ``-inf`` above the diagonal when causal."""
    idx = torch.arange(seqlen, device=slopes.device)
    distance = (idx[:, None] - idx[None, :]).abs().float()
    mask = torch.empty((1, slopes.shape[0], seqlen, seqlen), dtype=dtype, device=slopes.device)
    for h in range(slopes.shape[0]):  # one head at a time: the fp32 (S, S) temporaries stay small
        mask[0, h] = -slopes[h] * distance
        if causal:
            mask[0, h].masked_fill_(idx[None, :] > idx[:, None], float("-inf"))
    return mask


def _sdpa_masked(case: Case, inputs: dict) -> providers.Provider:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if case.variant in ("causal", "padded"):
        return providers.BUILDERS[case.prov](inputs, _dense_shape(case, inputs))
    qt, kt, vt = inputs["bhsd"]
    if case.variant == "alibi":
        if "alibi_mask" not in inputs:  # one per block: the reference checks SDPA against this very mask
            inputs["alibi_mask"] = alibi_mask(inputs["slopes"], case.N, case.causal, qt.dtype)
        mask = inputs["alibi_mask"]
    else:
        mask = inputs["bias"] if case.variant == "bias" else inputs["bias_grad"]
    backend = providers.SDPA_BACKENDS[case.prov]
    fwd = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)  # noqa: E731
    leaves = (qt, kt, vt, mask) if mask.requires_grad else (qt, kt, vt)
    return providers.Provider(fwd, leaves, inputs["dout_bhsd"], sdpa_kernel(getattr(SDPBackend, backend)),
                              heads_first=True)


def _flex(case: Case, inputs: dict) -> providers.Provider:
    """FlexAttention as in providers.py (fresh compile per case, donated buffers off), with the variant's
    block mask and score_mod; eager and forward-only on CPU (Flex has no CPU backward)."""
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = inputs["bhsd"]
    mask_mod = score_mod = None
    if case.window is not None:
        window = case.window
        mask_mod = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= window) & (q_idx >= kv_idx)  # noqa: E731
    elif case.causal:
        mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    if case.variant == "softcap":
        cap = case.softcap
        score_mod = lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)  # noqa: E731
    elif case.variant == "alibi":
        slopes = inputs["slopes"]
        score_mod = lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs()  # noqa: E731
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=case.N, KV_LEN=case.N, device=qt.device)
    if qt.device.type == "cuda":
        torch._dynamo.reset()  # a fresh compile per case: no recompile limit, no stale guards
        attend = torch.compile(flex_attention, dynamic=False)
    else:
        attend = flex_attention
        qt, kt, vt = (x.detach() for x in (qt, kt, vt))  # Flex refuses CPU inputs that require grad
    fwd = lambda: attend(qt, kt, vt, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    scope = torch._functorch.config.patch(donated_buffer=False)
    return providers.Provider(fwd, (qt, kt, vt), inputs["dout_bhsd"], scope, heads_first=True)


def _fa4(case: Case, inputs: dict) -> providers.Provider:
    """FlashAttention-4 (``flash_attn.cute``) with the variant's own arguments; it returns ``(out, lse)``."""
    cute = providers.fa4_module()
    if case.variant in ("causal", "plain"):
        return providers.BUILDERS["fa4"](inputs, _dense_shape(case, inputs))
    if case.variant not in ("window", "softcap", "sink", "varlen"):
        raise common.Unsupported(f"fa4: the suite does not run its {case.variant} rows")
    kwargs = {"causal": case.causal, "softcap": case.softcap or 0.0}
    if case.window is not None:
        kwargs["window_size"] = (case.window, 0)
    extra = ()
    if case.variant == "sink":
        kwargs["learnable_sink"] = inputs["sink"]
        extra = (inputs["sink"],)
    if case.variant == "varlen":
        q, k, v = inputs["packed"]
        cu, longest = inputs["cu_seqlens"], inputs["max_seqlen"]
        fwd = lambda: cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,  # noqa: E731
                                                  max_seqlen_k=longest, **kwargs)[0]
        return providers.Provider(fwd, (q, k, v), inputs["dout_packed"], contextlib.nullcontext(), heads_first=False)
    q, k, v = inputs["bshd"]
    fwd = lambda: cute.flash_attn_func(q, k, v, **kwargs)[0]  # noqa: E731
    with_lse = lambda: cute.flash_attn_func(q, k, v, return_lse=True, **kwargs)[:2]  # noqa: E731
    return providers.Provider(fwd, (q, k, v, *extra), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False,
                              with_lse=with_lse)


BUILDERS = {"flashtile": _flashtile, "fa4": _fa4, "flash": _sdpa_masked, "efficient": _sdpa_masked, "cudnn": _sdpa_masked,
            "flex": _flex}


# ---------------------------------------------------------------- measuring


def measure(case: Case, inputs: dict, timer, ref_heads: Optional[int], profile: bool = False) -> dict:
    """One case: its row, with times (median and spread), effective TFLOP/s and the reference error, and
    with ``profile`` the kernels that ran; failures become text."""
    row = case.key()
    flops = fwd_flops(case)
    try:
        p = BUILDERS[case.prov](case, inputs)
    except Exception as exc:  # noqa: BLE001 - an unavailable provider or feature is a marked cell
        row["fwd_err"] = common.describe_error(exc)
        return row
    check = ref_heads is not None and _checkable(case)
    if ref_heads is not None and not check:
        row["check_skipped"] = "padded, not causal: the padding keys are visible, a different function"
    with p.scope:
        out = None
        try:
            start = time.perf_counter()
            out = p.fwd()  # the first call compiles (Triton, inductor): excluded from the timings
            _synchronize(out)
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            out = None
            if check:
                backward = all(t.requires_grad for t in p.leaves[:3])  # Flex on CPU runs forward only
                try:
                    row.update(validate.check(p, reference(case, inputs, ref_heads), backward,
                                              _layout(case, p.heads_first)))
                except Exception as exc:  # noqa: BLE001 - a check that cannot run is no pass
                    row["invalid"] = f"check failed: {common.describe_error(exc)}"
            if not row.get("invalid"):
                row.update(common.timing_fields("fwd", timer(p.fwd)))
                row["fwd_tflops"] = common.tflops(flops, row["fwd_ms"])
                out = p.fwd()
        except Exception as exc:  # noqa: BLE001
            row["fwd_err"] = common.describe_error(exc)
        if "fwd_err" not in row and not row.get("invalid"):
            row.update(gpu.time_backward(p, out, timer, row["fwd_ms"]))
            row["bwd_tflops"] = common.tflops(common.BWD_FLOPS_FACTOR * flops, row.get("bwd_ms"))
        out = None  # frees the retained graph
        gpu._clear_grads(p.leaves)
        if profile and "fwd_err" not in row:
            try:
                row.update(gpu.record_kernels(p, backward="bwd_err" not in row))
            except Exception as exc:  # noqa: BLE001 - the proof is extra; its failure is noted, not fatal
                row["profile_err"] = common.describe_error(exc)
    gpu._clear_grads(p.leaves)
    return row


def _synchronize(out):
    if isinstance(out, torch.Tensor) and out.is_cuda:
        torch.cuda.synchronize()


# ---------------------------------------------------------------- criteria (pure)


class Criterion(NamedTuple):
    """A bar of the issue: ``subjects`` (flashtile variants) of ``group`` against ``baseline``
    ``(prov, variant)`` on the same shape (variant None: the subject's own), forward and backward.

    ``kind``: ``speedup`` = baseline / subject time >= target; ``overhead`` = subject / baseline
    <= target; ``padding`` = subject / baseline / (1 - padding fraction) <= target. A target of
    None is reported without a verdict."""

    id: str
    text: str
    group: str
    subjects: tuple
    baseline: tuple
    kind: str
    target: Optional[float]
    longest_only: bool = False


CRITERIA = (
    Criterion("window", "sliding window (1024, 0) >= 8x faster than full causal at the longest seqlen (16384)",
              "window", ("window",), ("flashtile", "causal"), "speedup", 8.0, longest_only=True),
    Criterion("varlen_equal", "varlen 16 x 2048 within 10% of dense on the (16, 2048) batch",
              "varlen_equal", ("varlen",), ("flashtile", "padded"), "overhead", 1.10),
    Criterion("varlen_mixed", "varlen 16 x U(128..4096) faster than padded dense by the padding fraction "
              "(time <= 1.1 x (1 - pad) x padded)", "varlen_mixed", ("varlen",), ("flashtile", "padded"), "padding",
              1.10),
    Criterion("softcap", "softcap=50 at most 15% over plain", "mods", ("softcap",), ("flashtile", "plain"), "overhead",
              1.15),
    Criterion("alibi", "alibi_slopes at most 15% over plain", "mods", ("alibi",), ("flashtile", "plain"), "overhead", 1.15),
    Criterion("sink", "sink at most 15% over plain", "mods", ("sink",), ("flashtile", "plain"), "overhead", 1.15),
    Criterion("bias", "attn_bias vs SDPA efficient, same float mask (no bar: reported)", "bias",
              ("bias", "bias_grad"), ("efficient", None), "overhead", None),
)


def _find(rows, group, prov, variant, like) -> Optional[dict]:
    for r in rows:
        if (r["group"], r["prov"], r["variant"]) == (group, prov, variant) and all(
                r[k] == like[k] for k in ("N", "B", "causal")):
            return r
    return None


def _ms(row: Optional[dict], stage: str) -> Optional[float]:
    if not row or row.get("skipped") or row.get("fwd_err") or row.get(f"{stage}_err"):
        return None
    return row.get(f"{stage}_ms") or None


def criterion_value(kind: str, subject_ms: Optional[float], baseline_ms: Optional[float], pad_frac: float = 0.0):
    if not subject_ms or not baseline_ms:
        return None
    if kind == "speedup":
        return baseline_ms / subject_ms
    if kind == "padding":
        return subject_ms / baseline_ms / (1.0 - pad_frac)
    return subject_ms / baseline_ms


def evaluate(rows: list[dict], criteria=CRITERIA) -> list[dict]:
    """Each criterion with its checks (one per shape, causal and stage) and a verdict:
    ``pass``, ``FAIL``, ``incomplete`` (some checks not measured), ``no data`` or ``info``."""
    results = []
    for c in criteria:
        subjects = [r for r in rows if r["group"] == c.group and r["prov"] == "flashtile" and r["variant"] in c.subjects]
        if c.longest_only and subjects:
            longest = max(r["N"] for r in subjects)
            subjects = [r for r in subjects if r["N"] == longest]
        checks = []
        for r in subjects:
            base = _find(rows, c.group, c.baseline[0], c.baseline[1] or r["variant"], r)
            for stage in ("fwd", "bwd"):
                pad = r.get("pad_frac") or 0.0
                unpaired = criterion_value(c.kind, _ms(r, stage), _ms(base, stage), pad)
                # The ratio timed in alternation, where the row has it (see PAIRED_ROUNDS).
                ratio = r.get(f"paired_{stage}") if base else None
                value = unpaired if ratio is None else criterion_value(c.kind, ratio, 1.0, pad)
                ok = None if value is None or c.target is None else (
                    value >= c.target if c.kind == "speedup" else value <= c.target)
                checks.append({"variant": r["variant"], "N": r["N"], "B": r["B"], "causal": r["causal"], "stage": stage,
                               "subject_ms": _ms(r, stage), "baseline_ms": _ms(base, stage), "value": value,
                               "unpaired_value": unpaired, "paired": ratio is not None, "ok": ok})
        oks = [ch["ok"] for ch in checks]
        if c.target is None:
            verdict = "info" if checks else "no data"
        elif not checks or all(ok is None for ok in oks):
            verdict = "no data"
        elif False in oks:
            verdict = "FAIL"
        elif None in oks:
            verdict = "incomplete"
        else:
            verdict = "pass"
        results.append({"id": c.id, "text": c.text, "kind": c.kind, "target": c.target,
                        "baseline": list(c.baseline), "verdict": verdict, "checks": checks})
    return results


# ---------------------------------------------------------------- tables (pure)


class GroupView(NamedTuple):
    title: Callable  # first row of the group -> its table's title
    ratio_header: str
    baseline: Callable  # row -> (prov, variant) of the row it is compared with, or None
    speedup: bool  # ratio = baseline / row (else row / baseline)


VIEWS = {
    "window": GroupView(lambda r: f"Sliding window ({(r.get('window') or ['?'])[0]}, 0) vs full causal, batch {r['B']}",
                        "speedup vs causal (own)",
                        lambda r: (r["prov"] if r["prov"] in ("flex", "fa4") else "flashtile", "causal"),
                        True),
    "varlen_equal": GroupView(lambda r: f"Varlen, {r['B']} sequences of {r['N']} vs padded dense",
                              "time / ft padded", lambda r: ("flashtile", "padded"), False),
    "varlen_mixed": GroupView(lambda r: f"Varlen, {r['B']} lengths drawn uniformly (seed 0) vs padded to the longest",
                              "time / ft padded", lambda r: ("flashtile", "padded"), False),
    "mods": GroupView(lambda r: f"softcap / ALiBi / sink vs plain, batch * seqlen = {r['B'] * r['N']}",
                      "time / ft plain", lambda r: ("flashtile", "plain"), False),
    "bias": GroupView(lambda r: f"attn_bias (1, H, S, S) vs SDPA efficient, same mask, batch * seqlen = {r['B'] * r['N']}",
                      "time / sdpa eff", lambda r: None if r["variant"] == "plain" else ("efficient", r["variant"]),
                      False),
}
PROV_NAMES = {"flashtile": "flashtile", "fa4": "fa4", "flash": "sdpa flash", "efficient": "sdpa efficient",
              "cudnn": "sdpa cudnn", "flex": "flex"}


def _stage_cells(row: dict, stage: str) -> list[str]:
    """``[ms, TFLOP/s]`` of a stage, or a marked cell: skip, OOM, ERR(...); a failed forward marks fwd only."""
    if row.get("invalid"):
        return [common.invalid_cell(row), "-"] if stage == "fwd" else ["-", "-"]
    if row.get("skipped"):
        return ["skip", "-"]
    if row.get("fwd_err"):
        return [common.short_error(row["fwd_err"]), "-"] if stage == "fwd" else ["-", "-"]
    if row.get(f"{stage}_err"):
        return [common.short_error(row[f"{stage}_err"]), "-"]
    tflops = row.get(f"{stage}_tflops")
    # GPU rows are hundreds of TFLOP/s; the CPU smoke run's are fractions, kept visible.
    return [common.fmt(row.get(f"{stage}_ms"), 3), common.fmt(tflops, 0 if tflops is None or tflops >= 10 else 3)]


def _ratio_cell(row: dict, rows: list[dict], view: GroupView) -> str:
    target = view.baseline(row)
    base = target and _find(rows, row["group"], target[0], target[1], row)
    if not base:
        return "-"
    kind = "speedup" if view.speedup else "overhead"
    cells, paired_cells = [], []
    for stage in ("fwd", "bwd"):
        value = criterion_value(kind, _ms(row, stage), _ms(base, stage))
        cells.append("-" if value is None else f"{value:.2f}")
        ratio = row.get(f"paired_{stage}")
        paired_cells.append("-" if ratio is None else f"{criterion_value(kind, ratio, 1.0):.2f}")
    text = " / ".join(cells)
    if any(cell != "-" for cell in paired_cells):
        text += f" (paired {' / '.join(paired_cells)})"
    return text


def _shape_label(row: dict) -> str:
    if row.get("seqlens"):
        lengths = row["seqlens"]
        spread = f"{min(lengths)}..{max(lengths)}" if len(set(lengths)) > 1 else str(lengths[0])
        return f"{len(lengths)} x {spread}"
    return f"{row['B']} x {row['N']}"


def group_table(rows: list[dict], group: str) -> str:
    view = VIEWS[group]
    mine = [r for r in rows if r["group"] == group]
    headers = ["batch x seqlen", "causal", "row", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s",
               f"{view.ratio_header} fwd/bwd", "max err"]
    lines = []
    for r in mine:
        err = f"{r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else ("ERR" if r.get("check_err") else "-")
        lines.append([_shape_label(r), str(r["causal"]).lower(), f"{PROV_NAMES.get(r['prov'], r['prov'])} {r['variant']}",
                      *_stage_cells(r, "fwd"), *_stage_cells(r, "bwd"), _ratio_cell(r, rows, view), err])
    window_row = next((r for r in mine if r.get("window")), mine[0])
    head = [f"{view.title(window_row)}; H={mine[0]['H']}, D={mine[0]['D']}"]
    if group == "window":
        for n in sorted({r["N"] for r in mine}):
            full = visible_pairs(n, True)
            win = next((r["visible_pairs"] for r in mine if r["N"] == n and r["variant"] == "window"), None)
            if win:
                head.append(f"  seqlen {n}: ideal speedup from visible pairs {full / win:.2f}x")
    if group.startswith("varlen") and mine:
        lengths = mine[0]["seqlens"]
        real = sum(visible_pairs(n, True) for n in lengths) / (len(lengths) * visible_pairs(max(lengths), True))
        pad = padding_fraction(lengths)
        head.append(f"  lengths {lengths}; padding fraction {pad:.3f} of tokens (token-proportional ideal speedup "
                    f"{1 / (1 - pad):.2f}x), {1 - real:.3f} of causal pairs")
    return "\n".join([*head, common.markdown_table(headers, lines)])


def criteria_table(results: list[dict]) -> str:
    lines = []
    for c in results:
        values = [ch for ch in c["checks"] if ch["value"] is not None]
        worst = "-"
        if values:
            pick = min if c["kind"] == "speedup" else max
            w = pick(values, key=lambda ch: ch["value"])
            unit = "x" if c["kind"] == "speedup" else ""
            worst = (f"{w['value']:.2f}{unit} ({w['stage']}, {w['variant']}, N={w['N']}, "
                     f"{'causal' if w['causal'] else 'full'})")
        target = "-" if c["target"] is None else (f">= {c['target']:g}x" if c["kind"] == "speedup" else f"<= {c['target']:g}")
        passed = "-" if c["target"] is None else f"{sum(ch['ok'] is True for ch in c['checks'])}/{len(c['checks'])}"
        lines.append([c["id"], c["text"], target, worst, passed, c["verdict"]])
    return common.markdown_table(["criterion", "bar", "target", "worst measured", "checks passed", "verdict"], lines)


def format_report(rows: list[dict], results: list[dict]) -> str:
    parts = ["Times in ms (median); TF/s = effective TFLOP/s on visible pairs; ft = flashtile; "
             "max err = max|out - fp32 reference| on the first ref_heads heads"]
    for group in GROUP_NAMES:
        if any(r["group"] == group for r in rows):
            parts += ["", group_table(rows, group)]
    parts += ["", "Criteria (value: the time ratio of the rows timed in alternation where they were (paired), else "
              "of their medians; padding: varlen/padded over (1 - padding fraction))", criteria_table(results)]
    return "\n".join(parts)


# ---------------------------------------------------------------- the run


def run_cases(cases: list[Case], dtype, device, timer, ref_heads: Optional[int], on_row: Callable,
              flex_budget_s: float = FLEX_BUDGET_S, profile: bool = False,
              paired_rounds: int = PAIRED_ROUNDS) -> list[dict]:
    """Measure ``cases`` (cases of one block share their inputs); ``on_row(case, row)`` after each row.
    Flex cases past ``flex_budget_s`` seconds spent in Flex (compiles included) are marked ``skipped``.
    After each block, the rows a bar compares are timed again in alternation (``paired_rounds`` rounds,
    0: not), which adds ``paired_*`` ratios to the subject rows."""
    import flashtile

    rows: list[dict] = []
    flex_spent = 0.0
    blocks: dict = {}
    for case in cases:
        blocks.setdefault(case.block(), []).append(case)
    for block_cases in blocks.values():
        first = block_cases[0]
        try:
            inputs = make_block_inputs(first, dtype, device)
        except Exception as exc:  # noqa: BLE001
            label = common.describe_error(exc)
            for case in block_cases:
                rows.append({**case.key(), "fwd_err": label})
                on_row(case, rows[-1])
            gpu._free_cuda(collect=True)
            continue
        for case in block_cases:
            if case.prov == "flex" and flex_spent > flex_budget_s:
                row = {**case.key(), "skipped": f"flex time budget ({flex_budget_s:.0f} s) spent"}
            else:
                start = time.perf_counter()
                calls_before = flashtile.stats()["calls"]
                try:
                    row = measure(case, inputs, timer, ref_heads, profile=profile)
                except Exception as exc:  # noqa: BLE001 - e.g. a cleanup after a broken CUDA context
                    row = {**case.key(), "fwd_err": common.describe_error(exc)}
                if case.prov == "flashtile":  # which backend really ran
                    calls = flashtile.stats()["calls"]
                    row["backend"] = sorted(b for b, n in calls.items() if n > calls_before.get(b, 0))
                if case.prov == "flex":
                    flex_spent += time.perf_counter() - start
                gpu._free_cuda()
            rows.append(row)
            on_row(case, row)
        if paired_rounds:
            pair_with_baselines(block_cases, rows[-len(block_cases):], inputs, timer, paired_rounds)
        del inputs
        gpu._free_cuda(collect=True)
    return rows


def bar_baselines(case: Case) -> list[tuple]:
    """``(prov, variant)`` of each flashtile row a bar compares flashtile row ``case`` with."""
    return [c.baseline for c in CRITERIA if c.group == case.group and case.prov == "flashtile"
            and case.variant in c.subjects and c.baseline[0] == "flashtile" and c.target is not None]


def alternate(timer, first: tuple, second: tuple, rounds: int) -> float:
    """Median over ``rounds`` of (time of ``second`` / time of ``first``): each round times both, each
    ``(fn, leaves)`` by the median of ``timer``'s runs, in turn first-second and second-first, so that a
    drift of the clock over the round cancels in the median."""
    ratios = []
    for r in range(rounds):
        times = {}
        for pair in ((first, second) if r % 2 == 0 else (second, first)):
            times[id(pair)] = common.quantile(timer(pair[0], grad_to_none=pair[1]), 0.5)
        ratios.append(times[id(second)] / times[id(first)])
    return common.quantile(ratios, 0.5)


def paired(case: Case, base: Case, inputs: dict, timer, rounds: int, backward: bool) -> dict:
    """``paired_fwd`` (and ``paired_bwd``): ``case``'s time over ``base``'s, timed in alternation
    (:func:`alternate`) on the block's inputs."""
    subject, baseline = BUILDERS[case.prov](case, inputs), BUILDERS[base.prov](base, inputs)
    result = {"paired_rounds": rounds}
    with baseline.scope, subject.scope:
        stages = {"fwd": ((baseline.fwd, None), (subject.fwd, None))}
        if backward:
            outs = [p.fwd() for p in (baseline, subject)]
            stages["bwd"] = tuple((lambda o=o, p=p: o.backward(p.dout, retain_graph=True), list(p.leaves))
                                  for o, p in zip(outs, (baseline, subject)))
        for stage, (first, second) in stages.items():
            result[f"paired_{stage}"] = alternate(timer, first, second, rounds)
    for p in (baseline, subject):
        gpu._clear_grads(p.leaves)
    return result


def pair_with_baselines(block_cases: list[Case], block_rows: list[dict], inputs: dict, timer, rounds: int) -> None:
    """Add the paired ratios (:func:`paired`) to each row of the block that a bar compares with another
    row of the block, where both were measured."""
    by_kind = {(c.prov, c.variant): (c, r) for c, r in zip(block_cases, block_rows)}
    for case, row in zip(block_cases, block_rows):
        for target in bar_baselines(case):
            if target not in by_kind or not _ms(row, "fwd") or not _ms(by_kind[target][1], "fwd"):
                continue
            base, base_row = by_kind[target]
            backward = bool(_ms(row, "bwd") and _ms(base_row, "bwd"))
            try:
                row.update(paired(case, base, inputs, timer, rounds, backward))
            except Exception as exc:  # noqa: BLE001 - the unpaired times stand
                row["paired_err"] = common.describe_error(exc)
            gpu._free_cuda()


def run(args) -> tuple[dict, str]:
    """Measure every case; returns ``(payload, table)`` after writing the JSON (also after each row)."""
    smoke = _device(args) == "cpu"
    sizes = SMOKE if smoke else (QUICK if getattr(args, "quick", False) else DEFAULT)
    groups = getattr(args, "groups", None) or list(GROUP_NAMES)
    chosen = getattr(args, "providers", None) or list(PROVIDERS)
    dtype_name = getattr(args, "dtype", None) or "bf16"
    cases = build_cases(sizes, groups, chosen)
    ref_heads = None if getattr(args, "no_check", False) else sizes.ref_heads

    import flashtile
    from flashtile.dispatch import force_backend

    if smoke:
        device = torch.device("cpu")
        env = {**common.base_env(), "gpu": None, "device": "cpu (smoke: tiny shapes, torch backend)", "dtype": dtype_name}
        timer, slug, scope = common.cpu_timer(), "cpu", force_backend("torch")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        env, scope, timer = gpu._env(dtype_name), contextlib.nullcontext(), common.gpu_timer()
        slug = common.gpu_slug(env["gpu"])
    suffix = "" if set(groups) == set(GROUP_NAMES) else "-" + "-".join(g for g in GROUP_NAMES if g in groups)
    path = common.result_path(getattr(args, "out", common.DEFAULT_OUT), f"{slug}-variants{suffix}", env)
    payload = {"kind": "variants", "env": env, "sizes": sizes._asdict(), "note": NOTE, "flop_model": FLOP_MODEL,
               "rows": [], "criteria": [], "flashtile_stats": None}
    common.log(f"flashtile variants on {env['gpu'] or 'CPU (smoke)'}, {dtype_name}, {len(cases)} rows "
               f"({', '.join(groups)}); results -> {path}")
    if not smoke and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        common.log("WARNING: TRITON_INTERPRET is set: flashtile's kernels run in Triton's interpreter, not on the GPU")
    flashtile.reset_stats()

    def on_row(case: Case, row: dict) -> None:
        common.log(f"   {case.group} N={case.N} B={case.B} causal={case.causal} "
                   f"{PROV_NAMES[case.prov] + ' ' + case.variant:<24} {_progress(row)}")
        payload["rows"].append(row)
        payload["flashtile_stats"] = flashtile.stats()
        payload["criteria"] = evaluate(payload["rows"])  # a run cut short still leaves its verdicts so far
        common.write_json(path, payload)

    with scope:
        run_cases(cases, common.DTYPES[dtype_name], device, timer, ref_heads, on_row,
                  paired_rounds=2 if smoke else PAIRED_ROUNDS)
    payload["criteria"] = evaluate(payload["rows"])
    payload["flashtile_stats"] = flashtile.stats()
    common.write_json(path, payload)
    table = format_report(payload["rows"], payload["criteria"])
    fallbacks = (payload["flashtile_stats"] or {}).get("fallbacks")
    if fallbacks:
        table += f"\nWARNING: flashtile fell back from its preferred backend during the run: {fallbacks}"
    table += f"\nwrote {path}"
    return payload, table


def _device(args) -> str:
    device = getattr(args, "device", "auto") or "auto"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _progress(row: dict) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    return gpu._progress(row)


def main_with_args(args) -> int:
    """Run, print the table (stderr with ``--json``, which prints the payload on stdout); exit status 1
    only when no flashtile row measured anything."""
    payload, table = run(args)
    if getattr(args, "json", False):
        common.log(table)
        print(json.dumps(payload, indent=1, default=str))
    else:
        print(table)
    mine = [r for r in payload["rows"] if r["prov"] == "flashtile"]
    return 1 if mine and all(r.get("fwd_err") for r in mine) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashtile.bench.variants",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="The same as: python -m flashtile bench --suite variants [options]",
    )
    parser.add_argument("--out", default=common.DEFAULT_OUT, metavar="DIR",
                        help="where <gpu>-variants-<date>T<time>Z.json goes (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="window 16384, mods 8192, bias 4096 only")
    parser.add_argument("--groups", nargs="+", choices=GROUP_NAMES, metavar="GROUP",
                        help=f"subset of: {' '.join(GROUP_NAMES)} (default all)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, metavar="NAME",
                        help=f"subset of: {' '.join(PROVIDERS)} (default all; leave out flex to skip its compiles)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cpu: the smoke run (tiny shapes, torch backend); auto: cuda when available")
    parser.add_argument("--no-check", action="store_true", help="skip the error check against the reference")
    parser.add_argument("--json", action="store_true", help="print the result JSON on stdout (the table goes to stderr)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build_parser().error("--device cuda: torch sees no CUDA GPU")
    return main_with_args(args)


if __name__ == "__main__":
    raise SystemExit(main())
