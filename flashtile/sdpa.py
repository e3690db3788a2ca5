"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``, and :func:`patch_sdpa` to install it.

:func:`scaled_dot_product_attention` takes torch's layout ``(batch, nheads, seqlen, headdim)``
and torch's semantics (top-left causal mask, ``enable_gqa``) and runs flashtile's
:func:`~flashtile.flash_attn_func` on ``(batch, seqlen, nheads, headdim)`` views of the same
memory; ``attn_mask`` becomes its ``attn_bias`` (a broadcast view, never expanded in memory) and
``dropout_p`` its dropout. A call flashtile cannot serve (float64, a head dim that is not a
multiple of 8, ...) runs torch's own kernel instead and is recorded as a fallback
(:func:`flashtile.stats`, warned once per reason, :class:`~flashtile.FallbackError` in strict
mode): never silently.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from .dispatch import preferred_backend, record_fallback
from .interface import flash_attn_func
from .validation import MAX_HEADDIM, SUPPORTED_DTYPES

# torch's own kernel, saved before any patch_sdpa() can replace it, so a fallback never recurses.
TORCH_SDPA = F.scaled_dot_product_attention
# The backend name under which calls run by torch's own kernel are counted in flashtile.stats().
TORCH_SDPA_BACKEND = "torch_sdpa"
_DEVICE_TYPES = ("cpu", "cuda")

__all__ = ["scaled_dot_product_attention", "patch_sdpa", "SDPAPatch", "TORCH_SDPA"]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by flashtile.

    Args:
        query: ``(batch, nheads, seqlen_q, headdim)``; also ``(nheads, seqlen_q, headdim)``
            (unbatched) or more leading batch dims ``(..., nheads, seqlen_q, headdim)``.
        key: ``(batch, nheads_kv, seqlen_k, headdim)`` with the same leading dims;
            value: ``(batch, nheads_kv, seqlen_k, headdim_v)`` (``headdim_v`` may differ).
            ``nheads_kv == nheads``, or ``nheads_kv == 1`` (broadcast), or with
            ``enable_gqa=True`` any divisor of ``nheads``: query head ``h`` reads KV head
            ``h // (nheads // nheads_kv)`` as in torch, without repeating K and V in memory.
        attn_mask: broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``: bool (True = may
            attend) or float in query's dtype (added to the scaled scores; its gradient is
            computed when it requires grad). With ``is_causal`` too, both apply (as torch does on
            CPU). A float mask in another dtype raises ``RuntimeError``, as torch does.
        dropout_p: dropout on the attention weights with flashtile's RNG (:mod:`flashtile.rng`;
            ``torch.manual_seed`` reproduces it, but the mask differs from torch's). Like torch,
            dropout applies whenever ``dropout_p > 0``, whatever the module's training flag.
        is_causal: torch's causal mask, aligned to the TOP-LEFT corner: query ``i`` sees key
            ``j`` iff ``j <= i``. :func:`flashtile.flash_attn_func` aligns it to the
            bottom-right instead; the two agree only when ``seqlen_q == seqlen_k``::

                seqlen_q=2, seqlen_k=5              seqlen_q=5, seqlen_k=2
                here (top-left)  flash_attn_func    here (top-left)  flash_attn_func
                  1 0 0 0 0        1 1 1 1 0          1 0              0 0
                  1 1 0 0 0        1 1 1 1 1          1 1              0 0
                                                      1 1              0 0
                                                      1 1              1 0
                                                      1 1              1 1

            Here every query sees at least key 0, so no row is empty (when ``seqlen_k > 0``).
        scale: softmax scale, default ``1 / sqrt(headdim)``.
        enable_gqa: allow ``nheads_kv < nheads`` (grouped-query attention).

    flashtile serves float16, bfloat16 and float32 inputs on CPU and CUDA with head dims that
    are multiples of 8 up to 256 (value's may differ from query's). Anything else runs torch's own
    kernel and is recorded as a fallback with the reason (``flashtile.stats()["fallbacks"]``,
    under the backend name ``"torch_sdpa"``); in strict mode it raises
    :class:`~flashtile.FallbackError`. Invalid arguments raise ``RuntimeError``, as torch does.

    Returns:
        ``(batch, nheads, seqlen_q, headdim_v)`` in query's dtype (the same leading dims as
        query): a transposed view of a ``(batch, seqlen_q, nheads, headdim_v)`` buffer, as
        torch's flash backend returns.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(
            f"scaled_dot_product_attention: query, key and value must share one dtype, got query={query.dtype}, "
            f"key={key.dtype}, value={value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise RuntimeError(
            f"scaled_dot_product_attention: query, key and value must be on one device, got query={query.device}, "
            f"key={key.device}, value={value.device}"
        )
    reason = _unsupported(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if reason is not None:
        # stacklevel 2: the warning points at the line that called scaled_dot_product_attention.
        record_fallback(reason, TORCH_SDPA_BACKEND, preferred=preferred_backend(query.device), stacklevel=2)
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    q, k, v = (_as_flash_layout(x) for x in (query, key, value))
    options = dict(softmax_scale=scale, dropout_p=dropout_p, attn_bias=_as_flash_bias(attn_mask, query, key))
    out = _top_left_causal(q, k, v, **options) if is_causal else flash_attn_func(q, k, v, **options)
    # (B, S, H, D) -> (B, H, S, D) and back to query's leading dims: views, no copy.
    return out.transpose(1, 2).reshape(query.shape[:-1] + value.shape[-1:])


def _unsupported(query, key, value, attn_mask, dropout_p, scale, enable_gqa) -> str | None:
    """Why flashtile cannot serve this call (torch's kernel will), or None; raises where torch would."""
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype}: flashtile runs float16, bfloat16 and float32"
    if query.device.type not in _DEVICE_TYPES:
        return f"device type {query.device.type!r}: flashtile's SDPA runs on cpu and cuda"
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested tensors: flashtile has no nested-tensor input"
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return "scale is not a finite positive float"
    if not (query.dim() == key.dim() == value.dim() >= 2) or not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        return "query, key and value have different leading (batch) dims: flashtile does not broadcast them"
    if query.shape[:-2].numel() == 0:
        return "an empty batch or head dim: flashtile needs at least one of each"
    headdim, seqlen_k = query.shape[-1], key.shape[-2]
    if key.shape[-1] != headdim:
        raise RuntimeError(
            f"scaled_dot_product_attention: query and key must have the same head dim, got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if value.shape[-2] != seqlen_k:
        raise RuntimeError(
            f"scaled_dot_product_attention: key and value must have the same seqlen, got key "
            f"{tuple(key.shape)} and value {tuple(value.shape)}"
        )
    for name, dim in (("head dim", headdim), ("value head dim", value.shape[-1])):
        if dim % 8 != 0 or not 8 <= dim <= MAX_HEADDIM:
            return f"{name} {dim}: flashtile needs a multiple of 8 between 8 and {MAX_HEADDIM}"
    reason = _unsupported_mask(attn_mask, query, key)
    if reason is not None:
        return reason
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        return f"dropout_p={dropout_p!r}: flashtile takes a float in [0, 1)"
    if query.dim() == 2:
        return None  # (seqlen, headdim): one head everywhere
    nheads, nheads_kv = query.shape[-3], key.shape[-3]
    if value.shape[-3] != nheads_kv:
        return "key and value have different numbers of heads: flashtile needs them equal"
    if enable_gqa and nheads % nheads_kv != 0:
        raise RuntimeError(
            f"scaled_dot_product_attention: with enable_gqa=True the number of query heads must be a multiple of "
            f"the number of key/value heads, got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if not enable_gqa and nheads_kv not in (nheads, 1):
        if nheads == 1:
            return "query has one head and key/value have several (broadcasting): flashtile does not broadcast query"
        raise RuntimeError(
            f"scaled_dot_product_attention: query has {nheads} heads but key/value have {nheads_kv} "
            f"(query {tuple(query.shape)}, key {tuple(key.shape)}); pass enable_gqa=True for grouped-query attention"
        )
    return None


def _unsupported_mask(attn_mask, query, key) -> str | None:
    """Why flashtile cannot take ``attn_mask`` as its attn_bias, or None; raises where torch would."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"scaled_dot_product_attention: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        raise RuntimeError(
            f"scaled_dot_product_attention: attn_mask must be bool or have query's dtype {query.dtype}, got "
            f"{attn_mask.dtype} (attn_mask {tuple(attn_mask.shape)})"
        )
    if attn_mask.device != query.device or attn_mask.is_nested:
        return "attn_mask on another device or nested: flashtile takes a dense mask on query's device"
    scores = tuple(query.shape[:-1]) + (key.shape[-2],)
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, scores)
    except RuntimeError:
        broadcast = None
    if broadcast != scores:
        raise RuntimeError(
            f"scaled_dot_product_attention: attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable to the "
            f"attention scores' shape {scores} (query {tuple(query.shape)}, key {tuple(key.shape)})"
        )
    return None


def _as_flash_bias(attn_mask, query, key):
    """``attn_mask`` (broadcastable to ``(..., nheads, seqlen_q, seqlen_k)``) as flashtile's attn_bias:
    broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)`` with the leading dims merged into batch."""
    if attn_mask is None or query.dim() <= 4 or attn_mask.dim() <= 3:
        return attn_mask  # already right-aligned with the flash layout's (batch, nheads, seqlen_q, seqlen_k)
    # Several leading dims: merge them as _as_flash_layout does (a copy only if the mask's strides forbid a view).
    scores = tuple(query.shape[:-1]) + (key.shape[-2],)
    return attn_mask.expand(scores).reshape(-1, *scores[-3:])


def _as_flash_layout(x: torch.Tensor) -> torch.Tensor:
    """``(..., nheads, seqlen, headdim)`` as a ``(batch, seqlen, nheads, headdim)`` view."""
    if x.dim() < 4:
        x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    elif x.dim() > 4:
        x = x.flatten(0, -4)  # a view unless the leading dims cannot be merged
    return x.transpose(1, 2)


def _top_left_causal(q, k, v, attn_bias=None, **options):
    """Top-left causal attention (query ``i`` sees keys ``0..i``) on ``(B, S, H, D)`` tensors, from
    flash_attn_func's bottom-right alignment.

    With ``seqlen_q <= seqlen_k`` it is the bottom-right causal mask over the first ``seqlen_q``
    keys (the others are never seen). With ``seqlen_q > seqlen_k`` it is the window
    ``(-1, seqlen_q - seqlen_k)``: ``j <= i + (seqlen_k - seqlen_q) + (seqlen_q - seqlen_k) = i``.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if seqlen_q <= seqlen_k:
        bias = None if attn_bias is None else attn_bias[..., :seqlen_q]  # a size-1 key dim stays as it is
        return flash_attn_func(q, k[:, :seqlen_q], v[:, :seqlen_q], causal=True, attn_bias=bias, **options)
    return flash_attn_func(q, k, v, window_size=(-1, seqlen_q - seqlen_k), attn_bias=attn_bias, **options)


_patch_lock = threading.Lock()
_patch_depth = [0]
_replaced = [None]  # what torch.nn.functional.scaled_dot_product_attention was before the outermost patch


class SDPAPatch:
    """Routes ``torch.nn.functional.scaled_dot_product_attention`` to flashtile while active.

    Use it as a context manager (``with flashtile.patch_sdpa(): ...``) or, for a whole program,
    call ``start()`` once (and ``stop()`` to undo). Patches nest, in any order: the function is
    replaced when the first one starts and restored when the last one stops, also when the
    ``with`` block raises. One object cannot be started twice without a stop in between.
    """

    def __init__(self):
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def start(self) -> SDPAPatch:
        with _patch_lock:
            if self._active:
                raise RuntimeError("patch_sdpa: this patch is already started; call stop() first or use a new patch_sdpa()")
            if _patch_depth[0] == 0:
                _replaced[0] = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = scaled_dot_product_attention
            _patch_depth[0] += 1
            self._active = True
        return self

    def stop(self) -> None:
        with _patch_lock:
            if not self._active:
                raise RuntimeError("patch_sdpa: this patch is not started")
            self._active = False
            _patch_depth[0] -= 1
            if _patch_depth[0] == 0:
                F.scaled_dot_product_attention = _replaced[0]
                _replaced[0] = None

    def __enter__(self) -> SDPAPatch:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def patch_sdpa() -> SDPAPatch:
    """Make ``torch.nn.functional.scaled_dot_product_attention`` run flashtile's
    :func:`scaled_dot_product_attention`, so ``nn.MultiheadAttention``,
    ``nn.TransformerEncoderLayer`` and models that call ``F.scaled_dot_product_attention`` use
    flashtile unchanged::

        with flashtile.patch_sdpa():     # for one block
            loss = model(x).sum()
        flashtile.patch_sdpa().start()   # for the rest of the program (.stop() undoes it)

    Calls flashtile cannot serve run torch's own kernel and are recorded as fallbacks.
    Not routed: code that bound the function before the patch
    (``from torch.nn.functional import scaled_dot_product_attention``), ``nn.MultiheadAttention``
    with ``need_weights=True`` (torch's default; it computes the weights without SDPA), and the
    inference fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` (eval mode,
    ``batch_first``, no autograd), which calls a fused native kernel instead.
    """
    return SDPAPatch()


def is_patched() -> bool:
    """Whether ``torch.nn.functional.scaled_dot_product_attention`` is flashtile's now."""
    return F.scaled_dot_product_attention is scaled_dot_product_attention
