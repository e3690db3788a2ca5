"""Public attention functions (flash-attn compatible, layout ``(batch, seqlen, nheads, headdim)``,
or ``(total_tokens, nheads, headdim)`` for the varlen functions).

Each function validates its arguments (:mod:`flashtile.validation`, which also fills the defaults
into one :class:`~flashtile.backends.AttnArgs`), asks :mod:`flashtile.dispatch` for a backend and
runs the matching autograd Function when a gradient is wanted, else the backend's forward alone
(or, while torch.compile traces, the custom op of :mod:`flashtile.ops`). A dense call that repeats
an earlier one reuses that call's validated arguments and plan (:func:`_attention`), and so does a
KV-cache step whose index values are not read on the host (:func:`flash_attn_with_kvcache`); when it
needs no gradient it is replayed: the earlier call's recorded launches run on the new tensors
(:mod:`flashtile.replay`). :func:`flash_attn_with_kvcache` and :func:`merge_attention_states` are inference-only: they run the
backend directly (no autograd), through a custom op while compiling.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import fp8, ops, replay, validation
from .autograd import (FlashAttnFunc, FlashAttnKVPackedFunc, FlashAttnQKVPackedFunc, draw_dropout_counters,
                       dropout_counters, replay_inputs, run_forward, wants_grad)
from .backends import AttentionCall
from .dispatch import dispatch, merge_call, recall, record_choice, remember, state_key


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    attn_bias=None,
    sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Exact attention ``softmax(q k^T * softmax_scale + ...) v``, with the variants below.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16, bfloat16 or float32.
        k: ``(batch, seqlen_k, nheads_kv, headdim)``; ``nheads`` must be a multiple of ``nheads_kv``
            (GQA/MQA; K and V are never repeated in memory).
        v: ``(batch, seqlen_k, nheads_kv, headdim_v)``; ``headdim_v`` may differ from ``headdim``
            (e.g. 192 / 128); the output has ``headdim_v``. Head dims are multiples of 8 up to 256.
        dropout_p: probability of dropping an attention weight (the kept ones are scaled by
            ``1 / (1 - dropout_p)``). As in flash-attn it applies whenever ``dropout_p > 0``: pass
            0 in eval. The mask comes from :mod:`flashtile.rng`, drawn from torch's default CPU
            generator once per forward (``torch.manual_seed`` reproduces it) and reused by the backward.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal: mask aligned to the bottom-right corner: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``. A query that sees no key outputs 0 with lse ``-inf``::

                seqlen_q=2, seqlen_k=5        seqlen_q=5, seqlen_k=2
                    1 1 1 1 0                     0 0
                    1 1 1 1 1                     0 0
                                                  0 0
                                                  1 0
                                                  1 1
        window_size: ``(left, right)`` sliding window, ``-1`` = unbounded on that side: query ``i``
            sees key ``j`` iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``
            (bottom-right aligned, like ``causal``). With ``causal=True`` the right side is 0, and
            ``(-1, 0)`` is plain causal::

                seqlen_q=4, seqlen_k=6:  window_size=(1, 1)     window_size=(2, 0) or causal + (2, -1)
                                          0 1 1 1 0 0            1 1 1 0 0 0
                                          0 0 1 1 1 0            0 1 1 1 0 0
                                          0 0 0 1 1 1            0 0 1 1 1 0
                                          0 0 0 0 1 1            0 0 0 1 1 1
        softcap: ``> 0`` caps the scaled scores: ``s = softcap * tanh(s / softcap)`` (Gemma-2); 0 = off.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``: adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores (after the softcap).
        deterministic: gradients bit-identical run to run. By default (as in flash-attn) the
            Hopper backward at head dim 128 may add dQ's partial sums in the order its programs
            finish, which moves dQ by float32 rounding between runs; ``True`` (or
            ``torch.use_deterministic_algorithms(True)``) takes a backward whose sums have a fixed
            order, about 1.1-1.2x slower there. Elsewhere the backward is deterministic either way.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen_q)`` float32
            (natural log) and ``None`` in place of the probabilities, as flash-attn does.
        attn_bias: a tensor broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)`` (e.g.
            ``(seqlen_q, seqlen_k)`` or ``(batch, 1, 1, seqlen_k)``; never expanded in memory).
            Float (float16/bfloat16/float32, any of them): added to the scaled, capped scores; its
            gradient (in its own shape and dtype) is computed when it requires grad. Bool: a mask,
            True = may attend.
        sink: ``(nheads,)`` float16/bfloat16/float32 attention-sink logits (gpt-oss): one extra
            logit per query head in every row's softmax denominator, with no value vector. Its
            gradient (in its dtype) is computed when it requires grad. With a sink a row that sees
            no key outputs 0 with lse ``sink[h]``.
        q_descale, k_descale, v_descale: FP8 inputs (FlashAttention-3's API): with float8_e4m3fn q, k, v
            (headdim 64, 128 or 256) the attention of ``q * q_descale``, ``k * k_descale``, ``v * v_descale``
            runs in FP8 and ``out`` is bfloat16. float32 descales, each ``(batch, nheads_kv)`` or per
            block of 128 rows: q's ``(batch, nheads_kv, cdiv(seqlen_q, 128))`` (one scale per block shared by
            a KV group's query heads) or ``(batch, nheads, cdiv(seqlen_q, 128))`` (per query head), k's and
            v's ``(batch, nheads_kv, cdiv(seqlen_k, 128))``. The Hopper kernel takes all but q's per query
            head (where nheads != nheads_kv) and v's per block, which run the torch FP8 math as a recorded
            fallback. Forward only; no dropout, ALiBi, sink or bias. See docs/fp8.md.

    Which backend runs the call, and why, is in :func:`flashtile.explain`; every call is
    counted in :func:`flashtile.stats`.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype, or
        ``(out, softmax_lse, None)`` when ``return_attn_probs``.
    """
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
    if _fp8(q, q_descale, k_descale, v_descale):
        return fp8.fp8_call(q, k, v, dict(options, sink=sink, attn_bias=attn_bias), q_descale, k_descale, v_descale,
                            return_attn_probs)
    return _attention(FlashAttnFunc, (q, k, v), (q, k, v), options, sink, attn_bias, return_attn_probs)


def _fp8(q, *descales) -> bool:
    """Whether a call takes the FP8 path: float8 q, or descales given (whose absence or misuse it then reports)."""
    if isinstance(q, torch.Tensor) and q.dtype in validation.FP8_DTYPES:
        return True
    given = [name for name, t in zip(("q_descale", "k_descale", "v_descale"), descales) if t is not None]
    if given and isinstance(q, torch.Tensor):
        raise ValueError(f"{', '.join(given)} apply to float8_e4m3fn q, k, v only, got q of dtype {q.dtype}; "
                         "drop them, or use flashtile.flash_attn_fp8_func to quantize 16-bit inputs")
    return False


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    attn_bias=None,
    sink=None,
):
    """Attention on packed ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)``.

    q, k and v are read as strided views of ``qkv`` (no copy), and the gradient is one
    packed tensor of ``qkv``'s shape. Other arguments as in :func:`flash_attn_func`.
    """
    q, k, v = validation.check_packed("qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return _attention(FlashAttnQKVPackedFunc, (qkv,), (q, k, v), options, sink, attn_bias, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    attn_bias=None,
    sink=None,
):
    """Attention on ``q`` ``(batch, seqlen_q, nheads, headdim)`` and packed ``kv``
    ``(batch, seqlen_k, 2, nheads_kv, headdim)``, read as views without a copy; dK and dV land
    in one packed gradient. Other arguments as in :func:`flash_attn_func`.
    """
    k, v = validation.check_packed("kv", kv, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return _attention(FlashAttnKVPackedFunc, (q, kv), (q, k, v), options, sink, attn_bias, return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    seqused_k=None,
    sink=None,
    attn_bias=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Attention over a batch of variable-length sequences packed without padding.

    Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` attending to rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` and ``v``; sequences never see each other.
    ``causal``, ``window_size`` and ALiBi positions are those within each sequence, aligned to the
    bottom-right corner of its own ``(seqlen_q_b, seqlen_k_b)`` block. Sequences may be empty.
    :func:`flashtile.unpad_input` packs a padded batch and :func:`flashtile.pad_input` undoes it.

    Args:
        q: ``(total_q, nheads, headdim)``, float16, bfloat16 or float32.
        k: ``(total_k, nheads_kv, headdim)``; v: ``(total_k, nheads_kv, headdim_v)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on q's device: ``0``, then the running
            total of the sequence lengths. Rows past ``cu_seqlens[-1]`` belong to no sequence:
            their values never reach any result (NaN there is fine; the Hopper forward may load
            them with a tile and masks them), and their gradients are 0.
        max_seqlen_q, max_seqlen_k: the longest query / key sequence: a Python int, or a 0-d
            tensor (read with ``.item()``; under torch.compile pass an int).
        seqused_k: optional int32 ``(batch,)``: sequence ``b`` uses only its first
            ``seqused_k[b]`` keys (its causal/window diagonal counts those keys only); the keys past
            them, like rows past ``cu_seqlens[-1]``, never reach a result.
        sink: ``(nheads,)``, as in :func:`flash_attn_func`.
        attn_bias: not served for packed sequences: a tensor raises ``NotImplementedError``.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic:
            as in :func:`flash_attn_func`; ``alibi_slopes`` is ``(nheads,)`` or ``(batch, nheads)``
            with ``batch = len(cu_seqlens_q) - 1``; dropout positions are counted within each sequence.
        q_descale, k_descale, v_descale: with float8_e4m3fn q, k, v, as in :func:`flash_attn_func`, with
            ``batch = len(cu_seqlens_q) - 1``, blocks counted from each sequence's start and ``seqlen`` the
            ``max_seqlen`` of q or k.

    The checks of the offsets' values (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1]``
    at most the number of rows, ``max_seqlen`` at least the longest sequence, ``seqused_k`` within
    each sequence) read them on the host: for CUDA tensors that is one device->host copy per call.

    Returns:
        ``out`` ``(total_q, nheads, headdim_v)`` in q's dtype, or ``(out, softmax_lse, None)``
        when ``return_attn_probs``, with ``softmax_lse`` float32 ``(nheads, total_q)``.
    """
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, varlen=True, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                   deterministic=deterministic)
    if _fp8(q, q_descale, k_descale, v_descale):
        return fp8.fp8_call(q, k, v, dict(options, sink=sink, attn_bias=attn_bias), q_descale, k_descale, v_descale,
                            return_attn_probs)
    return _attention(FlashAttnFunc, (q, k, v), (q, k, v), options, sink, attn_bias, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    sink=None,
    attn_bias=None,
):
    """Varlen self-attention on packed ``qkv`` ``(total, 3, nheads, headdim)``, the same offsets
    ``cu_seqlens`` (int32 ``(batch + 1,)``) and ``max_seqlen`` for queries and keys.

    q, k and v are views of ``qkv`` and the gradient is one packed tensor. Other arguments as in
    :func:`flash_attn_varlen_func`.
    """
    q, k, v = validation.check_packed("qkv", qkv, 3, "(total_tokens, 3, nheads, headdim)", varlen=True)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, varlen=True, cu_seqlens_q=cu_seqlens,
                   cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, seqused_k=None,
                   deterministic=deterministic)
    return _attention(FlashAttnQKVPackedFunc, (qkv,), (q, k, v), options, sink, attn_bias, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    seqused_k=None,
    sink=None,
    attn_bias=None,
):
    """Varlen attention on ``q`` ``(total_q, nheads, headdim)`` and packed ``kv``
    ``(total_k, 2, nheads_kv, headdim)`` (views, no copy; dK and dV land in one packed gradient).

    Other arguments as in :func:`flash_attn_varlen_func`.
    """
    k, v = validation.check_packed("kv", kv, 2, "(total_k, 2, nheads_kv, headdim)", varlen=True)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, varlen=True, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                   deterministic=deterministic)
    return _attention(FlashAttnKVPackedFunc, (q, kv), (q, k, v), options, sink, attn_bias, return_attn_probs)


def _attention(function, inputs, qkv, options, sink, attn_bias, return_attn_probs):
    """Validate and normalise the options, dispatch the call to a backend and run it: through the
    autograd Function when a gradient is wanted, else the backend's forward alone; through the
    custom op (:mod:`flashtile.ops`) while torch.compile traces. A repeated call (same shapes,
    dtypes, devices and options; no tensor options) reuses its first validation and plan; one that
    differs only in its number of keys (a KV cache grown by a token) reuses the validation."""
    q, k, v = qkv
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _signature(function, qkv, options, sink, attn_bias)
    known = None if key is None else recall(key)
    kept = None
    drawn = False
    if known is not None:
        args, chosen, kept = known
        if args.varlen:
            # Packed sequences: the longest lengths (Python ints, as the key asks) may differ from the plan's.
            planned = (chosen.call.seqlen_q, chosen.call.seqlen_k) == (options["max_seqlen_q"], options["max_seqlen_k"])
        else:
            planned = chosen.call.seqlen_k == k.shape[1]
        if planned and kept.forward and not wants_grad(*inputs, sink, attn_bias):
            # A call like an earlier one: its launches again (fastest), when the layouts are the same; with
            # this call's dropout counters, which the ordinary path below takes if no replay fits.
            args, drawn = draw_dropout_counters(args), True
            outputs = replay.replayed(kept.forward, _given(inputs, options, sink, attn_bias), dropout_counters(args))
            if outputs is not None:
                record_choice(chosen)
                out, lse = outputs
                return (out, lse, None) if return_attn_probs else out
        if sink is not None:
            # This call's sink, checked as the first call's was (the key holds its layout).
            args = replace(args, sink=validation.check_sink(sink, q.shape[-2], q.device))
        if options["alibi_slopes"] is not None:
            args = replace(args, alibi_slopes=validation.check_alibi_slopes(options["alibi_slopes"],
                                                                            *args.alibi_slopes.shape, q.device))
        if attn_bias is not None:
            # Dense calls only: (batch, nheads, seqlen_q, seqlen_k) of this call.
            shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            args = replace(args, attn_bias=validation.check_attn_bias(attn_bias, shape, q.device))
        if args.varlen:
            # The offsets are this call's.
            args = replace(args, cu_seqlens_q=options["cu_seqlens_q"], cu_seqlens_k=options["cu_seqlens_k"],
                           seqused_k=options["seqused_k"],
                           max_seqlen_q=validation.check_max_seqlen("max_seqlen_q", options["max_seqlen_q"]),
                           max_seqlen_k=validation.check_max_seqlen("max_seqlen_k", options["max_seqlen_k"]))
        if planned:
            record_choice(chosen)
        else:
            chosen = dispatch(AttentionCall.of(q, k, v, args))
            # Recorded afresh, unless the last recording served no call before the key count changed (one
            # that changes every call: recording would only add to each; the next count is recorded again).
            kept = replay.Kept(None if kept.forward and not kept.forward[0].uses else ())
            if chosen.fallback_reason is None:
                remember(key, (args, chosen, kept))
    else:
        validation.check_qkv(q, k, v, varlen=options.get("varlen", False))
        args = validation.attn_args(q, k, v, sink=sink, attn_bias=attn_bias, **options)
        if compiling:
            out, lse = ops.attention(q, k, v, args, sink=sink, attn_bias=attn_bias)
            return (out, lse, None) if return_attn_probs else out
        chosen = dispatch(AttentionCall.of(q, k, v, args))
        if key is not None and chosen.fallback_reason is None:
            kept = replay.Kept()
            remember(key, (args, chosen, kept))
    # Recorded for the next call like it; a fallback is counted every call, so it is not.
    if chosen.fallback_reason is not None:
        kept = None
    if wants_grad(*inputs, sink, attn_bias):
        out, lse = function.apply(*inputs, sink, attn_bias, args, chosen, kept)
        return (out, lse, None) if return_attn_probs else out
    if not drawn:
        args = draw_dropout_counters(args)
    if kept is not None:
        (out, lse), kept.forward = replay.record(lambda: run_forward(chosen, q, k, v, args),
                                                 _given(inputs, options, sink, attn_bias), kept.forward,
                                                 dropout_counters(args))
    else:
        out, lse = run_forward(chosen, q, k, v, args)
    return (out, lse, None) if return_attn_probs else out


def _given(inputs: tuple, options: dict, sink, attn_bias) -> tuple:
    """What a no-grad call's replay is given: the tensors as the caller passed them (the kernels read the
    validated ALiBi slopes and bias as views of them), so that the call is recorded as it is replayed, before
    any validation."""
    return replay_inputs(inputs, sink, options["alibi_slopes"], attn_bias, options.get("cu_seqlens_q"),
                         options.get("cu_seqlens_k"), options.get("seqused_k"))


_SCALARS = frozenset((int, float, bool, type(None)))


def _plain_window(window) -> bool:
    """A ``window_size`` a signature may hold: a tuple of two Python ints (a list or a tensor is validated afresh)."""
    return type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int


def _signature(function, qkv, options, sink, attn_bias):
    """What validation reads of a call, as a key (with the options' types, so that ``softcap=False`` does not
    pass for ``softcap=0``, and the layouts of the sink, ALiBi slopes and bias); None for calls validated
    afresh. The number of keys is left out (only whether k and v agree on it): the plan made for one is redone
    for another. Packed sequences: see :func:`_varlen_signature`."""
    extras = _layouts((sink, options["alibi_slopes"], attn_bias), strides=True)
    if extras is None:
        return None
    window = options["window_size"]
    if not _plain_window(window):
        return None
    scalars = (options["dropout_p"], options["softmax_scale"], options["causal"], options["softcap"],
               options["deterministic"])
    types = tuple(map(type, scalars))
    q, k, v = qkv
    varlen = options.get("varlen", False)
    if not _SCALARS.issuperset(types) or not all(isinstance(t, torch.Tensor) and t.dim() == 4 - varlen
                                                 for t in qkv):
        return None
    common = (function, window, scalars, types, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, extras,
              state_key())
    if varlen:
        return _varlen_signature(qkv, options, common)
    return (*common, q.shape, k.shape[0], k.shape[2:], v.shape[0], v.shape[2:], k.shape[1] == v.shape[1])


def _varlen_signature(qkv, options, common):
    """The key of a packed call: besides ``common``, q's shape, k's and v's but their token counts (whether
    they agree), the offsets' (and ``seqused_k``'s) shapes, dtypes and devices, whose checks read no
    value, and whether the query and key offsets are one tensor (a replay is then given it once). None when
    the call must be validated afresh: values checked on the host (CPU tensors, ``FLASHTILE_VALIDATE_VALUES=1``),
    or a longest length given as a tensor (read on the host)."""
    q, k, v = qkv
    if validation.values_checked(q.device):
        return None
    if type(options["max_seqlen_q"]) is not int or type(options["max_seqlen_k"]) is not int:
        return None
    index = _layouts((options["cu_seqlens_q"], options["cu_seqlens_k"], options["seqused_k"]), strides=False)
    if index is None:
        return None
    return (*common, "varlen", q.shape, k.shape[1:], v.shape[1:], k.shape[0] == v.shape[0], index,
            options["cu_seqlens_q"] is options["cu_seqlens_k"])


def _layouts(tensors, strides: bool):
    """Each tensor's shape, dtype and device (and strides), None for None; None when one is neither (a
    list, an int: validation would convert it)."""
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tuple([None if t is None else (t.shape, t.stride() if strides else None, t.dtype, t.device)
                  for t in tensors])


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    sink=None,
    num_splits=0,
    return_softmax_lse=False,
    k_descale=None,
    v_descale=None,
):
    """Attention of new queries over a KV cache, after appending the new keys and values to it in place
    (incremental decoding, speculative verification, chunked prefill), as flash-attn's function of
    the same name.

    When ``k`` and ``v`` are given they are written into ``k_cache`` and ``v_cache`` **in place**:
    token ``t`` of batch row ``b`` goes to key row ``cache_seqlens[b] + t`` of that row's cache. Then
    q attends to the key rows ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` of its row: the
    cached ones and the new ones. The caller keeps the lengths: add ``seqlen_new`` to
    ``cache_seqlens`` for the next step (:class:`flashtile.KVCache` does that for you).

    ``causal`` and ``window_size`` are aligned bottom-right to each row's key count
    ``n_b = cache_seqlens[b] + seqlen_new``: query ``i`` sees key row ``j`` iff ``j <= i + n_b - seqlen_q``
    (causal), so a decoding query sees every key and ``seqlen_q`` new tokens see the cache plus the
    new tokens up to themselves::

        cache_seqlens[b] = 3, seqlen_q = seqlen_new = 2, causal=True (c = cached key, n = new key)
                    c c c n n
            q0      1 1 1 1 0
            q1      1 1 1 1 1

    Rotary embeddings (``rotary_cos`` and ``rotary_sin``): the new keys are rotated before they are
    written, new token ``t`` at position ``cache_seqlens[b] + t``; q is rotated at positions
    ``cache_seqlens[b] + i`` when ``causal`` or windowed, else every query at ``cache_seqlens[b]``
    (flash-attn's rule). Positions are key rows: ``cache_leftpad`` does not shift them.

    Inference only: no gradient flows to q, k, v or the caches (as in flash-attn); the outputs do not
    require grad. The call never synchronizes with the host or allocates by tensor values unless the
    value checks below run, so a decode step can be captured in a CUDA graph and replayed.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, ``seqlen_q >= 1``; float16, bfloat16 or float32.
        k_cache, v_cache: the cache, in q's dtype with a contiguous last dim, written in place.
            Contiguous: ``(batch_cache, seqlen_cache, nheads_kv, headdim)`` (v: ``headdim_v``), batch
            row ``b`` uses cache row ``cache_batch_idx[b]`` (default ``b``). Paged (with
            ``block_table``): ``(num_blocks, page_size, nheads_kv, headdim)``, any ``page_size`` >= 1;
            key row ``r`` of batch row ``b`` is ``k_cache[block_table[b, r // page_size], r % page_size]``.
            ``nheads`` must be a multiple of ``nheads_kv`` (GQA/MQA: the query heads of a group are
            computed together; K and V are never repeated).
        k, v: optional new tokens ``(batch, seqlen_new, nheads_kv, headdim)`` (v: ``headdim_v``).
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)`` tables (any float dtype),
            ``rotary_dim <= headdim``; need k and v. They must cover every rotated position.
        cache_seqlens: int32 ``(batch,)`` on q's device, or an int: the keys already in each row's
            cache before this call. None means the cache is full (``seqlen_cache`` keys, or
            ``max_blocks_per_seq * page_size`` paged), as in flash-attn.
        cache_batch_idx: optional int32 ``(batch,)``: the cache row of each batch row (contiguous cache only).
        cache_leftpad: optional int32 ``(batch,)``: key rows before it are left padding, never attended
            to (contiguous cache only); ``cache_leftpad[b] <= cache_seqlens[b]``.
        block_table: optional int32 ``(batch, max_blocks_per_seq)``: the pages of each sequence. Only
            the pages a sequence uses (the first ``ceil((cache_seqlens[b] + seqlen_new) / page_size)``)
            are read; the rest may hold anything.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal, window_size, softcap, alibi_slopes, sink: as in :func:`flash_attn_func`, with
            ``seqlen_k`` the row's key count ``n_b`` (ALiBi distances ``|i + n_b - seqlen_q - j|``).
        rotary_interleaved: True rotates the pairs ``(2i, 2i + 1)`` (GPT-J), False the pairs
            ``(i, i + rotary_dim / 2)`` (GPT-NeoX).
        num_splits: split each row's keys into this many ranges, computed in parallel and merged
            (split-KV decoding); 0 lets the backend choose from the shapes alone, 1 never splits.
        return_softmax_lse: also return the log-sum-exp.
        k_descale, v_descale: an FP8 cache: with float8_e4m3fn ``k_cache`` and ``v_cache`` (q, k, v stay
            16-bit), float32 ``(nheads_kv,)`` or ``(batch, nheads_kv)`` descales: the cache holds
            ``k_cache * k_descale``; new tokens are written as ``e4m3(clamp(k / k_descale, -448, 448))``
            (after rotary), and attention reads the cache back as ``k_cache * k_descale`` in fp32 math.
            Half the bytes a decode step reads. See docs/fp8.md.

    The value checks (each ``cache_seqlens[b] + seqlen_new`` within the capacity, ``cache_leftpad``,
    ``cache_batch_idx`` and the pages a sequence uses within the cache, the rotary tables long enough)
    read the index tensors on the host: always for CPU tensors, for CUDA tensors only with
    ``FLASHTILE_VALIDATE_VALUES=1``, never while torch.compile traces or a CUDA graph is captured.
    Unchecked, a new token that would land past the capacity (or on a page past ``num_blocks``) is
    not written.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype, or ``(out, softmax_lse)`` when
        ``return_softmax_lse``, with ``softmax_lse`` float32 ``(batch, nheads, seqlen_q)`` (natural log,
        ``-inf`` for a query that sees no key).
    """
    index = dict(cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                 block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   rotary_interleaved=rotary_interleaved, num_splits=num_splits)
    key = _kvcache_signature((q, k_cache, v_cache, k, v, alibi_slopes, sink, k_descale, v_descale), index, options)
    known = None if key is None else recall(key)
    tensors = (q, k_cache, v_cache, k, v, alibi_slopes, sink, k_descale, v_descale, *index.values())
    if known is not None:
        # A step like an earlier one: its checks hold (no value is read), only the tensors are new.
        args, chosen, kept = known
        outputs = replay.replayed(kept.forward, tensors)
        if outputs is not None:
            # Its launches again, when the tensors are aligned as before.
            record_choice(chosen)
            out, lse = outputs
            return (out, lse) if return_softmax_lse else out
        batch, _, nheads, _ = q.shape
        args = replace(args, **index, alibi_slopes=None if alibi_slopes is None else
                       validation.check_alibi_slopes(alibi_slopes, batch, nheads, q.device),
                       sink=None if sink is None else validation.check_sink(sink, nheads, q.device),
                       k_descale=None if k_descale is None else k_descale.detach().expand(batch, -1),
                       v_descale=None if v_descale is None else v_descale.detach().expand(batch, -1))
        record_choice(chosen)
    else:
        args = validation.kvcache_args(q, k_cache, v_cache, k, v, alibi_slopes=alibi_slopes, sink=sink, **index,
                                       **options, k_descale=k_descale, v_descale=v_descale)
        if key is None:
            out, lse, _ = _attention_kvcache(q, k_cache, v_cache, k, v, args)
            return (out, lse) if return_softmax_lse else out
        chosen, kept = dispatch(AttentionCall.of(q, k_cache, v_cache, args)), replay.Kept()
        if chosen.fallback_reason is None:
            remember(key, (args, chosen, kept))

    def run():
        with torch.no_grad():
            return ops.run_kvcache(chosen, q, k_cache, v_cache, k, v, args)

    # Recorded for the next step like it.
    (out, lse), kept.forward = replay.record(run, tensors, kept.forward)
    return (out, lse) if return_softmax_lse else out


def _attention_kvcache(q, k_cache, v_cache, k, v, args):
    """Dispatch and run a validated KV-cache call, without autograd: ``(out, lse, plan)``; through the
    custom op while compiling (plan None)."""
    with torch.no_grad():
        if torch.compiler.is_compiling():
            return (*ops.attention_with_kvcache(q, k_cache, v_cache, k, v, args), None)
        chosen = dispatch(AttentionCall.of(q, k_cache, v_cache, args))
        return (*ops.run_kvcache(chosen, q, k_cache, v_cache, k, v, args), chosen)


def _kvcache_signature(tensors, index: dict, options: dict):
    """What validation and dispatch read of a KV-cache call, as a key: every tensor's shape, strides, dtype
    and device, the options and their types. None when the call must be validated afresh: while compiling,
    when the index values are checked on the host (CPU tensors, ``FLASHTILE_VALIDATE_VALUES=1``), or when
    validation would make a tensor (``cache_seqlens`` an int or None)."""
    q = tensors[0]
    if torch.compiler.is_compiling() or not all(isinstance(t, torch.Tensor) for t in (q, index["cache_seqlens"])):
        return None
    if validation.values_checked(q.device):
        return None
    layouts = _layouts((*tensors, *index.values()), strides=True)
    if layouts is None:
        return None
    window = options["window_size"]
    if not _plain_window(window):
        return None
    scalars = tuple(value for name, value in options.items() if name != "window_size")
    types = tuple(map(type, scalars))
    if not _SCALARS.issuperset(types):
        return None
    return ("kvcache", layouts, window, scalars, types, state_key())


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combine the attention results of two disjoint sets of keys into the attention over their union.

    With ``(out_a, lse_a)`` the attention of some queries over keys A and ``(out_b, lse_b)`` over keys B
    (as returned with ``return_attn_probs`` / ``return_softmax_lse``)::

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    computed in float32 without overflow whatever the size of the lses. A side whose lse is ``-inf``
    (no key) adds nothing; both ``-inf`` give out 0 and lse ``-inf``. Use it for cascade attention (a
    shared prefix attended once, then each sequence's own suffix), split-KV decoding and context
    parallelism (each rank's keys). Inference only: no gradient flows.

    Args:
        out_a, out_b: ``(batch, seqlen, nheads, headdim)``, one dtype (float16, bfloat16 or float32).
        lse_a, lse_b: float32 ``(batch, nheads, seqlen)`` (natural log), flash-attn's layout.

    Returns:
        ``(out, lse)``: ``out`` ``(batch, seqlen, nheads, headdim)`` in out_a's dtype, ``lse`` float32
        ``(batch, nheads, seqlen)``.
    """
    validation.check_merge_states(out_a, lse_a, out_b, lse_b)
    return _merge(out_a, lse_a, out_b, lse_b)


def _merge(out_a, lse_a, out_b, lse_b):
    """Dispatch and run a validated merge; through the custom op while compiling."""
    with torch.no_grad():
        if torch.compiler.is_compiling():
            return ops.merge_states(out_a, lse_a, out_b, lse_b)
        return ops.run_merge(dispatch(merge_call(out_a)), out_a, lse_a, out_b, lse_b)
