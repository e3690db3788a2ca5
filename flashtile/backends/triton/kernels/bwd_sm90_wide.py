"""Hopper one-pass backward for wide heads (q/k head dim 192 with values of 128, DeepSeek's shape, or of 192; head
dim 256), warp-specialized: FA4's sm90 plan in Gluon. Like bwd_sm90_ws.py it computes P and dS once for dK, dV and
dQ (five matmuls a tile), but its consumers split the work by head-dim columns, not by keys: one consumer's 64 keys
at full width would hold dK (96) + dV (64) + S^T and dP^T (64) + half of dQ (48) registers a thread, more than its
240.

A CTA owns ``BLOCK_N = 64`` keys of one KV head and walks the query blocks that see them, of every query head of its
GQA group. Gluon tiles are powers of two, so each tensor is read and written as a main part of 128 columns and a
tail (as fwd_sm90.py's TAIL): q, k and dQ of ``TAIL`` = 64 or 128, v and dO of ``V_TAIL`` = 0, 64 or 128. Its warps
split by role:

    producer (1 warp)    TMA: the CTA's K and V (main, tail) once, then dO and Q (main, tail) of each step into
                         rings of slots with barriers of their own, Q's with the rows' lse and delta
    consumer w (4 warps) S and dP on its 32 keys (queries x keys, M = 64 queries); then, on both consumers' P^T and
                         dS^T from shared memory, its columns of the gradients:
                             consumer 0: dK and dQ main, dV tail (if any)
                             consumer 1: dK and dQ tail, dV main
                         (at 192/128 1.70M multiply-adds a step each; at 192/192 2.10M and 1.83M; at 256 2.62M)
    reducer (1 warp)     adds each step's staged dQ (both parts) into a float32 buffer with the TMA's bulk reduce

Per step (64 queries), each consumer:

    issue S = Q K_w^T and dP = dO V_w^T (main and tail columns; with one slot dP first, under Q's load);
    wait for S -> P = exp2(S - lse) under dP
    store P^T to its 32 rows of a shared tile (``p_ready``); wait for dP -> dS = P (dP - delta)
    store dS^T to its 32 rows of a shared tile (``ds_ready``)
    wait for both halves of P^T -> issue dV[:, own] += P^T dO[:, own]
    wait for both halves of dS^T -> issue dK[:, own] += dS^T Q[:, own] and dQ[:, own] = dS K[:, own]
    release dO once dV is done and Q once dK is (``do_empty``, ``q_empty``: the producer refills them under the
    rest); wait for dQ
    stage dQ[:, own] (float32, scaled) in shared memory for the reducer (``dq_full``/``dq_empty``)

What limits it at 192/128 (issue 46: 0.67-0.71x FA4's backward): bytes moved a multiply-add, set by the CTA's 64
keys. A step's 3.41M multiply-adds read about 224 KB of wgmma operands from shared memory (each consumer reads all of
Q and dO for S and dP on only 32 keys: N = 32 products), plus 96 KB of dQ staging (stored, then read by the reduce),
16 KB of P^T/dS^T and 40 KB of TMA loads: about 376 KB, 2,900 cycles at 128 B a cycle against 1,700 of tensor-core
work; and 88 KB of L2 traffic (Q/dO loads, dQ's float32 reduce). FA4 takes 96 keys a CTA (m 64, n 96, two
warpgroups of 48 keys): the same fixed costs a step over 1.5x the work, about 1.36x fewer shared-memory bytes and
1.5x fewer L2 bytes a multiply-add, near its 1.48x lead. Gluon's tiles are powers of two, so 96 keys would take
three consumer warpgroups of 32 keys (dK^T and dV^T as swapped products, 80 accumulator registers each at 160).

Tuning variants (configs.OnePassConfig, launch.backward's ``one_pass``): ``DQ_FIRST`` issues dQ's product before
dK's and stages dQ while dK's runs (FA3's order; Q's slot then goes back after the staging); ``RELEASE_EACH`` has
the reducer hand consumer 0's staging buffer back as soon as its reduce has read it, not after consumer 1's too;
``ROTATE`` starts each CTA's walk at its key block's index (modulo its steps), so that the CTAs running together (the
key blocks of one head) add into different rows of dQ instead of all into the same 64 (the order of the steps is
free: dK and dV add over all of them, dQ's reduce in any order).

P^T and dS^T are double-buffered: a consumer reaches a buffer's next use only after the other consumer has arrived
at the previous step's ``ds_ready``, after its products of the step before have finished. The reduce order varies
from run to run, so dQ is not bit-identical between runs (the launcher never takes this kernel for deterministic
calls).

At head dim 256 a consumer holds dK and dV of its 128 columns (64 + 64 float32 registers a thread) through the walk,
S and dP (16 + 16) in a step's first half and its dQ tile (64) in the second: about 192 of its 240. Its shared memory
takes one Q/dO slot (``STAGES = 1``, FA4's sm90 choice at 256): Q, dO, K, V 32 KB each, P^T and dS^T 16 KB each
(two buffers), dQ staging 64 KB: 224 KB. What spilled there (58 spill stores) were not accumulators but the wgmma
descriptors of loop-invariant views, one 64-bit value for each 16-column step of each operand, hoisted out of the
loop and held through it: the views are rebuilt each step instead (bwd_sm90_ws.opaque_zero).

sm_90 ptxas through the launcher's own arguments (benchmarks/sm90_compile.py wide[-alibi|-varlen][-v192|-d256]),
2 x 4096, every mask, softcap, window, ALiBi, packed sequences: 0 spill stores in the loops (2 in the prologue with
packed sequences, causal, softcap and a window at 256); shared memory 206,528 B at 192/128, 231,184 B at 192/192 and
230,672 B at 256 (of 232,448), one CTA an SM; 88 HGMMAs at 256 (44 a consumer).

Packed sequences (``IS_VARLEN``) read through descriptors of the whole ``(1, tokens, heads, d)`` tensors. Key rows
past a sequence's used keys are zeroed in shared memory (consumer 0 K's, consumer 1 V's, both waiting for the other:
``kv_zeroed``), query and dO rows past its queries by consumer 0, which the other waits for (``tail_ready``).
Inputs: 16-bit; full rows, causal or windowed, softcap, ALiBi (exact: the score tiles are small), sinks (through the
lse); no dropout or bias. Scores and masks are common.py's.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .bwd_sm90 import _query_block, store_key_rows
from .bwd_sm90_ws import _reduce_add, _walk, barrier, barriers, consumer_step, opaque_zero, stage_rows
from .common import scores, visible
from .fwd_sm90 import _tile, _zero_tail, wgmma_layout


@gluon.jit
def _product(a, b, a_tail, b_tail, acc_like, TAIL: gl.constexpr):
    """``a @ b`` (+ ``a_tail @ b_tail`` if ``TAIL``) into an accumulator of ``acc_like``'s shape and layout, issued to
    the tensor cores, not waited for: one commit group each."""
    acc = warpgroup_mma(a, b, acc_like, use_acc=False, is_async=True)
    if TAIL:
        acc = warpgroup_mma(a_tail, b_tail, acc, is_async=True)
    return acc


@gluon.jit
def _own_keys(tile, WG: gl.constexpr):
    """Consumer ``WG``'s half of the keys of a ``[keys, columns]`` shared-memory tile, as a ``[columns, keys]`` B
    operand."""
    HALF_N: gl.constexpr = tile.shape[0] // 2
    return tile.slice(WG * HALF_N, HALF_N, 0).permute((1, 0))


@gluon.jit
def _stage_own(smem, ready, index, tile):
    """Store this consumer's part ``tile`` (16-bit) into shared memory ``smem`` for the tensor cores and both
    consumers, then arrive at ``ready.index(index)``."""
    smem.store(tile)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready.index(index), count=1)


@gluon.jit
def _walk_step(it, n_it, ROTATE: gl.constexpr):
    """The step of the walk that loop step ``it`` takes: ``it``, or (``ROTATE``) the walk begun at this CTA's key
    block (modulo its ``n_it`` steps), so that the CTAs running together add into different rows of dQ."""
    step = it
    if ROTATE:
        step = (it + gl.program_id(0)) % n_it
    return step


@gluon.jit
def _stage_dq(dq_own, dq, dq_full, dq_empty, WG: gl.constexpr, it):
    """Stage consumer ``WG``'s dQ columns (float32, scaled) in ``dq_own`` for the reducer, once the reduce of the
    step before has read them."""
    mbarrier.wait(dq_empty.index(WG), (it & 1) ^ 1)
    dq_own.reshape([dq.shape[0], dq.shape[1]]).store(dq)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(WG), count=1)


@gluon.jit
def _consumer(args, walk, WG: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
              FAST_TANH: gl.constexpr, ALIBI: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
              STAGES: gl.constexpr, V_TAIL: gl.constexpr, DQ_FIRST: gl.constexpr, ROTATE: gl.constexpr):
    (q_desc, qt_desc, k_desc, do_desc, q_smem, qt_smem, do_smem, dot_smem, k_smem, kt_smem, v_smem, vt_smem, pt_smem,
     dst_smem, dq_smem, dqt_smem, rows_smem, kv_ready, kv_zeroed, q_ready, q_empty, do_ready, do_empty, tail_ready,
     p_ready, ds_ready, dq_full, dq_empty, DK, DV, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2, softmax_scale,
     stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh) = args
    window_left, window_right = walk[2], walk[3]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HALF_N: gl.constexpr = BLOCK_N // 2
    MAIN: gl.constexpr = q_desc.block_type.shape[3]
    TAIL: gl.constexpr = qt_desc.block_type.shape[3]
    V_MAIN: gl.constexpr = do_desc.block_type.shape[3]
    # This consumer's dK and dQ columns: the main part or the tail; its dV columns: v's tail or its main part.
    OWN: gl.constexpr = MAIN if WG == 0 else TAIL
    V_OWN: gl.constexpr = V_TAIL if WG == 0 else V_MAIN
    HAS_DV: gl.constexpr = V_OWN > 0
    DV_COLS: gl.constexpr = V_OWN if HAS_DV else V_MAIN
    dtype: gl.constexpr = q_desc.dtype
    DP_FIRST: gl.constexpr = STAGES == 1
    # Accumulator layouts of one warpgroup: the scores on its keys (queries x keys), its dK/dQ columns, dV.
    s_layout: gl.constexpr = wgmma_layout(HALF_N, 4)
    own_layout: gl.constexpr = wgmma_layout(OWN, 4)
    dv_layout: gl.constexpr = wgmma_layout(DV_COLS, 4)
    queries_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    first_key = gl.program_id(0) * BLOCK_N
    seq, lo, full_lo, full_hi, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                                 IS_VARLEN, HAS_SEQUSED)
    _, q_start, seqlen_q, k_start, seqlen_k, key_rows = seq
    group = walk[4]
    offs_n = first_key + WG * HALF_N + gl.arange(0, HALF_N, layout=keys_layout)
    dk = gl.zeros([BLOCK_N, OWN], gl.float32, own_layout)
    dv = gl.zeros([BLOCK_N, DV_COLS], gl.float32, dv_layout)
    s_zero = gl.zeros([BLOCK_M, HALF_N], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, OWN], gl.float32, own_layout)
    mbarrier.wait(kv_ready, 0)
    if IS_VARLEN:
        # Key rows past the sequence's used keys hold the next sequence's keys or ones seqused_k leaves out, which
        # dP and dQ's product would read: zeros instead (their own dK and dV rows are stored as zeros or not at
        # all). Both consumers read all 64 rows, so each waits for the other's zeros.
        if first_key + BLOCK_N > seqlen_k:
            if WG == 0:
                _zero_tail(_tile(k_smem, 0), seqlen_k - first_key, 4)
                _zero_tail(_tile(kt_smem, 0), seqlen_k - first_key, 4)
            else:
                _zero_tail(_tile(v_smem, 0), seqlen_k - first_key, 4)
                if V_TAIL > 0:
                    _zero_tail(_tile(vt_smem, 0), seqlen_k - first_key, 4)
        mbarrier.arrive(kv_zeroed, count=1)
        mbarrier.wait(kv_zeroed, 0)
    n_tail = 0
    for it in range(n_it):
        slot, phase, buf, buf_phase, off_h, row, slope2 = consumer_step(it, _walk_step(it, n_it, ROTATE), n_q, lo,
                                                                        off_hk, group, ALIBI_SLOPES,
                                                                        off_b * stride_alibi_b, BLOCK_M, STAGES, ALIBI)
        offs_m = row + gl.arange(0, BLOCK_M, layout=queries_layout)
        # The step's views of shared memory go through an index the compilers cannot see is 0 (a ring of one slot
        # too): their wgmma descriptors are built where they are used, not hoisted out of the loop and held (at
        # head dim 256, 58 spill stores).
        zero = opaque_zero(it)
        slot = slot + zero
        k = _tile(k_smem, zero)
        kt = _tile(kt_smem, zero)
        k_own = k if WG == 0 else kt
        # B operands of S and dP: this consumer's 32 keys.
        k_keys = _own_keys(k, WG)
        kt_keys = _own_keys(kt, WG)
        v_keys = _own_keys(_tile(v_smem, zero), WG)
        vt_keys = _own_keys(_tile(vt_smem, zero), WG)
        q = _tile(q_smem, slot)
        qt = _tile(qt_smem, slot)
        do = _tile(do_smem, slot)
        dot = _tile(dot_smem, slot)
        q_own = q if WG == 0 else qt
        do_own = dot if WG == 0 else do
        mbarrier.wait(do_ready.index(slot), phase)
        if IS_VARLEN:
            if row + BLOCK_M > seqlen_q:
                # The rows past this sequence's queries are the next sequence's: consumer 0 zeroes them, so that
                # not even an infinity there meets this one's zero probabilities, and consumer 1 waits for it.
                if WG == 0:
                    mbarrier.wait(q_ready.index(slot), phase)
                    _zero_tail(q, seqlen_q - row, 4)
                    _zero_tail(qt, seqlen_q - row, 4)
                    _zero_tail(do, seqlen_q - row, 4)
                    if V_TAIL > 0:
                        _zero_tail(dot, seqlen_q - row, 4)
                    mbarrier.arrive(tail_ready, count=1)
                else:
                    mbarrier.wait(tail_ready, n_tail & 1)
                n_tail += 1
        if DP_FIRST:
            # One slot: Q is refilled last (after the step before's dK), so dP, on dO, covers its load; S is
            # waited for with it.
            dp = _product(do, v_keys, dot, vt_keys, s_zero, V_TAIL > 0)
            mbarrier.wait(q_ready.index(slot), phase)
            qk = _product(q, k_keys, qt, kt_keys, s_zero, True)
            qk, dp = warpgroup_mma_wait(0, deps=(qk, dp))
        else:
            # S and dP go to the tensor cores together; S is waited for alone.
            mbarrier.wait(q_ready.index(slot), phase)
            qk = _product(q, k_keys, qt, kt_keys, s_zero, True)
            dp = _product(do, v_keys, dot, vt_keys, s_zero, V_TAIL > 0)
            qk = warpgroup_mma_wait(2 if V_TAIL > 0 else 1, deps=(qk, ))
        # The exponentials run under the dP product (after it, with one slot); blocks straddling a window edge zero
        # the pairs they do not see afterwards.
        s, t = scores(qk, offs_m[:, None], offs_n[None, :], first_key, seqlen_q, seqlen_k, qk_scale, softcap2,
                      slope2, 0, 0, 0, window_left, window_right, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH,
                      ALIBI, "")
        # The rows' lse and delta come from shared memory where they are used, not held through the step.
        lse2 = rows_smem.index(slot * 2).load(queries_layout)
        p = gl.exp2(s - lse2[:, None])
        if (row < full_lo) | (row >= full_hi):
            p = gl.where(visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                                 MASK_LEFT, MASK_RIGHT), p, 0.0)
        # This consumer's keys are 32 rows of P^T (dV's A operand).
        _stage_own(_own_keys(pt_smem.index(buf), WG), p_ready, buf, p.to(dtype))
        if not DP_FIRST:
            dp = warpgroup_mma_wait(0, deps=(dp, ))
        delta = rows_smem.index(slot * 2 + 1).load(queries_layout)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            # d(c * tanh(x / c)) / dx = 1 - tanh^2.
            ds = ds * (1.0 - t * t)
        _stage_own(_own_keys(dst_smem.index(buf), WG), ds_ready, buf, ds.to(dtype))
        if HAS_DV:
            mbarrier.wait(p_ready.index(buf), buf_phase)
            dv = warpgroup_mma(pt_smem.index(buf), do_own, dv, is_async=True)
        # dK[:, own] += dS^T Q[:, own] and dQ[:, own] = dS K[:, own], over both consumers' keys.
        mbarrier.wait(ds_ready.index(buf), buf_phase)
        ds_t = dst_smem.index(buf)
        dq_own = dq_smem if WG == 0 else dqt_smem
        if DQ_FIRST:
            # FA3's order: dQ first, staged for the reducer while dK's product runs.
            dq = warpgroup_mma(ds_t.permute((1, 0)), k_own, dq_zero, use_acc=False, is_async=True)
            dk = warpgroup_mma(ds_t, q_own, dk, is_async=True)
            if HAS_DV:
                dv = warpgroup_mma_wait(2, deps=(dv, ))
            mbarrier.arrive(do_empty.index(slot), count=1)
            dq = warpgroup_mma_wait(1, deps=(dq, ))
            _stage_dq(dq_own, dq * softmax_scale, dq_full, dq_empty, WG, it)
            dk = warpgroup_mma_wait(0, deps=(dk, ))
            mbarrier.arrive(q_empty.index(slot), count=1)
        else:
            dk = warpgroup_mma(ds_t, q_own, dk, is_async=True)
            dq = warpgroup_mma(ds_t.permute((1, 0)), k_own, dq_zero, use_acc=False, is_async=True)
            # Each slot goes back once its last product is done (dO: dV, issued first; Q: dK), for the producer to
            # refill while the rest runs.
            if HAS_DV:
                dv = warpgroup_mma_wait(2, deps=(dv, ))
            mbarrier.arrive(do_empty.index(slot), count=1)
            dk = warpgroup_mma_wait(1, deps=(dk, ))
            mbarrier.arrive(q_empty.index(slot), count=1)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            _stage_dq(dq_own, dq * softmax_scale, dq_full, dq_empty, WG, it)

    store_key_rows(dk * softmax_scale, WG * MAIN, first_key, k_start, seqlen_k, key_rows, DK, off_b, off_hk,
                   stride_dkb, stride_dkn, stride_dkh, HAS_SEQUSED)
    if HAS_DV:
        store_key_rows(dv, (1 - WG) * V_MAIN, first_key, k_start, seqlen_k, key_rows, DV, off_b, off_hk,
                       stride_dvb, stride_dvn, stride_dvh, HAS_SEQUSED)


@gluon.jit
def load_step(rings, it, tma_b, q_start, off_b, off_h, row, seqlen_q, STAGES: gl.constexpr, V_TAIL: gl.constexpr):
    """The producer's step ``it``: rows from ``row`` of batch row ``off_b``'s query head ``off_h`` (TMA batch row
    ``tma_b``, from token ``q_start``) of dO (and its ``V_TAIL`` columns) and of Q (main and tail) into their rings'
    slot ``it % STAGES``, with the rows' lse and delta. A slot is refilled once its consumers have released its last
    use (the first pass waits on the phase before the barrier's first, which counts as done); dO first, whose last
    use (dV) comes before Q's (dK). ``rings``: the descriptors, rings and barriers, LSE2 and DELTA and their
    strides."""
    (q_desc, qt_desc, do_desc, dot_desc, q_smem, qt_smem, do_smem, dot_smem, rows_smem, q_ready, q_empty, do_ready,
     do_empty, LSE2, DELTA, stride_lse_b, stride_lse_h) = rings
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + qt_desc.block_type.nbytes
    do_bytes: gl.constexpr = do_desc.block_type.nbytes + (dot_desc.block_type.nbytes if V_TAIL > 0 else 0)
    slot = it % STAGES
    phase = (it // STAGES) & 1
    mbarrier.wait(do_empty.index(slot), phase ^ 1)
    bar = do_ready.index(slot)
    mbarrier.expect(bar, do_bytes)
    tma.async_copy_global_to_shared(do_desc, [tma_b, q_start + row, off_h, 0], bar, do_smem.index(slot))
    if V_TAIL > 0:
        tma.async_copy_global_to_shared(dot_desc, [tma_b, q_start + row, off_h, 0], bar, dot_smem.index(slot))
    # Q's barrier also waits for the rows' lse and delta, which share its slot.
    mbarrier.wait(q_empty.index(slot), phase ^ 1)
    bar = q_ready.index(slot)
    mbarrier.expect(bar, q_bytes)
    tma.async_copy_global_to_shared(q_desc, [tma_b, q_start + row, off_h, 0], bar, q_smem.index(slot))
    tma.async_copy_global_to_shared(qt_desc, [tma_b, q_start + row, off_h, 0], bar, qt_smem.index(slot))
    stage_rows(rows_smem, slot, bar, LSE2, DELTA, off_b * stride_lse_b + off_h * stride_lse_h + q_start, row,
               seqlen_q, BLOCK_M)


@gluon.jit
def _producer(args, walk, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
              HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr, V_TAIL: gl.constexpr, ROTATE: gl.constexpr):
    (q_desc, qt_desc, k_desc, kt_desc, v_desc, vt_desc, do_desc, dot_desc, q_smem, qt_smem, do_smem, dot_smem, k_smem,
     kt_smem, v_smem, vt_smem, rows_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, LSE2, DELTA, stride_lse_b,
     stride_lse_h) = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    first_key = gl.program_id(0) * BLOCK_N
    seq, lo, _, _, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                                     HAS_SEQUSED)
    tma_b, q_start, seqlen_q, k_start, _, _ = seq
    group = walk[4]
    # K's and V's parts (rows past the tensor arrive as zeros) complete one barrier.
    key_row = k_start + first_key
    kv_bytes: gl.constexpr = (k_desc.block_type.nbytes + kt_desc.block_type.nbytes + v_desc.block_type.nbytes
                              + (vt_desc.block_type.nbytes if V_TAIL > 0 else 0))
    mbarrier.expect(kv_ready, kv_bytes)
    tma.async_copy_global_to_shared(k_desc, [tma_b, key_row, off_hk, 0], kv_ready, k_smem.index(0))
    tma.async_copy_global_to_shared(kt_desc, [tma_b, key_row, off_hk, 0], kv_ready, kt_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [tma_b, key_row, off_hk, 0], kv_ready, v_smem.index(0))
    if V_TAIL > 0:
        tma.async_copy_global_to_shared(vt_desc, [tma_b, key_row, off_hk, 0], kv_ready, vt_smem.index(0))
    rings = (q_desc, qt_desc, do_desc, dot_desc, q_smem, qt_smem, do_smem, dot_smem, rows_smem, q_ready, q_empty,
             do_ready, do_empty, LSE2, DELTA, stride_lse_b, stride_lse_h)
    for it in range(n_it):
        off_h, row = _query_block(_walk_step(it, n_it, ROTATE), n_q, lo, off_hk, group, BLOCK_M)
        load_step(rings, it, tma_b, q_start, off_b, off_h, row, seqlen_q, STAGES, V_TAIL)


@gluon.jit
def _reducer(args, walk, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
             HAS_SEQUSED: gl.constexpr, RELEASE_EACH: gl.constexpr, ROTATE: gl.constexpr):
    q_desc, k_desc, dq_desc, dqt_desc, dq_smem, dqt_smem, dq_full, dq_empty = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    off_hk = gl.program_id(1)
    seq, lo, _, _, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                                     HAS_SEQUSED)
    tma_b, q_start, _, _, _, _ = seq
    group = walk[4]
    for it in range(n_it):
        off_h, row = _query_block(_walk_step(it, n_it, ROTATE), n_q, lo, off_hk, group, BLOCK_M)
        # Each part as soon as its consumer has staged it (rows past the tensor are clipped; rows past a packed
        # sequence, the next one's, get zeros added); both buffers go back once the reduces have read them.
        mbarrier.wait(dq_full.index(0), it & 1)
        _reduce_add(dq_desc, [tma_b, q_start + row, off_h, 0], dq_smem)
        if RELEASE_EACH:
            # Consumer 0's buffer goes back once read, without waiting for consumer 1's part.
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(0), count=1)
        mbarrier.wait(dq_full.index(1), it & 1)
        _reduce_add(dqt_desc, [tma_b, q_start + row, off_h, 0], dqt_smem)
        tma.store_wait(0)
        if not RELEASE_EACH:
            mbarrier.arrive(dq_empty.index(0), count=1)
        mbarrier.arrive(dq_empty.index(1), count=1)


@gluon.jit
def attn_bwd_sm90_wide(q_desc, q_tail_desc, k_desc, k_tail_desc, v_desc, v_tail_desc, do_desc, do_tail_desc, dq_desc,
                       dq_tail_desc, DK, DV, LSE2, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, ALIBI_SLOPES,
                       stride_alibi_b, qk_scale, softcap2, softmax_scale, window_left, window_right, stride_dkb,
                       stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_lse_b, stride_lse_h, seqlen_q,
                       seqlen_k, group,
                       MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                       FAST_TANH: gl.constexpr, ALIBI: gl.constexpr, IS_VARLEN: gl.constexpr,
                       HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr, V_TAIL: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, DQ_FIRST: gl.constexpr, RELEASE_EACH: gl.constexpr,
                       ROTATE: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``q_tail_desc``: TMA descriptors of ``(batch, seqlen, heads, 128)`` and ``(.., 64)`` views of q
    (its main columns and its tail) with ``[1, 64, 1, cols]`` tiles, ``k_desc``/``k_tail_desc`` the same of k,
    ``v_desc``/``do_desc`` of v and dO (their first 128 columns), ``v_tail_desc``/``do_tail_desc`` of their ``V_TAIL``
    more (None without), ``dq_desc``/``dq_tail_desc`` of the main and tail views of the zeroed float32 dQ buffer;
    one CTA per (64 keys, KV head, batch row). ``qk_scale``/``softcap2`` as common.scores
    takes them; LSE2 and DELTA are bwd_preprocess's. dQ arrives in its buffer scaled, to be cast."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    MAIN: gl.constexpr = q_desc.block_type.shape[3]
    TAIL: gl.constexpr = q_tail_desc.block_type.shape[3]
    V_MAIN: gl.constexpr = v_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(num_warps == 4, "the default partition is consumer 0, one warpgroup")
    gl.static_assert(BLOCK_M == 64 and BLOCK_N == 64, "steps of 64 queries over a CTA's 64 keys")
    gl.static_assert(dq_desc.block_type.shape[3] == MAIN and dq_tail_desc.block_type.shape[3] == TAIL,
                     "dQ's parts are q's")
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, MAIN], q_desc.layout)
    qt_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, TAIL], q_tail_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, V_MAIN], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, MAIN], k_desc.layout)
    kt_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, TAIL], k_tail_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, V_MAIN], v_desc.layout)
    if V_TAIL > 0:
        dot_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, V_TAIL], do_tail_desc.layout)
        vt_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, V_TAIL], v_tail_desc.layout)
    else:
        # No tail of v: names for the partitions' arguments, never read.
        dot_smem = do_smem
        vt_smem = v_smem
    # P^T and dS^T (keys x queries), two steps of each; dQ staging (queries x columns), one step of each part.
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, 1, MAIN], dq_desc.layout)
    dqt_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, 1, TAIL], dq_tail_desc.layout)
    # Each ring slot's rows: their lse (log2 units) and delta.
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready = barrier(1)
    kv_zeroed = barrier(2)
    tail_ready = barrier(1)
    # A ring slot's Q (and rows) / dO: landed, and released by both consumers.
    q_ready = barriers(STAGES, 2)
    q_empty = barriers(STAGES, 2)
    do_ready = barriers(STAGES, 1)
    do_empty = barriers(STAGES, 2)
    # Both consumers' halves of P^T / dS^T in place; a consumer's dQ staged / read by the reduce.
    p_ready = barriers(2, 2)
    ds_ready = barriers(2, 2)
    dq_full = barriers(2, 1)
    dq_empty = barriers(2, 1)
    walk = (seqlen_q, seqlen_k, window_left, window_right, group, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K)
    consumer = (q_desc, q_tail_desc, k_desc, do_desc, q_smem, qt_smem, do_smem, dot_smem, k_smem, kt_smem, v_smem,
                vt_smem, pt_smem, dst_smem, dq_smem, dqt_smem, rows_smem, kv_ready, kv_zeroed, q_ready, q_empty,
                do_ready, do_empty, tail_ready, p_ready, ds_ready, dq_full, dq_empty, DK, DV, ALIBI_SLOPES,
                stride_alibi_b, qk_scale, softcap2, softmax_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                stride_dvn, stride_dvh)
    producer = (q_desc, q_tail_desc, k_desc, k_tail_desc, v_desc, v_tail_desc, do_desc, do_tail_desc, q_smem, qt_smem,
                do_smem, dot_smem, k_smem, kt_smem, v_smem, vt_smem, rows_smem, kv_ready, q_ready, q_empty, do_ready,
                do_empty, LSE2, DELTA, stride_lse_b, stride_lse_h)
    reducer = (q_desc, k_desc, dq_desc, dq_tail_desc, dq_smem, dqt_smem, dq_full, dq_empty)
    gl.warp_specialize([(_consumer, (consumer, walk, 0, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, IS_VARLEN,
                                     HAS_SEQUSED, STAGES, V_TAIL, DQ_FIRST, ROTATE)),
                        (_consumer, (consumer, walk, 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, IS_VARLEN,
                                     HAS_SEQUSED, STAGES, V_TAIL, DQ_FIRST, ROTATE)),
                        (_producer, (producer, walk, MASK_LEFT, MASK_RIGHT, IS_VARLEN, HAS_SEQUSED, STAGES, V_TAIL,
                                     ROTATE)),
                        (_reducer, (reducer, walk, MASK_LEFT, MASK_RIGHT, IS_VARLEN, HAS_SEQUSED, RELEASE_EACH,
                                    ROTATE))],
                       [4, 1, 1],
                       [CONSUMER_REGS, 24, 24])
