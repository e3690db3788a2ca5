"""``nn.Module`` wrappers around flashtile's attention.

:class:`MultiheadAttention` is a drop-in for ``torch.nn.MultiheadAttention`` (a subclass with the
same parameters, so a state_dict loads into either). It computes attention, masks and dropout
included, with :func:`flashtile.scaled_dot_product_attention`; what flashtile cannot compute (the
attention weights) runs through torch and is recorded as a fallback, never silently.

:class:`Attention` is a minimal self-attention block in flashtile's own layout (fused qkv
projection, GQA, rotary embeddings) on :func:`flashtile.flash_attn_func`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import preferred_backend, record_fallback
from .interface import flash_attn_func
from .sdpa import scaled_dot_product_attention

__all__ = ["Attention", "MultiheadAttention"]

# The backend name under which torch's own MultiheadAttention forward is counted in flashtile.stats().
TORCH_MHA_BACKEND = "torch_mha"
# stacklevel of a fallback warning raised in forward(): forward <- Module._call_impl <- Module._wrapped_call_impl <- user.
_FORWARD_STACKLEVEL = 4


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` with attention computed by flashtile.

    Same constructor, parameters (``in_proj_weight``, or ``q_proj_weight``/``k_proj_weight``/
    ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``; ``in_proj_bias``,
    ``out_proj.weight``/``out_proj.bias``) and initialization as torch's, so ``load_state_dict``
    works both ways and ``isinstance(m, torch.nn.MultiheadAttention)`` holds.

    Differences from torch:

    - ``need_weights`` defaults to ``False``: flashtile never materializes the
      ``(seqlen_q, seqlen_k)`` weights. ``need_weights=True`` runs torch's forward and is
      recorded as a fallback (backend ``"torch_mha"``).
    - ``key_padding_mask`` and ``attn_mask`` are merged as torch merges them and passed to
      flashtile as one mask (bool when both are bool, else additive float); its gradient flows
      back to a float mask that requires grad. A query row whose keys are all masked outputs 0.
    - dropout uses flashtile's RNG (:mod:`flashtile.rng`): reproducible with ``torch.manual_seed``,
      but a different mask from torch's.
    - ``add_bias_kv`` and ``add_zero_attn`` raise ``NotImplementedError``.

    As in torch, ``is_causal=True`` is a hint that ``attn_mask`` is the causal mask and needs
    ``attn_mask``; without ``key_padding_mask`` the mask is not read and flashtile applies the
    top-left causal mask itself (query ``i`` sees keys ``0..i``; see
    :func:`flashtile.scaled_dot_product_attention`).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError(
                f"flashtile.nn.MultiheadAttention: add_bias_kv={add_bias_kv}, add_zero_attn={add_zero_attn} are not "
                "implemented; use torch.nn.MultiheadAttention for them"
            )
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
                         batch_first=batch_first, device=device, dtype=dtype)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """Attention of ``query`` over ``key``/``value``; returns ``(out, None)``.

        Args:
            query: ``(L, N, embed_dim)``, ``(N, L, embed_dim)`` when ``batch_first``, or ``(L, embed_dim)`` unbatched.
            key: ``(S, N, kdim)``, ``(N, S, kdim)`` or ``(S, kdim)``; value likewise with ``vdim``.
            key_padding_mask: ``(N, S)`` or ``(S,)``; bool (True = ignore that key) or float (added).
            attn_mask: ``(L, S)`` or ``(N * num_heads, L, S)``; bool (True = not allowed) or float (added).
            need_weights, average_attn_weights: ``need_weights=True`` runs torch's forward (a
                recorded fallback) and returns its weights.
            is_causal: hint that ``attn_mask`` is the causal mask (see the class docstring).

        Returns:
            ``(out, None)``, ``out`` shaped like ``query`` (``embed_dim`` features).
        """
        if need_weights:
            record_fallback("MultiheadAttention need_weights=True: flashtile never materializes attention weights",
                            TORCH_MHA_BACKEND, preferred=preferred_backend(query.device), stacklevel=_FORWARD_STACKLEVEL)
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=True,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "flashtile.nn.MultiheadAttention: is_causal=True needs attn_mask (as in torch, is_causal is a hint "
                "that attn_mask is the causal mask); use torch.nn.Transformer.generate_square_subsequent_mask(L)"
            )
        batched = query.dim() == 3
        self._check_inputs(query, key, value, batched)
        if not batched:  # (L, E) -> (1, L, E) in the batch-first layout, squeezed again at the end
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        batch_first = self.batch_first or not batched
        q, k, v = self._project(query, key, value)
        # (.., nheads, headdim) -> (batch, nheads, seqlen, headdim): views of the projections.
        order = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
        q, k, v = (x.permute(order) for x in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        if key_padding_mask is None and (attn_mask is None or is_causal):
            attn = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
        else:
            mask = self._merge_masks(attn_mask, key_padding_mask, q, k)
            attn = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        batch, _, seqlen_q, _ = attn.shape
        if batch_first:
            attn = attn.transpose(1, 2).reshape(batch, seqlen_q, self.embed_dim)
        else:
            attn = attn.permute(2, 0, 1, 3).reshape(seqlen_q, batch, self.embed_dim)
        out = F.linear(attn, self.out_proj.weight, self.out_proj.bias)
        return (out if batched else out.squeeze(0)), None

    def _check_inputs(self, query, key, value, batched):
        dims = 3 if batched else 2
        for name, x, features in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if x.dim() != dims or x.shape[-1] != features:
                raise ValueError(
                    f"flashtile.nn.MultiheadAttention: {name} must be {dims}-d (as query) with {features} features, "
                    f"got shape {tuple(x.shape)} (query {tuple(query.shape)})"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"flashtile.nn.MultiheadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} "
                             "must have the same batch and sequence dims")
        batch_dim = 0 if self.batch_first else 1
        if batched and query.shape[batch_dim] != key.shape[batch_dim]:
            raise ValueError(f"flashtile.nn.MultiheadAttention: query {tuple(query.shape)} and key {tuple(key.shape)} "
                             f"have different batch sizes (batch_first={self.batch_first})")

    def _project(self, query, key, value):
        """q, k, v projections as ``(..., num_heads, head_dim)`` views, in the inputs' layout."""
        heads = (self.num_heads, self.head_dim)
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        if self._qkv_same_embed_dim and query is key and key is value:  # self-attention: one GEMM
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            return qkv.unflatten(-1, (3, *heads)).unbind(-3)
        q = F.linear(query, w_q, b_q).unflatten(-1, heads)
        if self._qkv_same_embed_dim and key is value:  # cross-attention on one memory: one GEMM for k and v
            kv = F.linear(key, self.in_proj_weight[self.embed_dim:],
                          None if self.in_proj_bias is None else self.in_proj_bias[self.embed_dim:])
            return (q, *kv.unflatten(-1, (2, *heads)).unbind(-3))
        return q, F.linear(key, w_k, b_k).unflatten(-1, heads), F.linear(value, w_v, b_v).unflatten(-1, heads)

    def _merge_masks(self, attn_mask, key_padding_mask, q, k):
        """One mask broadcastable to ``(batch, num_heads, L, S)`` in SDPA's convention, merged as torch
        merges them: bool (True = may attend) when every given mask is bool, else additive float in
        q's dtype (a bool mask contributing ``-inf`` where it is True)."""
        batch, _, seqlen_q, _ = q.shape
        seqlen_k = k.shape[2]
        masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
        as_bool = all(m.dtype == torch.bool for m in masks)
        merged = None
        if attn_mask is not None:
            attn_mask = ~attn_mask if as_bool else _additive("attn_mask", attn_mask, q.dtype)
            if attn_mask.shape == (seqlen_q, seqlen_k):
                merged = attn_mask.view(1, 1, seqlen_q, seqlen_k)
            elif attn_mask.shape == (batch * self.num_heads, seqlen_q, seqlen_k):
                merged = attn_mask.view(batch, self.num_heads, seqlen_q, seqlen_k)
            else:
                raise RuntimeError(
                    f"flashtile.nn.MultiheadAttention: attn_mask must be (L, S) = {(seqlen_q, seqlen_k)} or "
                    f"(N * num_heads, L, S) = {(batch * self.num_heads, seqlen_q, seqlen_k)}, got {tuple(attn_mask.shape)}"
                )
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, seqlen_k):
                raise RuntimeError(f"flashtile.nn.MultiheadAttention: key_padding_mask must be (N, S) = {(batch, seqlen_k)}, "
                                   f"got {tuple(key_padding_mask.shape)}")
            padding = ~key_padding_mask if as_bool else _additive("key_padding_mask", key_padding_mask, q.dtype)
            padding = padding.view(batch, 1, 1, seqlen_k)
            merged = padding if merged is None else (merged & padding if as_bool else merged + padding)
        return merged


def _additive(name, mask, dtype):
    """A bool mask (True = masked out) as an additive float mask; a float mask in ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"flashtile.nn.MultiheadAttention: {name} must be bool or floating point, got {mask.dtype}")
    return mask.to(dtype)


class Attention(torch.nn.Module):
    """Self-attention ``x -> out_proj(attention(rotary(q), rotary(k), v))`` on flashtile.

    Args:
        embed_dim: features of the input and the output.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA/MQA), a divisor of ``num_heads``; default ``num_heads``.
        head_dim: default ``embed_dim // num_heads``; a multiple of 8 up to 256.
        bias: biases on the projections.
        causal: query ``i`` sees keys ``0..i`` (for self-attention the corners agree).
        rotary: rotary position embeddings on q and k (GPT-NeoX/Llama "rotate half" layout,
            base ``rope_theta``), positions ``0..seqlen-1``.
        window_size: ``(left, right)`` sliding window as in :func:`flashtile.flash_attn_func`
            (e.g. ``(4095, 0)`` with ``causal``: each query sees itself and the 4095 keys before it);
            ``(-1, -1)``: no window.

    Parameters: ``qkv_proj`` (``embed_dim -> (num_heads + 2 * num_kv_heads) * head_dim``, rows in
    the order q, k, v) and ``out_proj`` (``num_heads * head_dim -> embed_dim``).

    Incremental decoding: ``forward(x, cache)`` with a :class:`flashtile.KVCache` of this layer
    (``nheads_kv = num_kv_heads``, ``headdim = head_dim``) takes only the new tokens; their keys and
    values go into the cache, rotary positions continue from each sequence's cached length, and the
    result equals the rows of a full forward over the whole sequence::

        cache = flashtile.KVCache(batch, max_seqlen=2048, nheads_kv=attn.num_kv_heads, headdim=attn.head_dim,
                                  dtype=x.dtype, device=x.device)
        y = attn(prompt, cache)            # prefill
        y = attn(next_token, cache)        # one step: (batch, 1, embed_dim)
    """

    def __init__(self, embed_dim, num_heads, num_kv_heads=None, head_dim=None, bias=False, causal=True,
                 rotary=False, rope_theta=10000.0, window_size=(-1, -1), device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = embed_dim // num_heads if head_dim is None else head_dim
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"flashtile.nn.Attention: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if rotary and head_dim % 2 != 0:
            raise ValueError(f"flashtile.nn.Attention: rotary embeddings need an even head_dim, got {head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.rotary, self.rope_theta, self.window_size = causal, rotary, rope_theta, tuple(window_size)
        factory = {"device": device, "dtype": dtype}
        self.qkv_proj = torch.nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.out_proj = torch.nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)

    def forward(self, x, cache=None):
        """``x`` ``(batch, seqlen, embed_dim)`` -> ``(batch, seqlen, embed_dim)``; with ``cache`` (a
        :class:`flashtile.KVCache`), ``x`` holds the new tokens of each sequence (see above)."""
        embed_dim = self.qkv_proj.in_features
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != embed_dim:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"flashtile.nn.Attention: x must be (batch, seqlen, embed_dim) = (*, *, {embed_dim}), "
                             f"got {shape}")
        batch, seqlen, _ = x.shape
        qkv = self.qkv_proj(x).unflatten(-1, (self.num_heads + 2 * self.num_kv_heads, self.head_dim))
        # (batch, seqlen, heads, head_dim) views of one projection: no copy before the kernel.
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if cache is not None:
            out = self._attend_cached(q, k, v, cache)
        else:
            if self.rotary:
                q, k = rotary_embedding(q, self.rope_theta), rotary_embedding(k, self.rope_theta)
            out = flash_attn_func(q, k, v, causal=self.causal, window_size=self.window_size)
        return self.out_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))

    def _attend_cached(self, q, k, v, cache):
        if not self.causal:
            raise ValueError("flashtile.nn.Attention: incremental decoding with a cache needs causal=True "
                             "(a bidirectional layer's earlier outputs would change with every new token)")
        rotary = {}
        if self.rotary:
            # The kernels rotate q and the new keys at their positions in the cache ("rotate half" = NeoX).
            cos, sin = rotary_tables(cache.max_seqlen, self.head_dim, self.rope_theta, q.device)
            rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
        return cache.attend(q, k, v, causal=True, window_size=self.window_size, **rotary)


def rotary_tables(max_seqlen: int, head_dim: int, theta: float = 10000.0, device=None):
    """float32 ``(cos, sin)`` of shape ``(max_seqlen, head_dim / 2)``: the angles of :func:`rotary_embedding`
    at positions ``0..max_seqlen-1``, in the layout ``flash_attn_with_kvcache``'s ``rotary_cos/sin`` take."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_seqlen, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def rotary_embedding(x, theta=10000.0):
    """Rotate ``x`` ``(batch, seqlen, nheads, head_dim)`` by position ``0..seqlen-1`` ("rotate half" layout).

    Feature ``i`` pairs with ``i + head_dim / 2`` and turns by ``position * theta ** (-2 i / head_dim)``,
    computed in float32 and returned in ``x``'s dtype.
    """
    seqlen, head_dim = x.shape[1], x.shape[-1]
    cos, sin = rotary_tables(seqlen, head_dim, theta, x.device)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
