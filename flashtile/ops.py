"""The attention call as ``torch.library`` custom ops, so ``torch.compile(..., fullgraph=True)``
traces a model that calls flashtile without a graph break.

The public functions route here only while compiling; eager calls keep the autograd Functions of
:mod:`flashtile.autograd` (whose packed variants write one packed gradient without a copy). The
ops' real implementations dispatch at run time, so stats, strict mode and fallbacks behave as in
eager; their fake implementations only describe shapes (any sequence length: no recompile per
length; ``headdim_v`` and the varlen ``(nheads, total_q)`` lse included) and refuse, at trace time,
features no backend implements.

``flashtile::attention_kvcache`` (``flash_attn_with_kvcache``) writes the new tokens into
``k_cache`` and ``v_cache`` (declared in ``mutates_args``, so a compiled decode step keeps the
in-place update) and has no backward; ``flashtile::merge_states`` is ``merge_attention_states``.
:func:`run_kvcache` and :func:`run_merge` run a dispatched call, eager or inside the ops.

The schema carries everything of :class:`~flashtile.backends.AttnArgs` as plain arguments. The
forward op draws the dropout counters when it runs and returns them as a small int64 tensor
``[seed, offset]`` that the backward op reads back. ``sink`` and ``attn_bias`` go in as the
caller's tensors, so autograd returns their gradients: the backward op gives float32 ``dsink``
``(nheads,)`` and ``dbias`` ``(batch, nheads, seqlen_q, seqlen_k)`` (empty when not needed), and
the traced autograd formula casts them and sums ``dbias`` down to the bias's shape.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op

from .alloc import empty, empty_like
from .autograd import draw_dropout_counters, refuse_double_backward
from .backends import AttentionCall, AttnArgs, KVCacheArgs
from .dispatch import Plan, check_features, dispatch, get_backend, merge_call, plan, profiled, record_kernel

Tensor = torch.Tensor


def _args(q, k, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
          softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, seed=0,
          offset=0) -> AttnArgs:
    """The AttnArgs of an op call (its arguments were validated by the public function)."""
    nheads = q.shape[-2]
    if cu_seqlens_q is not None:
        batch, shape = cu_seqlens_q.shape[0] - 1, None
    else:
        batch, shape = q.shape[0], (q.shape[0], nheads, q.shape[1], k.shape[1])
    return AttnArgs(
        softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, alibi_slopes=None if alibi_slopes is None else alibi_slopes.expand(batch, nheads),
        sink=None if sink is None else sink.to(torch.float32).contiguous(),
        attn_bias=None if attn_bias is None else attn_bias.expand(shape),
        dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, deterministic=deterministic,
        total_k=k.shape[0] if cu_seqlens_q is not None else -1,
    )


@custom_op("flashtile::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], attn_bias: Optional[Tensor],
                  alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                  causal: bool, window_left: int, window_right: int, softcap: float, dropout_p: float,
                  deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, rng_state)`` of the call; the backend is chosen (and recorded) when it runs.
    ``rng_state`` is int64 ``[seed, offset]`` of the dropout RNG (zeros without dropout)."""
    args = draw_dropout_counters(_args(q, k, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                       max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                                       softcap, dropout_p, deterministic))
    chosen = dispatch(AttentionCall.of(q, k, v, args))
    with torch.profiler.record_function(chosen.fwd_name):
        out, lse = get_backend(chosen.backend).forward(q, k, v, args)
    return out, lse, torch.tensor([args.seed, args.offset], dtype=torch.int64)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                        deterministic):
    args = _args(q, k, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic)
    check_features(AttentionCall.of(q, k, v, args))
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    if args.varlen:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)  # (nheads, total_q)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64)


@custom_op("flashtile::attention_bwd", mutates_args=())
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
                  sink: Optional[Tensor], attn_bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
                  max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                  window_right: int, softcap: float, dropout_p: float, deterministic: bool, need_dsink: bool,
                  need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsink, dbias)`` on the backend the forward's dispatch rules pick for the same
    call; ``dsink`` / ``dbias`` are float32, and empty unless asked for."""
    seed, offset = rng_state.tolist()
    args = _args(q, k, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, seed,
                 offset)
    chosen = plan(AttentionCall.of(q, k, v, args))
    record_kernel(chosen.bwd_name)
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    dsink = empty((q.shape[-2],), torch.float32, q.device) if need_dsink else None
    dbias = empty(tuple(args.attn_bias.shape), torch.float32, q.device) if need_dbias else None
    with torch.profiler.record_function(chosen.bwd_name):
        get_backend(chosen.backend).backward(dout, q, k, v, out, lse, args, dq, dk, dv, dsink, dbias)
    # Outputs may not alias each other: a fresh empty tensor for each gradient not asked for.
    return (dq, dk, dv, q.new_empty((0,), dtype=torch.float32) if dsink is None else dsink,
            q.new_empty((0,), dtype=torch.float32) if dbias is None else dbias)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, rng_state, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                        seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                        softcap, dropout_p, deterministic, need_dsink, need_dbias):
    dsink = q.new_empty((q.shape[-2] if need_dsink else 0,), dtype=torch.float32)
    if need_dbias:
        dbias = q.new_empty((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), dtype=torch.float32)
    else:
        dbias = q.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink, dbias


_TENSOR_INPUTS = 9  # q, k, v, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k


def _setup_context(ctx, inputs, output):
    out, lse, rng_state = output
    ctx.save_for_backward(*inputs[:_TENSOR_INPUTS], out, lse, rng_state)
    ctx.scalars = inputs[_TENSOR_INPUTS:]


def _backward(ctx, dout, _dlse, _drng_state):
    refuse_double_backward()
    q, k, v, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, out, lse, rng_state = ctx.saved_tensors
    need_dsink, need_dbias = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
    dq, dk, dv, dsink, dbias = attention_bwd(
        dout.contiguous(), q, k, v, out, lse, rng_state, sink, attn_bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
        seqused_k, *ctx.scalars, need_dsink, need_dbias)
    dsink = dsink.to(sink.dtype) if need_dsink else None
    dbias = dbias.sum_to_size(attn_bias.shape).to(attn_bias.dtype) if need_dbias else None
    return (dq, dk, dv, dsink, dbias) + (None,) * (len(ctx.scalars) + _TENSOR_INPUTS - 5)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, args: AttnArgs, sink=None, attn_bias=None):
    """``(out, lse)`` through the custom op (the compiled path of the public functions).

    ``args`` comes from :func:`flashtile.validation.attn_args`; ``sink`` and ``attn_bias`` are the
    caller's tensors (the ones gradients flow to), not the normalised copies in ``args``.
    """
    out, lse, _ = attention_fwd(
        q, k, v, sink, attn_bias, args.alibi_slopes, args.cu_seqlens_q, args.cu_seqlens_k, args.seqused_k,
        args.max_seqlen_q, args.max_seqlen_k, args.softmax_scale, args.causal, args.window_left, args.window_right,
        args.softcap, args.dropout_p, args.deterministic)
    return out, lse


# ---------------------------------------------------------------- KV cache and merge


def run_kvcache(chosen: Plan, q, k_cache, v_cache, k, v, args: KVCacheArgs):
    """Append the new tokens and attend, on the backend ``chosen`` names; returns ``(out, lse)``."""
    backend = get_backend(chosen.backend)
    # A decode step lasts tens of microseconds: record_function only while a profiler runs.
    with profiled(chosen.fwd_name):
        q = backend.append_kv(q, k_cache, v_cache, k, v, args)
        return backend.attention_kv(q, k_cache, v_cache, args)


def run_merge(chosen: Plan, out_a, lse_a, out_b, lse_b):
    """``merge_states`` on the backend ``chosen`` names; returns ``(out, lse)``."""
    with profiled(chosen.fwd_name):
        return get_backend(chosen.backend).merge_states(out_a, lse_a, out_b, lse_b)


def _kvcache_args(q, k_cache, k, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                  alibi_slopes, sink, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  num_splits, k_descale, v_descale) -> KVCacheArgs:
    """The KVCacheArgs of an op call (its arguments were validated by the public function)."""
    batch, seqlen_q, nheads, _ = q.shape
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    return KVCacheArgs(
        softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, alibi_slopes=None if alibi_slopes is None else alibi_slopes.expand(batch, nheads), sink=sink,
        max_seqlen_q=seqlen_q, max_seqlen_k=capacity, cache_seqlens=cache_seqlens,
        seqlen_new=0 if k is None else k.shape[1], cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        num_splits=num_splits, k_descale=k_descale, v_descale=v_descale,
    )


@custom_op("flashtile::attention_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                      cache_seqlens: Tensor, rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                      cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                      alibi_slopes: Optional[Tensor], sink: Optional[Tensor], softmax_scale: float, causal: bool,
                      window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                      num_splits: int, k_descale: Optional[Tensor], v_descale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``flash_attn_with_kvcache``, k and v appended to the caches in place (quantized with
    ``k_descale`` / ``v_descale`` into an FP8 cache); the backend is chosen (and recorded) when it runs."""
    args = _kvcache_args(q, k_cache, k, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                         block_table, alibi_slopes, sink, softmax_scale, causal, window_left, window_right, softcap,
                         rotary_interleaved, num_splits, k_descale, v_descale)
    chosen = dispatch(AttentionCall.of(q, k_cache, v_cache, args))
    return run_kvcache(chosen, q, k_cache, v_cache, k, v, args)


@attention_kvcache.register_fake
def _attention_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                            cache_leftpad, block_table, alibi_slopes, sink, softmax_scale, causal, window_left,
                            window_right, softcap, rotary_interleaved, num_splits, k_descale, v_descale):
    args = _kvcache_args(q, k_cache, k, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                         block_table, alibi_slopes, sink, softmax_scale, causal, window_left, window_right, softcap,
                         rotary_interleaved, num_splits, k_descale, v_descale)
    check_features(AttentionCall.of(q, k_cache, v_cache, args))
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v_cache.shape[-1]))
    return out, q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def attention_with_kvcache(q, k_cache, v_cache, k, v, args: KVCacheArgs):
    """``(out, lse)`` through the custom op (the compiled path of ``flash_attn_with_kvcache``)."""
    return attention_kvcache(
        q, k_cache, v_cache, k, v, args.cache_seqlens, args.rotary_cos, args.rotary_sin, args.cache_batch_idx,
        args.cache_leftpad, args.block_table, args.alibi_slopes, args.sink, args.softmax_scale, args.causal,
        args.window_left, args.window_right, args.softcap, args.rotary_interleaved, args.num_splits, args.k_descale,
        args.v_descale)


@custom_op("flashtile::merge_states", mutates_args=())
def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``merge_attention_states``; the backend is chosen (and recorded) when it runs."""
    return run_merge(dispatch(merge_call(out_a)), out_a, lse_a, out_b, lse_b)


@merge_states.register_fake
def _merge_states_fake(out_a, lse_a, out_b, lse_b):
    check_features(merge_call(out_a))
    return torch.empty_like(out_a), torch.empty_like(lse_a)
