"""The FP8 quantizer: 16-bit q, k, v -> e4m3 with descales (the statement of what it computes is
``flashtile/backends/torch_fp8.py``).

Program ``(block, b, head)`` takes ``BLOCK`` rows of one sequence: heads ``[0, nheads_kv)`` are q's, each the
query heads of one KV group (they share a block's scale); heads ``[nheads_kv, 2 nheads_kv)`` are a KV head's k
and v. What a launch does with q and k (``QK_MODE``) and with v (``V_MODE``): ``"amax"`` writes each block's
amax and stores nothing else, ``"compute"`` writes the descale ``amax / 448`` and casts, ``"given"`` reads the
descale and casts, ``"skip"`` does nothing. A block is read twice when it computes its scale (its amax, then the
cast); the rotation is one ``tl.dot`` with the +-1 matrix ``diag(signs) H`` per ``CHUNK`` output columns, scaled
by ``1 / sqrt(HEAD_DIM)`` in fp32. v is stored transposed, ``(batch, nheads_kv, HEAD_DIM, seqlen_k)``, the
layout of the FP8 PV product.
"""
import triton
import triton.language as tl

from .common import sequence

# The largest finite e4m3 value.
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _columns(X_ROWS, R, row_ok, c0, inv_sqrt_d,
             HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, ROTATE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Columns ``c0 : c0 + CHUNK`` of the (rotated) rows at ``X_ROWS`` (a ``[SUB, 1]`` block of row pointers), fp32."""
    offs_c = c0 + tl.arange(0, CHUNK)
    if ROTATE:
        offs_d = tl.arange(0, HEAD_DIM)
        x = tl.load(X_ROWS + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        # R holds +-1 in x's dtype (exact): the dot sums signed inputs in fp32, then one scale makes it orthonormal.
        r = tl.load(R + offs_d[:, None] * HEAD_DIM + offs_c[None, :])
        return tl.dot(x, r, input_precision=INPUT_PRECISION) * inv_sqrt_d
    return tl.load(X_ROWS + offs_c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _quantize_block(X, X8, DESCALE, R, row0, n_rows, heads, stride_xm, stride_xh, stride_8m, stride_8h, stride_8d,
                    inv_sqrt_d, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                    ROTATE: tl.constexpr, MODE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Quantize rows ``row0 : min(row0 + BLOCK, n_rows)`` of ``heads`` heads of X (row ``m`` of head ``h`` at
    ``X + m * stride_xm + h * stride_xh``, unit column stride) into X8 (element ``(m, h, d)`` at
    ``X8 + m * stride_8m + h * stride_8h + d * stride_8d``), all under the one descale at ``DESCALE``: read with
    ``MODE`` "given"; else the heads' amax is taken first and written ("amax", which stores nothing else), or
    its descale ``amax / 448`` (1 for an all-zero block) is written ("compute")."""
    if MODE == "given":
        descale = tl.load(DESCALE)
    else:
        amax = 0.0
        for h in range(heads):
            amax = tl.maximum(amax, _block_pass(X + h * stride_xh, X8, R, row0, n_rows, stride_xm, stride_8m,
                                                stride_8d, inv_sqrt_d, 0.0, HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE,
                                                False, INPUT_PRECISION))
        if MODE == "amax":
            tl.store(DESCALE, amax)
            return
        descale = tl.where(amax > 0.0, amax / FP8_MAX, 1.0)
        tl.store(DESCALE, descale)
    for h in range(heads):
        _block_pass(X + h * stride_xh, X8 + h * stride_8h, R, row0, n_rows, stride_xm, stride_8m, stride_8d,
                    inv_sqrt_d, descale, HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, True, INPUT_PRECISION)


@triton.jit
def _block_pass(X, X8, R, row0, n_rows, stride_xm, stride_8m, stride_8d, inv_sqrt_d, descale,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                ROTATE: tl.constexpr, STORE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One pass over the block's (rotated) values, ``SUB`` rows by ``CHUNK`` columns at a time: returns their amax,
    and with ``STORE`` writes them divided by ``descale``, saturated and cast."""
    offs_s = tl.arange(0, SUB)
    amax = 0.0
    for m0 in range(0, BLOCK, SUB):
        rows = row0 + m0 + offs_s
        row_ok = rows < n_rows
        for c0 in range(0, HEAD_DIM, CHUNK):
            y = _columns(X + rows[:, None].to(tl.int64) * stride_xm, R, row_ok, c0, inv_sqrt_d,
                         HEAD_DIM, CHUNK, ROTATE, INPUT_PRECISION)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), 1), 0))
            if STORE:
                # Saturate: e4m3 has no infinity, and a value past 448 would become NaN.
                y = tl.minimum(tl.maximum(tl.math.div_rn(y, descale), -FP8_MAX), FP8_MAX)
                offs_c = c0 + tl.arange(0, CHUNK)
                dst = X8 + rows[:, None].to(tl.int64) * stride_8m + offs_c[None, :].to(tl.int64) * stride_8d
                tl.store(dst, y.to(X8.dtype.element_ty), mask=row_ok[:, None])
    return amax


@triton.jit
def quantize_fp8(Q, K, V, Q8, K8, VT8, Q_DESCALE, K_DESCALE, V_DESCALE, R, CU_SEQLENS_Q, CU_SEQLENS_K,
                 stride_qb, stride_qm, stride_qh, stride_kb, stride_km, stride_kh, stride_vb, stride_vm, stride_vh,
                 stride_q8b, stride_q8m, stride_q8h, stride_k8b, stride_k8m, stride_k8h,
                 stride_vtb, stride_vth, stride_vtd, stride_vtm,
                 stride_qdb, stride_qdh, stride_qdm, stride_kdb, stride_kdh, stride_kdm, stride_vdb, stride_vdh, stride_vdm,
                 seqlen_q, seqlen_k, total_q, total_k, nheads_kv, group, inv_sqrt_d,
                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                 ROTATE: tl.constexpr, QK_MODE: tl.constexpr, V_MODE: tl.constexpr, VARLEN: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """Descales are indexed ``(b, kv_head, block)`` by their strides (a per-tensor descale comes with a block
    stride of 0); q's query heads ``[g * group, (g + 1) * group)`` share KV head ``g``'s. ``VARLEN``: the rows of
    sequence ``b`` start at ``cu_seqlens[b]`` of packed tensors (batch strides 0) and blocks count from that
    start."""
    blk = tl.program_id(0)
    off_b = tl.program_id(1)
    head = tl.program_id(2)
    # Offsets clamped inside the packed rows (total_q / total_k) whatever they hold; the attention records them.
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                    CU_SEQLENS_Q, total_q, total_k, CU_SEQLENS_Q, VARLEN, False, False)
    off_b = off_b.to(tl.int64)
    if head < nheads_kv:
        if QK_MODE != "skip":
            if blk * BLOCK < tl.maximum(seqlen_q, 1):
                q_head = head * group
                _quantize_block(Q + off_b * stride_qb + q_head * stride_qh + q_start.to(tl.int64) * stride_qm,
                                Q8 + off_b * stride_q8b + q_head * stride_q8h + q_start.to(tl.int64) * stride_q8m,
                                Q_DESCALE + off_b * stride_qdb + head * stride_qdh + blk * stride_qdm, R,
                                blk * BLOCK, seqlen_q, group, stride_qm, stride_qh, stride_q8m, stride_q8h, 1,
                                inv_sqrt_d, HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, QK_MODE, INPUT_PRECISION)
    else:
        head_kv = head - nheads_kv
        if blk * BLOCK < tl.maximum(seqlen_k, 1):
            if QK_MODE != "skip":
                _quantize_block(K + off_b * stride_kb + head_kv * stride_kh + k_start.to(tl.int64) * stride_km,
                                K8 + off_b * stride_k8b + head_kv * stride_k8h + k_start.to(tl.int64) * stride_k8m,
                                K_DESCALE + off_b * stride_kdb + head_kv * stride_kdh + blk * stride_kdm, R,
                                blk * BLOCK, seqlen_k, 1, stride_km, 0, stride_k8m, 0, 1, inv_sqrt_d,
                                HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, QK_MODE, INPUT_PRECISION)
            if V_MODE != "skip":
                # v: never rotated; its rows become the columns of VT8.
                _quantize_block(V + off_b * stride_vb + head_kv * stride_vh + k_start.to(tl.int64) * stride_vm,
                                VT8 + off_b * stride_vtb + head_kv * stride_vth + k_start.to(tl.int64) * stride_vtm,
                                V_DESCALE + off_b * stride_vdb + head_kv * stride_vdh + blk * stride_vdm, R,
                                blk * BLOCK, seqlen_k, 1, stride_vm, 0, stride_vtm, 0, stride_vtd, inv_sqrt_d,
                                HEAD_DIM, BLOCK, SUB, CHUNK, False, V_MODE, INPUT_PRECISION)
