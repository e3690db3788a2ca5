"""Hugging Face transformers models with flashtile attention: ``attn_implementation="flashtile"``.

    from flashtile.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtile")

:func:`register` adds the name to transformers' ``AttentionInterface`` (:func:`flashtile_attention_forward`)
and ``AttentionMaskInterface`` (:func:`flashtile_attention_mask`). As on transformers' flash-attention
path, the mask a model builds for "flashtile" is the 2-D padding mask ``(batch, seqlen_k)`` or None,
never a ``seqlen x seqlen`` tensor: a padded batch (left padding from ``generate()``, or right
padding) runs through :func:`flashtile.flash_attn_varlen_func` with per-sequence offsets, a batch
without padding through :func:`flashtile.flash_attn_func` on the model's own tensors. A decoding step
over left padding (no gradient wanted) reads the cache in place through
:func:`flashtile.flash_attn_with_kvcache`, each row's padding as ``cache_leftpad``.

What the model's attention layer asks for and what flashtile receives:

- ``module.is_causal`` (or an ``is_causal`` keyword, which wins) -> ``causal``, bottom-right aligned:
  while decoding, a query sees the whole cache. In a bidirectional layer without a window (an encoder,
  cross-attention) every query attends to its row's real keys.
- ``sliding_window=W`` -> ``window_size=(W - 1, 0)``: transformers' sliding-window mask
  (``sliding_window_overlay``: ``kv_idx > q_idx - W``) lets a token see itself and the ``W - 1``
  tokens before it.
- ``softcap`` (Gemma-2's ``attn_logit_softcapping``) -> ``softcap``; ``s_aux`` (gpt-oss's ``sinks``,
  ``(nheads,)``) -> ``sink``; ``scaling`` -> ``softmax_scale``; ``dropout`` -> ``dropout_p`` while
  ``module.training`` (as in transformers' eager attention).
- K/V heads fewer than query heads (GQA/MQA): passed as they are, never repeated.
- Packed sequences (padding-free batches): ``cu_seq_lens_q/k`` and ``max_length_q/k`` keywords, or
  ``position_ids`` of one row that restart at their minimum -> the varlen path.

What flashtile does not serve is never dropped silently:

- ``output_attentions=True``, a ``position_bias``, and dtypes, head dims or devices flashtile lacks run
  an eager attention here, recorded as a fallback (``flashtile.stats()["fallbacks"]``, warned once,
  :class:`~flashtile.FallbackError` in strict mode).
- Mask patterns a padding mask cannot state (a model's own ``or_mask_function`` / ``and_mask_function``,
  e.g. Gemma-3's bidirectional image tokens; bidirectional sliding windows): the mask
  function builds the 4-D boolean mask and flashtile runs it as ``attn_bias`` (logged at INFO).
  A 4-D mask a caller passes runs as ``attn_bias`` too.
- Anything else (a 2-D mask that is not 0/1, a flex-attention ``BlockMask``, a 3-D mask) raises.

transformers 5.x reads every ``attn_implementation`` whose name contains "flash" as a flash-attn
kernel to import (and gpt-oss swaps such names for a hub kernel), so :func:`register` also makes
``PreTrainedModel`` accept exactly the name "flashtile" as the registered function it is.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import weakref

import torch
import torch.nn.functional as F

from ..autograd import wants_grad
from ..dispatch import preferred_backend, record_fallback
from ..interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from ..padding import pad_input, unpad_input
from ..validation import MAX_HEADDIM, SUPPORTED_DTYPES

__all__ = ["NAME", "register", "flashtile_attention_forward", "flashtile_attention_mask"]

NAME = "flashtile"
# The backend name under which the calls this module computes itself are counted in flashtile.stats().
EAGER_BACKEND = "eager"
_DEVICE_TYPES = ("cpu", "cuda")
# transformers.masking_utils' mask pieces that a padding mask plus causal / window_size / varlen states exactly.
_CAUSAL_PIECES = ("causal_mask_function",)
_EXPRESSIBLE_PIECES = _CAUSAL_PIECES + (
    "bidirectional_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",  # with causal: window_size=(W - 1, 0)
    "packed_sequence_mask_function.<locals>.inner_mask",  # the attention function reads it from position_ids
    "padding_mask_function.<locals>.inner_mask",
)

logger = logging.getLogger(__name__)


def register() -> str:
    """Register ``"flashtile"`` with transformers' attention and attention-mask interfaces.

    After it, ``AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")``,
    ``from_pretrained(..., attn_implementation="flashtile")`` and
    ``model.set_attn_implementation("flashtile")`` run the model's attention layers with
    :func:`flashtile_attention_forward`. Calling it again does nothing more.

    Returns:
        The name, ``"flashtile"``.

    Raises:
        ImportError: transformers is not installed.
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
    except ImportError as error:
        raise ImportError("flashtile.integrations.transformers needs transformers: pip install transformers") from error
    AttentionInterface.register(NAME, flashtile_attention_forward)
    AttentionMaskInterface.register(NAME, flashtile_attention_mask)
    _accept_name(PreTrainedModel)
    return NAME


def _accept_name(model_class) -> None:
    """Make ``model_class`` take ``attn_implementation="flashtile"`` as the registered function it is.

    transformers 5.x treats every name containing "flash" as a flash-attn kernel: at model init it
    imports one for the name (a hub kernel, which fails for "flashtile"), and models that list their
    ``_compatible_flash_implementations`` (gpt-oss) swap the name for one of those.
    """
    original = model_class._check_and_adjust_attn_implementation
    if getattr(original, "_flashtile_accepts", False):
        return

    @functools.wraps(original)
    def check_and_adjust(self, attn_implementation, *args, **kwargs):
        if attn_implementation == NAME:
            if not type(self)._can_set_attn_implementation():
                # Its attention layers do not call the AttentionInterface: flashtile would never run.
                logger.warning("%s does not dispatch its attention through transformers' AttentionInterface; "
                               "attn_implementation=%r will not run flashtile", type(self).__name__, NAME)
            return NAME
        if attn_implementation == f"paged|{NAME}":
            raise ValueError(f"attn_implementation='paged|{NAME}': flashtile has no paged attention for "
                             f"continuous batching; use attn_implementation={NAME!r}")
        return original(self, attn_implementation, *args, **kwargs)

    check_and_adjust._flashtile_accepts = True
    model_class._check_and_adjust_attn_implementation = check_and_adjust


def flashtile_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function contract, computed by flashtile.

    Args:
        module: the attention layer (``is_causal``, ``training`` are read from it).
        query: ``(batch, nheads, seqlen_q, headdim)``.
        key: ``(batch, nheads_kv, seqlen_k, headdim)``; value: ``(batch, nheads_kv, seqlen_k, headdim_v)``
            (the KV cache included: ``seqlen_k > seqlen_q`` while decoding).
        attention_mask: what :func:`flashtile_attention_mask` built: None (no padding), or bool
            ``(batch, seqlen_k)`` with True for tokens and False for padding; or a 4-D mask
            broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)`` (bool, True = attend, or float,
            added to the scores) that replaces the causal mask and the window.
        scaling: softmax scale, default ``1 / sqrt(headdim)``.
        dropout: attention dropout, applied only while ``module.training``.
        sliding_window: ``W``: a token sees itself and the ``W - 1`` tokens before it.
        softcap: ``> 0`` caps the scores with ``softcap * tanh(s / softcap)``.
        is_causal: overrides ``module.is_causal``.
        s_aux: ``(nheads,)`` attention-sink logits (gpt-oss).
        kwargs: ``position_ids``, ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``,
            ``max_length_k`` (packed sequences), ``output_attentions``, ``position_bias``; others are ignored.

    Returns:
        ``(attn_output, attn_weights)``: ``attn_output`` ``(batch, seqlen_q, nheads, headdim_v)`` in
        query's dtype; ``attn_weights`` None (flashtile never forms them), or
        ``(batch, nheads, seqlen_q, seqlen_k)`` from the eager fallback (``output_attentions=True``).
        In causal or windowed layers the query rows that are padding come out as zeros.
    """
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    window = _window_size(sliding_window, is_causal)
    mask = _check_mask(attention_mask)
    key, value, mask = _drop_unused_cache_slots(key, value, mask)
    softcap = float(softcap) if softcap else 0.0
    position_bias = kwargs.get("position_bias")

    reason = _unsupported(query, key, value, kwargs)
    if reason is not None:
        # stacklevel 2: the warning points at the model's line that called the attention function.
        record_fallback(reason, EAGER_BACKEND, preferred=preferred_backend(query.device), stacklevel=2)
        return _eager_attention(query, key, value, mask, scale=scaling, causal=is_causal, window=window,
                                softcap=softcap, sink=s_aux, dropout_p=dropout_p, position_bias=position_bias,
                                packed=_packed_offsets(query, key, mask, kwargs, module))

    # (batch, nheads, seqlen, headdim) -> flashtile's (batch, seqlen, nheads, headdim): views, no copy.
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    options = dict(dropout_p=dropout_p, softmax_scale=scaling, causal=is_causal, window_size=window, softcap=softcap,
                   sink=s_aux)
    if mask is not None and mask.dim() == 4:
        # The mask already holds the causal pattern and any window.
        options.update(causal=False, window_size=(-1, -1))
        return flash_attn_func(q, k, v, attn_bias=mask, **options), None
    if mask is not None:
        return _padded_attention(q, k, v, mask, options), None
    packed = _packed_offsets(query, key, None, kwargs, module)
    if packed is not None:
        return _packed_attention(q, k, v, packed, options), None
    return flash_attn_func(q, k, v, **options), None


def flashtile_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                             attention_mask=None, **kwargs):
    """transformers' attention-mask contract for "flashtile": the 2-D padding mask, or None.

    Args:
        batch_size, q_length, kv_length: the attention's sizes (``kv_length`` includes the cache).
        q_offset, kv_offset: positions of the first query and key.
        mask_function: the pattern transformers asks for (causal, sliding window, bidirectional, ...).
        attention_mask: bool ``(batch, seen_tokens + q_length)``: True for tokens, False for padding.
        kwargs: ``device``, ``use_vmap`` and the other keywords transformers passes to every mask function.

    Returns:
        None when no key is padding (the attention function then applies causal / window itself);
        else the bool ``(batch, kv_length)`` slice of ``attention_mask`` for the keys (shorter than
        ``kv_length`` for a static cache: its slots past the mask are unused). For a pattern a padding
        mask cannot state (see the module docstring), the bool ``(batch, 1, q_length, kv_length)`` mask
        that transformers' ``sdpa_mask`` builds, which flashtile runs as ``attn_bias``.
    """
    from transformers import masking_utils

    if mask_function is not None and not _padding_mask_states(mask_function, masking_utils):
        logger.info("flashtile: the model's attention mask pattern (%s) is not causal/sliding-window/padding; "
                    "building a (batch, 1, %d, %d) mask for attn_bias", getattr(mask_function, "__qualname__", "?"),
                    q_length, kv_length)
        device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
        return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                       kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                                       allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                                       use_vmap=kwargs.get("use_vmap", False), device=device)
    if attention_mask is None:
        return None
    # A sliding layer's cache holds only the last keys: the mask covers those.
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):  # a host sync, once per mask
        return None
    return attention_mask


def _padding_mask_states(mask_function, masking_utils) -> bool:
    """Whether causal / window_size / varlen on a padding mask state ``mask_function`` exactly."""
    pieces = _and_pieces(mask_function, masking_utils)
    if pieces is None:
        return False
    names = {_piece_name(piece, masking_utils) for piece in pieces}
    if not names <= set(_EXPRESSIBLE_PIECES):
        return False
    # A window without the causal mask is one-sided (no right bound): window_size cannot say that.
    return "sliding_window_overlay.<locals>.inner_mask" not in names or bool(names & set(_CAUSAL_PIECES))


def _and_pieces(mask_function, masking_utils):
    """The functions that ``and_masks`` combined into ``mask_function`` (itself if it is no
    intersection), or None when one of them is an ``or_masks``."""
    name = _piece_name(mask_function, masking_utils)
    if name == "or_masks.<locals>.or_mask":
        return None
    if name != "and_masks.<locals>.and_mask":
        return [mask_function]
    pieces = []
    for part in inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ()):
        part_pieces = _and_pieces(part, masking_utils)
        if part_pieces is None:
            return None
        pieces += part_pieces
    return pieces


def _piece_name(function, masking_utils) -> str | None:
    """``function``'s qualified name when transformers.masking_utils defines it, else None."""
    if getattr(function, "__module__", None) != masking_utils.__name__:
        return None
    return getattr(function, "__qualname__", None)


def _window_size(sliding_window, is_causal: bool) -> tuple:
    """flashtile's ``window_size`` for transformers' ``sliding_window`` (None: no window)."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    # Bidirectional layers: W - 1 on each side, as transformers' flash-attention path does.
    return (sliding_window - 1, 0 if is_causal else sliding_window - 1)


def _check_mask(attention_mask):
    """``attention_mask`` as None, a bool ``(batch, seqlen)`` padding mask, or a bool/float 4-D mask."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"flashtile attention takes attention_mask as None, a (batch, seqlen_k) padding mask or a 4-D tensor, "
            f"got {type(attention_mask).__name__}; a flex_attention BlockMask needs "
            f"attn_implementation='flex_attention'"
        )
    if attention_mask.dim() == 2:
        if attention_mask.is_floating_point() and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(
                f"flashtile attention: a 2-D attention_mask {tuple(attention_mask.shape)} is a padding mask "
                f"(1 = token, 0 = padding), but this float mask holds other values (an additive mask?); pass 0/1 "
                f"values, or a 4-D additive mask (batch, 1, seqlen_q, seqlen_k)"
            )
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    if attention_mask.dim() == 4:
        # Bool keeps, float adds (as in eager); an integer mask is read as a bool one.
        keeps_or_adds = attention_mask.dtype == torch.bool or attention_mask.is_floating_point()
        return attention_mask if keeps_or_adds else attention_mask != 0
    raise ValueError(
        f"flashtile attention takes a 2-D (batch, seqlen_k) padding mask or a 4-D mask broadcastable to "
        f"(batch, nheads, seqlen_q, seqlen_k), got attention_mask of shape {tuple(attention_mask.shape)}"
    )


def _drop_unused_cache_slots(key, value, mask):
    """Align the keys with a 2-D padding mask: a static cache allocates slots past the tokens the mask
    covers (unused, dropped here), and a mask longer than the keys keeps its last ``seqlen_k`` columns."""
    if mask is None or mask.dim() != 2:
        return key, value, mask
    seqlen_k = key.shape[2]
    if seqlen_k > mask.shape[1]:
        return key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]], mask
    return key, value, mask[:, mask.shape[1] - seqlen_k:]


def _unsupported(query, key, value, kwargs) -> str | None:
    """Why flashtile cannot compute this call (the eager fallback will), or None."""
    if kwargs.get("output_attentions", False):
        return "output_attentions=True: flashtile never forms the attention weights"
    if kwargs.get("position_bias") is not None:
        return "position_bias (a per-layer additive bias): the transformers integration does not pass it to attn_bias"
    if query.device.type not in _DEVICE_TYPES:
        return f"device type {query.device.type!r}: flashtile runs on cpu and cuda"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype}: flashtile runs float16, bfloat16 and float32"
    if not (query.dtype == key.dtype == value.dtype):
        return (f"query, key and value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}): "
                "flashtile takes one dtype")
    for name, dim in (("head dim", query.shape[-1]), ("value head dim", value.shape[-1])):
        if dim % 8 != 0 or not 8 <= dim <= MAX_HEADDIM:
            return f"{name} {dim}: flashtile needs a multiple of 8 between 8 and {MAX_HEADDIM}"
    return None


def _padded_attention(q, k, v, mask, options):
    """Attention of a padded batch through the varlen path: ``q`` ``(batch, seqlen_q, nheads, headdim)``,
    ``k``/``v`` ``(batch, seqlen_k, nheads_kv, headdim)``, ``mask`` bool ``(batch, seqlen_k)`` over the keys.

    With a causal mask or a window the queries are the last ``seqlen_q`` tokens of each row (``generate()``
    pads on the left; padding queries come out as zeros), and each sequence's diagonal and window count
    its own tokens only, bottom-right aligned. Without either, every query attends to its row's tokens.

    A decoding step (one query a row) over left padding needing no gradient reads the cache in place:
    ``flash_attn_with_kvcache`` with each row's padding as ``cache_leftpad`` (the split-KV kernel, no copy
    of the keys)."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    # The KV-cache path reads k and v in place: it needs their head dims contiguous (as transformers' caches are).
    decoding = (seqlen_q == 1 and (options["causal"] or options["window_size"] != (-1, -1))
                and options["dropout_p"] == 0 and not wants_grad(q, k, v, options["sink"])
                and k.stride(-1) == 1 and v.stride(-1) == 1)
    # The max_seqlen values below are Python ints: reading them (and these facts) syncs with the device once.
    if decoding:
        leftpad = seqlen_k - mask.sum(1, dtype=torch.int32)
        left_padded = (mask == (torch.arange(seqlen_k, device=mask.device) >= leftpad[:, None])).all()
        every, left_padded = torch.stack([mask.all(), left_padded]).tolist()
    else:
        every, left_padded = bool(mask.all()), False
    if every:
        return flash_attn_func(q, k, v, **options)
    if left_padded:
        full = torch.full((batch,), seqlen_k, dtype=torch.int32, device=q.device)
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=full, cache_leftpad=leftpad,
                                       softmax_scale=options["softmax_scale"], causal=options["causal"],
                                       window_size=options["window_size"], softcap=options["softcap"],
                                       sink=options["sink"])
    k_packed, indices_k, cu_seqlens_k, max_seqlen_k, _ = unpad_input(k, mask)
    v_packed = v.flatten(0, 1)[indices_k]
    if not options["causal"] and options["window_size"] == (-1, -1):
        # No query depends on where it sits: keep every one (cross-attention's queries are not the keys'
        # tokens; an encoder's padding queries get values, as in eager).
        cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(q.flatten(0, 1), k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, seqlen_q,
                                     max_seqlen_k, **options)
        return out.view(batch, seqlen_q, *out.shape[1:])
    if seqlen_q > seqlen_k:
        raise ValueError(f"flashtile attention: {seqlen_q} queries but only {seqlen_k} keys under a padding mask "
                         f"{tuple(mask.shape)}; with a causal mask or a window the queries must be the last tokens "
                         f"of the keys")
    if seqlen_q == seqlen_k:
        q_packed, indices_q = q.flatten(0, 1)[indices_k], indices_k
        cu_seqlens_q, max_seqlen_q = cu_seqlens_k, max_seqlen_k
    elif seqlen_q == 1:
        # Decoding: one query per row, whatever the padding.
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        q_packed, indices_q, max_seqlen_q = q.flatten(0, 1), cu_seqlens_q[:-1].long(), 1
    else:
        q_packed, indices_q, cu_seqlens_q, max_seqlen_q, _ = unpad_input(q, mask[:, seqlen_k - seqlen_q:])
    out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 **options)
    return pad_input(out, indices_q, batch, seqlen_q)


def _packed_offsets(query, key, mask, kwargs, module):
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of the sequences packed along the rows
    of a padding-free batch, or None.

    From the ``cu_seq_lens_q/k`` and ``max_length_q/k`` keywords (``DataCollatorWithFlattening``,
    vision towers), else from ``position_ids`` of one row that restart at their minimum; ``module``: the
    calling layer (one seen again starts another forward, which reads ``position_ids`` again)."""
    if mask is not None:
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        return (cu_q.to(device=query.device, dtype=torch.int32), cu_k.to(device=query.device, dtype=torch.int32),
                int(max_q), int(max_k))
    position_ids = kwargs.get("position_ids")
    seqlen = query.shape[2]
    if (not isinstance(position_ids, torch.Tensor) or query.shape[0] != 1 or key.shape[2] != seqlen
            or tuple(position_ids.shape) != (1, seqlen) or seqlen < 2):
        return None
    # A model passes one position_ids tensor to each of its layers in a forward: read it once (a host sync),
    # not once a layer, which would stall the host at every layer while the GPU drains its queue. A layer
    # that comes again starts another forward, whose positions may have changed in place: read them again.
    if torch.compiler.is_compiling():
        return _offsets_from_positions(position_ids, query.device)
    seen = _positions_seen.get("last")
    if (seen is not None and seen["positions"]() is position_ids and seen["device"] == query.device
            and id(module) not in seen["layers"] and seen["version"] == _version(position_ids)):
        seen["layers"].add(id(module))
        return seen["packed"]
    packed = _offsets_from_positions(position_ids, query.device)
    _positions_seen["last"] = dict(positions=weakref.ref(position_ids), device=query.device, layers={id(module)},
                                   version=_version(position_ids), packed=packed)
    return packed


# The last position_ids _packed_offsets read: the tensor (weakly), its device, the layers that took its
# offsets since, its version counter and the offsets (or None).
_positions_seen: dict = {}


def _version(tensor: torch.Tensor):
    """The tensor's version counter (None for an inference tensor, which keeps none)."""
    return None if tensor.is_inference() else tensor._version


def _offsets_from_positions(position_ids, device):
    """``_packed_offsets`` of one row of ``position_ids`` that restart at their minimum, or None."""
    positions = position_ids[0]
    starts = (positions == positions.min()).nonzero().flatten()  # a host sync, as in transformers' flash path
    starts = starts[starts > 0]
    if starts.numel() == 0:
        return None
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), positions.shape[0])])
    cu_seqlens = bounds.to(device=device, dtype=torch.int32)
    max_seqlen = int(bounds.diff().max())
    return cu_seqlens, cu_seqlens, max_seqlen, max_seqlen


def _packed_attention(q, k, v, packed, options):
    """Attention of sequences packed along the rows of ``(batch, seqlen, nheads, headdim)`` tensors."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = packed
    out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, **options)
    return out.view(q.shape[0], q.shape[1], *out.shape[1:])


def _eager_attention(query, key, value, mask, *, scale, causal, window, softcap, sink, dropout_p, position_bias,
                     packed):
    """Plain softmax attention in transformers' layout, with the weights: the fallback for what flashtile
    does not serve. Same masks as the fast path (causal and window bottom-right aligned, padding over the keys,
    packed sequences apart); float32 scores, K and V repeated over each query-head group (this path only)."""
    batch, nheads, seqlen_q, headdim = query.shape
    if packed is not None:
        # One row of all packed tokens; sequence ids keep them apart.
        cu_seqlens = packed[0].long()
        query, key, value = (x.transpose(0, 1).flatten(1, 2).unsqueeze(0) for x in (query, key, value))
    groups = nheads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(headdim) if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias.float()
    rows_q, rows_k = scores.shape[-2:]
    if mask is not None and mask.dim() == 4:
        keep = mask if mask.dtype == torch.bool else None
        if keep is None:
            scores = scores + mask.float()
    else:
        i = torch.arange(rows_q, device=query.device)[:, None] + (rows_k - rows_q)
        j = torch.arange(rows_k, device=query.device)[None, :]
        keep = torch.ones(rows_q, rows_k, dtype=torch.bool, device=query.device)
        if causal:
            keep &= j <= i
        if window[0] >= 0:
            keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
        if packed is not None:
            sequence = torch.searchsorted(cu_seqlens[1:], torch.arange(rows_k, device=query.device), right=True)
            keep &= sequence[:, None] == sequence[None, :]
        keep = keep[None, None]
        if mask is not None:
            keep = keep & mask[:, None, None, :]
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(torch.float32).min)
    if sink is not None:
        sink_column = sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(query.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, value).transpose(1, 2)
    if packed is not None:
        out = out.reshape(batch, seqlen_q, nheads, -1)
        # Rows flattened into one: their weights are one (total, total) matrix, per row only for batch 1.
        probs = probs if batch == 1 else None
    return out.contiguous(), probs
