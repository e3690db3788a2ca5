"""FlashAttention-2 forward: one program per (query block, head, batch or sequence).

Scores live in the exp2 domain with the softmax scale folded in
(``qk_scale = softmax_scale * log2(e)``), so a plain element costs one FMA and one exp2.
Softcap, ALiBi, bias, windows and dropout are compile-time switches: a call without them
runs the plain loop.
"""
import triton
import triton.language as tl

from .common import (LOG2E, dropout_keep, head_base, head_terms, int64, kv_block_range, load_tile, program_block,
                     run_bounds, score_scale, scores, sequence, softmax_step, store_tile, tile_ptrs, visible)

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_dk, offs_dv,
                    lo, hi, seqlen_q, seqlen_k, qk_scale, softcap2, slope2, bias_base, stride_bm, stride_bn,
                    window_left, window_right, seed, offset, bh, threshold,
                    BLOCK_N: tl.constexpr, HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
                    HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr,
                    DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    full_lo=0, full_hi=0, EDGES: tl.constexpr = False):
    """Keys ``[lo, hi)``; ``MASK``: every block is masked. ``EDGES``: only the blocks outside
    ``[full_lo, full_hi)`` are, under a branch that is uniform across the program."""
    MODIFIED: tl.constexpr = MASK or EDGES or SOFTCAP or ALIBI or BIAS != ""
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        # Full blocks are in range by construction: only masked blocks check the key boundary.
        k = load_tile(k_ptrs, offs_n, seqlen_k, offs_dk, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, MASK or EDGES)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if MODIFIED:
            s, _ = scores(qk, offs_m[:, None], offs_n[None, :], start_n, seqlen_q, seqlen_k, qk_scale, softcap2,
                          slope2, bias_base, stride_bm, stride_bn, window_left, window_right,
                          MASK, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS)
            if EDGES:
                if (start_n < full_lo) | (start_n >= full_hi):
                    s = tl.where(visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                                         window_right, MASK_LEFT, MASK_RIGHT), s, float("-inf"))
        else:
            s = qk
        p, alpha, m_ij = softmax_step(qk, s, m_i, qk_scale, MODIFIED)
        # Rescale what was accumulated under the old row max, then add this block.
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            # The denominator sums every probability; only the kept ones reach the output.
            p = tl.where(dropout_keep(seed, offset, bh, offs_m, start_n, threshold, BLOCK_N), p, 0.0)
        v = load_tile(v_ptrs, offs_n, seqlen_k, offs_dv, HEAD_DIM_V_ACTUAL, HEAD_DIM_V, MASK or EDGES)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_ij
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# seed and offset change every call: one compiled kernel serves all their values.
@triton.jit(do_not_specialize=["seed", "offset", "total_q", "total_k"])
def attn_fwd(Q, K, V, O, LSE, softmax_scale, softcap, window_left, window_right,
             ALIBI_SLOPES, SINK, BIAS_PTR, seed, offset, threshold, dropout_scale,
             CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, total_q, total_k, ERR,
             stride_qb, stride_qm, stride_qh,
             stride_kb, stride_kn, stride_kh,
             stride_vb, stride_vn, stride_vh,
             stride_ob, stride_om, stride_oh,
             stride_lse_b, stride_lse_h, stride_alibi_b,
             stride_bb, stride_bh, stride_bm, stride_bn,
             nheads, seqlen_q, seqlen_k, group,
             HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
             HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
             ALIBI: tl.constexpr, HAS_SINK: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
             IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
             EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_qb, stride_qm, stride_qh = int64(stride_qb, stride_qm, stride_qh)
    stride_kb, stride_kn, stride_kh = int64(stride_kb, stride_kn, stride_kh)
    stride_vb, stride_vn, stride_vh = int64(stride_vb, stride_vn, stride_vh)
    stride_bb, stride_bh, stride_bm = int64(stride_bb, stride_bh, stride_bm)
    stride_ob, stride_om, stride_oh = int64(stride_ob, stride_om, stride_oh)
    # Causal rows near the end visit the most keys: launch them first for a shorter tail.
    start_m, off_b, off_h = program_block(MASK_RIGHT and not MASK_LEFT)
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                                                    total_q, total_k, ERR, IS_VARLEN, HAS_SEQUSED, True)
    # Varlen grids are sized for the longest sequence.
    if start_m * BLOCK_M >= seqlen_q:
        return
    off_hk = off_h // group

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, HEAD_DIM_QK)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q_ptrs = tile_ptrs(head_base(Q, off_b, off_h, q_start, stride_qb, stride_qm, stride_qh), offs_m, stride_qm, offs_dk)
    k_ptrs = tile_ptrs(head_base(K, off_b, off_hk, k_start, stride_kb, stride_kn, stride_kh), offs_n, stride_kn, offs_dk)
    v_ptrs = tile_ptrs(head_base(V, off_b, off_hk, k_start, stride_vb, stride_vn, stride_vh), offs_n, stride_vn, offs_dv)

    if HAS_SINK:
        # The sink is one more logit in every row's softmax, with no value: start the row there.
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK + off_h).to(tl.float32) * LOG2E
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    qk_scale = score_scale(softmax_scale, softcap, SOFTCAP)
    slope2, bias_base, bh = head_terms(off_b, off_h, nheads, ALIBI_SLOPES, stride_alibi_b, BIAS_PTR,
                                       stride_bb, stride_bh, ALIBI)
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_dk, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, not EVEN_M)

    lo, full_lo, full_hi, hi = kv_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                              BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    if MASK_LEFT and MASK_RIGHT:
        # A two-sided window visits few blocks per program: one pipelined loop that masks only its
        # edge blocks beats three short loops (H200, (1024, 0) at 16k: 0.376 -> 0.354 ms).
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_dk, offs_dv,
            lo, hi, seqlen_q, seqlen_k, qk_scale, softcap * LOG2E, slope2, bias_base, stride_bm, stride_bn,
            window_left, window_right, seed, offset, bh, threshold,
            BLOCK_N, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, HEAD_DIM_V_ACTUAL, HEAD_DIM_V,
            False, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS, DROPOUT, INPUT_PRECISION,
            full_lo, full_hi, True)
    else:
        for run in tl.static_range(3):
            # Runs 0 and 2 straddle the window's edges or the sequence end; run 1 needs no mask.
            run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
            # Without a left edge run 0 is empty: leave it out of the compiled kernel.
            if run != 0 or MASK_LEFT:
                acc, l_i, m_i = _attn_fwd_inner(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_dk, offs_dv,
                    run_lo, run_hi, seqlen_q, seqlen_k, qk_scale, softcap * LOG2E, slope2, bias_base, stride_bm,
                    stride_bn, window_left, window_right, seed, offset, bh, threshold,
                    BLOCK_N, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, HEAD_DIM_V_ACTUAL, HEAD_DIM_V,
                    run != 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS, DROPOUT, INPUT_PRECISION)

    # A row that saw no key (and no sink) has l = 0: its output is 0 and its lse is -inf.
    seen = l_i > 0.0
    acc = acc * (dropout_scale / tl.where(seen, l_i, 1.0))[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_ptrs = tile_ptrs(head_base(O, off_b, off_h, q_start, stride_ob, stride_om, stride_oh), offs_m, stride_om, offs_dv)
    store_tile(o_ptrs, acc.to(O.dtype.element_ty), offs_m, seqlen_q, offs_dv, HEAD_DIM_V_ACTUAL)
    tl.store(LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m, lse, mask=offs_m < seqlen_q)
