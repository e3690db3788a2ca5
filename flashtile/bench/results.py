"""BENCHMARKS.md from the committed result files: ``python -m flashtile bench --report``.

``benchmarks/results/index.json`` lists what BENCHMARKS.md publishes, in order: ``intro`` (lines of
Markdown) and ``sections``, each ``{"file", "title", "renderer"}`` (:data:`RENDERERS`: the main suite, variants,
qualify, the peers file, the FP8 suite, a context-parallel run) plus optional ``"against"`` (the peer
of the ``x`` column), ``"note"`` (a paragraph under the title) and ``"env"`` (facts the file lacks, e.g.
its date). Every table names its GPU, date, versions and commit from the file's own ``env``. The
report is a pure function of the index and the files, so a test regenerates it and compares it with
the committed BENCHMARKS.md: the tables cannot drift from their data.

Withdrawn numbers: from commit ``0548a7d`` (2026-11-27) until the fix of issue 42, MHA calls at head
dim 128 ran a one-pass backward that computed wrong dK and dV. Their backward numbers are shown as
:data:`WITHDRAWN`, never as speeds (:func:`withdraw`).
"""
from __future__ import annotations

import json
from pathlib import Path

from . import common

ROOT = Path(__file__).resolve().parents[2]
INDEX = Path("benchmarks/results/index.json")
OUTPUT = Path("BENCHMARKS.md")
MAX_BYTES = 45_000
WITHDRAWN = "withdrawn (wrong dK/dV, issue fixed; re-measure pending)"
ONE_PASS_SINCE = "2026-11-27"  # the day 0548a7d put the one-pass backward on the dispatch path


# ---------------------------------------------------------------- withdrawn numbers


def _bwd_ranges(row: dict) -> str:
    return " ".join((row.get("ranges") or {}).get("bwd") or [])


def one_pass_suspect(row: dict, date: str, config_evidence: dict) -> bool:
    """Whether a flashtile backward may have run the wrong one-pass kernel: not when its dQ, dK and dV were
    checked before timing; otherwise its recorded backward ranges
    (or those of its configuration's profiled row) name it; without a record, it was measured at MHA head
    dim 128 outside a window on or after :data:`ONE_PASS_SINCE`."""
    if row.get("prov") != "flashtile":
        return False
    check = row.get("check") or {}
    if all(name in check and check[name]["err"] <= check[name]["bound"] for name in ("dq", "dk", "dv")):
        # Its gradients were checked against the reference before it was timed (the validated suite).
        return False
    if _bwd_ranges(row):
        return "one-pass" in _bwd_ranges(row)
    if row.get("config") in config_evidence:
        return config_evidence[row["config"]]
    mha = row.get("Hkv", row.get("H")) == row.get("H")
    window = row.get("variant") == "window" or row.get("window")
    return date >= ONE_PASS_SINCE and row.get("D") == 128 and mha and not window


def withdraw(rows: list[dict], date: str) -> list[dict]:
    """Copies of ``rows`` with the backward of each :func:`one_pass_suspect` row replaced by :data:`WITHDRAWN`."""
    evidence: dict = {}
    for r in rows:
        if r.get("prov") == "flashtile" and r.get("config") and _bwd_ranges(r):
            evidence[r["config"]] = evidence.get(r["config"], False) or "one-pass" in _bwd_ranges(r)
    out = []
    for row in rows:
        row = dict(row)
        if one_pass_suspect(row, date, evidence):
            for stage in ("bwd", "fwd_bwd"):
                if row.get(f"{stage}_ms") is not None:
                    for key in [k for k in row if k.startswith(f"{stage}_") or k == f"paired_{stage}"]:
                        del row[key]
                    row[f"{stage}_err"] = WITHDRAWN
        out.append(row)
    return out


# ---------------------------------------------------------------- renderers


def _facts(env: dict, path: str) -> str:
    commit = (env.get("git_commit") or env.get("commit") or "unknown")[:12]
    command = env.get("command") or (f"python -m flashtile {' '.join(env['argv'])}" if env.get("argv") else "")
    command = f" · `{command}`" if command else ""
    return (f"GPU {env.get('gpu') or 'none'} · {env.get('date')} · torch {env.get('torch')} · triton "
            f"{env.get('triton') or '-'} · flashtile commit `{commit}` · data `{path}`{command}")


def _suite(data: dict, entry: dict) -> str:
    from . import report

    rows = withdraw(data["dense"], data["env"]["date"])
    parts = []
    if rows:
        stages = [s for s in ("fwd", "bwd") if any(f"{s}_ms" in r or f"{s}_err" in r for r in rows)]
        parts.append(report.versus_table(rows, entry.get("against", "cudnn"), stages))
    if data.get("decode"):
        parts.append(report.decode_table(data["decode"], data["models"].get("bandwidth_ceiling_TBps")))
    return "\n\n".join(parts)


def _variants(data: dict, entry: dict) -> str:
    from . import variants

    rows = withdraw(data["rows"], data["env"]["date"])
    return "```\n" + variants.format_report(rows, variants.evaluate(rows)) + "\n```"


def _qualify(data: dict, entry: dict) -> str:
    from ..tools import qualify

    return qualify.table(data["rows"]) + "\n\n" + data["summary_line"]


def _peer_withdrawn(case: str) -> bool:
    """A model-shape case of the peers file run at MHA head dim 128 (no GQA, no window)."""
    return "d128" in case and "GQA" not in case and "window" not in case


def _peers(data: dict, entry: dict) -> str:
    """The peers file (one run of flashtile, FA4, SDPA cuDNN / flash, Flex): TFLOP/s, model shapes in ms,
    decode under CUDA graphs, peak memory."""
    names = {"flashtile": "flashtile", "fa4": "FA4", "sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2 (SDPA flash)",
             "flex": "Flex"}
    parts = []
    for key, title in (("dense", "B = 16384 // N, H = 2048 // d (MHA)"), ("dense_with_flex", "with Flex")):
        rows = data.get(key) or []
        provs = [p for p in names if any(p in r for r in rows)]
        lines = []
        for r in rows:
            gone = r["d"] == 128  # every dense row here is MHA
            cell = lambda p: (f"{r[p]['fwd']:.0f} / " + (WITHDRAWN if p == "flashtile" and gone  # noqa: E731
                                                          else f"{r[p]['bwd']:.0f}")) if r.get(p) else "-"
            ratio = "-"
            if r.get("fa4") and r.get("flashtile"):
                ratio = f"{r['flashtile']['fwd'] / r['fa4']['fwd']:.2f} / " + (
                    "-" if gone else f"{r['flashtile']['bwd'] / r['fa4']['bwd']:.2f}")
            lines.append([f"d{r['d']} N={r['n']} B={r['b']} H={r['h']} {'causal' if r['causal'] else 'full'}",
                          *(cell(p) for p in provs), ratio])
        headers = ["shape", *(f"{names[p]} fwd / bwd" for p in provs), "flashtile x FA4 fwd / bwd"]
        parts += [f"TFLOP/s, {title}:", "", common.markdown_table(headers, lines), ""]
    lines = []
    for r in data.get("model_shapes_ms") or []:
        gone = _peer_withdrawn(r["case"])
        bwd = WITHDRAWN if gone else f"{r['flashtile']['bwd_ms']:.3f}"
        lines.append([r["case"], f"{r['flashtile']['fwd_ms']:.3f} / {bwd}",
                      f"{r['fa4']['fwd_ms']:.3f} / {r['fa4']['bwd_ms']:.3f}",
                      f"{r['speedup_fwd']:.2f} / " + ("-" if gone else f"{r['speedup_bwd']:.2f}")])
    if lines:
        parts += ["Model shapes, ms (fwd / bwd):", "",
                  common.markdown_table(["case", "flashtile", "FA4", "flashtile x FA4"], lines), ""]
    lines = [[f"{r['B']} x {r['L']}", *(f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in
                                        ("flashtile_us", "fa4_us", "sdpa_cudnn_us", "sdpa_flash_us"))]
             for r in data.get("decode_cuda_graph_us") or []]
    if lines:
        parts += ["Decode step under a CUDA graph, us (32/8 heads, d128):", "",
                  common.markdown_table(["batch x cache", "flashtile", "FA4", "cuDNN", "FA2 (SDPA flash)"], lines), ""]
    memory = data.get("peak_extra_MiB_fwd_bwd_N8192_h16_d128") or []
    if memory:
        parts.append("Peak extra memory of a forward + backward (N 8192, 16 heads, d128): "
                     + ", ".join(f"{names.get(m['provider'], m['provider'])} {m['extra_MiB']:.0f} MiB" for m in memory)
                     + ".")
    return "\n".join(parts).rstrip()


def _fp8(data: dict, entry: dict) -> str:
    """The FP8 suite (``python -m flashtile bench --suite fp8``): its own forward and decode tables."""
    from . import fp8

    forward = data["rows"]["forward"] + data["rows"].get("varlen", [])
    return fp8.forward_table(forward) + "\n\n" + fp8.decode_table(data["rows"]["decode"])


CP_METHODS = ("ring", "ulysses", "hybrid", "torch_cp")


def _cp_cell(row: dict, name: str) -> str:
    """``ms / efficiency / GB per GPU`` of one method, or its status (``wrong (err X)``, an error)."""
    status = row.get(f"{name}_status")
    if status == "ok":
        return f"{row[f'{name}_ms']:.1f} / {row[f'{name}_efficiency']:.2f} / {row[f'{name}_mem_gb']:.1f}"
    if status == "wrong":
        # Files before ccdb5c1 hold the absolute error (max_err), later ones the relative error (rel_err).
        kind = next((k for k in ("rel", "max") if row.get(f"{name}_{k}_err") is not None), None)
        return "wrong" + (f" ({'abs' if kind == 'max' else kind} err {row[f'{name}_{kind}_err']:.3g})" if kind else "")
    # "error: <type>: <message>" as the suite's cells show it.
    return f"ERR({status.split(':')[1].strip()})" if status and status.startswith("error:") else status or "-"


def _cp_long(row: dict) -> str:
    return (f"{row['N']:,} tokens on {row['world']} GPUs ({row['tokens_per_gpu']:,} a GPU), "
            f"{row['nheads']}/{row['nheads_kv']} heads, d{row['headdim']}, causal forward + backward: ring "
            f"{row['ring_ms'] / 1e3:.1f} s, {row['ring_mem_gb']:.1f} GB per GPU; {len(row['sampled_rows'])} rows of "
            f"out spread over the sequence within {row['max_err']:.1e} of a float32 reference.")


def _cp(data: dict, entry: dict) -> str:
    """A context-parallel run (``flashtile.distributed.bench``): per length and heads, the one-GPU time T1 and
    each method's ms / efficiency (T1 / (P T_P)) / peak GB per GPU, and the fastest method; a ``--long`` run is
    one line."""
    rows = data["rows"]
    if rows and "sampled_rows" in rows[0]:
        return "\n".join(_cp_long(r) for r in rows)
    methods = [m for m in CP_METHODS if any(f"{m}_status" in r for r in rows)]
    lines = []
    for r in rows:
        timed = {m: r[f"{m}_ms"] for m in methods if r.get(f"{m}_status") == "ok"}
        lines.append([f"{r['tokens_per_gpu']:,}", f"{r['nheads']}/{r['nheads_kv']}", f"{r['flashtile_1gpu_ms']:.1f}",
                      *(_cp_cell(r, m) if f"{m}_status" in r else "-" for m in methods),
                      min(timed, key=timed.get) if timed else "-"])
    headers = ["tokens/GPU", "heads", "T1 ms", *(f"{m} ms / eff / GB" for m in methods), "fastest"]
    return common.markdown_table(headers, lines)


RENDERERS = {"suite": _suite, "variants": _variants, "qualify": _qualify, "peers": _peers, "fp8": _fp8, "cp": _cp}


# ---------------------------------------------------------------- the report


def render(root: Path = ROOT) -> str:
    """BENCHMARKS.md's text from ``root``'s index and result files."""
    index = json.loads((root / INDEX).read_text())
    parts = [f"# {index['title']}", "", *index.get("intro", []), ""]
    for entry in index["sections"]:
        path = INDEX.parent / entry["file"]
        data = json.loads((root / path).read_text())
        # Facts from the file's env, else its top level (the FP8 and context-parallel files), else the device.
        env = {"gpu": (data.get("device") or {}).get("name"),
               **{k: data[k] for k in ("gpu", "date", "torch", "triton", "commit") if data.get(k)},
               **data.get("env", {}), **entry.get("env", {})}
        parts += [f"## {entry['title']}", "", _facts(env, str(path)), ""]
        if entry.get("note"):
            parts += [entry["note"], ""]
        parts += [RENDERERS[entry["renderer"]](data, entry), ""]
    return "\n".join(parts).rstrip() + "\n"


def write_report(root: Path = ROOT) -> str:
    """Write ``root``/BENCHMARKS.md from the index; returns what was written."""
    text = render(root)
    (root / OUTPUT).write_text(text)
    return f"wrote {root / OUTPUT} ({len(text.encode())} bytes) from {root / INDEX}"
