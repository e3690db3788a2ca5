"""Triton backend: FlashAttention-2 kernels (``kernels/``), their launchers (``launch.py``) and tile
configs (``configs.py``). This module says what the backend can run without importing Triton."""
from __future__ import annotations

import functools
import importlib.util

import torch

from ... import env
from .. import AttentionCall, missing_features
from .configs import (MAX_GRID_Y, capability, bwd_choice, bwd_config, decode_plan, dense_takes_decode, deterministic,
                      fwd_config, gluon_fwd_config, gluon_kv_config, one_pass_keys, one_pass_keys96, one_pass_rows,
                      one_pass_wide, row_keys)

FEATURES = frozenset({"dropout", "window", "softcap", "alibi", "sink", "bias", "varlen", "headdim_v", "kvcache",
                      "paged", "merge", "fp8_cache"})


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    # Asked on every call: look the package up once, not on each dispatch.
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET=1``: the kernels run on CPU tensors through Triton's interpreter."""
    return env.flag("TRITON_INTERPRET")


def supports(call: AttentionCall) -> str | None:
    """Why the Triton kernels cannot run ``call``, or None when they can."""
    missing = missing_features(call, FEATURES)
    if missing:
        return f"{missing} is not implemented in the Triton kernels"
    if call.kvcache:
        reason = _kvcache_limits(call)
        if reason:
            return reason
    if not _triton_installed():
        return "triton is not installed"
    if call.device.type == "cpu":
        if not interpreter_enabled():
            return "CPU tensors run the Triton kernels only under TRITON_INTERPRET=1"
        if call.dtype == torch.bfloat16:
            return "Triton's interpreter computes bfloat16 wrongly (numpy has no bfloat16)"
        return None
    if call.device.type != "cuda":
        return f"device type {call.device.type!r} has no Triton backend"
    major, minor = capability(call.device)
    if major < 8:
        return f"GPU compute capability {major}.{minor} is below 8.0 (Ampere), which the Triton kernels need"
    if "fp8_cache" in call.feature_names and (major, minor) < (8, 9):
        return (f"GPU compute capability {major}.{minor} has no FP8 conversions in Triton (8.9+): the FP8 KV cache "
                "runs on the torch backend")
    return None


def _kvcache_limits(call: AttentionCall) -> str | None:
    """What the KV-cache kernels (kernels/decode.py) cannot run, or None."""
    for name, description in call.features:
        if name in ("dropout", "bias", "varlen"):
            return f"{description} is not implemented in the Triton KV-cache kernels"
    if call.batch * call.nheads_kv > MAX_GRID_Y:
        return (f"batch x nheads_kv = {call.batch} x {call.nheads_kv} exceeds the {MAX_GRID_Y} programs the "
                "Triton KV-cache kernel's grid can hold on that axis")
    return None


def _window(call: AttentionCall) -> tuple:
    """``(window_left, window_right)`` of the call; one built without its window still says whether it is causal."""
    left, right = call.window
    return left, 0 if call.causal and right < 0 else right


# The kernels' names by TileConfig.kernel (and the one-pass backward's kinds).
_KERNEL_LABELS = {"triton": "triton", "gluon": "gluon-sm90", "gluon-slim": "gluon-sm90-slim",
                  "gluon-ws": "gluon-sm90-ws", "gluon-wide": "gluon-sm90-wide"}


def describe(call: AttentionCall):
    """Profiler names of the forward and backward kernels, and their tile configs. A KV-cache call
    and a merge of partial results (``merge_attention_states``) have no backward (its name is empty)."""
    if "merge" in call.feature_names:
        return f"flashtile.merge[triton d={call.headdim_v}]", "", {}
    if call.kvcache:
        return _describe_kvcache(call)
    headdim = max(call.headdim, call.headdim_v)
    left, right = _window(call)
    mask = "causal" if call.causal else "full"
    # Features change the kernel that runs (each is a compile-time switch): name them.
    extras = "".join(f" {name}" for name, _ in call.features)
    bwd = bwd_config(headdim, call.dtype, call.device, call.headdim_v, row_keys(call.seqlen_k, left, right),
                     call.feature_names)
    # On an under-filled GPU: key blocks split among several dK/dV programs (parts=N), and the dQ kernel
    # alongside on a second stream (dq=...+stream; on the GPU only: the CPU has no streams). Unsplit key
    # blocks may take the Gluon dK/dV kernel (dkdv=gluon-sm90 ...).
    plan = bwd_choice(bwd, call.headdim, call.headdim_v, call.dtype, call.device, call.feature_names, (left, right),
                      call.batch, call.nheads, call.nheads_kv, call.seqlen_q, call.seqlen_k,
                      deterministic(call.deterministic))
    if plan.one_pass:
        rows = one_pass_rows(call.headdim, call.feature_names)
        keys = one_pass_keys(call.headdim, call.headdim_v, one_pass_keys96(call.headdim, call.headdim_v,
                                                                          call.feature_names))
        kernel = "gluon-wide" if one_pass_wide(call.headdim, call.headdim_v) else "gluon-ws"
        bwd_name = (f"flashtile.bwd[{_KERNEL_LABELS[kernel]} d={call.headdim} {mask}{extras} one-pass "
                    f"BM{rows}xBN{keys}]")
        bwd_tiles = {"bwd_one_pass": {"BLOCK_M": rows, "BLOCK_N": keys, "kernel": kernel}}
    else:
        bwd, parts = plan.cfg, plan.parts
        alongside = plan.alongside and call.device.type == "cuda"
        split = f" parts={parts}" if parts > 1 else ""
        dkdv = f"{_KERNEL_LABELS[bwd.dkdv.kernel]} " if bwd.dkdv.kernel != "triton" else ""
        bwd_name = (f"flashtile.bwd[triton d={call.headdim} {mask}{extras} dkdv={dkdv}BM{bwd.dkdv.BLOCK_M}"
                    f"xBN{bwd.dkdv.BLOCK_N}{split} dq=BM{bwd.dq.BLOCK_M}xBN{bwd.dq.BLOCK_N}"
                    f"{'+stream' if alongside else ''}]")
        bwd_tiles = {"bwd_dkdv": {**vars(bwd.dkdv), "parts": parts},
                     "bwd_dq": {**vars(bwd.dq), "alongside": alongside}}
    if dense_takes_decode(call.batch, call.seqlen_q, call.seqlen_k, call.nheads, call.nheads_kv, call.feature_names,
                          call.dtype, call.device):
        # Few query rows per KV head (a decode step): the KV-cache kernel over a full cache of seqlen_k keys.
        fwd_name, fwd_tiles = _decode_name(call, extras, 0)
        return fwd_name, bwd_name, {**fwd_tiles, **bwd_tiles}
    fwd = (gluon_fwd_config(call.headdim, call.headdim_v, call.dtype, call.device,
                            call.batch * call.nheads * call.seqlen_q, call.seqlen_k, left, right, call.feature_names,
                            call.softcap)
           or fwd_config(headdim, call.dtype, call.device, call.seqlen_k, left, right,
                         softcap="softcap" in call.feature_names, bias="bias" in call.feature_names,
                         head_dim_v=call.headdim_v, dropout="dropout" in call.feature_names))
    # The Gluon kernel needs TMA-readable inputs; a call whose strides are not takes the Triton one
    # and says so (a recorded fallback).
    kernel = _KERNEL_LABELS[fwd.kernel]
    # The warp-specialized forward's consumer warpgroups and turns, where not its two without turns.
    consumers = (f" consumers={fwd.consumers}" if fwd.consumers != 2 else "") + (" pingpong" if fwd.pingpong else "")
    fwd_name = (f"flashtile.fwd[{kernel} d={call.headdim} {mask}{extras}{consumers} BM={fwd.BLOCK_M} "
                f"BN={fwd.BLOCK_N}]")
    return fwd_name, bwd_name, {"fwd": vars(fwd), **bwd_tiles}


def _describe_kvcache(call: AttentionCall):
    """The KV-cache attention kernel (no backward): its name carries the head dim, the GQA group, the
    mask, the features, the split count and the tiles. ``call.seqlen_k`` is the cache capacity."""
    mask = "causal" if call.causal else "full"
    extras = "".join(f" {name}" for name, _ in call.features if name != "kvcache")
    left, right = _window(call)
    gluon = gluon_kv_config(call.headdim, call.headdim_v, call.dtype, call.device, call.batch, call.seqlen_q,
                            call.nheads, call.seqlen_k, left, right, call.feature_names, call.softcap)
    if gluon is not None:
        # Chunked prefill on a contiguous cache: the Gluon Hopper forward (launch.attention_kv).
        name = (f"flashtile.decode[{_KERNEL_LABELS[gluon.kernel]} d={call.headdim} {mask}{extras} "
                f"BM={gluon.BLOCK_M} BN={gluon.BLOCK_N}]")
        return name, "", {"decode": vars(gluon), "auto_num_splits": 1}
    name, config = _decode_name(call, extras, call.page_size)
    return name, "", config


def _decode_name(call: AttentionCall, extras: str, page_size: int):
    """The KV-cache kernel's name and tiles for ``call`` (``call.seqlen_k``: the capacity; ``page_size``: 0
    for a contiguous cache)."""
    group = call.nheads // call.nheads_kv
    rows = call.seqlen_q * group
    # The call does not carry num_splits: this is what auto (num_splits=0) picks for these shapes.
    cfg, splits = decode_plan(max(call.headdim, call.headdim_v), call.dtype, call.device, rows,
                              call.batch * call.nheads_kv, call.seqlen_k, 0, page_size,
                              fp8="fp8_cache" in call.feature_names, nheads_kv=call.nheads_kv)
    mask = "causal" if call.causal else "full"
    heads = f" heads={cfg.heads}" if cfg.heads > 1 else ""
    name = (f"flashtile.decode[triton d={call.headdim} gqa={group} {mask}{extras} splits=auto "
            f"BM={cfg.BLOCK_M} BN={cfg.BLOCK_N}{heads}]")
    return name, {"decode": vars(cfg), "auto_num_splits": splits}
