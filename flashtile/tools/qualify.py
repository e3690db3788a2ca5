"""``python -m flashtile qualify``: the qualification matrix of a model's attention calls.

From a Hugging Face ``config.json`` (or explicit shapes) it derives the calls the model makes:
per distinct layer type (global, sliding window) with its softcap and sinks, a causal prefill
at several lengths (forward and backward), a decode step (one query, forward) against several
cache lengths, and a varlen call (packed sequences of different lengths, forward and backward). For each call it asks :func:`flashtile.explain` which backend and kernel would
run, runs it on random inputs, checks out/lse (and dq/dk/dv, dsink with sinks, for prefill and varlen) against
:func:`flashtile.testing.attention_ref` with the tolerance rule of
:func:`flashtile.testing.assert_close_to_ref`, and times it. Any call that falls back, misses
tolerance or cannot run makes the exit status 1, so the command can gate a deployment.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

from . import ToolError, flatten, int_list, model_config, print_json, readable_errors

# (out/lse atol, gradient atol) on top of twice the input-dtype reference's error; as tests/test_attention.py.
DEFAULT_PREFILL = {"cuda": [128, 512, 2048], "cpu": [64, 257]}
DEFAULT_DECODE = {"cuda": [1000, 4096], "cpu": [100, 300]}
DEFAULT_BATCH = {"cuda": 2, "cpu": 1}
OK, SKIPPED, FALLBACK, TOLERANCE, UNSUPPORTED, ERROR = "ok", "skipped", "fallback", "tolerance", "unsupported", "error"
PASSING = (OK, SKIPPED)

EXAMPLES = """\
examples:
  python -m flashtile qualify --config tiny-llama                     # a bundled toy: seconds on a CPU
  python -m flashtile qualify --config path/to/Meta-Llama-3-8B/config.json --out results/
  python -m flashtile qualify --config gemma-2-9b --prefill 1024 4096 --decode 8192 --batch 4
  python -m flashtile qualify --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16
  python -m flashtile qualify --config mistral-7b --json > mistral-7b.json
  FLASHTILE_DISABLE_BACKENDS=triton python -m flashtile qualify --config tiny-llama   # a forced fallback: exit 1

--config takes a config.json, a checkpoint directory holding one, or a bundled name (llama-3-8b,
llama-3-70b, mistral-7b, gemma-2-9b, gpt-oss-20b, gpt-oss-120b, qwen3-8b, deepseek-v3; tiny-llama is a toy);
only the local file is read. Calls per distinct layer type: causal prefill at --prefill lengths
(forward + backward), decode (1 query) at --decode cache lengths (forward), varlen: the first prefill length and shorter ones packed into one
flash_attn_varlen_func call (forward + backward); a sliding layer of window W calls
window_size=(W-1, 0); sinks are a random learnable (nheads,) float32 tensor. Defaults: GPU prefill 128 512 2048, decode 1000 4096, batch 2, the config's dtype;
CPU prefill 64 257, decode 100 300, batch 1, float16 under TRITON_INTERPRET=1 (bfloat16 is broken
in Triton's interpreter) else float32. Errors: max|ours - ref| over out, lse, dq, dk, dv (dsink), where ref
is attention_ref in float64 (CPU) / float32 (GPU); a call passes when every tensor is within
2 x max|ref in the input dtype - ref| + atol. Times: triton.testing.do_bench median (GPU),
median of --runs wall-clock runs (CPU). Writes <out>/qualify-<model>-<device>.md and .json.
Exit status: 0 when every call runs on its preferred backend within tolerance, 1 when any
falls back, misses tolerance or cannot run, 2 for a bad path or config.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "qualify",
        help="the qualification matrix: a model's attention calls, backend, error and time (exit 1 on any fallback)",
        description=(
            "Derive the attention calls a model makes (from a Hugging Face config.json or explicit shapes) and, "
            "for each, report the backend and kernel chosen, the max error against the reference, and the time. "
            "Exit status 1 when any call falls back, misses tolerance or cannot run."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_config.add_shape_arguments(parser, layers=False, dtype_default="see below")
    parser.add_argument("--softcap", type=float, metavar="X", help="attention logit softcap (Gemma-2: 50)")
    parser.add_argument("--batch", type=int, metavar="B", help="sequences per call (GPU default 2, CPU 1)")
    parser.add_argument("--prefill", nargs="+", type=int_list, metavar="N", help="prefill lengths, e.g. 128 512 2048")
    parser.add_argument("--decode", nargs="+", type=int_list, metavar="N", help="decode cache lengths, e.g. 1000 4096")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto (default): cuda when torch sees a GPU")
    parser.add_argument("--runs", type=int, default=3, metavar="R", help="timed runs on CPU (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: %(default)s)")
    parser.add_argument("--out", default="flashtile-results", metavar="DIR",
                        help="where the .md and .json go, named with the date and time (default: %(default)s in the "
                             "current directory)")
    parser.add_argument("--json", action="store_true", help="print the JSON on stdout (the table goes to stderr)")
    parser.set_defaults(func=run, parser=parser)
    return parser


@dataclass
class Call:
    """One attention call a model makes; ``layers`` of its layers make it."""

    layer: str  # model_config.FULL or SLIDING
    layers: int
    phase: str  # "prefill", "decode" or "varlen"
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    headdim_v: int = 0  # the values' head dim where it differs (MLA), else 0
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    softmax_scale: float | None = None
    causal: bool = True
    # varlen: the length of each packed sequence (queries and keys alike); batch = len(seqlens).
    seqlens: tuple = ()

    def kwargs(self) -> dict:
        """The keyword arguments of ``flash_attn_func`` / ``explain`` (sinks aside)."""
        return {"softmax_scale": self.softmax_scale, "causal": self.causal,
                "window_size": tuple(self.window_size), "softcap": self.softcap}

    def features(self) -> str:
        parts = ["causal"] if self.causal else []
        if tuple(self.window_size) != (-1, -1):
            parts.append(f"window {self.window_size[0]},{self.window_size[1]}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.seqlens:
            parts.append(f"{len(self.seqlens)} packed sequences")
        return ", ".join(parts) or "-"


def derive_calls(shape: model_config.ModelShape, batch: int, prefill: list[int], decode: list[int]) -> list[Call]:
    """Prefill and decode calls for every distinct layer type of ``shape``, then the varlen case."""
    calls = []
    for kind, count in shape.layer_counts().items():
        # A sliding layer sees its last `sliding_window` keys, itself included (transformers' convention).
        window = (shape.sliding_window - 1, 0) if kind == model_config.SLIDING else (-1, -1)
        common = dict(layer=kind, layers=count, batch=batch, nheads=shape.num_heads, nheads_kv=shape.num_kv_heads,
                      headdim=shape.head_dim, headdim_v=shape.head_dim_v or 0, window_size=window, softcap=shape.softcap or 0.0, sinks=shape.sinks,
                      softmax_scale=shape.softmax_scale)
        calls += [Call(phase="prefill", seqlen_q=n, seqlen_k=n, **common) for n in prefill]
        calls += [Call(phase="decode", seqlen_q=1, seqlen_k=n, **common) for n in decode]
    first = calls[0] if calls else None
    if first is not None:
        # The first layer type at the first prefill length, packed with two shorter sequences.
        n = first.seqlen_q
        seqlens = (n, max(1, n // 2), max(1, n // 3))
        calls.append(Call(**{**asdict(first), "layer": "all", "layers": shape.num_layers, "phase": "varlen",
                             "batch": len(seqlens), "seqlens": seqlens}))
    return calls


def _reference(q, k, v, dout, kwargs: dict, hi: bool, sink=None, varlen: dict | None = None) -> dict:
    """attention_ref's out, lse (and gradients, dsink included, when ``dout`` is given): ``hi`` in
    float64 on CPU / float32 on GPU, else in the input dtype (the "lo" reference of the tolerance rule).
    ``varlen`` holds ``cu_seqlens_q`` / ``cu_seqlens_k`` for a packed call."""
    import torch

    from ..testing import attention_ref, attention_varlen_ref

    dtype = q.dtype
    if hi:
        dtype = torch.float64 if (q.device.type == "cpu" or q.dtype == torch.float32) else torch.float32
    grad = dout is not None
    leaves = [t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v)]
    if sink is not None:
        leaves.append(sink.detach().to(dtype).requires_grad_(grad))
    sink = leaves[3] if sink is not None else None
    with torch.set_grad_enabled(grad):
        if varlen:
            out, lse = attention_varlen_ref(*leaves[:3], sink=sink, upcast=False, **varlen, **kwargs)
        else:
            out, lse = attention_ref(*leaves[:3], sink=sink, upcast=False, **kwargs)
        result = {"out": out, "lse": lse}
        if grad:
            result.update(zip(("dq", "dk", "dv", "dsink"), torch.autograd.grad(out, leaves, dout.to(dtype))))
    return result


def _check(ours: dict, ref_hi: dict, ref_lo: dict, dtype_name: str) -> tuple[dict, list[str]]:
    """Max error of each tensor and the tolerance failures (messages of assert_close_to_ref)."""
    import torch

    from ..testing import ATOL, assert_close_to_ref, max_abs_error

    atol_out, atol_grad = ATOL[getattr(torch, dtype_name)]
    errors, failures = {}, []
    for name, value in ours.items():
        errors[name] = max_abs_error(value, ref_hi[name])
        try:
            assert_close_to_ref(name, value, ref_hi[name], ref_lo[name], atol_out if name in ("out", "lse") else atol_grad)
        except AssertionError as failure:
            failures.append(str(failure))
    return errors, failures


def _time_ms(fn, device: str, runs: int, grad_to_none=None) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _delta(before: dict, after: dict) -> dict:
    return {key: after.get(key, 0) - before.get(key, 0) for key in after if after.get(key, 0) != before.get(key, 0)}


def _new_row(call: Call, dtype_name: str) -> dict:
    return {**asdict(call), "window_size": list(call.window_size), "features": call.features(), "dtype": dtype_name,
            "backend": None, "kernel": None, "preferred": None, "fallback": False, "rejected": {}, "config": {},
            "explain": None, "errors": {}, "fwd_ms": None, "fwd_bwd_ms": None, "status": None, "reasons": []}


def _attention(q, k, v, kwargs: dict, varlen: dict | None, **extra):
    """``flash_attn_func`` or, for a packed call, ``flash_attn_varlen_func``."""
    import flashtile

    if varlen:
        return flashtile.flash_attn_varlen_func(q, k, v, varlen["cu_seqlens_q"], varlen["cu_seqlens_k"],
                                                varlen["max_seqlen"], varlen["max_seqlen"], **kwargs, **extra)
    return flashtile.flash_attn_func(q, k, v, **kwargs, **extra)


def _run_once(q, k, v, kwargs: dict, grad: bool, generator, varlen: dict | None = None) -> tuple[dict, object]:
    """flashtile's out and lse (and dq, dk, dv, dsink for a random upstream gradient when ``grad``), and that gradient."""
    import torch

    from ..testing import random_like

    with torch.set_grad_enabled(grad):
        out, lse, _ = _attention(q, k, v, kwargs, varlen, return_attn_probs=True)
        ours = {"out": out, "lse": lse}
        dout = random_like(out, generator) if grad else None
        if grad:
            leaves = [q, k, v] + ([kwargs["sink"]] if "sink" in kwargs else [])
            ours.update(zip(("dq", "dk", "dv", "dsink"), torch.autograd.grad(out, leaves, dout)))
    return ours, dout


def _inputs(call: Call, device: str, dtype, grad: bool, generator):
    """Random q, k, v of the call (packed for varlen) and, for varlen, the offsets."""
    from ..testing import cu_seqlens_of, make_qkv

    varlen = None
    if not call.seqlens:
        q, k, v = make_qkv(call.batch, call.seqlen_q, call.seqlen_k, call.nheads, call.nheads_kv, call.headdim, dtype,
                           device, requires_grad=False, generator=generator)
    else:
        total = sum(call.seqlens)
        q, k, v = (t[0] for t in make_qkv(1, total, total, call.nheads, call.nheads_kv, call.headdim, dtype, device,
                                          requires_grad=False, generator=generator))
        cu = cu_seqlens_of(call.seqlens, device)
        varlen = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen": max(call.seqlens)}
    if call.headdim_v:
        v = v[..., :call.headdim_v].contiguous()  # narrower values (MLA): random columns all the same
    return tuple(t.requires_grad_(grad) for t in (q, k, v)), varlen


def qualify_call(call: Call, device: str, dtype_name: str, runs: int, seed: int) -> dict:
    """Explain, run, check and time one call; returns its row (``status`` and ``reasons`` say how it went)."""
    import torch

    import flashtile
    from ..bench.common import describe_error

    row = _new_row(call, dtype_name)
    generator = torch.Generator().manual_seed(seed)
    grad = call.phase in ("prefill", "varlen")
    (q, k, v), varlen = _inputs(call, device, getattr(torch, dtype_name), grad, generator)
    kwargs = call.kwargs()
    ref_kwargs = dict(kwargs)
    sink = None
    if call.sinks:
        sink = torch.randn(call.nheads, generator=generator).to(device).requires_grad_(grad)
        kwargs["sink"] = sink

    explain_varlen = {}
    if varlen:
        explain_varlen = dict(cu_seqlens_q=varlen["cu_seqlens_q"], cu_seqlens_k=varlen["cu_seqlens_k"],
                              max_seqlen_q=varlen["max_seqlen"], max_seqlen_k=varlen["max_seqlen"])
    explanation = flashtile.explain(q, k, v, **kwargs, **explain_varlen).to_dict()
    row.update(preferred=explanation.get("preferred"), rejected=explanation.get("rejected") or {}, explain=explanation)
    if explanation.get("error"):
        row.update(status=UNSUPPORTED, reasons=[explanation["error"]])
        return row
    row.update(backend=explanation.get("backend"), kernel=explanation.get("kernel") or None,
               fallback=bool(explanation.get("fallback")), config=explanation.get("config") or {})

    before = flashtile.stats()
    try:
        ours, dout = _run_once(q, k, v, kwargs, grad, generator, varlen)
    except flashtile.FallbackError as error:
        row.update(status=FALLBACK, fallback=True, reasons=[f"strict mode refused the call: {error}"])
        return row
    except NotImplementedError as error:
        row.update(status=UNSUPPORTED, reasons=[f"{error} (explain did not say so)"])
        return row
    except Exception as error:  # noqa: BLE001 - one failed call is a row of the report, not the end of it
        row.update(status=ERROR, reasons=[describe_error(error)])
        return row
    after = flashtile.stats()
    ran, fell_back = _delta(before["calls"], after["calls"]), _delta(before["fallbacks"], after["fallbacks"])
    reasons = []
    mispredicted = ran != {row["backend"]: 1}
    if mispredicted:
        reasons.append(f"explain predicted the {row['backend']} backend but {sorted(ran)} ran")
    if row["fallback"] or fell_back:
        row["fallback"] = True
        why = explanation.get("fallback_reason") or ", ".join(fell_back)
        reasons.append(f"fell back from {row['preferred']} to {row['backend']}: {why}")

    ref_varlen = None if varlen is None else {"cu_seqlens_q": varlen["cu_seqlens_q"], "cu_seqlens_k": varlen["cu_seqlens_k"]}
    ref_hi = _reference(q, k, v, dout, ref_kwargs, hi=True, sink=sink, varlen=ref_varlen)
    ref_lo = _reference(q, k, v, dout, ref_kwargs, hi=False, sink=sink, varlen=ref_varlen)
    row["errors"], failures = _check(ours, ref_hi, ref_lo, dtype_name)
    reasons += failures

    def forward():
        with torch.no_grad():
            _attention(q, k, v, kwargs, varlen)

    def forward_backward():
        _attention(q, k, v, kwargs, varlen).backward(dout)

    row["fwd_ms"] = _time_ms(forward, device, runs)
    if grad:
        leaves = [q, k, v] + ([sink] if sink is not None else [])
        row["fwd_bwd_ms"] = _time_ms(forward_backward, device, runs, grad_to_none=leaves)
    status = ERROR if mispredicted else TOLERANCE if failures else FALLBACK if row["fallback"] else OK
    row.update(status=status, reasons=reasons)
    return row


def _fmt_ms(value) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def table(rows: list[dict]) -> str:
    from ..bench.common import markdown_table

    body = []
    for i, r in enumerate(rows, 1):
        err = max(r["errors"].values()) if r["errors"] else None
        layers = f"{r['layer']} x{r['layers']}"
        body.append([
            str(i), layers, r["phase"], "+".join(map(str, r["seqlens"])) if r.get("seqlens") else f"{r['seqlen_q']}x{r['seqlen_k']}", f"{r['nheads']}/{r['nheads_kv']}",
            f"{r['headdim']}/{r['headdim_v']}" if r.get("headdim_v") else str(r["headdim"]), r["dtype"], r["features"],
            r["backend"] or "-", r["kernel"] or "-", "-" if err is None else f"{err:.2e}",
            _fmt_ms(r["fwd_ms"]), _fmt_ms(r["fwd_bwd_ms"]), r["status"],
        ])
    headers = ["#", "layers", "call", "q x k", "heads", "d", "dtype", "features", "backend", "forward kernel",
               "max err", "fwd ms", "fwd+bwd ms", "status"]
    lines = [markdown_table(headers, body)]
    notes = [f"- #{i} {r['status']}: {reason}" for i, r in enumerate(rows, 1) if r["status"] != OK for reason in r["reasons"]]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def summary_line(name: str, device: str, rows: list[dict], exit_status: int) -> str:
    counts: dict = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    parts = ", ".join(f"{n} {status}" for status, n in counts.items())
    verdict = "PASS" if exit_status == 0 else "FAIL"
    return f"qualify {name} on {device}: {len(rows)} calls: {parts} -> {verdict} (exit {exit_status})"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-") or "model"


def _device_info(device: str) -> dict:
    import torch

    from ..bench.common import gpu_slug

    if device == "cuda":
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        return {"type": "cuda", "name": name, "compute_capability": f"{major}.{minor}", "slug": gpu_slug(name)}
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return {"type": "cpu", "name": "cpu" + (" (TRITON_INTERPRET=1)" if interpret else ""), "slug": "cpu",
            "triton_interpret": interpret}


def markdown(payload: dict, rows_table: str) -> str:
    env, shape, device = payload["env"], payload["shape"], payload["device"]
    settings = payload["settings"]
    lines = [
        f"# flashtile qualify: {payload['model']} on {device['name']}",
        "",
        f"- model: `{payload['source']}`: {payload['shape_summary']}",
        *(f"- note: {note}" for note in shape["notes"]),
        f"- device: {device['name']}"
        + (f", compute capability {device['compute_capability']}" if "compute_capability" in device else ""),
        f"- flashtile {env['flashtile']} (commit {env.get('git_commit') or 'unknown'}), torch {env['torch']}, "
        f"triton {env['triton']}, {env['date']}",
        f"- dtype {payload['dtype']}, batch {settings['batch']}, prefill {settings['prefill']}, decode {settings['decode']}, "
        f"seed {settings['seed']}" + ("" if device["type"] == "cuda" else f", CPU times: median of {settings['runs']} run(s)"),
        "",
        rows_table,
        "",
        f"**{payload['summary_line']}**",
        "",
    ]
    return "\n".join(lines)


def _resolve_device(args) -> str:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        args.parser.error("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _default_dtype(shape: model_config.ModelShape, device: str) -> str:
    if device == "cuda":
        return shape.dtype
    # bfloat16 is computed wrongly by Triton's interpreter; fp16 keeps the kernels' 16-bit path under test.
    return "float16" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "float32"


def _check_writable(out: str) -> None:
    """Fail before the (minutes-long) qualification when ``--out`` cannot take its results."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ToolError(f"--out {out}: cannot write the results there ({error.strerror or error})") from None


@readable_errors("qualify")
def run(args) -> int:
    from ..bench.common import base_env, log, stamp, unique_stem, write_json

    args.prefill, args.decode = flatten(args.prefill), flatten(args.decode)
    for flag in ("batch", "runs"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            args.parser.error(f"--{flag} must be positive, got {value}")
    bad = [n for n in (args.prefill or []) + (args.decode or []) if n <= 0]
    if bad:
        args.parser.error(f"--prefill/--decode lengths must be positive, got {bad}")
    if args.softcap is not None and args.softcap < 0:
        args.parser.error(f"--softcap must be >= 0, got {args.softcap}")
    shape = model_config.shape_from_args(args)
    if args.softcap is not None:
        shape = model_config.with_overrides(shape, softcap=args.softcap)
    device = _resolve_device(args)
    dtype_name = model_config.canonical_dtype(args.dtype) if args.dtype else _default_dtype(shape, device)
    batch = args.batch or DEFAULT_BATCH[device]
    prefill = args.prefill or DEFAULT_PREFILL[device]
    decode = args.decode or DEFAULT_DECODE[device]
    calls = derive_calls(shape, batch, prefill, decode)
    _check_writable(args.out)
    info = _device_info(device)

    rows = []
    with warnings.catch_warnings():
        # Fallbacks are the report's subject: each is a row of the table, not a stray warning.
        warnings.filterwarnings("ignore", message="flashtile fell back", category=RuntimeWarning)
        for i, call in enumerate(calls, 1):
            row = qualify_call(call, device, dtype_name, args.runs, args.seed + i)
            log(f"[{i}/{len(calls)}] {call.layer} {call.phase} {call.seqlen_q}x{call.seqlen_k}: {row['status']}")
            rows.append(row)
    exit_status = 0 if all(r["status"] in PASSING for r in rows) else 1
    payload = {
        "model": shape.name,
        "source": shape.source,
        "shape": shape.to_dict(),
        "shape_summary": shape.summary(),
        "device": info,
        "dtype": dtype_name,
        "settings": {"batch": batch, "prefill": prefill, "decode": decode, "runs": args.runs, "seed": args.seed},
        "env": base_env(),
        "rows": rows,
        "exit_status": exit_status,
    }
    payload["summary_line"] = summary_line(shape.name, info["name"], rows, exit_status)
    rows_table = table(rows)
    try:
        os.makedirs(args.out, exist_ok=True)
        stem = unique_stem(args.out, f"qualify-{_slug(shape.name)}-{info['slug']}-{stamp(payload['env'])}").name
        md_path = os.path.join(args.out, stem + ".md")
        with open(md_path, "w") as f:
            f.write(markdown(payload, rows_table))
        json_path = write_json(os.path.join(args.out, stem + ".json"), payload)
    except OSError as error:
        raise ToolError(f"--out {args.out}: cannot write the results ({error.strerror or error})") from None
    report = f"{rows_table}\n\n{payload['summary_line']}\nwrote {md_path} and {json_path}"
    if args.json:
        print(report, file=sys.stderr)
        print_json(payload)
    else:
        print(f"{shape.name} ({shape.source}): {shape.summary()}; {info['name']}, {dtype_name}, batch {batch}\n")
        print(report)
    return exit_status
