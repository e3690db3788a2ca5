"""FlashAttention-2 backward, recomputing P tile by tile from Q, K and the saved LSE.

Three kernels, no atomics (so gradients are bit-identical run to run):
  * ``bwd_preprocess``: ``delta = rowsum(dO * O)`` and the LSE moved to the exp2 domain;
  * ``bwd_dkdv``: one program per key block; it walks the query blocks of every query
    head in its GQA group, so dK/dV are the group sums without atomics;
  * ``bwd_dq``: one program per query block, walking the key blocks like the forward.
With ``dS = P * (dP - delta)``: ``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.
"""
import triton
import triton.language as tl

from .common import int64, kv_block_range, load_tile, q_block_range, query_program, store_tile, tile_ptrs, visible

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def bwd_preprocess(O, DO, LSE, DELTA, LSE2,
                   stride_ob, stride_om, stride_oh,
                   stride_dob, stride_dom, stride_doh,
                   nheads, seqlen_q,
                   HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_ob, stride_om, stride_oh = int64(stride_ob, stride_om, stride_oh)
    stride_dob, stride_dom, stride_doh = int64(stride_dob, stride_dom, stride_doh)
    start_m, off_b, off_h, _, off_bh = query_program(nheads, 1, False)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = load_tile(tile_ptrs(O, off_b, off_h, stride_ob, stride_oh, offs_m, stride_om, offs_d),
                  offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
    do = load_tile(tile_ptrs(DO, off_b, off_h, stride_dob, stride_doh, offs_m, stride_dom, offs_d),
                   offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = off_bh * seqlen_q + offs_m
    lse = tl.load(LSE + row, mask=offs_m < seqlen_q, other=0.0)
    # A row that saw no key has lse = -inf; +inf makes every recomputed P of it exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(DELTA + row, delta, mask=offs_m < seqlen_q)
    tl.store(LSE2 + row, lse2, mask=offs_m < seqlen_q)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse2_ptr, delta_ptr, stride_qm, stride_dom,
                    offs_n, offs_d, lo, hi, seqlen_q, seqlen_k, qk_scale,
                    BLOCK_M: tl.constexpr, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, EVEN_M: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    offs_m = lo + tl.arange(0, BLOCK_M)
    q_ptrs += lo * stride_qm
    do_ptrs += lo * stride_dom
    for _ in range(lo, hi, BLOCK_M):
        q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, not EVEN_M)
        # Rows past seqlen_q read lse = +inf, so their P is 0 and they add nothing.
        if EVEN_M:
            lse2 = tl.load(lse2_ptr + offs_m)
            delta = tl.load(delta_ptr + offs_m)
        else:
            lse2 = tl.load(lse2_ptr + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
            delta = tl.load(delta_ptr + offs_m, mask=offs_m < seqlen_q, other=0.0)
        # Work on the transposed tile (keys x queries) so dK and dV accumulate row-wise.
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if MASK:
            p_t = tl.where(visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, IS_CAUSAL), p_t, 0.0)
        do = load_tile(do_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, not EVEN_M)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        offs_m += BLOCK_M
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, softmax_scale,
             stride_qb, stride_qm, stride_qh,
             stride_kb, stride_kn, stride_kh,
             stride_vb, stride_vn, stride_vh,
             stride_dob, stride_dom, stride_doh,
             stride_dkb, stride_dkn, stride_dkh,
             stride_dvb, stride_dvn, stride_dvh,
             nheads, nheads_kv, seqlen_q, seqlen_k,
             group, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_qb, stride_qm, stride_qh = int64(stride_qb, stride_qm, stride_qh)
    stride_kb, stride_kn, stride_kh = int64(stride_kb, stride_kn, stride_kh)
    stride_vb, stride_vn, stride_vh = int64(stride_vb, stride_vn, stride_vh)
    stride_dob, stride_dom, stride_doh = int64(stride_dob, stride_dom, stride_doh)
    stride_dkb, stride_dkn, stride_dkh = int64(stride_dkb, stride_dkn, stride_dkh)
    stride_dvb, stride_dvn, stride_dvh = int64(stride_dvb, stride_dvn, stride_dvh)
    start_n = tl.program_id(0)
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k = load_tile(tile_ptrs(K, off_b, off_hk, stride_kb, stride_kh, offs_n, stride_kn, offs_d),
                  offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
    v = load_tile(tile_ptrs(V, off_b, off_hk, stride_vb, stride_vh, offs_n, stride_vn, offs_d),
                  offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = softmax_scale * LOG2E
    m_start, m_full = q_block_range(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)

    # Sum over the query heads that share this KV head (GQA), in a fixed order.
    for g in range(group):
        off_h = off_hk * group + g
        q_ptrs = tile_ptrs(Q, off_b, off_h, stride_qb, stride_qh, offs_m, stride_qm, offs_d)
        do_ptrs = tile_ptrs(DO, off_b, off_h, stride_dob, stride_doh, offs_m, stride_dom, offs_d)
        row = (off_b * nheads + off_h) * seqlen_q
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE2 + row, DELTA + row, stride_qm, stride_dom,
                                 offs_n, offs_d, m_start, m_full, seqlen_q, seqlen_k, qk_scale,
                                 BLOCK_M, HEAD_DIM_ACTUAL, HEAD_DIM, IS_CAUSAL, True, EVEN_M, INPUT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE2 + row, DELTA + row, stride_qm, stride_dom,
                                 offs_n, offs_d, m_full, seqlen_q, seqlen_q, seqlen_k, qk_scale,
                                 BLOCK_M, HEAD_DIM_ACTUAL, HEAD_DIM, IS_CAUSAL, False, EVEN_M, INPUT_PRECISION)

    dk *= softmax_scale
    store_tile(tile_ptrs(DK, off_b, off_hk, stride_dkb, stride_dkh, offs_n, stride_dkn, offs_d),
               dk.to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL)
    store_tile(tile_ptrs(DV, off_b, off_hk, stride_dvb, stride_dvh, offs_n, stride_dvn, offs_d),
               dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                  lo, hi, seqlen_q, seqlen_k, qk_scale,
                  BLOCK_N: tl.constexpr, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for _ in range(lo, hi, BLOCK_N):
        k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, MASK)
        v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, MASK)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASK:
            # Keys past seqlen_k were read as zeros: they must not add to dQ.
            p = tl.where(visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, IS_CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def bwd_dq(Q, K, V, DO, DQ, LSE2, DELTA, softmax_scale,
           stride_qb, stride_qm, stride_qh,
           stride_kb, stride_kn, stride_kh,
           stride_vb, stride_vn, stride_vh,
           stride_dob, stride_dom, stride_doh,
           stride_dqb, stride_dqm, stride_dqh,
           nheads, seqlen_q, seqlen_k,
           group, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_qb, stride_qm, stride_qh = int64(stride_qb, stride_qm, stride_qh)
    stride_kb, stride_kn, stride_kh = int64(stride_kb, stride_kn, stride_kh)
    stride_vb, stride_vn, stride_vh = int64(stride_vb, stride_vn, stride_vh)
    stride_dob, stride_dom, stride_doh = int64(stride_dob, stride_dom, stride_doh)
    stride_dqb, stride_dqm, stride_dqh = int64(stride_dqb, stride_dqm, stride_dqh)
    start_m, off_b, off_h, off_hk, off_bh = query_program(nheads, group, IS_CAUSAL)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = load_tile(tile_ptrs(Q, off_b, off_h, stride_qb, stride_qh, offs_m, stride_qm, offs_d),
                  offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, not EVEN_M)
    do = load_tile(tile_ptrs(DO, off_b, off_h, stride_dob, stride_doh, offs_m, stride_dom, offs_d),
                   offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, not EVEN_M)
    row = off_bh * seqlen_q + offs_m
    lse2 = tl.load(LSE2 + row, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(DELTA + row, mask=offs_m < seqlen_q, other=0.0)
    k_ptrs = tile_ptrs(K, off_b, off_hk, stride_kb, stride_kh, offs_n, stride_kn, offs_d)
    v_ptrs = tile_ptrs(V, off_b, off_hk, stride_vb, stride_vh, offs_n, stride_vn, offs_d)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = softmax_scale * LOG2E

    n_full, n_end = kv_block_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                       0, n_full, seqlen_q, seqlen_k, qk_scale,
                       BLOCK_N, HEAD_DIM_ACTUAL, HEAD_DIM, IS_CAUSAL, False, INPUT_PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                       n_full, n_end, seqlen_q, seqlen_k, qk_scale,
                       BLOCK_N, HEAD_DIM_ACTUAL, HEAD_DIM, IS_CAUSAL, True, INPUT_PRECISION)
    dq *= softmax_scale
    store_tile(tile_ptrs(DQ, off_b, off_h, stride_dqb, stride_dqh, offs_m, stride_dqm, offs_d),
               dq.to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL)
