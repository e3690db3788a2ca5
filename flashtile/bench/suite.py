"""The benchmark suite behind ``python -m flashtile bench``: what it measures (grids, stages,
providers), the run, and the result file's schema.

Stages (``--only``; ``dense`` = fwd bwd fwd_bwd, ``variants`` = window varlen softcap):

- ``fwd``, ``bwd``, ``fwd_bwd``: dense attention over seqlen x configuration, every provider of
  :mod:`flashtile.bench.providers` on the same inputs (:func:`flashtile.bench.gpu.measure`). Shapes
  keep tokens and width fixed: ``batch = 16384 // seqlen``, ``nheads = 2048 // headdim`` (MHA), plus
  GQA 32/8 at headdim 128 (Llama-3-8B's attention).
- ``window``, ``varlen``, ``softcap``: cases of the variants suite (:mod:`flashtile.bench.variants`):
  sliding window (1024, 0) vs full causal, varlen with mixed lengths vs padding + dense, softcap=50
  vs plain, with their peers (Flex, SDPA flash on the padded batch).
- ``decode``: :mod:`flashtile.bench.decode`, batch x cache length, contiguous and paged caches.
- ``e2e``: :mod:`flashtile.bench.e2e`, a Llama-3-8B-shaped model with flashtile / sdpa / eager attention.

Grids: :data:`QUICK` (the default; sized for about 5 minutes on an H200 including compiles) and
:data:`FULL` (sized for about 20). Without a CUDA GPU the suite runs the CPU comparison
(:mod:`flashtile.bench.cpu`) and says which GPU stages were skipped.

Outputs in ``--out``: ``<gpu>-suite-<grid>[-<selection>]-<date>.json``, written after every measured
cell; the same name ``.md`` (summary, tables, kernels, plots); PNG plots when matplotlib is installed
(:mod:`flashtile.bench.report`, :mod:`flashtile.bench.plots`). The JSON's schema is :data:`TOP_KEYS`,
:data:`ENV_KEYS`, :data:`ROW_KEYS` (one list of rows per section: dense, variants, decode, e2e, cpu;
every row has a ``status``) and :data:`SUMMARY_KEYS`; :func:`validate` checks a payload against it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Optional

import torch

from . import common, cpu, decode, e2e, gpu, providers, variants
from . import validate as validation

SCHEMA_ID = "flashtile.bench.suite/1"
STAGES = ("fwd", "bwd", "fwd_bwd", "models", "window", "varlen", "softcap", "decode", "e2e")
DENSE_STAGES = gpu.DENSE_STAGES
STAGE_ALIASES = {"dense": DENSE_STAGES, "variants": ("window", "varlen", "softcap"), "all": STAGES}
VARIANT_GROUPS = {"window": "window", "varlen": "varlen_mixed", "softcap": "mods"}
MODS_VARIANTS = ("plain", "softcap")  # of the variants suite's "mods" group, the suite runs these

TOKENS, WIDTH = 16384, 2048  # batch * seqlen and nheads * headdim of the dense MHA shapes
GQA_HEADS = (32, 8)
GQA_HEADDIMS = (128,)


def _model(label: str, batch: int, seqlen: int, nheads: int, nheads_kv: int, headdim: int, headdim_v: int,
           **features) -> tuple:
    return label, providers.DenseShape(batch, seqlen, nheads, nheads_kv, headdim, headdim_v, True, "bf16", **features)


# The ``models`` stage: the attention shapes of real models, forward and backward against every peer that
# has the feature (FA4, cuDNN, FA2 and Flex where they do).
MODEL_SHAPES = (
    _model("Llama-3 GQA 32/8 d128 2x8k causal", 2, 8192, 32, 8, 128, 128),
    _model("full causal h16 d128 1x16k", 1, 16384, 16, 16, 128, 128),
    _model("window (1024, 0) h16 d128 1x16k", 1, 16384, 16, 16, 128, 128, window=1024),
    _model("softcap 50 GQA 16/8 d128 2x8k causal", 2, 8192, 16, 8, 128, 128, softcap=50.0),
    _model("gpt-oss sink GQA 64/8 d64 2x4k causal", 2, 4096, 64, 8, 64, 64, sink=True),
    _model("gpt-oss sink + window (128, 0) GQA 64/8 d64 2x4k", 2, 4096, 64, 8, 64, 64, sink=True, window=128),
    _model("DeepSeek d192/dv128 h16 2x4k causal", 2, 4096, 16, 16, 192, 128),
)

# Providers of each stage, in table order; the CPU comparison has its own.
STAGE_PROVIDERS = {
    "dense": providers.NAMES,
    "variants": variants.PROVIDERS,
    "decode": decode.PROVIDERS,
    "e2e": e2e.IMPLEMENTATIONS,
    "cpu": cpu.PROVIDERS,
}
ALL_PROVIDERS = tuple(dict.fromkeys(p for names in STAGE_PROVIDERS.values() for p in names))

TIMING_NOTE = (
    "GPU kernels: median of CUDA-event times of each run after warm-up (triton.testing.do_bench(warmup=25, "
    "rep=100, return_mode='all'), L2 flushed before each run), spread = 10th-90th percentile; compile time "
    "(Triton, torch.compile) excluded by an untimed first call (first_call_s). bwd = out.backward(dout, "
    "retain_graph=True) alone on one retained graph (else fwd+bwd minus fwd, see bwd_method); fwd_bwd = "
    "fwd().backward(dout). Decode: the same timer per step, host overhead included; graph_* = replays of the "
    "step captured in a CUDA graph. End to end: wall clock with the device synchronized, median of runs after "
    "one warm-up. CPU comparison: wall clock in a fresh process per cell."
)
MEMORY_NOTE = ("peak_extra_GB = torch.cuda.max_memory_allocated() during one forward + backward (forward only, "
               "under no_grad, when no backward stage runs) minus what was allocated before it (inputs, dout).")
REFERENCE_NOTE = ("validated before timing (flashtile.bench.validate): dense and model shapes check out, lse (where the "
                  "provider returns it), dq, dk, dv against flashtile.testing.reference_results in fp32 on the query heads "
                  "of the first KV head, error <= 2x the same-dtype PyTorch computation's + atol; a provider that fails "
                  "is 'invalid (err X)' and not timed. Variants: out against the fp32 reference on the first ref_heads "
                  f"heads, same rule; decode: out of the first {decode.REF_BATCH} sequences, same rule; e2e: "
                  "logits_max_diff_vs_eager = max|last-token logits - eager's| at the shortest prompt.")
PROOF_NOTE = ("kernels / ranges = distinct CUDA kernel names (torch.profiler, CUDA activity; truncated) and flashtile "
              "record_function ranges of one call of each provider: dense at the first seqlen of each configuration "
              "(fwd and bwd separately), every variant and decode cell, one prefill per e2e implementation.")


class UsageError(ValueError):
    """A bad combination of options: the command line reports it as a usage error (exit 2)."""


# ---------------------------------------------------------------- grids


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """One line of the dense sweep's plots: dtype, head dims, heads, causal; seqlen varies."""

    dtype: str
    headdim: int
    headdim_v: int
    nheads: int
    nheads_kv: int
    causal: bool

    @property
    def group(self) -> str:
        """The configuration without ``causal``: one figure of plots, one table."""
        dims = f"d{self.headdim}" + (f"/{self.headdim_v}" if self.headdim_v != self.headdim else "")
        return f"{self.dtype} {dims} h{self.nheads}/{self.nheads_kv}"

    @property
    def label(self) -> str:
        return f"{self.group} {'causal' if self.causal else 'full'}"

    def shape(self, seqlen: int, tokens: int = TOKENS) -> providers.DenseShape:
        """The shape at ``seqlen``, ``batch = tokens // seqlen`` (at least 1)."""
        return providers.DenseShape(max(1, tokens // seqlen), seqlen, self.nheads, self.nheads_kv, self.headdim,
                                    self.headdim_v, self.causal, self.dtype)


def dense_configs(dtypes, headdims, causals, width: int = WIDTH, gqa_heads=GQA_HEADS,
                  gqa_headdims=GQA_HEADDIMS) -> tuple[DenseConfig, ...]:
    """MHA with ``nheads = width // headdim`` for each (headdim, headdim_v), plus GQA ``gqa_heads``
    where ``headdim`` is in ``gqa_headdims``; every dtype and causal."""
    out = []
    for dtype in dtypes:
        for headdim, headdim_v in headdims:
            heads = [(max(1, width // headdim),) * 2]
            if headdim in gqa_headdims and headdim_v == headdim:
                heads.append(tuple(gqa_heads))
            for nheads, nheads_kv in heads:
                for causal in causals:
                    out.append(DenseConfig(dtype, headdim, headdim_v, nheads, nheads_kv, causal))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Grid:
    """Everything a run measures; :data:`QUICK` and :data:`FULL`, adjusted by the command line."""

    name: str
    seqlens: tuple
    dense: tuple
    variant_sizes: variants.Sizes
    decode_shapes: tuple  # (batch, cache_len)
    decode_layouts: tuple
    e2e: e2e.Settings
    dense_providers: tuple  # the default providers of the dense stages
    dense_flex_budget_s: float  # Flex compiles are the slow part: past this, Flex cells are skipped (models too)
    variant_flex_budget_s: float
    cpu_seqlens: tuple
    tokens: int = TOKENS  # batch * seqlen of the dense shapes
    width: int = WIDTH  # nheads * headdim of the dense MHA shapes
    cpu_headdims: tuple = (cpu.HEADDIM,)
    cpu_causal: tuple = (False,)
    dtype: str = "bf16"  # variants, decode, e2e
    cpu_dtype: str = "fp32"
    models: tuple = MODEL_SHAPES


BOTH = (False, True)
QUICK = Grid(
    name="quick",
    seqlens=(1024, 4096, 16384),
    dense=dense_configs(("bf16",), ((64, 64), (128, 128)), BOTH),
    variant_sizes=variants.QUICK,
    decode_shapes=((16, 8192), (1, 32768)),
    decode_layouts=tuple(decode.LAYOUTS),
    e2e=e2e.Settings(prompts=(512, 2048, 8192), new_tokens=32, decode_prompt=512, layers=4),
    dense_providers=tuple(p for p in providers.NAMES if p != "naive"),  # math already is naive attention
    dense_flex_budget_s=90.0,
    variant_flex_budget_s=45.0,
    cpu_seqlens=cpu.QUICK_SEQLENS,
)
FULL = Grid(
    name="full",
    seqlens=(512, 1024, 2048, 4096, 8192, 16384, 32768),
    dense=(dense_configs(("bf16",), ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)), BOTH)
           + dense_configs(("fp16",), ((128, 128),), BOTH)),
    variant_sizes=variants.DEFAULT,
    decode_shapes=((16, 8192), (16, 32768), (1, 32768), (1, 131072)),
    decode_layouts=tuple(decode.LAYOUTS),
    e2e=e2e.Settings(prompts=(512, 1024, 2048, 4096, 8192), new_tokens=128, decode_prompt=512, layers=4),
    dense_providers=providers.NAMES,
    dense_flex_budget_s=180.0,
    variant_flex_budget_s=120.0,
    cpu_seqlens=cpu.SEQLENS,
)
# The table of flashtile against FA4, cuDNN, FA2 (SDPA flash) and Flex: MHA at four head dims, three
# lengths, causal and not, fwd and bwd, then the model shapes; sized for about 5 minutes on an H200.
HEADLINE = dataclasses.replace(
    QUICK, name="headline",
    dense=dense_configs(("bf16",), ((64, 64), (128, 128), (256, 256), (192, 128)), BOTH, gqa_headdims=()),
    dense_providers=("flashtile", "fa4", "cudnn", "flash", "flex"), dense_flex_budget_s=90.0)
HEADLINE_STAGES = ("fwd", "bwd", "models")
GRIDS = {"quick": QUICK, "full": FULL, "headline": HEADLINE}


def with_overrides(grid: Grid, seqlens=None, headdims=None, causal: Optional[str] = None,
                   dtype: Optional[str] = None) -> Grid:
    """``grid`` with the command line's ``--seqlens``, ``--headdims`` (``[(d, dv), ...]``), ``--causal``
    (both, true, false) and ``--dtype`` applied.

    ``--headdims`` keeps the grid's configurations of those head dims (``--full --headdims 64`` is
    exactly the full grid's headdim-64 part, so a long run can be split and merged) and adds the
    grid's usual configurations for head dims it does not have; ``--dtype`` and ``--causal`` then
    set every configuration's dtype and causal settings."""
    causals = None if causal is None else {"both": BOTH, "true": (True,), "false": (False,)}[causal]
    dense = list(grid.dense)
    if headdims:
        present = {(c.headdim, c.headdim_v) for c in dense}
        dense = [c for c in dense if (c.headdim, c.headdim_v) in headdims]
        dense += dense_configs((grid.dtype,), [hd for hd in headdims if hd not in present],
                               causals or BOTH, grid.width)
    if dtype:
        dense = [dataclasses.replace(c, dtype=dtype) for c in dense]
    if causals:
        bases = dict.fromkeys(dataclasses.replace(c, causal=False) for c in dense)
        dense = [dataclasses.replace(c, causal=x) for c in bases for x in causals]
    changes = {"dense": tuple(dict.fromkeys(dense))}
    if seqlens:
        changes.update(seqlens=tuple(seqlens), cpu_seqlens=tuple(seqlens))
    if headdims:
        changes["cpu_headdims"] = tuple(dict.fromkeys(d for d, _ in headdims))
    if causals:
        changes["cpu_causal"] = causals
    if dtype:
        changes.update(dtype=dtype, cpu_dtype=dtype, e2e=grid.e2e._replace(dtype=dtype))
    return dataclasses.replace(grid, **changes)


def parse_stages(words) -> tuple:
    """``--only`` words (stages or aliases) -> stages in run order; all stages when empty."""
    if not words:
        return STAGES
    chosen = set()
    for word in words:
        if word in STAGE_ALIASES:
            chosen.update(STAGE_ALIASES[word])
        elif word in STAGES:
            chosen.add(word)
        else:
            raise UsageError(f"--only {word}: choose from {' '.join(STAGES)} (or {' '.join(STAGE_ALIASES)})")
    return tuple(s for s in STAGES if s in chosen)


def parse_headdim(text: str) -> list[tuple[int, int]]:
    """``"64,192/128"`` -> ``[(64, 64), (192, 128)]`` (argparse type; ``D/DV`` is a value head dim that differs)."""
    out = []
    for item in (x for x in text.split(",") if x):
        parts = item.split("/")
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected head dims like 128 or 192/128, got {item!r}") from None
        if len(dims) > 2 or min(dims) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive head dims like 128 or 192/128, got {item!r}")
        out.append((dims[0], dims[-1]))
    return out


@dataclasses.dataclass(frozen=True)
class Options:
    grid: Grid
    stages: tuple
    providers: Optional[tuple]  # None: each stage's defaults
    device: str  # cuda or cpu
    out: Path
    check: bool = True
    plots: bool = True
    selection: str = ""  # part of the file names: what --only and the overrides chose

    def stage_providers(self, stage: str) -> tuple:
        """The providers of a stage (dense, variants, decode, e2e, cpu), in table order."""
        known = STAGE_PROVIDERS[stage]
        if self.providers is None:
            return self.grid.dense_providers if stage == "dense" else known
        return tuple(p for p in known if p in self.providers)


def options_from_args(args) -> Options:
    """The run's :class:`Options` from parsed command-line arguments; :class:`UsageError` on a bad mix."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    stages = parse_stages(args.only)
    chosen = tuple(dict.fromkeys(args.providers)) if args.providers else None
    unknown = [p for p in chosen or () if p not in ALL_PROVIDERS]
    if unknown:
        raise UsageError(f"--providers {' '.join(unknown)}: choose from {' '.join(ALL_PROVIDERS)}")
    bad = [n for n in args.seqlens or () if n <= 0]
    if bad:
        raise UsageError(f"--seqlens must be positive, got {bad}")
    name = "full" if args.full else "headline" if getattr(args, "headline", False) else "quick"
    if name == "headline" and not args.only:
        stages = HEADLINE_STAGES
    grid = with_overrides(GRIDS[name], args.seqlens, args.headdims, args.causal, args.dtype)
    if device == "cpu":
        if any(d != dv for d, dv in args.headdims or ()):
            raise UsageError("--headdims D/DV: the CPU comparison takes one head dim for q, k and v")
        if chosen and not any(p in cpu.PROVIDERS for p in chosen):
            raise UsageError(f"--providers {' '.join(chosen)}: none runs on CPU; CPU providers: {' '.join(cpu.PROVIDERS)}")
    selection = _selection(args)
    return Options(grid, stages, chosen, device, Path(args.out), check=not args.no_check, plots=not args.no_plots,
                   selection=selection)


def _selection(args) -> str:
    """What ``--only`` and the overrides chose, for the file names: ``-decode-dtype-fp16``,
    ``-dense-headdims-64-192x128``; empty for a whole grid."""
    parts = ["-".join(args.only)] if args.only else []
    if args.seqlens:
        parts.append("seqlens-" + "-".join(map(str, args.seqlens)))
    if args.headdims:
        parts.append("headdims-" + "-".join(str(d) if d == dv else f"{d}x{dv}" for d, dv in args.headdims))
    for name in ("causal", "dtype"):
        if getattr(args, name):
            parts.append(f"{name}-{getattr(args, name)}")
    return "".join(f"-{p}" for p in parts)


# ---------------------------------------------------------------- schema


NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))
OPTIONAL_STR = (str, type(None))
TOP_KEYS = {
    "schema": str, "kind": str, "mode": str, "env": dict, "grid": dict, "stages": dict, "models": dict,
    "dense": list, "variants": list, "variant_criteria": list, "decode": list, "e2e": list, "cpu": list,
    "summary": list, "skipped": list, "files": dict, "flashtile_stats": (dict, type(None)), "elapsed_s": NUMBER,
    "interrupted": bool,
}
ENV_KEYS = {
    "date": str, "time_utc": str, "flashtile": str, "git_commit": OPTIONAL_STR, "git_dirty": (bool, type(None)),
    "torch": str, "triton": OPTIONAL_STR, "python": str, "platform": str, "argv": list, "device": str,
    "gpu": OPTIONAL_STR, "driver": OPTIONAL_STR, "cuda": OPTIONAL_STR, "cpu": str,
}
ROW_KEYS = {
    "dense": {"prov": str, "config": str, "group": str, "dtype": str, "D": int, "Dv": int, "H": int, "Hkv": int, "N": int, "B": int,
              "causal": bool, "status": str},
    "variants": {"prov": str, "group": str, "variant": str, "N": int, "B": int, "H": int, "D": int, "causal": bool,
                 "status": str},
    "decode": {"prov": str, "layout": str, "page_size": (int, type(None)), "dtype": str, "B": int, "L": int, "H": int,
               "Hkv": int, "D": int, "status": str},
    "e2e": {"prov": str, "kind": str, "prompt": int, "layers": int, "dtype": str, "status": str},
    "cpu": {"prov": str, "D": int, "N": int, "B": int, "H": int, "causal": bool, "status": str},
}
# The measurement a row with status "ok" must carry, per section.
PRIMARY = {"dense": "fwd_ms", "variants": "fwd_ms", "decode": "step_ms", "cpu": "fwd_ms"}
SUMMARY_KEYS = {"section": str, "config": str, "shape": str, "stage": str, "metric": str, "higher_is_better": bool,
                "flashtile": OPTIONAL_NUMBER, "best_peer": OPTIONAL_STR, "best_peer_value": OPTIONAL_NUMBER,
                "ratio": OPTIONAL_NUMBER, "note": OPTIONAL_STR}
STATUSES = ("ok", "partial", "invalid", "skipped", "oom", "unsupported", "n/a", "error")


def _check_keys(where: str, obj: dict, spec: dict) -> list[str]:
    problems = []
    for key, types in spec.items():
        if key not in obj:
            problems.append(f"{where}: missing {key!r}")
        elif not isinstance(obj[key], types) or (isinstance(obj[key], bool) and bool not in (
                types if isinstance(types, tuple) else (types,))):
            problems.append(f"{where}: {key!r} is {type(obj[key]).__name__} {obj[key]!r}, expected {types}")
    return problems


def validate(payload: dict) -> list[str]:
    """Everything wrong with a suite result (empty when it follows the schema above): required keys and
    types at the top, in ``env``, in every row and summary entry; statuses known; an ``ok`` row has its
    primary measurement, positive, inside its own 10th-90th percentile spread."""
    if not isinstance(payload, dict):
        return [f"payload is {type(payload).__name__}, expected dict"]
    problems = _check_keys("payload", payload, TOP_KEYS)
    if problems:
        return problems
    if payload["schema"] != SCHEMA_ID:
        problems.append(f"schema is {payload['schema']!r}, expected {SCHEMA_ID!r}")
    if payload["mode"] not in ("gpu", "cpu"):
        problems.append(f"mode is {payload['mode']!r}, expected gpu or cpu")
    problems += _check_keys("env", payload["env"], ENV_KEYS)
    for section, spec in ROW_KEYS.items():
        for i, row in enumerate(payload[section]):
            where = f"{section}[{i}]"
            problems += _check_keys(where, row, spec)
            status = row.get("status")
            if status not in STATUSES:
                problems.append(f"{where}: status {status!r} not one of {STATUSES}")
            primary = PRIMARY.get(section) or ("prefill_ms" if row.get("kind") == "prefill" else "tokens_per_s")
            if status == "ok":
                value = row.get(primary)
                if not isinstance(value, NUMBER) or value <= 0:
                    problems.append(f"{where}: status ok but {primary} is {value!r}")
                low, high = row.get(primary.replace("_ms", "_p10_ms")), row.get(primary.replace("_ms", "_p90_ms"))
                if primary.endswith("_ms") and isinstance(low, NUMBER) and isinstance(high, NUMBER) and not (
                        low - 1e-9 <= value <= high + 1e-9):
                    problems.append(f"{where}: {primary} {value} outside its spread [{low}, {high}]")
    for i, entry in enumerate(payload["summary"]):
        problems += _check_keys(f"summary[{i}]", entry, SUMMARY_KEYS)
    for name, stage in payload["stages"].items():
        if not isinstance(stage, dict) or stage.get("status") not in ("ran", "skipped", "not reached"):
            problems.append(f"stages[{name!r}]: {stage!r}, expected {{'status': 'ran'|'skipped'|'not reached', ...}}")
    return problems


# ---------------------------------------------------------------- the run


def _cpu_env() -> dict:
    env = cpu._env()
    env.update(driver=None, cuda=torch.version.cuda)
    return env


def _grid_description(opts: Options) -> dict:
    grid = opts.grid
    return {
        "name": grid.name,
        "stages": list(opts.stages),
        "providers": {stage: list(opts.stage_providers(stage)) for stage in STAGE_PROVIDERS},
        "seqlens": list(grid.seqlens),
        "tokens": grid.tokens,
        "width": grid.width,
        "dense": [dataclasses.asdict(c) | {"label": c.label} for c in grid.dense],
        "variant_sizes": grid.variant_sizes._asdict(),
        "decode_shapes": [{"B": b, "L": n, "H": decode.HEADS, "Hkv": decode.KV_HEADS, "D": decode.HEADDIM}
                          for b, n in grid.decode_shapes],
        "decode_layouts": list(grid.decode_layouts),
        "e2e": grid.e2e._asdict() | {"config": e2e.CONFIG_PATH.name},
        "dense_flex_budget_s": grid.dense_flex_budget_s,
        "variant_flex_budget_s": grid.variant_flex_budget_s,
        "cpu": {"seqlens": list(grid.cpu_seqlens), "headdims": list(grid.cpu_headdims),
                "causal": list(grid.cpu_causal), "dtype": grid.cpu_dtype},
        "dtype": grid.dtype,
        "check": opts.check,
    }


def new_payload(opts: Options, env: dict) -> dict:
    ceiling = decode.bandwidth_ceiling_tbps(env.get("gpu"))
    return {
        "schema": SCHEMA_ID,
        "kind": "suite",
        "mode": "gpu" if opts.device == "cuda" else "cpu",
        "env": env,
        "grid": _grid_description(opts),
        "stages": {},
        "models": {
            "flops": common.FLOP_MODEL, "bytes": common.BYTE_MODEL, "timing": TIMING_NOTE, "memory": MEMORY_NOTE,
            "reference": REFERENCE_NOTE, "proof": PROOF_NOTE, "variants_flops": variants.FLOP_MODEL,
            "bandwidth_ceiling_TBps": ceiling,
            "bandwidth_ceiling_source": common.BANDWIDTH_CEILING_SOURCE if ceiling else None,
            "shapes": (f"dense: batch = {TOKENS} // seqlen, nheads = {WIDTH} // headdim (MHA), GQA {GQA_HEADS[0]}/"
                       f"{GQA_HEADS[1]} at headdim {', '.join(map(str, GQA_HEADDIMS))}; decode: {decode.HEADS} query "
                       f"heads, {decode.KV_HEADS} KV heads, headdim {decode.HEADDIM}, every sequence at the cache length"),
        },
        "dense": [], "variants": [], "variant_criteria": [], "decode": [], "e2e": [], "cpu": [],
        "summary": [], "skipped": [], "files": {}, "flashtile_stats": None, "elapsed_s": 0.0, "interrupted": False,
    }


def output_stem(opts: Options, env: dict) -> Path:
    slug = common.gpu_slug(env["gpu"]) if opts.device == "cuda" else "cpu"
    return common.unique_stem(opts.out, f"{slug}-suite-{opts.grid.name}{opts.selection}-{common.stamp(env)}")


def finalize(payload: dict) -> dict:
    """Statuses of every row and the summary (pure; safe to call on a partial payload)."""
    from . import report

    for section in ROW_KEYS:
        for row in payload[section]:
            row["status"] = common.row_status(row)
    payload["summary"] = report.summary(payload)
    return payload


class _FlexBudget:
    """Seconds spent in Flex cells (compiles included) against a budget."""

    def __init__(self, budget_s: float):
        self.budget_s, self.spent_s = budget_s, 0.0


class _Run:
    """The state of one run: the payload, where it goes, the progress bar."""

    def __init__(self, opts: Options, env: dict):
        self.opts, self.payload = opts, new_payload(opts, env)
        self.stem = output_stem(opts, env)
        self.json_path = self.stem.with_suffix(".json")
        self.start = time.perf_counter()
        self.progress: Optional[common.Progress] = None
        self.flex = _FlexBudget(opts.grid.dense_flex_budget_s)  # shared by the dense and models stages
        for stage in STAGES:  # in run order; each is marked when it is skipped or done
            self.stage(stage, "not reached")

    def save(self) -> None:
        import flashtile

        self.payload["flashtile_stats"] = flashtile.stats()
        self.payload["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        common.write_json(self.json_path, finalize(self.payload))

    def add(self, section: str, row: dict, label: str, text: str) -> None:
        self.payload[section].append(row)
        self.progress.step(label, text)
        self.save()

    def stage(self, name: str, status: str, reason: Optional[str] = None) -> None:
        self.payload["stages"][name] = {"status": status, "reason": reason}


def _cell_counts(opts: Options) -> dict:
    grid, stages = opts.grid, opts.stages
    counts = {"dense": 0, "models": 0, "variants": 0, "decode": 0, "e2e": 0}
    if any(s in stages for s in DENSE_STAGES):
        counts["dense"] = len(grid.dense) * len(grid.seqlens) * len(opts.stage_providers("dense"))
    counts["models"] = len(grid.models) * len(opts.stage_providers("dense")) if "models" in stages else 0
    counts["variants"] = len(_variant_cases(opts))
    if "decode" in stages:
        counts["decode"] = len(decode.cells(_decode_shapes(opts), grid.decode_layouts, opts.stage_providers("decode")))
    if "e2e" in stages:
        counts["e2e"] = e2e.cell_count(grid.e2e, opts.stage_providers("e2e"))
    return counts


def _variant_cases(opts: Options) -> list:
    groups = [VARIANT_GROUPS[s] for s in opts.stages if s in VARIANT_GROUPS]
    if not groups:
        return []
    cases = variants.build_cases(opts.grid.variant_sizes, groups, opts.stage_providers("variants"))
    return [c for c in cases if c.group != "mods" or c.variant in MODS_VARIANTS]


def _decode_shapes(opts: Options) -> list:
    return [decode.DecodeShape(b, n, dtype=opts.grid.dtype) for b, n in opts.grid.decode_shapes]


def _run_dense(run: _Run, timer, device) -> None:
    opts = run.opts
    stages = tuple(s for s in DENSE_STAGES if s in opts.stages)
    for config in opts.grid.dense:
        for index, seqlen in enumerate(opts.grid.seqlens):
            shape = config.shape(seqlen, opts.grid.tokens)
            _run_shape(run, shape, config.label, config.group, stages, timer, device, run.flex,
                       profile=opts.stage_providers("dense") if index == 0 else ())


def _run_models(run: _Run, timer, device) -> None:
    """The ``models`` stage: each model shape forward and backward, its rows in the dense section (group
    ``models``); flashtile's kernels recorded on each (the peers' on the dense shapes only: a profile costs time)."""
    for label, shape in run.opts.grid.models:
        shape = shape._replace(dtype=run.opts.grid.dtype)
        _run_shape(run, shape, label, "models", ("fwd", "bwd"), timer, device, run.flex, profile=("flashtile",))


def _run_shape(run: _Run, shape: providers.DenseShape, label: str, group: str, stages: tuple, timer, device,
               flex: _FlexBudget, profile: tuple) -> None:
    """Every chosen provider on one shape: validated against the reference, then timed; one row each; the
    providers in ``profile`` record the kernels that ran."""
    import flashtile

    chosen = run.opts.stage_providers("dense")
    where = f"{label} N={shape.seqlen} B={shape.batch}"
    try:
        inputs = providers.make_inputs(shape.batch, shape.seqlen, shape.nheads, shape.nheads_kv, shape.headdim,
                                       shape.headdim_v, common.DTYPES[shape.dtype], device)
    except Exception as exc:  # noqa: BLE001
        error = common.describe_error(exc)
        for prov in chosen:
            row = {**shape.key(prov), "config": label, "group": group, "fwd_err": error}
            run.add("dense", row, f"{where} {prov}", f"inputs failed: {error}")
        gpu._free_cuda(collect=True)
        return
    reference, reference_err = _reference(inputs, shape) if run.opts.check else (None, None)
    if reference_err:
        common.log(f"   {where}: the reference failed, nothing is timed unchecked: {reference_err}")
    for prov in chosen:
        if reference_err:
            row = {**shape.key(prov), "invalid": reference_err}
        elif prov == "flex" and flex.spent_s > flex.budget_s:
            row = {**shape.key(prov), "skipped": f"flex compile budget ({flex.budget_s:.0f} s) spent"}
        else:
            start = time.perf_counter()
            calls_before = flashtile.stats()["calls"]
            try:
                row = gpu.measure(prov, inputs, shape, timer, stages, reference, profile=prov in profile)
            except Exception as exc:  # noqa: BLE001 - e.g. a cleanup after a broken CUDA context
                row = {**shape.key(prov), "fwd_err": common.describe_error(exc)}
            if prov == "flashtile":  # which backend really ran: Triton, unless something fell back
                calls = flashtile.stats()["calls"]
                row["backend"] = sorted(b for b, n in calls.items() if n > calls_before.get(b, 0))
            if prov == "flex":
                flex.spent_s += time.perf_counter() - start
        row.update(config=label, group=group)
        run.add("dense", row, f"{where} {prov}", gpu._progress(row))
    del inputs, reference
    gpu._free_cuda(collect=True)


def _reference(inputs: dict, shape: providers.DenseShape) -> tuple:
    """``(validation.Reference, None)`` of a dense or model shape, or ``(None, "reference: <error>")``."""
    try:
        q, k, v = inputs["bshd"]
        reference = validation.reference(q, k, v, inputs["dout_bshd"], **shape.features(inputs))
        gpu._free_cuda()
        return reference, None
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: every cell of the shape says so
        gpu._free_cuda()
        return None, f"reference: {common.describe_error(exc)}"


def _run_variants(run: _Run, timer, device) -> None:
    opts = run.opts
    sizes = opts.grid.variant_sizes

    def on_row(case, row):
        label = f"{case.group} N={case.N} B={case.B} {'causal' if case.causal else 'full'} {case.prov} {case.variant}"
        run.add("variants", row, label, variants._progress(row))

    variants.run_cases(_variant_cases(opts), common.DTYPES[opts.grid.dtype], device, timer,
                       sizes.ref_heads if opts.check else None, on_row,
                       flex_budget_s=opts.grid.variant_flex_budget_s, profile=True,
                       paired_rounds=2 if torch.device(device).type == "cpu" else variants.PAIRED_ROUNDS)
    run.payload["variant_criteria"] = [c for c in variants.evaluate(run.payload["variants"]) if c["verdict"] != "no data"]


def run_stages(run: _Run, device, timer) -> None:
    """The GPU suite's stages on ``device`` with ``timer`` (:func:`common.gpu_timer` on CUDA; tests pass
    a CPU device, tiny grids and :func:`common.cpu_timer` to run the same code)."""
    opts = run.opts
    counts = _cell_counts(opts)
    run.progress = common.Progress(sum(counts.values()))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        common.log("WARNING: TRITON_INTERPRET is set: flashtile's kernels run in Triton's interpreter, not on the GPU")
    for stage in STAGES:  # what will not run, and why; the rest is marked as it finishes
        if stage not in opts.stages:
            run.stage(stage, "skipped", "not selected (--only)")
        elif counts[_section_of(stage)] == 0:
            run.stage(stage, "skipped", "no selected provider applies")
        else:
            run.stage(stage, "not reached")
    sections = [("dense", _run_dense), ("models", _run_models), ("variants", _run_variants), ("decode", _run_decode),
                ("e2e", _run_e2e)]
    for section, runner in sections:
        if counts[section]:
            runner(run, timer, device)
            for stage in STAGES:
                if _section_of(stage) == section and stage in opts.stages:
                    run.stage(stage, "ran")
            run.save()


def _section_of(stage: str) -> str:
    """The part of the run a stage belongs to (the models stage's rows go to the dense section)."""
    if stage in DENSE_STAGES:
        return "dense"
    if stage == "models":
        return "models"
    return "variants" if stage in VARIANT_GROUPS else stage


def _run_decode(run: _Run, timer, device) -> None:
    opts = run.opts
    ceiling = run.payload["models"]["bandwidth_ceiling_TBps"]
    decode.run(_decode_shapes(opts), opts.grid.decode_layouts, opts.stage_providers("decode"), device, timer,
               opts.check, lambda label, row: run.add("decode", row, label, decode.progress_text(row)),
               ceiling_tbps=ceiling)


def _run_e2e(run: _Run, timer, device) -> None:  # wall clock: e2e does not use the kernel timer
    opts = run.opts
    e2e.run(opts.grid.e2e, opts.stage_providers("e2e"), device,
            lambda label, row: run.add("e2e", row, label, e2e.progress_text(row)))


def _run_cpu(run: _Run) -> None:
    opts, grid = run.opts, run.opts.grid
    gpu_stages = ("bwd", "fwd_bwd", "models", "window", "varlen", "softcap", "decode", "e2e")
    reason = "--device cpu" if torch.cuda.is_available() else "no CUDA GPU"
    run.payload["skipped"].append(
        f"{'--device cpu' if torch.cuda.is_available() else 'No CUDA GPU found'}: GPU rows skipped (dense sweep vs "
        "SDPA flash/cuDNN/efficient/math, FlexAttention, flash-attn; window, varlen, softcap; decode; end to end). "
        "This is the CPU comparison: flashtile's tiled torch backend vs naive attention and torch's CPU SDPA, "
        "forward only.")
    for stage in gpu_stages:
        run.stage(stage, "skipped", reason)
    chosen = opts.stage_providers("cpu")
    if "fwd" not in opts.stages:
        run.stage("fwd", "skipped", "not selected (--only); the CPU comparison is forward only")
        run.payload["skipped"].append("--only selects no stage the CPU comparison runs (it is forward only)")
        run.progress = common.Progress(0)
        return
    run.stage("fwd", "not reached", "CPU comparison")
    total = len(grid.cpu_seqlens) * len(grid.cpu_headdims) * len(grid.cpu_causal) * len(chosen)
    run.progress = common.Progress(total)

    def on_row(row):
        label = f"cpu d{row['D']} N={row['N']} {'causal' if row['causal'] else 'full'} {row['prov']}"
        run.add("cpu", row, label, cpu.progress_text(row))

    cpu.sweep(grid.cpu_seqlens, grid.cpu_headdims, grid.cpu_causal, chosen, grid.cpu_dtype, opts.check, on_row)
    run.stage("fwd", "ran", "CPU comparison")


def run(opts: Options) -> tuple[dict, str]:
    """Run the suite; returns ``(payload, text)`` after writing the JSON, Markdown and plots.
    The JSON is rewritten after every cell, so a run cut short keeps what it measured."""
    from . import report

    import flashtile

    env = gpu._env() if opts.device == "cuda" else _cpu_env()
    state = _Run(opts, env)
    flashtile.reset_stats()
    where = env["gpu"] or f"CPU ({env.get('cpu')})"
    what = f"stages {' '.join(opts.stages)}" if opts.device == "cuda" else "the CPU comparison (forward)"
    common.log(f"flashtile bench suite ({opts.grid.name}) on {where}; {what}; results -> {state.json_path}")
    if common.load_warning(env):
        common.log(f"WARNING: {common.load_warning(env)}")
    try:
        if opts.device == "cuda":
            run_stages(state, torch.device("cuda", torch.cuda.current_device()), common.gpu_timer())
        else:
            _run_cpu(state)
    except KeyboardInterrupt:
        state.payload["interrupted"] = True
        common.log("interrupted: writing what was measured so far")
    state.save()
    files = report.write(state.payload, state.stem, plots=opts.plots)
    state.payload["files"] = files
    state.save()
    return state.payload, report.terminal(state.payload)


def exit_status(payload: dict) -> int:
    """1 when flashtile was asked for and measured nothing at all; 130 after an interrupt; else 0."""
    if payload.get("interrupted"):
        return 130
    mine = [r for section in ROW_KEYS for r in payload[section] if r.get("prov") == "flashtile"]
    if mine and all(r.get("status") not in ("ok", "partial") for r in mine):
        return 1
    return 0


# ---------------------------------------------------------------- merging runs made in parts

# The identity of a row in each section: a later file's row replaces an earlier one with the same key.
MERGE_KEYS = {
    "dense": ("config", "N", "B", "prov"),
    "variants": ("group", "prov", "variant", "N", "B", "causal"),
    "decode": ("dtype", "B", "L", "layout", "prov"),
    "e2e": ("kind", "prompt", "prov", "layers", "dtype"),
    "cpu": ("D", "N", "causal", "prov"),
}


def merge_payloads(payloads: list[dict], sources: list[str]) -> dict:
    """One payload from several suite results (e.g. ``--full`` run in parts under a time limit)."""
    import json

    merged = json.loads(json.dumps(payloads[0]))  # a deep copy
    merged["env"]["merged_from"] = [{"file": src, "date": p["env"]["date"], "git_commit": p["env"].get("git_commit"),
                                     "gpu": p["env"].get("gpu"), "argv": p["env"].get("argv")}
                                    for src, p in zip(sources, payloads)]
    merged["grid"] = {**merged["grid"], "name": "merged", "parts": [p["grid"] for p in payloads]}
    for section, key in MERGE_KEYS.items():
        rows: dict = {}
        for p in payloads:
            for row in p[section]:
                rows[tuple(str(row.get(k)) for k in key)] = row
        merged[section] = list(rows.values())
    for p in payloads[1:]:
        for stage, state in p["stages"].items():
            if state.get("status") == "ran" or stage not in merged["stages"]:
                merged["stages"][stage] = state
    merged["skipped"] = list(dict.fromkeys(line for p in payloads for line in p["skipped"]))
    for what in ("gpu", "git_commit", "torch", "triton"):
        values = sorted({str(p["env"].get(what)) for p in payloads})
        if len(values) > 1:
            merged["skipped"].append(f"merged runs differ in {what}: {', '.join(values)}")
    merged["variant_criteria"] = [c for c in variants.evaluate(merged["variants"]) if c["verdict"] != "no data"]
    merged["elapsed_s"] = sum(p["elapsed_s"] for p in payloads)
    merged["interrupted"] = any(p["interrupted"] for p in payloads)
    merged["flashtile_stats"] = None
    return finalize(merged)


def merge(paths, out, plots: bool = True) -> tuple[dict, str]:
    """``--merge``: read suite result files, write the merged JSON, Markdown and plots in ``out``."""
    import json

    from . import report

    payloads = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--merge {path}: {exc}") from None
        problems = validate(data)
        if problems:
            raise UsageError(f"--merge {path}: not a flashtile suite result ({problems[0]})")
        payloads.append(data)
    if len({p["mode"] for p in payloads}) > 1:
        raise UsageError("--merge: the files mix GPU and CPU results")
    merged = merge_payloads(payloads, [str(p) for p in paths])
    env = merged["env"]
    slug = common.gpu_slug(env["gpu"]) if merged["mode"] == "gpu" else "cpu"
    stem = common.unique_stem(out, f"{slug}-suite-merged-{env['date']}")
    common.write_json(stem.with_suffix(".json"), merged)
    merged["files"] = report.write(merged, stem, plots=plots)
    common.write_json(stem.with_suffix(".json"), merged)
    return merged, report.terminal(merged)
