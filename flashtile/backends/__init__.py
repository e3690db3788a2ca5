"""Attention backends. Each backend module offers the same two functions:

``forward(q, k, v, softmax_scale, causal) -> (out, lse)``
    q ``(batch, seqlen_q, nheads, headdim)``, k/v ``(batch, seqlen_k, nheads_kv, headdim)``,
    any strides, one dtype (fp16/bf16/fp32), already validated; seqlens may be 0.
    ``out`` has q's shape and dtype; ``lse`` is ``(batch, nheads, seqlen_q)`` float32,
    natural log, ``-inf`` for a row that sees no key (whose output is 0).

``backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dq, dk, dv) -> None``
    Writes the gradients into ``dq``, ``dk``, ``dv`` (same shapes as q, k, v; possibly
    strided views of one packed tensor). dK/dV of a KV head sum over its query-head group.
"""
