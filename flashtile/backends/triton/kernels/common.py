"""Index and mask helpers shared by every attention kernel.

Causal attention is aligned bottom-right: query ``i`` sees key ``j`` iff
``j <= i + seqlen_k - seqlen_q``. Blocks are visited in two kinds of loops: *full*
blocks where every (query, key) pair is visible and in range (no mask needed), and
*masked* blocks on the diagonal or the sequence boundary.
"""
import triton
import triton.language as tl


@triton.jit
def int64(stride_b, stride_m, stride_h):
    """A tensor's (batch, seq, head) strides as int64, so offsets past 2**31 elements do not wrap."""
    return tl.cast(stride_b, tl.int64), tl.cast(stride_m, tl.int64), tl.cast(stride_h, tl.int64)


@triton.jit
def query_program(nheads, group, IS_CAUSAL: tl.constexpr):
    """This program's query block, batch, query head, KV head, and ``batch * nheads + head``."""
    start_m = tl.program_id(0)
    if IS_CAUSAL:
        # Causal rows near the end visit the most keys: launch them first for a shorter tail.
        start_m = tl.num_programs(0) - 1 - start_m
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    return start_m, off_b, off_h, off_h // group, off_b * nheads + off_h


@triton.jit
def tile_ptrs(base, off_b, off_h, stride_b, stride_h, offs_rows, stride_rows, offs_d):
    """Pointers to rows ``offs_rows`` x columns ``offs_d`` of head ``off_h`` in batch ``off_b``."""
    return base + off_b * stride_b + off_h * stride_h + offs_rows[:, None] * stride_rows + offs_d[None, :]


@triton.jit
def visible(offs_q, offs_k, seqlen_q, seqlen_k, IS_CAUSAL: tl.constexpr):
    """Which (query, key) pairs attend. ``offs_q`` and ``offs_k`` broadcast against each other."""
    mask = offs_k < seqlen_k
    if IS_CAUSAL:
        mask = mask & (offs_k <= offs_q + (seqlen_k - seqlen_q))
    return mask


@triton.jit
def kv_block_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Keys visited by query block ``start_m``: ``[0, n_full)`` unmasked, then ``[n_full, n_end)`` masked."""
    # Every full key block lies below the sequence end.
    n_full = seqlen_k // BLOCK_N * BLOCK_N
    n_end = seqlen_k
    if IS_CAUSAL:
        diag = seqlen_k - seqlen_q
        # The block's first row sees keys j <= start_m * BLOCK_M + diag: blocks wholly below that need no mask.
        n_full = tl.minimum(n_full, tl.maximum(start_m * BLOCK_M + diag + 1, 0) // BLOCK_N * BLOCK_N)
        # The block's last row sees nothing past (start_m + 1) * BLOCK_M - 1 + diag: later blocks are skipped.
        n_end = tl.minimum(seqlen_k, tl.maximum((start_m + 1) * BLOCK_M + diag, 0))
    return n_full, n_end


@triton.jit
def q_block_range(start_n, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Queries that see key block ``start_n``: ``[m_start, m_full)`` masked, then ``[m_full, seqlen_q)`` unmasked."""
    m_start = 0
    m_full = 0
    if IS_CAUSAL:
        diag = seqlen_k - seqlen_q
        # Query i sees key j iff i >= j - diag: earlier query blocks see nothing of this key block.
        m_start = tl.maximum(start_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
        # Queries from the block's last key on see the whole block.
        m_full = tl.maximum((start_n + 1) * BLOCK_N - 1 - diag, 0)
        m_full = tl.maximum(m_start, tl.cdiv(m_full, BLOCK_M) * BLOCK_M)
        # Never walk query blocks past the sequence: their rows would be read unmasked.
        m_full = tl.minimum(m_full, tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M)
    return m_start, m_full


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
