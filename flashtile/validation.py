"""Argument checks for the public API.

Every check raises ``ValueError`` or ``TypeError`` that names the argument and
quotes the actual shape, dtype, device or value, and says what was expected.
:func:`attn_args` runs the checks of everything but q, k and v and returns the
normalised :class:`~flashtile.backends.AttnArgs` a backend receives.
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from .backends import AttnArgs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256
DENSE_LAYOUT = "(batch, seqlen, nheads, headdim)"
VARLEN_LAYOUT = "(total_tokens, nheads, headdim)"


def _describe(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}"


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    """``t`` must be a floating tensor of rank ``ndim`` in a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {layout}, got {t.dim()} dims ({_describe(t)})")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has unsupported dtype {t.dtype} ({_describe(t)}); "
            "expected torch.float16, torch.bfloat16 or torch.float32"
        )


def check_packed(name: str, t, parts: int, layout: str, varlen: bool = False) -> tuple:
    """``t`` packs ``parts`` tensors along dim 2 (dim 1 for varlen, which has no batch dim);
    returns them as views (no copy)."""
    dim = 1 if varlen else 2
    check_tensor(name, t, dim + 3, layout)
    if t.shape[dim] != parts:
        raise ValueError(f"{name} must have shape {layout}, got dim {dim} of size {t.shape[dim]} (shape={tuple(t.shape)})")
    return t.unbind(dim)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool = False) -> None:
    """Validate q, k, v: dense ``(batch, seqlen, nheads, headdim)``, or varlen ``(total_tokens, nheads, headdim)``.

    v may have its own head dim (``headdim_v``); everything else of k and v must agree.
    """
    layout = VARLEN_LAYOUT if varlen else DENSE_LAYOUT
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3 if varlen else 4, layout)
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
    """``(nheads,)`` float16/bfloat16/float32; returned as a contiguous float32 copy for the backend."""
    expected = f"(nheads,) = ({nheads},), one logit per query head"
    _check_small_tensor("sink", sink, device, SUPPORTED_DTYPES, expected)
    if tuple(sink.shape) != (nheads,):
        raise ValueError(f"sink must have shape {expected}, got {tuple(sink.shape)}")
    return sink.detach().to(torch.float32).contiguous()


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
    each sequence) read them on the host. For CPU tensors they always run. For CUDA tensors they
    would cost a device->host copy that stalls the host until the GPU catches up, so they run only
    with ``FLASHTILE_VALIDATE_VARLEN=1`` (debugging; the test suite sets it); the varlen path
    otherwise never synchronizes. They are skipped while torch.compile traces (the values are not
    known then).
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
    on_host = cu_seqlens_q.device.type == "cpu" or os.environ.get("FLASHTILE_VALIDATE_VARLEN", "0") not in ("", "0")
    if on_host and not torch.compiler.is_compiling():
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
              max_seqlen_q=None, max_seqlen_k=None, seqused_k=None) -> AttnArgs:
    """Validate every argument of a call but q, k and v (checked by :func:`check_qkv` first) and
    return the normalised :class:`AttnArgs` (dropout counters not drawn yet: seed = offset = 0).

    Normalisation: causal folds into the window (``window_right = 0``), and a window ``(-1, 0)``
    is plain causal (as in flash-attn); ``alibi_slopes`` becomes a ``(batch, nheads)`` view,
    ``sink`` float32, ``attn_bias`` a ``(batch, nheads, seqlen_q, seqlen_k)`` view.
    """
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    left, right = check_window(window_size)
    causal = bool(causal) or (left == -1 and right == 0)
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
                           max_seqlen_k=max_k, seqused_k=seqused_k)
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
    return AttnArgs(
        softmax_scale=scale, causal=causal, window_left=left, window_right=right, softcap=softcap,
        alibi_slopes=None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, batch, nheads, q.device),
        sink=None if sink is None else check_sink(sink, nheads, q.device),
        attn_bias=None if attn_bias is None else check_attn_bias(attn_bias, (batch, nheads, seqlen_q, seqlen_k), q.device),
        dropout_p=dropout_p, **varlen_args,
    )
