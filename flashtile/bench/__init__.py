"""``python -m flashtile bench``: the benchmark suite (:mod:`flashtile.bench.suite`): dense attention
forward / backward / forward+backward against the peers, the variants (window, varlen, softcap),
decode and end to end on a GPU, the CPU comparison without one; JSON, Markdown and PNG plots.
``--suite variants``: the variants suite alone, with the issue's criteria
(:mod:`flashtile.bench.variants`).

The measuring modules are imported only when they run, so CUDA-only and compile-time modules never
load on the other path.
"""
from __future__ import annotations

import argparse
import json

from ..tools import flatten, int_list
from . import common

EXAMPLES = """\
examples:
  python -m flashtile bench                    # the quick suite (about 5 min on an H200): dense fwd/bwd/fwd+bwd
                                               # vs SDPA flash/cudnn/efficient/math, Flex, flash-attn; window,
                                               # varlen, softcap; decode; end to end. CPU only: the CPU comparison
  python -m flashtile bench --full             # every shape (about 20 min on an H200)
  python -m flashtile bench --headline         # flashtile vs FA4, cuDNN, FA2, Flex: d64/128/256/192-128, N 1k/4k/16k,
                                               # causal and not, fwd and bwd, plus the model shapes (~5 min)
  python -m flashtile bench --report           # BENCHMARKS.md from benchmarks/results/index.json
  python -m flashtile bench --only fwd bwd     # stages: fwd bwd fwd_bwd models window varlen softcap decode e2e
                                               # (dense = fwd bwd fwd_bwd, variants = window varlen softcap)
  python -m flashtile bench --only decode --providers flashtile cudnn flash
  python -m flashtile bench --full --only dense --headdims 64 96 --out /tmp/results   # a part of --full
  python -m flashtile bench --headdims 128 192/128 --causal true --dtype fp16 --seqlens 2048 8192
  python -m flashtile bench --merge a.json b.json --out DIR   # one report from runs made in parts
  python -m flashtile bench --quick --json > result.json
  bash scripts/bench.sh --quick                # the same, set up in the project's virtualenv
  python -m flashtile bench --suite variants --out /tmp/results
                                               # the variants suite alone: window, varlen, softcap/ALiBi/sink,
                                               # attn_bias vs plain flashtile and the peers, criteria verdicts
  python -m flashtile bench --suite variants --device cpu   # smoke run: tiny shapes, torch backend

Dense shapes: batch = 16384 // seqlen, nheads = 2048 // headdim, plus GQA 32/8 at headdim 128.
TFLOP/s: fwd = 4*B*H*Sq*Sk*D (halved when causal), bwd = 2.5x, fwd+bwd = 3.5x; GB/s from a modeled
byte count (stated in the output). Every provider is validated before it is timed (output, LSE, dQ, dK, dV
against the fp32 reference; a failure is an "invalid (err X)" cell, never a speed; --no-check skips it).
Writes <out>/<gpu>-suite-<grid>[-<selection>]-<date>T<time>.json, .md and -*.png (cpu-suite-... without a
GPU; <out> defaults to ./flashtile-results). Exit status 1 when flashtile measured nothing.
--suite variants writes <out>/<gpu>-variants-<date>.json; of the options above it takes --quick,
--providers, --dtype, --device, --no-check, --out and --json.
"""

SUITE_ONLY = ("seqlens", "headdims", "causal", "only", "full", "headline", "merge", "no_plots")


def _word_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from . import suite

    parser = subparsers.add_parser(
        "bench",
        help="benchmark suite: flashtile against its peers (GPU) or naive attention (CPU)",
        description=(
            "The flashtile benchmark suite. On a CUDA GPU: dense attention forward, backward and forward+backward "
            "against torch SDPA (flash, cuDNN, efficient, math), FlexAttention, flash-attn and naive attention; "
            "sliding window, varlen and softcap; decode with contiguous and paged caches; a Llama-3-8B-shaped "
            "model end to end. Time, TFLOP/s, modeled bandwidth, peak memory, max error and the kernels that ran, "
            "as JSON, Markdown and plots. On a CPU-only machine: the tiled CPU backend against naive attention and "
            "torch's CPU SDPA."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--suite", choices=("suite", "variants"), default="suite",
                        help="suite (default): everything below; variants: the variants suite alone, with criteria")
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="the quick grid (the default; ~5 min on an H200)")
    grid.add_argument("--full", action="store_true", help="the full grid (~20 min on an H200)")
    grid.add_argument("--headline", action="store_true",
                      help="the table against FA4, cuDNN, FA2 (SDPA flash) and Flex: MHA d64/128/256/192-128, N 1k/4k/16k, "
                           "causal and not, fwd and bwd, then the model shapes (~5 min on an H200)")
    parser.add_argument("--only", nargs="+", type=_word_list, metavar="STAGE",
                        help=f"stages to run: {' '.join(suite.STAGES)}, or {' '.join(suite.STAGE_ALIASES)} (default all)")
    parser.add_argument(
        "--providers", nargs="+", type=_word_list, metavar="NAME",
        help=f"providers to run where they apply: {' '.join(suite.ALL_PROVIDERS)} (default: each stage's own; "
             "sdpa and eager are e2e attention implementations and the CPU comparison's sdpa)",
    )
    parser.add_argument("--groups", nargs="+", type=_word_list, metavar="GROUP",
                        help="--suite variants only: window varlen_equal varlen_mixed mods bias (default all)")
    parser.add_argument("--seqlens", nargs="+", type=int_list, metavar="N", help="dense (and CPU) seqlens, overriding the grid's")
    parser.add_argument("--headdims", nargs="+", type=suite.parse_headdim, metavar="D",
                        help="dense head dims, D or D/DV (e.g. 192/128), overriding the grid's (CPU: D only)")
    parser.add_argument("--causal", choices=("both", "true", "false"), help="dense and CPU causal settings (grid default)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="dtype of every stage (GPU default bf16, the "
                        "full grid adds fp16 at headdim 128; CPU default fp32)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto (default): the GPU suite when torch sees a CUDA GPU, else the CPU comparison")
    parser.add_argument("--no-check", action="store_true", help="skip the max-abs-error check against the reference")
    parser.add_argument("--no-plots", action="store_true", help="no PNG plots")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine suite result files (e.g. --full run in parts) into one JSON, Markdown and plots in --out")
    parser.add_argument("--out", default=common.DEFAULT_OUT, metavar="DIR",
                        help="where the files go, named with the date and time so no run overwrites another "
                             "(default: %(default)s in the current directory)")
    parser.add_argument("--report", action="store_true",
                        help="regenerate BENCHMARKS.md from the committed result files of benchmarks/results/index.json")
    parser.add_argument("--json", action="store_true", help="print the result JSON on stdout (the report goes to stderr)")
    parser.set_defaults(func=run, parser=parser)
    return parser


def _emit(args, payload: dict, text: str) -> None:
    from . import common

    if args.json:
        common.log(text)
        print(json.dumps(payload, indent=1, default=str))
    else:
        print(text)


def run(args) -> int:
    from . import suite

    for name in ("seqlens", "headdims", "providers", "groups", "only"):
        setattr(args, name, flatten(getattr(args, name)))
    if args.report:
        from . import results

        print(results.write_report())
        return 0
    if args.suite == "variants":
        return _run_variants(args)
    if args.groups:
        args.parser.error("--groups: only with --suite variants")
    if args.merge:
        try:
            payload, text = suite.merge(args.merge, args.out, plots=not args.no_plots)
        except suite.UsageError as error:
            args.parser.error(str(error))
        _emit(args, payload, text)
        return 0
    try:
        opts = suite.options_from_args(args)
    except suite.UsageError as error:
        args.parser.error(str(error))
    payload, text = suite.run(opts)
    _emit(args, payload, text)
    return suite.exit_status(payload)


def _run_variants(args) -> int:
    import torch

    from . import variants

    given = [f"--{name.replace('_', '-')}" for name in SUITE_ONLY if getattr(args, name)]
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
