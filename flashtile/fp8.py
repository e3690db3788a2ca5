"""FP8 attention (FlashAttention-3's low-precision forward): the public functions, and which implementation runs.

Two ways in:

* :func:`flash_attn_fp8_func` / :func:`flash_attn_varlen_fp8_func` take 16-bit q, k, v, quantize them in one
  fused kernel (Hadamard rotation of q and k with seeded random signs, per-block scales, the e4m3 cast, v
  transposed for the PV product) and run the FP8 attention; the output comes back in q's dtype.
* :func:`flashtile.flash_attn_func` / :func:`flashtile.flash_attn_varlen_func` with float8_e4m3fn q, k, v and
  ``q_descale``, ``k_descale``, ``v_descale`` (FA3's API) run :func:`attention` on them as given.

Where it runs: on a Hopper GPU (sm_90) the Gluon FP8 kernel (``backends/triton/fp8.py``), named
``flashtile.fwd[gluon-sm90 fp8 d=... ...]``; elsewhere the torch statement of the same math
(``backends/torch_fp8.py``, ``flashtile.fwd[torch fp8 ...]``): the preferred implementation on CPU, a recorded
fallback (strict mode refuses it) on a GPU whose kernel cannot run the call. Forward only: a gradient through
FP8 attention raises ``NotImplementedError``.
"""
from __future__ import annotations

import functools
import importlib

import torch

from . import validation
from .backends import AttentionCall, AttnArgs
from .backends import torch_fp8
from .dispatch import Plan, TORCH, TRITON, profiled, record_choice, record_fallback, record_kernel


def flash_attn_fp8_func(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                        return_lse=False, block_quant=True, incoherent=True, seed=0):
    """FP8 attention of 16-bit ``q`` ``(batch, seqlen_q, nheads, headdim)``, ``k``, ``v``
    ``(batch, seqlen_k, nheads_kv, headdim)``, headdim 64, 128 or 256.

    q, k, v are quantized to float8_e4m3fn (one fused kernel on the GPU and under ``TRITON_INTERPRET=1``, its
    torch twin elsewhere), then attended in FP8 with fp32 accumulation; ``out`` comes back in q's dtype.

    Args:
        causal, softmax_scale, window_size, softcap: as in :func:`flashtile.flash_attn_func`.
        return_lse: also return ``softmax_lse`` float32 ``(batch, nheads, seqlen_q)``.
        block_quant: q and k get one scale per 128 rows (q's shared by the query heads of a KV group, the amax
            over the group: ``(batch, nheads_kv, cdiv(seqlen, 128))``), v one per (batch row, KV head); False:
            all three one per (batch row, KV head), FA3's per-tensor scales.
        incoherent: rotate q and k along the head dim by ``diag(signs) H / sqrt(headdim)`` (H Walsh-Hadamard,
            signs drawn from ``seed``) before quantizing: outliers spread over every channel; ``q k^T`` is unchanged.
        seed: the seed of the rotation's signs.

    Forward only: backward through it raises ``NotImplementedError``.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)`` when ``return_lse``.
    """
    validation.check_qkv(q, k, v)
    validation.check_fp8_head_dims(q, v)
    args = validation.attn_args(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                softcap=softcap)
    with torch.no_grad():
        q8, k8, v8_t, *descales = _quantize(q, k, v, block_quant, incoherent, seed)
        out, lse = attention(q8, k8, v8_t, *descales, args, v_transposed=True)
    out = _forward_only(out.to(q.dtype), q, k, v)
    return (out, lse) if return_lse else out


def flash_attn_varlen_fp8_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                               softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
                               block_quant=True, incoherent=True, seed=0):
    """:func:`flash_attn_fp8_func` on packed sequences: q ``(total_q, nheads, headdim)``, k, v
    ``(total_k, nheads_kv, headdim)``, offsets and longest lengths as in :func:`flashtile.flash_attn_varlen_func`.
    Scale blocks count from each sequence's start. Returns ``out`` ``(total_q, nheads, headdim)`` (rows past
    ``cu_seqlens_q[-1]`` are 0), or ``(out, softmax_lse)`` with ``softmax_lse`` ``(nheads, total_q)``."""
    validation.check_qkv(q, k, v, varlen=True)
    validation.check_fp8_head_dims(q, v)
    args = validation.attn_args(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                softcap=softcap, varlen=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    with torch.no_grad():
        q8, k8, v8_t, *descales = _quantize(q, k, v, block_quant, incoherent, seed, args)
        out, lse = attention(q8, k8, v8_t, *descales, args, v_transposed=True)
    out = _forward_only(out.to(q.dtype), q, k, v)
    return (out, lse) if return_lse else out


def fp8_call(q, k, v, options: dict, q_descale, k_descale, v_descale, return_attn_probs: bool):
    """``flash_attn_func`` / ``flash_attn_varlen_func`` on float8_e4m3fn q, k, v (FA3's API): validate, run
    :func:`attention`, return as those functions do (out in bfloat16)."""
    varlen = options.get("varlen", False)
    validation.check_qkv(q, k, v, varlen=varlen, dtypes=(torch.float8_e4m3fn,))
    validation.check_fp8_head_dims(q, v)
    validation.check_fp8_options(options["dropout_p"], options["alibi_slopes"], options.pop("sink", None),
                                 options.pop("attn_bias", None))
    options = {name: value for name, value in options.items() if name != "alibi_slopes"}
    args = validation.attn_args(q, k, v, **options)
    batch, seqlen_q, seqlen_k = _sizes(q, k, args)
    validation.check_descales(q, k, q_descale, k_descale, v_descale, batch, seqlen_q, seqlen_k)
    out, lse = attention(q, k, v, q_descale, k_descale, v_descale, args)
    return (out, lse, None) if return_attn_probs else out


def attention(q8, k8, v8, q_descale, k_descale, v_descale, args: AttnArgs, v_transposed: bool = False):
    """``(out, lse)`` of validated e4m3 inputs: ``out`` bfloat16 in q's layout, ``lse`` float32 as every backend.
    ``v8`` is ``(batch, seqlen_k, nheads_kv, d)`` (``(total_k, nheads_kv, d)`` varlen), or with ``v_transposed``
    the kernel's ``(batch, nheads_kv, d, seqlen_k)`` (varlen: ``torch_fp8.pack_v_t``'s packed V^T) with rows 16
    bytes apart (as the quantizer writes it). Descales in any shape :func:`flashtile.validation.check_descales`
    takes: those the kernel lacks (q's per query head, v's per block) run the torch math, a recorded fallback on a
    GPU."""
    chosen = plan(q8, k8, args, (q_descale, k_descale, v_descale))
    if chosen.fallback_reason is None:
        record_choice(chosen)
    else:
        # stacklevel: the user's line (record_fallback <- attention <- flash_attn_fp8_func / fp8_call <- ...).
        record_fallback(chosen.fallback_reason, chosen.backend, preferred=chosen.preferred, stacklevel=4)
        record_kernel(chosen.fwd_name)
    with profiled(chosen.fwd_name), torch.no_grad():
        if chosen.backend == TRITON:
            return _run_kernel(q8, k8, v8, q_descale, k_descale, v_descale, args, v_transposed)
        if v_transposed and args.varlen:
            v8 = torch_fp8.unpack_v_t(v8, args.cu_seqlens_k, k8.shape[0])
        elif v_transposed:
            v8 = v8.permute(0, 3, 1, 2)
        return torch_fp8.forward(q8, k8, v8, q_descale, k_descale, v_descale, args)


def plan(q8, k8, args: AttnArgs, descales: tuple) -> Plan:
    """Which implementation runs an FP8 call with ``descales`` ``(q_descale, k_descale, v_descale)``, under which
    profiler name, and why not the kernel."""
    per_block = any(descale.dim() == 3 for descale in descales)
    call = AttentionCall.of(q8, k8, k8, args)
    call = AttentionCall(**{**vars(call), "features": (*call.features, ("fp8", "float8_e4m3fn q, k, v: FP8"))})
    preferred = _preferred(q8.device)
    rejected = {}
    reason = kernel_reason(q8.device, args, q8.shape[-1], descales, k8.shape[-2])
    if reason is not None:
        rejected[TRITON] = reason
    backend = TRITON if reason is None else TORCH
    mask = "causal" if args.causal else "full"
    extras = "".join(f" {name}" for name, _ in call.features if name != "fp8")
    label = "gluon-sm90" if backend == TRITON else "torch"
    scales = "block-scales" if per_block else "tensor-scales"
    name = f"flashtile.fwd[{label} fp8 d={call.headdim} {mask}{extras} {scales}]"
    config = {"fp8": {"quant_block": torch_fp8.QUANT_BLOCK, "p_scale": torch_fp8.P_SCALE, "per_block": per_block}}
    return Plan(call, preferred, backend, rejected, name, "", config)


def _preferred(device: torch.device) -> str:
    """The kernel on CUDA; the torch math on CPU, where no FP8 kernel runs (not even under the interpreter)."""
    return TRITON if device.type == "cuda" else TORCH


def kernel_reason(device: torch.device, args: AttnArgs, head_dim: int, descales: tuple, nheads_kv: int) -> str | None:
    """Why the Gluon FP8 kernel cannot run a call on ``device`` with ``descales``, or None when it can."""
    if device.type != "cuda":
        return f"the FP8 kernel runs on CUDA GPUs, got device {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"GPU compute capability {major}.{minor} has no FP8 tensor cores (8.9+ has them; the FP8 kernel is "
                "written for 9.0)")
    if major != 9:
        return f"the FP8 kernel is written for Hopper (compute capability 9.0), got {major}.{minor}"
    kernel = _kernel_module()
    if kernel is None:
        return "the Gluon FP8 kernel (flashtile/backends/triton/fp8.py) is not in this build"
    return descale_reason(kernel, descales, nheads_kv) or kernel.fp8_sm90_supported(args, head_dim)


def descale_reason(kernel, descales: tuple, nheads_kv: int) -> str | None:
    """Why ``kernel`` (the launcher module) cannot take ``descales`` ``(q_descale, k_descale, v_descale)``, or None.
    It takes each per (batch, KV head); with ``PER_BLOCK_DESCALES`` q's and k's also per block of 128 rows and
    KV head, ``(batch, nheads_kv, blocks)``; never v's per block (V's descale scales the output once)."""
    q_descale, _, v_descale = descales
    blocked = [name for name, descale in zip(("q_descale", "k_descale", "v_descale"), descales) if descale.dim() == 3]
    if blocked and not getattr(kernel, "PER_BLOCK_DESCALES", False):
        return f"the FP8 kernel takes descales per (batch, KV head) only, got per-block {', '.join(blocked)}"
    if q_descale.dim() == 3 and q_descale.shape[1] != nheads_kv:
        return (f"q_descale per block of each query head {tuple(q_descale.shape)}: the FP8 kernel takes a block's "
                f"scale shared by a KV group's query heads, (batch, nheads_kv={nheads_kv}, blocks)")
    if v_descale.dim() == 3:
        return (f"v_descale per block {tuple(v_descale.shape)}: the FP8 kernel takes v_descale per (batch, KV head), "
                f"(batch, nheads_kv={nheads_kv})")
    return None


@functools.lru_cache(maxsize=1)
def _kernel_module():
    try:
        return importlib.import_module("flashtile.backends.triton.fp8")
    except ImportError:
        return None


def kernel_v_layout(v8: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """v ``(batch, seqlen_k, nheads_kv, d)`` in the FP8 kernel's K-major layout ``(batch, nheads_kv, d, seqlen_k)``,
    rows 16 bytes apart as its TMA reads them; packed v ``(total_k, nheads_kv, d)`` with ``cu_seqlens_k`` as
    :func:`torch_fp8.pack_v_t` lays it out (each sequence from a 16-byte-aligned column)."""
    from .backends.triton.host import tma_rows
    if cu_seqlens_k is None:
        v_t = v8.permute(0, 2, 3, 1)
        return tma_rows(v_t.shape, v_t.dtype, v_t.device).copy_(v_t)
    total_k, nheads_kv, head_dim = v8.shape
    width = torch_fp8.packed_vt_width(total_k, cu_seqlens_k.shape[0] - 1)
    return torch_fp8.pack_v_t(v8, cu_seqlens_k, tma_rows((nheads_kv, head_dim, width), v8.dtype, v8.device))


def _run_kernel(q8, k8, v8, q_descale, k_descale, v_descale, args: AttnArgs, v_transposed: bool):
    """The Gluon FP8 kernel: out bfloat16, lse float32, v in its K-major layout (a transposing copy into rows 16
    bytes apart, as the TMA reads them, unless given so)."""
    from .alloc import empty
    if not v_transposed:
        v8 = kernel_v_layout(v8, args.cu_seqlens_k if args.varlen else None)
    out = empty(q8.shape, torch.bfloat16, q8.device)
    if args.varlen:
        lse = empty((q8.shape[1], q8.shape[0]), torch.float32, q8.device)
    else:
        lse = empty((q8.shape[0], q8.shape[2], q8.shape[1]), torch.float32, q8.device)
    _kernel_module().forward_fp8_sm90(q8, k8, v8, q_descale, k_descale, v_descale, out, lse, args)
    return out, lse


def _quantize(q, k, v, block_quant: bool, incoherent: bool, seed: int, args: AttnArgs | None = None):
    """The fused Triton quantizer where Triton runs (CUDA, or CPU under ``TRITON_INTERPRET=1``), else its torch twin."""
    from .dispatch import preferred_backend
    varlen = args is not None and args.varlen
    triton = preferred_backend(q.device) == TRITON
    reason = None
    if triton and q.device.type == "cpu" and q.dtype == torch.bfloat16:
        reason = "Triton's interpreter computes bfloat16 wrongly (numpy has no bfloat16)"
    elif triton and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(q.device)
        reason = f"GPU compute capability {major}.{minor} has no FP8 conversions in Triton (8.9+)"
    if reason is not None:
        record_fallback(f"{reason}: the FP8 quantizer runs as torch ops", TORCH, preferred=TRITON, stacklevel=4)
        triton = False
    if triton:
        from .backends.triton import quant
        if varlen:
            return quant.quantize(q, k, v, block_quant, incoherent, seed, args.cu_seqlens_q, args.cu_seqlens_k,
                                  args.max_seqlen_q, args.max_seqlen_k)
        return quant.quantize(q, k, v, block_quant, incoherent, seed)
    if varlen:
        return torch_fp8.quantize_varlen(q, k, v, args, block_quant, incoherent, seed)
    return torch_fp8.quantize(q, k, v, block_quant, incoherent, seed)


def _sizes(q, k, args: AttnArgs) -> tuple:
    """``(batch, seqlen_q, seqlen_k)``; the number of sequences and the longest lengths when varlen."""
    if args.varlen:
        return args.cu_seqlens_q.shape[0] - 1, args.max_seqlen_q, args.max_seqlen_k
    return q.shape[0], q.shape[1], k.shape[1]


class _ForwardOnly(torch.autograd.Function):
    """Passes ``out`` through; its backward refuses: FP8 attention has no backward."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("backward through FP8 attention (flash_attn_fp8_func) is not implemented: FP8 "
                                  "inputs serve inference; train with flash_attn_func on 16-bit inputs")


def _forward_only(out, *inputs):
    """``out``, tied to ``inputs`` so that a gradient asked of them raises instead of being silently absent."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _ForwardOnly.apply(out, *inputs)
    return out
