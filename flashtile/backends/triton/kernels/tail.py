"""Rows of a packed (varlen) tensor past the last sequence belong to no sequence: this kernel
gives them their value (0 for outputs and gradients, ``-inf`` for lse), so the launchers never
clear a whole tensor just to cover a tail that is usually empty."""
import triton
import triton.language as tl


@triton.jit
def fill_tail(X, LSE, CU_SEQLENS, batch, total, stride_row, stride_h, nheads, head_dim, value, stride_lse_h,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, HAS_LSE: tl.constexpr):
    """Set rows ``cu_seqlens[batch]:total`` of ``X`` ``(total, nheads, head_dim)`` (unit stride on the
    last dim) to ``value``, and with ``HAS_LSE`` the same columns of a forward's ``LSE`` ``(nheads, total)``
    (unit stride on the tokens) to ``-inf``. One program per ``BLOCK_R`` rows; those before the tail exit
    at once."""
    first = tl.load(CU_SEQLENS + batch)
    start = tl.program_id(0) * BLOCK_R
    if start + BLOCK_R <= first:
        return
    rows = start + tl.arange(0, BLOCK_R)
    in_tail = (rows >= first) & (rows < total)
    width = nheads * head_dim
    for col0 in range(0, width, BLOCK_C):
        # Columns run over (head, feature) pairs: a row's heads may lie apart (packed qkv views).
        cols = col0 + tl.arange(0, BLOCK_C)
        ptrs = (X + tl.cast(rows, tl.int64)[:, None] * stride_row + (cols // head_dim)[None, :] * stride_h
                + (cols % head_dim)[None, :])
        tile = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32) + value
        tl.store(ptrs, tile.to(X.dtype.element_ty), mask=in_tail[:, None] & (cols < width)[None, :])
    if HAS_LSE:
        heads = tl.arange(0, BLOCK_H)
        lse_ptrs = LSE + tl.cast(heads, tl.int64)[None, :] * stride_lse_h + rows[:, None]
        tl.store(lse_ptrs, tl.full([BLOCK_R, BLOCK_H], float("-inf"), tl.float32),
                 mask=in_tail[:, None] & (heads < nheads)[None, :])
