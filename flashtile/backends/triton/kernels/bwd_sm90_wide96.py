"""Hopper one-pass backward at 192/128 (DeepSeek's head dims) on CTAs of 96 keys, FA4's sm90 tile (m 64, n 96): a
tuning variant of bwd_sm90_wide.py (64 keys a CTA), reached through configs.OnePassConfig(keys=96). The fixed costs
of a step (Q and dO loads, dQ's float32 staging and reduce, barriers) are spread over 1.5x the multiply-adds.

Gluon's tiles are powers of two, so the 96 keys go to three consumer warpgroups of 32 keys each (FA4 has two of 48),
and each warpgroup keeps its own keys' gradients, transposed so that a product's M is the head dim (64 rows a
warpgroup is wgmma's least M, 32 keys fall short of it):

    producer (1 warp)    TMA: the CTA's K (128 + 64 columns) and V in three 32-key tiles once, then dO and Q (128 +
                         64 columns) of each step into rings of slots, Q's with the rows' lse and delta
    consumer w (4 warps) keys 32w..32w+31: S = Q K_w^T and dP = dO V_w^T (64 x 32); P, dS
                         dV_w^T += dO^T P_w, dK_w^T += Q^T dS_w (128 + 64 rows) on its own P and dS tiles
                         dQ[:, 64w:64w+64] = sum over the three key tiles j of dS_j K_j[:, 64w:64w+64]
    reducer (1 warp)     adds each consumer's staged dQ columns into the float32 buffer with the TMA's bulk reduce

Registers a consumer thread: dK^T 48 + dV^T 32 accumulators, S, P and dP 16 each, dQ 32: within 160 (the compiler
counts the 14 warps as 16 at 128 registers: two consumers at 160, the default partition's at 168, the producer and
reducer warps at 24). dP is issued once P is in shared memory, not under the exponentials: its accumulator held
there cost 16 spill instructions in the causal key loop (the other two consumers keep the tensor cores busy).
sm_90 ptxas (benchmarks/sm90_compile.py wide keys96=1 consumer_regs=160 maxnreg=128): 0 spill instructions full,
2 in the causal key loop, 218,840 B of shared memory; softcap spills (64), so the launcher takes neither it nor
ALiBi here. Shared memory: Q 2 x 24 KB, dO 2 x 16 KB, K 36 KB, V
24 KB, P 12 KB, dS 12 KB a buffer (a consumer writes its dS only once all three have read that buffer's last,
``ds_empty``; ``DS_BUFS`` = 2 lets a consumer run a step ahead of the others, at 231,128 B of the 232,448), dQ
staging 48 KB: 218,840 B with one dS buffer. Masks, windows and sinks (through the lse) as bwd_sm90_wide.py takes
them.

Packed sequences (``IS_VARLEN``, ``HAS_SEQUSED``) as bwd_sm90_wide.py reads them: descriptors of the whole ``(1,
tokens, heads, d)`` tensors, each CTA's sequence from bwd_sm90_ws._walk. Each consumer zeroes its own key rows past
the sequence's used keys (dQ's product reads all three's: ``kv_zeroed``); a step's query rows past the sequence are
zeroed by consumer 0, the default partition, which the others wait for (``tail_ready``), 16 rows at a time: a whole
tile beside the accumulators, or a share in each 160-register consumer, spilled in the key loops (13-18 and 4-7 spill
instructions). sm_90 ptxas (wide-varlen keys96=1, 4096 + 4096 tokens with seqused_k): 0 spill instructions in the
key loops full and causal (8 + 13 and 14 + 19 in the prologue and stores), 218,920 B; with a window too, 1 spill
store and 4-5 reloads a step in two loops, so configs.one_pass_96_takes keeps packed calls with a window on the
64-key kernel.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .bwd_sm90 import _query_block, store_key_rows
from .bwd_sm90_wide import load_step
from .bwd_sm90_ws import _reduce_add, _walk, barrier, barriers, consumer_step, opaque_zero
from .common import scores, visible
from .fwd_sm90 import _tile, _zero_tail, wgmma_layout

# Consumer warpgroups, each with a third of the CTA's keys and of dQ's columns.
NUM_WG = gl.constexpr(3)


@gluon.jit
def _zero_rows(tile, rows):
    """fwd_sm90._zero_tail of a ``[rows, columns]`` shared-memory tile 16 rows at a time (those wholly before
    ``rows`` untouched): a consumer holds its accumulators meanwhile, and a whole tile's rows would not fit beside
    them."""
    CHUNK: gl.constexpr = 16
    for c in gl.static_range(tile.shape[0] // CHUNK):
        if rows < (c + 1) * CHUNK:
            _zero_tail(tile.slice(c * CHUNK, CHUNK, 0), rows - c * CHUNK, 4)


@gluon.jit
def _consumer(args, walk, WG: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
              FAST_TANH: gl.constexpr, ALIBI: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
              STAGES: gl.constexpr, DS_BUFS: gl.constexpr):
    (q_desc, qt_desc, k_desc, do_desc, q_smem, qt_smem, do_smem, k_smem, kt_smem, v_smem, p_smem, ds_smem, dq_smem,
     rows_smem, kv_ready, kv_zeroed, q_ready, q_empty, do_ready, do_empty, tail_ready, ds_ready, ds_empty, dq_full,
     dq_empty, DK, DV,
     ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2, softmax_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
     stride_dvn, stride_dvh) = args
    window_left, window_right = walk[2], walk[3]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    MAIN: gl.constexpr = q_desc.block_type.shape[3]
    TAIL: gl.constexpr = qt_desc.block_type.shape[3]
    V_MAIN: gl.constexpr = do_desc.block_type.shape[3]
    DQ_COLS: gl.constexpr = dq_smem.shape[4]
    dtype: gl.constexpr = q_desc.dtype
    # Accumulator layouts of one warpgroup: the scores (queries x its keys), dQ's columns, the transposed dK/dV.
    s_layout: gl.constexpr = wgmma_layout(KEYS, 4)
    dq_layout: gl.constexpr = wgmma_layout(DQ_COLS, 4)
    queries_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    cta_key = gl.program_id(0) * NUM_WG * KEYS
    first_key = cta_key + WG * KEYS
    seq, lo, full_lo, full_hi, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, NUM_WG * KEYS, MASK_LEFT, MASK_RIGHT,
                                                 IS_VARLEN, HAS_SEQUSED)
    _, _, seqlen_q, _, seqlen_k, _ = seq
    group = walk[4]
    offs_n = first_key + gl.arange(0, KEYS, layout=keys_layout)
    dkt = gl.zeros([MAIN, KEYS], gl.float32, s_layout)
    dkt_tail = gl.zeros([TAIL, KEYS], gl.float32, s_layout)
    dvt = gl.zeros([V_MAIN, KEYS], gl.float32, s_layout)
    s_zero = gl.zeros([BLOCK_M, KEYS], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    p_own = p_smem.index(WG)
    mbarrier.wait(kv_ready, 0)
    if IS_VARLEN:
        # Key rows past the sequence's used keys hold the next sequence's keys or ones seqused_k leaves out, which
        # S, dP and dQ's product would read: zeros instead (their own dK and dV rows are stored as zeros or not at
        # all). Each consumer zeroes its own 32 keys; dQ's product reads all three's, so each waits for the others.
        if first_key + KEYS > seqlen_k:
            _zero_rows(_tile(k_smem, WG), seqlen_k - first_key)
            _zero_rows(_tile(kt_smem, WG), seqlen_k - first_key)
            _zero_rows(_tile(v_smem, WG), seqlen_k - first_key)
        mbarrier.arrive(kv_zeroed, count=1)
        mbarrier.wait(kv_zeroed, 0)
    for it in range(n_it):
        slot, phase, _, _, off_h, row, slope2 = consumer_step(it, it, n_q, lo, off_hk, group, ALIBI_SLOPES,
                                                              off_b * stride_alibi_b, BLOCK_M, STAGES, ALIBI)
        offs_m = row + gl.arange(0, BLOCK_M, layout=queries_layout)
        # Views rebuilt each step (bwd_sm90_ws.opaque_zero): their wgmma descriptors are not held through the loop.
        zero = opaque_zero(it)
        slot = slot + zero
        k = _tile(k_smem, WG + zero)
        kt = _tile(kt_smem, WG + zero)
        v = _tile(v_smem, WG + zero)
        q = _tile(q_smem, slot)
        qt = _tile(qt_smem, slot)
        do = _tile(do_smem, slot)
        if IS_VARLEN:
            if row + BLOCK_M > seqlen_q:
                # The rows past this sequence's queries are the next sequence's: consumer 0 (the default
                # partition, 8 registers more) zeroes them, so that not even an infinity there meets this one's
                # zero probabilities, and the others wait for it (a share each spilled in their key loops: 7
                # reloads a step with a window). Only each head's last block has such rows: the walk's heads count
                # the tail's phases.
                if WG == 0:
                    mbarrier.wait(q_ready.index(slot), phase)
                    mbarrier.wait(do_ready.index(slot), phase)
                    _zero_rows(q, seqlen_q - row)
                    _zero_rows(qt, seqlen_q - row)
                    _zero_rows(do, seqlen_q - row)
                    mbarrier.arrive(tail_ready, count=1)
                else:
                    mbarrier.wait(tail_ready, (it // n_q) & 1)
        # S first, dP only once P is in shared memory: dP's accumulator is not held under the exponentials (the
        # other two consumers' products keep the tensor cores busy meanwhile).
        mbarrier.wait(q_ready.index(slot), phase)
        qk = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma(qt, kt.permute((1, 0)), qk, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        s, t = scores(qk, offs_m[:, None], offs_n[None, :], cta_key, seqlen_q, seqlen_k, qk_scale, softcap2, slope2,
                      0, 0, 0, window_left, window_right, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, "")
        lse2 = rows_smem.index(slot * 2).load(queries_layout)
        p = gl.exp2(s - lse2[:, None])
        if (row < full_lo) | (row >= full_hi):
            p = gl.where(visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                                 MASK_LEFT, MASK_RIGHT), p, 0.0)
        # P stays this warpgroup's (dV's B operand): its last reader, the step before's dV, has been waited for.
        p_own.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.wait(do_ready.index(slot), phase)
        dvt = warpgroup_mma(do.permute((1, 0)), p_own, dvt, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp, dvt = warpgroup_mma_wait(0, deps=(dp, dvt))
        delta = rows_smem.index(slot * 2 + 1).load(queries_layout)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        # dS is every warpgroup's (dQ's A operand): its buffer is written once all three have read it DS_BUFS steps
        # before.
        ds_buf = it % DS_BUFS
        ds_phase = (it // DS_BUFS) & 1
        ds_own = ds_smem.index(ds_buf * NUM_WG + WG)
        mbarrier.wait(ds_empty.index(ds_buf), ds_phase ^ 1)
        ds_own.store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(ds_buf), count=1)
        dkt = warpgroup_mma(q.permute((1, 0)), ds_own, dkt, is_async=True)
        dkt_tail = warpgroup_mma(qt.permute((1, 0)), ds_own, dkt_tail, is_async=True)
        # dQ[:, own columns] over the three warpgroups' keys.
        mbarrier.wait(ds_ready.index(ds_buf), ds_phase)
        dq = dq_zero
        for j in gl.static_range(NUM_WG):
            if WG < NUM_WG - 1:
                k_cols = _tile(k_smem, j + zero).slice(WG * DQ_COLS, DQ_COLS, 1)
            else:
                k_cols = _tile(kt_smem, j + zero)
            dq = warpgroup_mma(ds_smem.index(ds_buf * NUM_WG + j), k_cols, dq, use_acc=j > 0, is_async=True)
        dq, dkt, dkt_tail, dvt = warpgroup_mma_wait(0, deps=(dq, dkt, dkt_tail, dvt))
        mbarrier.arrive(ds_empty.index(ds_buf), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        mbarrier.arrive(q_empty.index(slot), count=1)
        # Stage dQ's columns once the reduce of the step before has read them.
        mbarrier.wait(dq_empty.index(WG), (it & 1) ^ 1)
        dq_smem.index(WG).reshape([BLOCK_M, DQ_COLS]).store(dq * softmax_scale)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(dq_full.index(WG), count=1)

    # The sequence's rows once more, not held through the walk (a packed call's are no kernel arguments).
    seq, _, _, _, _, _ = _walk(walk, q_desc, k_desc, BLOCK_M, NUM_WG * KEYS, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                               HAS_SEQUSED)
    _, _, _, k_start, seqlen_k, key_rows = seq
    store_key_rows(gl.permute(dkt * softmax_scale, (1, 0)), 0, first_key, k_start, seqlen_k, key_rows, DK, off_b,
                   off_hk, stride_dkb, stride_dkn, stride_dkh, HAS_SEQUSED)
    store_key_rows(gl.permute(dkt_tail * softmax_scale, (1, 0)), MAIN, first_key, k_start, seqlen_k, key_rows, DK,
                   off_b, off_hk, stride_dkb, stride_dkn, stride_dkh, HAS_SEQUSED)
    store_key_rows(gl.permute(dvt, (1, 0)), 0, first_key, k_start, seqlen_k, key_rows, DV, off_b, off_hk, stride_dvb,
                   stride_dvn, stride_dvh, HAS_SEQUSED)


@gluon.jit
def _producer(args, walk, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
              HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, qt_desc, k_desc, kt_desc, v_desc, do_desc, q_smem, qt_smem, do_smem, k_smem, kt_smem, v_smem, rows_smem,
     kv_ready, q_ready, q_empty, do_ready, do_empty, LSE2, DELTA, stride_lse_b, stride_lse_h) = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    seq, lo, _, _, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, NUM_WG * KEYS, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                                     HAS_SEQUSED)
    tma_b, q_start, seqlen_q, k_start, _, _ = seq
    group = walk[4]
    # The three key tiles of K (main, tail) and V (rows past the tensor arrive as zeros) complete one barrier.
    mbarrier.expect(kv_ready, NUM_WG * (k_desc.block_type.nbytes + kt_desc.block_type.nbytes
                                        + v_desc.block_type.nbytes))
    for w in gl.static_range(NUM_WG):
        key_row = k_start + gl.program_id(0) * NUM_WG * KEYS + w * KEYS
        tma.async_copy_global_to_shared(k_desc, [tma_b, key_row, off_hk, 0], kv_ready, k_smem.index(w))
        tma.async_copy_global_to_shared(kt_desc, [tma_b, key_row, off_hk, 0], kv_ready, kt_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [tma_b, key_row, off_hk, 0], kv_ready, v_smem.index(w))
    # No tail of dO: its descriptor and ring stand in for the tail's, never read.
    rings = (q_desc, qt_desc, do_desc, do_desc, q_smem, qt_smem, do_smem, do_smem, rows_smem, q_ready, q_empty,
             do_ready, do_empty, LSE2, DELTA, stride_lse_b, stride_lse_h)
    for it in range(n_it):
        off_h, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
        load_step(rings, it, tma_b, q_start, off_b, off_h, row, seqlen_q, STAGES, 0)


@gluon.jit
def _reducer(args, walk, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
             HAS_SEQUSED: gl.constexpr):
    q_desc, k_desc, dq_desc, dq_smem, dq_full, dq_empty = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    off_hk = gl.program_id(1)
    seq, lo, _, _, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, NUM_WG * KEYS, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                                     HAS_SEQUSED)
    tma_b, q_start, _, _, _, _ = seq
    group = walk[4]
    for it in range(n_it):
        off_h, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
        # Each consumer's columns as soon as staged (rows past the tensor are clipped; rows past a packed sequence,
        # the next one's, get zeros added); its buffer goes back once read.
        for w in gl.static_range(NUM_WG):
            mbarrier.wait(dq_full.index(w), it & 1)
            _reduce_add(dq_desc, [tma_b, q_start + row, off_h, w * DQ_COLS], dq_smem.index(w))
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(w), count=1)


@gluon.jit
def attn_bwd_sm90_wide96(q_desc, q_tail_desc, k_desc, k_tail_desc, v_desc, do_desc, dq_desc, DK, DV, LSE2, DELTA,
                         CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2,
                         softmax_scale, window_left, window_right, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                         stride_dvn, stride_dvh, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, group,
                         MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                         FAST_TANH: gl.constexpr, ALIBI: gl.constexpr, IS_VARLEN: gl.constexpr,
                         HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``q_tail_desc``: TMA descriptors of the ``(batch, seqlen, heads, 128)`` and ``(.., 64)`` views of q
    with ``[1, 64, 1, cols]`` tiles, ``k_desc``/``k_tail_desc`` the same of k with ``[1, 32, 1, cols]`` (one
    consumer's keys), ``v_desc`` of v (128 columns) with ``[1, 32, 1, 128]``, ``do_desc`` of dO with
    ``[1, 64, 1, 128]``, ``dq_desc`` of the zeroed float32 dQ buffer (all 192 columns) with ``[1, 64, 1, 64]`` (one
    consumer's columns); one CTA per (96 keys, KV head, batch row). ``qk_scale``/``softcap2`` as common.scores takes
    them; LSE2 and DELTA are bwd_preprocess's. With ``IS_VARLEN`` the tensors are packed ``(1, tokens, heads, d)``,
    a batch row is a sequence (``CU_SEQLENS_*``, ``SEQUSED_K`` with ``HAS_SEQUSED``, as in bwd.py's kernels) and the
    lengths are the longest ones; dense calls never read them. dQ arrives in its buffer scaled, to be cast."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    MAIN: gl.constexpr = q_desc.block_type.shape[3]
    TAIL: gl.constexpr = q_tail_desc.block_type.shape[3]
    V_MAIN: gl.constexpr = v_desc.block_type.shape[3]
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(num_warps == 4, "the default partition is consumer 0, one warpgroup")
    gl.static_assert(BLOCK_M == 64 and KEYS == 32, "steps of 64 queries over three consumers' 32 keys")
    gl.static_assert(NUM_WG * DQ_COLS == MAIN + TAIL and DQ_COLS == TAIL, "a consumer adds 64 of dQ's 192 columns")
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, MAIN], q_desc.layout)
    qt_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, TAIL], q_tail_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, V_MAIN], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, KEYS, 1, MAIN], k_desc.layout)
    kt_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, KEYS, 1, TAIL], k_tail_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, KEYS, 1, V_MAIN], v_desc.layout)
    # Each consumer's P and dS (queries x its keys), one buffer; dQ staging, one tile of columns a consumer.
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, KEYS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [NUM_WG, BLOCK_M, KEYS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFS * NUM_WG, BLOCK_M, KEYS], pds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_WG, 1, BLOCK_M, 1, DQ_COLS], dq_desc.layout)
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready = barrier(1)
    # Packed sequences: the three consumers' key rows past the sequence zeroed, and a step's query rows.
    kv_zeroed = barrier(NUM_WG)
    tail_ready = barrier(1)
    # A ring slot's Q (and rows) / dO: landed, and released by the three consumers.
    q_ready = barriers(STAGES, 2)
    q_empty = barriers(STAGES, NUM_WG)
    do_ready = barriers(STAGES, 1)
    do_empty = barriers(STAGES, NUM_WG)
    # The three dS tiles in place / read by the three dQ products; a consumer's dQ staged / read by the reduce.
    ds_ready = barriers(DS_BUFS, NUM_WG)
    ds_empty = barriers(DS_BUFS, NUM_WG)
    dq_full = barriers(NUM_WG, 1)
    dq_empty = barriers(NUM_WG, 1)
    walk = (seqlen_q, seqlen_k, window_left, window_right, group, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K)
    consumer = (q_desc, q_tail_desc, k_desc, do_desc, q_smem, qt_smem, do_smem, k_smem, kt_smem, v_smem, p_smem,
                ds_smem, dq_smem, rows_smem, kv_ready, kv_zeroed, q_ready, q_empty, do_ready, do_empty, tail_ready,
                ds_ready, ds_empty, dq_full, dq_empty, DK, DV, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2,
                softmax_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh)
    producer = (q_desc, q_tail_desc, k_desc, k_tail_desc, v_desc, do_desc, q_smem, qt_smem, do_smem, k_smem, kt_smem,
                v_smem, rows_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, LSE2, DELTA, stride_lse_b,
                stride_lse_h)
    reducer = (q_desc, k_desc, dq_desc, dq_smem, dq_full, dq_empty)
    gl.warp_specialize([(_consumer, (consumer, walk, 0, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, IS_VARLEN,
                                     HAS_SEQUSED, STAGES, DS_BUFS)),
                        (_consumer, (consumer, walk, 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, IS_VARLEN,
                                     HAS_SEQUSED, STAGES, DS_BUFS)),
                        (_consumer, (consumer, walk, 2, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, IS_VARLEN,
                                     HAS_SEQUSED, STAGES, DS_BUFS)),
                        (_producer, (producer, walk, MASK_LEFT, MASK_RIGHT, IS_VARLEN, HAS_SEQUSED, STAGES)),
                        (_reducer, (reducer, walk, MASK_LEFT, MASK_RIGHT, IS_VARLEN, HAS_SEQUSED))], [4, 4, 1, 1],
                       [CONSUMER_REGS, CONSUMER_REGS, 24, 24])
