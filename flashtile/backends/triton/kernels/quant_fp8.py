"""The FP8 quantizer: 16-bit q, k, v -> e4m3 with descales (the statement of what it computes is
``flashtile/backends/torch_fp8.py``).

Program ``(p, b, head)`` takes ``tiles`` blocks of ``BLOCK`` rows of one sequence in turn: heads ``[0, nheads_kv)``
are q's, each the query heads of one KV group (they share a block's scale), then k's heads, then v's (v's alone when
q and k are skipped). Its block loop is software-pipelined (``STAGES``): the next blocks' tiles are copied into
shared memory while one is rotated and cast; v's cast loads its next block into registers instead
(:func:`_cast_v_blocks`). What a launch does with q and k (``QK_MODE``) and with v (``V_MODE``): ``"amax"`` writes
each block's amax and stores nothing else, ``"compute"`` writes the descale ``amax / 448`` and casts, ``"given"``
reads the descale and casts, ``"reduce"`` (v only) takes its descale from the "amax" launch's block amaxes and
casts, ``"skip"`` does nothing. The rotation of a ``(BLOCK, HEAD_DIM)`` tile by the +-1 matrix ``diag(signs) H`` is
two ``tl.dot``s of half its width with two quadrants of the matrix (loaded once a program; :func:`_block_values`),
scaled by ``1 / sqrt(HEAD_DIM)`` in fp32; a one-head block (k, MHA's q) is read once: its amax and its cast come
from the same registers. The query heads of a GQA group are read twice (their amax, then the cast). v is stored
transposed, ``(batch, nheads_kv, HEAD_DIM, seqlen_k)`` (packed: ``(nheads_kv, HEAD_DIM, columns)``, sequence b's
keys from column ``common.packed_vt_start``), the layout of the FP8 PV product: the tile is transposed in registers
so that each row of VT8 (consecutive keys) is written contiguously.
"""
import triton
import triton.language as tl

from .common import packed_vt_start, sequence

# The largest finite e4m3 value.
FP8_MAX = tl.constexpr(448.0)
# Descales below 2^-64 (a block's amax under about 2.4e-17) are scaled up before _divide's reciprocal.
MIN_FAST_DESCALE = tl.constexpr(2.0 ** -64)


@triton.jit
def _load_block(X, rows, row_ok, stride_xm, COLS: tl.constexpr):
    """The ``(BLOCK, COLS)`` rows ``rows`` of X in its dtype, 0 where not ``row_ok``; ``rows`` count from X's
    block (32-bit offsets: a block loop's offsets stay in registers, not spilled as 64-bit pointers)."""
    offs_d = tl.arange(0, COLS)
    return tl.load(X + rows[:, None] * stride_xm + offs_d[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _block_values(X, r, rows, row_ok, stride_xm, inv_sqrt_d,
                  HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """The fp32 values of ``rows`` of X (rotated with ``ROTATE`` by ``r``, :func:`_rotation`'s quadrants), 0 where
    not ``row_ok``, as their two ``(BLOCK, HEAD_DIM // 2)`` column halves.

    ``R = diag(signs) H`` with Sylvester's ``H = [[H', H'], [H', -H']]``: R's right half is its left half with the
    bottom quadrant negated, so ``x R = [a + b, a - b]`` with ``a = x_lo R_top``, ``b = x_hi R_bottom``: two
    products of half the width, half the dense product's FLOPs and half its matrix in shared memory."""
    HALF: tl.constexpr = HEAD_DIM // 2
    x_lo = _load_block(X, rows, row_ok, stride_xm, HALF)
    x_hi = _load_block(X + HALF, rows, row_ok, stride_xm, HALF)
    if ROTATE:
        r_top, r_bottom = r
        # r holds +-1 in x's dtype (exact): the dots sum signed inputs in fp32, then one scale makes it orthonormal.
        a = tl.dot(x_lo, r_top, input_precision=INPUT_PRECISION)
        b = tl.dot(x_hi, r_bottom, input_precision=INPUT_PRECISION)
        return (a + b) * inv_sqrt_d, (a - b) * inv_sqrt_d
    return x_lo.to(tl.float32), x_hi.to(tl.float32)


@triton.jit
def _halves_amax(y_lo, y_hi):
    """The largest magnitude in a block's two column halves (one reduction across the warps, not two: the halves
    share a layout)."""
    return tl.max(tl.maximum(tl.abs(y_lo), tl.abs(y_hi)))


@triton.jit
def _store_halves(X8, y_lo, y_hi, descale, rows, store_ok, stride_8m, stride_8d, HEAD_DIM: tl.constexpr,
                  TRANSPOSED: tl.constexpr, FMA: tl.constexpr):
    """:func:`_store_block` of a block's two column halves (:func:`_block_values`)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    _store_block(X8, y_lo, descale, rows, store_ok, stride_8m, stride_8d, HALF, TRANSPOSED, FMA)
    _store_block(X8 + HALF * stride_8d, y_hi, descale, rows, store_ok, stride_8m, stride_8d, HALF, TRANSPOSED, FMA)


@triton.jit
def _store_block(X8, y, descale, rows, store_ok, stride_8m, stride_8d, COLS: tl.constexpr,
                 TRANSPOSED: tl.constexpr, FMA: tl.constexpr):
    """``y / descale``, saturated and cast, into the rows ``rows`` of X8 where ``store_ok`` (element ``(m, d)`` at
    ``X8 + m * stride_8m + d * stride_8d``; ``TRANSPOSED``: ``stride_8m`` is 1, and the tile is written as
    ``(COLS, BLOCK)``); ``rows`` count from X8's block, as :func:`_load_block`'s."""
    # Saturate: e4m3 has no infinity, and a value past 448 would become NaN.
    y8 = tl.minimum(tl.maximum(_divide(y, descale, FMA), -FP8_MAX), FP8_MAX).to(X8.dtype.element_ty)
    offs_d = tl.arange(0, COLS)
    if TRANSPOSED:
        # Keys along the fastest dim of the stored tile: each VT8 row is one contiguous run of BLOCK bytes.
        tl.store(X8 + offs_d[:, None] * stride_8d + rows[None, :], tl.trans(y8), mask=store_ok[None, :])
    else:
        tl.store(X8 + rows[:, None] * stride_8m + offs_d[None, :], y8, mask=store_ok[:, None])


@triton.jit
def _divide(y, descale, FMA: tl.constexpr):
    """``y / descale`` correctly rounded (torch's division) for a tile ``y`` and one scalar ``descale``.

    div.rn costs ~12 instructions an element (a reciprocal, its refinement, a range check and a call); here the
    quotient by the correctly rounded reciprocal ``r`` is corrected once by its exact remainder (Markstein's
    theorem: ``q + r * (y - q * descale)`` rounds to ``y / descale``), 4 instructions. The theorem needs the
    reciprocal finite and the remainder clear of underflow: a tiny descale (a block of values under ~1e-17)
    and its tile are first scaled by 2^64, exactly, which leaves the quotient as it is. Quotients must be
    finite (a quantizer's are at most about 448). Without ``FMA`` (Triton's interpreter, whose fma rounds twice)
    it is div.rn."""
    if not FMA:
        return tl.math.div_rn(y, descale)
    scale = tl.where(descale < MIN_FAST_DESCALE, 2.0 ** 64, 1.0)
    descale = descale * scale
    y = y * scale
    r = tl.math.div_rn(1.0, descale)
    q = y * r
    return tl.math.fma(tl.math.fma(-q, descale, y), r, q)


@triton.jit
def _block_scale(DESCALE, amax, MODE: tl.constexpr):
    """Writes ``amax`` ("amax") or the descale ``amax / 448`` (1 for an all-zero block) to DESCALE; returns it."""
    if MODE == "amax":
        tl.store(DESCALE, amax)
        return amax
    descale = _descale_of(amax)
    tl.store(DESCALE, descale)
    return descale


@triton.jit
def _descale_of(amax):
    """``amax / 448`` correctly rounded (IEEE division, as the twin's descale_of), 1 for an all-zero block."""
    return tl.where(amax > 0.0, tl.math.div_rn(amax, FP8_MAX), 1.0)


@triton.jit
def _reduced_descale(AMAX, n_blocks, BLOCK: tl.constexpr):
    """The descale of the largest of the ``n_blocks`` block amaxes at AMAX (unit stride)."""
    amax = 0.0
    for b0 in range(0, n_blocks, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.max(tl.load(AMAX + offs, mask=offs < n_blocks, other=0.0)))
    return _descale_of(amax)


@triton.jit
def _rotation(R, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr):
    """With ``ROTATE``, the top and bottom quadrants of the left half of the ``(HEAD_DIM, HEAD_DIM)`` +-1 matrix at
    R (what :func:`_block_values` multiplies by), loaded once a program; R itself without."""
    r = R
    if ROTATE:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs = tl.arange(0, HALF)
        top = R + offs[:, None] * HEAD_DIM + offs[None, :]
        r = (tl.load(top), tl.load(top + HALF * HEAD_DIM))
    return r


@triton.jit
def _quantize_block(X, X8, DESCALE, r, row0, n_rows, n_stored, heads, stride_xm, stride_xh, stride_8m, stride_8h,
                    stride_8d, inv_sqrt_d, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr,
                    MODE: tl.constexpr, TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr, FMA: tl.constexpr,
                    STAGES: tl.constexpr):
    """Quantize rows ``row0 : min(row0 + BLOCK, n_rows)`` of ``heads`` heads of X (row ``m`` of head ``h`` at
    ``X + m * stride_xm + h * stride_xh``, unit column stride) into X8 (head ``h`` at ``X8 + h * stride_8h``,
    see :func:`_store_block`), rotated by ``r`` (:func:`_rotation`) with ``ROTATE``, all under the one descale at
    ``DESCALE``: read with ``MODE`` "given"; else the heads' amax is taken first and written ("amax", which stores
    nothing else), or its descale ("compute"). Rows up to ``n_stored`` (at least ``n_rows``) are stored, those
    past ``n_rows`` as 0. A GQA group's loops over its heads are pipelined into ``STAGES`` stages."""
    # The block's own row offsets from pointers moved to its first row.
    X += tl.cast(row0, tl.int64) * stride_xm
    X8 += tl.cast(row0, tl.int64) * stride_8m
    rows = tl.arange(0, BLOCK)
    row_ok = rows < n_rows - row0
    store_ok = rows < n_stored - row0
    if MODE == "given":
        _cast_block(X, X8, tl.load(DESCALE), r, rows, row_ok, store_ok, heads, stride_xm, stride_xh, stride_8m,
                    stride_8h, stride_8d, inv_sqrt_d, HEAD_DIM, ROTATE, TRANSPOSED, INPUT_PRECISION, FMA, STAGES)
    elif heads == 1:
        # One head: its amax and its cast from the same registers, one read of the block.
        y_lo, y_hi = _block_values(X, r, rows, row_ok, stride_xm, inv_sqrt_d, HEAD_DIM, ROTATE, INPUT_PRECISION)
        descale = _block_scale(DESCALE, _halves_amax(y_lo, y_hi), MODE)
        if MODE == "compute":
            _store_halves(X8, y_lo, y_hi, descale, rows, store_ok, stride_8m, stride_8d, HEAD_DIM, TRANSPOSED, FMA)
    else:
        # A GQA group shares the scale: every head's amax first, then every head's cast (a second read).
        amax = 0.0
        for h in tl.range(heads, num_stages=STAGES):
            y_lo, y_hi = _block_values(X + h * stride_xh, r, rows, row_ok, stride_xm, inv_sqrt_d, HEAD_DIM, ROTATE,
                                       INPUT_PRECISION)
            amax = tl.maximum(amax, _halves_amax(y_lo, y_hi))
        descale = _block_scale(DESCALE, amax, MODE)
        if MODE == "compute":
            _cast_block(X, X8, descale, r, rows, row_ok, store_ok, heads, stride_xm, stride_xh, stride_8m,
                        stride_8h, stride_8d, inv_sqrt_d, HEAD_DIM, ROTATE, TRANSPOSED, INPUT_PRECISION, FMA, STAGES)


@triton.jit
def _cast_block(X, X8, descale, r, rows, row_ok, store_ok, heads, stride_xm, stride_xh, stride_8m, stride_8h,
                stride_8d, inv_sqrt_d, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, TRANSPOSED: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, FMA: tl.constexpr, STAGES: tl.constexpr):
    """Each head's (rotated) rows ``rows`` of X, divided by ``descale``, saturated and cast into X8 (a loop of
    ``STAGES`` pipelined stages)."""
    for h in tl.range(heads, num_stages=STAGES):
        y_lo, y_hi = _block_values(X + h * stride_xh, r, rows, row_ok, stride_xm, inv_sqrt_d, HEAD_DIM, ROTATE,
                                   INPUT_PRECISION)
        _store_halves(X8 + h * stride_8h, y_lo, y_hi, descale, rows, store_ok, stride_8m, stride_8d, HEAD_DIM,
                      TRANSPOSED, FMA)


@triton.jit
def _cast_v_blocks(V, VT8, V_DESCALE, descale, blk0, blk1, n_rows, n_stored, stride_vm, stride_vtd, stride_vdm,
                   HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr, FMA: tl.constexpr):
    """Blocks ``[blk0, blk1)`` of v's rows (row ``m`` at ``V + m * stride_vm``, ``n_rows`` of them) cast into the
    columns of VT8 (its row ``d`` at ``VT8 + d * stride_vtd``; columns up to ``n_stored`` stored, 0 past
    ``n_rows``): ``MODE`` "reduce" under ``descale``, "given" under each block's at ``V_DESCALE + blk *
    stride_vdm``. Each block's successor is loaded into registers while it is cast: the transposed store's
    layout change goes through shared memory from registers (the pipeliner's copies straight into shared memory
    leave an unswizzled tile that the transpose reads 2 bytes at a time, 8-way bank conflicts)."""
    limit = tl.minimum(n_rows, blk1 * BLOCK)
    rows = tl.arange(0, BLOCK)
    row0 = blk0 * BLOCK
    x = _load_block(V + tl.cast(row0, tl.int64) * stride_vm, rows, rows < limit - row0, stride_vm, HEAD_DIM)
    for blk in tl.range(blk0, blk1, num_stages=1):
        row0 = blk * BLOCK
        x_next = _load_block(V + tl.cast(row0 + BLOCK, tl.int64) * stride_vm, rows, rows < limit - row0 - BLOCK,
                             stride_vm, HEAD_DIM)
        block_descale = descale
        if MODE == "given":
            block_descale = tl.load(V_DESCALE + blk * stride_vdm)
        _store_block(VT8 + row0, x.to(tl.float32), block_descale, rows, rows < n_stored - row0, 1, stride_vtd,
                     HEAD_DIM, True, FMA)
        x = x_next


@triton.jit
def _past_block_scale(DESCALE, MODE: tl.constexpr):
    """What a block past its sequence's rows holds: amax 0 ("amax"), descale 1 ("compute"), as an empty block's."""
    if MODE == "amax":
        tl.store(DESCALE, 0.0)
    elif MODE == "compute":
        tl.store(DESCALE, 1.0)


@triton.jit
def _zero_rows(X8, row0, row1, heads, stride_8m, stride_8h, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Zeros into rows ``[row0, row1)`` of heads ``[0, heads)`` of X8 (unit column stride); none if empty."""
    offs_d = tl.arange(0, HEAD_DIM)
    zeros = tl.zeros((BLOCK, HEAD_DIM), dtype=X8.dtype.element_ty)
    for m0 in range(row0, row1, BLOCK):
        rows = m0 + tl.arange(0, BLOCK)
        for h in range(heads):
            tl.store(X8 + h * stride_8h + rows[:, None].to(tl.int64) * stride_8m + offs_d[None, :], zeros,
                     mask=rows[:, None] < row1)


@triton.jit
def _zero_columns(VT8, col0, col1, stride_vtd, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Zeros into columns ``[col0, col1)`` of the ``(HEAD_DIM, columns)`` rows of VT8 (unit column stride)."""
    offs_d = tl.arange(0, HEAD_DIM)
    zeros = tl.zeros((HEAD_DIM, BLOCK), dtype=VT8.dtype.element_ty)
    for c0 in range(col0, col1, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        tl.store(VT8 + offs_d[:, None].to(tl.int64) * stride_vtd + cols[None, :], zeros, mask=cols[None, :] < col1)


@triton.jit
def quantize_fp8(Q, K, V, Q8, K8, VT8, Q_DESCALE, K_DESCALE, V_DESCALE, V_AMAX, R, CU_SEQLENS_Q, CU_SEQLENS_K,
                 stride_qb, stride_qm, stride_qh, stride_kb, stride_km, stride_kh, stride_vb, stride_vm, stride_vh,
                 stride_q8b, stride_q8m, stride_q8h, stride_k8b, stride_k8m, stride_k8h,
                 stride_vtb, stride_vth, stride_vtd, stride_vtm,
                 stride_qdb, stride_qdh, stride_qdm, stride_kdb, stride_kdh, stride_kdm, stride_vdb, stride_vdh, stride_vdm,
                 stride_vab, stride_vah,
                 seqlen_q, seqlen_k, total_q, total_k, nheads_kv, group, tiles, inv_sqrt_d,
                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROTATE: tl.constexpr, QK_MODE: tl.constexpr,
                 V_MODE: tl.constexpr, VARLEN: tl.constexpr, STAGES: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 FMA: tl.constexpr):
    """Program ``(p, b, head)`` takes blocks ``[p * tiles, (p + 1) * tiles)`` of sequence ``b``, one after the
    other (with ``STAGES`` > 2, the next blocks' tiles copied while one is rotated and cast); heads ``[0, nheads_kv)``
    are q's KV groups, ``[nheads_kv, 2 nheads_kv)`` k's heads and ``[2 nheads_kv, 3 nheads_kv)`` v's (with
    ``QK_MODE`` "skip" the grid holds v's programs only, from head 0). Descales are indexed ``(b, kv_head,
    block)`` by their strides (a per-tensor descale comes with a block stride of 0); q's query heads
    ``[g * group, (g + 1) * group)`` share KV head ``g``'s. ``VARLEN``: the rows of sequence ``b`` start at
    ``cu_seqlens[b]`` of packed tensors (batch strides 0) and blocks count from that start. VT8's key stride
    ``stride_vtm`` is 1 and its row pitch ``stride_vtd`` a multiple of 16, past the last key (the host's
    ``tma_rows``). ``V_MODE`` "reduce": v's descale (one per (b, kv_head)) is that of the largest of its blocks'
    amaxes at V_AMAX (``(b, kv_head, block)``, unit block stride, the "amax" launch's), written by the program of
    the sequence's first block, and v is cast with it.

    Every byte of the outputs is written by the launch that casts (no memset before it), the padding as the FP8
    attention reads it: a sequence's V^T columns up to the next 16-byte boundary (stored with its keys, zero past
    them: the mask then comes in 16-key groups, one vector store each) and, packed, every other column and every
    row outside all sequences as 0, written by the program of the sequence's first block (the first and last
    sequences also those before and after them); blocks of a descale past a short sequence hold amax 0 or
    descale 1."""
    blk0 = tl.program_id(0) * tiles
    off_b = tl.program_id(1)
    head = tl.program_id(2)
    if QK_MODE == "skip":
        # v's programs alone, in the reverse of the order in which the launch before (its amaxes, the last of its
        # programs) read v: the blocks it read last, still in L2, are read first.
        blk0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * tiles
        off_b = tl.num_programs(1) - 1 - off_b
        head = tl.num_programs(2) - 1 - head + 2 * nheads_kv
    # The grid's bounds: blocks of the longest sequence (varlen) or of every one.
    blocks_q = tl.cdiv(tl.maximum(seqlen_q, 1), BLOCK)
    blocks_k = tl.cdiv(tl.maximum(seqlen_k, 1), BLOCK)
    # Offsets clamped inside the packed rows (total_q / total_k) whatever they hold; the attention records them.
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                    CU_SEQLENS_Q, total_q, total_k, CU_SEQLENS_Q, VARLEN, False, False)
    last = off_b == tl.num_programs(1) - 1
    off_b = off_b.to(tl.int64)
    # This program's blocks of the sequence (block 0 even of an empty one: it writes the sequence's scales), and
    # those past its end up to the grid's bound (packed sequences' descales there hold 1, or amax 0).
    end_q = tl.minimum(blk0 + tiles, tl.cdiv(tl.maximum(seqlen_q, 1), BLOCK))
    end_k = tl.minimum(blk0 + tiles, tl.cdiv(tl.maximum(seqlen_k, 1), BLOCK))
    if head < nheads_kv:
        if QK_MODE != "skip":
            q_head = head * group
            q8 = Q8 + off_b * stride_q8b + q_head * stride_q8h
            q_descale = Q_DESCALE + off_b * stride_qdb + head * stride_qdh
            r = _rotation(R, HEAD_DIM, ROTATE)
            for blk in tl.range(blk0, end_q, num_stages=STAGES):
                _quantize_block(Q + off_b * stride_qb + q_head * stride_qh + q_start.to(tl.int64) * stride_qm,
                                q8 + q_start.to(tl.int64) * stride_q8m, q_descale + blk * stride_qdm, r, blk * BLOCK,
                                seqlen_q, seqlen_q, group, stride_qm, stride_qh, stride_q8m, stride_q8h, 1,
                                inv_sqrt_d, HEAD_DIM, BLOCK, ROTATE, QK_MODE, False, INPUT_PRECISION, FMA,
                                STAGES)
            if VARLEN:
                for blk in range(tl.maximum(blk0, end_q), tl.minimum(blk0 + tiles, blocks_q)):
                    _past_block_scale(q_descale + blk * stride_qdm, QK_MODE)
                if (QK_MODE == "compute" or QK_MODE == "given") and blk0 == 0:
                    # Rows before the first sequence and after the last (none for well-formed offsets).
                    _zero_rows(q8, tl.where(off_b == 0, 0, q_start), q_start, group, stride_q8m, stride_q8h,
                               HEAD_DIM, BLOCK)
                    _zero_rows(q8, q_start + seqlen_q, tl.where(last, total_q, 0), group, stride_q8m, stride_q8h,
                               HEAD_DIM, BLOCK)
    elif head < 2 * nheads_kv:
        if QK_MODE != "skip":
            head_kv = head - nheads_kv
            k8 = K8 + off_b * stride_k8b + head_kv * stride_k8h
            k_descale = K_DESCALE + off_b * stride_kdb + head_kv * stride_kdh
            r = _rotation(R, HEAD_DIM, ROTATE)
            for blk in tl.range(blk0, end_k, num_stages=STAGES):
                _quantize_block(K + off_b * stride_kb + head_kv * stride_kh + k_start.to(tl.int64) * stride_km,
                                k8 + k_start.to(tl.int64) * stride_k8m, k_descale + blk * stride_kdm, r, blk * BLOCK,
                                seqlen_k, seqlen_k, 1, stride_km, 0, stride_k8m, 0, 1, inv_sqrt_d, HEAD_DIM, BLOCK,
                                ROTATE, QK_MODE, False, INPUT_PRECISION, FMA, STAGES)
            if VARLEN:
                for blk in range(tl.maximum(blk0, end_k), tl.minimum(blk0 + tiles, blocks_k)):
                    _past_block_scale(k_descale + blk * stride_kdm, QK_MODE)
                if (QK_MODE == "compute" or QK_MODE == "given") and blk0 == 0:
                    _zero_rows(k8, tl.where(off_b == 0, 0, k_start), k_start, 1, stride_k8m, 0, HEAD_DIM, BLOCK)
                    _zero_rows(k8, k_start + seqlen_k, tl.where(last, total_k, 0), 1, stride_k8m, 0, HEAD_DIM,
                               BLOCK)
    elif V_MODE != "skip":
        # v: never rotated; its rows become the columns of VT8.
        head_kv = head - 2 * nheads_kv
        vt8_head = VT8 + off_b * stride_vtb + head_kv * stride_vth
        v_descale = V_DESCALE + off_b * stride_vdb + head_kv * stride_vdh
        # Packed V^T: each sequence's keys from a 16-byte-aligned column (the FP8 attention's TMA reads no other).
        v_start = k_start
        if VARLEN:
            v_start = packed_vt_start(k_start, off_b)
        # V^T columns stored with the keys: up to the 16-byte boundary past them, inside the row pitch.
        v_stored = tl.minimum(tl.cdiv(seqlen_k, 16) * 16, stride_vtd - v_start)
        v = V + off_b * stride_vb + head_kv * stride_vh + k_start.to(tl.int64) * stride_vm
        vt8 = vt8_head + v_start.to(tl.int64) * stride_vtm
        if V_MODE == "reduce" or V_MODE == "given":
            descale = 1.0
            if V_MODE == "reduce":
                # One descale for all of the head's blocks: the largest of their amaxes, reduced once a program.
                descale = _reduced_descale(V_AMAX + off_b * stride_vab + head_kv * stride_vah,
                                           tl.cdiv(tl.maximum(seqlen_k, 1), BLOCK), BLOCK)
                if blk0 == 0:
                    tl.store(v_descale, descale)
            _cast_v_blocks(v, vt8, v_descale, descale, blk0, end_k, seqlen_k, v_stored, stride_vm, stride_vtd,
                           stride_vdm, HEAD_DIM, BLOCK, V_MODE, FMA)
        else:
            # amax (or a descale) per block, nothing transposed: the pipelined loop's copies serve it.
            for blk in tl.range(blk0, end_k, num_stages=STAGES if V_MODE == "amax" else 1):
                _quantize_block(v, vt8, v_descale + blk * stride_vdm, R, blk * BLOCK, seqlen_k, v_stored, 1,
                                stride_vm, 0, 1, 0, stride_vtd, inv_sqrt_d, HEAD_DIM, BLOCK, False, V_MODE, True,
                                INPUT_PRECISION, FMA, 1)
        if VARLEN:
            for blk in range(tl.maximum(blk0, end_k), tl.minimum(blk0 + tiles, blocks_k)):
                _past_block_scale(v_descale + blk * stride_vdm, V_MODE)
            if (V_MODE == "reduce" or V_MODE == "given") and blk0 == 0:
                # The columns from this sequence's stored ones to the next sequence's first (the last: to the
                # row's end), and those before the first sequence.
                next_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + off_b + 1), 0), total_k)
                v_end = tl.where(last, stride_vtd, tl.minimum(packed_vt_start(next_start, off_b + 1), stride_vtd))
                _zero_columns(vt8_head, v_start + v_stored, v_end, stride_vtd, HEAD_DIM, BLOCK)
                _zero_columns(vt8_head, 0, tl.where(off_b == 0, v_start, 0), stride_vtd, HEAD_DIM, BLOCK)
