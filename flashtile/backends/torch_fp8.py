"""FP8 attention in plain tensor ops: what the FP8 kernels compute, stated readably (the torch backend's
FP8 forward, and the reference the Triton quantizer and the Gluon FP8 kernel are tested against).

Quantization (:func:`quantize`, the twin of ``triton/kernels/quant_fp8.py``), per tensor of 16-bit q, k, v:

* incoherent processing: q and k are multiplied along the head dim by one orthonormal matrix
  ``R = diag(signs) @ H / sqrt(d)`` (``H`` the Sylvester Walsh-Hadamard matrix, ``signs`` random +-1 drawn
  from ``seed``). ``(q R)(k R)^T = q k^T``, so the scores are unchanged, but an outlier in one channel is
  spread over all ``d`` of them before the cast; v is not rotated (the output needs no undoing);
* scales: block quantization keeps one descale per :data:`QUANT_BLOCK` rows for q and k, the kernel's
  ``BLOCK_M`` / ``BLOCK_N`` tiles, so the kernel applies each as one scalar per tile: q's ``(batch, nheads_kv,
  cdiv(seqlen_q, 128))``, one scale per block shared by the query heads of a KV head's group (the amax over the
  group's heads: GQA's query heads share their K and V, and the kernel reads one scale per tile and KV head);
  k's ``(batch, nheads_kv, cdiv(seqlen_k, 128))``; v's one per (batch row, KV head) ``(batch, nheads_kv)``, the
  amax over all of its rows (the kernel folds V's descale into the output once, after the key loop). Without
  block quantization all three are per (batch row, KV head), FA3's layout (q's over the heads of its group).
  ``descale = amax / 448`` (1 for an all-zero block), and ``x8 = e4m3(clamp(x / descale, -448, 448))``;
* v is written "K-major", ``(batch, nheads_kv, headdim, seqlen_k)``, the B operand layout of the PV wgmma.

Attention (:func:`forward`, :func:`attention`): the scores ``(q8 * q_descale) . (k8 * k_descale)`` in fp32,
an online softmax over key tiles of :data:`QUANT_BLOCK` keys as the kernel runs it, and P quantized as the
kernel must before its FP8 PV product: ``p = exp(s - m_running)`` lies in ``[0, 1]``, so one fixed scale
:data:`P_SCALE` = 448 maps it onto e4m3's range (a per-row scale would buy nothing: every row's largest
``p`` of a tile is 1, or less only when an earlier tile held the row's max, where the tile adds little).
The row sums ``l`` are taken from the fp32 ``p`` (the kernel sums its fp32 registers before the cast);
``acc += e4m3(p * 448) / 448 @ (v8 * v_descale)`` in fp32. Output in bfloat16, lse float32 as every backend.
"""
from __future__ import annotations

import functools
import math

import torch

from . import AttnArgs

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3 value: quantized values are saturated to +-FP8_MAX.
FP8_MAX = 448.0
# Rows (of one head) that share a scale under block quantization: the FP8 kernel's BLOCK_M and BLOCK_N.
QUANT_BLOCK = 128
# P = exp(s - m) lies in [0, 1]; P * P_SCALE fills e4m3's range before P's cast.
P_SCALE = FP8_MAX


@functools.lru_cache(maxsize=64)
def _rotation(head_dim: int, seed: int) -> torch.Tensor:
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < head_dim:
        # Sylvester: H_2n = [[H, H], [H, -H]].
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.int64) * 2 - 1
    return signs.to(torch.float64)[:, None] * hadamard


def hadamard_signs(head_dim: int, seed: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``diag(signs) @ H`` ``(head_dim, head_dim)``, entries +-1 (exact in any float dtype); the rotation is
    this divided by ``sqrt(head_dim)``. ``head_dim`` must be a power of two. The tensor is shared between calls
    (kept per device and dtype): read it, never write it."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got headdim={head_dim}")
    return _rotation_on(head_dim, seed, torch.device(device) if device is not None else torch.device("cpu"), dtype)


@functools.lru_cache(maxsize=64)
def _rotation_on(head_dim: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Made once per device: a copy to a GPU on every call synchronizes the host with the GPU (torch's blocking
    # host-to-device copy), which the quantizer paid on each call and a CUDA graph cannot capture.
    return _rotation(head_dim, seed).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x @ R`` in fp32 along the last dim, ``R = diag(signs) H / sqrt(d)`` orthonormal."""
    head_dim = x.shape[-1]
    return (x.float() @ hadamard_signs(head_dim, seed, x.device)) * (1.0 / math.sqrt(head_dim))


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to e4m3 (torch's cast makes NaN of values past 448)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def descale_of(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` correctly rounded, as the quantize kernel's, 1 where ``amax`` is 0 (an all-zero block: no
    division by 0). The divisor is a tensor: CUDA tensors divided by a Python number are multiplied by its rounded
    reciprocal, one ulp off for some amaxes, which moves quotients that sit on e4m3 rounding ties."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def _blocks(seqlen: int) -> int:
    return max(1, -(-seqlen // QUANT_BLOCK))


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """``(batch, nheads, blocks)`` amax of ``x`` ``(batch, seqlen, nheads, d)`` over blocks of QUANT_BLOCK rows."""
    batch, seqlen, nheads, _ = x.shape
    blocks = _blocks(seqlen)
    padded = x.new_zeros(batch, blocks * QUANT_BLOCK, nheads, x.shape[-1])
    padded[:, :seqlen] = x
    return padded.abs().view(batch, blocks, QUANT_BLOCK, nheads, -1).amax(dim=(2, 4)).transpose(1, 2)


def _rows(descale: torch.Tensor, seqlen: int, nheads: int) -> torch.Tensor:
    """A descale per (batch, token, head) ``(batch, seqlen, nheads, 1)`` from its per-block
    ``(batch, heads, blocks)`` or per-tensor ``(batch, heads)`` form, ``heads`` ``nheads`` or ``nheads_kv`` (q's
    heads share their KV head's)."""
    descale = descale.float().repeat_interleave(nheads // descale.shape[1], dim=1)
    if descale.dim() == 2:
        return descale[:, None, :, None]
    return descale.repeat_interleave(QUANT_BLOCK, dim=2)[:, :, :seqlen].transpose(1, 2)[..., None]


def quantize_one(x: torch.Tensor, block_quant: bool, nheads_kv: int, rotate_seed=None, descale=None):
    """``(x8, descale)`` of ``x`` ``(batch, seqlen, nheads, d)``: rotated first when ``rotate_seed`` is set;
    ``descale`` per block ``(batch, nheads_kv, blocks)`` (a block's scale shared by the heads of a KV group) or
    per (batch, KV head) ``(batch, nheads_kv)``, computed from the amax unless given."""
    batch, seqlen, nheads, _ = x.shape
    x = rotate(x, rotate_seed) if rotate_seed is not None else x.float()
    if descale is None:
        # One scale for the heads of a KV group: per block, or over every block too.
        amax = _block_amax(x).view(batch, nheads_kv, nheads // nheads_kv, -1).amax(dim=2)
        descale = descale_of(amax if block_quant else amax.amax(dim=2))
    return to_fp8(x / _rows(descale, seqlen, nheads)), descale


def quantize(q, k, v, block_quant: bool = True, incoherent: bool = True, seed: int = 0):
    """Dense 16-bit q, k, v -> ``(q8, k8, v8_t, q_descale, k_descale, v_descale)`` as the Triton quantizer
    makes them (see the module doc): q8 ``(batch, seqlen_q, nheads, d)``, k8 ``(batch, seqlen_k, nheads_kv, d)``,
    v8_t ``(batch, nheads_kv, d, seqlen_k)``; descales float32: with ``block_quant`` q's and k's per block
    ``(batch, nheads_kv, cdiv(seqlen, 128))`` and v's ``(batch, nheads_kv)``, else all ``(batch, nheads_kv)``."""
    nheads_kv = k.shape[2]
    seed_qk = seed if incoherent else None
    q8, q_descale = quantize_one(q, block_quant, nheads_kv, seed_qk)
    k8, k_descale = quantize_one(k, block_quant, nheads_kv, seed_qk)
    v8, v_descale = quantize_one(v, False, nheads_kv)
    return q8, k8, v8.permute(0, 2, 3, 1).contiguous(), q_descale, k_descale, v_descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """fp32 ``x8 * descale`` of ``x8`` ``(batch, seqlen, heads, d)`` with either descale form."""
    return x8.float() * _rows(descale, x8.shape[1], x8.shape[2])


def attention(q, k, v, args: AttnArgs, quantize_p: bool = True):
    """``(out, lse)`` fp32 of fp32 ``q`` ``(batch, seqlen_q, nheads, d)``, ``k``, ``v``
    ``(batch, seqlen_k, nheads_kv, d)`` (dense, already dequantized), over key tiles of QUANT_BLOCK keys with
    an online softmax; ``quantize_p``: P goes through e4m3 with :data:`P_SCALE` before the PV product."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    qh = q.transpose(1, 2)  # (batch, nheads, seqlen_q, d)
    m_i = torch.full((batch, nheads, seqlen_q), float("-inf"), device=q.device)
    l_i = torch.zeros_like(m_i)
    acc = torch.zeros(batch, nheads, seqlen_q, v.shape[-1], device=q.device)
    # Bottom-right alignment: query i sits on key i + seqlen_k - seqlen_q.
    query = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
    for k0 in range(0, seqlen_k, QUANT_BLOCK):
        k1 = min(k0 + QUANT_BLOCK, seqlen_k)
        k_tile = k[:, k0:k1].transpose(1, 2).repeat_interleave(group, dim=1)
        v_tile = v[:, k0:k1].transpose(1, 2).repeat_interleave(group, dim=1)
        s = (qh @ k_tile.transpose(-1, -2)) * args.softmax_scale
        if args.softcap > 0:
            s = args.softcap * torch.tanh(s / args.softcap)
        distance = query - torch.arange(k0, k1, device=q.device)[None, :]
        visible = torch.ones_like(distance, dtype=torch.bool)
        if args.window_left >= 0:
            visible &= distance <= args.window_left
        if args.window_right >= 0:
            visible &= distance >= -args.window_right
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m_i, s.amax(dim=-1))
        # A row that has seen no key keeps max -inf; subtracting 0 keeps exp() at 0, not NaN.
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m_i - m_safe)
        l_i = l_i * alpha + p.sum(dim=-1)
        if quantize_p:
            p = to_fp8(p * P_SCALE).float() / P_SCALE
        acc = acc * alpha[..., None] + p @ v_tile
        m_i = m_new
    out = acc / l_i.masked_fill(l_i == 0, 1.0)[..., None]
    lse = m_i + torch.log(l_i)
    return out.transpose(1, 2), lse


def _sequences(args: AttnArgs):
    cu_q, cu_k = args.cu_seqlens_q.tolist(), args.cu_seqlens_k.tolist()
    used_k = None if args.seqused_k is None else args.seqused_k.tolist()
    for b in range(len(cu_q) - 1):
        yield b, cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1] if used_k is None else cu_k[b] + used_k[b]


def forward(q8, k8, v8, q_descale, k_descale, v_descale, args: AttnArgs, out_dtype=torch.bfloat16):
    """FP8 attention of e4m3 ``q8``, ``k8``, ``v8`` (standard layouts, ``(batch, seqlen, heads, d)``; packed
    ``(total, heads, d)`` with ``args.varlen``, sequences from ``args.cu_seqlens_*``, descales per sequence).
    Returns ``(out, lse)``: out in ``out_dtype``, lse float32 ``(batch, nheads, seqlen_q)`` (``(nheads,
    total_q)`` varlen). Rows of a packed q past ``cu_seqlens_q[-1]`` are 0 with lse ``-inf``."""
    if not args.varlen:
        out, lse = attention(dequantize(q8, q_descale), dequantize(k8, k_descale), dequantize(v8, v_descale), args)
        return out.to(out_dtype), lse
    total_q, nheads, _ = q8.shape
    out = torch.zeros(total_q, nheads, v8.shape[-1], dtype=out_dtype, device=q8.device)
    lse = torch.full((nheads, total_q), float("-inf"), device=q8.device)
    for b, q0, q1, k0, k1 in _sequences(args):
        parts = [dequantize(x[None, start:end], descale[b:b + 1]) for x, start, end, descale in
                 ((q8, q0, q1, q_descale), (k8, k0, k1, k_descale), (v8, k0, k1, v_descale))]
        seq_out, seq_lse = attention(*parts, args)
        out[q0:q1] = seq_out[0].to(out_dtype)
        lse[:, q0:q1] = seq_lse[0]
    return out, lse


# Packed V^T (varlen): sequence b's keys start at a column a multiple of VT_ALIGN, ``k_start // 16 * 16 + 16 b``
# (kernels/common.py: packed_vt_start), since the FP8 kernel's TMA reads V^T's key dim only at 16-byte-aligned
# coordinates; a sequence before it adds at most VT_ALIGN columns.
VT_ALIGN = 16


def packed_vt_width(total_k: int, batch: int) -> int:
    """Columns of packed V^T for ``total_k`` keys in ``batch`` sequences (past the last sequence's keys)."""
    return total_k + VT_ALIGN * max(batch - 1, 0)


def _packed_starts(cu_seqlens_k: torch.Tensor, total_k: int) -> tuple:
    """``(starts, v_starts)`` int64: each sequence's first key row of packed K (clamped into ``[0, total_k]`` as
    the kernels clamp it) and its first column of packed V^T."""
    starts = cu_seqlens_k.clamp(0, total_k).long()
    seq = torch.arange(starts.shape[0], device=starts.device)
    return starts, starts // VT_ALIGN * VT_ALIGN + VT_ALIGN * seq


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """e4m3 as its bytes (0 is 0.0), so that gathers and selects need no FP8 kernels; other dtypes as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def pack_v_t(v8: torch.Tensor, cu_seqlens_k: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed V^T ``(nheads_kv, d, packed_vt_width)`` of packed v ``(total_k, nheads_kv, d)`` (any dtype), written
    into ``out`` when given (rows 16 bytes apart for the kernel): each column takes its sequence's key, the
    columns between sequences 0. Torch ops on the device, no host sync; any offsets index inside v8."""
    total_k, nheads_kv, head_dim = v8.shape
    batch = cu_seqlens_k.shape[0] - 1
    width = packed_vt_width(total_k, batch)
    if out is None:
        out = torch.empty((nheads_kv, head_dim, width), dtype=v8.dtype, device=v8.device)
    if total_k == 0 or batch <= 0:
        return out.zero_()
    starts, v_starts = _packed_starts(cu_seqlens_k, total_k)
    columns = torch.arange(width, device=v8.device)
    seq = (torch.searchsorted(v_starts[:-1].contiguous(), columns, right=True) - 1).clamp(0, batch - 1)
    offset = columns - v_starts[seq]
    inside = (offset >= 0) & (offset < starts[seq + 1] - starts[seq])
    rows = (starts[seq] + offset).clamp(0, total_k - 1)
    raw = _bytes(v8)
    values = raw.permute(1, 2, 0).index_select(2, rows)
    out.view(raw.dtype).copy_(torch.where(inside, values, torch.zeros((), dtype=raw.dtype, device=v8.device)))
    return out


def unpack_v_t(v8_t: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int) -> torch.Tensor:
    """Packed v ``(total_k, nheads_kv, d)`` from :func:`pack_v_t`'s layout (rows outside every sequence: some
    column's value, in range)."""
    batch = cu_seqlens_k.shape[0] - 1
    if total_k == 0 or batch <= 0:
        return v8_t.new_zeros((total_k, *v8_t.shape[:2]))
    starts, v_starts = _packed_starts(cu_seqlens_k, total_k)
    rows = torch.arange(total_k, device=v8_t.device)
    seq = torch.searchsorted(starts[1:-1].contiguous(), rows, right=True)
    columns = (rows - starts[seq] + v_starts[seq]).clamp(0, v8_t.shape[2] - 1)
    raw = _bytes(v8_t)
    return raw.index_select(2, columns).permute(2, 0, 1).view(v8_t.dtype)


def quantize_varlen(q, k, v, args: AttnArgs, block_quant: bool = True, incoherent: bool = True, seed: int = 0):
    """:func:`quantize` of packed q ``(total_q, nheads, d)``, k, v ``(total_k, nheads_kv, d)``, blocks counted
    from each sequence's start: descales as :func:`quantize` makes them with ``batch`` sequences and
    ``cdiv(max_seqlen, 128)`` blocks; v8_t packed, ``(nheads_kv, d, packed_vt_width(total_k, batch))``
    (:func:`pack_v_t`). Rows outside every sequence are written as 0."""
    batch = args.cu_seqlens_q.shape[0] - 1
    nheads_kv = k.shape[1]
    q8, k8, v8 = (torch.zeros(x.shape, dtype=FP8_DTYPE, device=x.device) for x in (q, k, v))
    blocks = {"q": _blocks(args.max_seqlen_q), "k": _blocks(args.max_seqlen_k), "v": None}
    # Blocks past a short sequence keep descale 1.
    q_descale, k_descale, v_descale = (
        torch.ones((batch, nheads_kv, blocks[name]) if block_quant and name != "v" else (batch, nheads_kv),
                   device=q.device) for name in ("q", "k", "v"))
    cu_q, cu_k = args.cu_seqlens_q.tolist(), args.cu_seqlens_k.tolist()
    seed_qk = seed if incoherent else None
    for b in range(batch):
        for x, x8, descale, (start, end), rotated in ((q, q8, q_descale, cu_q[b:b + 2], seed_qk),
                                                      (k, k8, k_descale, cu_k[b:b + 2], seed_qk),
                                                      (v, v8, v_descale, cu_k[b:b + 2], None)):
            part8, part_descale = quantize_one(x[None, start:end], block_quant and x is not v, nheads_kv, rotated)
            x8[start:end] = part8[0]
            if descale.dim() == 3:
                descale[b, :, :part_descale.shape[2]] = part_descale[0]
            else:
                descale[b] = part_descale[0]
    return q8, k8, pack_v_t(v8, args.cu_seqlens_k), q_descale, k_descale, v_descale
