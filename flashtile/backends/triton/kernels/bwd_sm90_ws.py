"""Hopper one-pass backward, warp-specialized (FA3's plan in Gluon): dK, dV and dQ from one computation of P
and dS, five matmuls a tile instead of the pair's seven (bwd_sm90.py's dK/dV and bwd.py's dQ kernel).

A CTA owns ``2 * BLOCK_N = 128`` keys of one KV head and walks the query blocks that see them, of every query
head of its GQA group. Its warps split by role:

    producer (1 warp)    TMA: the CTA's K and V once, then Q and dO of each step into a ring of slots
    consumer 0 (4 warps) keys 0..63:   S^T, dP^T, dV, dK as bwd_sm90.py, on the transposed tiles
    consumer 1 (4 warps) keys 64..127: the same; then both meet on dS^T in shared memory and each takes
                         half of dQ's columns, dS K[:, half] (a 64 x HEAD_DIM/2 x 128 product), into float32
    reducer (1 warp)     adds each step's staged dQ into a float32 buffer with the TMA's bulk reduce

Per step (64 queries), each consumer:

    issue S^T = K Q^T and dP^T = V dO^T; wait for S^T -> P^T = exp2(S^T - lse) under the dP^T product
    issue dV += P^T dO (P^T from registers); wait for dP^T -> dS^T = P^T (dP^T - delta)
    store dS^T (16-bit) to its half of a shared tile; issue dK += dS^T Q from there
    wait for the other consumer's half -> issue dQ[:, half] = dS K[:, half]; wait for all three
    stage dQ (float32, scaled) in shared memory for the reducer

Tuning variants (configs.OnePassConfig, launch.backward's ``one_pass``; off by default, FA3's choices):
``DQ_FIRST`` issues dQ's product before dK's and stages dQ while dK's runs (Q's slot then goes back after the
staging); ``DK_RS`` takes dK's product with dS^T from registers, as dV's takes P^T (16 KB less wgmma operand traffic
a CTA step at 128, 32 KB at 64), issued before dS^T is stored unless ``DQ_FIRST``; at 128-row steps (head dim 64) a
``dq_desc`` of half the rows and all the columns has the consumers split dQ by rows (products of N = 64, not 32).
``S_AHEAD`` (head dim 128, not with ``DK_RS``) issues the next step's S^T after this step's last product and before
waiting on them, so that the tensor cores run it while dQ is staged, and waits on it before the step ends (a product
in flight across the loop's back edge has ptxas serialize every wgmma, C7514); the step then issues dP^T alone and
starts its exponentials at once.

dS^T and the staging tiles are double-buffered, so a consumer never waits on the reduce of the step it just
staged. Everything a consumer stores or reads goes through mbarriers: ``ds_ready`` (both halves of dS^T are
in place; count 2), ``dq_full``/``dq_empty`` (a staging buffer is filled / has been read by the reduce),
``q_empty`` (both consumers are done with a Q/dO slot), ``q_ready`` (Q has landed and the producer has put the
rows' lse and delta in shared memory). The reduce order varies from run to run, so dQ is not bit-identical
between runs (the launcher never takes this kernel for deterministic calls).

What keeps the consumers' 240 registers enough (sm_90 ptxas; benchmarks/sm90_compile.py): the rows' lse and
delta are read from shared memory where they are used; softcap's 1 - tanh^2 is held in float16, computed in
float32 (no cancellation; its 2^-11 error is far under dS's 16-bit rounding); causal ALiBi is a key term on the
scores and a query term in the lse (no absolute value, no query offsets held); the step's views of shared memory are
rebuilt each step (``opaque_zero``), so that their wgmma descriptors are not held through the loop. Softcap's scale
stays a multiply an element: folded into K it would round the K that dQ's product reads.

Packed sequences (``IS_VARLEN``) read through descriptors of the whole ``(1, tokens, heads, HEAD_DIM)`` tensors, as
bwd_sm90.py does. Key rows past a sequence's used keys are zeroed in shared memory by their consumer (dQ's product
reads every key of the CTA), query and dO rows past its queries by consumer 0, which the other waits for
(``tail_ready``); dQ's rows there get zeros added. Inputs: 16-bit, head dim 64 or 128; full rows, causal or windowed,
softcap, ALiBi, sinks (through the lse); no dropout or bias. Scores and masks are common.py's.
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .bwd_sm90 import _query_block, store_dkdv
from .common import q_block_range, scores, sequence, stored_keys, visible
from .fwd_sm90 import _load, _tile, _zero_tail, wgmma_layout


@builtin
def _reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce: add shared-memory tile ``src`` into the global tile at ``coord`` (asynchronous like
    ``tma.async_copy_shared_to_global``; ``tma.store_wait`` waits for it). Gluon 3.6's Hopper module has no
    wrapper for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def stage_rows(rows_smem, slot, bar, LSE2, DELTA, lse_base, row, seqlen_q, BLOCK_M: gl.constexpr):
    """The producer warp's part of a step: its rows' lse and delta (rows past the sequence: lse +inf makes their P
    exactly 0) go to shared memory beside the step's ring slot; then it arrives at ``bar`` (the slot's readiness,
    which counts this arrival beside the TMA's)."""
    rows_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    offs_m = row + gl.arange(0, BLOCK_M, layout=rows_layout)
    rows_smem.index(slot * 2).store(gl.load(LSE2 + lse_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")))
    rows_smem.index(slot * 2 + 1).store(gl.load(DELTA + lse_base + offs_m, mask=offs_m < seqlen_q, other=0.0))
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def barrier(count: gl.constexpr):
    """An mbarrier whose phases complete on ``count`` arrivals."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=count)
    return bar


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers (``.index(i)``), each with phases that complete on ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def opaque_zero(it):
    """0, from a loop counter ``it`` (its sign bit) in a way the compilers cannot fold: views of shared memory
    indexed by it are rebuilt each step instead of hoisted out of the loop, where each 16-column step of each
    operand's wgmma descriptor (64 bits) would hold registers through it."""
    return gl.inline_asm_elementwise("shr.u32 $0, $1, 31;", "=r,r", [it], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def consumer_step(it, step, n_q, lo, off_hk, group, ALIBI_SLOPES, alibi_row, BLOCK_M: gl.constexpr,
                  STAGES: gl.constexpr, ALIBI: gl.constexpr):
    """Loop step ``it`` of a consumer's walk, which takes query block ``step`` of the walk (``it`` itself unless the
    walk is rotated): ``(slot, phase, buf, buf_phase, off_h, row, slope2)``, its Q/dO ring slot and the slot's phase,
    its buffer of the double-buffered tiles (dS, dQ staging) and that buffer's phase, its query head and first row,
    and the head's ALiBi slope in log2 units (0 without ALiBi; ``alibi_row``: the batch row's offset in
    ``ALIBI_SLOPES``)."""
    off_h, row = _query_block(step, n_q, lo, off_hk, group, BLOCK_M)
    slope2 = 0.0
    if ALIBI:
        slope2 = gl.load(ALIBI_SLOPES + alibi_row + off_h) * 1.4426950408889634
    return it % STAGES, (it // STAGES) & 1, it % 2, (it // 2) & 1, off_h, row, slope2


@gluon.jit
def _walk(walk, q_desc, k_desc, BLOCK_M: gl.constexpr, CTA_KEYS: gl.constexpr, MASK_LEFT: gl.constexpr,
          MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr):
    """This CTA's sequence and query walk (its ``CTA_KEYS`` keys), the same in every partition: ``(tma_b, q_start,
    seqlen_q, k_start, seqlen_k, key_rows)`` as bwd_sm90.py has them (packed tensors are one batch row for the TMA;
    ``key_rows``: the sequence's keys, of which the first ``seqlen_k`` are used), the first query row ``lo``, the
    unmasked run ``[full_lo, full_hi)``, the query blocks of one head ``n_q`` (0 for a CTA past its sequence's used
    keys) and the steps ``n_it`` (``n_q`` for each head of the GQA group). ``walk``: the kernel's lengths, window, group
    and sequence tensors. Bad offsets are clamped into the packed tensors (``q_desc``/``k_desc`` give their
    rows) but not recorded here: an atomic in any partition costs the consumers spills (sm90_compile.py: STL
    23 -> 44), and the forward of the same call has recorded them."""
    seqlen_q, seqlen_k, window_left, window_right, group, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K = walk
    # The packed tokens, from the descriptors: no argument is added to the partitions.
    total_q = q_desc.shape[1]
    total_k = k_desc.shape[1]
    off_b = gl.program_id(2)
    cta_key = gl.program_id(0) * CTA_KEYS
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K,
                                                    total_q, total_k, CU_SEQLENS_Q, IS_VARLEN, HAS_SEQUSED, False)
    key_rows = stored_keys(off_b, k_start, seqlen_k, CU_SEQLENS_K, total_k, HAS_SEQUSED)
    tma_b = off_b
    if IS_VARLEN:
        tma_b = 0
    lo, full_lo, full_hi, hi = q_block_range(gl.program_id(0), seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, CTA_KEYS, MASK_LEFT, MASK_RIGHT, True)
    # Grids are sized for the longest sequence: CTAs past this one's (used) keys see no query.
    n_q = gl.where(cta_key < seqlen_k, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M), 0)
    return (tma_b, q_start, seqlen_q, k_start, seqlen_k, key_rows), lo, full_lo, full_hi, n_q, n_q * group


@gluon.jit
def _alibi_linear(s_t, lse2, offs_m, offs_n, first_key, diag, slope2):
    """ALiBi's bias ``-slope * (i + diag - j)`` on a transposed tile (keys x queries) where no key right of the
    diagonal is seen (causal): a key term added to the scores and a query term taken into the lse, one add an
    element and no query vector of offsets held through the step; both counted from the first key, so small."""
    return (s_t + ((offs_n - first_key).to(gl.float32) * slope2)[:, None],
            lse2 + (offs_m + diag - first_key).to(gl.float32) * slope2)


@gluon.jit
def _dq_product(ds_smem, k_smem, buf, zero, dq_zero, WG: gl.constexpr):
    """Issue consumer ``WG``'s part of dQ = dS K over both consumers' keys (``ds_smem``'s halves of buffer ``buf``,
    the keys x queries dS^T): with ``dq_zero`` all the rows and half the columns, dQ[:, half] = dS K[:, half]
    (products of N = HEAD_DIM / 2), or half the rows and all the columns, dQ[half] = dS[half] K (N = HEAD_DIM, FA3's
    split at 128-row steps)."""
    DQ_M: gl.constexpr = dq_zero.shape[0]
    DQ_N: gl.constexpr = dq_zero.shape[1]
    BLOCK_M: gl.constexpr = ds_smem.shape[2]
    if DQ_M == BLOCK_M:
        dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)), _tile(k_smem, zero).slice(WG * DQ_N, DQ_N, 1),
                           dq_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)),
                           _tile(k_smem, 1 + zero).slice(WG * DQ_N, DQ_N, 1), dq, is_async=True)
    else:
        dq = warpgroup_mma(ds_smem.index(buf * 2).slice(WG * DQ_M, DQ_M, 1).permute((1, 0)), _tile(k_smem, zero),
                           dq_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).slice(WG * DQ_M, DQ_M, 1).permute((1, 0)),
                           _tile(k_smem, 1 + zero), dq, is_async=True)
    return dq


@gluon.jit
def _stage_dq(dq_smem, dq, dq_full, dq_empty, buf, buf_phase, WG: gl.constexpr):
    """Stage consumer ``WG``'s half of a step's dQ (float32, scaled) in its staging buffer ``buf`` once the reduce of
    two steps back has read it, and tell the reducer (``dq_full``)."""
    mbarrier.wait(dq_empty.index(buf), buf_phase ^ 1)
    dq_smem.index(buf * 2 + WG).reshape(dq.shape).store(dq)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(buf), count=1)


@gluon.jit
def _zero_step_tail(do_ready, tail_ready, q, do, slot, phase, row, seqlen_q, n_tail, WG: gl.constexpr,
                    IS_VARLEN: gl.constexpr):
    """Packed sequences: before a step's products read its Q and dO (slot ``slot``, ``phase``), the rows past its
    sequence's queries (the next sequence's) are zeroed by consumer 0, so that not even an infinity there meets
    this one's zero probabilities, and consumer 1 waits for it (``tail_ready``, whose phases ``n_tail`` counts;
    returned, counted on)."""
    if IS_VARLEN:
        if row + q.shape[0] > seqlen_q:
            if WG == 0:
                mbarrier.wait(do_ready.index(slot), phase)
                _zero_tail(q, seqlen_q - row, 4)
                _zero_tail(do, seqlen_q - row, 4)
                mbarrier.arrive(tail_ready, count=1)
            else:
                mbarrier.wait(tail_ready, n_tail & 1)
            n_tail += 1
    return n_tail


@gluon.jit
def _ready_step(q_ready, do_ready, tail_ready, q_smem, do_smem, it, n_it, n_q, lo, off_hk, group, seqlen_q, n_tail,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, IS_VARLEN: gl.constexpr):
    """``S_AHEAD``: wait until step ``it``'s Q can be read by its S^T product, if it is a step of the walk (``n_it``
    steps); returns :func:`_zero_step_tail`'s count."""
    if it < n_it:
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(q_ready.index(slot), phase)
        _, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
        n_tail = _zero_step_tail(do_ready, tail_ready, _tile(q_smem, slot), _tile(do_smem, slot), slot, phase, row,
                                 seqlen_q, n_tail, WG, IS_VARLEN)
    return n_tail


@gluon.jit
def _next_scores(k_smem, q_smem, kv, slot, st_zero):
    """Issue a step's S^T = K Q^T (this consumer's keys, ``k_smem`` index ``kv``; the Q of ring slot ``slot``) into a
    fresh accumulator like ``st_zero``."""
    return warpgroup_mma(_tile(k_smem, kv), _tile(q_smem, slot).permute((1, 0)), st_zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _consumer(args, walk, WG: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
              FAST_TANH: gl.constexpr, ALIBI: gl.constexpr, ALIBI_LINEAR: gl.constexpr, IS_VARLEN: gl.constexpr,
              HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr, DQ_FIRST: gl.constexpr, DK_RS: gl.constexpr,
              S_AHEAD: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, rows_smem, kv_ready, q_ready,
     do_ready, q_empty, ds_ready, dq_full, dq_empty, tail_ready, DK, DV, ALIBI_SLOPES, stride_alibi_b, qk_scale,
     softcap2, softmax_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh) = args
    window_left, window_right = walk[2], walk[3]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    # This consumer's part of a step's dQ, as its staging buffer has it: all the rows and half the columns, or
    # (DQ_ROWS) half the rows and all the columns.
    DQ_M: gl.constexpr = dq_smem.shape[2]
    DQ_N: gl.constexpr = dq_smem.shape[4]
    # Accumulator layouts of one warpgroup: the transposed scores (keys x queries), dK/dV (keys x head dim),
    # dQ's part (queries x columns); P^T as the register operand of the dV product.
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M, 4)
    acc_layout: gl.constexpr = wgmma_layout(HEAD_DIM, 4)
    dq_layout: gl.constexpr = wgmma_layout(DQ_N, 4)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    queries_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    # Products issued after this step's own, left in flight when those are waited on: the next step's S^T.
    NEXT: gl.constexpr = 1 if S_AHEAD else 0

    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    first_key = gl.program_id(0) * 2 * BLOCK_N + WG * BLOCK_N
    seq, lo, full_lo, full_hi, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, 2 * BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                                 IS_VARLEN, HAS_SEQUSED)
    _, q_start, seqlen_q, k_start, seqlen_k, key_rows = seq
    group = walk[4]
    offs_n = first_key + gl.arange(0, BLOCK_N, layout=keys_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([DQ_M, DQ_N], gl.float32, dq_layout)
    mbarrier.wait(kv_ready, 0)
    if IS_VARLEN:
        if first_key + BLOCK_N > seqlen_k:
            # Key rows past the sequence's used keys hold the next sequence's keys or ones seqused_k leaves out,
            # which S^T, dP^T and dQ's product would read: zeros instead, so they add nothing to dQ (their own dK
            # and dV rows are stored as zeros or not at all). The other consumer reads these rows only after the
            # first ds_ready, which this one arrives at later.
            _zero_tail(_tile(k_smem, WG), seqlen_k - first_key, 4)
            _zero_tail(_tile(v_smem, WG), seqlen_k - first_key, 4)
    n_tail = 0
    if S_AHEAD:
        # The first step's S^T, here; each step computes the next one's under its own last products.
        n_tail = _ready_step(q_ready, do_ready, tail_ready, q_smem, do_smem, 0, n_it, n_q, lo, off_hk, group,
                             seqlen_q, n_tail, BLOCK_M, STAGES, WG, IS_VARLEN)
        qk_t = _next_scores(k_smem, q_smem, WG, opaque_zero(n_it), st_zero)
        qk_t = warpgroup_mma_wait(0, deps=(qk_t, ))
    for it in range(n_it):
        slot, phase, buf, buf_phase, off_h, row, slope2 = consumer_step(it, it, n_q, lo, off_hk, group, ALIBI_SLOPES,
                                                                        off_b * stride_alibi_b, BLOCK_M, STAGES, ALIBI)
        offs_m = row + gl.arange(0, BLOCK_M, layout=queries_layout)
        # The step's views of shared memory through an index the compilers cannot see is 0: their wgmma
        # descriptors are built where they are used, not hoisted out of the loop and held (7 to 72 spill stores).
        zero = opaque_zero(it)
        slot = slot + zero
        k = _tile(k_smem, WG + zero)
        v = _tile(v_smem, WG + zero)
        q = _tile(q_smem, slot)
        do = _tile(do_smem, slot)
        if not S_AHEAD:
            # S^T and dP^T go to the tensor cores together; S^T is waited for alone.
            mbarrier.wait(q_ready.index(slot), phase)
            n_tail = _zero_step_tail(do_ready, tail_ready, q, do, slot, phase, row, seqlen_q, n_tail, WG, IS_VARLEN)
            qk_t = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            dp_t = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            qk_t = warpgroup_mma_wait(1, deps=(qk_t, ))
        else:
            # S^T is in place since the last step; dP^T runs under the exponentials.
            mbarrier.wait(do_ready.index(slot), phase)
            dp_t = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        # The exponentials run under the dP^T product; blocks straddling a window edge zero the pairs they do
        # not see afterwards.
        s_t, t_t = scores(qk_t, offs_m[None, :], offs_n[:, None], first_key, seqlen_q, seqlen_k, qk_scale,
                          softcap2, slope2, 0, 0, 0, window_left, window_right, False, MASK_LEFT, MASK_RIGHT,
                          SOFTCAP, FAST_TANH, ALIBI and not ALIBI_LINEAR, "")
        # The rows' lse and delta come from shared memory where they are used, not held through the step.
        lse2 = rows_smem.index(slot * 2).load(queries_layout)
        if ALIBI_LINEAR:
            s_t, lse2 = _alibi_linear(s_t, lse2, offs_m, offs_n, first_key, seqlen_k - seqlen_q, slope2)
        if SOFTCAP:
            # d(c * tanh(x / c)) / dx = 1 - tanh^2, held in float16 (computed in float32: no cancellation).
            w16 = (1.0 - t_t * t_t).to(gl.float16)
        p_t = gl.exp2(s_t - lse2[None, :])
        if (row < full_lo) | (row >= full_hi):
            p_t = gl.where(visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                                   MASK_LEFT, MASK_RIGHT), p_t, 0.0)
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        # dS^T under the dV product.
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
        delta = rows_smem.index(slot * 2 + 1).load(queries_layout)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * w16.to(gl.float32)
        ds16 = ds_t.to(dtype)
        if DK_RS:
            # dS^T as dK's register operand, as P^T is dV's (FA3's): not read back from shared memory.
            ds_op = gl.convert_layout(ds16, op_layout)
            if not DQ_FIRST:
                # Issued before dS^T is stored, under the store and the hand-over.
                dk = warpgroup_mma(ds_op, q, dk, is_async=True)
        # This consumer's half of dS^T goes to shared memory: dK's operand here (without DK_RS), dQ's in both
        # consumers.
        ds_own = ds_smem.index(buf * 2 + WG)
        ds_own.store(ds16)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(buf), count=1)
        if not DK_RS and not DQ_FIRST:
            dk = warpgroup_mma(ds_own, q, dk, is_async=True)
        if S_AHEAD:
            # The next step's Q in place before this one's last products are issued.
            n_tail = _ready_step(q_ready, do_ready, tail_ready, q_smem, do_smem, it + 1, n_it, n_q, lo, off_hk, group,
                                 seqlen_q, n_tail, BLOCK_M, STAGES, WG, IS_VARLEN)
        # This consumer's part of dQ = dS K, over both consumers' keys.
        mbarrier.wait(ds_ready.index(buf), buf_phase)
        dq = _dq_product(ds_smem, k_smem, buf, zero, dq_zero, WG)
        if DQ_FIRST:
            # FA3's order: dK's product after dQ's, and dQ staged for the reducer while dK's runs.
            if DK_RS:
                dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            else:
                dk = warpgroup_mma(ds_own, q, dk, is_async=True)
        if S_AHEAD:
            # The next step's S^T goes to the tensor cores before this step's products are waited on, to run
            # while dQ is staged. After the last step it reads a slot nobody writes, its result unused (Gluon
            # does not merge a product in flight with a plain tensor across a branch).
            qk_next = _next_scores(k_smem, q_smem, WG + zero, zero + (it + 1) % STAGES, st_zero)
        if DQ_FIRST:
            dq, dv = warpgroup_mma_wait(1 + NEXT, deps=(dq, dv))
            _stage_dq(dq_smem, dq * softmax_scale, dq_full, dq_empty, buf, buf_phase, WG)
            dk = warpgroup_mma_wait(NEXT, deps=(dk, ))
            # Both consumers release the Q/dO slot (dK's product read Q last); the producer refills it.
            mbarrier.arrive(q_empty.index(slot), count=1)
        else:
            dq, dk, dv = warpgroup_mma_wait(NEXT, deps=(dq, dk, dv))
            # Both consumers release the Q/dO slot; the producer refills it.
            mbarrier.arrive(q_empty.index(slot), count=1)
            _stage_dq(dq_smem, dq * softmax_scale, dq_full, dq_empty, buf, buf_phase, WG)
        if S_AHEAD:
            # Waited on within the step: a product in flight across the loop's back edge, its registers read in
            # the next step, would have ptxas serialize every wgmma (C7514).
            qk_t = warpgroup_mma_wait(0, deps=(qk_next, ))

    store_dkdv(dk * softmax_scale, dv, first_key, k_start, seqlen_k, key_rows, DK, DV, off_b, off_hk, stride_dkb,
               stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, HAS_SEQUSED)


@gluon.jit
def _producer(args, walk, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
              HAS_SEQUSED: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, rows_smem, kv_ready, q_ready, do_ready, q_empty,
     LSE2, DELTA, stride_lse_b, stride_lse_h) = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    first_key = gl.program_id(0) * 2 * BLOCK_N
    seq, lo, _, _, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, 2 * BLOCK_N, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                                     HAS_SEQUSED)
    tma_b, q_start, seqlen_q, k_start, _, _ = seq
    group = walk[4]
    # Both consumers' K and V rows (rows past the tensor arrive as zeros) complete one barrier.
    mbarrier.expect(kv_ready, 4 * k_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [tma_b, k_start + first_key + w * BLOCK_N, off_hk, 0], kv_ready,
                                        k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [tma_b, k_start + first_key + w * BLOCK_N, off_hk, 0], kv_ready,
                                        v_smem.index(w))
    for it in range(n_it):
        # A slot is refilled once both consumers have released its last use (the first pass waits on the
        # phase before the barrier's first, which counts as done).
        slot = it % STAGES
        phase = (it // STAGES) & 1
        off_h, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
        mbarrier.wait(q_empty.index(slot), phase ^ 1)
        _load(q_desc, q_ready.index(slot), q_smem.index(slot), tma_b, q_start + row, off_h, True)
        _load(do_desc, do_ready.index(slot), do_smem.index(slot), tma_b, q_start + row, off_h, True)
        stage_rows(rows_smem, slot, q_ready.index(slot), LSE2, DELTA, off_b * stride_lse_b + off_h * stride_lse_h
                   + q_start, row, seqlen_q, BLOCK_M)


@gluon.jit
def _reducer(args, walk, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
             HAS_SEQUSED: gl.constexpr):
    q_desc, k_desc, dq_desc, dq_smem, dq_full, dq_empty = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    # Consumer w's part starts w * DQ_M rows down when the consumers split the rows, w * DQ_N columns across when
    # they split the columns.
    DQ_M: gl.constexpr = dq_desc.block_type.shape[1]
    DQ_N: gl.constexpr = dq_desc.block_type.shape[3]
    off_hk = gl.program_id(1)
    seq, lo, _, _, n_q, n_it = _walk(walk, q_desc, k_desc, BLOCK_M, 2 * BLOCK_N, MASK_LEFT, MASK_RIGHT, IS_VARLEN,
                                     HAS_SEQUSED)
    tma_b, q_start, _, _, _, _ = seq
    group = walk[4]
    for it in range(n_it):
        buf = it % 2
        off_h, row = _query_block(it, n_q, lo, off_hk, group, BLOCK_M)
        # Both parts staged: add them into dQ's float32 buffer (rows past the tensor are clipped; rows past a
        # packed sequence, the next one's, get zeros added), and hand the buffer back once the reduce has read it.
        mbarrier.wait(dq_full.index(buf), (it // 2) & 1)
        for w in gl.static_range(2):
            _reduce_add(dq_desc, [tma_b, q_start + row + w * (BLOCK_M - DQ_M), off_h, w * (HEAD_DIM - DQ_N)],
                        dq_smem.index(buf * 2 + w))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def attn_bwd_sm90_ws(q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, LSE2, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K,
                     SEQUSED_K, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2, softmax_scale, window_left,
                     window_right, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                     stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, group, MASK_LEFT: gl.constexpr,
                     MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr, ALIBI: gl.constexpr,
                     ALIBI_LINEAR: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, DQ_FIRST: gl.constexpr, DK_RS: gl.constexpr,
                     S_AHEAD: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``do_desc``: TMA descriptors of ``(batch, seqlen, heads, HEAD_DIM)`` q and dO with ``[1, 64, 1,
    HEAD_DIM]`` tiles, ``k_desc``/``v_desc`` of k and v with ``[1, 64, 1, HEAD_DIM]`` (one consumer's keys),
    ``dq_desc`` of the zeroed float32 dQ buffer with one consumer's part of a step's dQ as its tile, ``[1, BLOCK_M,
    1, HEAD_DIM / 2]`` (half the columns) or, at 128-row steps, ``[1, 64, 1, HEAD_DIM]`` (half the rows: products of
    N = HEAD_DIM, not HEAD_DIM / 2); one CTA per (128 keys, KV head, batch row). ``qk_scale``/``softcap2`` as
    common.scores takes them; LSE2 and DELTA are bwd_preprocess's. dQ arrives in its buffer scaled, to be cast."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    HALF_D: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(num_warps == 4, "the default partition is consumer 0, one warpgroup")
    gl.static_assert(BLOCK_N == 64, "a consumer warpgroup owns 64 keys")
    DQ_M: gl.constexpr = dq_desc.block_type.shape[1]
    DQ_N: gl.constexpr = dq_desc.block_type.shape[3]
    gl.static_assert((DQ_M == BLOCK_M and DQ_N == HALF_D) or (DQ_M == 64 and 2 * DQ_M == BLOCK_M and DQ_N == HEAD_DIM),
                     "a consumer adds half of dQ's columns, or at 128-row steps half its rows")
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    # dS^T halves (keys x queries) and the consumers' dQ staging parts, two steps of each.
    ds_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [4, 1, DQ_M, 1, DQ_N], dq_desc.layout)
    # Each ring slot's rows: their lse (log2 units) and delta.
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready = barrier(1)
    q_ready = barriers(STAGES, 2)
    do_ready = barriers(STAGES, 1)
    q_empty = barriers(STAGES, 2)
    ds_ready = barriers(2, 2)
    dq_full = barriers(2, 2)
    dq_empty = barriers(2, 1)
    tail_ready = barrier(1)
    walk = (seqlen_q, seqlen_k, window_left, window_right, group, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K)
    consumer = (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, rows_smem,
                kv_ready, q_ready, do_ready, q_empty, ds_ready, dq_full, dq_empty, tail_ready, DK, DV, ALIBI_SLOPES,
                stride_alibi_b, qk_scale, softcap2, softmax_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                stride_dvn, stride_dvh)
    producer = (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, rows_smem, kv_ready, q_ready,
                do_ready, q_empty, LSE2, DELTA, stride_lse_b, stride_lse_h)
    reducer = (q_desc, k_desc, dq_desc, dq_smem, dq_full, dq_empty)
    gl.warp_specialize([(_consumer, (consumer, walk, 0, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI,
                                     ALIBI_LINEAR, IS_VARLEN, HAS_SEQUSED, STAGES, DQ_FIRST, DK_RS, S_AHEAD)),
                        (_consumer, (consumer, walk, 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI,
                                     ALIBI_LINEAR, IS_VARLEN, HAS_SEQUSED, STAGES, DQ_FIRST, DK_RS, S_AHEAD)),
                        (_producer, (producer, walk, MASK_LEFT, MASK_RIGHT, IS_VARLEN, HAS_SEQUSED, STAGES)),
                        (_reducer, (reducer, walk, MASK_LEFT, MASK_RIGHT, IS_VARLEN, HAS_SEQUSED))], [4, 1, 1],
                       [CONSUMER_REGS, 24, 24])
