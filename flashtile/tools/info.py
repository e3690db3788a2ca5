"""``python -m flashtile info``: versions, the GPU, and which backends can run on which device, and why not.

Backend usability comes from :func:`flashtile.explain` on tiny causal calls, one per device and
dtype, so it states exactly what dispatch would decide; nothing runs.
"""
from __future__ import annotations

import argparse
import os
import platform

from . import print_json, readable_errors

EXAMPLES = """\
examples:
  python -m flashtile info
  python -m flashtile info --json
  TRITON_INTERPRET=1 python -m flashtile info      # the Triton kernels on CPU tensors, in Triton's interpreter
  FLASHTILE_DISABLE_BACKENDS=triton python -m flashtile info

Backends are probed with flashtile.explain on a (1, 16, 2, 64) causal call (GQA, 1 KV head) per
device and dtype; "runs on" is what dispatch would pick, "fallback" when that is not the preferred one.
"""

PROBE_SHAPE = (1, 16, 2, 1, 64)  # batch, seqlen, heads, kv heads, head dim
PROBE_DTYPES = ("float16", "bfloat16", "float32")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "info",
        help="versions, GPU, and which backends are usable (and why not)",
        description="Versions (flashtile, torch, triton, CUDA), the GPU and its compute capability, "
                    "and which flashtile backends can run on which device and dtype, with the reasons.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run, parser=parser)
    return parser


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def probe(device: str, dtype_name: str) -> dict:
    """What :func:`flashtile.explain` says about a tiny causal call on ``device`` in ``dtype_name``."""
    import torch

    import flashtile
    from flashtile.dispatch import BACKENDS

    batch, seqlen, heads, kv_heads, head_dim = PROBE_SHAPE
    dtype = getattr(torch, dtype_name)
    q = torch.zeros(batch, seqlen, heads, head_dim, dtype=dtype, device=device)
    k = torch.zeros(batch, seqlen, kv_heads, head_dim, dtype=dtype, device=device)
    explanation = flashtile.explain(q, k, k, causal=True).to_dict()
    rejected = explanation.get("rejected") or {}
    return {
        "device": device,
        "dtype": dtype_name,
        **explanation,
        "usable": [name for name in BACKENDS if name not in rejected],
    }


def collect() -> dict:
    import torch

    import flashtile

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({
                "index": index,
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count,
            })
    from flashtile import dispatch

    strict = dispatch.strict_enabled() if hasattr(dispatch, "strict_enabled") else _env_flag("FLASHTILE_STRICT")
    devices = ["cpu"] + (["cuda"] if gpus else [])
    return {
        "versions": {
            "flashtile": flashtile.__version__,
            "torch": torch.__version__,
            "triton": triton_version,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "flashtile_path": os.path.dirname(flashtile.__file__),
        "platform": platform.platform(),
        "gpus": gpus,
        "triton_interpret": _env_flag("TRITON_INTERPRET"),
        "strict": strict,
        "disabled_backends": [x for x in os.environ.get("FLASHTILE_DISABLE_BACKENDS", "").replace(" ", "").split(",") if x],
        "backends": list(dispatch.BACKENDS),
        "probes": [probe(device, dtype) for device in devices for dtype in PROBE_DTYPES],
    }


def text(report: dict) -> str:
    from ..bench.common import markdown_table

    v = report["versions"]
    lines = [
        f"flashtile {v['flashtile']} ({report['flashtile_path']})",
        f"torch {v['torch']}, triton {v['triton'] or 'not installed'}, "
        f"CUDA {v['cuda'] or 'none (CPU-only torch build)'}, python {v['python']}",
        f"platform {report['platform']}",
    ]
    if report["gpus"]:
        lines += [f"GPU {g['index']}: {g['name']}, compute capability {g['compute_capability']}, "
                  f"{g['memory_gib']} GiB, {g['multiprocessors']} SMs" for g in report["gpus"]]
    else:
        lines.append("GPU: no CUDA GPU (torch.cuda.is_available() is False)")
    interp = "on: the Triton kernels run on CPU tensors in the interpreter" if report["triton_interpret"] else "off"
    lines.append(f"TRITON_INTERPRET: {interp}")
    lines.append(f"strict mode: {'on (a fallback raises FallbackError)' if report['strict'] else 'off (a fallback warns once)'}; "
                 f"disabled backends: {', '.join(report['disabled_backends']) or 'none'}")
    rows = []
    reasons: dict = {}
    for p in report["probes"]:
        fallback = "-" if p.get("backend") is None else ("yes" if p.get("fallback") else "no")
        rows.append([p["device"], p["dtype"], p.get("preferred") or "-", p.get("backend") or "NONE", fallback,
                     p.get("kernel") or "-"])  # with no backend, the reasons are listed below the table
        for name, why in (p.get("rejected") or {}).items():
            reasons.setdefault((p["device"], name, why), []).append(p["dtype"])
    lines += ["", "Backends (flashtile.explain on a tiny causal call; nothing runs):",
              markdown_table(["device", "dtype", "preferred", "runs on", "fallback", "forward kernel"], rows)]
    if reasons:
        lines += ["", "Not usable:"]
        for (device, name, why), dtypes in reasons.items():
            which = "all dtypes" if len(dtypes) == len(PROBE_DTYPES) else ", ".join(dtypes)
            lines.append(f"  {name} on {device} ({which}): {why}")
    return "\n".join(lines)


@readable_errors("info")
def run(args) -> int:
    report = collect()
    if args.json:
        print_json(report)
    else:
        print(text(report))
    return 0
