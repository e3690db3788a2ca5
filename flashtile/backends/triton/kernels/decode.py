"""Attention over a KV cache (``flash_attn_with_kvcache``): append, split-KV attention, combine, merge.

``append_kv``: one program per (new token, batch row, block of heads) writes the token's k and v
into its cache row (rotated k with rotary tables); the programs past the KV heads rotate q. Rotary
positions are key rows (new token ``t`` at ``cache_seqlens[b] + t``), as in flash-attn: left padding
does not shift them.

``attn_decode``: one program per (block of packed query rows, batch row x KV head, split). The
``group`` query heads that share a KV head are packed into the rows, row ``r = t * group + g``
being query token ``t`` of head ``kv_head * group + g``, so each K/V tile is read from memory once
for the whole group. The program walks its split's share of the keys the rows can see, in the
forward kernel's three runs (masked, unmasked, masked). With one split it writes the output; with
more it writes a float32 partial (output, lse) that ``attn_decode_combine`` merges.

Key ``j`` of batch row ``b`` is key row ``leftpad[b] + j`` of its cache, ``j < seqlen_k[b] =
cache_seqlens[b] + seqlen_new - leftpad[b]``; masks are aligned bottom-right to ``seqlen_k[b]``.

With ``Q_VARLEN`` q and the output are packed ``(tokens, heads, headdim)`` as in
``flash_attn_varlen_func`` (a decode step of a continuous batch): batch row ``b``'s queries are rows
``cu_seqlens_q[b]..`` and its keys, read as a cache whose rows are the packed k, start at ``leftpad[b]
= cu_seqlens_k[b]``. Partials keep the ``(batch, token)`` layout; the combine writes the packed rows.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import (LOG2E, cache_sequence, cache_slots, head_terms, kv_range, load_tile, merge_state,
                     packed_queries, report_bad, run_bounds, score_scale, scores, softmax_step, split_range,
                     store_tile)

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _rotary(x, row_ptrs, offs_d, row_ok, COS, SIN, pos, seqlen_ro, stride_ro,
            ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``x`` ``[rows, HEAD_DIM]`` (float32, loaded from ``row_ptrs + offs_d``) rotated at position ``pos``.

    Pairs ``(2i, 2i + 1)`` (interleaved) or ``(i, i + ROTARY_DIM / 2)`` rotate by angle ``i``:
    ``(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)``; features from ``ROTARY_DIM`` on are kept.
    A position outside the tables leaves ``x`` as it is (nothing is read out of bounds)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    in_rot = offs_d < ROTARY_DIM
    if INTERLEAVED:
        partner = offs_d ^ 1
        angle = offs_d // 2
        first = (offs_d % 2) == 0
    else:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        angle = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
        first = offs_d < HALF
    # The partner is the same row's other half of the pair: a second read of bytes already in cache.
    x_partner = tl.load(row_ptrs + partner[None, :], mask=row_ok[:, None] & in_rot[None, :], other=0.0).to(tl.float32)
    table_ok = in_rot & (pos >= 0) & (pos < seqlen_ro)
    cos = tl.load(COS + pos * stride_ro + angle, mask=table_ok, other=1.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_ro + angle, mask=table_ok, other=0.0).to(tl.float32)
    return x * cos[None, :] + tl.where(first, -sin, sin)[None, :] * x_partner


@triton.jit
def append_kv(Q, K_NEW, V_NEW, K_CACHE, V_CACHE, Q_OUT, COS, SIN,
              CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, BLOCK_TABLE, ERR, K_DESCALE, V_DESCALE,
              stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
              stride_kcb, stride_kcn, stride_kch, stride_vcb, stride_vcn, stride_vch,
              stride_qob, stride_qom, stride_qoh, stride_bt, stride_ro,
              stride_kdb, stride_kdh, stride_vdb, stride_vdh,
              seqlen_q, seqlen_new, nheads, nheads_kv, kv_head_blocks, max_seqlen_k, page_size, num_blocks, seqlen_ro,
              HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
              HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr,
              ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, Q_PER_TOKEN: tl.constexpr,
              PAGED: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
              FP8_CACHE: tl.constexpr):
    """Program ``(t, b, z)``: for ``z < kv_head_blocks`` writes new token ``t`` of KV heads
    ``z * BLOCK_H ...`` into the caches; otherwise rotates query token ``t`` of a block of q heads.
    ``FP8_CACHE``: the caches are e4m3 and hold ``x / descale`` (descales ``(batch, nheads_kv)``, by strides)."""
    t = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    seqlen_cache, _, _, cache_b = cache_sequence(off_b, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, seqlen_new,
                                                 max_seqlen_k, num_blocks, ERR, HAS_SEQLENS, False, HAS_BATCH_IDX, False)
    # Rotary positions are key rows, as in flash-attn: left padding does not shift them.
    pos = seqlen_cache
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < HEAD_DIM_ACTUAL
    if z < kv_head_blocks:
        if t < seqlen_new:
            heads = z * BLOCK_H + tl.arange(0, BLOCK_H)
            head_ok = heads < nheads_kv
            heads = heads[:, None].to(tl.int64)
            t64 = t.to(tl.int64)
            k_rows = K_NEW + off_b * stride_kb + t64 * stride_kn + heads * stride_kh
            k = tl.load(k_rows + offs_d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0)
            if ROTARY:
                k = _rotary(k.to(tl.float32), k_rows, offs_d, head_ok, COS, SIN, pos + t, seqlen_ro, stride_ro,
                            ROTARY_DIM, INTERLEAVED)
            # Key row seqlen_cache + t; rows outside the capacity, on a page outside the cache or of no cache row
            # (cache_b = -1) are dropped and recorded (scalar compares: free).
            row = seqlen_cache + t
            row_ok = (row >= 0) & (row < max_seqlen_k) & (cache_b >= 0)
            slot, offset, in_cache = cache_slots(row, row_ok, cache_b, BLOCK_TABLE + off_b * stride_bt, page_size,
                                                 num_blocks, PAGED)
            if PAGED:
                if row_ok & (in_cache == 0):
                    report_bad(ERR, True, 7, tl.load(BLOCK_TABLE + off_b * stride_bt + row // page_size), off_b)
            write = head_ok & row_ok & in_cache
            k_dst = K_CACHE + slot * stride_kcb + offset.to(tl.int64) * stride_kcn + heads * stride_kch
            if FP8_CACHE:
                k = _quantize(k, K_DESCALE + off_b * stride_kdb + heads * stride_kdh, head_ok[:, None])
            tl.store(k_dst + offs_d[None, :], k.to(K_CACHE.dtype.element_ty), mask=write[:, None] & d_ok[None, :])
            offs_dv = tl.arange(0, HEAD_DIM_V)
            dv_ok = offs_dv < HEAD_DIM_V_ACTUAL
            v_rows = V_NEW + off_b * stride_vb + t64 * stride_vn + heads * stride_vh
            v = tl.load(v_rows + offs_dv[None, :], mask=head_ok[:, None] & dv_ok[None, :], other=0.0)
            if FP8_CACHE:
                v = _quantize(v, V_DESCALE + off_b * stride_vdb + heads * stride_vdh, head_ok[:, None])
            v_dst = V_CACHE + slot * stride_vcb + offset.to(tl.int64) * stride_vcn + heads * stride_vch
            tl.store(v_dst + offs_dv[None, :], v.to(V_CACHE.dtype.element_ty), mask=write[:, None] & dv_ok[None, :])
    else:
        if ROTARY:
            if t < seqlen_q:
                heads = (z - kv_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
                head_ok = heads < nheads
                heads = heads[:, None].to(tl.int64)
                t64 = t.to(tl.int64)
                q_rows = Q + off_b * stride_qb + t64 * stride_qm + heads * stride_qh
                q = tl.load(q_rows + offs_d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0)
                # flash-attn: with a causal mask or a window query t sits at the new key t, else all
                # queries sit at position cache_seqlens.
                q_pos = pos
                if Q_PER_TOKEN:
                    q_pos = pos + t
                q = _rotary(q.to(tl.float32), q_rows, offs_d, head_ok, COS, SIN, q_pos, seqlen_ro, stride_ro,
                            ROTARY_DIM, INTERLEAVED)
                q_dst = Q_OUT + off_b * stride_qob + t64 * stride_qom + heads * stride_qoh
                tl.store(q_dst + offs_d[None, :], q.to(Q_OUT.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])


@triton.jit
def _quantize(x, descale_ptrs, mask):
    """``x / descale`` in fp32, saturated to e4m3's +-448 (it has no infinity: the cast would make NaN)."""
    # IEEE division (not the GPU default's approximate one): the same e4m3 value as torch's x / descale.
    x = tl.math.div_rn(x.to(tl.float32), tl.load(descale_ptrs, mask=mask, other=1.0))
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


@triton.jit
def _fp16_operand(q):
    """``(q / scale in fp16, scale)``, ``scale`` a power of two that brings the tile's largest magnitude under
    2^15 (1 for any tile within fp16's range). Against an e4m3 cache the dots run in fp16: e4m3 -> bf16 costs
    sm_90 a cvt to fp16, one to fp32 and one to bf16 per value (255 registers and spills at 16x128), e4m3 -> fp16
    one cvt a pair. bf16 values from 2^-14 to 2^15 are exact in fp16; smaller ones keep fp16's subnormal bits
    (an error under 2^-24 a product with |k| <= 1 before the descale)."""
    q = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q), 1), 0)
    # amax < 2^(e + 1) for e its unbiased exponent: dividing by 2^(e - 14) leaves it under 2^15.
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.minimum(tl.maximum(exponent - 14, 0), 126)
    scale = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return (q * inverse).to(tl.float16), scale


@triton.jit
def _decode_inner(acc, acc_odd, l_i, m_i, q, K_HEAD, V_HEAD, table_row, stride_kb, stride_kn, stride_vb, stride_vn,
                  offs_t, offs_dk, offs_dv, cols_k, cols_v, lo, hi, leftpad, cache_b, page_size, num_blocks, seqlen_q,
                  seqlen_k, qk_scale, softcap2, slope2, window_left, window_right,
                  BLOCK_N: tl.constexpr, HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
                  HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr,
                  PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  FP8_CACHE: tl.constexpr, V_PAIRS: tl.constexpr, PTX: tl.constexpr):
    """The key blocks ``[lo, hi)`` into the running ``(acc, l_i, m_i)``; with ``V_PAIRS`` ``acc`` holds the even
    output columns and ``acc_odd`` the odd ones (else ``acc_odd`` is carried untouched). ``cols_k``, ``cols_v``:
    each tile column's element offset from the program's first KV head (``_head_columns``), ``offs_dk``,
    ``offs_dv``: its feature in its head (for the padded-feature masks); with ``V_PAIRS`` ``cols_v`` and ``offs_dv``
    count V's pairs of columns (16-bit words)."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    slot, offset = _block_slots(lo, leftpad, seqlen_k, cache_b, table_row, page_size, num_blocks,
                                BLOCK_N, PAGED, PAGE_ALIGNED)
    for start_n in range(lo, hi, BLOCK_N):
        k_ptrs = K_HEAD + (slot * stride_kb + offset.to(tl.int64) * stride_kn)[:, None] + cols_k[None, :]
        # Full blocks lie below seqlen_k by construction: only masked blocks check the key boundary.
        k = load_tile(k_ptrs, offs_n, seqlen_k, offs_dk, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, MASK)
        if FP8_CACHE:
            # q is fp16 here (attn_decode): e4m3 -> fp16 is one cvt a pair of values, exact; the descale, one
            # scalar of this KV head, is in qk_scale.
            qk = tl.dot(q, tl.trans(k.to(tl.float16)), input_precision=INPUT_PRECISION)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if MASK or SOFTCAP or ALIBI:
            s, _ = scores(qk, offs_t[:, None], offs_n[None, :], start_n, seqlen_q, seqlen_k, qk_scale, softcap2,
                          slope2, K_HEAD, 0, 0, window_left, window_right,
                          MASK, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, "")
        else:
            s = qk
        p, alpha, m_ij = softmax_step(qk, s, m_i, qk_scale, MASK or SOFTCAP or ALIBI)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_rows = V_HEAD + slot * stride_vb + offset.to(tl.int64) * stride_vn
        # v's descale multiplies the output once, after the loop; p in [0, 1] keeps more bits in fp16 than in bf16
        # (weights below 2^-24 of the row's largest drop out).
        if V_PAIRS:
            acc_odd = acc_odd * alpha[:, None]
            v_even, v_odd = _e4m3_pairs(v_rows, cols_v, offs_dv, offs_n, seqlen_k, HEAD_DIM_V_ACTUAL, HEAD_DIM_V,
                                        MASK, PTX)
            p16 = p.to(tl.float16)
            acc = tl.dot(p16, v_even, acc, input_precision=INPUT_PRECISION)
            acc_odd = tl.dot(p16, v_odd, acc_odd, input_precision=INPUT_PRECISION)
        else:
            v = load_tile(v_rows[:, None] + cols_v[None, :], offs_n, seqlen_k, offs_dv, HEAD_DIM_V_ACTUAL,
                          HEAD_DIM_V, MASK)
            if FP8_CACHE:
                v = v.to(tl.float16)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_ij
        # Read the next block's pages now, so its K and V loads wait on no table read.
        offs_n += BLOCK_N
        slot, offset = _block_slots(start_n + BLOCK_N, leftpad, seqlen_k, cache_b, table_row, page_size, num_blocks,
                                    BLOCK_N, PAGED, PAGE_ALIGNED)
    return acc, acc_odd, l_i, m_i


@triton.jit
def _e4m3_pairs(row_ptrs, cols_w, offs_w, offs_n, seqlen_k, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                CHECK_ROWS: tl.constexpr, PTX: tl.constexpr):
    """The e4m3 tile at ``row_ptrs`` (rows and head strides 2-byte aligned) as its even and its odd columns, two
    ``[BLOCK_N, W]`` fp16 tiles, for ``P @ V`` as two products; its ``W`` pairs of columns are at ``cols_w`` (in
    16-bit words), pair ``offs_w`` of their head (``_head_columns`` of half the head dim).

    The tile is read as 16-bit pairs of columns. Its conversions are elementwise, so Triton loads the pairs from
    shared memory straight into the dot operand's layout, whose registers run along keys: a 16-bit transposing
    ldmatrix, then per register (two keys' pairs) one byte permute and two conversions. Converted whole (a single
    fp16 tile) it would be moved through shared memory again, or loaded a byte at a time (sm_90 has no 8-bit
    transposing ldmatrix). ``PTX``: ``prmt`` and ``cvt.rn.f16x2.e4m3x2`` (on a GPU); else shifts and casts, the
    same values (the interpreter runs no PTX)."""
    w_ptrs = row_ptrs.to(tl.pointer_type(tl.int16), bitcast=True)[:, None] + cols_w[None, :]
    pairs = load_tile(w_ptrs, offs_n, seqlen_k, offs_w, HEAD_DIM_ACTUAL // 2, HEAD_DIM // 2, CHECK_ROWS)
    if PTX:
        # Two elements a call: bytes (e0 even, e0 odd, e1 even, e1 odd) -> (e0 even, e1 even | e0 odd, e1 odd).
        even, odd = tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        even = _e4m3_byte(pairs, 0)
        odd = _e4m3_byte(pairs, 8)
    return even, odd


@triton.jit
def _e4m3_byte(pairs, shift: tl.constexpr):
    """The e4m3 value in bits ``shift .. shift + 7`` of each 16-bit pair, in fp16 (exact)."""
    return ((pairs >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _block_slots(start_n, leftpad, seqlen_k, cache_b, table_row, page_size, num_blocks,
                 BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr):
    """``(slot, offset)`` of the key block from key ``start_n``: key j is key row leftpad + j. A page
    outside the cache is read clamped into it."""
    if PAGED and PAGE_ALIGNED:
        # The block lies on one page: one table read, then its rows are contiguous as in an unpaged cache.
        first = leftpad + start_n
        page = tl.load(table_row + first // page_size, mask=start_n < seqlen_k, other=0).to(tl.int64)
        slot = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        offset = first % page_size + tl.arange(0, BLOCK_N)
    else:
        # Each row is looked up on its own page (BLOCK_N need not match pages).
        offs_n = start_n + tl.arange(0, BLOCK_N)
        slot, offset, _ = cache_slots(leftpad + offs_n, offs_n < seqlen_k, cache_b, table_row, page_size, num_blocks,
                                      PAGED)
    return slot, offset


@triton.jit
def _head_columns(HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, stride_h):
    """Columns of a tile spanning ``HEADS`` heads of ``HEAD_DIM`` features: ``(feature, head slot, offset)``, the
    offset from the first head's feature 0 (``stride_h``: between heads)."""
    offs = tl.arange(0, HEADS * HEAD_DIM)
    if HEADS == 1:
        return offs, offs * 0, offs
    else:
        return offs % HEAD_DIM, offs // HEAD_DIM, (offs // HEAD_DIM) * stride_h + offs % HEAD_DIM


# Lengths and counts that only bound loops and masks are not specialized on (Triton would compile a variant
# for each of "is 1", "divides by 16" and neither): a cache that grows a token a step keeps one kernel.
@triton.jit(do_not_specialize=["max_seqlen_k", "num_blocks", "num_splits"])
def attn_decode(Q, K, V, O, LSE, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, BLOCK_TABLE, ALIBI_SLOPES, SINK,
                CU_SEQLENS_Q, SEQUSED_K, ERR, K_DESCALE, V_DESCALE,
                softmax_scale, softcap, window_left, window_right,
                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                stride_os, stride_ob, stride_om, stride_oh, stride_ls, stride_lb, stride_lh,
                stride_alibi_b, stride_bt, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
                seqlen_q, seqlen_new, max_seqlen_k, page_size, num_blocks, nheads, nheads_kv, num_splits,
                total_q, GROUP: tl.constexpr,
                HEAD_DIM_QK_ACTUAL: tl.constexpr, HEAD_DIM_QK: tl.constexpr,
                HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
                ALIBI: tl.constexpr, HAS_SINK: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr,
                HAS_SEQLENS: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                Q_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                PDL: tl.constexpr, FP8_CACHE: tl.constexpr, V_PAIRS: tl.constexpr, PTX: tl.constexpr):
    """``FP8_CACHE``: K and V are e4m3, read as ``K * K_DESCALE[b, h_kv]`` (descales by strides); ``V_PAIRS``:
    V's rows are 2-byte aligned and read as pairs of columns (``_e4m3_pairs``; ``PTX``: not under the interpreter).
    ``O``/``LSE`` are the output ``(batch, seqlen_q, nheads, headdim_v)`` / ``(batch, nheads, seqlen_q)``
    (one split, ``stride_os = stride_ls = 0``) or the float32 partials with a leading split dim. With
    ``Q_VARLEN`` the output is packed (``stride_ob = stride_lb = 0``, rows from ``cu_seqlens_q[b]``) and
    ``seqlen_q`` is ``max_seqlen_q``. ``PDL``: the combine is launched as a programmatic dependent. ``HEADS``: KV
    heads a program (adjacent ones: each key row's read is ``HEADS`` heads long); their rows are packed one head
    after the other, and the tiles span the heads' features side by side, q and the output masked to each row's own
    head's columns (a block-diagonal product: the other heads' columns of a row are computed and dropped)."""
    if PDL:
        # Let the combine's programs start now: they wait in gdc_wait until this grid has finished.
        gdc_launch_dependents()
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    split = tl.program_id(2)
    # The program's first KV head.
    off_b = (off_bh // (nheads_kv // HEADS)).to(tl.int64)
    off_hk = off_bh % (nheads_kv // HEADS) * HEADS
    _, leftpad, seqlen_k, cache_b = cache_sequence(off_b, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, seqlen_new,
                                                   max_seqlen_k, num_blocks, ERR, HAS_SEQLENS, HAS_LEFTPAD,
                                                   HAS_BATCH_IDX, Q_VARLEN)
    if HAS_SEQUSED:
        # A varlen call's seqused_k: never past the sequence's own keys (one scalar compare).
        used = tl.load(SEQUSED_K + off_b)
        report_bad(ERR, (used < 0) | (used > seqlen_k), 3, used, off_b)
        seqlen_k = tl.minimum(tl.maximum(used, 0), seqlen_k)
    q_start, seqlen_q = packed_queries(off_b, seqlen_q, CU_SEQLENS_Q, total_q, ERR, Q_VARLEN)
    # Packed row r of a KV head's seqlen_q * GROUP is query token r // GROUP of query head off_hk * GROUP + r % GROUP;
    # with HEADS > 1 the next KV head's rows follow.
    n_rows = seqlen_q * GROUP * HEADS
    if Q_VARLEN:
        # The grid is sized for the longest sequence.
        if start_m * BLOCK_M >= n_rows:
            return
    # The partials are laid out by (batch row, token); a packed output by token row.
    o_start = tl.where(num_splits > 1, 0, q_start)
    offs_r = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if HEADS == 1:
        slot_r = offs_r * 0
        offs_t = offs_r // GROUP
        heads = off_hk * GROUP + offs_r % GROUP
    else:
        head_rows = tl.maximum(seqlen_q * GROUP, 1)
        # Rows past the last head's stay on it: their descales, sink and slopes are read in bounds (and not stored).
        slot_r = tl.minimum(offs_r // head_rows, HEADS - 1)
        offs_t = offs_r % head_rows // GROUP
        heads = (off_hk + slot_r) * GROUP + offs_r % GROUP
    row_ok = offs_r < n_rows
    offs_dk, slot_k, cols_k = _head_columns(HEADS, HEAD_DIM_QK, stride_kh)
    offs_dv, slot_v, cols_v = _head_columns(HEADS, HEAD_DIM_V, stride_vh)
    q_ptrs = (Q + off_b * stride_qb + ((q_start + offs_t).to(tl.int64) * stride_qm
                                       + heads.to(tl.int64) * stride_qh)[:, None] + offs_dk[None, :])
    if HEADS == 1:
        q = load_tile(q_ptrs, offs_r, n_rows, offs_dk, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, True)
    else:
        # Each row holds its own head's features; the other heads' columns are 0, so they add nothing to its scores.
        q_mask = (row_ok[:, None] & (slot_k[None, :] == slot_r[:, None])
                  & (offs_dk[None, :] < HEAD_DIM_QK_ACTUAL))
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    if HAS_SINK:
        # The sink joins the softmax once: in split 0 (the combine carries it into the others).
        sink2 = tl.load(SINK + heads).to(tl.float32) * LOG2E
        m_i = tl.where(split == 0, sink2, float("-inf"))
        l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if V_PAIRS:
        # The output's even and odd columns, accumulated apart (see _e4m3_pairs); V read by 16-bit words.
        acc = tl.zeros([BLOCK_M, HEADS * HEAD_DIM_V // 2], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_M, HEADS * HEAD_DIM_V // 2], dtype=tl.float32)
        offs_dv_in, _, cols_v_in = _head_columns(HEADS, HEAD_DIM_V // 2, stride_vh // 2)
    else:
        acc = tl.zeros([BLOCK_M, HEADS * HEAD_DIM_V], dtype=tl.float32)
        offs_dv_in, cols_v_in = offs_dv, cols_v
        acc_odd = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    qk_scale = score_scale(softmax_scale, softcap, SOFTCAP)
    slope2, _, _ = head_terms(off_b, heads, nheads, ALIBI_SLOPES, stride_alibi_b, Q, 0, 0, ALIBI)
    if ALIBI:
        slope2 = slope2[:, None]

    # The keys the block's queries see, then this split's share of them (with HEADS > 1 a block's rows may hold any
    # token: those of all the queries).
    if HEADS == 1:
        first_t = start_m * BLOCK_M // GROUP
        last_t = tl.minimum((start_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
    else:
        first_t = 0
        last_t = seqlen_q - 1
    lo, full_lo, full_hi, hi = kv_range(first_t, last_t, seqlen_q, seqlen_k, window_left, window_right,
                                        BLOCK_N, MASK_LEFT, MASK_RIGHT)
    split_lo, split_hi = split_range(lo, hi, split, num_splits, BLOCK_N)
    K_HEAD = K + off_hk.to(tl.int64) * stride_kh
    V_HEAD = V + off_hk.to(tl.int64) * stride_vh
    table_row = BLOCK_TABLE + off_b * stride_bt
    if FP8_CACHE:
        # The scores are (q / q_scale) . k8 * q_scale * k_descale: both factors join qk_scale, which every score
        # takes anyway.
        if HEADS == 1:
            q, q_scale = _fp16_operand(q)
            qk_scale = qk_scale * (tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh) * q_scale)
        else:
            # Each row's own KV head's descale: into q's rows (fp32), before the fp16 rounding.
            k_descale = tl.load(K_DESCALE + off_b * stride_kdb + (off_hk + slot_r) * stride_kdh)
            q, q_scale = _fp16_operand(q.to(tl.float32) * k_descale[:, None])
            qk_scale = qk_scale * q_scale
    if PAGED:
        # The row's last page, checked once a program (a table not grown with the sequence shows there); pages
        # are clamped as they are read, but a check in the key loop would cost registers (sm90: 128 -> 168).
        last_page = tl.load(table_row + (leftpad + seqlen_k - 1) // page_size, mask=seqlen_k > 0, other=0)
        report_bad(ERR, (last_page < 0) | (last_page >= num_blocks), 7, last_page, off_b)
    for run in tl.static_range(3):
        run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
        # Without a left edge run 0 is empty: leave it out of the compiled kernel.
        if run != 0 or MASK_LEFT:
            acc, acc_odd, l_i, m_i = _decode_inner(
                acc, acc_odd, l_i, m_i, q, K_HEAD, V_HEAD, table_row, stride_kb, stride_kn, stride_vb, stride_vn,
                offs_t, offs_dk, offs_dv_in, cols_k, cols_v_in, tl.maximum(run_lo, split_lo),
                tl.minimum(run_hi, split_hi),
                leftpad, cache_b, page_size, num_blocks, seqlen_q, seqlen_k,
                qk_scale, softcap * LOG2E, slope2, window_left, window_right,
                BLOCK_N, HEAD_DIM_QK_ACTUAL, HEAD_DIM_QK, HEAD_DIM_V_ACTUAL, HEAD_DIM_V,
                run != 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, FAST_TANH, ALIBI, PAGED, PAGE_ALIGNED, INPUT_PRECISION,
                FP8_CACHE, V_PAIRS, PTX)
    if V_PAIRS:
        # Column 2j + i of the output is column j of the i-th accumulator.
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, HEADS * HEAD_DIM_V])

    # A row that saw no key (and no sink) has l = 0: output 0, lse -inf (an empty split, too).
    seen = l_i > 0.0
    if FP8_CACHE:
        if HEADS == 1:
            acc = acc * tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
        else:
            acc = acc * tl.load(V_DESCALE + off_b * stride_vdb + (off_hk + slot_r) * stride_vdh)[:, None]
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_rows = (split.to(tl.int64) * stride_os + off_b * stride_ob + (o_start + offs_t).to(tl.int64) * stride_om
              + heads * stride_oh)
    if HEADS == 1:
        store_tile(O + o_rows[:, None] + offs_dv[None, :], acc.to(O.dtype.element_ty), offs_r, n_rows, offs_dv,
                   HEAD_DIM_V_ACTUAL)
    else:
        # Each row's own head's columns.
        o_mask = row_ok[:, None] & (slot_v[None, :] == slot_r[:, None]) & (offs_dv[None, :] < HEAD_DIM_V_ACTUAL)
        tl.store(O + o_rows[:, None] + offs_dv[None, :], acc.to(O.dtype.element_ty), mask=o_mask)
    lse_ptrs = LSE + split.to(tl.int64) * stride_ls + off_b * stride_lb + heads * stride_lh + o_start + offs_t
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def attn_decode_combine(O_PART, LSE_PART, O, LSE, CU_SEQLENS_Q, ERR,
                        stride_ps, stride_pb, stride_pm, stride_ph, stride_pls, stride_plb, stride_plh,
                        stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                        nheads, num_splits, seqlen_q, total_q,
                        HEAD_DIM_V_ACTUAL: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_S: tl.constexpr,
                        Q_VARLEN: tl.constexpr, PDL: tl.constexpr):
    """Program ``(row, b)`` merges the ``num_splits`` partials of row ``t * nheads + h``, ``BLOCK_S``
    splits per load: the step is latency-bound, so its loads go out together, not one split at a time.
    With ``Q_VARLEN`` the output is packed, as in ``attn_decode``. ``PDL``: launched as a programmatic
    dependent of ``attn_decode``, so the launch and the indexing overlap its tail."""
    row = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    off_t = (row // nheads).to(tl.int64)
    off_h = (row % nheads).to(tl.int64)
    q_start, seqlen_q = packed_queries(off_b, seqlen_q, CU_SEQLENS_Q, total_q, ERR, Q_VARLEN)
    if off_t >= seqlen_q:
        return
    if PDL:
        # The partials are complete, and visible, once the split kernel has finished.
        gdc_wait()
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM_V)
    o_part = (O_PART + off_b * stride_pb + off_t * stride_pm + off_h * stride_ph
              + offs_s[:, None].to(tl.int64) * stride_ps + offs_d[None, :])
    lse_part = LSE_PART + off_b * stride_plb + off_h * stride_plh + off_t + offs_s.to(tl.int64) * stride_pls
    o = tl.zeros([1, HEAD_DIM_V], dtype=tl.float32)
    lse = tl.full([1], float("-inf"), dtype=tl.float32)
    for start_s in range(0, num_splits, BLOCK_S):
        lse_s = tl.load(lse_part, mask=start_s + offs_s < num_splits, other=float("-inf"))
        o_s = load_tile(o_part, start_s + offs_s, num_splits, offs_d, HEAD_DIM_V_ACTUAL, HEAD_DIM_V, True)
        # These splits as one partial (its lse and weighted output), merged into the running one.
        m = tl.max(lse_s, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2((lse_s - m) * LOG2E)
        total = tl.sum(w, 0)
        o_c = tl.sum(tl.where(w[:, None] > 0.0, o_s * w[:, None], 0.0), 0, keep_dims=True)
        o_c = o_c / tl.where(total > 0.0, total, 1.0)
        lse_c = tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        o, lse = merge_state(o, lse, o_c, tl.zeros([1], dtype=tl.float32) + lse_c)
        o_part += BLOCK_S * stride_ps
        lse_part += BLOCK_S * stride_pls
    o_t = q_start + off_t
    o_ptrs = O + off_b * stride_ob + o_t * stride_om + off_h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM_V_ACTUAL)
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + o_t + tl.arange(0, 1), lse)


@triton.jit
def merge_states(OA, LSE_A, OB, LSE_B, O, LSE,
                 stride_ab, stride_am, stride_ah, stride_bb, stride_bm, stride_bh, stride_ob, stride_om, stride_oh,
                 stride_lab, stride_lah, stride_lam, stride_lbb, stride_lbh, stride_lbm, stride_lb, stride_lh,
                 seqlen, nheads, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ``(row block, b)`` merges rows ``t * nheads + h`` of two partial results."""
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    off_b = tl.program_id(1).to(tl.int64)
    n_rows = seqlen * nheads
    offs_t = (offs_r // nheads).to(tl.int64)
    heads = (offs_r % nheads).to(tl.int64)
    row_ok = offs_r < n_rows
    offs_d = tl.arange(0, HEAD_DIM)
    o_a = load_tile(OA + off_b * stride_ab + (offs_t * stride_am + heads * stride_ah)[:, None] + offs_d[None, :],
                    offs_r, n_rows, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True).to(tl.float32)
    o_b = load_tile(OB + off_b * stride_bb + (offs_t * stride_bm + heads * stride_bh)[:, None] + offs_d[None, :],
                    offs_r, n_rows, offs_d, HEAD_DIM_ACTUAL, HEAD_DIM, True).to(tl.float32)
    lse_a = tl.load(LSE_A + off_b * stride_lab + heads * stride_lah + offs_t * stride_lam, mask=row_ok,
                    other=float("-inf"))
    lse_b = tl.load(LSE_B + off_b * stride_lbb + heads * stride_lbh + offs_t * stride_lbm, mask=row_ok,
                    other=float("-inf"))
    o, lse = merge_state(o_a, lse_a, o_b, lse_b)
    o_ptrs = O + off_b * stride_ob + (offs_t * stride_om + heads * stride_oh)[:, None] + offs_d[None, :]
    store_tile(o_ptrs, o.to(O.dtype.element_ty), offs_r, n_rows, offs_d, HEAD_DIM_ACTUAL)
    tl.store(LSE + off_b * stride_lb + heads * stride_lh + offs_t, lse, mask=row_ok)
