"""Hopper forward on FP8 inputs (FlashAttention-3's FP8 half): the warp-specialized kernel of fwd_sm90_ws.py
with float8_e4m3fn Q, K and V and its ``FP8`` switch on.

Per 128-row tile, as there: a producer warp streams K_j and V_j through the TMA, two consumer warpgroups of
64 query rows (three over 192 rows with fp8.Fp8Tile.consumers = 3, off by default) each run

    S = Q8 K8^T                  FP8 wgmma, float32 scores
    s = S * q_descale * k_descale * softmax_scale * log2(e)     (or through softcap's tanh)
    online softmax (m_i, l_i) in float32, l_i summing the float32 P
    P8 = e4m3(P * 448)           P <= 1, so 448 (e4m3's largest value) uses the format's whole range
    O += P8 V8                   FP8 wgmma, P8 the register operand (TWO_LEVEL: each block's P8 V8 from zero,
                                 added to O in float32: the tensor cores add FP8 products in ~13 mantissa bits)
    out = O / l_i * v_descale / 448   -> bf16, lse = (m_i + log2 l_i) * ln 2 as the bf16 forward stores it

FP8 wgmma reads both shared-memory operands K-major (the reduced dimension contiguous): K's rows already are
for S = Q K^T, but P V reduces over keys, so V arrives transposed, ``(batch, heads_kv, headdim, seqlen_k)``
with the keys contiguous (the quantize step writes it that way). The descales are FlashAttention-3's: one
float32 per (batch row, KV head) for each of Q, K and V; Q's and K's may also come per block of 128
rows (block quantization: a tile's Q rows share one, a key block takes its keys' one as it is read). Without a fixed row max: softcap's bound would leave
P far below 1 where every score is small, under e4m3's smallest values.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fwd_sm90_ws import DESCALE_BLOCK, run_partitions


# Lengths and the strides that follow them (a per-block descale's head stride is its block count) vary call to
# call: one compiled kernel serves them all, where Triton would compile one per value class (1, multiple of 16).
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_tiles", "stride_ob", "stride_lse_b", "stride_lse_h",
                              "stride_qds_b", "stride_qds_h", "stride_qds_m", "stride_kds_b", "stride_kds_h",
                              "stride_kds_n", "stride_vds_b", "stride_vds_h"])
def attn_fwd_sm90_fp8(q_desc, k_desc, vt_desc, O, LSE, Q_DESCALE, K_DESCALE, V_DESCALE, stride_qds_b, stride_qds_h,
                      stride_qds_m, stride_kds_b, stride_kds_h, stride_kds_n, stride_vds_b, stride_vds_h, qk_scale,
                      softcap2, window_left, window_right, stride_ob, stride_om, stride_oh, stride_lse_b,
                      stride_lse_h, seqlen_q, seqlen_k, group, nheads, num_tiles, CU_SEQLENS_Q, CU_SEQLENS_K,
                      SEQUSED_K, ERR, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                      K_BLOCKS: gl.constexpr, TWO_LEVEL: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr, IS_VARLEN: gl.constexpr,
                      HAS_SEQUSED: gl.constexpr, CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    """``q_desc``/``k_desc``: TMA descriptors of the FP8 ``(batch, seqlen, heads, headdim)`` inputs with
    ``[1, 64, 1, HEAD_DIM]`` (one consumer's rows) and ``[1, BLOCK_N, 1, HEAD_DIM]`` tiles; ``vt_desc``: of
    V^T ``(batch, heads_kv, headdim, seqlen_k)`` with ``[1, 1, HEAD_DIM, BLOCK_N]`` tiles. ``O``: bf16
    ``(batch, seqlen_q, heads, headdim)``; ``LSE``: float32 ``(batch, heads, seqlen_q)``; ``*_DESCALE``: float32
    ``(batch, heads_kv)``, or for Q and K per block of 128 rows ``(batch, heads_kv, cdiv(seqlen, 128))``
    (``stride_qds_m``/``stride_kds_n``: the block strides, 0 without blocks; ``K_BLOCKS``: K's are per block, read
    per key block); ``qk_scale``: ``softmax_scale * log2(e)``, or ``softmax_scale / softcap`` with
    ``SOFTCAP`` (``softcap2 = softcap * log2(e)``); ``TWO_LEVEL``: O summed in float32 a key block at a time (each
    block's P V in a zeroed accumulator) instead of on the tensor cores across all keys; ``CONSUMERS``: 2 or 3
    consumer warpgroups of 64 rows (fp8.Fp8Tile); ``num_tiles``: batch x heads x query blocks of ``CONSUMERS x 64``
    rows.

    ``IS_VARLEN``: packed sequences, ``(1, tokens, heads, d)`` q and k, V^T ``(1, heads_kv, d, tokens_k)``, O ``(1,
    tokens, heads, d)`` (``stride_ob`` 0), LSE ``(heads, tokens)`` (``stride_lse_b`` 0); sequence b's rows from
    ``CU_SEQLENS_Q``/``CU_SEQLENS_K`` (int32, batch + 1) and its used keys from ``SEQUSED_K`` (``HAS_SEQUSED``),
    ``seqlen_q``/``seqlen_k`` the longest, ``batch`` the sequences, descales per sequence with blocks counted from
    its start; bad offsets are clamped into the tensors and noted in ``ERR`` (flashtile/device_errors.py)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    gl.static_assert(vt_desc.block_type.shape[2] == HEAD_DIM, "V^T tiles are [1, 1, HEAD_DIM, BLOCK_N]")
    gl.static_assert(vt_desc.block_type.shape[3] == BLOCK_N, "V^T tiles are [1, 1, HEAD_DIM, BLOCK_N]")
    gl.static_assert(DESCALE_BLOCK % q_desc.block_type.shape[1] == 0, "a consumer's Q rows share one descale")
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, 1, 1, HEAD_DIM, BLOCK_N], vt_desc.layout)
    descales = (Q_DESCALE, stride_qds_b, stride_qds_h, stride_qds_m, K_DESCALE, stride_kds_b, stride_kds_h,
                stride_kds_n, V_DESCALE, stride_vds_b, stride_vds_h)
    # No ALiBi, sink or fixed row max: LSE stands in for their pointers (never read).
    run_partitions(q_desc, k_desc, vt_desc, vt_smem, O, LSE, LSE, LSE, 0, qk_scale, softcap2, 0.0, window_left,
                   window_right, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k,
                   group, nheads, num_tiles, descales, (CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, ERR), (None, None),
                   MASK_LEFT, MASK_RIGHT, SOFTCAP, False, False, False, False, STAGES, CONSUMER_REGS, True, K_BLOCKS,
                   TWO_LEVEL, PINGPONG, IS_VARLEN, HAS_SEQUSED, False, CONSUMERS, num_warps)
