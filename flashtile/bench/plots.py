"""PNG plots of a suite run (matplotlib, drawn on ``matplotlib.figure.Figure`` without pyplot, so no
display or global state is needed):

- dense: one figure per configuration (dtype, head dims, heads), subplots stage x causal, TFLOP/s
  against seqlen on a log2 axis, one line per provider;
- headline: bars per provider and configuration on the longest causal rows, forward and backward;
- decode: achieved K/V bandwidth per provider and layout, per step and per graph replay, with the
  bandwidth ceiling;
- e2e: prefill latency against prompt length, decode tokens/s;
- cpu: forward time and peak extra memory against seqlen.
"""
from __future__ import annotations

import re
from pathlib import Path

from . import common

STAGE_NAMES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _log2_axis(ax, values) -> None:
    values = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
    ax.minorticks_off()


def _title(payload: dict) -> str:
    env = payload["env"]
    return env.get("gpu") or f"CPU ({env.get('cpu')})"


def dense(payload: dict, stem: Path, figure) -> list[Path]:
    from .providers import NAMES

    rows = payload.get("dense", [])
    paths = []
    for group in dict.fromkeys(r["group"] for r in rows if r.get("group")):
        mine = [r for r in rows if r.get("group") == group]
        stages = [s for s in STAGE_NAMES if any(r.get(f"{s}_tflops") for r in mine)]
        if not stages:
            continue
        causals = sorted({r["causal"] for r in mine})
        provs = [p for p in NAMES if any(r["prov"] == p for r in mine)]
        fig = figure(figsize=(5.2 * len(causals), 3.6 * len(stages)), layout="constrained")
        axes = fig.subplots(len(stages), len(causals), squeeze=False)
        for i, stage in enumerate(stages):
            for j, causal in enumerate(causals):
                ax = axes[i][j]
                for prov in provs:
                    points = sorted((r["N"], r[f"{stage}_tflops"]) for r in mine
                                    if r["prov"] == prov and r["causal"] == causal and r.get(f"{stage}_tflops"))
                    if points:
                        ax.plot(*zip(*points), marker="o", label=prov, linewidth=2.4 if prov == "flashtile" else 1.3)
                _log2_axis(ax, [r["N"] for r in mine])
                ax.set_ylim(bottom=0)
                ax.set_title(f"{STAGE_NAMES[stage]}, {'causal' if causal else 'non-causal'}")
                ax.set_xlabel("seqlen (batch x seqlen = 16k tokens)")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8)
        fig.suptitle(f"{group}: TFLOP/s vs seqlen, {_title(payload)}")
        path = Path(f"{stem}-dense-{_slug(group)}.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def headline(payload: dict, stem: Path, figure) -> list[Path]:
    """Bars of every provider's TFLOP/s on the causal rows of the longest seqlen, forward and backward, one
    cluster per dense configuration that has several seqlens (the README's figure)."""
    from .providers import NAMES

    rows = [r for r in payload.get("dense", []) if r.get("causal") and r.get("config") == f"{r.get('group')} causal"]
    rows = [r for r in rows if len({x["N"] for x in rows if x["group"] == r["group"]}) > 1]
    if not rows:
        return []
    longest = max(r["N"] for r in rows)
    rows = [r for r in rows if r["N"] == longest]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    provs = [p for p in NAMES if any(r["prov"] == p for r in rows)]
    env = payload["env"]
    fig = figure(figsize=(9, 3.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    width = 0.8 / len(provs)
    for ax, stage in zip(axes, ("fwd", "bwd")):
        for i, prov in enumerate(provs):
            cells = {r["group"]: r.get(f"{stage}_tflops") for r in rows if r["prov"] == prov}
            ax.bar([g + (i - (len(provs) - 1) / 2) * width for g in range(len(groups))],
                   [cells.get(group) or 0 for group in groups], width, label=prov)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([group.split()[1] for group in groups])
        ax.set_title(f"{stage}, causal, N={longest // 1024}k")
        ax.set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=8, ncols=2)
    fig.suptitle(f"{_title(payload)}, {rows[0]['dtype']}, {env.get('date')}, flashtile {env.get('git_commit')} "
                 "(every cell validated before timing)", fontsize=9)
    path = Path(f"{stem}-headline.png")
    fig.savefig(path, dpi=100)
    return [path]


def decode(payload: dict, stem: Path, figure) -> list[Path]:
    rows = [r for r in payload.get("decode", []) if r.get("step_GBps")]
    if not rows:
        return []
    shapes = list(dict.fromkeys((r["B"], r["L"]) for r in rows))
    ceiling = payload["models"].get("bandwidth_ceiling_TBps")
    fig = figure(figsize=(max(6.0, 1.2 * max(sum(1 for r in rows if (r["B"], r["L"]) == s) for s in shapes)),
                          3.4 * len(shapes)), layout="constrained")
    axes = fig.subplots(len(shapes), 1, squeeze=False)
    for ax, (batch, length) in zip((a[0] for a in axes), shapes):
        mine = [r for r in rows if (r["B"], r["L"]) == (batch, length)]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["step_GBps"] for r in mine], width=0.4, label="per step (host included)")
        ax.bar([x + 0.2 for x in xs], [r.get("graph_GBps") or 0 for r in mine], width=0.4, label="CUDA graph replay")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['prov']}\n{r['layout']}" for r in mine], fontsize=8)
        if ceiling:
            ax.axhline(ceiling * 1e3, color="gray", linestyle="--", label=f"copy ceiling {ceiling} TB/s")
        ax.set_ylabel("GB/s (K+V read)")
        ax.set_title(f"decode: batch {batch} x cache {length}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode bandwidth, {_title(payload)}")
    path = Path(f"{stem}-decode.png")
    fig.savefig(path, dpi=100)
    return [path]


def e2e(payload: dict, stem: Path, figure) -> list[Path]:
    rows = payload.get("e2e", [])
    prefill = [r for r in rows if r["kind"] == "prefill" and r.get("prefill_ms")]
    dec = [r for r in rows if r["kind"] == "decode" and r.get("tokens_per_s")]
    if not prefill and not dec:
        return []
    fig = figure(figsize=(11, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for impl in dict.fromkeys(r["prov"] for r in prefill):
        points = sorted((r["prompt"], r["prefill_ms"]) for r in prefill if r["prov"] == impl)
        left.plot(*zip(*points), marker="o", label=impl)
    if prefill:
        _log2_axis(left, [r["prompt"] for r in prefill])
        left.set_yscale("log")
    left.set_xlabel("prompt length")
    left.set_ylabel("prefill latency (ms)")
    left.set_title("prefill, batch 1")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    right.bar([r["prov"] for r in dec], [r["tokens_per_s"] for r in dec])
    right.set_ylabel("tokens/s")
    right.set_title("decode (greedy generate, batch 1)")
    right.grid(True, axis="y", alpha=0.3)
    layers = next((r["layers"] for r in rows), "?")
    fig.suptitle(f"Llama-3-8B-shaped model, {layers} layers, random weights, {_title(payload)}")
    path = Path(f"{stem}-e2e.png")
    fig.savefig(path, dpi=100)
    return [path]


def cpu(payload: dict, stem: Path, figure) -> list[Path]:
    rows = [r for r in payload.get("cpu", []) if r.get("fwd_ms")]
    if not rows:
        return []
    fig = figure(figsize=(11, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for key in dict.fromkeys((r["prov"], r["D"], r["causal"]) for r in rows):
        mine = sorted((r for r in rows if (r["prov"], r["D"], r["causal"]) == key), key=lambda r: r["N"])
        label = f"{key[0]} d{key[1]}" + (" causal" if key[2] else "")
        left.plot([r["N"] for r in mine], [r["fwd_ms"] for r in mine], marker="o", label=label)
        right.plot([r["N"] for r in mine], [max((r.get("peak_extra_GB") or 0) * 1e3, 0.1) for r in mine], marker="o",
                   label=label)
    for ax, ylabel in ((left, "forward ms"), (right, "peak extra memory (MB, floor 0.1)")):
        _log2_axis(ax, [r["N"] for r in rows])
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"CPU comparison, forward, {_title(payload)}")
    path = Path(f"{stem}-cpu.png")
    fig.savefig(path, dpi=100)
    return [path]


PLOTTERS = {"dense": dense, "headline": headline, "decode": decode, "e2e": e2e, "cpu": cpu}


def write_all(payload: dict, stem: Path) -> tuple[list[Path], str | None]:
    """Every plot that has data; ``(paths, note)``, the note saying what was skipped or failed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    paths, failures = [], []
    for name, plotter in PLOTTERS.items():
        try:
            paths += plotter(payload, Path(stem), Figure)
        except Exception as exc:  # noqa: BLE001 - a plot must never lose the measurements
            failures.append(f"{name} plot failed: {common.describe_error(exc)}")
    return paths, "; ".join(failures) or None
