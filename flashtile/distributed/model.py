"""A communication model of context parallelism: T_P of ring, Ulysses and the hybrid from T1 and bytes moved.

    python -m flashtile.distributed.model     # the fit, its check on the 2/4-GPU rows, 8 GPUs predicted

For causal forward + backward (bf16, one sequence of N = P x n tokens, the benchmark of
:mod:`.bench`), every method splits the causal work evenly over P GPUs, so the ideal time is T1 / P
(T1: flashtile on the whole sequence on one GPU, measured). The model adds what the split costs:

- **Compute.** Ring blocks are shorter than the whole sequence: zigzag ring steps are calls over
  chunks of ``m = shard / 2`` tokens, where T1 runs rows of N. A call's efficiency is taken as
  ``e(m) = m / (m + m0)`` (``m0``: the row length at half speed, fitted), so a ring's compute is
  ``T1 / P x e(N) / e(m)``. Ulysses runs the whole sequence (``nheads / P`` heads): ``T1 / P``.
  The forward is ``FWD = 2/7`` of the compute (its 2 matmuls a block against the backward's 5).
- **Ring** (R ranks, shards of s tokens): R equal steps forward and backward. Between steps K and V
  travel (``2 s Hkv d`` bf16 values), overlapped with the step's attention: a step costs
  ``max(compute, bytes / B)``. The backward also carries the dK/dV partial sums (fp32: twice K/V's
  bytes) with them; their last hop, home to the owner, is exposed.
- **Ulysses** (U ranks): four all-to-alls forward (q, k, v to head shards, out back) and four backward
  (dout, dq, dk, dv), not overlapped; each sends ``(U - 1) / U`` of its tensor. KV heads fewer than U
  are repeated to U first (as :mod:`.ulysses` does).
- **Hybrid** (a ``(U, R)`` mesh): Ulysses' all-to-alls over U, then a ring over R of shards of
  ``U n`` tokens with ``nheads / U`` heads.
- Every exchange (a ring step's send/receive, an all-to-all) also costs a fixed ``t_op``.

Three numbers are fitted to every timed row of the committed 2- and 4-GPU measurements (H200, NVLink;
``benchmarks/results/h200x{2,4}-cp-*.json``): the bandwidth ``B`` (GB/s a GPU sends, effective: it
absorbs the copies around each exchange), ``m0`` and ``t_op``, by least squares on the relative error
of T_P (a coarse-to-fine grid search). T1 at lengths no run measured is scaled as N^2 from the longest
measured one (T1 / N^2 varies by less than 5% from 16k to 256k tokens). It is a model: it says where the
time goes and extrapolates P; it is no substitute for an 8-GPU run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
MEASURED = ("h200x2-cp-2026-11-27-56f0e72.json", "h200x4-cp-2026-11-27-56f0e72.json")
FWD = 2 / 7
BF16, FP32 = 2, 4
METHODS = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class Params:
    bandwidth_gbs: float  # B: GB/s one GPU sends
    m0: float  # tokens: the block row length at half the kernel's speed
    t_op_ms: float  # fixed cost of one exchange


@dataclass(frozen=True)
class Shape:
    world: int
    tokens_per_gpu: int
    nheads: int
    nheads_kv: int
    headdim: int = 128


def _transfer_ms(nbytes: float, p: Params) -> float:
    return nbytes / (p.bandwidth_gbs * 1e6)


def _efficiency(tokens: float, p: Params) -> float:
    return tokens / (tokens + p.m0)


def _ring_ms(compute_ms, ranks, shard, nheads_kv, headdim, total, p: Params) -> float:
    """R zigzag steps of ``shard``-token K/V shards, forward and backward, over ``ranks`` ranks."""
    if ranks == 1:
        return compute_ms
    compute = compute_ms * _efficiency(total, p) / _efficiency(shard / 2, p)
    kv = 2 * shard * nheads_kv * headdim * BF16
    step_fwd, step_bwd = FWD * compute / ranks, (1 - FWD) * compute / ranks
    fwd = (ranks - 1) * max(step_fwd, _transfer_ms(kv, p)) + step_fwd
    bwd = (ranks - 1) * max(step_bwd, _transfer_ms(kv * (1 + FP32 / BF16), p)) + step_bwd
    last_hop = _transfer_ms(kv * FP32 / BF16, p)
    return fwd + bwd + last_hop + (2 * (ranks - 1) + 1) * p.t_op_ms


def _all_to_all_ms(ranks, tokens, nheads, nheads_kv, headdim, p: Params) -> float:
    """Ulysses' eight all-to-alls over ``ranks`` ranks of ``tokens``-token local tensors."""
    if ranks == 1:
        return 0.0
    nheads_kv = max(nheads_kv, ranks)  # fewer KV heads than ranks: repeated first
    per_pass = (2 * nheads + 2 * nheads_kv) * tokens * headdim * BF16  # q, k, v, out (dout, dq, dk, dv)
    return 2 * _transfer_ms(per_pass * (ranks - 1) / ranks, p) + 8 * p.t_op_ms


def predict_ms(method: str, shape: Shape, t1_ms: float, p: Params, mesh: tuple = None) -> float:
    """T_P of ``method`` (``"ring"``, ``"ulysses"``, ``"hybrid"`` on ``mesh`` = (U, R), default (2, P/2))."""
    world, n = shape.world, shape.tokens_per_gpu
    if method == "ring":
        mesh = (1, world)
    elif method == "ulysses":
        mesh = (world, 1)
    elif method == "hybrid":
        mesh = mesh or (2, world // 2)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    ulysses, ring = mesh
    if ulysses * ring != world:
        raise ValueError(f"mesh {mesh} must have {world} ranks")
    heads_kv = max(shape.nheads_kv, ulysses) // ulysses if ulysses > 1 else shape.nheads_kv
    return (_all_to_all_ms(ulysses, n, shape.nheads, shape.nheads_kv, shape.headdim, p)
            + _ring_ms(t1_ms / world, ring, ulysses * n, heads_kv, shape.headdim, world * n, p))


def load_rows(paths=None) -> list:
    """Every (shape, T1, method, measured T_P) of the committed measurements."""
    paths = paths or [os.path.join(RESULTS, name) for name in MEASURED]
    rows = []
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if "flashtile_1gpu_ms" not in row:  # the 1M-token ring run has no one-GPU time
                    continue
                shape = Shape(row["world"], row["tokens_per_gpu"], row["nheads"], row["nheads_kv"], row["headdim"])
                for method in METHODS:
                    if row.get(f"{method}_status") == "ok":
                        rows.append((shape, row["flashtile_1gpu_ms"], method, row[f"{method}_ms"]))
    return rows


def t1_table(paths=None) -> dict:
    """Measured T1 (ms) by (N, nheads, nheads_kv)."""
    table = {}
    for shape, t1, _, _ in load_rows(paths):
        table[shape.world * shape.tokens_per_gpu, shape.nheads, shape.nheads_kv] = t1
    return table


def t1_ms(tokens: int, nheads: int, nheads_kv: int, table: dict) -> float:
    """T1 at ``tokens``: measured, or scaled as N^2 from the longest measured sequence of these heads."""
    if (tokens, nheads, nheads_kv) in table:
        return table[tokens, nheads, nheads_kv]
    longest = max(n for n, h, hkv in table if (h, hkv) == (nheads, nheads_kv))
    return table[longest, nheads, nheads_kv] * (tokens / longest) ** 2


def _loss(p: Params, rows) -> float:
    return sum((predict_ms(method, shape, t1, p) / measured - 1) ** 2 for shape, t1, method, measured in rows)


def fit(rows=None) -> Params:
    """B, m0 and t_op by least squares on the relative error of T_P: a grid, refined three times around its best."""
    rows = rows or load_rows()
    # log B (GB/s), m0 (tokens), t_op (ms): centre and half-width of the search
    centre, width = [math.log(150.0), 2048.0, 0.5], [math.log(10.0), 2048.0, 0.5]
    best = None
    for _ in range(4):
        grids = [[c + w * (2 * i / 10 - 1) for i in range(11)] for c, w in zip(centre, width)]
        for log_b in grids[0]:
            for m0 in grids[1]:
                for t_op in grids[2]:
                    p = Params(math.exp(log_b), max(m0, 0.0), max(t_op, 0.0))
                    loss = _loss(p, rows)
                    if best is None or loss < best[0]:
                        best = loss, p, [log_b, max(m0, 0.0), max(t_op, 0.0)]
        centre, width = best[2], [w / 4 for w in width]
    return best[1]


def validate(p: Params, rows=None) -> list:
    """``(shape, method, measured efficiency, predicted efficiency)`` of every measured row."""
    rows = rows or load_rows()
    return [(shape, method, t1 / (shape.world * measured), t1 / (shape.world * predict_ms(method, shape, t1, p)))
            for shape, t1, method, measured in rows]


def predictions(p: Params, world=8, tokens=(8192, 16384, 32768, 65536), heads=((32, 32), (32, 8)), table=None):
    """``(shape, {method: (T_P ms, efficiency)})`` at ``world`` GPUs; the hybrid on (2, P/2) and (P/2, 2)."""
    table = table or t1_table()
    out = []
    for nheads, nheads_kv in heads:
        for n in tokens:
            shape = Shape(world, n, nheads, nheads_kv)
            t1 = t1_ms(world * n, nheads, nheads_kv, table)
            cells = {}
            for name, method, mesh in (("ring", "ring", None), ("ulysses", "ulysses", None),
                                       (f"hybrid 2x{world // 2}", "hybrid", (2, world // 2)),
                                       (f"hybrid {world // 2}x2", "hybrid", (world // 2, 2))):
                ms = predict_ms(method, shape, t1, p, mesh)
                cells[name] = (ms, t1 / (world * ms))
            out.append((shape, t1, cells))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashtile.distributed.model", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8, help="GPUs to predict (default 8)")
    parser.add_argument("--results", nargs="*", default=None, help="measurement JSON files to fit (default: the "
                        "committed 2- and 4-GPU H200 runs)")
    options = parser.parse_args(argv)
    rows = load_rows(options.results)
    p = fit(rows)
    print(f"fitted on {len(rows)} timed rows: B = {p.bandwidth_gbs:.0f} GB/s a GPU, m0 = {p.m0:.0f} tokens, "
          f"t_op = {p.t_op_ms:.2f} ms")
    print("\nvalidation (efficiency T1 / (P T_P), measured -> predicted):")
    worst = 0.0
    for shape, method, measured, predicted in validate(p, rows):
        worst = max(worst, abs(predicted - measured))
        print(f"  P={shape.world} {shape.tokens_per_gpu // 1024:>3}k {shape.nheads}/{shape.nheads_kv:<2} "
              f"{method:<8} {measured:.3f} -> {predicted:.3f}  ({predicted - measured:+.3f})")
    print(f"  largest error: {worst:.3f}")
    table = predictions(p, options.world, table=t1_table(options.results))
    names = list(table[0][2])
    print(f"\n{options.world} GPUs predicted (efficiency, T_P ms):\n")
    print("| tokens/GPU | heads | T1 ms | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for shape, t1, cells in table:
        print(f"| {shape.tokens_per_gpu // 1024}k | {shape.nheads}/{shape.nheads_kv} | {t1:.0f} | "
              + " | ".join(f"{eff:.2f} ({ms:.0f})" for ms, eff in cells.values()) + " |")
    return p


if __name__ == "__main__":
    main()
