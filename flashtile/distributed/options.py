"""Checks and defaults shared by the context-parallel entry points."""
from __future__ import annotations

import torch

from .. import validation


def block_options(q, k, v, *, causal, softmax_scale, window_size, softcap, sink, deterministic=False) -> tuple:
    """``(options, window)``: the keyword arguments every block call takes (scale, softcap, determinism)
    and the global window ``(left, right)`` with causal folded in (``right = 0``); validated on the local
    shards like any flashtile call (a bad value raises on every rank alike)."""
    args = validation.attn_args(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                softcap=softcap, sink=sink, deterministic=deterministic)
    options = dict(softmax_scale=args.softmax_scale, softcap=args.softcap, deterministic=args.deterministic)
    return options, (args.window_left, args.window_right)


# How the ring's backward sends the dK/dV partial sums of a shard on to the next rank: as float32 (the sums' own
# dtype) or rounded to the inputs' dtype (half the bytes for bf16/fp16; each hop's sum is still float32).
DKV_TRANSFERS = ("float32", "input")


def check_dkv_transfer(dkv_transfer) -> str:
    if not isinstance(dkv_transfer, str) or dkv_transfer not in DKV_TRANSFERS:
        raise ValueError(f"dkv_transfer must be one of {DKV_TRANSFERS}, got {dkv_transfer!r}")
    return dkv_transfer


def dkv_dtype(dkv_transfer: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the dK/dV partial sums travel in, for inputs of ``dtype``."""
    return torch.float32 if dkv_transfer == "float32" else dtype


def refuse_alibi(alibi_slopes, where: str) -> None:
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"{where}: alibi_slopes is not implemented for ring attention (a block's ALiBi distances need the "
            "global positions, which the backends do not take); use ulysses_attention, whose attention sees the "
            "whole sequence")


def mask_name(window: tuple) -> str:
    left, right = window
    if window == (-1, -1):
        return "full"
    if window == (-1, 0):
        return "causal"
    return f"window=({left},{right})"


def shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The sizes every rank must agree on (checked with one all-gather)."""
    return dict(zip(("batch", "seqlen_q", "nheads", "headdim", "seqlen_k", "nheads_kv", "headdim_v"),
                    (*q.shape, k.shape[1], k.shape[2], v.shape[3])))
