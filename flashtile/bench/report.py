"""What a suite run shows: the summary against the best peer, the terminal and Markdown reports,
and the PNG plots (matplotlib, when installed).

Summary ratio: for each flashtile measurement, the best (fastest) peer measured on the same shape
and stage; ``ratio`` = how many times faster flashtile is (``best peer time / flashtile time``, or
``flashtile tokens/s / best peer tokens/s``): above 1 flashtile is ahead, below 1 behind. A stage a
peer failed or skipped does not count for it; with no peer measured the ratio is empty.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from . import common

STAGE_NAMES = {"fwd": "fwd", "bwd": "bwd", "fwd_bwd": "fwd+bwd"}
# Variant rows of flashtile and the peer rows that compute the same thing.
VARIANT_PEERS = {"window": ("window",), "varlen": ("padded",), "softcap": ("softcap",)}


# ---------------------------------------------------------------- summary (pure)


def _ok(row: dict | None, key: str, *errors: str) -> float | None:
    """``row[key]`` when the row measured it (positive, no error on the way), else None."""
    if not row or row.get("skipped") or row.get("invalid") or any(row.get(e) for e in ("fwd_err", "err", *errors)):
        return None
    value = row.get(key)
    return value if isinstance(value, (int, float)) and value > 0 else None


def best_peer(values: dict, higher_is_better: bool):
    """``(name, value)`` of the best measured peer in ``{name: value or None}``, or ``(None, None)``."""
    measured = {name: v for name, v in values.items() if v is not None}
    if not measured:
        return None, None
    name = (max if higher_is_better else min)(measured, key=measured.get)
    return name, measured[name]


def entry(section: str, config: str, shape: str, stage: str, metric: str, higher_is_better: bool, flashtile_row,
          flashtile_value, peers: dict, rates: dict | None = None) -> dict:
    """One summary line: flashtile's value, the best peer's, and their ratio (> 1: flashtile ahead)."""
    name, value = best_peer(peers, higher_is_better)
    ratio = note = None
    if flashtile_value is not None and value is not None:
        ratio = flashtile_value / value if higher_is_better else value / flashtile_value
    if flashtile_row is None:
        note = "flashtile not measured"
    elif flashtile_value is None:
        errors = common.error_fields(flashtile_row)
        label = flashtile_row.get("fwd_err") or flashtile_row.get("err") or next(iter(errors.values()), None)
        note = "flashtile: " + (common.invalid_cell(flashtile_row) if flashtile_row.get("invalid") else
                                "skipped" if flashtile_row.get("skipped") else
                                common.short_error(label) if label else "not measured")
    elif name is None:
        note = "no peer measured"
    out = {"section": section, "config": config, "shape": shape, "stage": stage, "metric": metric,
           "higher_is_better": higher_is_better, "flashtile": flashtile_value, "best_peer": name,
           "best_peer_value": value, "ratio": ratio, "note": note}
    if rates:  # TFLOP/s (or GB/s) next to the times, for the tables
        out["rate_unit"] = rates["unit"]
        out["flashtile_rate"] = rates.get("flashtile")
        out["best_peer_rate"] = rates.get(name) if name else None
    return out


def _dense(rows: list[dict]) -> list[dict]:
    out = []
    shapes: dict = {}
    for r in rows:
        shapes.setdefault((r["config"], r["N"], r["B"]), {})[r["prov"]] = r
    for (config, n, b), cells in shapes.items():
        ft = cells.get("flashtile")
        for stage in STAGE_NAMES:
            if not any(f"{stage}_ms" in r or f"{stage}_err" in r for r in cells.values()):
                continue  # the stage did not run
            peers = {p: _ok(r, f"{stage}_ms", f"{stage}_err") for p, r in cells.items() if p != "flashtile"}
            rates = {p: r.get(f"{stage}_tflops") for p, r in cells.items()}
            out.append(entry("dense", config, f"N={n} B={b}", stage, "ms", False, ft,
                             _ok(ft, f"{stage}_ms", f"{stage}_err"), peers, {"unit": "TFLOP/s", **rates}))
    return out


def _variants(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["prov"] != "flashtile" or r["variant"] not in VARIANT_PEERS:
            continue
        same = [p for p in rows if p["prov"] != "flashtile" and p["group"] == r["group"]
                and p["variant"] in VARIANT_PEERS[r["variant"]] and all(p[k] == r[k] for k in ("N", "B", "causal"))]
        config = {"window": f"window ({(r.get('window') or ['?'])[0]}, 0)",
                  "varlen": f"varlen, {r['group'].split('_')[-1]} lengths",
                  "softcap": f"softcap {r.get('softcap') or ''}"}[r["variant"]]
        shape = f"N={r['N']} B={r['B']} {'causal' if r['causal'] else 'full'}"
        for stage in ("fwd", "bwd"):
            peers = {f"{p['prov']} {p['variant']}": _ok(p, f"{stage}_ms", f"{stage}_err") for p in same}
            rates = {f"{p['prov']} {p['variant']}": p.get(f"{stage}_tflops") for p in same}
            out.append(entry("variants", config, shape, stage, "ms", False, r, _ok(r, f"{stage}_ms", f"{stage}_err"),
                             peers, {"unit": "TFLOP/s", "flashtile": r.get(f"{stage}_tflops"), **rates}))
    return out


def _decode(rows: list[dict]) -> list[dict]:
    out = []
    shapes: dict = {}
    for r in rows:
        shapes.setdefault((r["dtype"], r["H"], r["Hkv"], r["D"], r["B"], r["L"]), []).append(r)
    for (dtype, h, hkv, d, b, n), cells in shapes.items():
        config = f"decode {dtype} h{h}/{hkv} d{d}"
        peers_rows = [r for r in cells if r["prov"] != "flashtile"]
        for ft in (r for r in cells if r["prov"] == "flashtile"):
            for prefix in ("step", "graph"):
                peers = {f"{p['prov']} {p['layout']}": _ok(p, f"{prefix}_ms", f"{prefix}_err") for p in peers_rows}
                rates = {f"{p['prov']} {p['layout']}": p.get(f"{prefix}_GBps") for p in peers_rows}
                out.append(entry("decode", config, f"B={b} L={n}", f"{prefix} {ft['layout']}", "ms", False, ft,
                                 _ok(ft, f"{prefix}_ms", f"{prefix}_err"), peers,
                                 {"unit": "GB/s", "flashtile": ft.get(f"{prefix}_GBps"), **rates}))
    return out


def _e2e(rows: list[dict]) -> list[dict]:
    out = []
    for ft in (r for r in rows if r["prov"] == "flashtile"):
        same = [r for r in rows if r["prov"] != "flashtile" and r["kind"] == ft["kind"] and r["prompt"] == ft["prompt"]]
        config = f"llama3-8b x{ft['layers']} layers {ft['dtype']}"
        if ft["kind"] == "prefill":
            peers = {r["prov"]: _ok(r, "prefill_ms") for r in same}
            out.append(entry("e2e", config, f"prompt {ft['prompt']}", "prefill", "ms", False, ft,
                             _ok(ft, "prefill_ms"), peers))
        else:
            peers = {r["prov"]: _ok(r, "tokens_per_s") for r in same}
            out.append(entry("e2e", config, f"prompt {ft['prompt']} +{ft['new_tokens']}", "decode", "tokens/s", True,
                             ft, _ok(ft, "tokens_per_s"), peers))
    return out


def _cpu(rows: list[dict]) -> list[dict]:
    out = []
    for ft in (r for r in rows if r["prov"] == "flashtile"):
        same = [r for r in rows if r["prov"] != "flashtile" and all(r[k] == ft[k] for k in ("D", "N", "causal"))]
        peers = {r["prov"]: _ok(r, "fwd_ms") for r in same}
        rates = {r["prov"]: r.get("fwd_gflops") for r in same}
        out.append(entry("cpu", f"cpu d{ft['D']} h{ft['H']} {'causal' if ft['causal'] else 'full'}",
                         f"N={ft['N']} B={ft['B']}", "fwd", "ms", False, ft, _ok(ft, "fwd_ms"), peers,
                         {"unit": "GFLOP/s", "flashtile": ft.get("fwd_gflops"), **rates}))
    return out


def summary(payload: dict) -> list[dict]:
    """Every flashtile measurement against its best peer (see the module docstring)."""
    return (_dense(payload.get("dense", [])) + _variants(payload.get("variants", [])) + _decode(payload.get("decode", []))
            + _e2e(payload.get("e2e", [])) + _cpu(payload.get("cpu", [])))


def aggregate(entries: list[dict]) -> list[dict]:
    """Per (section, configuration, stage): the geometric mean, min and max of the ratios, and which
    peers were best how often."""
    groups: dict = {}
    for e in entries:
        groups.setdefault((e["section"], e["config"], e["stage"]), []).append(e)
    out = []
    for (section, config, stage), items in groups.items():
        ratios = [e["ratio"] for e in items if e["ratio"]]
        out.append({
            "section": section, "config": config, "stage": stage, "shapes": len(items), "compared": len(ratios),
            "ratio_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            "best_peers": dict(Counter(e["best_peer"] for e in items if e["best_peer"]).most_common()),
            "notes": sorted({e["note"] for e in items if e["note"]}),
        })
    return out


# ---------------------------------------------------------------- tables


def _value(value, metric: str, rate=None, unit=None) -> str:
    """``1.234 ms (456 TFLOP/s)``, ``88.5 tokens/s``, or ``-``."""
    if value is None:
        return "-"
    text = f"{value:.1f}" if metric == "tokens/s" or value >= 100 else f"{value:.3f}"
    text += f" {metric}"
    if rate is not None and unit:
        text += f" ({_rate(rate)} {unit})"
    return text


def summary_table(entries: list[dict]) -> str:
    headers = ["section", "config", "shape", "stage", "flashtile", "best peer", "peer", "ratio", "note"]
    lines = []
    for e in entries:
        unit = e.get("rate_unit")
        lines.append([e["section"], e["config"], e["shape"], STAGE_NAMES.get(e["stage"], e["stage"]),
                      _value(e["flashtile"], e["metric"], e.get("flashtile_rate"), unit),
                      e["best_peer"] or "-", _value(e["best_peer_value"], e["metric"], e.get("best_peer_rate"), unit),
                      f"{e['ratio']:.2f}x" if e["ratio"] else "-", e["note"] or ""])
    return common.markdown_table(headers, lines)


def aggregate_table(groups: list[dict]) -> str:
    headers = ["section", "config", "stage", "ratio (geomean)", "min..max", "best peer (times best)", "note"]
    lines = []
    for g in groups:
        span = f"{g['ratio_min']:.2f}..{g['ratio_max']:.2f}" if g["ratio_min"] else "-"
        peers = ", ".join(f"{p} ({n})" for p, n in g["best_peers"].items()) or "-"
        note = "; ".join(g["notes"])
        if g["compared"] < g["shapes"]:
            note = f"{g['compared']}/{g['shapes']} compared" + (f"; {note}" if note else "")
        lines.append([g["section"], g["config"], STAGE_NAMES.get(g["stage"], g["stage"]),
                      f"{g['ratio_geomean']:.2f}x" if g["ratio_geomean"] else "-", span, peers, note])
    return common.markdown_table(headers, lines)


def _ms_cell(row: dict, prefix: str, error_keys=()) -> str:
    """``median (p10-p90)`` in ms, or the row's marked cell."""
    if row.get("invalid"):
        return common.invalid_cell(row)
    if row.get("skipped"):
        return "skip"
    for key in ("fwd_err", "err", *error_keys):
        if row.get(key):
            return common.short_error(row[key])
    ms = row.get(f"{prefix}_ms")
    if ms is None:
        return "-"
    low, high = row.get(f"{prefix}_p10_ms"), row.get(f"{prefix}_p90_ms")
    spread = f" ±{(high - low) / 2 / ms:.0%}" if low is not None and high is not None and ms > 0 else ""
    return f"{ms:.3f}{spread}"


def _rate(value) -> str:
    """A rate cell: whole numbers on a GPU (hundreds of TFLOP/s), two significant digits below 10 (CPU)."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _failed(row: dict | None) -> str | None:
    """The one marked cell of a row that measured nothing (skipped, or its forward failed), else None."""
    if row is None:
        return "-"
    if row.get("invalid"):
        return common.invalid_cell(row)
    if row.get("skipped"):
        return "skip"
    main = row.get("fwd_err") or row.get("err")
    return common.short_error(main) if main else None


def _rate_cell(row: dict | None, key: str, error_key: str) -> str:
    failed = _failed(row)
    if failed:
        return failed
    return common.short_error(row[error_key]) if row.get(error_key) else _rate(row.get(key))


def _ordered(rows, order):
    rank = {p: i for i, p in enumerate(order)}
    return sorted(rows, key=lambda r: rank.get(r["prov"], len(rank)))


def versus_table(rows: list[dict], against: str = "fa4", stages=("fwd", "bwd")) -> str:
    """One line per shape: each provider's TFLOP/s (``fwd / bwd``) and flashtile's speed as a multiple of
    ``against``'s (``x FA4``: above 1 flashtile is faster); invalid, failed and skipped cells say so."""
    from .providers import NAMES

    provs = [p for p in NAMES if any(r["prov"] == p for r in rows)]
    lines = []
    for config, n, b in dict.fromkeys((r["config"], r["N"], r["B"]) for r in rows):
        cells = {r["prov"]: r for r in rows if (r["config"], r["N"], r["B"]) == (config, n, b)}
        line = [config, str(n), str(b)]
        for p in provs:
            failed = _failed(cells.get(p))
            line.append(failed or " / ".join(_rate_cell(cells[p], f"{s}_tflops", f"{s}_err") for s in stages))
        ratios = []
        for stage in stages:
            mine = _ok(cells.get("flashtile"), f"{stage}_ms", f"{stage}_err")
            theirs = _ok(cells.get(against), f"{stage}_ms", f"{stage}_err")
            ratios.append(f"{theirs / mine:.2f}" if mine and theirs else "-")
        line.append(" / ".join(ratios))
        lines.append(line)
    slash = "/".join(STAGE_NAMES[s] for s in stages)
    headers = ["shape", "N", "B", *(f"{p} {slash}" for p in provs), f"flashtile x {against} {slash}"]
    return common.markdown_table(headers, lines)


def dense_tables(rows: list[dict]) -> str:
    """Per configuration: TFLOP/s by provider and seqlen, then each row's times, bandwidth, memory, error."""
    from .providers import NAMES

    parts = []
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        provs = [p for p in NAMES if any(r["prov"] == p for r in mine)] + sorted(
            {r["prov"] for r in mine} - set(NAMES))
        stages = [s for s in STAGE_NAMES if any(f"{s}_ms" in r or f"{s}_err" in r for r in mine)] or ["fwd"]
        shapes = list(dict.fromkeys((r["N"], r["B"], r["H"], r["Hkv"]) for r in mine))
        lines = []
        for n, b, h, hkv in shapes:
            cells = {r["prov"]: r for r in mine if r["N"] == n and r["B"] == b}
            line = [str(n), f"{b}x{h}" + (f"/{hkv}" if hkv != h else "")]
            for p in provs:
                failed = _failed(cells.get(p))
                line.append(failed or " / ".join(_rate_cell(cells[p], f"{s}_tflops", f"{s}_err") for s in stages))
            lines.append(line)
        headers = ["seqlen", "BxH"] + [f"{p} {'/'.join(STAGE_NAMES[s] for s in stages)}" for p in provs]
        parts += [f"### {config}", "", "TFLOP/s:", "", common.markdown_table(headers, lines), ""]
        detail = []
        for r in sorted(mine, key=lambda r: (r["N"], provs.index(r["prov"]) if r["prov"] in provs else 99)):
            peak = r.get("peak_extra_GB")
            if _failed(r):
                reason = r.get("invalid") or r.get("skipped") or r.get("fwd_err") or r.get("err")
                detail.append([str(r["N"]), r["prov"], _failed(r), *([""] * (len(stages) + 3)), r.get("status", ""),
                               reason])
                continue
            detail.append([str(r["N"]), r["prov"], *(_ms_cell(r, s, (f"{s}_err",)) for s in stages),
                           _rate(r.get("fwd_GBps")),
                           common.fmt_bytes(peak * 1e9) if peak is not None else (common.short_error(r["mem_err"])
                                                                                  if r.get("mem_err") else "-"),
                           f"{r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else "-",
                           r.get("status", ""), ", ".join(r.get("backend") or [])])
        headers = ["seqlen", "provider", *(f"{STAGE_NAMES[s]} ms ±spread" for s in stages), "fwd GB/s",
                   "peak extra", "max err", "status", "backend / why not"]
        parts += ["Times (median, ± half the 10th-90th percentile spread), modeled forward bandwidth, peak extra "
                  "memory, max error:", "", common.markdown_table(headers, detail), ""]
    return "\n".join(parts)


def _kernel_text(names) -> str:
    return "<br>".join(f"`{n}`" for n in names) if names else "-"


def kernel_table(payload: dict) -> str:
    """Which kernels each provider ran (dense: the first seqlen of each configuration; decode: each cell)."""
    lines = []
    for r in payload.get("dense", []):
        if r.get("kernels") or r.get("ranges"):
            kernels, ranges = r.get("kernels") or {}, r.get("ranges") or {}
            lines.append([f"dense {r['config']} N={r['N']}", r["prov"], _kernel_text(kernels.get("fwd")),
                          _kernel_text(kernels.get("bwd")), _kernel_text(sorted({*ranges.get("fwd", []),
                                                                                  *ranges.get("bwd", [])}))])
    for r in payload.get("variants", []):
        if r.get("kernels") or r.get("ranges"):
            kernels, ranges = r.get("kernels") or {}, r.get("ranges") or {}
            lines.append([f"{r['group']} {r['variant']} N={r['N']}", r["prov"], _kernel_text(kernels.get("fwd")),
                          _kernel_text(kernels.get("bwd")),
                          _kernel_text(sorted({*ranges.get("fwd", []), *ranges.get("bwd", [])}))])
    for r in payload.get("decode", []):
        if r.get("kernels") or r.get("ranges"):
            lines.append([f"decode B={r['B']} L={r['L']} {r['layout']}", r["prov"], _kernel_text(r.get("kernels")), "-",
                          _kernel_text(r.get("ranges"))])
    if not lines:
        return "No kernel names recorded."
    return common.markdown_table(["cell", "provider", "forward kernels", "backward kernels", "flashtile ranges"], lines)


def decode_table(rows: list[dict], ceiling) -> str:
    lines = []
    for r in rows:
        step, graph = r.get("step_ms"), r.get("graph_ms")
        frac = lambda key: f"{r[key]:.0%}" if r.get(key) is not None else "-"  # noqa: E731
        if r.get("err") or r.get("skipped") or r.get("invalid"):
            status = (common.invalid_cell(r) if r.get("invalid") else common.short_error(r["err"]) if r.get("err")
                      else "skip")
            lines.append([f"{r['B']} x {r['L']}", r["layout"], r["prov"], status, "-", "-", "-", "-", "-", "-"])
            continue
        graph_cell = f"{graph * 1e3:.1f}" if graph else (common.short_error(r["graph_err"]) if r.get("graph_err") else "-")
        spread = ""
        if r.get("step_p10_ms") is not None and step:
            spread = f" ±{(r['step_p90_ms'] - r['step_p10_ms']) / 2 / step:.0%}"
        lines.append([f"{r['B']} x {r['L']}", r["layout"], r["prov"], f"{step * 1e3:.1f}{spread}",
                      _rate(r.get("step_GBps")), frac("step_frac_peak"), graph_cell,
                      _rate(r.get("graph_GBps")), frac("graph_frac_peak"),
                      f"{r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else "-"])
    head = "of the ceiling" if ceiling else "(no ceiling known for this GPU)"
    headers = ["batch x cache", "layout", "provider", "us/step", "GB/s", f"frac {head}", "graph us/step", "graph GB/s",
               "graph frac", "max err"]
    return common.markdown_table(headers, lines)


def e2e_tables(rows: list[dict]) -> str:
    prefill = [r for r in rows if r["kind"] == "prefill"]
    dec = [r for r in rows if r["kind"] == "decode"]
    out = []
    if prefill:
        prompts = sorted({r["prompt"] for r in prefill})
        impls = list(dict.fromkeys(r["prov"] for r in prefill))
        lines = []
        for n in prompts:
            cells = {r["prov"]: r for r in prefill if r["prompt"] == n}
            lines.append([str(n)] + [_ms_cell(cells[p], "prefill") if p in cells else "-" for p in impls]
                         + [common.fmt_bytes(cells[p]["peak_extra_GB"] * 1e9) if cells.get(p, {}).get("peak_extra_GB")
                            is not None else "-" for p in impls])
        out += ["Prefill latency (ms, median ± half the 10th-90th percentile spread) and peak extra memory:", "",
                common.markdown_table(["prompt"] + [f"{p} ms" for p in impls] + [f"{p} peak" for p in impls], lines), ""]
        diffs = [f"{r['prov']} {r['logits_max_diff_vs_eager']:.2e}" for r in prefill
                 if r.get("logits_max_diff_vs_eager") is not None]
        if diffs:
            out += [f"Last-token logits, max |difference| vs eager at prompt {min(prompts)}: {', '.join(diffs)}", ""]
    if dec:
        lines = [[r["prov"], str(r["prompt"]), str(r["new_tokens"]),
                  common.short_error(r["err"]) if r.get("err") else common.fmt(r.get("tokens_per_s"), 1),
                  common.fmt(r.get("ms_per_token"), 2), common.fmt(r.get("generate_ms"), 1)] for r in dec]
        out += ["Decode (greedy generate, batch 1; tokens/s = (N - 1) / (time(N) - time(1))):", "",
                common.markdown_table(["impl", "prompt", "new tokens", "tokens/s", "ms/token", "generate ms"], lines), ""]
    ranges = [f"{r['prov']}: {', '.join(r['ranges']) or 'no flashtile range'}; {len(r.get('kernels') or [])} distinct "
              "kernels" for r in prefill if "ranges" in r]
    if ranges:
        out += ["Proof of path (one prefill each): " + "; ".join(ranges), ""]
    return "\n".join(out)


# ---------------------------------------------------------------- reports


def terminal(payload: dict) -> str:
    """What the command prints last: the per-shape summary, then the summary by configuration."""
    from . import cpu

    parts = []
    if payload.get("cpu"):
        parts += [f"CPU forward, {payload['grid']['cpu']['dtype']}, batch {cpu.BATCH}, {cpu.NHEADS} heads; peak extra "
                  "mem = ru_maxrss growth in a fresh process", cpu.format_table(payload["cpu"]), ""]
    entries = payload.get("summary") or []
    if entries:
        parts += ["flashtile vs the best peer, by shape (ratio > 1: flashtile faster)", summary_table(entries), "",
                  "Summary: flashtile vs the best peer, by configuration", aggregate_table(aggregate(entries))]
    else:
        parts.append("Nothing measured to compare.")
    parts += [f"NOTE: {line}" for line in payload.get("skipped", [])]
    parts.append(f"Repeats: {repeats(payload)}.")
    warning = common.load_warning(payload.get("env") or {})
    if warning:
        parts.append(f"WARNING: {warning}")
    stats = payload.get("flashtile_stats") or {}
    if stats.get("fallbacks"):
        parts.append(f"WARNING: flashtile fell back from its preferred backend during the run: {stats['fallbacks']}")
    if payload.get("interrupted"):
        parts.append("INTERRUPTED: the results above are partial")
    files = payload.get("files") or {}
    for kind in ("json", "markdown"):
        if files.get(kind):
            parts.append(f"wrote {files[kind]}")
    for path in files.get("plots", []):
        parts.append(f"wrote {path}")
    if files.get("plots_note"):
        parts.append(files["plots_note"])
    return "\n".join(parts)


def repeats(payload: dict) -> str:
    """``timed runs per cell: 12..180 (median reported)`` over every row's ``*_reps``, or the e2e/CPU wording."""
    counts = [v for section in ("dense", "variants", "decode", "cpu") for row in payload.get(section, [])
              for k, v in row.items() if k.endswith("_reps") and isinstance(v, int)]
    if not counts:
        return "no timed runs"
    span = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}..{max(counts)}"
    return f"{span} timed runs per measurement (the median is reported, with its 10th-90th percentile spread)"


def ran_stages(payload: dict) -> list[str]:
    """The stages that ran (or were cut short), in order: the header names these alone."""
    return [name for name, state in payload.get("stages", {}).items() if state.get("status") != "skipped"]


def markdown(payload: dict, plot_paths=(), plots_note: str | None = None) -> str:
    env, grid, models = payload["env"], payload["grid"], payload["models"]
    where = env.get("gpu") or f"CPU ({env.get('cpu')})"
    commit = env.get("git_commit") or "unknown"
    parts = [f"# flashtile benchmark suite ({grid['name']}): {where}, {env['date']}", ""]
    facts = [("GPU", env.get("gpu") or "none"), ("driver / CUDA / cuDNN",
                                                 f"{env.get('driver') or '-'} / {env.get('cuda') or '-'} / {env.get('cudnn') or '-'}"),
             ("CPU", env.get("cpu")), ("torch / triton", f"{env.get('torch')} / {env.get('triton')}"),
             ("FlashAttention-4", env.get("fa4") or "not installed"),
             ("flashtile", f"{env.get('flashtile')}, commit `{commit[:12]}`" + (" (dirty tree)" if env.get("git_dirty") else "")),
             ("command", "`python -m flashtile " + " ".join(env.get("argv") or []) + "`"),
             ("stages", " ".join(ran_stages(payload)) or "none"),
             ("repeats", repeats(payload)),
             ("machine load", f"{env.get('load_1m')} (1-minute load average) on {env.get('cpus')} cores"
              + (" **busy**" if env.get("busy") else "")),
             ("elapsed", common.fmt_duration(payload.get("elapsed_s") or 0))]
    parts += [common.markdown_table(["", ""], [[k, str(v)] for k, v in facts]), ""]
    if common.load_warning(env):
        parts += [f"**{common.load_warning(env)}**", ""]
    if payload.get("interrupted"):
        parts += ["**Interrupted: partial results.**", ""]
    parts += ["## How it measures", ""]
    for key in ("shapes", "timing", "flops", "bytes", "memory", "reference", "proof"):
        parts.append(f"- {key}: {models[key]}")
    if models.get("bandwidth_ceiling_TBps"):
        parts.append(f"- bandwidth ceiling: {models['bandwidth_ceiling_TBps']} TB/s ({models['bandwidth_ceiling_source']})")
    parts += ["", "## Stages", "",
              common.markdown_table(["stage", "status", "reason"],
                                    [[s, v["status"], v.get("reason") or ""] for s, v in payload["stages"].items()
                                     if v["status"] != "skipped"]), ""]
    parts += [f"**{line}**" for line in payload.get("skipped", [])] + [""]
    entries = payload.get("summary") or []
    if entries:
        parts += ["## Summary: flashtile vs the best peer", "",
                  "ratio = best peer time / flashtile time (tokens/s: flashtile / best peer); above 1 flashtile is "
                  "ahead. Geometric mean over the shapes of each configuration:", "",
                  aggregate_table(aggregate(entries)), "", "### By shape", "", summary_table(entries), ""]
    dense = [r for r in payload.get("dense", []) if r.get("group") != "models"]
    model_rows = [r for r in payload.get("dense", []) if r.get("group") == "models"]
    if dense:
        parts += ["## flashtile against each peer (TFLOP/s, fwd / bwd)", "", versus_table(dense), "",
                  "## Dense attention", "", dense_tables(dense)]
    if model_rows:
        parts += ["## Model shapes (TFLOP/s on the visible pairs, fwd / bwd)", "", versus_table(model_rows), "",
                  dense_tables(model_rows)]
    if payload.get("variants"):
        from . import variants

        parts += ["## Variants (sliding window, varlen, softcap)", "", "```",
                  variants.format_report(payload["variants"], payload.get("variant_criteria") or []), "```", ""]
    if payload.get("decode"):
        parts += ["## Decode", "", decode_table(payload["decode"], models.get("bandwidth_ceiling_TBps")), ""]
    if payload.get("e2e"):
        parts += ["## End to end", "", e2e_tables(payload["e2e"])]
    if payload.get("cpu"):
        from . import cpu

        parts += ["## CPU comparison", "", cpu.NOTE, "", cpu.format_table(payload["cpu"]), ""]
    if any(payload.get(s) for s in ("dense", "variants", "decode")):
        parts += ["## Kernels that ran (proof of path)", "", kernel_table(payload), ""]
    if plot_paths or plots_note:
        parts += ["## Plots", ""]
        parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plot_paths]
        if plots_note:
            parts.append(plots_note)
        parts.append("")
    return "\n".join(parts)


def write(payload: dict, stem: Path, plots: bool = True) -> dict:
    """Write the Markdown report and the plots next to the JSON; returns the ``files`` entry."""
    from . import plots as plotting

    stem = Path(stem)
    plot_paths, note = [], "plots skipped (--no-plots)"
    if plots:
        plot_paths, note = plotting.write_all(payload, stem)
    md_path = stem.with_suffix(".md")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(payload, plot_paths, note))
    return {"json": str(stem.with_suffix(".json")), "markdown": str(md_path), "plots": [str(p) for p in plot_paths],
            "plots_note": note}
