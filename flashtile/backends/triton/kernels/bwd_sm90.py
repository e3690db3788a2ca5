"""Hopper dK/dV backward in Gluon: TMA query/dO ring and asynchronous wgmma, so the exponentials run while
the tensor cores still multiply.

``tl.dot`` waits for every wgmma right after issuing it, so bwd.py's dK/dV kernel runs its four matmuls
and the softmax between them one after the other. Here one warpgroup owns ``BLOCK_N = 64`` keys (K and V
stay in shared memory) and walks the query blocks that see them, of every query head of its GQA group; per
block of ``BLOCK_M`` queries, on the transposed tiles (keys x queries):

    issue S^T  = K Q^T              (async)
    issue dP^T = V dO^T             (async, queued behind S^T)
    wait for S^T only               -> P^T = exp2(S^T - lse) overlaps the dP^T product
    issue dV  += P^T dO             (P^T from registers)
    wait for dP^T only              -> dS^T = P^T (dP^T - delta) overlaps the dV product
    issue dK  += dS^T Q             (dS^T from registers)

Q and dO arrive through the TMA into rings of ``STAGES`` slots, each slot refilled once the products
that read it are done. The scores are common.py's (masks, softcap); ``LSE2`` and ``DELTA`` are
bwd_preprocess's (the row's lse in log2 units, +inf for a row that saw no key, and rowsum(dO * O)), read
with rows past ``seqlen_q`` as +inf and 0, so the zero rows the TMA fills there add nothing. Keys past
``seqlen_k`` (zero rows too) are computed and never stored. The masked blocks (straddling a window's edge)
zero the probabilities of the pairs they do not see after the exponential, so the others take the scale and
the lse in one FMA an element; with softcap the scale is folded into K once (``FOLD_SCALE``).

Packed sequences (``IS_VARLEN``) read through descriptors of the whole ``(1, tokens, heads, 128)`` tensors. A
tile past a sequence's end holds the next sequence's rows: key rows there only feed their own dK/dV rows,
which are not stored; query and dO rows there are zeroed in shared memory first (``_zero_tail``). Inputs:
16-bit, head dim 128; no ALiBi, dropout or bias (the launcher takes bwd.py's kernel for those).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .common import q_block_range, scores, sequence, stored_keys, visible
from .fwd_sm90 import _load, _scale_tile, _tile, _zero_tail, wgmma_layout


@gluon.jit
def _query_block(it, n_q, lo, off_hk, group, BLOCK_M: gl.constexpr):
    """Step ``it`` of the walk: (query head, first row) of its block; each head's blocks in turn."""
    g = it // n_q
    return off_hk * group + g, lo + (it - g * n_q) * BLOCK_M


@gluon.jit
def _load_step(q_desc, do_desc, q_bar, do_bar, q_smem, do_smem, it, n_it, n_q, lo, tma_b, q_start, off_hk, group,
               STAGES: gl.constexpr):
    """TMA loads of step ``it``'s Q and dO rows into ring slot ``it % STAGES`` (nothing past the walk); the
    sequence's queries start at row ``q_start`` of batch row ``tma_b``."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    off_h, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
    slot = it % STAGES
    _load(q_desc, q_bar.index(slot), q_smem.index(slot), tma_b, q_start + row, off_h, it < n_it)
    _load(do_desc, do_bar.index(slot), do_smem.index(slot), tma_b, q_start + row, off_h, it < n_it)


@gluon.jit
def store_key_rows(acc, col0, first_key, k_start, seqlen_k, key_rows, PTR, off_b, off_hk, stride_b, stride_n, stride_h,
                   HAS_SEQUSED: gl.constexpr):
    """Store a program's ``[keys, columns]`` dK or dV accumulator at key ``first_key`` and column ``col0`` of the
    sequence whose keys start at row ``k_start``: keys past those used (``seqlen_k``, seqused_k) get zeros; rows
    past the sequence's keys (``key_rows``) are not this program's."""
    layout: gl.constexpr = acc.type.layout
    offs_n = first_key + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    offs_d = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    if HAS_SEQUSED:
        acc = gl.where(offs_n[:, None] < seqlen_k, acc, 0.0)
    rows = (k_start + offs_n[:, None]).to(gl.int64)
    ptrs = PTR + off_b.to(gl.int64) * stride_b + off_hk.to(gl.int64) * stride_h + rows * stride_n + offs_d[None, :]
    gl.store(ptrs, acc.to(PTR.dtype.element_ty), mask=offs_n[:, None] < key_rows)


@gluon.jit
def store_dkdv(dk, dv, first_key, k_start, seqlen_k, key_rows, DK, DV, off_b, off_hk, stride_dkb, stride_dkn,
               stride_dkh, stride_dvb, stride_dvn, stride_dvh, HAS_SEQUSED: gl.constexpr):
    """:func:`store_key_rows` of both ``[keys, head dim]`` accumulators (dK scaled already)."""
    store_key_rows(dk, 0, first_key, k_start, seqlen_k, key_rows, DK, off_b, off_hk, stride_dkb, stride_dkn, stride_dkh,
                   HAS_SEQUSED)
    store_key_rows(dv, 0, first_key, k_start, seqlen_k, key_rows, DV, off_b, off_hk, stride_dvb, stride_dvn, stride_dvh,
                   HAS_SEQUSED)


@gluon.jit
def attn_bwd_dkdv_sm90(q_desc, k_desc, v_desc, do_desc, DK, DV, LSE2, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                       total_q, total_k, ERR,
                       qk_scale, softcap2, softmax_scale, window_left, window_right, stride_dkb, stride_dkn,
                       stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k,
                       group, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                       FAST_TANH: gl.constexpr, FOLD_SCALE: gl.constexpr, IS_VARLEN: gl.constexpr,
                       HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``do_desc``: TMA descriptors of ``(batch, seqlen, heads, 128)`` q and dO with ``[1, BLOCK_M,
    1, 128]`` tiles, ``k_desc``/``v_desc`` of k and v with ``[1, BLOCK_N, 1, 128]``; one program per (key
    block, KV head, batch row). ``qk_scale``/``softcap2`` as common.scores takes them. With ``IS_VARLEN`` the
    tensors are packed ``(1, tokens, heads, 128)``, a batch row is a sequence (``CU_SEQLENS_*``, ``SEQUSED_K``
    as in bwd.py's kernels) and the lengths are the longest ones."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(num_warps == 4, "one warpgroup per program")
    # Accumulator layouts: the transposed scores (keys x queries) and dK/dV (keys x head dim), and the
    # probabilities as the register operand of the second.
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M, num_warps)
    acc_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    queries_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    start_n = gl.program_id(0)
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    first_key = start_n * BLOCK_N
    # This sequence's query rows start at q_start of batch row tma_b, its keys at k_start; key_rows of them are
    # its own (past seqused_k, seqlen_k, they get zero gradients).
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                                                    total_q, total_k, ERR, IS_VARLEN, HAS_SEQUSED, False)
    key_rows = stored_keys(off_b, k_start, seqlen_k, CU_SEQLENS_K, total_k, HAS_SEQUSED)
    tma_b = off_b
    if IS_VARLEN:
        # Varlen grids are sized for the longest sequence; packed tensors are one batch row for the TMA.
        if first_key >= key_rows:
            return
        tma_b = 0
    lo, full_lo, full_hi, hi = q_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                             BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
    n_q = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    if HAS_SEQUSED:
        # A key block wholly past the keys used sees no query.
        n_q = gl.where(first_key < seqlen_k, n_q, 0)
    n_it = n_q * group

    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_bar, count=1)
    mbarrier.init(v_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(do_bar.index(i), count=1)

    _load(k_desc, k_bar, k_smem, tma_b, k_start + first_key, off_hk, True)
    _load(v_desc, v_bar, v_smem, tma_b, k_start + first_key, off_hk, True)
    for i in gl.static_range(STAGES):
        _load_step(q_desc, do_desc, q_bar, do_bar, q_smem, do_smem, i, n_it, n_q, lo, tma_b, q_start, off_hk, group,
                   STAGES)

    offs_n = first_key + gl.arange(0, BLOCK_N, layout=keys_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    k = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v = v_smem.reshape([BLOCK_N, HEAD_DIM])
    mbarrier.wait(k_bar, 0)
    mbarrier.wait(v_bar, 0)
    if FOLD_SCALE:
        # Softcap's scale goes into K once (rounded to its dtype, as the forward rounds it into Q): the tanh
        # then takes K Q^T with no multiply an element.
        _scale_tile(k, qk_scale, num_warps)
    for it in range(n_it):
        slot = it % STAGES
        phase = (it // STAGES) & 1
        off_h, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
        offs_m = row + gl.arange(0, BLOCK_M, layout=queries_layout)
        # Rows past the sequence: lse +inf makes their P exactly 0.
        lse_rows = off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m
        lse2 = gl.load(LSE2 + lse_rows, mask=offs_m < seqlen_q, other=float("inf"))
        delta = gl.load(DELTA + lse_rows, mask=offs_m < seqlen_q, other=0.0)
        q = _tile(q_smem, slot)
        do = _tile(do_smem, slot)
        # S^T and dP^T go to the tensor cores together; S^T is waited for alone.
        mbarrier.wait(q_bar.index(slot), phase)
        if IS_VARLEN:
            if row + BLOCK_M > seqlen_q:
                # The rows past this sequence's queries are the next sequence's: zeros instead, so that not
                # even an infinity there meets this one's zero probabilities.
                mbarrier.wait(do_bar.index(slot), phase)
                _zero_tail(q, seqlen_q - row, num_warps)
                _zero_tail(do, seqlen_q - row, num_warps)
        qk_t = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(slot), phase)
        dp_t = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        qk_t = warpgroup_mma_wait(1, deps=(qk_t, ))
        # The exponentials run under the dP^T product, scale and lse in one FMA an element (with FOLD_SCALE K
        # holds the scale); blocks straddling the window's edges zero the pairs they do not see afterwards.
        if FOLD_SCALE:
            s_t, t_t = scores(qk_t, offs_m[None, :], offs_n[:, None], first_key, seqlen_q, seqlen_k, 1.0, softcap2,
                              0.0, 0, 0, 0, window_left, window_right, False, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                              FAST_TANH, False, "")
        else:
            s_t, t_t = scores(qk_t, offs_m[None, :], offs_n[:, None], first_key, seqlen_q, seqlen_k, qk_scale,
                              softcap2, 0.0, 0, 0, 0, window_left, window_right, False, MASK_LEFT, MASK_RIGHT,
                              SOFTCAP, FAST_TANH, False, "")
        p_t = gl.exp2(s_t - lse2[None, :])
        if (row < full_lo) | (row >= full_hi):
            p_t = gl.where(visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                                   MASK_LEFT, MASK_RIGHT), p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do, dv, is_async=True)
        # dS^T under the dV product.
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            # d(c * tanh(x / c)) / dx = 1 - tanh^2.
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), op_layout), q, dk, is_async=True)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        # Both products have read this slot: refill it STAGES steps ahead.
        _load_step(q_desc, do_desc, q_bar, do_bar, q_smem, do_smem, it + STAGES, n_it, n_q, lo, tma_b, q_start, off_hk,
                   group, STAGES)

    store_dkdv(dk * softmax_scale, dv, first_key, k_start, seqlen_k, key_rows, DK, DV, off_b, off_hk, stride_dkb,
               stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, HAS_SEQUSED)
    mbarrier.invalidate(k_bar)
    mbarrier.invalidate(v_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(q_bar.index(i))
        mbarrier.invalidate(do_bar.index(i))
