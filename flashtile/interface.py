"""Public attention functions (flash-attn compatible, layout ``(batch, seqlen, nheads, headdim)``).

Each function validates its arguments, fills defaults, asks :mod:`flashtile.dispatch`
for a backend and runs the matching autograd Function.
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
):
    """Exact attention ``softmax(q k^T * softmax_scale) v``.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16, bfloat16 or float32.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; ``nheads`` must be a multiple of
            ``nheads_kv`` (GQA/MQA; K and V are never repeated in memory).
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal: mask aligned to the bottom-right corner: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``. A query that sees no key outputs 0 with lse ``-inf``::

                seqlen_q=2, seqlen_k=5        seqlen_q=5, seqlen_k=2
                    1 1 1 1 0                     0 0
                    1 1 1 1 1                     0 0
                                                  0 0
                                                  1 0
                                                  1 1
        deterministic: accepted for compatibility; the backward never uses atomics, so
            gradients are bit-identical run to run either way.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen_q)`` float32
            (natural log) and ``None`` in place of the probabilities, as flash-attn does.
        dropout_p, window_size, softcap, alibi_slopes: not implemented yet; a non-default
            value raises ``NotImplementedError`` naming the feature.

    Which backend runs the call, and why, is in :func:`flashtile.explain`; every call is
    counted in :func:`flashtile.stats`.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)`` in q's dtype, or
        ``(out, softmax_lse, None)`` when ``return_attn_probs``.
    """
    validation.check_qkv(q, k, v)
    features = dict(dropout_p=dropout_p, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return _attention(FlashAttnFunc, (q, k, v), (q, k, v), softmax_scale, causal, features, deterministic, return_attn_probs)


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
):
    """Attention on packed ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)``.

    q, k and v are read as strided views of ``qkv`` (no copy), and the gradient is one
    packed tensor of ``qkv``'s shape. Other arguments as in :func:`flash_attn_func`.
    """
    q, k, v = validation.check_packed("qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    validation.check_qkv(q, k, v)
    features = dict(dropout_p=dropout_p, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return _attention(FlashAttnQKVPackedFunc, (qkv,), (q, k, v), softmax_scale, causal, features, deterministic, return_attn_probs)


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
):
    """Attention on ``q`` ``(batch, seqlen_q, nheads, headdim)`` and packed ``kv``
    ``(batch, seqlen_k, 2, nheads_kv, headdim)``, read as views without a copy.

    Other arguments as in :func:`flash_attn_func`.
    """
    k, v = validation.check_packed("kv", kv, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    validation.check_qkv(q, k, v)
    features = dict(dropout_p=dropout_p, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return _attention(FlashAttnKVPackedFunc, (q, kv), (q, k, v), softmax_scale, causal, features, deterministic, return_attn_probs)


def _attention(function, inputs, qkv, softmax_scale, causal, features, deterministic, return_attn_probs):
    """Fill the scale, dispatch the call to a backend and run it: through the autograd Function
    in eager mode, through the custom op (:mod:`flashtile.ops`) while torch.compile traces."""
    q, k, v = qkv
    scale = validation.check_softmax_scale(softmax_scale, q.shape[-1])
    if torch.compiler.is_compiling():
        out, lse = ops.attention(q, k, v, scale, causal, **features)
    else:
        chosen = dispatch(AttentionCall.of(q, k, causal, **features))
        out, lse = function.apply(*inputs, scale, bool(causal), bool(deterministic), chosen)
    return (out, lse, None) if return_attn_probs else out
