"""The FP8 quantizer: 16-bit q, k, v -> e4m3 with descales, in one launch (the statement of what it computes
is ``flashtile/backends/torch_fp8.py``).

Program ``(block, b, head)`` takes ``BLOCK`` rows of one head of one sequence: heads ``[0, nheads)`` are q's,
heads ``[nheads, nheads + nheads_kv)`` are a KV head's k and v. A block is read twice: once for its amax (after
the Hadamard rotation, for q and k), once to scale, saturate, cast and store; the rotation is one ``tl.dot``
with the +-1 matrix ``diag(signs) H`` per ``CHUNK`` output columns, scaled by ``1 / sqrt(HEAD_DIM)`` in fp32.
v is stored transposed, ``(batch, nheads_kv, HEAD_DIM, seqlen_k)``, the layout of the FP8 PV product.
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
def _quantize_block(X, X8, DESCALE, R, row0, n_rows, stride_xm, stride_8m, stride_8d, inv_sqrt_d,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                    ROTATE: tl.constexpr, SCALE_GIVEN: tl.constexpr, AMAX_ONLY: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    """Quantize rows ``row0 : min(row0 + BLOCK, n_rows)`` of X (row ``m`` at ``X + m * stride_xm``, unit column
    stride) into X8 (element ``(m, d)`` at ``X8 + m * stride_8m + d * stride_8d``). ``DESCALE`` points at this
    block's descale: read when ``SCALE_GIVEN``, else written as ``amax / 448`` (1 for an all-zero block);
    ``AMAX_ONLY`` writes the amax there and stores nothing else (the first pass of per-tensor scaling)."""
    if SCALE_GIVEN:
        descale = tl.load(DESCALE)
    else:
        amax = _block_pass(X, X8, R, row0, n_rows, stride_xm, stride_8m, stride_8d, inv_sqrt_d, 0.0,
                           HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, False, INPUT_PRECISION)
        if AMAX_ONLY:
            tl.store(DESCALE, amax)
            return
        descale = tl.where(amax > 0.0, amax / FP8_MAX, 1.0)
        tl.store(DESCALE, descale)
    _block_pass(X, X8, R, row0, n_rows, stride_xm, stride_8m, stride_8d, inv_sqrt_d, descale,
                HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, True, INPUT_PRECISION)


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
                 seqlen_q, seqlen_k, total_q, total_k, nheads, inv_sqrt_d,
                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNK: tl.constexpr,
                 ROTATE: tl.constexpr, SCALE_GIVEN: tl.constexpr, AMAX_ONLY: tl.constexpr, VARLEN: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """Descales are indexed ``(b, head, block)`` by their strides (a per-tensor descale comes with a block stride
    of 0). ``VARLEN``: the rows of sequence ``b`` start at ``cu_seqlens[b]`` of packed tensors (batch strides 0)
    and blocks count from that start."""
    blk = tl.program_id(0)
    off_b = tl.program_id(1)
    head = tl.program_id(2)
    # Offsets clamped inside the packed rows (total_q / total_k) whatever they hold; the attention records them.
    q_start, seqlen_q, k_start, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                    CU_SEQLENS_Q, total_q, total_k, CU_SEQLENS_Q, VARLEN, False, False)
    off_b = off_b.to(tl.int64)
    if head < nheads:
        if blk * BLOCK < tl.maximum(seqlen_q, 1):
            _quantize_block(Q + off_b * stride_qb + head * stride_qh + q_start.to(tl.int64) * stride_qm,
                            Q8 + off_b * stride_q8b + head * stride_q8h + q_start.to(tl.int64) * stride_q8m,
                            Q_DESCALE + off_b * stride_qdb + head * stride_qdh + blk * stride_qdm, R,
                            blk * BLOCK, seqlen_q, stride_qm, stride_q8m, 1, inv_sqrt_d,
                            HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, SCALE_GIVEN, AMAX_ONLY, INPUT_PRECISION)
    else:
        head_kv = head - nheads
        if blk * BLOCK < tl.maximum(seqlen_k, 1):
            _quantize_block(K + off_b * stride_kb + head_kv * stride_kh + k_start.to(tl.int64) * stride_km,
                            K8 + off_b * stride_k8b + head_kv * stride_k8h + k_start.to(tl.int64) * stride_k8m,
                            K_DESCALE + off_b * stride_kdb + head_kv * stride_kdh + blk * stride_kdm, R,
                            blk * BLOCK, seqlen_k, stride_km, stride_k8m, 1, inv_sqrt_d,
                            HEAD_DIM, BLOCK, SUB, CHUNK, ROTATE, SCALE_GIVEN, AMAX_ONLY, INPUT_PRECISION)
            # v: never rotated; its rows become the columns of VT8.
            _quantize_block(V + off_b * stride_vb + head_kv * stride_vh + k_start.to(tl.int64) * stride_vm,
                            VT8 + off_b * stride_vtb + head_kv * stride_vth + k_start.to(tl.int64) * stride_vtm,
                            V_DESCALE + off_b * stride_vdb + head_kv * stride_vdh + blk * stride_vdm, R,
                            blk * BLOCK, seqlen_k, stride_vm, stride_vtm, stride_vtd, inv_sqrt_d,
                            HEAD_DIM, BLOCK, SUB, CHUNK, False, SCALE_GIVEN, AMAX_ONLY, INPUT_PRECISION)
