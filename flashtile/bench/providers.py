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
- ``flash_attn``: ``flash_attn.flash_attn_func`` (flash-attn 2) when the package is importable.
- ``fa4``: FlashAttention-4, ``flash_attn.cute.flash_attn_func`` (CuTe DSL; FA3-class kernels on sm90),
  which returns ``(out, lse)``; windows, softcap and sinks (``learnable_sink``) through its own arguments.
- ``naive``: ``softmax(q k^T * scale) v`` with the whole score matrix, K and V repeated per group.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, NamedTuple, Optional

import torch

from . import common

NAMES = ("flashtile", "fa4", "cudnn", "flash", "flex", "efficient", "math", "flash_attn", "naive")
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
    with_lse: Optional[Callable] = None  # () -> (out, lse (B, H, S)) where the provider returns its LSE




class DenseShape(NamedTuple):
    """One shape of the dense sweep or of the model shapes (square: ``seqlen_q = seqlen_k = seqlen``), with
    the features a model shape adds: a left window ``(window, 0)``, ``softcap``, a learned ``sink`` per head."""

    batch: int
    seqlen: int
    nheads: int
    nheads_kv: int
    headdim: int
    headdim_v: int
    causal: bool
    dtype: str
    window: Optional[int] = None
    softcap: float = 0.0
    sink: bool = False

    def key(self, provider: str) -> dict:
        """The identifying fields of a result row."""
        row = {"prov": provider, "dtype": self.dtype, "D": self.headdim, "Dv": self.headdim_v, "H": self.nheads,
               "Hkv": self.nheads_kv, "N": self.seqlen, "B": self.batch, "causal": self.causal}
        if self.window is not None:
            row["window"] = [self.window, 0]
        if self.softcap:
            row["softcap"] = self.softcap
        if self.sink:
            row["sink"] = True
        return row

    def flops(self, stage: str = "fwd") -> float:
        """Matmul FLOPs on the (query, key) pairs the mask leaves visible (a window's only)."""
        if self.window is None:
            fwd = common.attn_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, self.causal,
                                    self.headdim_v)
        else:
            pairs = sum(min(i, self.window) + 1 for i in range(self.seqlen))
            fwd = 2.0 * self.batch * self.nheads * pairs * (self.headdim + self.headdim_v)
        return common.STAGE_FLOPS_FACTOR[stage] * fwd

    def features(self, inputs: dict) -> dict:
        """flashtile's (and the reference's) keyword arguments for this shape."""
        kwargs = {"causal": self.causal}
        if self.window is not None:
            kwargs["window_size"] = (self.window, 0)
        if self.softcap:
            kwargs["softcap"] = self.softcap
        if self.sink:
            kwargs["sink"] = inputs["sink"]
        return kwargs

    def plain(self) -> bool:
        return self.window is None and not self.softcap and not self.sink

    def bytes(self, stage: str = "fwd") -> int:
        elt = torch.finfo(common.DTYPES[self.dtype]).bits // 8
        return common.attn_bytes(stage, self.batch, self.nheads, self.nheads_kv, self.seqlen, self.seqlen,
                                 self.headdim, self.headdim_v, elt)


def make_inputs(batch, seqlen, nheads, nheads_kv, headdim, headdim_v, dtype, device) -> dict:
    """q, k, v and dout in both layouts, seeded: ``bshd`` ``[q, k, v]`` ``(B, S, H, D)`` leaves,
    ``bhsd`` contiguous ``(B, H, S, D)`` leaves (the SDPA / Flex layout), ``dout_bshd``, ``dout_bhsd``, and a
    float32 ``sink`` ``(H,)`` for the shapes that use one."""
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
        "sink": torch.randn((nheads,), generator=gen, device=device, dtype=torch.float32),
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
    kwargs = shape.features(inputs)
    fwd = lambda: flashtile.flash_attn_func(q, k, v, **kwargs)  # noqa: E731
    with_lse = lambda: flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)[:2]  # noqa: E731
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False,
                    with_lse=with_lse)


def fa4_module():
    """``flash_attn.cute`` (FlashAttention-4), or :class:`common.Unavailable` when it is not installed."""
    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError as exc:
        raise common.Unavailable(f"flash_attn.cute (FlashAttention-4) is not installed ({type(exc).__name__})") from None


def _fa4(inputs, shape: DenseShape) -> Provider:
    cute = fa4_module()
    q, k, v = inputs["bshd"]
    kwargs = {"causal": shape.causal, "softcap": shape.softcap}
    if shape.window is not None:
        kwargs["window_size"] = (shape.window, 0)
    if shape.sink:
        kwargs["learnable_sink"] = inputs["sink"]
    with_lse = lambda: cute.flash_attn_func(q, k, v, return_lse=True, **kwargs)[:2]  # noqa: E731
    fwd = lambda: cute.flash_attn_func(q, k, v, **kwargs)[0]  # noqa: E731 - FA4 returns (out, lse)
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False,
                    with_lse=with_lse)


def _plain_only(name: str, shape: DenseShape) -> None:
    """Unsupported: a peer without windows, softcap or sinks on a shape that has one."""
    if not shape.plain():
        raise common.Unsupported(f"{name}: no window / softcap / sink argument")


def _sdpa(backend_name: str):
    def build(inputs, shape: DenseShape) -> Provider:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        _plain_only(f"sdpa {backend_name}", shape)
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
    if shape.sink:
        raise common.Unsupported("flex: a sink (an extra logit in the denominator) is not a score_mod")
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no stale guards
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = score_mod = None
    window = shape.window
    if window is not None:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= window),
                                       B=None, H=None, Q_LEN=shape.seqlen, KV_LEN=shape.seqlen, device=qt.device)
    elif shape.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None,
                                       Q_LEN=shape.seqlen, KV_LEN=shape.seqlen, device=qt.device)
    if shape.softcap:
        cap = shape.softcap
        score_mod = lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)  # noqa: E731
    gqa = kt.shape[1] != qt.shape[1]
    fwd = lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)  # noqa: E731
    # Donated buffers forbid backward(retain_graph=True); turn them off while flex compiles and runs.
    scope = torch._functorch.config.patch(donated_buffer=False)
    return Provider(fwd, (qt, kt, vt), inputs["dout_bhsd"], scope, heads_first=True)


def _flash_attn(inputs, shape: DenseShape) -> Provider:
    try:
        module = importlib.import_module("flash_attn")
    except ImportError as exc:
        raise common.Unavailable(f"flash_attn is not installed ({type(exc).__name__})") from None
    if not hasattr(module, "flash_attn_func"):  # FlashAttention-4's wheel ships flash_attn.cute alone
        raise common.Unavailable("flash_attn (flash-attn 2) is not installed: flash_attn has no flash_attn_func")
    if shape.sink:
        raise common.Unsupported("flash_attn: no sink argument")
    q, k, v = inputs["bshd"]
    window = (-1, -1) if shape.window is None else (shape.window, 0)
    fwd = lambda: module.flash_attn_func(q, k, v, causal=shape.causal, window_size=window,  # noqa: E731
                                         softcap=shape.softcap)
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False)


def _naive(inputs, shape: DenseShape) -> Provider:
    _plain_only("naive", shape)
    q, k, v = inputs["bshd"]
    scale = shape.headdim ** -0.5
    fwd = lambda: naive_attention(q, k, v, shape.causal, scale)  # noqa: E731
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False)


BUILDERS = {
    "flashtile": _flashtile,
    "fa4": _fa4,
    **{name: _sdpa(backend) for name, backend in SDPA_BACKENDS.items()},
    "flex": _flex,
    "flash_attn": _flash_attn,
    "naive": _naive,
}
