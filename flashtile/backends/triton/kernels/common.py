"""Index, mask and score helpers shared by every attention kernel.

Query ``i`` sees key ``j`` iff ``j < seqlen_k`` and ``j`` lies in the window
``[i + diag - window_left, i + diag + window_right]`` with ``diag = seqlen_k - seqlen_q``
(bottom-right alignment; causal is ``window_right = 0``). ``MASK_LEFT`` / ``MASK_RIGHT``
say whether each side of the window is bounded. Blocks are visited in runs: *full* blocks,
where every (query, key) pair is visible and in range (no mask needed), and *masked* blocks
on the window's edges and the sequence boundary.

Scores are kept in log2 units (``qk_scale = softmax_scale * log2(e)``) so the softmax can use
``exp2``; every additive term (ALiBi slope, bias, sink) is scaled by ``log2(e)`` to match.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def int64(stride_b, stride_m, stride_h):
    """A tensor's (batch, seq, head) strides as int64, so offsets past 2**31 elements do not wrap."""
    return tl.cast(stride_b, tl.int64), tl.cast(stride_m, tl.int64), tl.cast(stride_h, tl.int64)


@triton.jit
def program_block(REVERSE: tl.constexpr):
    """This program's block along the sequence, and its batch and head."""
    start = tl.program_id(0)
    if REVERSE:
        # Causal rows near the end visit the most keys: launch them first for a shorter tail.
        start = tl.num_programs(0) - 1 - start
    return start, tl.program_id(2).to(tl.int64), tl.program_id(1)


@triton.jit
def report_bad(ERR, bad, ARGUMENT: tl.constexpr, value, index):
    """Note a bad index value in the device error record ``ERR`` (int32 ``[argument, value, index, count]``,
    see flashtile/device_errors.py): the first program to meet one writes it, every one counts. A branch on
    a scalar that good input never takes: free on the fast path."""
    if bad:
        if tl.atomic_cas(ERR, 0, ARGUMENT) == 0:
            tl.store(ERR + 1, value.to(tl.int32))
            tl.store(ERR + 2, index.to(tl.int32))
        tl.atomic_add(ERR + 3, 1)


@triton.jit
def packed_vt_start(k_start, off_b):
    """Column of packed FP8 V^T ``(heads_kv, d, columns)`` where sequence ``off_b``'s keys (from ``k_start`` of
    the packed K) begin: ``k_start`` rounded down to 16, plus 16 a sequence before it. The TMA reads V^T's key
    dim only at 16-byte-aligned coordinates (an unaligned one is an illegal instruction on sm_90), and these
    starts never overlap: the next sequence's is past this one's last key. Host side: torch_fp8.pack_v_t."""
    return k_start // 16 * 16 + 16 * off_b


@triton.jit
def row_block(row, rows, BLOCK: tl.constexpr):
    """The block of ``BLOCK`` rows that holds ``row``, at most the last of ``rows`` rows' ``cdiv(rows, BLOCK)``
    blocks (``rows`` >= 1): a tile's rows past the end (never stored) take that block, not one past a tensor of
    ``cdiv(rows, BLOCK)`` blocks."""
    return tl.minimum(row, rows - 1) // BLOCK


@triton.jit
def packed_span(CU_SEQLENS, off_b, total, ERR, ARGUMENT: tl.constexpr, RECORD: tl.constexpr):
    """``(start, end)`` of sequence ``off_b`` of a packed tensor of ``total`` rows, from its offsets: any
    offset below 0, decreasing or past ``total`` is recorded and clamped, so the span lies inside the tensor
    whatever ``CU_SEQLENS`` holds (two scalar compares per program). ``RECORD``: note bad values in ``ERR`` (a
    warp-specialized kernel has one partition do it)."""
    start = tl.load(CU_SEQLENS + off_b)
    end = tl.load(CU_SEQLENS + off_b + 1)
    if RECORD:
        bad = (start < 0) | (end < start) | (end > total)
        report_bad(ERR, bad, ARGUMENT, tl.where(start < 0, start, end), tl.where(start < 0, off_b, off_b + 1))
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return start, end


@triton.jit
def sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, total_q, total_k, ERR,
             IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr, RECORD: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``off_b``: where its rows start in
    the (packed) tensors and how many there are. Varlen: ``seqlen_q`` comes in as ``max_seqlen_q``
    (the grid's bound) and ``total_q``/``total_k`` are the packed tokens; whatever the offsets and
    ``seqused_k`` hold, the rows returned lie inside the tensors (bad values go to ``ERR`` with ``RECORD``)."""
    if IS_VARLEN:
        max_seqlen_q = seqlen_q
        q_start, q_end = packed_span(CU_SEQLENS_Q, off_b, total_q, ERR, 1, RECORD)
        seqlen_q = q_end - q_start
        max_seqlen_k = seqlen_k
        k_start, k_end = packed_span(CU_SEQLENS_K, off_b, total_k, ERR, 2, RECORD)
        seqlen_k = k_end - k_start
        if RECORD:
            # A sequence longer than max_seqlen_q (or _k) has rows no program of a grid covers: say so.
            report_bad(ERR, seqlen_q > max_seqlen_q, 8, seqlen_q, off_b)
            report_bad(ERR, seqlen_k > max_seqlen_k, 9, seqlen_k, off_b)
    else:
        q_start = 0
        k_start = 0
    if HAS_SEQUSED:
        used = tl.load(SEQUSED_K + off_b)
        # Never past the sequence's own keys (the next sequence's would be read): one scalar compare.
        if RECORD:
            report_bad(ERR, (used < 0) | (used > seqlen_k), 3, used, off_b)
        seqlen_k = tl.minimum(tl.maximum(used, 0), seqlen_k)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def stored_keys(off_b, k_start, seqlen_k, CU_SEQLENS_K, total_k, HAS_SEQUSED: tl.constexpr):
    """The keys of sequence ``off_b`` whose dK/dV a program stores: ``seqlen_k`` as :func:`sequence` gives it, or
    with ``seqused_k`` all the sequence's keys (those past the used ones get gradient 0), clamped as there."""
    stored = seqlen_k
    if HAS_SEQUSED:
        k_end = tl.load(CU_SEQLENS_K + off_b + 1)
        stored = tl.minimum(tl.maximum(k_end, k_start), total_k) - k_start
    return stored


@triton.jit
def packed_queries(off_b, seqlen_q, CU_SEQLENS_Q, total_q, ERR, IS_VARLEN: tl.constexpr):
    """``(q_start, seqlen_q)`` of batch row ``off_b``: with ``IS_VARLEN`` q is packed ``total_q`` rows and the
    row's queries are ``cu_seqlens_q[b]..cu_seqlens_q[b + 1]`` (clamped as in :func:`packed_span`), at most
    ``seqlen_q`` of them (``max_seqlen_q``, the grid's bound, as in the forward kernels); otherwise row
    ``off_b`` of a dense q."""
    q_start = 0
    if IS_VARLEN:
        q_start, q_end = packed_span(CU_SEQLENS_Q, off_b, total_q, ERR, 1, True)
        # Rows past max_seqlen_q are past the grid: not computed, and said so.
        report_bad(ERR, q_end - q_start > seqlen_q, 8, q_end - q_start, off_b)
        seqlen_q = tl.minimum(q_end - q_start, seqlen_q)
    return q_start, seqlen_q


@triton.jit
def cache_sequence(off_b, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, seqlen_new, max_seqlen_k, batch_cache, ERR,
                   HAS_SEQLENS: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                   KEYS_PACKED: tl.constexpr):
    """``(seqlen_cache, leftpad, seqlen_k, cache_b)`` of batch row ``off_b`` of a KV cache: the keys
    already cached (without ``CACHE_SEQLENS``: a full cache), the first valid key row, how many keys
    its queries attend to (key ``j`` is key row ``leftpad + j``) and its row of a contiguous cache
    (``batch_cache`` rows; ``-1`` when ``cache_batch_idx`` names none: callers then read and write nothing).
    Keys past the capacity ``max_seqlen_k`` are never read, whatever the lengths say; bad values go to ``ERR``
    (``KEYS_PACKED``: the lengths and left padding are a varlen call's ``cu_seqlens_k[1:]`` and ``[:-1]``, and
    named so). The checks are a few compares on scalars per program: free."""
    seqlen_cache = max_seqlen_k
    if HAS_SEQLENS:
        seqlen_cache = tl.load(CACHE_SEQLENS + off_b).to(tl.int32)
        # A negative length would put the new tokens before the row's first key: none is written then.
        report_bad(ERR, (seqlen_cache < 0) | (seqlen_cache + seqlen_new > max_seqlen_k), 2 if KEYS_PACKED else 4,
                   seqlen_cache, off_b + 1 if KEYS_PACKED else off_b)
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.load(CACHE_LEFTPAD + off_b).to(tl.int32)
        report_bad(ERR, (leftpad < 0) | (leftpad > tl.maximum(seqlen_cache, 0)), 2 if KEYS_PACKED else 6, leftpad,
                   off_b)
        leftpad = tl.minimum(tl.maximum(leftpad, 0), max_seqlen_k)
    cache_b = off_b
    if HAS_BATCH_IDX:
        cache_b = tl.load(CACHE_BATCH_IDX + off_b).to(tl.int64)
        no_row = (cache_b < 0) | (cache_b >= batch_cache)
        report_bad(ERR, no_row, 5, cache_b, off_b)
        cache_b = tl.where(no_row, -1, cache_b)
    seqlen_k = tl.maximum(tl.minimum(tl.maximum(seqlen_cache, 0) + seqlen_new, max_seqlen_k) - leftpad, 0)
    if HAS_BATCH_IDX:
        # No cache row: no key is read.
        seqlen_k = tl.where(cache_b >= 0, seqlen_k, 0)
    return seqlen_cache, leftpad, seqlen_k, cache_b


@triton.jit
def cache_slots(rows, rows_ok, cache_b, table_row, page_size, num_blocks, PAGED: tl.constexpr):
    """Where key rows ``rows`` of one batch row live: ``(slot, offset, in_cache)`` such that row
    ``r`` is ``cache[slot, offset]`` (``slot`` is the page, or ``cache_b`` for a contiguous cache).

    Paged: the block table (``table_row``: this batch row's entries) is read only where ``rows_ok``;
    an entry outside ``[0, num_blocks)`` is clamped into range so no read leaves the cache, and
    ``in_cache`` says which slots were real (writers skip the others and record them)."""
    if PAGED:
        page = tl.load(table_row + rows // page_size, mask=rows_ok, other=0).to(tl.int64)
        in_cache = (page >= 0) & (page < num_blocks)
        slot = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        offset = rows % page_size
    else:
        in_cache = rows_ok
        slot = cache_b
        offset = rows
    return slot, offset, in_cache


@triton.jit
def head_base(base, off_b, off_h, start, stride_b, stride_m, stride_h):
    """Pointer to row ``start`` of head ``off_h`` in batch ``off_b`` (varlen tensors have ``stride_b = 0``)."""
    return base + off_b * stride_b + tl.cast(start, tl.int64) * stride_m + off_h * stride_h


@triton.jit
def tile_ptrs(base, offs_rows, stride_rows, offs_d):
    """Pointers to rows ``offs_rows`` x columns ``offs_d`` below ``base``."""
    return base + offs_rows[:, None] * stride_rows + offs_d[None, :]


@triton.jit
def visible(offs_q, offs_k, seqlen_q, seqlen_k, window_left, window_right,
            MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Which (query, key) pairs attend. ``offs_q`` and ``offs_k`` broadcast against each other."""
    mask = offs_k < seqlen_k
    if MASK_RIGHT:
        mask = mask & (offs_k <= offs_q + (seqlen_k - seqlen_q + window_right))
    if MASK_LEFT:
        mask = mask & (offs_k >= offs_q + (seqlen_k - seqlen_q - window_left))
    return mask


@triton.jit
def kv_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Keys visited by query block ``start_m`` in three runs:
    ``[lo, full_lo)`` masked, ``[full_lo, full_hi)`` unmasked, ``[full_hi, hi)`` masked."""
    first_row = start_m * BLOCK_M
    return kv_range(first_row, first_row + BLOCK_M - 1, seqlen_q, seqlen_k, window_left, window_right,
                    BLOCK_N, MASK_LEFT, MASK_RIGHT)


@triton.jit
def kv_range(first_row, last_row, seqlen_q, seqlen_k, window_left, window_right,
             BLOCK_N: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Keys visited by the queries ``first_row..last_row`` (of ``seqlen_q``) in three runs:
    ``[lo, full_lo)`` masked, ``[full_lo, full_hi)`` unmasked, ``[full_hi, hi)`` masked.
    Every boundary but ``hi`` is a multiple of ``BLOCK_N``."""
    diag = seqlen_k - seqlen_q
    lo = 0
    full_lo = 0
    # Every full key block lies below the sequence end.
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    hi = seqlen_k
    if MASK_LEFT:
        # Blocks wholly left of the first row's window are skipped...
        lo = tl.maximum(first_row + diag - window_left, 0) // BLOCK_N * BLOCK_N
        # ...and from the last row's first key on, the left edge masks nothing.
        full_lo = tl.cdiv(tl.maximum(last_row + diag - window_left, 0), BLOCK_N) * BLOCK_N
    if MASK_RIGHT:
        # Nothing past the last row's last key is visited; up to the first row's, nothing is masked.
        hi = tl.minimum(seqlen_k, tl.maximum(last_row + diag + window_right + 1, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(first_row + diag + window_right + 1, 0) // BLOCK_N * BLOCK_N)
    # A narrow window can leave no full block: the two masked runs then meet at full_lo.
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.cdiv(hi, BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def split_range(lo, hi, split, num_splits, BLOCK_N: tl.constexpr):
    """``[start, end)`` of split ``split`` of ``num_splits``: near-equal shares, in whole key blocks,
    of the keys ``[lo, hi)`` (``lo`` a multiple of ``BLOCK_N``), so split-KV keeps the runs' alignment."""
    blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    start = lo + (split * blocks // num_splits) * BLOCK_N
    end = tl.minimum(lo + ((split + 1) * blocks // num_splits) * BLOCK_N, hi)
    return start, end


@triton.jit
def q_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  EVEN_M: tl.constexpr):
    """Queries that see key block ``start_n``, in three runs:
    ``[lo, full_lo)`` masked, ``[full_lo, full_hi)`` unmasked, ``[full_hi, hi)`` masked.
    Unless ``EVEN_M`` (``seqlen_q`` a multiple of ``BLOCK_M``), a last partial query block is left
    to the masked run 2, so the unmasked run reads whole blocks without row checks."""
    diag = seqlen_k - seqlen_q
    first_key = start_n * BLOCK_N
    last_key = first_key + BLOCK_N - 1
    lo = 0
    full_lo = 0
    full_hi = seqlen_q
    hi = seqlen_q
    if MASK_RIGHT:
        # Query i sees key j only if i >= j - diag - window_right: earlier query blocks see nothing.
        lo = tl.maximum(first_key - diag - window_right, 0) // BLOCK_M * BLOCK_M
        # Queries from the block's last key on see the whole block (as far as the right edge goes).
        full_lo = tl.cdiv(tl.maximum(last_key - diag - window_right, 0), BLOCK_M) * BLOCK_M
    if MASK_LEFT:
        # Query i sees key j only if i <= j - diag + window_left.
        hi = tl.minimum(seqlen_q, tl.maximum(last_key - diag + window_left + 1, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(first_key - diag + window_left + 1, 0) // BLOCK_M * BLOCK_M)
    if not EVEN_M:
        full_hi = tl.minimum(full_hi, seqlen_q // BLOCK_M * BLOCK_M)
    # Never walk query blocks past the sequence: their rows would be read unmasked.
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.cdiv(hi, BLOCK_M) * BLOCK_M)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def run_bounds(run: tl.constexpr, lo, full_lo, full_hi, hi):
    """``[start, end)`` of run 0 (masked), 1 (unmasked) or 2 (masked) of a block range."""
    start = full_hi
    end = hi
    if run == 0:
        start = lo
        end = full_lo
    if run == 1:
        start = full_lo
        end = full_hi
    return start, end


@triton.jit
def part_range(lo, hi, part, split, BLOCK_M: tl.constexpr):
    """Part ``part`` of ``split`` of the query rows ``[lo, hi)``, in whole blocks of ``BLOCK_M`` from
    ``lo``: ``[part_lo, part_hi)``, empty for parts past the last block."""
    per_part = tl.cdiv(tl.cdiv(hi - lo, BLOCK_M), split) * BLOCK_M
    part_lo = lo + part * per_part
    return part_lo, tl.minimum(hi, part_lo + per_part)


@triton.jit
def load_tile(ptrs, offs_rows, n_rows, offs_d, HEAD_DIM_ACTUAL: tl.constexpr, HEAD_DIM: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """Load a ``[rows, HEAD_DIM]`` tile, zero-filling rows past ``n_rows`` and padded head-dim columns."""
    if CHECK_ROWS:
        if HEAD_DIM_ACTUAL == HEAD_DIM:
            tile = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM_ACTUAL), other=0.0)
    else:
        if HEAD_DIM_ACTUAL == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM_ACTUAL, other=0.0)
    return tile


@triton.jit
def store_tile(ptrs, tile, offs_rows, n_rows, offs_d, HEAD_DIM_ACTUAL: tl.constexpr):
    """Store a ``[rows, HEAD_DIM]`` tile, skipping rows past ``n_rows`` and padded head-dim columns."""
    tl.store(ptrs, tile, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM_ACTUAL))


@triton.jit
def tanh(x, FAST_TANH: tl.constexpr):
    """tanh, through the GPU's approximate instruction for 16-bit inputs, else exactly via exp2."""
    if FAST_TANH:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        # 1 - 2 / (e^2x + 1): saturates to +-1 without overflow to NaN.
        y = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    return y


@triton.jit
def score_scale(softmax_scale, softcap, SOFTCAP: tl.constexpr):
    """The factor on ``q . k``: inside the tanh with softcap (``scale / softcap``), else ``scale * log2(e)``."""
    if SOFTCAP:
        qk_scale = softmax_scale / softcap
    else:
        qk_scale = softmax_scale * LOG2E
    return qk_scale


@triton.jit
def head_terms(off_b, off_h, nheads, ALIBI_SLOPES, stride_alibi_b, BIAS_PTR, stride_bb, stride_bh,
               ALIBI: tl.constexpr):
    """What depends on (batch, query head): the ALiBi slope in log2 units, the start of the bias
    slice, and the dropout stream ``b * nheads + h``."""
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(ALIBI_SLOPES + off_b * stride_alibi_b + off_h) * LOG2E
    return slope2, BIAS_PTR + off_b * stride_bb + off_h * stride_bh, (off_b * nheads + off_h).to(tl.int32)


@triton.jit
def bias_ptrs(base, offs_q, offs_k, stride_bm, stride_bn):
    """Pointers into a ``(seqlen_q, seqlen_k)`` slice of the bias (``offs_q``/``offs_k`` broadcast)."""
    return base + tl.cast(offs_q, tl.int64) * stride_bm + tl.cast(offs_k, tl.int64) * stride_bn


@triton.jit
def scores(qk, offs_q, offs_k, key0, seqlen_q, seqlen_k, qk_scale, softcap2, slope2, bias_base, stride_bm, stride_bn,
           window_left, window_right, MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
           SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ALIBI: tl.constexpr, BIAS: tl.constexpr):
    """One tile's scores in log2 units with every modifier applied, ``-inf`` where not visible.

    ``qk`` is ``q . k``; ``offs_q``/``offs_k`` broadcast to its shape (either orientation);
    ``key0`` is the block's first key.
    With ``SOFTCAP``, ``qk_scale = softmax_scale / softcap`` and ``softcap2 = softcap * log2(e)``.
    Also returns ``tanh`` of the capped scores (the backward's chain rule needs it), else ``s``.
    """
    if SOFTCAP:
        t = tanh(qk * qk_scale, FAST_TANH)
        s = softcap2 * t
    else:
        s = qk * qk_scale
        t = s
    if ALIBI:
        # The bias grows with the distance from the (bottom-right aligned) diagonal. Row and column
        # terms scaled once per block make it one subtract per element (and the |.| a free operand
        # modifier); counting both from the block's first key keeps them small, so near the
        # diagonal the rounding stays far below bf16's.
        rows = slope2 * (offs_q + (seqlen_k - seqlen_q) - key0).to(tl.float32)
        cols = slope2 * (offs_k - key0).to(tl.float32)
        s -= tl.abs(rows - cols)
    if BIAS != "":
        in_range = (offs_q < seqlen_q) & (offs_k < seqlen_k)
        ptrs = bias_ptrs(bias_base, offs_q, offs_k, stride_bm, stride_bn)
        if BIAS == "add":
            s += tl.load(ptrs, mask=in_range, other=0.0).to(tl.float32) * LOG2E
        else:
            s = tl.where(tl.load(ptrs, mask=in_range, other=0) != 0, s, float("-inf"))
    if MASK:
        s = tl.where(visible(offs_q, offs_k, seqlen_q, seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT),
                     s, float("-inf"))
    return s, t


@triton.jit
def softmax_step(qk, s, m_i, qk_scale, MODIFIED: tl.constexpr, P_LOG2: tl.constexpr = 0.0):
    """One key block of the online softmax: ``(p, alpha, m_new)``, the block's probabilities under the
    new running row max and the factor that rescales what was accumulated under the old one.

    With ``MODIFIED`` ``s`` holds the finished log2 scores (masked pairs ``-inf``); otherwise the
    scores are ``qk * qk_scale``, scaled here inside the max and the exp2 (one FMA per element).
    ``P_LOG2``: p comes out times ``2**P_LOG2`` (an FP8 operand's range) from the row term the exp2 subtracts
    anyway, so the scale costs no multiply an element."""
    if MODIFIED:
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_ij_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - shift_max(m_ij_safe, P_LOG2)[:, None])
        alpha = tl.math.exp2(m_i - m_ij_safe)
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - shift_max(m_ij, P_LOG2)[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
    return p, alpha, m_ij


@triton.jit
def shift_max(m, P_LOG2: tl.constexpr):
    """The row term ``m - P_LOG2`` of a scaled exp2 (``m`` itself without a scale)."""
    if P_LOG2 != 0.0:
        return m - P_LOG2
    else:
        return m


@triton.jit
def dropout_keep(seed, offset, bh, offs_m, start_n, threshold, BLOCK_N: tl.constexpr):
    """Dropout's keep mask for rows ``offs_m`` x keys ``start_n + arange(BLOCK_N)`` (a multiple of 4).

    Philox on counters (key // 4, query, batch x head, call offset) yields four words, one for
    each of 4 adjacent keys: the same function :mod:`flashtile.rng` computes in torch.
    """
    quads = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    rows = offs_m[:, None] + quads[None, :] * 0
    cols = quads[None, :] + offs_m[:, None] * 0
    w0, w1, w2, w3 = tl.philox(seed, cols, rows, rows * 0 + bh, rows * 0 + offset)
    # Interleave the words so key 4c + w reads word w of counter c.
    bits = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [offs_m.shape[0], BLOCK_N])
    # The top 31 bits as a non-negative int, compared with dropout_p * 2**31.
    return (bits >> 1).to(tl.int32) >= threshold


@triton.jit
def merge_state(o_a, lse_a, o_b, lse_b):
    """The attention over the union of two disjoint key sets from each set's normalised output
    ``o`` ``[rows, d]`` and natural-log lse ``[rows]`` (float32): split-KV's combine and
    :func:`flashtile.merge_states` alike. A set with lse ``-inf`` (no key) contributes nothing,
    whatever its ``o`` holds; both ``-inf`` gives ``o = 0``, ``lse = -inf``."""
    m = tl.maximum(lse_a, lse_b)
    # Both empty: subtract 0 so the weights are exp(-inf) = 0, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.math.exp2((lse_a - m) * LOG2E)
    w_b = tl.math.exp2((lse_b - m) * LOG2E)
    total = w_a + w_b
    seen = total > 0.0
    inv = 1.0 / tl.where(seen, total, 1.0)
    o = (tl.where(w_a[:, None] > 0.0, o_a * (w_a * inv)[:, None], 0.0)
         + tl.where(w_b[:, None] > 0.0, o_b * (w_b * inv)[:, None], 0.0))
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    return o, lse
