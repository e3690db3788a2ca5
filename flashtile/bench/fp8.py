"""``python -m flashtile bench --suite fp8``: FP8 attention against our bf16 forward, and the FP8 KV cache's decode
step against the bf16 cache's (issue 45's speed table). About 2-3 minutes on an H100/H200, compiles included.

Forward cells (head dims 128 and 256, N 4096 / 8192 / 16384, causal and not; 16384 tokens a batch and 2048 of
width, ``batch = 16384 // N``, ``nheads = 2048 // d``, as the main suite), each on one set of bf16 inputs:

- ``bf16``: ``flash_attn_func`` (our bf16 forward);
- ``fp8_kernel``: the FP8 attention alone on inputs quantized beforehand (``flashtile.fp8.attention``);
- ``fp8_e2e``: ``flash_attn_fp8_func`` (the fused quantize, then the FP8 attention);
- ``quantize``: the fused quantize kernel alone.

Packed cells (``flash_attn_varlen_func`` against ``flash_attn_varlen_fp8_func``): sequences of 3000, 5000, 1000,
4000 and 3384 tokens (16384 in all, most starting off a 16-token boundary) at each head dim, causal and not,
measured the same way; their TFLOP/s count each sequence's own attention.

TFLOP/s count the FP8 FLOPs with the bf16 formula (``4 B H N^2 d``, halved when causal). Before any timing a
cell checks the outputs of the first two heads against fp32 attention (RMSE, max error); a cell that fails is
marked ``wrong`` and not timed. The FP8 times run only when the Gluon FP8 kernel runs the call (the kernel name
is recorded): a fallback to the torch math is reported, not timed.

Decode cells (GQA 32/8, d128; batch 16 x 32768 and batch 1 x 131072): one query token a sequence on a contiguous
bf16 cache and on the same keys and values in an e4m3 cache with per-KV-head descales, each step captured in a
CUDA graph and replayed; checked first against fp32 attention on the dequantized cache. Bandwidth = the K and V
bytes a step reads over its time.

Writes ``<out>/<gpu>-fp8-<date>.json`` and prints a Markdown table. ``--headdims`` and ``--seqlens`` narrow the
forward cells' grid (and the packed cells' head dims); ``--only forward varlen decode`` picks the kinds of cells, e.g.
the quantize kernel's time at the bench's widest shapes alone:
``python -m flashtile bench --suite fp8 --only forward --headdims 128 256 --seqlens 16384``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from . import common

TOKENS, WIDTH = 16384, 2048
HEAD_DIMS = (128, 256)
SEQLENS = (4096, 8192, 16384)
DECODE_SHAPES = ((16, 32768), (1, 131072))
KINDS = ("forward", "varlen", "decode")
# Packed sequences of 16384 tokens in all, starting off 16-token boundaries (packed V^T's alignment path).
VARLEN_LENGTHS = (3000, 5000, 1000, 4000, 3384)
DECODE_HEADS = (32, 8, 128)
REF_HEADS = 2
# An FP8 output whose RMSE against fp32 attention of the bf16 inputs exceeds this is wrong (measured ~3e-3 on
# unit-normal inputs); bf16's own bound is 100x smaller.
FP8_RMSE_LIMIT = 2e-2
BF16_RMSE_LIMIT = 2e-3


def _rmse(out, ref) -> float:
    return (out.float() - ref.float()).pow(2).mean().sqrt().item()


def forward_cell(batch: int, seqlen: int, nheads: int, head_dim: int, causal: bool, timer, device) -> dict:
    """One forward cell: errors first, then the times of the bf16 forward, the FP8 kernel, FP8 end to end and
    the quantize kernel, with TFLOP/s and the ratios to bf16."""
    import flashtile
    from .. import fp8, validation
    from ..testing import attention_ref

    row = {"B": batch, "N": seqlen, "H": nheads, "D": head_dim, "causal": causal}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device=device, dtype=dtype) for _ in range(3))
    args = validation.attn_args(q, k, v, causal=causal)
    runs = {
        "bf16": lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
        "fp8_e2e": lambda: flashtile.flash_attn_fp8_func(q, k, v, causal=causal),
    }
    # The first heads' float32 (CPU: float64) output: a spot check where the whole reference is slow.
    reference = lambda: attention_ref(*(t[:, :, :REF_HEADS] for t in (q, k, v)), causal=causal)[0]  # noqa: E731
    first_heads = lambda out: out[:, :, :REF_HEADS]  # noqa: E731
    quantize = lambda: _quantize(fp8, device, q, k, v, None)  # noqa: E731
    return _measure(row, runs, quantize, args, reference, first_heads,
                    common.fwd_flops(batch, nheads, seqlen, head_dim, causal), timer, device)


def varlen_cell(lengths: tuple, nheads: int, head_dim: int, causal: bool, timer, device) -> dict:
    """A forward cell of packed sequences (``flash_attn_varlen_func`` against ``flash_attn_varlen_fp8_func``),
    measured as :func:`forward_cell`; TFLOP/s count each sequence's own attention."""
    import flashtile
    from .. import fp8, validation
    from ..testing import attention_varlen_ref, cu_seqlens_of

    total, longest = sum(lengths), max(lengths)
    row = {"lengths": list(lengths), "N": total, "H": nheads, "D": head_dim, "causal": causal}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(total, nheads, head_dim, device=device, dtype=dtype) for _ in range(3))
    cu = cu_seqlens_of(lengths, device)
    args = validation.attn_args(q, k, v, causal=causal, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=longest, max_seqlen_k=longest)
    runs = {
        "bf16": lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal),
        "fp8_e2e": lambda: flashtile.flash_attn_varlen_fp8_func(q, k, v, cu, cu, longest, longest, causal=causal),
    }
    reference = lambda: attention_varlen_ref(*(t[:, :REF_HEADS] for t in (q, k, v)), cu, cu,  # noqa: E731
                                             causal=causal)[0]
    first_heads = lambda out: out[:, :REF_HEADS]  # noqa: E731
    quantize = lambda: _quantize(fp8, device, q, k, v, args)  # noqa: E731
    flops = sum(common.fwd_flops(1, nheads, n, head_dim, causal) for n in lengths)
    return _measure(row, runs, quantize, args, reference, first_heads, flops, timer, device)


def _quantize(fp8, device, q, k, v, args):
    """The fused quantizer on a GPU, called directly so its timing holds no dispatch (its twin on CPU), packed
    with varlen ``args``."""
    if device.type != "cuda":
        return fp8._quantize(q, k, v, True, True, 0, args)
    from ..backends.triton import quant
    if args is None:
        return quant.quantize(q, k, v)
    return quant.quantize(q, k, v, True, True, 0, args.cu_seqlens_q, args.cu_seqlens_k, args.max_seqlen_q,
                          args.max_seqlen_k)


def _measure(row: dict, runs: dict, quantize, args, reference, first_heads, flops: float, timer, device) -> dict:
    """Check, then time: ``runs`` (bf16 and FP8 end to end) plus the FP8 kernel alone on ``quantize()``'s
    inputs; each output's first heads against ``reference()``; a cell over its RMSE limit, or whose end-to-end
    call ran another kernel than the plan's, is marked wrong and not timed."""
    import flashtile
    from .. import fp8

    with torch.no_grad():
        quantized = quantize()
        plan = fp8.plan(quantized[0], quantized[1], args, tuple(quantized[3:]))
        row["fp8_kernel_name"] = plan.fwd_name
        row["fp8_fallback"] = plan.fallback_reason
        ref = reference()
        runs = {"bf16": runs["bf16"], "fp8_kernel": lambda: fp8.attention(*quantized, args, v_transposed=True)[0],
                "fp8_e2e": runs["fp8_e2e"]}
        for name, fn in runs.items():
            if name != "bf16" and plan.fallback_reason is not None:
                continue
            flashtile.reset_stats()
            start = time.perf_counter()
            out = fn()
            common.synchronize(device)
            if name == "fp8_e2e":
                # The end-to-end call quantizes and plans itself: it must reach the kernel the plan named.
                stats = flashtile.stats()
                row["fp8_e2e_kernels"] = sorted(stats["kernels"])
                row["fp8_e2e_fallbacks"] = sorted(stats["fallbacks"])
            row[f"{name}_first_call_s"] = round(time.perf_counter() - start, 3)
            row[f"{name}_rmse"] = _rmse(first_heads(out), ref)
            row[f"{name}_max_abs_err"] = common.max_abs_err(first_heads(out), ref)
        limits = {"bf16": BF16_RMSE_LIMIT, "fp8_kernel": FP8_RMSE_LIMIT, "fp8_e2e": FP8_RMSE_LIMIT}
        wrong = [name for name in runs if row.get(f"{name}_rmse", 0.0) > limits[name]]
        if "fp8_e2e_kernels" in row and (plan.fwd_name not in row["fp8_e2e_kernels"] or row["fp8_e2e_fallbacks"]):
            row["status"] = (f"wrong: fp8_e2e ran {row['fp8_e2e_kernels']} (fallbacks {row['fp8_e2e_fallbacks']}), "
                             f"not {plan.fwd_name}")
            return row
        if wrong:
            row["status"] = "wrong: " + ", ".join(f"{name} rmse {row[f'{name}_rmse']:.2e}" for name in wrong)
            return row
        timed = {name: fn for name, fn in runs.items() if f"{name}_rmse" in row}
        timed["quantize"] = quantize
        for name, fn in timed.items():
            row.update(common.timing_fields(name, timer(fn)))
            if name != "quantize":
                row[f"{name}_tflops"] = common.tflops(flops, row[f"{name}_ms"])
        for name in ("fp8_kernel", "fp8_e2e"):
            if f"{name}_ms" in row:
                row[f"{name}_speedup_vs_bf16"] = row["bf16_ms"] / row[f"{name}_ms"]
    row["status"] = "ok" if plan.fallback_reason is None else f"fp8 kernel not run: {plan.fallback_reason}"
    return row


def decode_cell(batch: int, cache_len: int, timer, device, graphs: bool) -> dict:
    """One decode cell: the bf16-cache and FP8-cache steps (CUDA graph replays on a GPU), checked first."""
    import flashtile
    from ..backends.torch_fp8 import FP8_MAX, to_fp8
    from ..testing import attention_ref
    from .decode import capture_graph

    nheads, nheads_kv, head_dim = DECODE_HEADS
    row = {"B": batch, "L": cache_len, "H": nheads, "Hkv": nheads_kv, "D": head_dim}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(batch, 1, nheads, head_dim, device=device, dtype=dtype)
    k16 = torch.randn(batch, cache_len, nheads_kv, head_dim, device=device, dtype=dtype)
    v16 = torch.randn(batch, cache_len, nheads_kv, head_dim, device=device, dtype=dtype)
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    # Per-KV-head descales: each head's amax over the whole cache, mapped to e4m3's 448.
    k_descale = k16.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX
    v_descale = v16.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX
    k8, v8 = to_fp8(k16.float() / k_descale[:, None]), to_fp8(v16.float() / v_descale[:, None])
    steps = {
        "bf16": lambda: flashtile.flash_attn_with_kvcache(q, k16, v16, cache_seqlens=seqlens, causal=True),
        "fp8": lambda: flashtile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, causal=True,
                                                         k_descale=k_descale, v_descale=v_descale),
    }
    with torch.no_grad():
        refs = {"bf16": attention_ref(q[:1], k16[:1], v16[:1])[0],
                "fp8": attention_ref(q[:1], (k8[:1].float() * k_descale[:, None]),
                                     (v8[:1].float() * v_descale[:, None]))[0]}
        for name, fn in steps.items():
            flashtile.reset_stats()
            row[f"{name}_max_abs_err"] = common.max_abs_err(fn()[:1], refs[name])
            row[f"{name}_kernel"] = next(iter(flashtile.stats()["kernels"]), "")
            if row[f"{name}_max_abs_err"] > 2e-2:
                row["status"] = f"wrong: {name} max_abs_err {row[f'{name}_max_abs_err']:.2e}"
                return row
        for name, fn in steps.items():
            elt = 1 if name == "fp8" else torch.finfo(dtype).bits // 8
            nbytes = common.decode_bytes(batch, cache_len, nheads_kv, head_dim, head_dim, elt)
            prefix = f"{name}_graph" if graphs else f"{name}_step"
            run = capture_graph(fn).replay if graphs else fn
            row.update(common.timing_fields(prefix, timer(run)))
            row[f"{prefix}_GBps"] = common.gbps(nbytes, row[f"{prefix}_ms"])
        prefix = "graph" if graphs else "step"
        row[f"fp8_over_bf16_{prefix}"] = row[f"fp8_{prefix}_ms"] / row[f"bf16_{prefix}_ms"]
    row["status"] = "ok"
    return row


def run(device, timer, head_dims=HEAD_DIMS, seqlens=SEQLENS, decode_shapes=DECODE_SHAPES, graphs=True,
        on_row=None, tokens=TOKENS, width=WIDTH, varlen_lengths=VARLEN_LENGTHS, kinds=KINDS) -> dict:
    """Every cell of ``kinds`` (of :data:`KINDS`); ``on_row(kind, row)`` after each. A cell that raises is recorded
    with its error."""
    rows = {"forward": [], "varlen": [], "decode": []}
    for head_dim in head_dims:
        for seqlen in seqlens if "forward" in kinds else ():
            for causal in (False, True):
                cell = dict(batch=max(1, tokens // seqlen), seqlen=seqlen, nheads=max(1, width // head_dim),
                            head_dim=head_dim, causal=causal)
                rows["forward"].append(_guarded(forward_cell, cell, timer, device, on_row, "forward"))
        for causal in (False, True) if "varlen" in kinds else ():
            cell = dict(lengths=varlen_lengths, nheads=max(1, width // head_dim), head_dim=head_dim, causal=causal)
            rows["varlen"].append(_guarded(varlen_cell, cell, timer, device, on_row, "varlen"))
    for batch, cache_len in decode_shapes if "decode" in kinds else ():
        rows["decode"].append(_guarded(decode_cell, dict(batch=batch, cache_len=cache_len, graphs=graphs), timer,
                                       device, on_row, "decode"))
    return rows


def _guarded(cell, kwargs: dict, timer, device, on_row, kind: str) -> dict:
    try:
        row = cell(**kwargs, timer=timer, device=device)
    except Exception as exc:  # noqa: BLE001 - one failed cell must not end the run
        row = {**kwargs, "status": f"error: {common.describe_error(exc)}"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if on_row is not None:
        on_row(kind, row)
    return row


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def forward_table(rows: list[dict]) -> str:
    """The forward cells: TFLOP/s of our bf16 forward, the FP8 kernel and FP8 end to end, and the ratios."""
    lines = ["| d | N | causal | bf16 TF/s | fp8 kernel TF/s | x bf16 | fp8 e2e TF/s | x bf16 | quantize ms | "
             "fp8 rmse | status |", "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r.get('D', r.get('head_dim'))} | {_tokens(r)} | {r.get('causal')} | "
            f"{_fmt(r.get('bf16_tflops'), '.0f')} | {_fmt(r.get('fp8_kernel_tflops'), '.0f')} | "
            f"{_fmt(r.get('fp8_kernel_speedup_vs_bf16'), '.2f')} | {_fmt(r.get('fp8_e2e_tflops'), '.0f')} | "
            f"{_fmt(r.get('fp8_e2e_speedup_vs_bf16'), '.2f')} | {_fmt(r.get('quantize_ms'), '.3f')} | "
            f"{_fmt(r.get('fp8_e2e_rmse'), '.2e')} | {r.get('status')} |")
    return "\n".join(lines)


def _tokens(row: dict) -> str:
    """The N column: the sequence length, or a packed cell's lengths."""
    lengths = row.get("lengths")
    return "packed " + " + ".join(map(str, lengths)) if lengths else str(row.get("N", row.get("seqlen")))


def decode_table(rows: list[dict]) -> str:
    """The decode cells: the step on the bf16 cache against the FP8 cache (us, GB/s, time ratio)."""
    lines = ["| B x L | bf16 cache us | GB/s | fp8 cache us | GB/s | fp8 / bf16 | status |", "|" + "---|" * 7]
    for r in rows:
        prefix = "graph" if "bf16_graph_ms" in r else "step"
        us = {name: r.get(f"{name}_{prefix}_ms") for name in ("bf16", "fp8")}
        lines.append(
            f"| {r.get('B', r.get('batch'))} x {r.get('L', r.get('cache_len'))} | "
            f"{_fmt(us['bf16'] and us['bf16'] * 1e3, '.1f')} | {_fmt(r.get(f'bf16_{prefix}_GBps'), '.0f')} | "
            f"{_fmt(us['fp8'] and us['fp8'] * 1e3, '.1f')} | {_fmt(r.get(f'fp8_{prefix}_GBps'), '.0f')} | "
            f"{_fmt(r.get(f'fp8_over_bf16_{prefix}'), '.2f')} | {r.get('status')} |")
    return "\n".join(lines)


def markdown(rows: dict, gpu: str) -> str:
    """The forward and decode tables."""
    return "\n".join([f"## FP8 attention on {gpu}", "", forward_table(rows["forward"] + rows.get("varlen", [])), "",
                      decode_table(rows["decode"])])


def _narrowed(args) -> dict:
    """``run``'s arguments from ``--headdims``, ``--seqlens`` and ``--only`` (kinds of cells), where given."""
    kwargs = {}
    if getattr(args, "headdims", None):
        if any(d != dv for d, dv in args.headdims):
            args.parser.error(f"--suite fp8 takes one head dim for q, k and v, got {args.headdims}")
        kwargs["head_dims"] = tuple(d for d, _ in args.headdims)
    if getattr(args, "seqlens", None):
        kwargs["seqlens"] = tuple(args.seqlens)
    if getattr(args, "only", None):
        unknown = sorted(set(args.only) - set(KINDS))
        if unknown:
            args.parser.error(f"--suite fp8 --only takes {' '.join(KINDS)}, got {' '.join(unknown)}")
        kwargs["kinds"] = tuple(args.only)
    return kwargs


def main_with_args(args) -> int:
    """``--suite fp8``: the GPU run (on CPU: a smoke run of tiny shapes through the torch FP8 math)."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        timer, kwargs = common.gpu_timer(), {}
        gpu = torch.cuda.get_device_name(device)
    else:
        timer, gpu = common.cpu_timer(runs=1), "cpu"
        kwargs = dict(head_dims=(64,), seqlens=(256,), decode_shapes=((2, 512),), graphs=False, tokens=256, width=128,
                      varlen_lengths=(100, 29, 127))
    kwargs.update(_narrowed(args))
    started = time.perf_counter()
    rows = run(device, timer, on_row=lambda kind, row: common.log(f"fp8 {kind}: {row.get('status')}"), **kwargs)
    payload = {"schema": "flashtile.bench.fp8/1", "gpu": gpu, "env": common.base_env(),
               "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu.replace(' ', '_')}-fp8-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    print(markdown(rows, gpu))
    print(f"\nwrote {path} ({payload['seconds']} s)")
    statuses = [r.get("status", "") for kind in rows.values() for r in kind]
    return 0 if statuses and not any(s.startswith(("wrong", "error")) for s in statuses) else 1

