"""The attention implementations the benchmarks compare, built on shared inputs.

Each builder takes the inputs of one shape and returns a :class:`Provider`: a no-argument forward,
the leaves that get gradients, the upstream gradient in its layout, a context to run inside, and
whether its output is ``(B, H, S, D)``. A builder raises :class:`~flashtile.bench.common.Unavailable`
when its library is missing and lets the peer's own error through when it refuses a shape; either
becomes a marked cell, never a crash.

Providers (dense attention, GQA through each one's own mechanism, K and V never repeated except
by the naive reference):

- ``flashtile``: ``flashtile.flash_attn_func`` on ``(B, S, H, D)``.
- ``flash``, ``cudnn``, ``efficient``, ``math``: ``torch.nn.functional.scaled_dot_product_attention``
  on ``(B, H, S, D)`` contiguous copies under ``sdpa_kernel(<backend>)``, ``enable_gqa=True`` when
  ``Hkv < H``.
- ``flex``: ``torch.compile(flex_attention, dynamic=False)`` with a causal block mask; the compile
  cache is reset for every shape (``torch._dynamo.reset()``), so it never hits the recompile limit;
  CUDA only.
- ``flash_attn``: ``flash_attn.flash_attn_func`` when the package is importable.
- ``naive``: ``softmax(q k^T * scale) v`` with the whole score matrix, K and V repeated per group.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, NamedTuple

import torch

from . import common

NAMES = ("flashtile", "flash", "cudnn", "efficient", "math", "flex", "flash_attn", "naive")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
# naive and math materialize the (B, H, Sq, Sk) scores (and their softmax and gradient): past this many
# elements (8 GiB of fp32 each) they are not run, a marked cell.
MAX_SCORE_ELEMENTS = 2**31


class Provider(NamedTuple):
    """What a provider needs measured: its forward, the leaves that get gradients, the upstream
    gradient in its layout, a context to run inside, and whether it works in (B, H, S, D)."""

    fwd: Callable
    leaves: tuple
    dout: torch.Tensor
    scope: contextlib.AbstractContextManager
    heads_first: bool


class DenseShape(NamedTuple):
    """One shape of the dense sweep (square: ``seqlen_q = seqlen_k = seqlen``)."""

    batch: int
    seqlen: int
    nheads: int
    nheads_kv: int
    headdim: int
    headdim_v: int
    causal: bool
    dtype: str

    def key(self, provider: str) -> dict:
        """The identifying fields of a result row."""
        return {"prov": provider, "dtype": self.dtype, "D": self.headdim, "Dv": self.headdim_v, "H": self.nheads,
                "Hkv": self.nheads_kv, "N": self.seqlen, "B": self.batch, "causal": self.causal}

    def flops(self, stage: str = "fwd") -> float:
        fwd = common.attn_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, self.causal,
                                self.headdim_v)
        return common.STAGE_FLOPS_FACTOR[stage] * fwd

    def bytes(self, stage: str = "fwd") -> int:
        elt = torch.finfo(common.DTYPES[self.dtype]).bits // 8
        return common.attn_bytes(stage, self.batch, self.nheads, self.nheads_kv, self.seqlen, self.seqlen,
                                 self.headdim, self.headdim_v, elt)


def make_inputs(batch, seqlen, nheads, nheads_kv, headdim, headdim_v, dtype, device) -> dict:
    """q, k, v and dout in both layouts, seeded: ``bshd`` ``[q, k, v]`` ``(B, S, H, D)`` leaves,
    ``bhsd`` contiguous ``(B, H, S, D)`` leaves (the SDPA / Flex layout), ``dout_bshd``, ``dout_bhsd``."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(batch, seqlen, nheads, headdim), (batch, seqlen, nheads_kv, headdim),
              (batch, seqlen, nheads_kv, headdim_v), (batch, seqlen, nheads, headdim_v)]
    q, k, v, dout = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes)
    bhsd = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    return {
        "bshd": [x.requires_grad_() for x in (q, k, v)],
        "bhsd": bhsd,
        "dout_bshd": dout,
        "dout_bhsd": dout.transpose(1, 2).contiguous(),
    }


def naive_attention(q, k, v, causal: bool, scale: float):
    """``softmax(q k^T * scale) v`` materialising the whole score matrix, on ``(batch, seqlen, nheads, headdim)``;
    K and V are repeated over each query-head group (GQA)."""
    from ..testing import causal_lower_right_mask

    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-2, -1)).mul_(scale)  # in place: one score matrix, not two
    if causal:
        scores.masked_fill_(~causal_lower_right_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2)


def not_applicable(name: str, shape: DenseShape) -> str | None:
    """Why ``name`` is not run on ``shape`` at all (a ``skipped`` cell), or None."""
    if name in ("naive", "math"):
        elements = shape.batch * shape.nheads * shape.seqlen * shape.seqlen
        if elements > MAX_SCORE_ELEMENTS:
            return (f"materializes the {shape.batch}x{shape.nheads}x{shape.seqlen}x{shape.seqlen} score matrix "
                    f"({elements / 2**30:.0f} Gi elements > {MAX_SCORE_ELEMENTS // 2**30} Gi)")
    return None


def _flashtile(inputs, shape: DenseShape) -> Provider:
    import flashtile

    q, k, v = inputs["bshd"]
    fwd = lambda: flashtile.flash_attn_func(q, k, v, causal=shape.causal)  # noqa: E731
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False)


def _sdpa(backend_name: str):
    def build(inputs, shape: DenseShape) -> Provider:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = inputs["bhsd"]
        # enable_gqa only when needed: older torch has no such argument, and MHA needs none.
        extra = {"enable_gqa": True} if kt.shape[1] != qt.shape[1] else {}
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qt, kt, vt, is_causal=shape.causal, **extra)
        # The kernel choice happens in forward; backward follows the op forward recorded.
        return Provider(fwd, (qt, kt, vt), inputs["dout_bhsd"], sdpa_kernel(getattr(SDPBackend, backend_name)),
                        heads_first=True)

    return build


def _flex(inputs, shape: DenseShape) -> Provider:
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = inputs["bhsd"]
    if qt.device.type != "cuda":
        raise common.Unsupported("flex: the suite runs FlexAttention compiled, on CUDA only")
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no stale guards
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if shape.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None,
                                       Q_LEN=shape.seqlen, KV_LEN=shape.seqlen, device=qt.device)
    gqa = kt.shape[1] != qt.shape[1]
    fwd = lambda: compiled(qt, kt, vt, block_mask=block_mask, enable_gqa=gqa)  # noqa: E731
    # Donated buffers forbid backward(retain_graph=True); turn them off while flex compiles and runs.
    scope = torch._functorch.config.patch(donated_buffer=False)
    return Provider(fwd, (qt, kt, vt), inputs["dout_bhsd"], scope, heads_first=True)


def _flash_attn(inputs, shape: DenseShape) -> Provider:
    try:
        module = importlib.import_module("flash_attn")
    except ImportError as exc:
        raise common.Unavailable(f"flash_attn is not installed ({type(exc).__name__})") from None
    q, k, v = inputs["bshd"]
    fwd = lambda: module.flash_attn_func(q, k, v, causal=shape.causal)  # noqa: E731
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False)


def _naive(inputs, shape: DenseShape) -> Provider:
    q, k, v = inputs["bshd"]
    scale = shape.headdim ** -0.5
    fwd = lambda: naive_attention(q, k, v, shape.causal, scale)  # noqa: E731
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False)


BUILDERS = {
    "flashtile": _flashtile,
    **{name: _sdpa(backend) for name, backend in SDPA_BACKENDS.items()},
    "flex": _flex,
    "flash_attn": _flash_attn,
    "naive": _naive,
}
