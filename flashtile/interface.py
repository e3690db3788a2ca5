"""Public attention functions (flash-attn compatible, layout ``(batch, seqlen, nheads, headdim)``,
or ``(total_tokens, nheads, headdim)`` for the varlen functions).

Each function validates its arguments (:mod:`flashtile.validation`, which also fills the defaults
into one :class:`~flashtile.backends.AttnArgs`), asks :mod:`flashtile.dispatch` for a backend and
runs the matching autograd Function (or, while torch.compile traces, the custom op of
:mod:`flashtile.ops`).
"""
from __future__ import annotations

import torch

from . import ops, validation
from .autograd import FlashAttnFunc, FlashAttnKVPackedFunc, FlashAttnQKVPackedFunc
from .backends import AttentionCall
from .dispatch import dispatch


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
        deterministic: accepted for compatibility; the backward never uses atomics, so
            gradients are bit-identical run to run either way.
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

    Which backend runs the call, and why, is in :func:`flashtile.explain`; every call is
    counted in :func:`flashtile.stats`.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` in q's dtype, or
        ``(out, softmax_lse, None)`` when ``return_attn_probs``.
    """
    validation.check_qkv(q, k, v)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes)
    return _attention(FlashAttnFunc, (q, k, v), (q, k, v), options, sink, attn_bias, return_attn_probs)


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
    validation.check_qkv(q, k, v)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes)
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
    validation.check_qkv(q, k, v)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes)
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
            they are not read, and their gradients are 0.
        max_seqlen_q, max_seqlen_k: the longest query / key sequence: a Python int, or a 0-d
            tensor (read with ``.item()``; under torch.compile pass an int).
        seqused_k: optional int32 ``(batch,)``: sequence ``b`` uses only its first
            ``seqused_k[b]`` keys (its causal/window diagonal counts those keys only).
        sink: ``(nheads,)``, as in :func:`flash_attn_func`.
        attn_bias: not served for packed sequences: a tensor raises ``NotImplementedError``.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic:
            as in :func:`flash_attn_func`; ``alibi_slopes`` is ``(nheads,)`` or ``(batch, nheads)``
            with ``batch = len(cu_seqlens_q) - 1``; dropout positions are counted within each sequence.

    The checks of the offsets' values (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1]``
    at most the number of rows, ``max_seqlen`` at least the longest sequence, ``seqused_k`` within
    each sequence) read them on the host: for CUDA tensors that is one device->host copy per call.

    Returns:
        ``out`` ``(total_q, nheads, headdim_v)`` in q's dtype, or ``(out, softmax_lse, None)``
        when ``return_attn_probs``, with ``softmax_lse`` float32 ``(nheads, total_q)``.
    """
    validation.check_qkv(q, k, v, varlen=True)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, varlen=True, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
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
    validation.check_qkv(q, k, v, varlen=True)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, varlen=True, cu_seqlens_q=cu_seqlens,
                   cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
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
    validation.check_qkv(q, k, v, varlen=True)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, varlen=True, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    return _attention(FlashAttnKVPackedFunc, (q, kv), (q, k, v), options, sink, attn_bias, return_attn_probs)


def _attention(function, inputs, qkv, options, sink, attn_bias, return_attn_probs):
    """Validate and normalise the options, dispatch the call to a backend and run it: through the
    autograd Function in eager mode, through the custom op (:mod:`flashtile.ops`) while
    torch.compile traces."""
    q, k, v = qkv
    args = validation.attn_args(q, k, v, sink=sink, attn_bias=attn_bias, **options)
    if torch.compiler.is_compiling():
        out, lse = ops.attention(q, k, v, args, sink=sink, attn_bias=attn_bias)
    else:
        chosen = dispatch(AttentionCall.of(q, k, v, args))
        out, lse = function.apply(*inputs, sink, attn_bias, args, chosen)
    return (out, lse, None) if return_attn_probs else out
