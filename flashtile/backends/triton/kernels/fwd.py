"""FlashAttention-2 forward: one program per (query block, batch x head).

Scores live in the exp2 domain with the softmax scale folded in
(``qk_scale = softmax_scale * log2(e)``), so each element costs one FMA and one exp2.
"""
import triton
import triton.language as tl

from .common import int64, kv_block_range, load_tile, query_program, store_tile, tile_ptrs, visible

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                    lo, hi, seqlen_q, seqlen_k, qk_scale,
                    BLOCK_N: tl.constexpr, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for _ in range(lo, hi, BLOCK_N):
        # Full blocks are in range by construction: only masked blocks check the key boundary.
        k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, MASK)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if MASK:
            qk = tl.where(visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, IS_CAUSAL),
                          qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
            m_ij_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_ij_safe[:, None])
            alpha = tl.math.exp2(m_i - m_ij_safe)
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        # Rescale what was accumulated under the old row max, then add this block.
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, MASK)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_ij
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def attn_fwd(Q, K, V, O, LSE, softmax_scale,
             stride_qb, stride_qm, stride_qh,
             stride_kb, stride_kn, stride_kh,
             stride_vb, stride_vn, stride_vh,
             stride_ob, stride_om, stride_oh,
             nheads, seqlen_q, seqlen_k,
             group, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_qb, stride_qm, stride_qh = int64(stride_qb, stride_qm, stride_qh)
    stride_kb, stride_kn, stride_kh = int64(stride_kb, stride_kn, stride_kh)
    stride_vb, stride_vn, stride_vh = int64(stride_vb, stride_vn, stride_vh)
    stride_ob, stride_om, stride_oh = int64(stride_ob, stride_om, stride_oh)
    start_m, off_b, off_h, off_hk, off_bh = query_program(nheads, group, IS_CAUSAL)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = tile_ptrs(Q, off_b, off_h, stride_qb, stride_qh, offs_m, stride_qm, offs_d)
    k_ptrs = tile_ptrs(K, off_b, off_hk, stride_kb, stride_kh, offs_n, stride_kn, offs_d)
    v_ptrs = tile_ptrs(V, off_b, off_hk, stride_vb, stride_vh, offs_n, stride_vn, offs_d)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = softmax_scale * LOG2E
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, not EVEN_M)

    n_full, n_end = kv_block_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                                    0, n_full, seqlen_q, seqlen_k, qk_scale,
                                    BLOCK_N, HEAD_DIM_ACTUAL, HEAD_DIM, IS_CAUSAL, False, INPUT_PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                                    n_full, n_end, seqlen_q, seqlen_k, qk_scale,
                                    BLOCK_N, HEAD_DIM_ACTUAL, HEAD_DIM, IS_CAUSAL, True, INPUT_PRECISION)

    # A row that saw no key has l = 0: its output is 0 and its lse is -inf.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_ptrs = tile_ptrs(O, off_b, off_h, stride_ob, stride_oh, offs_m, stride_om, offs_d)
    store_tile(o_ptrs, acc.to(O.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL)
    tl.store(LSE + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
