"""``python -m flashtile bench``: the GPU sweep against the peers, or the CPU comparison;
``--suite variants``: the attention variants (window, varlen, softcap, ALiBi, sink, bias) against
their plain counterparts and the peers, with the issue's criteria.

The GPU sweep lives in :mod:`flashtile.bench.gpu`, the CPU comparison in
:mod:`flashtile.bench.cpu`, the variants in :mod:`flashtile.bench.variants`; each is imported only
when it runs, so CUDA-only and compile-time modules never load on the other path.
"""
from __future__ import annotations

import argparse
import json

from ..tools import flatten, int_list

EXAMPLES = """\
examples:
  python -m flashtile bench                    # GPU: full sweep vs SDPA flash/cudnn/efficient + flex
                                               # CPU only: tiled backend vs naive vs torch SDPA
  python -m flashtile bench --quick            # GPU seqlens 1024 4096 16384; CPU seqlens 1024 4096
  python -m flashtile bench --headdims 128 --causal true --providers flashtile flash cudnn
  python -m flashtile bench --seqlens 8192 --dtype fp16 --out /tmp/results
  python -m flashtile bench --quick --json > result.json
  bash scripts/bench.sh --quick                # the same, set up in the project's virtualenv
  python -m flashtile bench --suite variants --out /tmp/results
                                               # GPU: window, varlen, softcap/ALiBi/sink, attn_bias vs
                                               # plain flashtile and the peers, criteria verdicts last
  python -m flashtile bench --suite variants --groups window mods --providers flashtile flash
  python -m flashtile bench --suite variants --device cpu   # smoke run: tiny shapes, torch backend

GPU rows: batch = 16384 // seqlen, nheads = 2048 // headdim; TFLOP/s fwd = 4*B*H*S*S*D
(halved when causal), bwd = 2.5x that over the time of backward alone. Results are written to
<out>/<gpu>-<date>.json (GPU) or <out>/cpu-<date>.json (CPU); the table is printed last.
--suite variants writes <out>/<gpu>-variants-<date>.json (see flashtile/bench/variants.py for its
shapes and FLOP model); of the options above it takes --quick, --providers, --dtype, --device,
--no-check, --out and --json.
"""

SWEEP_ONLY = ("seqlens", "headdims", "causal")


def _word_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark flashtile against its peers (GPU) or naive attention (CPU)",
        description=(
            "Benchmark flashtile. On a CUDA GPU: a sweep against torch SDPA (flash, cuDNN, efficient) and "
            "FlexAttention, forward and backward. On a CPU-only machine: the tiled CPU backend against naive "
            "attention and torch's CPU SDPA, forward time and peak memory."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--suite", choices=("sweep", "variants"), default="sweep",
                        help="sweep (default): dense attention vs the peers; variants: window, varlen, "
                             "softcap/ALiBi/sink, attn_bias against plain flashtile and the peers")
    parser.add_argument("--groups", nargs="+", type=_word_list, metavar="GROUP",
                        help="--suite variants only: window varlen_equal varlen_mixed mods bias (default all)")
    parser.add_argument("--quick", action="store_true", help="fewer seqlens (GPU: 1024 4096 16384; CPU: 1024 4096)")
    parser.add_argument("--seqlens", nargs="+", type=int_list, metavar="N", help="seqlens to run (overrides --quick)")
    parser.add_argument("--headdims", nargs="+", type=int_list, metavar="D", help="head dims (GPU default: 64 128; CPU: 64)")
    parser.add_argument(
        "--providers", nargs="+", type=_word_list, metavar="NAME",
        help="GPU: flashtile flash cudnn efficient flex (default all); CPU: flashtile naive sdpa (default all)",
    )
    parser.add_argument("--causal", choices=("both", "true", "false"), help="GPU default: both; CPU default: false")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="GPU default: bf16; CPU default: fp32")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto (default): the GPU sweep when torch sees a CUDA GPU, else the CPU comparison")
    parser.add_argument("--no-check", action="store_true", help="skip the max-abs-error check against the reference")
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR", help="where the JSON goes (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result JSON on stdout (the table goes to stderr)")
    parser.set_defaults(func=run, parser=parser)
    return parser


def run(args) -> int:
    import torch

    from . import common

    for name in ("seqlens", "headdims", "providers", "groups"):
        setattr(args, name, flatten(getattr(args, name)))
    if args.suite == "variants":
        return _run_variants(args)
    if args.groups:
        args.parser.error("--groups: only with --suite variants")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        args.parser.error("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if device == "cuda":
        from . import gpu as module
    else:
        from . import cpu as module
    unknown = sorted(set(args.providers or ()) - set(module.PROVIDERS))
    if unknown:
        args.parser.error(f"--providers {' '.join(unknown)}: not a {device} provider; choose from {' '.join(module.PROVIDERS)}")
    bad = [n for n in [*(args.seqlens or ()), *(args.headdims or ())] if n <= 0]
    if bad:
        args.parser.error(f"--seqlens/--headdims must be positive, got {bad}")

    payload, table = module.run(args)
    if args.json:
        common.log(table)
        print(json.dumps(payload, indent=1, default=str))
    else:
        print(table)
    flashtile_rows = [r for r in payload["attn"] if r["prov"] == "flashtile"]
    # Nothing of flashtile measured at all is a failure worth an exit code; a few marked cells are not.
    if flashtile_rows and all(r.get("fwd_err") or r.get("err") for r in flashtile_rows):
        return 1
    return 0


def _run_variants(args) -> int:
    import torch

    from . import variants

    given = [f"--{name}" for name in SWEEP_ONLY if getattr(args, name)]
    if given:
        args.parser.error(f"{' '.join(given)}: not used by --suite variants (its shapes are fixed; see --groups, --quick)")
    for option, chosen, known in (("--providers", args.providers, variants.PROVIDERS),
                                  ("--groups", args.groups, variants.GROUP_NAMES)):
        unknown = sorted(set(chosen or ()) - set(known))
        if unknown:
            args.parser.error(f"{option} {' '.join(unknown)}: choose from {' '.join(known)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        args.parser.error("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    return variants.main_with_args(args)
