"""GPU sweep: flashtile against torch SDPA (flash, cuDNN, efficient) and FlexAttention, in one run.

Shapes keep the token count and model width fixed, as the peer file does:
``batch = 16384 // seqlen`` and ``nheads = 2048 // headdim``.

Timing is ``triton.testing.do_bench(..., return_mode="median")`` (L2 flushed before each run).
Forward times the forward call alone. Backward times ``out.backward(dout, retain_graph=True)``
alone on one retained forward graph, gradients reset outside the timed region; only if a
provider refuses that, ``do_bench(fwd + backward) - do_bench(fwd)`` is used, and the row says so
in ``bwd_method``. Every failure (unsupported shape, OOM, compile error) becomes a row with
``fwd_err``/``bwd_err``/``mem_err`` instead of stopping the sweep.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Callable, NamedTuple

import torch

from . import common

PROVIDERS = ("flashtile", "flash", "cudnn", "efficient", "flex")
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096, 16384)
HEADDIMS = (64, 128)
TOKENS, WIDTH = 16384, 2048  # batch * seqlen and nheads * headdim, fixed across the sweep
MEM_SEQLEN = 8192  # peak memory of forward + backward is measured at this seqlen
WARMUP_MS, REP_MS = 25, 100

NOTE = (
    "bf16 unless env.dtype says otherwise; triton.testing.do_bench(warmup=25, rep=100, return_mode='median'). "
    "B = 16384 // N, H = 2048 // D. fwd TFLOP/s = 4*B*H*N*N*D (/2 causal) / fwd time; "
    "bwd TFLOP/s = 2.5x fwd FLOPs / time of out.backward(dout, retain_graph=True) alone (bwd_method). "
    "SDPA peers on (B,H,N,D) contiguous copies under sdpa_kernel(<backend>); flex = "
    "torch.compile(flex_attention, dynamic=False), causal via create_block_mask, torch._dynamo.reset() "
    "before each shape, compile time excluded, compiled with torch._functorch.config.donated_buffer=False "
    "so its backward can be re-run on a retained graph. max_abs_err: |out - attention_ref fp32| "
    "(flashtile.testing). mem: max_memory_allocated during one forward+backward minus what was allocated "
    "before it (inputs, dout)."
)


class Provider(NamedTuple):
    """What a provider needs measured: its forward, the leaves that get gradients, the upstream
    gradient in its layout, a context to run inside, and whether it works in (B, H, S, D)."""

    fwd: Callable
    leaves: tuple
    dout: torch.Tensor
    scope: contextlib.AbstractContextManager
    heads_first: bool


def _sdpa_provider(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def build(inputs, causal):
        qt, kt, vt = inputs["bhsd"]
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        # The kernel choice happens in forward; backward follows the op forward recorded.
        return Provider(fwd, (qt, kt, vt), inputs["dout_bhsd"], sdpa_kernel(backend), heads_first=True)

    return build


def _flashtile_provider(inputs, causal):
    import flashtile

    q, k, v = inputs["bshd"]
    fwd = lambda: flashtile.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    return Provider(fwd, (q, k, v), inputs["dout_bshd"], contextlib.nullcontext(), heads_first=False)


def _flex_provider(inputs, causal):
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = inputs["bhsd"]
    seqlen = qt.shape[2]
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no stale guards
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        block_mask = create_block_mask(
            lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=qt.device
        )
    fwd = lambda: compiled(qt, kt, vt, block_mask=block_mask)  # noqa: E731
    # Donated buffers forbid backward(retain_graph=True); turn them off while flex compiles and runs.
    scope = torch._functorch.config.patch(donated_buffer=False)
    return Provider(fwd, (qt, kt, vt), inputs["dout_bhsd"], scope, heads_first=True)


BUILDERS = {
    "flashtile": _flashtile_provider,
    "flash": _sdpa_provider("FLASH_ATTENTION"),
    "cudnn": _sdpa_provider("CUDNN_ATTENTION"),
    "efficient": _sdpa_provider("EFFICIENT_ATTENTION"),
    "flex": _flex_provider,
}


def _make_inputs(batch, seqlen, nheads, headdim, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch, seqlen, nheads, headdim)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    bhsd = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    return {
        "bshd": [x.requires_grad_() for x in (q, k, v)],
        "bhsd": bhsd,
        "dout_bshd": dout,
        "dout_bhsd": dout.transpose(1, 2).contiguous(),
    }


def _clear_grads(leaves):
    for t in leaves:
        t.grad = None


def _free_cuda():
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken CUDA context fails every later cell, which marks it
        pass


def _peak_extra_bytes(fwd, leaves, dout) -> int:
    """Peak bytes allocated by one forward + backward beyond what was already allocated."""
    _clear_grads(leaves)
    _free_cuda()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fwd()
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    _clear_grads(leaves)
    return peak


def measure(provider, inputs, causal, reference, shape, do_bench, measure_memory) -> tuple[dict, dict | None]:
    """One provider on one shape: ``(row, mem_row or None)``; failures land in the row as text."""
    batch, seqlen, nheads, headdim = shape
    flops = common.fwd_flops(batch, nheads, seqlen, headdim, causal)
    row = {"D": headdim, "N": seqlen, "B": batch, "H": nheads, "causal": causal, "prov": provider}
    try:
        p = BUILDERS[provider](inputs, causal)
    except Exception as exc:  # noqa: BLE001 - an unavailable provider is a marked cell
        row["fwd_err"] = common.describe_error(exc)
        return row, None
    mem_row = None
    with p.scope:
        out = None
        try:
            start = time.perf_counter()
            out = p.fwd()  # the first call compiles (Triton, inductor): excluded from the timings
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            try:
                if reference is not None:
                    row["max_abs_err"] = common.max_abs_err(out.transpose(1, 2) if p.heads_first else out, reference)
            except Exception as exc:  # noqa: BLE001 - a failed check must not hide the timing
                row["check_err"] = common.describe_error(exc)
            row["fwd_ms"] = do_bench(p.fwd, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
            row["fwd_tflops"] = common.tflops(flops, row["fwd_ms"])
        except Exception as exc:  # noqa: BLE001
            row["fwd_err"] = common.describe_error(exc)
        if "fwd_err" not in row:
            row.update(_time_backward(p, out, do_bench, row["fwd_ms"]))
            row["bwd_tflops"] = common.tflops(common.BWD_FLOPS_FACTOR * flops, row.get("bwd_ms"))
        out = None  # frees the retained graph before the memory measurement
        _clear_grads(p.leaves)
        if measure_memory and "fwd_err" not in row:
            mem_row = {key: row[key] for key in ("D", "N", "B", "H", "causal", "prov")}
            try:
                mem_row["peak_extra_GB"] = _peak_extra_bytes(p.fwd, p.leaves, p.dout) / 1e9
                row["peak_extra_GB"] = mem_row["peak_extra_GB"]
            except Exception as exc:  # noqa: BLE001
                mem_row["mem_err"] = common.describe_error(exc)
    _clear_grads(p.leaves)
    _free_cuda()
    return row, mem_row


def _time_backward(p: Provider, out, do_bench, fwd_ms: float) -> dict:
    """Backward time of ``out``'s graph: ``backward(retain_graph=True)`` alone, else (fwd+bwd) - fwd."""
    try:
        out.backward(p.dout, retain_graph=True)  # the first backward compiles too
        _clear_grads(p.leaves)
        bwd = lambda: out.backward(p.dout, retain_graph=True)  # noqa: E731
        ms = do_bench(bwd, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=list(p.leaves), return_mode="median")
        return {"bwd_ms": ms, "bwd_method": "backward(retain_graph=True)"}
    except Exception as exc:  # noqa: BLE001
        retained_err = common.describe_error(exc)
    _clear_grads(p.leaves)
    try:
        both = lambda: p.fwd().backward(p.dout)  # noqa: E731
        total = do_bench(both, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=list(p.leaves), return_mode="median")
        return {"bwd_ms": total - fwd_ms, "bwd_method": f"fwd+bwd minus fwd (retain_graph failed: {retained_err})"}
    except Exception as exc:  # noqa: BLE001
        return {"bwd_err": common.describe_error(exc)}


def _env(dtype_name: str) -> dict:
    import triton

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    env = common.base_env()
    env.update(
        {
            "gpu": torch.cuda.get_device_name(index),
            "sms": props.multi_processor_count,
            "gpu_mem_GB": round(props.total_memory / 1e9, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "triton": triton.__version__,
            "dtype": dtype_name,
        }
    )
    return env


def _cell(row: dict | None, stage: str) -> str:
    """TFLOP/s of ``stage`` (fwd or bwd) in a row, or its error label (a failed forward fails both)."""
    if row is None:
        return "-"
    err = row.get("fwd_err") or row.get(f"{stage}_err")
    return common.short_error(err) if err else common.fmt(row.get(f"{stage}_tflops"), 0)


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or not a.get(key) or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}"


def format_tables(rows: list[dict], mem_rows: list[dict], providers: list[str]) -> str:
    """Per shape: TFLOP/s ``fwd / bwd`` of each provider, flashtile's ratios to flash and cuDNN, and its error."""
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault((r["D"], r["causal"], r["N"], r["B"], r["H"]), {})[r["prov"]] = r
    headers = ["hdim", "causal", "seqlen", "BxH"] + [f"{p} fwd/bwd" for p in providers]
    if "flashtile" in providers:
        headers += [f"ft/{p} fwd/bwd" for p in ("flash", "cudnn") if p in providers]
    headers += [f"{p} max err" for p in ("flashtile", "flash") if p in providers]
    table = []
    for (d, causal, n, b, h), cells in sorted(by_shape.items(), key=lambda item: item[0]):
        line = [str(d), str(causal).lower(), str(n), f"{b}x{h}"]
        for p in providers:
            r = cells.get(p)
            line.append(_cell(r, "fwd") if r and r.get("fwd_err") else f"{_cell(r, 'fwd')} / {_cell(r, 'bwd')}")
        if "flashtile" in providers:
            ft = cells.get("flashtile")
            for p in ("flash", "cudnn"):
                if p in providers:
                    line.append(f"{_ratio(ft, cells.get(p), 'fwd_tflops')} / {_ratio(ft, cells.get(p), 'bwd_tflops')}")
        for p in ("flashtile", "flash"):
            if p in providers:
                r = cells.get(p)
                line.append(f"{r['max_abs_err']:.1e}" if r and r.get("max_abs_err") is not None else "-")
        table.append(line)
    out = ["TFLOP/s (forward / backward); ft = flashtile; max err = max|out - fp32 reference|",
           common.markdown_table(headers, table)]
    if mem_rows:
        order = {p: i for i, p in enumerate(PROVIDERS)}
        mem_rows = sorted(mem_rows, key=lambda m: (m["D"], m["causal"], m["N"], order.get(m["prov"], 99)))
        mem_table = [
            [str(m["D"]), str(m["causal"]).lower(), str(m["N"]), m["prov"],
             common.short_error(m["mem_err"]) if m.get("mem_err") else common.fmt_bytes(m["peak_extra_GB"] * 1e9)]
            for m in mem_rows
        ]
        out += ["", f"Peak extra memory of forward + backward at seqlen {MEM_SEQLEN}",
                common.markdown_table(["hdim", "causal", "seqlen", "provider", "peak extra"], mem_table)]
    return "\n".join(out)


def run(args) -> tuple[dict, str]:
    """Run the sweep; returns ``(payload, table)`` after writing the JSON file (also after each shape)."""
    from triton.testing import do_bench

    import flashtile

    dtype_name = args.dtype or "bf16"
    dtype = common.DTYPES[dtype_name]
    device = torch.device("cuda", torch.cuda.current_device())
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    headdims = args.headdims or HEADDIMS
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal or "both"]
    providers = args.providers or list(PROVIDERS)

    env = _env(dtype_name)
    path = common.result_path(args.out, common.gpu_slug(env["gpu"]), env["date"])
    payload = {"kind": "gpu", "env": env, "note": NOTE, "attn": [], "mem": [], "flashtile_stats": None}
    previous = common.load_previous(path, env, ("gpu", "dtype", "git_commit", "torch", "triton"))
    flashtile.reset_stats()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        common.log("WARNING: TRITON_INTERPRET is set: flashtile's kernels run in Triton's interpreter, not on the GPU")
    common.log(f"flashtile bench on {env['gpu']} ({env['sms']} SMs), {dtype_name}, providers {', '.join(providers)}; results -> {path}")
    for headdim in headdims:
        for causal in causals:
            for seqlen in seqlens:
                batch, nheads = max(1, TOKENS // seqlen), max(1, WIDTH // headdim)
                shape = (batch, seqlen, nheads, headdim)
                common.log(f"-- hdim {headdim} causal {causal} seqlen {seqlen} batch {batch} nheads {nheads}")
                try:
                    inputs = _make_inputs(batch, seqlen, nheads, headdim, dtype, device)
                    q, k, v = (x.detach() for x in inputs["bshd"])
                    reference = None if args.no_check else common.reference_output(q, k, v, causal)  # fp32
                except Exception as exc:  # noqa: BLE001
                    label = common.describe_error(exc)
                    common.log(f"   inputs/reference failed: {label}")
                    payload["attn"].extend(
                        {"D": headdim, "N": seqlen, "B": batch, "H": nheads, "causal": causal, "prov": p, "fwd_err": label}
                        for p in providers
                    )
                    _free_cuda()
                    continue
                for provider in providers:
                    calls_before = flashtile.stats()["calls"]
                    try:
                        row, mem_row = measure(provider, inputs, causal, reference, shape, do_bench, seqlen == MEM_SEQLEN)
                    except Exception as exc:  # noqa: BLE001 - e.g. a cleanup after a broken CUDA context
                        row = {"D": headdim, "N": seqlen, "B": batch, "H": nheads, "causal": causal, "prov": provider,
                               "fwd_err": common.describe_error(exc)}
                        mem_row = None
                    if provider == "flashtile":  # which backend really ran: Triton, unless something fell back
                        calls = flashtile.stats()["calls"]
                        row["backend"] = sorted(b for b, n in calls.items() if n > calls_before.get(b, 0))
                    payload["attn"].append(row)
                    if mem_row:
                        payload["mem"].append(mem_row)
                    common.log(f"   {provider:<10} {_progress(row)}")
                del inputs, reference, q, k, v
                _free_cuda()
                payload["flashtile_stats"] = flashtile.stats()
                common.write_json(path, common.merged(payload, previous))
    payload["flashtile_stats"] = flashtile.stats()
    payload = common.merged(payload, previous)
    common.write_json(path, payload)
    shown = [p for p in PROVIDERS if p in providers or any(r["prov"] == p for r in payload["attn"])]
    table = format_tables(payload["attn"], payload["mem"], shown)
    if payload.get("rows_from_earlier_run"):
        table += f"\n{payload['rows_from_earlier_run']} rows above come from an earlier run of this commit today ({path.name})"
    fallbacks = (payload["flashtile_stats"] or {}).get("fallbacks")
    if fallbacks:
        table += f"\nWARNING: flashtile fell back from Triton during the run: {fallbacks}"
    table += f"\nwrote {path}"
    return payload, table


def _progress(row: dict) -> str:
    if row.get("fwd_err"):
        return f"fwd failed: {row['fwd_err']}"
    text = f"fwd {row['fwd_ms']:.3f} ms {row['fwd_tflops']:.0f} TFLOP/s"
    if row.get("max_abs_err") is not None:
        text += f", err {row['max_abs_err']:.1e}"
    if row.get("bwd_err"):
        return text + f"; bwd failed: {row['bwd_err']}"
    return text + f"; bwd {row['bwd_ms']:.3f} ms {row['bwd_tflops']:.0f} TFLOP/s"
