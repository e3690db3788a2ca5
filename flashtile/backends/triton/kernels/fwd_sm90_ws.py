"""Hopper forward, warp-specialized (FA3's plan in Gluon), for long rows at head dim 128 (64, 256 and 192/128 where
configs.GLUON_WS_D64, GLUON_WS_D256 and GLUON_WS_D192 are on).

fwd_sm90.py runs one warpgroup a program: it issues its own TMA loads and waits on them between its
matmuls, and a program's fill and drain (Q's load, the first key blocks, the last PV product, the output
store) leave the tensor cores to the SM's other program. Here a CTA splits its warps by role:

    producer (1 warp, 24 registers)      TMA: Q of the next tile, then K_j and V_j into a ring of slots
    consumer 0 (4 warps, 240 registers)  query rows 0..63 of the tile: S = Q K^T, softmax, O += P V
    consumer 1 (4 warps, 240 registers)  query rows 64..127, on the same K/V slots

Each consumer runs fwd_sm90's loop (the softmax of block j under the PV product of block j - 1) and,
instead of loading, waits on a slot's ``ready`` barrier and arrives on its ``empty`` barrier once its
wgmma has read the slot; the producer refills a slot when both consumers have released it (``empty``
counts 2). A consumer walks only the key blocks its own rows see (a causal tile's upper half sees one
block more) and releases the others unread. The register budget moves to the consumers (``setmaxnreg``),
so S and O of a 64 x 128 block each fit without Q in registers.

The CTA walks tiles of 128 rows, query blocks fastest (causal ones from the last block down, so each
head's longest rows go first): with ``grid`` below the tile count each CTA takes every grid-th tile
(persistent: the producer loads the next tile's Q while the consumers finish this one, into a second Q
buffer where shared memory holds one, else into the one buffer once both consumers' last S has read it:
:func:`q_buffers`). Inputs: 16-bit, head dim 64, 128 or 256 for q, k and v alike (HEAD_DIM is the descriptors'), or
192 for q and k with 128 for v (DeepSeek's; ``TAIL``: q and k in two parts, 128 + 64 columns, as fwd_sm90 reads them);
full rows or causal (the masks are fwd_sm90's, windows included, but the dispatcher keeps windows on that kernel's
tiles); softcap (``FIXED_MAX``, ``FOLD_SCALE``: as in fwd_sm90, each consumer folds the scale into its own Q rows),
ALiBi and a sink; no packed sequences or KV cache (the launcher takes fwd_sm90 for those).

``CONSUMERS`` = 3 (configs.TileConfig.consumers, FlashAttention-3's 192-row tiles at head dim 64; with ``FP8``
fp8.Fp8Tile.consumers) adds consumer 2, rows 128..191: tiles of 192 rows, each K/V slot read by three consumers
before its refill (``empty`` counts 3), so a third less K/V traffic and ring bookkeeping a row. Four warpgroups
share 64K registers: the consumers take 160 (consumer 0, the one the kernel starts as, 168) and the producer 24.
S_j (64 registers at 128 keys), P_{j-1} in flight and O (32 each at head dim 64; FP8 d128: O 64, P 16) then fill a
consumer, so P is made the 16-bit (or e4m3) operand as its softmax ends (``P_AT_SOFTMAX``), not carried in
float32 until its PV product.

``FP8`` (kernels/fwd_sm90_fp8.py's entry) runs the same partitions on float8_e4m3fn Q, K and V^T: the scores
take the descales (:func:`_tile_scales`, :func:`_block_scale`), P enters the PV wgmma as e4m3 scaled by
448 (``P_LOG2``: from the exp2, no multiply), V^T's slots are read K-major (:func:`_v_operand`), and O may be summed in
float32 a block at a time (:func:`_pv_mma`). With ``FP8`` off each of these is the 16-bit code as it was.

``PINGPONG`` (FP8's entry sets it) orders the two consumers' matmuls, FlashAttention-3's scheduler barrier on
two mbarriers: a consumer issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} only once the other has issued its
pair for the ring position before, and passes the turn on as soon as its own are issued. Each consumer's
softmax then runs under the other's matmuls instead of both softmaxes leaving the tensor cores idle together:
at FP8's doubled matmul rate the softmax takes about as long as a consumer's two matmuls, so that overlap,
not either one alone, sets the time a key block. P is converted to the operand before the turn is taken, so
the turn is held only while the wgmmas are issued. Both consumers take a turn at every ring position of the
tile, read or released unread, so their counts of turns stay equal. Three 16-bit consumers (the 16-bit entry's
``PINGPONG``, TileConfig.pingpong) pass the turn round: 0, 1, 2, 0, ... (FlashAttention-3 orders its three
warpgroups so at head dim 64).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import kv_range, packed_vt_start, row_block, sequence
from .fwd_sm90 import (_load_qk, _scale_tile, _scores_mma, _softmax_block, _tile, row_parts, row_parts_start,
                       row_start, store_rows, wgmma_layout)

# P (in [0, 1]) times 448, e4m3's largest finite value, spans the format's range before the FP8 cast. The
# factor rides in the exp2's row term (exp2(s - m + log2 448)), so l sums the scaled P too and O / l takes it
# back; only the lse subtracts it.
P_LOG2 = gl.constexpr(8.807354922057604)
# The shared memory a CTA may take on sm_90 (227 KB), less 1 KB for the barriers.
SMEM_BYTES = gl.constexpr(226 * 1024)
# Per-block FP8 descales: one per DESCALE_BLOCK query rows (a CTA's tile) or keys (one or two key blocks).
DESCALE_BLOCK = gl.constexpr(128)


@gluon.constexpr_function
def operand_width(dtype):
    """A wgmma register operand's ``k_width``: the elements of ``dtype`` in one 32-bit register."""
    return 32 // dtype.primitive_bitwidth


@gluon.constexpr_function
def q_buffers(block_m, head_dim, q_bits, ring_bytes, consumers):
    """Q buffers of ``consumers`` consumers' ``block_m x head_dim`` rows: two (this tile's and the next's) when they
    fit beside the K and V rings' ``ring_bytes``, else one. 16-bit d256 with two 64-key slots: two would take
    128 KB beside the rings' 128 KB; one leaves 192 KB."""
    one = consumers * block_m * head_dim * q_bits // 8
    return 2 if 2 * one + ring_bytes <= SMEM_BYTES.value else 1


@gluon.constexpr_function
def value_dim(block_shape, FP8):
    """The value head dim of V's TMA tile ``block_shape``: ``[1, BLOCK_N, 1, HEAD_DIM_V]``, or FP8's V^T
    ``[1, 1, HEAD_DIM_V, BLOCK_N]``."""
    return block_shape[2] if FP8 else block_shape[3]


@gluon.jit
def _tile_of(t, num_m, nheads, LONGEST_FIRST: gl.constexpr):
    """Tile ``t``'s (query block, head, batch row)."""
    start_m = t % num_m
    if LONGEST_FIRST:
        start_m = num_m - 1 - start_m
    return start_m, (t // num_m) % nheads, t // (num_m * nheads)


@gluon.jit
def _tile_sequence(off_b, max_seqlen_q, max_seqlen_k, seqs, q_desc, k_desc, IS_VARLEN: gl.constexpr,
                   HAS_SEQUSED: gl.constexpr, RECORD: gl.constexpr):
    """Where a tile of batch row (or packed sequence) ``off_b`` reads: ``(tma_b, q_start, seqlen_q, k_start, v_start,
    seqlen_k)``, query i at row ``q_start + i`` of the TMA's batch row ``tma_b``, key j at ``k_start + j`` of K and
    ``v_start + j`` of V (packed FP8 V^T: :func:`common.packed_vt_start`). Packed
    sequences (``seqs``: ``CU_SEQLENS_Q``, ``CU_SEQLENS_K``, ``SEQUSED_K``, ``ERR``) are common.sequence's clamped
    spans of the one-row ``(1, tokens, heads, d)`` tensors (the descriptors give the tokens), the same in every
    partition; ``RECORD``: this partition notes bad offsets. A sequence with more keys than ``max_seqlen_k``
    (recorded) is cut there: K's per-block descales have no block past it."""
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, ERR = seqs
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, max_seqlen_q, max_seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                    SEQUSED_K, q_desc.shape[1], k_desc.shape[1], ERR, IS_VARLEN,
                                                    HAS_SEQUSED, RECORD)
    tma_b = off_b
    v_start = k_start
    if IS_VARLEN:
        tma_b = 0
        v_start = packed_vt_start(k_start, off_b)
        seqlen_k = gl.minimum(seqlen_k, max_seqlen_k)
    return tma_b, q_start, seqlen_q, k_start, v_start, seqlen_k


@gluon.jit
def _zero_keys(tile, keys):
    """Zero the columns from ``keys`` on of a ``[HEAD_DIM, BLOCK_N]`` V^T tile in shared memory (the keys past a
    packed sequence: the next sequence's, where even a NaN must not meet a zero probability), 8 rows at a time
    (the producer's one warp holds 8 registers of them), then make the stores visible to the tensor cores."""
    ROWS: gl.constexpr = 8
    HEAD_DIM: gl.constexpr = tile.shape[0]
    BLOCK_N: gl.constexpr = tile.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [ROWS, 4], [1, 1], [1, 0])
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    for r in gl.static_range(0, HEAD_DIM, ROWS):
        part = tile.slice(r, ROWS, 0)
        values = part.load(layout)
        part.store(gl.where((cols < keys)[None, :], values, gl.zeros_like(values)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _blocks(start_m, wg, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, CONSUMERS: gl.constexpr):
    """The tile's first key ``lo`` and block count ``n`` (what the producer loads: every key some row of the
    ``CONSUMERS x BLOCK_M`` rows sees), and consumer ``wg``'s blocks ``[jb, je)`` of them, its first row and its
    own unmasked run ``[full_lo, full_hi)``."""
    first = start_m * CONSUMERS * BLOCK_M
    lo, _, _, hi = kv_range(first, first + CONSUMERS * BLOCK_M - 1, seqlen_q, seqlen_k, window_left, window_right,
                            BLOCK_N, MASK_LEFT, MASK_RIGHT)
    n = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    row = first + wg * BLOCK_M
    lo_w, full_lo, full_hi, hi_w = kv_range(row, row + BLOCK_M - 1, seqlen_q, seqlen_k, window_left, window_right,
                                            BLOCK_N, MASK_LEFT, MASK_RIGHT)
    jb = gl.minimum((lo_w - lo) // BLOCK_N, n)
    je = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(hi_w - lo, 0), BLOCK_N), n), jb)
    return lo, n, jb, je, row, full_lo, full_hi


@gluon.jit
def _slot(c, STAGES: gl.constexpr):
    """Ring position ``c`` (counted over the CTA's whole walk) as (slot, phase of its barriers)."""
    return c % STAGES, (c // STAGES) & 1


@gluon.jit
def _next_slot(s, ph, STAGES: gl.constexpr):
    """The (slot, phase) of the ring position after slot ``s`` at phase ``ph``: a key loop carries these instead
    of dividing its position by ``STAGES`` each block."""
    wrap = s == STAGES - 1
    return gl.where(wrap, 0, s + 1), gl.where(wrap, ph ^ 1, ph)


@gluon.jit
def _take_turn(turn, c, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """With ``PINGPONG``, wait for consumer ``WG``'s turn at ring position ``c``: the consumer before it has issued
    its matmuls of position ``c - 1`` (consumer 0, after the last consumer) or ``c`` (the others).
    ``turn.index(w)``'s phase ``c`` completes when consumer ``w`` may go at ``c`` (the last consumer completes
    consumer 0's phase 0 at the start)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), c & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    """With ``PINGPONG``, hand the tensor cores to the next of ``CONSUMERS`` consumers (its next turn)."""
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)


@gluon.jit
def _release_unread(k_ready, k_empty, v_ready, v_empty, turn, c, STAGES: gl.constexpr, WG: gl.constexpr,
                    PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    """Release ring position ``c`` without reading it: wait until it has landed (its slot's earlier use is
    over), then count this consumer's release of K and V; its turn is taken and passed on unused."""
    s, ph = _slot(c, STAGES)
    mbarrier.wait(k_ready.index(s), ph)
    mbarrier.arrive(k_empty.index(s), count=1)
    mbarrier.wait(v_ready.index(s), ph)
    mbarrier.arrive(v_empty.index(s), count=1)
    _take_turn(turn, c, WG, PINGPONG)
    _pass_turn(turn, WG, PINGPONG, CONSUMERS)


@gluon.jit
def _tile_scales(descales, off_b, off_hk, q_block, qk_scale, FP8: gl.constexpr, K_BLOCKS: gl.constexpr):
    """The consumer's score scale and output scale. With ``FP8`` ``descales`` holds the pointer and (batch, KV
    head, block) strides of Q's, K's and V's float32 descales (a block stride 0: one per batch row and KV head): Q
    K^T of the FP8 inputs times the descales of Q's block ``q_block`` (the DESCALE_BLOCK that holds the consumer's
    rows) and of K is the dequantized product (K's per key block, with ``K_BLOCKS``, in :func:`_block_scale`), and
    O takes ``v_descale`` (P's 448 cancels in O / l)."""
    if FP8:
        (Q_DESCALE, stride_qds_b, stride_qds_h, stride_qds_m, K_DESCALE, stride_kds_b, stride_kds_h, _, V_DESCALE,
         stride_vds_b, stride_vds_h) = descales
        score_scale = qk_scale * gl.load(Q_DESCALE + off_b * stride_qds_b + off_hk * stride_qds_h
                                         + q_block * stride_qds_m)
        if not K_BLOCKS:
            score_scale = score_scale * gl.load(K_DESCALE + off_b * stride_kds_b + off_hk * stride_kds_h)
        v_ds = gl.load(V_DESCALE + off_b * stride_vds_b + off_hk * stride_vds_h)
        return score_scale, v_ds
    else:
        return qk_scale, 1.0


@gluon.jit
def _block_scale(score_scale, descales, off_b, off_hk, start_n, K_BLOCKS: gl.constexpr):
    """The score scale of the key block from ``start_n``: with ``K_BLOCKS``, times its keys' descale (the block
    lies inside one DESCALE_BLOCK: both are powers of two and the block starts at a multiple of its size)."""
    if K_BLOCKS:
        K_DESCALE, stride_kds_b, stride_kds_h, stride_kds_n = descales[4], descales[5], descales[6], descales[7]
        return score_scale * gl.load(K_DESCALE + off_b * stride_kds_b + off_hk * stride_kds_h
                                     + (start_n // DESCALE_BLOCK) * stride_kds_n)
    else:
        return score_scale


@gluon.constexpr_function
def p_log2(FP8):
    """The exp2's scale of P (log2): FP8's 448, none for 16-bit P."""
    return P_LOG2.value if FP8 else 0.0


@gluon.jit
def _p_operand(p, layout: gl.constexpr, dtype: gl.constexpr, CONVERT: gl.constexpr):
    """P as the register A operand of the PV wgmma, in ``dtype``, converted here if ``CONVERT`` (else ``p``
    already is: :func:`_consumer` converts it where the schedule wants, once)."""
    if CONVERT:
        return gl.convert_layout(p.to(dtype), layout)
    else:
        return p


@gluon.jit
def _v_operand(ring, slot, FP8: gl.constexpr):
    """Slot ``slot`` of the V ring as the ``[BLOCK_N, HEAD_DIM]`` B operand of the PV wgmma. FP8 wgmma reads
    only K-major operands: FP8 V comes transposed, ``[HEAD_DIM, BLOCK_N]`` slots with the keys contiguous."""
    if FP8:
        return ring.index(slot).reshape([ring.shape[3], ring.shape[4]]).permute((1, 0))
    else:
        return _tile(ring, slot)


@gluon.jit
def _pv_mma(p, v, acc, pv_zero, TWO_LEVEL: gl.constexpr):
    """Issue the PV product (asynchronous): ``(acc, pv)``. Plain: O += P V on the tensor cores. ``TWO_LEVEL``: P V
    into a zeroed block accumulator ``pv``, which :func:`_pv_done` adds to O in float32. FP8 wgmma adds in
    about 13 mantissa bits (FP22, as SageAttention2 measured), chopped each 32-key step: carried over
    thousands of keys O would come out biased low by percents."""
    if TWO_LEVEL:
        return acc, warpgroup_mma(p, v, pv_zero, use_acc=False, is_async=True)
    else:
        return warpgroup_mma(p, v, acc, is_async=True), pv_zero


@gluon.jit
def _pv_done(acc, pv, alpha_pv, TWO_LEVEL: gl.constexpr, FIXED_MAX: gl.constexpr):
    """Wait for the PV product :func:`_pv_mma` issued; O with it. ``TWO_LEVEL``: O (the blocks before P's, under
    the row max before P's) moves to P's max as P V joins it, ``acc * alpha_pv + pv``, one FMA an element
    (``alpha_pv``: the rescale factor P's block came with; ``FIXED_MAX``: none). Plain: the wgmma has added P V
    into O, which the caller rescales for the next block."""
    if TWO_LEVEL:
        pv = warpgroup_mma_wait(0, deps=(pv, ))
        if FIXED_MAX:
            return acc + pv
        else:
            return acc * gl.convert_layout(alpha_pv, gl.SliceLayout(1, acc.type.layout))[:, None] + pv
    else:
        return warpgroup_mma_wait(0, deps=(acc, ))


@gluon.jit
def _consumer(args, WG: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
              ALIBI: gl.constexpr, HAS_SINK: gl.constexpr, FIXED_MAX: gl.constexpr, FOLD_SCALE: gl.constexpr,
              STAGES: gl.constexpr, FP8: gl.constexpr, K_BLOCKS: gl.constexpr, TWO_LEVEL: gl.constexpr,
              PINGPONG: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr, TAIL: gl.constexpr,
              CONSUMERS: gl.constexpr):
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O,
     LSE, SINK, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2, row_max, window_left, window_right, stride_ob,
     stride_om, stride_oh, stride_lse_b, stride_lse_h, max_seqlen_q, max_seqlen_k, nheads, group, num_tiles, descales,
     seqs, v_landed, tails) = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM_V: gl.constexpr = value_dim(v_desc.block_type.shape, FP8)
    dtype: gl.constexpr = q_desc.dtype
    q_tail_smem, k_tail_smem = tails[2], tails[3]
    # Accumulator layouts of the two matmuls (one warpgroup), and P as the register operand of the second.
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, 4, dtype.primitive_bitwidth)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM_V, 4, dtype.primitive_bitwidth)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=operand_width(dtype))
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    P_SHIFT: gl.constexpr = p_log2(FP8)
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // CONSUMERS
    # Three 16-bit consumers' 160 registers cannot carry P_{j-1} in float32 (64 a thread) beside S_j's 64 and O's
    # 32: they make P the 16-bit operand as its softmax ends. FP8 P carried from one block to the next as e4m3 would
    # take a register a byte (64, repacked by 128 PRMTs a block, and spilled): three FP8 consumers carry it in
    # float32 and make it the operand at the top of the next block, before S_j's registers are taken, as PINGPONG
    # does before its turn (the rest as the PV product is issued).
    P_AT_SOFTMAX: gl.constexpr = CONSUMERS == 3 and not FP8
    P_AT_TOP: gl.constexpr = PINGPONG or (CONSUMERS == 3 and FP8)
    num_m = gl.cdiv(max_seqlen_q, CONSUMERS * BLOCK_M)
    if PINGPONG and WG == CONSUMERS - 1:
        # Consumer 0 takes the first turn.
        mbarrier.arrive(turn.index(0), count=1)
    base = 0
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        start_m, off_h, off_b = _tile_of(t, num_m, nheads, MASK_RIGHT and not MASK_LEFT)
        _, q_start, seqlen_q, _, _, seqlen_k = _tile_sequence(off_b, max_seqlen_q, max_seqlen_k, seqs, q_desc,
                                                              k_desc, IS_VARLEN, HAS_SEQUSED, False)
        # A tile past its packed sequence's rows has nothing to load or store: the producer skips it too.
        if start_m * CONSUMERS * BLOCK_M < seqlen_q:
            lo, n, jb, je, first_row, full_lo, full_hi = _blocks(start_m, WG, seqlen_q, seqlen_k, window_left,
                                                                 window_right, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                                 MASK_RIGHT, CONSUMERS)
            for j in range(0, jb):
                _release_unread(k_ready, k_empty, v_ready, v_empty, turn, base + j, STAGES, WG, PINGPONG,
                                CONSUMERS)

            offs_m = first_row + gl.arange(0, BLOCK_M, layout=rows_s)
            offs_n = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            m_i, l_i, slope2 = row_start(SINK, row_max, ALIBI_SLOPES, stride_alibi_b, off_b, off_h, BLOCK_M, rows_s,
                                         HAS_SINK, FIXED_MAX, ALIBI)
            acc = gl.zeros([BLOCK_M, HEAD_DIM_V], gl.float32, o_layout)
            pv_zero = gl.zeros([BLOCK_M, HEAD_DIM_V], gl.float32, o_layout)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            l_i = row_parts_start(l_i, s_zero, row_parts(ALIBI))
            qb = i % Q_BUFFERS
            mbarrier.wait(q_ready.index(qb * CONSUMERS + WG), (i // Q_BUFFERS) & 1)
            q = q_smem.index(qb * CONSUMERS + WG).reshape([BLOCK_M, HEAD_DIM])
            q_tail = q
            if TAIL:
                q_tail = q_tail_smem.index(qb * CONSUMERS + WG).reshape([BLOCK_M, q_tail_smem.shape[4]])
            off_hk = off_h // group
            # The DESCALE_BLOCK of Q rows that holds this consumer's 64: two consumers' tile is one, three's spans two
            # (the last tile's consumers past the rows take the last block: Q's descales have no block past it).
            q_block = start_m
            if CONSUMERS * BLOCK_M != DESCALE_BLOCK:
                q_block = row_block(first_row, max_seqlen_q, DESCALE_BLOCK)
            score_scale, out_scale = _tile_scales(descales, off_b, off_hk, q_block, qk_scale, FP8, K_BLOCKS)
            if FOLD_SCALE:
                # Softcap's scale (at most 1) into this consumer's Q rows: the tanh then takes q . k as it is.
                _scale_tile(q, qk_scale, 4)
                if TAIL:
                    _scale_tile(q_tail, qk_scale, 4)
                score_scale = 1.0
            if je > jb:
                # Block jb: scores and probabilities; its PV product joins the next step.
                s, ph = _slot(base + jb, STAGES)
                start_n = lo + jb * BLOCK_N
                block_scale = _block_scale(score_scale, descales, off_b, off_hk, start_n, K_BLOCKS)
                mbarrier.wait(k_ready.index(s), ph)
                _take_turn(turn, base + jb, WG, PINGPONG)
                qk = _scores_mma(q, q_tail, k_smem, k_tail_smem, s, s_zero, TAIL)
                _pass_turn(turn, WG, PINGPONG, CONSUMERS)
                qk = warpgroup_mma_wait(0, deps=(qk, ))
                mbarrier.arrive(k_empty.index(s), count=1)
                p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, first_row, offs_m, offs_n + jb * BLOCK_N, start_n,
                                                    (start_n < full_lo) | (start_n >= full_hi), seqlen_q, seqlen_k,
                                                    block_scale, softcap2, slope2, window_left, window_right,
                                                    MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, FIXED_MAX, P_SHIFT)
                p = _p_operand(p, p_layout, dtype, P_AT_SOFTMAX)
                # The factor that moves O to the max of the block whose P V joins it next (TWO_LEVEL; O is 0 here).
                alpha_pv = alpha
                for j in range(jb + 1, je):
                    # Block j's slot follows block j - 1's (carried: no division by STAGES a block).
                    prev, ph_prev = s, ph
                    s, ph = _next_slot(s, ph, STAGES)
                    start_n = lo + j * BLOCK_N
                    block_scale = _block_scale(score_scale, descales, off_b, off_hk, start_n, K_BLOCKS)
                    # S_j = Q K_j^T and O += P_{j-1} V_{j-1} both go to the tensor cores (with PINGPONG P is made
                    # the operand before the turn is taken, so the turn is held only while they are issued)...
                    p = _p_operand(p, p_layout, dtype, P_AT_TOP and not P_AT_SOFTMAX)
                    mbarrier.wait(k_ready.index(s), ph)
                    _take_turn(turn, base + j, WG, PINGPONG)
                    qk = _scores_mma(q, q_tail, k_smem, k_tail_smem, s, s_zero, TAIL)
                    mbarrier.wait(v_ready.index(prev), ph_prev)
                    acc, pv = _pv_mma(_p_operand(p, p_layout, dtype, not (P_AT_TOP or P_AT_SOFTMAX)),
                                      _v_operand(v_smem, prev, FP8), acc, pv_zero, TWO_LEVEL)
                    _pass_turn(turn, WG, PINGPONG, CONSUMERS)
                    # ...S_j is waited for alone (wgmma groups retire in order), and K_j's slot released.
                    qk = warpgroup_mma_wait(1, deps=(qk, ))
                    mbarrier.arrive(k_empty.index(s), count=1)
                    # The softmax of S_j runs while the PV product is still in flight.
                    p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, first_row, offs_m, offs_n + j * BLOCK_N,
                                                        start_n, (start_n < full_lo) | (start_n >= full_hi), seqlen_q,
                                                        seqlen_k, block_scale, softcap2, slope2, window_left,
                                                        window_right, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                                                        FIXED_MAX, P_SHIFT)
                    p = _p_operand(p, p_layout, dtype, P_AT_SOFTMAX)
                    acc = _pv_done(acc, pv, alpha_pv, TWO_LEVEL, FIXED_MAX)
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    if TWO_LEVEL:
                        # O holds blocks up to j - 1 under their max: block j's P V joins it with this block's factor.
                        alpha_pv = alpha
                    elif not FIXED_MAX:
                        # O now holds blocks up to j - 1 under the old row max: move it to the new one.
                        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
                if Q_BUFFERS == 1:
                    # Every S of this tile has been read: the one Q buffer is free (the producer may load the
                    # next tile's Q under the last PV product and the store).
                    mbarrier.arrive(q_empty.index(qb), count=1)
                # The last block's PV product (s, ph: block je - 1's slot).
                mbarrier.wait(v_ready.index(s), ph)
                acc, pv = _pv_mma(_p_operand(p, p_layout, dtype, not P_AT_SOFTMAX), _v_operand(v_smem, s, FP8), acc,
                                  pv_zero, TWO_LEVEL)
                acc = _pv_done(acc, pv, alpha_pv, TWO_LEVEL, FIXED_MAX)
                mbarrier.arrive(v_empty.index(s), count=1)
            elif Q_BUFFERS == 1:
                # No key block of this tile for these rows: Q is not read.
                mbarrier.arrive(q_empty.index(qb), count=1)
            if Q_BUFFERS == 2:
                # This Q buffer is free for the tile after next (released late: an arrive inside the key
                # loop's branch cost FP8 d256 4% at 16k).
                mbarrier.arrive(q_empty.index(qb), count=1)
            for j in range(je, n):
                _release_unread(k_ready, k_empty, v_ready, v_empty, turn, base + j, STAGES, WG, PINGPONG,
                                CONSUMERS)
            base += n
            i += 1

            if FP8:
                acc = acc * out_scale
                # l summed P times 448: the lse takes it out.
                m_i = m_i - P_LOG2
            store_rows(acc, m_i, l_i, offs_m, O, LSE, off_b, off_h, first_row, q_start, seqlen_q, stride_ob,
                       stride_om, stride_oh, stride_lse_b, stride_lse_h, O.dtype.element_ty)


@gluon.jit
def _load_v(v_desc, bar, smem, tma_b, row, off_hk, FP8: gl.constexpr):
    """TMA copy of the key block from ``row`` of V (FP8: of V^T, ``(batch, heads_kv, headdim, seqlen)``, the keys
    along the last dim) into ``smem``; ``bar`` completes when it lands."""
    mbarrier.expect(bar, v_desc.block_type.nbytes)
    if FP8:
        tma.async_copy_global_to_shared(v_desc, [tma_b, off_hk, 0, row], bar, smem)
    else:
        tma.async_copy_global_to_shared(v_desc, [tma_b, row, off_hk, 0], bar, smem)


@gluon.jit
def _load_rows(desc, tail_desc, bar, ring, tail_ring, slot, off_b, row, off_h, TAIL: gl.constexpr):
    """TMA copy of rows ``row..`` of (batch ``off_b``, head ``off_h``) into slot ``slot`` of ``ring``, with ``TAIL``
    their last columns into ``tail_ring``'s (fwd_sm90._load_qk); ``bar`` completes when all have landed."""
    if TAIL:
        _load_qk(desc, tail_desc, bar, ring.index(slot), tail_ring.index(slot), off_b, row, off_h, True, True)
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [off_b, row, off_h, 0], bar, ring.index(slot))


@gluon.jit
def _producer(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
              IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr, TAIL: gl.constexpr, CONSUMERS: gl.constexpr):
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O,
     LSE, SINK, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2, row_max, window_left, window_right, stride_ob,
     stride_om, stride_oh, stride_lse_b, stride_lse_h, max_seqlen_q, max_seqlen_k, nheads, group, num_tiles, descales,
     seqs, v_landed, tails) = args
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // CONSUMERS
    q_tail_desc, k_tail_desc, q_tail_smem, k_tail_smem = tails
    num_m = gl.cdiv(max_seqlen_q, CONSUMERS * BLOCK_M)
    c = 0
    i = 0
    tails = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        start_m, off_h, off_b = _tile_of(t, num_m, nheads, MASK_RIGHT and not MASK_LEFT)
        off_hk = off_h // group
        # The producer alone notes bad offsets: an atomic in a consumer would cost it registers.
        tma_b, q_start, seqlen_q, k_start, v_start, seqlen_k = _tile_sequence(off_b, max_seqlen_q, max_seqlen_k,
                                                                              seqs, q_desc, k_desc, IS_VARLEN,
                                                                              HAS_SEQUSED, True)
        if start_m * CONSUMERS * BLOCK_M < seqlen_q:
            lo, n, _, _, _, _, _ = _blocks(start_m, 0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                           BLOCK_N, MASK_LEFT, MASK_RIGHT, CONSUMERS)
            # Q of every consumer's rows into the buffer the tile before last (one buffer: the last tile) has
            # released (rows past the tensor arrive as zeros; a packed sequence's next rows are never stored).
            qb = i % Q_BUFFERS
            mbarrier.wait(q_empty.index(qb), ((i // Q_BUFFERS) & 1) ^ 1)
            for w in gl.static_range(CONSUMERS):
                _load_rows(q_desc, q_tail_desc, q_ready.index(qb * CONSUMERS + w), q_smem, q_tail_smem,
                           qb * CONSUMERS + w, tma_b, q_start + start_m * CONSUMERS * BLOCK_M + w * BLOCK_M, off_h,
                           TAIL)
            for j in range(n):
                # Each slot is refilled once every consumer has released its last use (the first pass waits
                # on the phase before the barrier's first, which counts as done).
                s, ph = _slot(c, STAGES)
                row = lo + j * BLOCK_N
                mbarrier.wait(k_empty.index(s), ph ^ 1)
                _load_rows(k_desc, k_tail_desc, k_ready.index(s), k_smem, k_tail_smem, s, tma_b, k_start + row, off_hk,
                           TAIL)
                mbarrier.wait(v_empty.index(s), ph ^ 1)
                if IS_VARLEN:
                    if row + BLOCK_N > seqlen_k:
                        # Only the last block can run past the sequence's keys, into the next sequence's: it lands
                        # here first, the producer zeroes those keys, then hands the slot to the consumers.
                        _load_v(v_desc, v_landed, v_smem.index(s), tma_b, v_start + row, off_hk, FP8)
                        mbarrier.wait(v_landed, tails & 1)
                        _zero_keys(v_smem.index(s).reshape([v_smem.shape[3], v_smem.shape[4]]), seqlen_k - row)
                        mbarrier.arrive(v_ready.index(s), count=1)
                        tails += 1
                    else:
                        _load_v(v_desc, v_ready.index(s), v_smem.index(s), tma_b, v_start + row, off_hk, FP8)
                else:
                    _load_v(v_desc, v_ready.index(s), v_smem.index(s), tma_b, v_start + row, off_hk, FP8)
                c += 1
            i += 1


@gluon.jit
def attn_fwd_sm90_ws(q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, O, LSE, SINK, ALIBI_SLOPES, stride_alibi_b,
                     qk_scale, softcap2, row_max, window_left, window_right, stride_ob, stride_om, stride_oh,
                     stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, group, nheads, num_tiles,
                     MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                     HAS_SINK: gl.constexpr, FIXED_MAX: gl.constexpr, FOLD_SCALE: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, TAIL: gl.constexpr, CONSUMERS: gl.constexpr,
                     PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``k_desc``/``v_desc``: TMA descriptors of the ``(batch, seqlen, heads, headdim)`` inputs with
    ``[1, 64, 1, HEAD_DIM]`` (Q: one consumer's rows), ``[1, BLOCK_N, 1, HEAD_DIM]`` and ``[1, BLOCK_N, 1,
    HEAD_DIM_V]`` tiles, HEAD_DIM 64, 128 or 256 (v's alike); with ``TAIL`` q and k of head dim 192 come in two
    parts, as fwd_sm90 reads them: ``q_desc``/``k_desc`` their first 128 columns, ``q_tail_desc``/``k_tail_desc``
    the last 64 (None without ``TAIL``), and v has 128. ``CONSUMERS``: 2 or 3 consumer warpgroups of 64 rows
    (``PINGPONG``: taking turns at the tensor cores); ``num_tiles``: batch x heads x query blocks of ``CONSUMERS x 64``
    rows, walked by ``grid`` CTAs."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM_V: gl.constexpr = v_desc.block_type.shape[3]
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM_V], v_desc.layout)
    # No descales or packed sequences: O (never read) stands in for their pointers.
    descales = (O, 0, 0, 0, O, 0, 0, 0, O, 0, 0)
    run_partitions(q_desc, k_desc, v_desc, v_smem, O, LSE, SINK, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2,
                   row_max, window_left, window_right, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                   seqlen_q, seqlen_k, group, nheads, num_tiles, descales, (O, O, O, O), (q_tail_desc, k_tail_desc),
                   MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_SINK, FIXED_MAX, FOLD_SCALE, STAGES, CONSUMER_REGS, False,
                   False, False, PINGPONG, False, False, TAIL, CONSUMERS, num_warps)


@gluon.jit
def run_partitions(q_desc, k_desc, v_desc, v_smem, O, LSE, SINK, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2,
                   row_max, window_left, window_right, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                   seqlen_q, seqlen_k, group, nheads, num_tiles, descales, seqs, tail_descs, MASK_LEFT: gl.constexpr,
                   MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, HAS_SINK: gl.constexpr,
                   FIXED_MAX: gl.constexpr, FOLD_SCALE: gl.constexpr, STAGES: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, FP8: gl.constexpr, K_BLOCKS: gl.constexpr, TWO_LEVEL: gl.constexpr,
                   PINGPONG: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr, TAIL: gl.constexpr,
                   CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    """The CTA's shared memory, barriers and partitions, around the V ring ``v_smem`` the kernel allocated
    (its layout is the kernel's: V's rows, or with ``FP8`` V^T's). ``K_BLOCKS``, ``TWO_LEVEL``: FP8's per-block K
    descales and block-wise float32 sum of O (:func:`_block_scale`, :func:`_pv_mma`); ``PINGPONG``: the consumers
    take turns issuing their matmuls (:func:`_take_turn`). ``IS_VARLEN`` (FP8 only; 16-bit packed sequences run
    fwd_sm90.py): ``seqs`` holds ``(CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, ERR)``, ``seqlen_q``/``seqlen_k`` are the
    longest lengths and ``off_b`` of a tile a sequence (:func:`_tile_sequence`). ``TAIL``: ``tail_descs`` holds the
    descriptors of q's and k's last columns (192 = 128 + 64), which get rings of their own beside Q's and K's.
    ``CONSUMERS``: 2 or 3 consumer warpgroups."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_tail_desc, k_tail_desc = tail_descs
    TAIL_DIM: gl.constexpr = q_tail_desc.block_type.shape[3] if TAIL else 0
    HEAD_DIM_V: gl.constexpr = value_dim(v_desc.block_type.shape, FP8)
    gl.static_assert(num_warps == 4, "the default partition is consumer 0, one warpgroup")
    gl.static_assert(not (FP8 and FOLD_SCALE), "FP8 Q cannot take the scale: it is applied to the scores")
    gl.static_assert(FP8 or not IS_VARLEN, "the keys past a packed sequence are zeroed in V^T's layout (FP8's)")
    gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "two or three consumer warpgroups")
    # FP8's Q descales come a DESCALE_BLOCK at a time: each consumer's rows must lie in one.
    gl.static_assert(not FP8 or DESCALE_BLOCK % BLOCK_M == 0, "a consumer's Q rows share one descale")
    # One or two Q buffers (this tile's and the next's) of every consumer's rows, and the K ring (V's is
    # given, with as many slots).
    Q_BUFFERS: gl.constexpr = q_buffers(BLOCK_M, HEAD_DIM + TAIL_DIM, dtype.primitive_bitwidth,
                                        STAGES * BLOCK_N * (HEAD_DIM + TAIL_DIM + HEAD_DIM_V)
                                        * dtype.primitive_bitwidth // 8, CONSUMERS)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * Q_BUFFERS, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    if TAIL:
        q_tail_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * Q_BUFFERS, 1, BLOCK_M, 1, TAIL_DIM],
                                                q_tail_desc.layout)
        k_tail_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, TAIL_DIM], k_tail_desc.layout)
        tails = (q_tail_desc, k_tail_desc, q_tail_smem, k_tail_smem)
    else:
        # No tail (nothing more for the partitions to capture).
        tails = (None, None, None, None)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    # A packed sequence's last V^T block lands here first, for the producer to zero the keys past the sequence.
    v_landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(CONSUMERS * Q_BUFFERS):
        mbarrier.init(q_ready.index(b), count=1)
    for b in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_empty.index(b), count=CONSUMERS)
    for b in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(b), count=1)
        mbarrier.init(v_ready.index(b), count=1)
        # Every consumer releases every slot, read or not.
        mbarrier.init(k_empty.index(b), count=CONSUMERS)
        mbarrier.init(v_empty.index(b), count=CONSUMERS)
    if PINGPONG:
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(turn.index(w), count=1)
    if IS_VARLEN:
        mbarrier.init(v_landed, count=1)
    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
            turn, O, LSE, SINK, ALIBI_SLOPES, stride_alibi_b, qk_scale, softcap2, row_max, window_left, window_right,
            stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, nheads, group, num_tiles,
            descales, seqs, v_landed, tails)
    if CONSUMERS == 3:
        # Four warpgroups (the producer's padded to one) in 64K registers: three consumers at 160 (the one the
        # kernel runs as, consumer 0, keeps what the others leave: 168) and the producer at 24.
        gl.warp_specialize([(_consumer, (args, 0, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_SINK, FIXED_MAX,
                                         FOLD_SCALE, STAGES, FP8, K_BLOCKS, TWO_LEVEL, PINGPONG, IS_VARLEN,
                                         HAS_SEQUSED, TAIL, CONSUMERS)),
                            (_consumer, (args, 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_SINK, FIXED_MAX,
                                         FOLD_SCALE, STAGES, FP8, K_BLOCKS, TWO_LEVEL, PINGPONG, IS_VARLEN,
                                         HAS_SEQUSED, TAIL, CONSUMERS)),
                            (_consumer, (args, 2, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_SINK, FIXED_MAX,
                                         FOLD_SCALE, STAGES, FP8, K_BLOCKS, TWO_LEVEL, PINGPONG, IS_VARLEN,
                                         HAS_SEQUSED, TAIL, CONSUMERS)),
                            (_producer, (args, MASK_LEFT, MASK_RIGHT, STAGES, FP8, IS_VARLEN, HAS_SEQUSED, TAIL,
                                         CONSUMERS))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_consumer, (args, 0, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_SINK, FIXED_MAX,
                                         FOLD_SCALE, STAGES, FP8, K_BLOCKS, TWO_LEVEL, PINGPONG, IS_VARLEN,
                                         HAS_SEQUSED, TAIL, CONSUMERS)),
                            (_consumer, (args, 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_SINK, FIXED_MAX,
                                         FOLD_SCALE, STAGES, FP8, K_BLOCKS, TWO_LEVEL, PINGPONG, IS_VARLEN,
                                         HAS_SEQUSED, TAIL, CONSUMERS)),
                            (_producer, (args, MASK_LEFT, MASK_RIGHT, STAGES, FP8, IS_VARLEN, HAS_SEQUSED, TAIL,
                                         CONSUMERS))],
                           [4, 1], [CONSUMER_REGS, 24])
