"""FlashAttention-2 backward, recomputing P tile by tile from Q, K and the saved LSE.

Three kernels, a fourth for split key blocks and a fifth for the sink's gradient, with no atomics (so
gradients are bit-identical run to run):
  * ``bwd_preprocess``: ``delta = rowsum(dO * O)`` and the LSE moved to the exp2 domain;
  * ``bwd_dkdv``: one program per key block; it walks the query blocks of every query
    head in its GQA group, so dK/dV are the group sums without atomics. When that leaves the
    GPU under-filled (few KV heads, short batches), ``split`` programs share a key block's query
    rows, each storing float32 partial sums that ``bwd_sum_parts`` adds up in a fixed order;
  * ``bwd_dq``: one program per query block, walking the key blocks like the forward; it
    also writes dS for the bias gradient, each element exactly once;
  * ``bwd_sink_grad``: one program per head sums its rows' share of the sink.
With ``dS = P * (dP - delta)``: ``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.
Softcap multiplies dS by ``1 - tanh^2`` on its way to dQ and dK; dropout scales dP and P by
the kept mask over ``1 - p`` (regenerated from the same counters as the forward).

The q/k head dim is padded to ``HEAD_DIM_QK`` columns, or with ``TAIL_DIM`` (the launcher's choice at 192)
worked as ``HEAD_DIM_QK`` (128) real columns plus a tail of ``TAIL_DIM`` (64): Q, K, dK and dQ tiles come in
two parts, ``S = Q K^T`` sums the two parts' products and dK, dQ keep one accumulator per part. That spares
the 64 padded columns of every QK^T, dK and dQ product (18% of the pair's matmul work at 192/128).
"""
import triton
import triton.language as tl

from .common import (LOG2E, dropout_keep, head_base, head_terms, int64, kv_block_range, load_tile, part_range,
                     program_block, q_block_range, run_bounds, score_scale, scores, sequence, store_tile, stored_keys,
                     tile_ptrs)


@triton.jit
def bwd_preprocess(O, DO, LSE, DELTA, LSE2, DQ_ACC,
                   stride_ob, stride_om, stride_oh,
                   stride_dob, stride_dom, stride_doh,
                   stride_dqb, stride_dqm, stride_dqh,
                   stride_lse_b, stride_lse_h, seqlen_q,
                   HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   ZERO_DQ: tl.constexpr, DQ_DIM_ACTUAL: tl.constexpr, DQ_DIM: tl.constexpr):
    """Runs over the rows of (batch, seqlen_q) or, for varlen, of all packed tokens (batch 1); ``HEAD_DIM*``: the
    values' head dim (O's and dO's). With ``ZERO_DQ`` it also zeroes these rows of the one-pass backward's float32 dQ
    buffer ``DQ_ACC``, of q's head dim ``DQ_DIM_ACTUAL`` (``DQ_DIM``: padded to a power of two)."""
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_ob, stride_om, stride_oh = int64(stride_ob, stride_om, stride_oh)
    stride_dob, stride_dom, stride_doh = int64(stride_dob, stride_dom, stride_doh)
    start_m, off_b, off_h = program_block(False)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = load_tile(tile_ptrs(head_base(O, off_b, off_h, 0, stride_ob, stride_om, stride_oh), offs_m, stride_om, offs_d),
                  offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
    do = load_tile(tile_ptrs(head_base(DO, off_b, off_h, 0, stride_dob, stride_dom, stride_doh), offs_m, stride_dom,
                             offs_d), offs_m, seqlen_q, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = off_b * stride_lse_b + off_h * stride_lse_h + offs_m
    lse = tl.load(LSE + row, mask=offs_m < seqlen_q, other=0.0)
    # A row that saw no key has lse = -inf; +inf makes every recomputed P of it exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(DELTA + row, delta, mask=offs_m < seqlen_q)
    tl.store(LSE2 + row, lse2, mask=offs_m < seqlen_q)
    if ZERO_DQ:
        stride_dqb, stride_dqm, stride_dqh = int64(stride_dqb, stride_dqm, stride_dqh)
        offs_dq = tl.arange(0, DQ_DIM)
        store_tile(tile_ptrs(head_base(DQ_ACC, off_b, off_h, 0, stride_dqb, stride_dqm, stride_dqh), offs_m, stride_dqm,
                             offs_dq), tl.zeros([BLOCK_M, DQ_DIM], dtype=tl.float32), offs_m, seqlen_q, offs_dq,
                   DQ_DIM_ACTUAL)


@triton.jit
def bwd_sink_grad(SINK, LSE, DELTA, DSINK, batch, rows, stride_lse_b, stride_lse_h, BLOCK_M: tl.constexpr):
    """``DSINK[h] = -sum over rows of exp(sink[h] - lse) * delta``: the sink's share of each row's softmax
    times the row's delta (the sink has no value, so its dP is 0). One program per head, adding its rows in
    a fixed order; a row that saw nothing (lse ``-inf``, rows past the last packed sequence) adds 0."""
    off_h = tl.program_id(0)
    sink = tl.load(SINK + off_h).to(tl.float32)
    stride_lse_b = tl.cast(stride_lse_b, tl.int64)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for off_b in range(batch):
        base = off_b * stride_lse_b + off_h * stride_lse_h
        for start in range(0, rows, BLOCK_M):
            offs = start + tl.arange(0, BLOCK_M)
            lse = tl.load(LSE + base + offs, mask=offs < rows, other=float("-inf"))
            delta = tl.load(DELTA + base + offs, mask=offs < rows, other=0.0)
            share = tl.where(lse == float("-inf"), 0.0, tl.exp(sink - lse))
            total += share * delta
    tl.store(DSINK + off_h, (-tl.sum(total, axis=0)).to(DSINK.dtype.element_ty))


@triton.jit
def bwd_sum_parts(PART, OUT, seqlen, stride_pb, stride_pm, stride_ph, stride_ob, stride_om, stride_oh,
                  HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """``OUT[b, m, h] = sum over p of PART[b, m, h * SPLITS + p]``, added in part order and cast to OUT's
    dtype: the split dK/dV kernel's float32 partial sums of one KV head. One program per ``BLOCK_M`` rows
    of one (head, sequence); varlen runs over all packed tokens as one sequence."""
    stride_pb, stride_pm, stride_ph = int64(stride_pb, stride_pm, stride_ph)
    stride_ob, stride_om, stride_oh = int64(stride_ob, stride_om, stride_oh)
    start_m, off_b, off_h = program_block(False)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    part_ptrs = tile_ptrs(head_base(PART, off_b, off_h * SPLITS, 0, stride_pb, stride_pm, stride_ph), offs_m,
                          stride_pm, offs_d)
    total = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for _ in tl.static_range(SPLITS):
        total += load_tile(part_ptrs, offs_m, seqlen, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True)
        part_ptrs += stride_ph
    store_tile(tile_ptrs(head_base(OUT, off_b, off_h, 0, stride_ob, stride_om, stride_oh), offs_m, stride_om, offs_d),
               total.to(OUT.dtype.element_ty), offs_m, seqlen, offs_d, HEAD_DIM_ACTUAL)


@triton.jit
def _qk_ptrs(base, offs_rows, stride_rows, HEAD_DIM_QK: tl.constexpr, TAIL_DIM: tl.constexpr):
    """Pointer tiles to the q/k columns of rows ``offs_rows``: the first ``HEAD_DIM_QK`` and, with ``TAIL_DIM``,
    the ``TAIL_DIM`` after them (without a tail the second is the first again, never read)."""
    ptrs = tile_ptrs(base, offs_rows, stride_rows, tl.arange(0, HEAD_DIM_QK))
    if TAIL_DIM:
        tail_ptrs = tile_ptrs(base + HEAD_DIM_QK, offs_rows, stride_rows, tl.arange(0, TAIL_DIM))
    else:
        tail_ptrs = ptrs
    return ptrs, tail_ptrs


@triton.jit
def _load_qk(ptrs, tail_ptrs, offs_rows, n_rows, HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
             TAIL_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """``load_tile`` of a Q or K tile as ``(main, tail)`` (without a tail, ``(tile, tile)``)."""
    if TAIL_DIM:
        # The main part's columns are all real: only the tail can hold padding.
        tile = load_tile(ptrs, offs_rows, n_rows, tl.arange(0, HEAD_DIM_QK), HEAD_DIM_QK, HEAD_DIM_QK, CHECK_ROWS)
        tail = load_tile(tail_ptrs, offs_rows, n_rows, tl.arange(0, TAIL_DIM), HEAD_DIM_QK_ACTUAL - HEAD_DIM_QK,
                         TAIL_DIM, CHECK_ROWS)
    else:
        tile = load_tile(ptrs, offs_rows, n_rows, tl.arange(0, HEAD_DIM_QK), HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK,
                         CHECK_ROWS)
        tail = tile
    return tile, tail


@triton.jit
def _store_qk(ptrs, tail_ptrs, tile, tail, offs_rows, n_rows, HEAD_DIM_QK_ACTUAL: tl.constexpr,
              HEAD_DIM_QK: tl.constexpr, TAIL_DIM: tl.constexpr):
    """``store_tile`` of a dK or dQ tile given as its main part and tail."""
    if TAIL_DIM:
        store_tile(ptrs, tile, offs_rows, n_rows, tl.arange(0, HEAD_DIM_QK), HEAD_DIM_QK)
        store_tile(tail_ptrs, tail, offs_rows, n_rows, tl.arange(0, TAIL_DIM), HEAD_DIM_QK_ACTUAL - HEAD_DIM_QK)
    else:
        store_tile(ptrs, tile, offs_rows, n_rows, tl.arange(0, HEAD_DIM_QK), HEAD_DIM_QK_ACTUAL)


@triton.jit
def _dot_qk(a, a_tail, b, b_tail, TAIL_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``a b^T`` over the q/k head dim: the tail's product is added onto the main part's."""
    ab = tl.dot(a, tl.trans(b), input_precision=INPUT_PRECISION)
    if TAIL_DIM:
        ab = tl.dot(a_tail, tl.trans(b_tail), ab, input_precision=INPUT_PRECISION)
    return ab


@triton.jit
def _acc_qk(acc, acc_tail, ds, x, x_tail, TAIL_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc += ds x`` for each part of ``x`` (Q for dK, K for dQ): the parts' columns are independent."""
    acc = tl.dot(ds.to(x.dtype), x, acc, input_precision=INPUT_PRECISION)
    if TAIL_DIM:
        acc_tail = tl.dot(ds.to(x.dtype), x_tail, acc_tail, input_precision=INPUT_PRECISION)
    return acc, acc_tail


@triton.jit
def _bwd_dkdv_inner(dk, dk_tail, dv, k, k_tail, v, q_base, do_base, lse2_ptr, delta_ptr, stride_qm, stride_dom,
                    start_n, offs_n, offs_dv, lo, hi, seqlen_q, seqlen_k, qk_scale, softcap2, slope2,
                    bias_base, stride_bm, stride_bn, window_left, window_right,
                    seed, offset, bh, threshold, dropout_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_QK_ACTUAL: tl.constexpr,
                    HEAD_DIM_QK: tl.constexpr, TAIL_DIM: tl.constexpr, HEAD_DIM_V_ACTUAL: tl.constexpr,
                    HEAD_DIM_V: tl.constexpr, MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr,
                    DROPOUT: tl.constexpr, EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_m = lo + tl.arange(0, BLOCK_M)
    # Only masked runs can reach past seqlen_q (see q_block_range): the unmasked run loads whole blocks.
    CHECK_ROWS: tl.constexpr = MASK and not EVEN_M
    for _ in range(lo, hi, BLOCK_M):
        # Pointers made from the row offsets each step: two pointer tiles carried through the loop would
        # take a register per element and spill.
        q_ptrs, q_tail_ptrs = _qk_ptrs(q_base, offs_m, stride_qm, HEAD_DIM_QK, TAIL_DIM)
        q, q_tail = _load_qk(q_ptrs, q_tail_ptrs, offs_m, seqlen_q, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM,
                             CHECK_ROWS)
        # Rows past seqlen_q read lse = +inf, so their P is 0 and they add nothing.
        if not CHECK_ROWS:
            lse2 = tl.load(lse2_ptr + offs_m)
            delta = tl.load(delta_ptr + offs_m)
        else:
            lse2 = tl.load(lse2_ptr + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
            delta = tl.load(delta_ptr + offs_m, mask=offs_m < seqlen_q, other=0.0)
        # Work on the transposed tile (keys x queries) so dK and dV accumulate row-wise.
        qk_t = _dot_qk(k, k_tail, q, q_tail, TAIL_DIM, INPUT_PRECISION)
        s_t, t_t = scores(qk_t, offs_m[None, :], offs_n[:, None], start_n, seqlen_q, seqlen_k, qk_scale, softcap2,
                          slope2, bias_base, stride_bm, stride_bn, window_left, window_right,
                          MASK, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        do = load_tile(tile_ptrs(do_base, offs_m, stride_dom, offs_dv), offs_m, seqlen_q, offs_dv, HEAD_DIM_V_ACTUAL,
                       HEAD_DIM_V, CHECK_ROWS)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        if DROPOUT:
            # The output saw P * keep / (1 - p): dV and dP see the same mask and scale.
            keep = tl.trans(dropout_keep(seed, offset, bh, offs_m, start_n, threshold, BLOCK_N))
            dv = tl.dot(tl.where(keep, p_t * dropout_scale, 0.0).to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
            dp_t = tl.where(keep, dp_t * dropout_scale, 0.0)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            # d(c * tanh(x / c)) / dx = 1 - tanh^2.
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk, dk_tail = _acc_qk(dk, dk_tail, ds_t, q, q_tail, TAIL_DIM, INPUT_PRECISION)
        offs_m += BLOCK_M
    return dk, dk_tail, dv


# seed and offset change every call: one compiled kernel serves all their values.
@triton.jit(do_not_specialize=["seed", "offset", "total_q", "total_k"])
def bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, softmax_scale, softcap, window_left, window_right,
             ALIBI_SLOPES, BIAS_PTR, seed, offset, threshold, dropout_scale,
             CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, total_q, total_k, ERR,
             stride_qb, stride_qm, stride_qh,
             stride_kb, stride_kn, stride_kh,
             stride_vb, stride_vn, stride_vh,
             stride_dob, stride_dom, stride_doh,
             stride_dkb, stride_dkn, stride_dkh,
             stride_dvb, stride_dvn, stride_dvh,
             stride_lse_b, stride_lse_h, stride_alibi_b,
             stride_bb, stride_bh, stride_bm, stride_bn,
             nheads, seqlen_q, seqlen_k, group, split,
             HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr, TAIL_DIM: tl.constexpr,
             HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
             ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr,
             IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
             EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_qb, stride_qm, stride_qh = int64(stride_qb, stride_qm, stride_qh)
    stride_kb, stride_kn, stride_kh = int64(stride_kb, stride_kn, stride_kh)
    stride_vb, stride_vn, stride_vh = int64(stride_vb, stride_vn, stride_vh)
    stride_bb, stride_bh, stride_bm = int64(stride_bb, stride_bh, stride_bm)
    stride_dob, stride_dom, stride_doh = int64(stride_dob, stride_dom, stride_doh)
    stride_dkb, stride_dkn, stride_dkh = int64(stride_dkb, stride_dkn, stride_dkh)
    stride_dvb, stride_dvn, stride_dvh = int64(stride_dvb, stride_dvn, stride_dvh)
    # Program axis 1 runs over (KV head, part): DK and DV have ``split`` partial heads per KV head.
    start_n, off_b, off_part = program_block(False)
    off_hk = off_part // split
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                                                    total_q, total_k, ERR, IS_VARLEN, HAS_SEQUSED, False)
    # Keys this program stores: with seqused_k the sequence's keys past seqused_k get gradient 0.
    stored_k = stored_keys(off_b, k_start, seqlen_k, CU_SEQLENS_K, total_k, HAS_SEQUSED)
    # Varlen grids are sized for the longest sequence.
    if start_n * BLOCK_N >= stored_k:
        return

    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    # Pointer tiles are made where they are used: held across the loops they would take registers the
    # loops need.
    dk_base = head_base(DK, off_b, off_part, k_start, stride_dkb, stride_dkn, stride_dkh)
    dv_base = head_base(DV, off_b, off_part, k_start, stride_dvb, stride_dvn, stride_dvh)
    if HAS_SEQUSED:
        if start_n * BLOCK_N >= seqlen_k:
            # Unused keys: nothing to accumulate.
            dk_ptrs, dk_tail_ptrs = _qk_ptrs(dk_base, offs_n, stride_dkn, HEAD_DIM_QK, TAIL_DIM)
            zeros = tl.zeros([BLOCK_N, HEAD_DIM_QK], dtype=DK.dtype.element_ty)
            _store_qk(dk_ptrs, dk_tail_ptrs, zeros, tl.zeros([BLOCK_N, max(TAIL_DIM, 1)], dtype=DK.dtype.element_ty),
                      offs_n, stored_k, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM)
            store_tile(tile_ptrs(dv_base, offs_n, stride_dvn, offs_dv), tl.zeros([BLOCK_N, HEAD_DIM_V],
                       dtype=DV.dtype.element_ty), offs_n, stored_k, offs_dv, HEAD_DIM_V_ACTUAL)
            return
    k_ptrs, k_tail_ptrs = _qk_ptrs(head_base(K, off_b, off_hk, k_start, stride_kb, stride_kn, stride_kh), offs_n,
                                   stride_kn, HEAD_DIM_QK, TAIL_DIM)
    k, k_tail = _load_qk(k_ptrs, k_tail_ptrs, offs_n, seqlen_k, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM, True)
    v = load_tile(tile_ptrs(head_base(V, off_b, off_hk, k_start, stride_vb, stride_vn, stride_vh), offs_n, stride_vn,
                            offs_dv), offs_n, seqlen_k, offs_dv, HEAD_DIM_V_ACTUAL, HEAD_DIM_V, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_QK], dtype=tl.float32)
    # dK's tail columns (without a tail, a stand-in that no step touches).
    dk_tail = tl.zeros([BLOCK_N, max(TAIL_DIM, 1)], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    qk_scale = score_scale(softmax_scale, softcap, SOFTCAP)
    lo, full_lo, full_hi, hi = q_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, EVEN_M)
    part_lo, part_hi = part_range(lo, hi, off_part % split, split, BLOCK_M)

    # Sum over the query heads that share this KV head (GQA), in a fixed order.
    for g in range(group):
        off_h = off_hk * group + g
        q_base = head_base(Q, off_b, off_h, q_start, stride_qb, stride_qm, stride_qh)
        do_base = head_base(DO, off_b, off_h, q_start, stride_dob, stride_dom, stride_doh)
        row = off_b * stride_lse_b + off_h * stride_lse_h + q_start
        slope2, bias_base, bh = head_terms(off_b, off_h, nheads, ALIBI_SLOPES, stride_alibi_b, BIAS_PTR,
                                           stride_bb, stride_bh, ALIBI)
        for run in tl.static_range(3):
            # Runs 0 and 2 straddle the window's edges; run 1 needs no mask.
            run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
            run_lo, run_hi = tl.maximum(run_lo, part_lo), tl.minimum(run_hi, part_hi)
            # Run 0 is empty without a right edge (causal), run 2 without a left edge or a partial
            # last query block: leave them out.
            if (run != 0 or MASK_RIGHT) and (run != 2 or MASK_LEFT or not EVEN_M):
                dk, dk_tail, dv = _bwd_dkdv_inner(
                    dk, dk_tail, dv, k, k_tail, v, q_base, do_base, LSE2 + row, DELTA + row, stride_qm, stride_dom,
                    start_n * BLOCK_N, offs_n, offs_dv, run_lo, run_hi, seqlen_q, seqlen_k, qk_scale, softcap * LOG2E, slope2,
                    bias_base, stride_bm, stride_bn, window_left, window_right,
                    seed, offset, bh, threshold, dropout_scale,
                    BLOCK_M, BLOCK_N, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM, HEAD_DIM_V_ACTUAL, HEAD_DIM_V,
                    run != 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS, DROPOUT, EVEN_M, INPUT_PRECISION)

    dk *= softmax_scale
    dk_tail *= softmax_scale
    if HAS_SEQUSED:
        # Unmasked runs do not check the key bound: rows past seqused_k are set to 0 here.
        dk = tl.where(offs_n[:, None] < seqlen_k, dk, 0.0)
        dk_tail = tl.where(offs_n[:, None] < seqlen_k, dk_tail, 0.0)
        dv = tl.where(offs_n[:, None] < seqlen_k, dv, 0.0)
    dk_ptrs, dk_tail_ptrs = _qk_ptrs(dk_base, offs_n, stride_dkn, HEAD_DIM_QK, TAIL_DIM)
    _store_qk(dk_ptrs, dk_tail_ptrs, dk.to(DK.dtype.element_ty), dk_tail.to(DK.dtype.element_ty), offs_n, stored_k,
              HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM)
    store_tile(tile_ptrs(dv_base, offs_n, stride_dvn, offs_dv), dv.to(DV.dtype.element_ty), offs_n, stored_k, offs_dv,
               HEAD_DIM_V_ACTUAL)


@triton.jit
def _bwd_dq_inner(dq, dq_tail, q, q_tail, do, lse2, delta, k_ptrs, k_tail_ptrs, v_ptrs, stride_kn, stride_vn, offs_m,
                  offs_dv,
                  lo, hi, seqlen_q, seqlen_k, qk_scale, softcap2, slope2, bias_base, dbias_base,
                  stride_bm, stride_bn, window_left, window_right,
                  seed, offset, bh, threshold, dropout_scale,
                  BLOCK_N: tl.constexpr, HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
                  TAIL_DIM: tl.constexpr, HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr,
                  DROPOUT: tl.constexpr, WRITE_DBIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs += lo * stride_kn
    if TAIL_DIM:
        k_tail_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        k, k_tail = _load_qk(k_ptrs, k_tail_ptrs, offs_n, seqlen_k, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM, MASK)
        v = load_tile(v_ptrs, offs_n, seqlen_k, offs_dv, HEAD_DIM_V_ACTUAL, HEAD_DIM_V, MASK)
        qk = _dot_qk(q, q_tail, k, k_tail, TAIL_DIM, INPUT_PRECISION)
        # Keys past seqlen_k were read as zeros: the mask gives them P = 0 so they add nothing to dQ.
        s, t = scores(qk, offs_m[:, None], offs_n[None, :], start_n, seqlen_q, seqlen_k, qk_scale, softcap2,
                      slope2, bias_base, stride_bm, stride_bn, window_left, window_right,
                      MASK, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, offset, bh, offs_m, start_n, threshold, BLOCK_N)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if WRITE_DBIAS:
            # dL/d(bias) is dS itself; this program owns these (query, key) pairs of its head.
            tl.store(dbias_base + offs_m[:, None].to(tl.int64) * seqlen_k + offs_n[None, :], ds,
                     mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq, dq_tail = _acc_qk(dq, dq_tail, ds, k, k_tail, TAIL_DIM, INPUT_PRECISION)
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        if TAIL_DIM:
            k_tail_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq, dq_tail


# seed and offset change every call: one compiled kernel serves all their values.
@triton.jit(do_not_specialize=["seed", "offset", "total_q", "total_k"])
def bwd_dq(Q, K, V, DO, DQ, LSE2, DELTA, DBIAS, softmax_scale, softcap, window_left, window_right,
           ALIBI_SLOPES, BIAS_PTR, seed, offset, threshold, dropout_scale,
           CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, total_q, total_k, ERR,
           stride_qb, stride_qm, stride_qh,
           stride_kb, stride_kn, stride_kh,
           stride_vb, stride_vn, stride_vh,
           stride_dob, stride_dom, stride_doh,
           stride_dqb, stride_dqm, stride_dqh,
           stride_lse_b, stride_lse_h, stride_alibi_b,
           stride_bb, stride_bh, stride_bm, stride_bn,
           nheads, seqlen_q, seqlen_k, group,
           HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr, TAIL_DIM: tl.constexpr,
           HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
           ALIBI: tl.constexpr, BIAS: tl.constexpr, DROPOUT: tl.constexpr, WRITE_DBIAS: tl.constexpr,
           IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
           EVEN_M: tl.constexpr, INPUT_PRECISION: tl.constexpr, ADD_DQ: tl.constexpr = False):
    """dQ of one block of query rows, written into ``DQ`` or, with ``ADD_DQ``, added to what it holds (ring
    attention sums a row's dQ over its steps in float32)."""
    # Offsets of long sequences can pass 2**31 elements: do the index math in int64.
    stride_qb, stride_qm, stride_qh = int64(stride_qb, stride_qm, stride_qh)
    stride_kb, stride_kn, stride_kh = int64(stride_kb, stride_kn, stride_kh)
    stride_vb, stride_vn, stride_vh = int64(stride_vb, stride_vn, stride_vh)
    stride_bb, stride_bh, stride_bm = int64(stride_bb, stride_bh, stride_bm)
    stride_dob, stride_dom, stride_doh = int64(stride_dob, stride_dom, stride_doh)
    stride_dqb, stride_dqm, stride_dqh = int64(stride_dqb, stride_dqm, stride_dqh)
    start_m, off_b, off_h = program_block(MASK_RIGHT and not MASK_LEFT)
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                                                    total_q, total_k, ERR, IS_VARLEN, HAS_SEQUSED, False)
    if start_m * BLOCK_M >= seqlen_q:
        return
    off_hk = off_h // group

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q_ptrs, q_tail_ptrs = _qk_ptrs(head_base(Q, off_b, off_h, q_start, stride_qb, stride_qm, stride_qh), offs_m,
                                   stride_qm, HEAD_DIM_QK, TAIL_DIM)
    q, q_tail = _load_qk(q_ptrs, q_tail_ptrs, offs_m, seqlen_q, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM, not EVEN_M)
    do = load_tile(tile_ptrs(head_base(DO, off_b, off_h, q_start, stride_dob, stride_dom, stride_doh), offs_m,
                             stride_dom, offs_dv), offs_m, seqlen_q, offs_dv, HEAD_DIM_V_ACTUAL, HEAD_DIM_V, not EVEN_M)
    row = off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m
    lse2 = tl.load(LSE2 + row, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(DELTA + row, mask=offs_m < seqlen_q, other=0.0)
    k_ptrs, k_tail_ptrs = _qk_ptrs(head_base(K, off_b, off_hk, k_start, stride_kb, stride_kn, stride_kh), offs_n,
                                   stride_kn, HEAD_DIM_QK, TAIL_DIM)
    v_ptrs = tile_ptrs(head_base(V, off_b, off_hk, k_start, stride_vb, stride_vn, stride_vh), offs_n, stride_vn, offs_dv)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_QK], dtype=tl.float32)
    # dQ's tail columns (without a tail, a stand-in that no step touches).
    dq_tail = tl.zeros([BLOCK_M, max(TAIL_DIM, 1)], dtype=tl.float32)
    qk_scale = score_scale(softmax_scale, softcap, SOFTCAP)
    slope2, bias_base, bh = head_terms(off_b, off_h, nheads, ALIBI_SLOPES, stride_alibi_b, BIAS_PTR,
                                       stride_bb, stride_bh, ALIBI)
    # dS goes to a contiguous (batch, nheads, seqlen_q, seqlen_k) float32 buffer.
    dbias_base = DBIAS + (off_b * nheads + off_h) * seqlen_q * seqlen_k

    lo, full_lo, full_hi, hi = kv_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                              BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    for run in tl.static_range(3):
        # Runs 0 and 2 straddle the window's edges or the sequence end; run 1 needs no mask.
        run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
        # Without a left edge run 0 is empty: leave it out of the compiled kernel.
        if run != 0 or MASK_LEFT:
            dq, dq_tail = _bwd_dq_inner(
                dq, dq_tail, q, q_tail, do, lse2, delta, k_ptrs, k_tail_ptrs, v_ptrs, stride_kn, stride_vn, offs_m,
                offs_dv,
                run_lo, run_hi, seqlen_q, seqlen_k, qk_scale, softcap * LOG2E, slope2, bias_base, dbias_base,
                stride_bm, stride_bn, window_left, window_right,
                seed, offset, bh, threshold, dropout_scale,
                BLOCK_N, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM, HEAD_DIM_V_ACTUAL, HEAD_DIM_V,
                run != 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, BIAS, DROPOUT, WRITE_DBIAS, INPUT_PRECISION)
    dq *= softmax_scale
    dq_tail *= softmax_scale
    dq_ptrs, dq_tail_ptrs = _qk_ptrs(head_base(DQ, off_b, off_h, q_start, stride_dqb, stride_dqm, stride_dqh), offs_m,
                                     stride_dqm, HEAD_DIM_QK, TAIL_DIM)
    if ADD_DQ:
        summed, summed_tail = _load_qk(dq_ptrs, dq_tail_ptrs, offs_m, seqlen_q, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK,
                                       TAIL_DIM, True)
        dq += summed.to(tl.float32)
        if TAIL_DIM:
            dq_tail += summed_tail.to(tl.float32)
    _store_qk(dq_ptrs, dq_tail_ptrs, dq.to(DQ.dtype.element_ty), dq_tail.to(DQ.dtype.element_ty), offs_m, seqlen_q,
              HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, TAIL_DIM)
