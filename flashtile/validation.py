"""Argument checks for the public API.

Every check raises ``ValueError`` or ``TypeError`` that names the argument and
quotes the actual shape, dtype, device or value, and says what was expected.
:func:`attn_args` runs the checks of everything but q, k and v and returns the
normalised :class:`~flashtile.backends.AttnArgs` a backend receives;
:func:`kvcache_args` does the same for ``flash_attn_with_kvcache`` (a
:class:`~flashtile.backends.KVCacheArgs`).

Shapes, dtypes and devices are always checked. Checks of the *values* of index tensors
(varlen offsets, cache lengths, block tables) read them on the host: see :func:`values_checked`.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import device_errors, env
from .backends import AttnArgs, KVCacheArgs
from .backends.torch_fp8 import QUANT_BLOCK

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEADDIM = 256
DENSE_LAYOUT = "(batch, seqlen, nheads, headdim)"
VARLEN_LAYOUT = "(total_tokens, nheads, headdim)"


def _describe(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}"


def check_tensor(name: str, t, ndim: int, layout: str, dtypes: tuple = SUPPORTED_DTYPES) -> None:
    """``t`` must be a floating tensor of rank ``ndim`` in one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got {t.dim()} dims ({_describe(t)})")
    if t.dtype not in dtypes:
        if t.dtype in FP8_DTYPES and dtypes == SUPPORTED_DTYPES:
            hint = "; float8_e4m3fn inputs need q_descale, k_descale and v_descale (see docs/fp8.md)"
        elif t.dtype == torch.float8_e5m2:
            hint = ("; FP8 attention takes float8_e4m3fn (e5m2 keeps 2 mantissa bits, too few for attention's "
                    "inputs): quantize to e4m3, or pass 16-bit inputs to flashtile.flash_attn_fp8_func")
        else:
            hint = ""
        raise TypeError(
            f"{name} has unsupported dtype {t.dtype} ({_describe(t)}); "
            f"expected {' or '.join(map(str, dtypes))}{hint}"
        )


def check_packed(name: str, t, parts: int, layout: str, varlen: bool = False) -> tuple:
    """``t`` packs ``parts`` tensors along dim 2 (dim 1 for varlen, which has no batch dim);
    returns them as views (no copy)."""
    dim = 1 if varlen else 2
    check_tensor(name, t, dim + 3, layout)
    if t.shape[dim] != parts:
        raise ValueError(f"{name} must have shape {layout}, got dim {dim} of size {t.shape[dim]} (shape={tuple(t.shape)})")
    return t.unbind(dim)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool = False,
              dtypes: tuple = SUPPORTED_DTYPES) -> None:
    """Validate q, k, v: dense ``(batch, seqlen, nheads, headdim)``, or varlen ``(total_tokens, nheads, headdim)``.

    v may have its own head dim (``headdim_v``); everything else of k and v must agree.
    """
    layout = VARLEN_LAYOUT if varlen else DENSE_LAYOUT
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3 if varlen else 4, layout, dtypes)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape[:-1] != v.shape[:-1]:
        what = "tokens and nheads" if varlen else "batch, seqlen and nheads"
        raise ValueError(
            f"k and v must have the same {what} (only the head dim may differ), got k={tuple(k.shape)} and v={tuple(v.shape)}"
        )
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q has batch {q.shape[0]} ({_describe(q)}) but k has batch {k.shape[0]} ({_describe(k)})")
    hq, dq = q.shape[-2:]
    hk, dk = k.shape[-2:]
    if dq != dk:
        raise ValueError(f"headdim mismatch: q has headdim {dq} but k has headdim {dk} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"nheads of q must be a multiple of nheads of k/v, got q nheads={hq} and k/v nheads={hk} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    if dq % 8 != 0 or dq < 8 or dq > MAX_HEADDIM:
        raise ValueError(
            f"headdim must be a multiple of 8 between 8 and {MAX_HEADDIM}, got {dq} (q {tuple(q.shape)}); "
            "pad the head dimension to the next multiple of 8"
        )
    dv = v.shape[-1]
    if dv % 8 != 0 or dv < 8 or dv > MAX_HEADDIM:
        raise ValueError(
            f"the head dim of v (headdim_v) must be a multiple of 8 between 8 and {MAX_HEADDIM}, got {dv} "
            f"(v {tuple(v.shape)}); pad it to the next multiple of 8"
        )
    if not varlen and q.shape[0] < 1:
        raise ValueError(f"batch must be >= 1, got q {tuple(q.shape)}")


def check_softmax_scale(softmax_scale, headdim: int) -> float:
    """Return the scale to use: ``1/sqrt(headdim)`` when ``softmax_scale`` is None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, torch.Tensor) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive float, got {scale}")
    return scale


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_bool(name: str, value) -> bool:
    """A real ``bool`` (a string such as ``"no"`` would be truthy): returned as is."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")
    return value


def check_window(window_size) -> tuple[int, int]:
    """``(left, right)`` as two Python ints, each ``-1`` (unbounded) or ``>= 0``."""
    if isinstance(window_size, torch.Tensor) or not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    if not all(_is_int(w) for w in window_size):
        types = ", ".join(type(w).__name__ for w in window_size)
        raise TypeError(f"window_size must be a pair of ints, got {tuple(window_size)!r} ({types})")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be -1 (unbounded) or >= 0, got window_size={(left, right)}")
    return left, right


def check_softcap(softcap) -> float:
    """A finite float ``>= 0`` (0 = no softcap)."""
    if isinstance(softcap, (torch.Tensor, bool)) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a Python float, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not 0.0 <= softcap < math.inf:  # NaN fails too; plain comparisons also trace under torch.compile
        raise ValueError(f"softcap must be a finite float >= 0 (0 = no softcapping), got {softcap}")
    return softcap


def check_dropout_p(dropout_p) -> float:
    """A float in ``[0, 1)``."""
    if isinstance(dropout_p, (torch.Tensor, bool)) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a Python float, got {type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def _check_small_tensor(name: str, t, device, dtypes, expected: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype} (expected {expected})")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device} ({_describe(t)})")


def check_alibi_slopes(alibi_slopes, batch: int, nheads: int, device) -> torch.Tensor:
    """float32 ``(nheads,)`` or ``(batch, nheads)``; returned as a ``(batch, nheads)`` view."""
    expected = f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}) float32"
    _check_small_tensor("alibi_slopes", alibi_slopes, device, (torch.float32,), expected)
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape {expected}, got {tuple(alibi_slopes.shape)}")
    return alibi_slopes.detach().expand(batch, nheads)


def check_sink(sink, nheads: int, device) -> torch.Tensor:
    """``(nheads,)`` float16/bfloat16/float32; returned detached and contiguous, in its dtype (the kernels
    read it as float32)."""
    expected = f"(nheads,) = ({nheads},), one logit per query head"
    _check_small_tensor("sink", sink, device, SUPPORTED_DTYPES, expected)
    if tuple(sink.shape) != (nheads,):
        raise ValueError(f"sink must have shape {expected}, got {tuple(sink.shape)}")
    return sink.detach().contiguous()


def check_attn_bias(attn_bias, shape: tuple, device) -> torch.Tensor:
    """Bool or float16/bfloat16/float32, broadcastable to ``shape = (batch, nheads, seqlen_q, seqlen_k)``;
    returned as an expanded view of that shape (broadcast dims have stride 0; nothing is copied)."""
    expected = "(batch, nheads, seqlen_q, seqlen_k)"
    _check_small_tensor("attn_bias", attn_bias, device, (torch.bool,) + SUPPORTED_DTYPES,
                        f"a float bias or a bool mask broadcastable to {expected} = {tuple(shape)}")
    sizes = tuple(attn_bias.shape)
    if len(sizes) > 4 or any(s not in (1, t) for s, t in zip(reversed(sizes), reversed(shape))):
        raise ValueError(
            f"attn_bias of shape {sizes} is not broadcastable to {expected} = {tuple(shape)}; each of its dims "
            "must be 1 or the full size, aligned from the right"
        )
    return attn_bias.detach().expand(shape)


def values_checked(device) -> bool:
    """Whether the checks that read index tensors' values on the host run for tensors on ``device``.

    For CPU tensors they always run. For CUDA tensors each would cost a device->host copy that
    stalls the host until the GPU catches up, so they run only with ``FLASHTILE_VALIDATE_VALUES=1``
    (debugging; the test suite sets it; the older name ``FLASHTILE_VALIDATE_VARLEN=1`` works too).
    They never run while torch.compile traces (the values are not known then) or while a CUDA
    graph is being captured (a copy to the host is not allowed then).
    """
    if torch.compiler.is_compiling():
        return False
    if device.type == "cpu":
        return True
    if not (env.flag("FLASHTILE_VALIDATE_VALUES") or env.flag("FLASHTILE_VALIDATE_VARLEN")):
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check_cu_seqlens(name: str, cu, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32, (batch + 1,)), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype} ({_describe(cu)}); use .to(torch.int32)")
    if cu.dim() != 1:
        raise ValueError(f"{name} must be 1-d (batch + 1,), got {cu.dim()} dims ({_describe(cu)})")
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must hold batch + 1 >= 2 offsets (at least one sequence), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")


def check_max_seqlen(name: str, value) -> int:
    """A Python int or a 0-d integer tensor (read with ``.item()``, a device sync on CUDA), ``>= 0``."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a Python int or a 0-d integer tensor, got a tensor ({_describe(value)})")
        value = value.item()
    elif not _is_int(value):
        raise TypeError(f"{name} must be a Python int or a 0-d integer tensor, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k) -> tuple[int, int]:
    """Check the varlen arguments of packed ``q`` ``(total_q, ...)`` and ``k`` ``(total_k, ...)``; returns
    ``(max_seqlen_q, max_seqlen_k)`` as ints.

    The checks on the offsets' values (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1]``
    within the tokens given, ``max_seqlen`` at least the longest sequence, ``seqused_k`` within
    each sequence) read them on the host, when :func:`values_checked` allows it.
    """
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both hold batch + 1 offsets, got shapes {tuple(cu_seqlens_q.shape)} "
            f"and {tuple(cu_seqlens_k.shape)}"
        )
    batch = cu_seqlens_q.shape[0] - 1
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if seqused_k is not None:
        if not isinstance(seqused_k, torch.Tensor):
            raise TypeError(f"seqused_k must be a torch.Tensor (int32, (batch,)) or None, got {type(seqused_k).__name__}")
        if seqused_k.dtype != torch.int32:
            raise TypeError(f"seqused_k must have dtype torch.int32, got {seqused_k.dtype} ({_describe(seqused_k)})")
        if tuple(seqused_k.shape) != (batch,):
            raise ValueError(f"seqused_k must have shape (batch,) = ({batch},), got {tuple(seqused_k.shape)}")
        if seqused_k.device != q.device:
            raise ValueError(f"seqused_k must be on q's device {q.device}, got {seqused_k.device}")
    if values_checked(cu_seqlens_q.device):
        _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_k)
    return max_q, max_k


def _check_varlen_values(q, k, cu_q, cu_k, max_q, max_k, seqused_k) -> None:
    facts = []
    for cu in (cu_q, cu_k):
        lengths = cu[1:] - cu[:-1]
        facts += [cu[0], cu[-1], lengths.min(), lengths.max()]
    if seqused_k is not None:
        lengths_k = cu_k[1:] - cu_k[:-1]
        facts += [seqused_k.min(), (seqused_k > lengths_k).any()]
    values = torch.stack([f.to(torch.int64) for f in facts]).tolist()  # the one device->host copy
    device_errors.check_if_strict()  # the host has waited for the device: strict mode reads the record here
    for i, (name, tokens, which, max_seqlen) in enumerate((("cu_seqlens_q", q, "q", max_q), ("cu_seqlens_k", k, "k", max_k))):
        first, last, shortest, longest = values[4 * i : 4 * i + 4]
        if first != 0:
            raise ValueError(f"{name}[0] must be 0, got {first}")
        if shortest < 0:
            raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got a sequence of length {shortest}")
        if last > tokens.shape[0]:
            raise ValueError(
                f"{name}[-1]={last} exceeds the {tokens.shape[0]} tokens of {which} (shape {tuple(tokens.shape)}); "
                f"{name}[-1] must be at most the number of packed tokens"
            )
        if longest > max_seqlen:
            raise ValueError(f"max_seqlen_{which}={max_seqlen} is less than the longest sequence in {name} ({longest})")
    if seqused_k is not None:
        smallest, too_long = values[8:]
        if smallest < 0 or too_long:
            raise ValueError(
                f"seqused_k must be between 0 and each sequence's number of keys (cu_seqlens_k[b + 1] - cu_seqlens_k[b]), "
                f"got a value {'below 0' if smallest < 0 else 'above it'}"
            )


def attn_args(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              sink=None, attn_bias=None, dropout_p=0.0, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, deterministic=False) -> AttnArgs:
    """Validate every argument of a call but q, k and v (checked by :func:`check_qkv` first) and
    return the normalised :class:`AttnArgs` (dropout counters not drawn yet: seed = offset = 0).

    Normalisation: causal folds into the window (``window_right = 0``), and a window ``(-1, 0)``
    is plain causal (as in flash-attn); ``alibi_slopes`` becomes a ``(batch, nheads)`` view,
    ``sink`` float32, ``attn_bias`` a ``(batch, nheads, seqlen_q, seqlen_k)`` view.
    """
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    left, right = check_window(window_size)
    deterministic = check_bool("deterministic", deterministic)
    causal = check_bool("causal", causal) or (left == -1 and right == 0)
    if causal:
        right = 0
    softcap = check_softcap(softcap)
    dropout_p = check_dropout_p(dropout_p)
    nheads = q.shape[-2]
    varlen_args = {}
    if varlen:
        if attn_bias is not None:
            raise NotImplementedError(
                "attn_bias with variable-length sequences (cu_seqlens_q/cu_seqlens_k): no flashtile backend serves "
                "a bias on packed sequences; pad the batch (flashtile.pad_input) and call flash_attn_func(..., attn_bias=...)"
            )
        max_q, max_k = check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
        batch = cu_seqlens_q.shape[0] - 1
        varlen_args = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q,
                           max_seqlen_k=max_k, seqused_k=seqused_k, total_k=k.shape[0])
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
    return AttnArgs(
        softmax_scale=scale, causal=causal, window_left=left, window_right=right, softcap=softcap,
        alibi_slopes=None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, batch, nheads, q.device),
        sink=None if sink is None else check_sink(sink, nheads, q.device),
        attn_bias=None if attn_bias is None else check_attn_bias(attn_bias, (batch, nheads, seqlen_q, seqlen_k), q.device),
        dropout_p=dropout_p, deterministic=bool(deterministic), **varlen_args,
    )


# ---------------------------------------------------------------- flash_attn_with_kvcache

CACHE_LAYOUT = "(batch_cache, seqlen_cache, nheads_kv, headdim)"
PAGED_LAYOUT = "(num_blocks, page_size, nheads_kv, headdim)"
NEW_LAYOUT = "(batch, seqlen_new, nheads_kv, headdim)"


def _check_head_dim(name: str, t: torch.Tensor) -> None:
    dim = t.shape[-1]
    if dim % 8 != 0 or dim < 8 or dim > MAX_HEADDIM:
        raise ValueError(
            f"the head dim of {name} must be a multiple of 8 between 8 and {MAX_HEADDIM}, got {dim} "
            f"({name} {tuple(t.shape)}); pad it to the next multiple of 8"
        )


def check_kvcache(q, k_cache, v_cache, k, v, paged: bool) -> None:
    """Shapes, dtypes and devices of ``flash_attn_with_kvcache``'s tensors (no values read).

    ``q`` ``(batch, seqlen_q, nheads, headdim)``; ``k_cache``, ``v_cache`` ``(batch_cache,
    seqlen_cache, nheads_kv, headdim[_v])`` or, ``paged``, ``(num_blocks, page_size, nheads_kv,
    headdim[_v])``; ``k``, ``v`` None or ``(batch, seqlen_new, nheads_kv, headdim[_v])``.
    """
    layout = PAGED_LAYOUT if paged else CACHE_LAYOUT
    check_tensor("q", q, 4, DENSE_LAYOUT)
    # An FP8 cache (float8_e4m3fn, with k_descale / v_descale) holds q's 16-bit keys and values quantized.
    fp8 = isinstance(k_cache, torch.Tensor) and k_cache.dtype in FP8_DTYPES
    cache_dtypes = (torch.float8_e4m3fn,) if fp8 else SUPPORTED_DTYPES
    check_tensor("k_cache", k_cache, 4, layout, cache_dtypes)
    check_tensor("v_cache", v_cache, 4, layout, cache_dtypes)
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"the new tokens k and v must be given together, got {given} but {missing}=None")
    tensors = [("q", q)] if fp8 else [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if k is not None:
        check_tensor("k", k, 4, NEW_LAYOUT)
        check_tensor("v", v, 4, NEW_LAYOUT)
        tensors += [("k", k), ("v", v)]
    if len({t.dtype for _, t in tensors}) > 1:
        dtypes = ", ".join(f"{name}={t.dtype}" for name, t in tensors)
        raise TypeError(f"q, k_cache, v_cache (and k, v) must share one dtype, got {dtypes}")
    placed = tensors + [("k_cache", k_cache), ("v_cache", v_cache)] if fp8 else tensors
    if len({t.device for _, t in placed}) > 1:
        devices = ", ".join(f"{name}={t.device}" for name, t in placed)
        raise ValueError(f"q, k_cache, v_cache (and k, v) must be on one device, got {devices}")
    batch, seqlen_q, nheads, headdim = q.shape
    if batch < 1 or seqlen_q < 1:
        raise ValueError(f"q must have batch >= 1 and seqlen_q >= 1, got q {tuple(q.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        if paged and k_cache.shape[1] != v_cache.shape[1]:
            raise ValueError(
                f"k_cache and v_cache must have the same page_size (dim 1 of {PAGED_LAYOUT}), got k_cache "
                f"{tuple(k_cache.shape)} (page_size {k_cache.shape[1]}) and v_cache {tuple(v_cache.shape)} "
                f"(page_size {v_cache.shape[1]})"
            )
        raise ValueError(
            f"k_cache and v_cache must agree on every dim of {layout} but the head dim, got k_cache "
            f"{tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}"
        )
    nheads_kv = k_cache.shape[2]
    if k_cache.shape[3] != headdim:
        raise ValueError(
            f"headdim mismatch: q has headdim {headdim} but k_cache has headdim {k_cache.shape[3]} "
            f"(q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)})"
        )
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads of q must be a multiple of nheads_kv of k_cache/v_cache, got q nheads={nheads} and "
            f"k_cache nheads_kv={nheads_kv} (q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)})"
        )
    _check_head_dim("q", q)
    _check_head_dim("v_cache", v_cache)
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache must hold at least one token per {'page' if paged else 'sequence'}, got {tuple(k_cache.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # Written in place: a copy made to fix the strides would be written instead of the caller's cache.
        if cache.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride(-1) == 1), got strides {cache.stride()} "
                f"(shape {tuple(cache.shape)}); it is written in place, so it cannot be copied to fix this"
            )
    if k is not None:
        if k.shape[0] != batch:
            raise ValueError(f"batch mismatch: q has batch {batch} but k has batch {k.shape[0]} (k {tuple(k.shape)})")
        if k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(
                f"k must have the nheads_kv and headdim of k_cache ({k_cache.shape[2]}, {k_cache.shape[3]}), got k "
                f"{tuple(k.shape)} and k_cache {tuple(k_cache.shape)}"
            )
        if v.shape[:3] != k.shape[:3] or v.shape[3] != v_cache.shape[3]:
            raise ValueError(
                f"v must have k's batch, seqlen_new and nheads_kv and v_cache's head dim, got v {tuple(v.shape)}, "
                f"k {tuple(k.shape)}, v_cache {tuple(v_cache.shape)}"
            )


def _check_index_tensor(name: str, t, shape: tuple, layout: str, device) -> None:
    """An int32 tensor of ``shape`` (described by ``layout``) on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32, {layout}) or None, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype} ({_describe(t)}); use .to(torch.int32)")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def check_block_table(block_table, batch: int, device) -> None:
    """int32 ``(batch, max_blocks_per_seq)`` on ``device``, at least one page per sequence."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor (int32, (batch, max_blocks_per_seq)) or None, "
                        f"got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype} ({_describe(block_table)}); "
                        "use .to(torch.int32)")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape (batch, max_blocks_per_seq) = ({batch}, >= 1), "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on q's device {device}, got {block_table.device}")


def check_rotary(rotary_cos, rotary_sin, headdim: int, device, has_new_tokens: bool) -> None:
    """``(seqlen_ro, rotary_dim / 2)`` cos and sin tables, ``rotary_dim <= headdim``; only with new tokens."""
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise ValueError(f"rotary_cos and rotary_sin must be given together, got {given} but {missing}=None")
    if not has_new_tokens:
        raise ValueError(
            "rotary_cos/rotary_sin rotate q and the new tokens k at their positions, so they need k and v; got "
            "k=None (rotate q yourself when nothing is appended)"
        )
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _check_small_tensor(name, table, device, SUPPORTED_DTYPES, "(seqlen_ro, rotary_dim / 2)")
        if table.dim() != 2:
            raise ValueError(f"{name} must be 2-d (seqlen_ro, rotary_dim / 2), got {table.dim()} dims ({_describe(table)})")
    if rotary_cos.shape != rotary_sin.shape or rotary_cos.dtype != rotary_sin.dtype:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape and dtype, got rotary_cos "
                         f"({_describe(rotary_cos)}) and rotary_sin ({_describe(rotary_sin)})")
    seqlen_ro, half = rotary_cos.shape
    if seqlen_ro < 1 or half < 1 or 2 * half > headdim:
        raise ValueError(
            f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with seqlen_ro >= 1 and 2 <= rotary_dim <= "
            f"headdim = {headdim}, got {tuple(rotary_cos.shape)} (rotary_dim = {2 * half})"
        )


def _check_num_splits(num_splits) -> int:
    if not _is_int(num_splits) or isinstance(num_splits, torch.Tensor):
        raise TypeError(f"num_splits must be a Python int (0 = chosen from the shapes), got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = chosen from the shapes), got {num_splits}")
    return int(num_splits)


# (value, batch, device) -> int32 tensor: a decode loop that passes an int reuses one tensor.
_SEQLENS_TENSORS: dict = {}


def _seqlens_tensor(value: int, batch: int, device) -> torch.Tensor:
    """``cache_seqlens`` given as an int, as the int32 ``(batch,)`` tensor the backends take; no host sync."""
    key = (value, batch, device)
    tensor = _SEQLENS_TENSORS.get(key)
    if tensor is None:
        tensor = torch.full((batch,), value, dtype=torch.int32, device=device)
        # Never keep one made while tracing (a fake tensor) or capturing a graph (filled only on replay).
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not (torch.compiler.is_compiling() or capturing):
            if len(_SEQLENS_TENSORS) >= 64:
                _SEQLENS_TENSORS.clear()
            _SEQLENS_TENSORS[key] = tensor
    return tensor


def check_cache_seqlens(cache_seqlens, batch: int, capacity: int, seqlen_new: int, where: str, device) -> torch.Tensor:
    """``cache_seqlens`` (int, int32 ``(batch,)`` tensor or None = full) as an int32 ``(batch,)`` tensor."""
    if cache_seqlens is None or _is_int(cache_seqlens):
        value = capacity if cache_seqlens is None else int(cache_seqlens)
        said = f"cache_seqlens=None (the cache is full: {capacity} tokens)" if cache_seqlens is None else f"cache_seqlens={value}"
        if value < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {value}")
        if value + seqlen_new > capacity:
            raise ValueError(
                f"{said} plus seqlen_new={seqlen_new} new tokens is {value + seqlen_new}, past the cache capacity of "
                f"{capacity} tokens per sequence ({where}); nothing was written"
            )
        return _seqlens_tensor(value, batch, device)
    _check_index_tensor("cache_seqlens", cache_seqlens, (batch,), "an int or (batch,)", device)
    return cache_seqlens


def kvcache_args(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                 cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, sink=None,
                 num_splits=0, k_descale=None, v_descale=None) -> KVCacheArgs:
    """Validate every argument of ``flash_attn_with_kvcache`` and return the normalised :class:`KVCacheArgs`.

    Normalisation as in :func:`attn_args` (causal folds into ``window_right = 0``, ``alibi_slopes``
    becomes a ``(batch, nheads)`` view, ``sink`` float32), and ``cache_seqlens`` given as an int or
    None (the cache is full) becomes an int32 ``(batch,)`` tensor. The checks of the index tensors'
    values (lengths within the capacity, ``cache_leftpad <= cache_seqlens``, ``cache_batch_idx``
    rows and the pages a sequence uses inside the cache, rotary tables long enough) run when
    :func:`values_checked` allows it.
    """
    paged = block_table is not None
    check_kvcache(q, k_cache, v_cache, k, v, paged)
    batch, seqlen_q, nheads, headdim = q.shape
    device = q.device
    seqlen_new = 0 if k is None else k.shape[1]
    if paged:
        check_block_table(block_table, batch, device)
        for name, given in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if given is not None:
                raise NotImplementedError(
                    f"{name} with a paged KV cache (block_table) is not supported (nor is it in flash-attn); "
                    f"the block table already says where each sequence's keys are"
                )
        capacity = block_table.shape[1] * k_cache.shape[1]
        where = (f"block_table {tuple(block_table.shape)} gives each sequence {block_table.shape[1]} pages of "
                 f"page_size={k_cache.shape[1]} tokens")
    else:
        capacity = k_cache.shape[1]
        where = f"seqlen_cache of k_cache {tuple(k_cache.shape)}"
        if cache_batch_idx is not None:
            _check_index_tensor("cache_batch_idx", cache_batch_idx, (batch,), "(batch,)", device)
        elif k_cache.shape[0] < batch:
            raise ValueError(
                f"k_cache holds {k_cache.shape[0]} sequences (batch_cache of {tuple(k_cache.shape)}) but q has batch "
                f"{batch}; pass cache_batch_idx to say which cache row each batch row uses"
            )
        if cache_leftpad is not None:
            _check_index_tensor("cache_leftpad", cache_leftpad, (batch,), "(batch,)", device)
    if seqlen_new > capacity:
        raise ValueError(f"k and v hold seqlen_new={seqlen_new} new tokens per sequence, more than the cache capacity of "
                         f"{capacity} ({where})")
    cache_seqlens = check_cache_seqlens(cache_seqlens, batch, capacity, seqlen_new, where, device)
    k_descale, v_descale = check_cache_descales(k_cache, k_descale, v_descale, batch, device)
    check_rotary(rotary_cos, rotary_sin, headdim, device, k is not None)
    num_splits = _check_num_splits(num_splits)

    scale = check_softmax_scale(softmax_scale, headdim)
    left, right = check_window(window_size)
    causal = check_bool("causal", causal) or (left == -1 and right == 0)
    if causal:
        right = 0
    softcap = check_softcap(softcap)
    if values_checked(device):
        # flash-attn's rule: q sits at the new tokens' positions when causal or windowed, else all at cache_seqlens.
        q_per_token = causal or left >= 0 or right >= 0
        _check_kvcache_values(k_cache, seqlen_q, seqlen_new, capacity, where, cache_seqlens, cache_batch_idx,
                              cache_leftpad, block_table, rotary_cos, q_per_token)
    return KVCacheArgs(
        softmax_scale=scale, causal=causal, window_left=left, window_right=right, softcap=softcap,
        alibi_slopes=None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, batch, nheads, device),
        sink=None if sink is None else check_sink(sink, nheads, device),
        max_seqlen_q=seqlen_q, max_seqlen_k=capacity, cache_seqlens=cache_seqlens, seqlen_new=seqlen_new,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=bool(rotary_interleaved), num_splits=num_splits,
        k_descale=k_descale, v_descale=v_descale,
    )


def _check_kvcache_values(k_cache, seqlen_q, seqlen_new, capacity, where, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table, rotary_cos, q_per_token) -> None:
    """The value checks of :func:`kvcache_args`, with one device->host copy for all of them."""
    batch = cache_seqlens.shape[0]
    parts = [cache_seqlens]
    parts += [t for t in (cache_leftpad, cache_batch_idx) if t is not None]
    if block_table is not None:
        page_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
        # Only the pages a sequence uses are read: entries past them may hold anything (e.g. -1).
        pages_used = (cache_seqlens.long().clamp(min=0) + seqlen_new + page_size - 1) // page_size
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
        bad = (used & ((block_table < 0) | (block_table >= num_blocks))).flatten()
        first = bad.to(torch.int64).argmax()
        parts += [bad.any().reshape(1), first.reshape(1), block_table.flatten()[first].reshape(1)]
    values = torch.cat([t.to(torch.int64).flatten() for t in parts]).tolist()
    device_errors.check_if_strict()  # the host has waited for the device: strict mode reads the record here
    seqlens, rest = values[:batch], values[batch:]
    leftpad = batch_idx = None
    if cache_leftpad is not None:
        leftpad, rest = rest[:batch], rest[batch:]
    if cache_batch_idx is not None:
        batch_idx, rest = rest[:batch], rest[batch:]

    for b, length in enumerate(seqlens):
        if length < 0:
            raise ValueError(f"cache_seqlens[{b}] = {length} is negative")
        if length + seqlen_new > capacity:
            total = f"cache_seqlens[{b}] + seqlen_new = {length} + {seqlen_new} = {length + seqlen_new}" if seqlen_new \
                else f"cache_seqlens[{b}] = {length}"
            raise ValueError(f"{total} exceeds the cache capacity of {capacity} tokens per sequence ({where}); "
                             "nothing was written")
    if leftpad is not None:
        for b, (pad, length) in enumerate(zip(leftpad, seqlens)):
            if not 0 <= pad <= length:
                raise ValueError(f"cache_leftpad[{b}] = {pad} must be between 0 and cache_seqlens[{b}] = {length}")
    if batch_idx is not None:
        for b, row in enumerate(batch_idx):
            if not 0 <= row < k_cache.shape[0]:
                raise ValueError(f"cache_batch_idx[{b}] = {row} is not a row of k_cache (batch_cache = {k_cache.shape[0]}, "
                                 f"shape {tuple(k_cache.shape)})")
        if seqlen_new:
            first = {}
            for b, row in enumerate(batch_idx):
                if row in first:
                    raise ValueError(
                        f"cache_batch_idx[{first[row]}] and cache_batch_idx[{b}] are both {row}: two batch rows would "
                        f"append their {seqlen_new} new token(s) to one cache row; give each appending batch row its "
                        "own cache row (rows may be shared only when nothing is appended, k=None)")
                first[row] = b
    if block_table is not None:
        any_bad, first, page = rest
        if any_bad:
            row, col = divmod(first, block_table.shape[1])
            raise ValueError(
                f"block_table[{row}, {col}] = {page} is not a page of k_cache (num_blocks = {k_cache.shape[0]}, shape "
                f"{tuple(k_cache.shape)}); the first ceil((cache_seqlens[b] + seqlen_new) / page_size) entries of each "
                f"row must be in [0, num_blocks)"
            )
    if rotary_cos is not None:
        seqlen_ro = rotary_cos.shape[0]
        for b, length in enumerate(seqlens):
            last_k = length + seqlen_new - 1
            last_q = length + (seqlen_q - 1 if q_per_token else 0)
            if max(last_k, last_q) >= seqlen_ro:
                which = (f"the new key {seqlen_new - 1} sits at cache_seqlens[{b}] + {seqlen_new - 1} = {last_k}"
                         if last_k >= last_q else f"query {seqlen_q - 1} sits at cache_seqlens[{b}] + {seqlen_q - 1} = {last_q}")
                raise ValueError(
                    f"rotary_cos/rotary_sin have {seqlen_ro} positions (shape {tuple(rotary_cos.shape)}) but batch row {b} "
                    f"needs position {max(last_k, last_q)} ({which}); give tables of at least {max(last_k, last_q) + 1} rows"
                )


def check_merge_states(out_a, lse_a, out_b, lse_b) -> None:
    """Two partial attention results: outs ``(batch, seqlen, nheads, headdim)`` of one shape and dtype,
    lses float32 ``(batch, nheads, seqlen)``, all on one device."""
    layout = "(batch, seqlen, nheads, headdim)"
    check_tensor("out_a", out_a, 4, layout)
    check_tensor("out_b", out_b, 4, layout)
    batch, seqlen, nheads, _ = out_a.shape
    expected = (batch, nheads, seqlen)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(lse).__name__}")
        if lse.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32 (the lse flashtile returns), got {lse.dtype}")
        if tuple(lse.shape) != expected:
            raise ValueError(f"{name} must have shape (batch, nheads, seqlen) = {expected} to match out_a "
                             f"{tuple(out_a.shape)}, got {tuple(lse.shape)}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have one shape {layout}, got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if out_a.dtype != out_b.dtype:
        raise TypeError(f"out_a and out_b must share one dtype, got {out_a.dtype} and {out_b.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) > 1:
        raise ValueError(f"out_a, lse_a, out_b, lse_b must be on one device, got out_a={out_a.device}, "
                         f"lse_a={lse_a.device}, out_b={out_b.device}, lse_b={lse_b.device}")


# ---------------------------------------------------------------- FP8 attention

# The head dims FP8 attention serves: the Hadamard rotation needs a power of two; the Gluon FP8 kernel's dims.
FP8_HEAD_DIMS = (64, 128, 256)
# Rows of one head that share a descale under block quantization.
FP8_BLOCK = QUANT_BLOCK


def check_fp8_head_dims(q, v) -> None:
    """FP8 attention serves head dims 64, 128 and 256 (the Hadamard rotation's powers of two, the FP8 kernel's
    dims), one head dim for q, k and v."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"FP8 attention supports headdim 64, 128 or 256, got headdim={head_dim} "
                         f"(q {tuple(q.shape)}); use flash_attn_func with 16-bit inputs for other head dims")
    if head_dim_v != head_dim:
        raise ValueError(f"FP8 attention needs v's head dim equal to q's, got headdim_v={head_dim_v} and "
                         f"headdim={head_dim} (v {tuple(v.shape)})")


def check_fp8_options(dropout_p, alibi_slopes, sink, attn_bias) -> None:
    """The variants the FP8 path does not compute: each named."""
    for name, value, off in (("dropout_p", dropout_p, 0.0), ("alibi_slopes", alibi_slopes, None), ("sink", sink, None),
                             ("attn_bias", attn_bias, None)):
        if (value is not None) if off is None else (value != off):
            shown = value if off is not None else _describe(value) if isinstance(value, torch.Tensor) else value
            raise NotImplementedError(f"{name}={shown} is not implemented for FP8 attention (float8_e4m3fn q, k, v); "
                                      "pass 16-bit inputs to use it")


def check_descales(q, k, q_descale, k_descale, v_descale, batch: int, seqlen_q: int, seqlen_k: int) -> bool:
    """FA3's descales of float8_e4m3fn q, k, v: float32, on q's device, each per tensor ``(batch, nheads_kv)``
    or per block of 128 rows: q's ``(batch, nheads_kv, cdiv(seqlen_q, 128))`` (a block's scale shared by a KV
    group's query heads, what the FP8 kernel takes) or ``(batch, nheads, cdiv(seqlen_q, 128))`` (per query
    head), k's and v's ``(batch, nheads_kv, cdiv(seqlen_k, 128))`` (varlen: ``batch`` sequences, blocks from each
    sequence's start, ``seqlen`` the longest sequence). Returns whether any is per block."""
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    per_tensor = (batch, nheads_kv)
    blocks_q, blocks_k = max(1, -(-seqlen_q // FP8_BLOCK)), max(1, -(-seqlen_k // FP8_BLOCK))
    per_block = {"q_descale": [(batch, nheads_kv, blocks_q), (batch, nheads, blocks_q)],
                 "k_descale": [(batch, nheads_kv, blocks_k)], "v_descale": [(batch, nheads_kv, blocks_k)]}
    any_block = False
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        blocks = " or ".join(str(shape) for shape in dict.fromkeys(per_block[name]))
        if t is None:
            raise ValueError(f"float8_e4m3fn q, k, v need {name} (float32 {per_tensor} per (batch, KV head), or "
                             f"{blocks} per block of {FP8_BLOCK} rows); got None")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32 torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {t.dtype} ({_describe(t)})")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if tuple(t.shape) in per_block[name]:
            any_block = True
        elif tuple(t.shape) != per_tensor:
            raise ValueError(f"{name} must have shape (batch, nheads_kv) = {per_tensor} or, per block of {FP8_BLOCK} "
                             f"rows, {blocks}; got {tuple(t.shape)}")
    return any_block


def check_cache_descales(k_cache, k_descale, v_descale, batch: int, device) -> tuple:
    """The descales of an FP8 KV cache: float32 ``(nheads_kv,)`` or ``(batch, nheads_kv)`` (per row of the call),
    both given exactly when the cache is float8_e4m3fn; returned as ``(batch, nheads_kv)`` views (a per-head
    descale with batch stride 0), or ``(None, None)`` for a 16-bit cache."""
    nheads_kv = k_cache.shape[2]
    if k_cache.dtype != torch.float8_e4m3fn:
        for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None:
                raise ValueError(f"{name} applies to a float8_e4m3fn KV cache, got k_cache of dtype {k_cache.dtype}; "
                                 "drop it, or build the cache in torch.float8_e4m3fn")
        return None, None
    checked = []
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        expected = f"float32 (nheads_kv,) = ({nheads_kv},) or (batch, nheads_kv) = ({batch}, {nheads_kv})"
        if t is None:
            raise ValueError(f"a float8_e4m3fn KV cache needs {name} ({expected}); got None")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor ({expected}), got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {t.dtype} ({_describe(t)})")
        if t.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
        if tuple(t.shape) not in ((nheads_kv,), (batch, nheads_kv)):
            raise ValueError(f"{name} must have shape ({nheads_kv},) or ({batch}, {nheads_kv}) (nheads_kv of k_cache "
                             f"{tuple(k_cache.shape)}, batch of q), got {tuple(t.shape)}")
        checked.append(t.detach().expand(batch, nheads_kv))
    return tuple(checked)
