"""Hopper forward in Gluon: TMA key/value ring, asynchronous wgmma, and each block's softmax
running while the tensor cores still multiply the previous block's P by V.

``tl.dot`` waits for every wgmma right after issuing it, so the Triton kernel (fwd.py) runs
matmul and softmax one after the other. Here one warpgroup owns ``BLOCK_M = 64`` query rows and
per key block ``j``:

    issue S_j = Q K_j^T          (async)
    issue O  += P_{j-1} V_{j-1}  (async, queued behind S_j)
    wait for S_j only            -> softmax of S_j overlaps the PV product
    wait for the PV product      -> rescale O by the new row max

K and V arrive through the TMA into rings of ``K_STAGES`` and ``V_STAGES`` shared-memory slots,
each slot refilled as soon as the wgmma that read it has finished. Two programs share an SM, so
one's softmax also overlaps the other's matmuls. With 64-key blocks Q sits in registers; 128-key
blocks need those registers for the scores, so Q stays in shared memory and one key slot (refilled
right after S_j, a whole softmax ahead of its use) keeps two programs within an SM's shared memory.
With softcap the scores are bounded, and ``FIXED_MAX`` (configs.fixed_row_max) holds every row's max
at one value from the start: no row max, no rescaling of O. ``FOLD_SCALE`` folds softcap's scale (at most 1)
into Q once, rounded to Q's dtype, so the tanh takes ``q . k`` with no multiply a score. With ALiBi on
128-key blocks, a block wholly on one side of the rows' diagonal keys takes the bias as linear
(``_alibi_linear_step``): one FMA an element more than plain. Scores, masks and the online softmax are
the Triton kernel's helpers (common.py). Inputs: 16-bit, head dims 128 or 256 for q, k and v alike, or
192 for q and k with 128 for v (``TAIL``); no bias or dropout (the launcher takes the Triton kernel for
those). Packed sequences (``IS_VARLEN``) read through descriptors of the whole ``(1, tokens, heads, headdim)``
tensors, KV caches (``KVCACHE``, chunked prefill) through the cache's: a tile that runs past a sequence's
keys holds the next sequence's rows or whatever the cache holds there, which the key mask hides from the
scores; those value rows are zeroed in shared memory before P V reads them (``_zero_tail``), so nothing past
the keys can reach the output, not even an infinity times a zero probability.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import LOG2E, cache_sequence, kv_range, scores, sequence, shift_max, softmax_step

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load(desc, bar, smem, off_b, row, off_h, pred):
    """TMA copy of rows ``row..`` of (batch ``off_b``, head ``off_h``) into ``smem``; ``bar`` completes
    when it lands. Rows past the tensor's end are zero-filled."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [off_b, row, off_h, 0], bar, smem, pred=pred)


@gluon.jit
def _load_qk(desc, tail_desc, bar, smem, tail_smem, off_b, row, off_h, pred, TAIL: gl.constexpr):
    """``_load`` of a Q or K tile; with ``TAIL`` its head dim comes in two parts (the first
    power-of-two columns, then the rest: 192 = 128 + 64), both completing ``bar``."""
    if TAIL:
        mbarrier.expect(bar, desc.block_type.nbytes + tail_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [off_b, row, off_h, 0], bar, smem, pred=pred)
        tma.async_copy_global_to_shared(tail_desc, [off_b, row, off_h, 0], bar, tail_smem, pred=pred)
    else:
        _load(desc, bar, smem, off_b, row, off_h, pred)


@gluon.jit
def _scores_mma(q, q_tail, k_smem, k_tail_smem, slot, s_zero, TAIL: gl.constexpr):
    """Issue S = Q K^T for key slot ``slot`` (asynchronous); with ``TAIL`` a second wgmma adds the
    tail columns' product to the first."""
    qk = warpgroup_mma(q, _tile(k_smem, slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if TAIL:
        qk = warpgroup_mma(q_tail, _tile(k_tail_smem, slot).permute((1, 0)), qk, is_async=True)
    return qk


@gluon.constexpr_function
def wgmma_layout(columns, num_warps, operand_bits=16):
    """The accumulator layout of a Hopper wgmma over ``columns`` output columns (rows: 64 a warpgroup) whose
    operands have ``operand_bits`` bits an element: one instruction reduces 32 bytes of each row (16 of bf16,
    32 of FP8)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, columns, 256 // operand_bits])


@gluon.jit
def _tile(ring, slot):
    """Slot ``slot`` of a ``[slots, 1, rows, 1, headdim]`` ring as a ``[rows, headdim]`` matrix."""
    return ring.index(slot).reshape([ring.shape[2], ring.shape[4]])


@gluon.jit
def _zero_tail(tile, rows, num_warps: gl.constexpr):
    """Zero the rows from ``rows`` on of a ``[BLOCK_N, headdim]`` shared-memory tile, before a wgmma reads it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    values = tile.load(layout)
    offs = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout))
    tile.store(gl.where((offs < rows)[:, None], values, gl.zeros_like(values)))
    # Make the generic-proxy stores visible to the tensor cores' async proxy, then wait for every thread's.
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scale_tile(tile, scale, num_warps: gl.constexpr):
    """Multiply a ``[rows, headdim]`` shared-memory tile by ``scale`` in place, before a wgmma reads it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    values = tile.load(layout)
    tile.store((values.to(gl.float32) * scale).to(values.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _softmax_block(qk, m_i, l_i, first_row, offs_m, offs_n, start_n, masked, seqlen_q, seqlen_k, qk_scale, softcap2,
                   slope2, window_left, window_right, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, FIXED_MAX: gl.constexpr, P_LOG2: gl.constexpr = 0.0):
    """The online softmax of key block ``start_n``: ``(p, alpha, m_new, l_new)``, ``l_i`` and ``l_new`` the row
    sums in :func:`_row_parts`' parts; ``masked`` (uniform
    across the program) says whether the block straddles a window edge or the sequence end. ``P_LOG2``
    (without ALiBi): p, and so l, come out times ``2**P_LOG2`` (see softmax_step).

    ``FIXED_MAX``: softcap bounds the scores (``|s| <= softcap2``), so every row keeps the launcher's
    fixed max ``m_i`` (``fixed_row_max``): no max, no rescale."""
    BLOCK_M: gl.constexpr = qk.shape[0]
    BLOCK_N: gl.constexpr = qk.shape[1]
    # 64-key blocks keep ALiBi's column terms in registers, so the exact bias costs them no more. The
    # linear form takes the raw scores: with softcap the bias follows the tanh and must be exact.
    LINEAR: gl.constexpr = ALIBI and not SOFTCAP and BLOCK_N >= 128
    left = False
    linear = False
    if LINEAR:
        # The ALiBi bias -slope * |i + diag - j| bends at each row's diagonal key: it is linear on a block
        # wholly on one side of the rows' diagonal keys, and on the keys a causal mask keeps (window_right <= 0).
        diag = seqlen_k - seqlen_q
        left = (start_n + BLOCK_N <= first_row + diag + 1) or (MASK_RIGHT and window_right <= 0)
        linear = left or (start_n >= first_row + BLOCK_M - 1 + diag)
    if linear and not masked:
        p, alpha, m_new = _alibi_linear_step(qk, m_i, offs_m, start_n, seqlen_q, seqlen_k, qk_scale, slope2,
                                             left, window_left, window_right, False, MASK_LEFT, MASK_RIGHT)
    elif linear:
        p, alpha, m_new = _alibi_linear_step(qk, m_i, offs_m, start_n, seqlen_q, seqlen_k, qk_scale, slope2,
                                             left, window_left, window_right, True, MASK_LEFT, MASK_RIGHT)
    elif masked or LINEAR:
        s, _ = scores(qk, offs_m[:, None], offs_n[None, :], start_n, seqlen_q, seqlen_k, qk_scale, softcap2, slope2,
                      0, 0, 0, window_left, window_right, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, True, ALIBI, "")
        p, alpha, m_new = _softmax_step(qk, s, m_i, qk_scale, True, FIXED_MAX, P_LOG2)
    else:
        s, _ = scores(qk, offs_m[:, None], offs_n[None, :], start_n, seqlen_q, seqlen_k, qk_scale, softcap2, slope2,
                      0, 0, 0, window_left, window_right, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, True, ALIBI, "")
        p, alpha, m_new = _softmax_step(qk, s, m_i, qk_scale, SOFTCAP or ALIBI, FIXED_MAX, P_LOG2)
    return p, alpha, m_new, l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout),
                                                    assert_trivial=True)[:, None] + _row_parts(p, l_i.shape[1])


@gluon.jit
def _row_parts(p, PARTS: gl.constexpr):
    """``p``'s row sums in ``PARTS`` parts a row, ``[BLOCK_M, PARTS]``. 8: each thread's own share, column ``8 g + c``
    adding into part ``c`` (the wgmma accumulator gives a thread every ``g`` of its ``c``), so no shuffles;
    :func:`store_rows` adds the parts up once a tile (FlashAttention-3 reduces the row sum across threads only at
    the end too). 1: summed across the row's threads each block (2 registers a thread, not 4)."""
    if PARTS == 1:
        return gl.sum(p, 1)[:, None]
    else:
        return gl.sum(gl.reshape(p, [p.shape[0], p.shape[1] // PARTS, PARTS]), 1)


@gluon.constexpr_function
def row_parts(ALIBI):
    """The row sums' parts a row (:func:`_row_parts`): 8, but 1 with ALiBi, whose linear bias already spills
    registers in the key loop (two more a thread would add to its spills)."""
    return 1 if ALIBI else 8


@gluon.jit
def row_parts_start(l_i, s_zero, PARTS: gl.constexpr):
    """Row sums ``l_i`` (``[BLOCK_M]``, in ``s_zero``'s row layout) as :func:`_row_parts`' running ``PARTS``: part 0
    holds the row's sum, the others 0 (``s_zero``: zeros in the scores' layout)."""
    zero = _row_parts(s_zero, PARTS)
    parts = gl.arange(0, PARTS, layout=gl.SliceLayout(0, zero.type.layout))
    rows = gl.convert_layout(l_i, gl.SliceLayout(1, zero.type.layout), assert_trivial=True)
    return gl.where(parts[None, :] == 0, rows[:, None], zero)


@gluon.jit
def _alibi_linear_step(qk, m_i, offs_m, start_n, seqlen_q, seqlen_k, qk_scale, slope2, left, window_left,
                       window_right, MASK: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """The online softmax of an ALiBi block whose visible keys all lie left (``left``) or right of their
    rows' diagonal keys; ``MASK``: the block straddles a window edge or the sequence end.

    There ``-slope * |i + diag - j|`` is linear in ``j``: a row term, and ``ss * (j - start_n)`` with
    ``ss = +-slope2``. Split the column ``j - start_n = lane + c``: a thread's ``c`` are constants (the
    accumulator layout puts ``lane = jj % 8 - jj % 2`` in the thread index), so ``qk + c * ss / qk_scale``
    is one FMA with an immediate, and ``ss * lane`` joins the row term. The row max is taken without the
    lane term and bounded for it: ``max(ss * lane) <= 6 * slope2``, so it may sit that far above the true
    one, which scales every term of the row alike and stays well inside float32's range. Masked blocks
    take the exact scores and max (one FMA an element more)."""
    lane, c = _column_split(gl.SliceLayout(0, qk.type.layout), qk.shape[1])
    ss = gl.where(left, slope2, -slope2)
    b = -ss * (offs_m + (seqlen_k - seqlen_q) - start_n).to(gl.float32)
    s_raw = qk + (c.to(gl.float32) * (ss / qk_scale))[None, :]
    lane_term = (ss * lane.to(gl.float32))[None, :]
    if MASK:
        # A causal row's largest terms sit in its diagonal block: the exact max there keeps the largest at
        # exp2(0) = 1, which bf16 holds exactly (under the bound it is rounded like the others).
        keep = _visible(qk, offs_m, start_n, seqlen_q, seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT)
        s = gl.where(keep, s_raw * qk_scale + lane_term + b[:, None], float("-inf"))
        return softmax_step(qk, s, m_i, qk_scale, True)
    m_new = gl.maximum(m_i, gl.max(s_raw, 1) * qk_scale + b + gl.maximum(6.0 * ss, 0.0))
    p = gl.exp2(s_raw * qk_scale + (lane_term + (b - m_new)[:, None]))
    return p, gl.exp2(m_i - m_new), m_new


@gluon.jit
def _column_split(layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """A block's columns ``0..BLOCK_N`` as ``lane + c``: ``lane = jj % 8 - jj % 2`` is what the wgmma
    accumulator layout takes from the thread index, so each thread's ``c`` are constants the compiler folds
    into immediates and its ``lane`` is one value."""
    jj = gl.arange(0, BLOCK_N, layout=layout)
    c = jj // 8 * 8 + jj % 2
    return jj - c, c


@gluon.jit
def _visible(qk, offs_m, start_n, seqlen_q, seqlen_k, window_left, window_right, MASK_LEFT: gl.constexpr,
             MASK_RIGHT: gl.constexpr):
    """Which pairs of block ``qk`` lie in the window and before the sequence end (as common.visible): each
    row's first and last visible column, less the thread's ``lane``, against the constants ``c``, so one
    compare an element and bound. Only the ALiBi linear blocks take it: with it in the other masked blocks
    ptxas schedules their unmasked softmax worse (H200, plain causal 1 x 16384 x 16 heads 2.18 against
    2.08 ms, though the masked block shrinks from 574 to 403 instructions)."""
    lane, c = _column_split(gl.SliceLayout(0, qk.type.layout), qk.shape[1])
    hi = offs_m * 0 + seqlen_k
    if MASK_RIGHT:
        hi = gl.minimum(hi, offs_m + (seqlen_k - seqlen_q + window_right + 1))
    keep = c[None, :] < (hi - start_n)[:, None] - lane[None, :]
    if MASK_LEFT:
        lo = offs_m + (seqlen_k - seqlen_q - window_left) - start_n
        keep = keep & (c[None, :] >= lo[:, None] - lane[None, :])
    return keep


@gluon.jit
def row_start(SINK, row_max, ALIBI_SLOPES, stride_alibi_b, off_b, off_h, BLOCK_M: gl.constexpr,
              layout: gl.constexpr, HAS_SINK: gl.constexpr, FIXED_MAX: gl.constexpr, ALIBI: gl.constexpr):
    """Head ``off_h``'s rows before their first key block: ``(m_i, l_i, slope2)``, the running max and sum
    (log2 units, in ``layout``) and the ALiBi slope in log2 units (0 without ALiBi)."""
    if HAS_SINK:
        # The sink is one more logit in every row's softmax, with no value: start the row there.
        m_i = gl.full([BLOCK_M], 0.0, gl.float32, layout) + gl.load(SINK + off_h).to(gl.float32) * LOG2E
        l_i = gl.full([BLOCK_M], 1.0, gl.float32, layout)
    else:
        # With FIXED_MAX, row_max stands in for every row's max from the start (see fixed_row_max).
        m_i = gl.full([BLOCK_M], row_max if FIXED_MAX else float("-inf"), gl.float32, layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout)
    slope2 = 0.0
    if ALIBI:
        slope2 = gl.load(ALIBI_SLOPES + off_b * stride_alibi_b + off_h) * LOG2E
    return m_i, l_i, slope2


@gluon.jit
def store_rows(acc, m_i, l_i, offs_m, O, LSE, off_b, off_h, first_row, q_start, seqlen_q, stride_ob, stride_om,
               stride_oh, stride_lse_b, stride_lse_h, dtype: gl.constexpr):
    """Divide O by each row's sum and store it (as ``dtype``) and the rows' lse: rows ``first_row..`` of a
    sequence whose row 0 is row ``q_start`` of O (``offs_m``: the rows in ``m_i``'s layout; ``l_i``: the sums'
    parts, :func:`_row_parts`). A row that saw no key has l = 0: its output is 0 and its lse is -inf."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    rows_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    l_i = gl.convert_layout(gl.sum(l_i, 1), m_i.type.layout)
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    acc = acc / gl.convert_layout(l_safe, rows_o)[:, None]
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    offs_mo = first_row + gl.arange(0, BLOCK_M, layout=rows_o)
    offs_d = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
    o_ptrs = (O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
              + (q_start + offs_mo[:, None]).to(gl.int64) * stride_om + offs_d[None, :])
    gl.store(o_ptrs, acc.to(dtype), mask=offs_mo[:, None] < seqlen_q)
    gl.store(LSE + off_b.to(gl.int64) * stride_lse_b + off_h * stride_lse_h + q_start + offs_m, lse,
             mask=offs_m < seqlen_q)


@gluon.jit
def _softmax_step(qk, s, m_i, qk_scale, MODIFIED: gl.constexpr, FIXED_MAX: gl.constexpr,
                  P_LOG2: gl.constexpr = 0.0):
    """``softmax_step``, or with ``FIXED_MAX`` the probabilities against the row max ``m_i`` held fixed."""
    if FIXED_MAX:
        p = gl.exp2(s - shift_max(m_i, P_LOG2)[:, None])
        alpha = gl.full_like(m_i, 1.0)
        m_new = m_i
    else:
        p, alpha, m_new = softmax_step(qk, s, m_i, qk_scale, MODIFIED, P_LOG2)
    return p, alpha, m_new


@gluon.jit
def attn_fwd_sm90(q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, O, LSE, qk_scale, softcap2, row_max,
                  window_left, window_right, ALIBI_SLOPES, stride_alibi_b, SINK, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                  total_q, total_k, ERR, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, seqlen_new,
                  stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, group,
                  MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                  HAS_SINK: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr,
                  FIXED_MAX: gl.constexpr, FOLD_SCALE: gl.constexpr, TAIL: gl.constexpr, IS_VARLEN: gl.constexpr,
                  HAS_SEQUSED: gl.constexpr,
                  KVCACHE: gl.constexpr, HAS_SEQLENS: gl.constexpr, HAS_LEFTPAD: gl.constexpr,
                  HAS_BATCH_IDX: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``k_desc``/``v_desc``: TMA descriptors of the ``(batch, seqlen, heads, headdim)``
    inputs with ``[1, rows, 1, headdim]`` tiles; one program per (query block, head, batch) as in
    the Triton kernel. With ``TAIL`` a head dim that is no power of two (192) is read in two parts:
    ``q_desc``/``k_desc`` cover its first 128 columns, ``q_tail_desc``/``k_tail_desc`` the rest (None
    without ``TAIL``).
    With ``IS_VARLEN`` the inputs are packed ``(1, tokens, heads, headdim)``, ``off_b`` is a sequence
    (``CU_SEQLENS_*``, ``SEQUSED_K`` as in the Triton kernel) and ``seqlen_q`` its longest length.
    With ``KVCACHE`` k and v are a contiguous KV cache of capacity ``seqlen_k`` whose rows the KV-cache
    kernels' ``cache_sequence`` gives (``CACHE_*``, ``seqlen_new``: chunked prefill)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    HEAD_DIM_V: gl.constexpr = v_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(num_warps == 4, "one warpgroup per program: slots are refilled without a CTA barrier")
    # Accumulator layouts of the two matmuls, and P as the register operand of the second.
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM_V, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    start_m = gl.program_id(0)
    if MASK_RIGHT and not MASK_LEFT:
        # Causal rows near the end visit the most keys: launch them first for a shorter tail.
        start_m = gl.num_programs(0) - 1 - start_m
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    first_row = start_m * BLOCK_M
    # Where this program's rows are: query i is row q_start + i of q's batch row q_b, key j row k_start + j
    # of k's and v's batch row kv_b.
    if KVCACHE:
        # A KV cache's k has total_k = batch_cache rows, which cache_batch_idx must name.
        _, k_start, seqlen_k, kv_b = cache_sequence(off_b, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, seqlen_new,
                                                    seqlen_k, total_k, ERR, HAS_SEQLENS, HAS_LEFTPAD, HAS_BATCH_IDX,
                                                    False)
        kv_b = kv_b.to(gl.int32)
        q_b = off_b
        q_start = 0
    else:
        q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                        SEQUSED_K, total_q, total_k, ERR, IS_VARLEN, HAS_SEQUSED, True)
        if IS_VARLEN:
            # Varlen grids are sized for the longest sequence; packed tensors are one batch row for the TMA.
            if first_row >= seqlen_q:
                return
            q_b = 0
            kv_b = 0
        else:
            q_b = off_b
            kv_b = off_b
    lo, full_lo, full_hi, hi = kv_range(first_row, first_row + BLOCK_M - 1, seqlen_q, seqlen_k, window_left,
                                        window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    n_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    q_tail_smem = q_smem
    k_tail_smem = k_smem
    if TAIL:
        TAIL_DIM: gl.constexpr = q_tail_desc.block_type.shape[3]
        q_tail_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, 1, TAIL_DIM], q_tail_desc.layout)
        k_tail_smem = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, 1, TAIL_DIM], k_tail_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, 1, BLOCK_N, 1, HEAD_DIM_V], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_bar.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_bar.index(i), count=1)

    off_hk = off_h // group
    _load_qk(q_desc, q_tail_desc, q_bar, q_smem, q_tail_smem, q_b, q_start + first_row, off_h, True, TAIL)
    for i in gl.static_range(K_STAGES):
        _load_qk(k_desc, k_tail_desc, k_bar.index(i), k_smem.index(i), k_tail_smem.index(i), kv_b,
                 k_start + lo + i * BLOCK_N, off_hk, i < n_blocks, TAIL)
    for i in gl.static_range(V_STAGES):
        _load(v_desc, v_bar.index(i), v_smem.index(i), kv_b, k_start + lo + i * BLOCK_N, off_hk, i < n_blocks)

    offs_m = first_row + gl.arange(0, BLOCK_M, layout=rows_s)
    offs_n = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i, l_i, slope2 = row_start(SINK, row_max, ALIBI_SLOPES, stride_alibi_b, off_b, off_h, BLOCK_M, rows_s,
                                 HAS_SINK, FIXED_MAX, ALIBI)
    acc = gl.zeros([BLOCK_M, HEAD_DIM_V], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    l_i = row_parts_start(l_i, s_zero, row_parts(ALIBI))
    mbarrier.wait(q_bar, 0)
    q = q_smem.reshape([BLOCK_M, HEAD_DIM])
    q_tail = q_tail_smem.reshape([BLOCK_M, q_tail_smem.shape[3]])
    if FOLD_SCALE:
        # Fold softcap's scale (at most 1) into Q once: the tanh then takes q . k with no multiply a score.
        _scale_tile(q, qk_scale, num_warps)
        if TAIL:
            _scale_tile(q_tail, qk_scale, num_warps)
        score_scale = 1.0
    else:
        score_scale = qk_scale
    if Q_IN_REGS:
        # Q as the register operand: each QK^T then reads only K from shared memory.
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        if TAIL:
            q_tail = q_tail.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    if n_blocks > 0:
        # Block 0: scores and probabilities; its PV product joins the first iteration.
        mbarrier.wait(k_bar.index(0), 0)
        qk = _scores_mma(q, q_tail, k_smem, k_tail_smem, 0, s_zero, TAIL)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        _load_qk(k_desc, k_tail_desc, k_bar.index(0), k_smem.index(0), k_tail_smem.index(0), kv_b,
                 k_start + lo + K_STAGES * BLOCK_N, off_hk, K_STAGES < n_blocks, TAIL)
        p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, first_row, offs_m, offs_n, lo,
                                            (lo < full_lo) | (lo >= full_hi),
                                            seqlen_q, seqlen_k, score_scale, softcap2, slope2,
                                            window_left, window_right, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, FIXED_MAX)
        for j in range(1, n_blocks):
            slot = j % K_STAGES
            prev = (j - 1) % V_STAGES
            start_n = lo + j * BLOCK_N
            # S_j = Q K_j^T and O += P_{j-1} V_{j-1} both go to the tensor cores...
            mbarrier.wait(k_bar.index(slot), (j // K_STAGES) & 1)
            qk = _scores_mma(q, q_tail, k_smem, k_tail_smem, slot, s_zero, TAIL)
            mbarrier.wait(v_bar.index(prev), ((j - 1) // V_STAGES) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), _tile(v_smem, prev), acc, is_async=True)
            # ...S_j is waited for alone (wgmma groups retire in order), and K_j's slot refilled.
            qk = warpgroup_mma_wait(1, deps=(qk, ))
            _load_qk(k_desc, k_tail_desc, k_bar.index(slot), k_smem.index(slot), k_tail_smem.index(slot), kv_b,
                     k_start + start_n + K_STAGES * BLOCK_N, off_hk, j + K_STAGES < n_blocks, TAIL)
            # The softmax of S_j runs while the PV product is still in flight.
            p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, first_row, offs_m, offs_n + j * BLOCK_N, start_n,
                                                (start_n < full_lo) | (start_n >= full_hi), seqlen_q, seqlen_k,
                                                score_scale, softcap2, slope2, window_left, window_right,
                                                MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, FIXED_MAX)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _load(v_desc, v_bar.index(prev), v_smem.index(prev), kv_b, k_start + start_n + (V_STAGES - 1) * BLOCK_N,
                  off_hk, j - 1 + V_STAGES < n_blocks)
            if not FIXED_MAX:
                # O now holds blocks up to j - 1 under the old row max: move it to the new one.
                acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        last = (n_blocks - 1) % V_STAGES
        mbarrier.wait(v_bar.index(last), ((n_blocks - 1) // V_STAGES) & 1)
        if IS_VARLEN or KVCACHE:
            # Only the last block can run past the sequence: its rows there belong to the next one (or hold
            # whatever a cache has past its keys).
            rows_left = seqlen_k - (lo + (n_blocks - 1) * BLOCK_N)
            if rows_left < BLOCK_N:
                _zero_tail(_tile(v_smem, last), rows_left, num_warps)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), _tile(v_smem, last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))

    store_rows(acc, m_i, l_i, offs_m, O, LSE, off_b, off_h, first_row, q_start, seqlen_q, stride_ob, stride_om,
               stride_oh, stride_lse_b, stride_lse_h, dtype)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bar.index(i))
    for i in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bar.index(i))
