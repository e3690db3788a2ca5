"""The FP8-cache decode step's tiles (evidence for configs.DECODE_SM90_FP8): the e4m3 step against the bf16-cache step, GQA 32/8, d=128,
one query token, batch 16 x 32768 and 1 x 131072, CUDA-graph replay (flashtile.bench.fp8.decode_cell's cells).

Variants of the e4m3 step: main's plan (auto tiles and splits), main's plan on a head-major cache (the same
(batch, seq, head, dim) tensor as a transposed view of (batch, head, seq, dim): each KV head's keys contiguous, so a
128-key tile is one 16 KB run instead of 128-byte rows 1 KB apart: isolates DRAM locality), and tiles x programs
an SM (``per_sm``: the split count decode_splits gives, as DECODE_FP8_PROGRAMS_PER_SM would), plus the kernel's
KV heads a program (``heads``, TileConfig.heads). Each variant is checked against fp32 attention on
the dequantized cache (batch row 0) before it is timed.

    python benchmarks/decode_fp8_tiles.py      # table on stdout, $OUT/decode-sweep.json

SWEEP_SMOKE=1 (with TRITON_INTERPRET=1): the same cells on CPU on a tiny shape, fp16 q, no graphs (a check of the
script, not a measurement).
"""
import json
import os
import time
from dataclasses import replace

import torch

from flashtile import validation
from flashtile.backends.torch_fp8 import FP8_MAX, to_fp8
from flashtile.backends.triton import configs, decode
from flashtile.backends.triton.configs import TileConfig
from flashtile.bench import common
from flashtile.bench.decode import capture_graph
from flashtile.testing import attention_ref

SMOKE = os.environ.get("SWEEP_SMOKE") == "1"
SHAPES = ((2, 300),) if SMOKE else ((16, 32768), (1, 131072))
DTYPE = torch.float16 if SMOKE else torch.bfloat16
NHEADS, NHEADS_KV, D = 32, 8, 128
GROUP = NHEADS // NHEADS_KV
MAX_ERR = 2e-2
# (tile, programs an SM, KV heads a program) besides main's plan (auto tiles and splits).
# Programs an SM as shared memory and registers allow (ptxas, sm_90, triton 3.6: 16x128 w4 s3 72 KB 166 registers;
# heads 2: 16x64 w4 s3 74 KB, s4 106 KB, 16x128 w4 s3 140 KB, s2 76 KB 250 registers; heads 4: 16x32 w4 s3 81 KB).
TILES = [
    (TileConfig(16, 128, 4, 3), 1, 1), (TileConfig(16, 128, 4, 3), 2, 1), (TileConfig(16, 128, 4, 3), 4, 1),
    (TileConfig(16, 128, 4, 4), 2, 1), (TileConfig(16, 256, 4, 2), 2, 1), (TileConfig(16, 256, 8, 3), 1, 1),
    (TileConfig(16, 64, 4, 4), 3, 1),
    (TileConfig(16, 64, 4, 3), 3, 2), (TileConfig(16, 64, 4, 4), 2, 2), (TileConfig(16, 128, 4, 3), 1, 2),
    (TileConfig(16, 128, 4, 2), 2, 2), (TileConfig(16, 128, 8, 3), 1, 2),
    (TileConfig(16, 32, 4, 3), 2, 4),
]


def variant_name(tile: TileConfig, per_sm: int, heads: int) -> str:
    """E.g. ``heads2 16x128 w4 s3 ps1``: KV heads a program (when more than one), the tile, programs an SM."""
    return (f"heads{heads} " if heads > 1 else "") + \
        f"{tile.BLOCK_M}x{tile.BLOCK_N} w{tile.num_warps} s{tile.num_stages} ps{per_sm}"


# (name, tile, programs an SM, KV heads a program); tile None: main's plan.
VARIANTS = [("main", None, None, 1)] + [(variant_name(*row), *row) for row in TILES]
# Cells whose graph is also profiled kernel by kernel.
PROFILED = ("bf16 main", "fp8 main")


def head_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seq, heads, dim) copied into a (batch, heads, seq, dim) buffer, returned as the same-shaped view."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def build(batch: int, cache_len: int, device):
    q = torch.randn(batch, 1, NHEADS, D, device=device, dtype=DTYPE)
    k16 = torch.randn(batch, cache_len, NHEADS_KV, D, device=device, dtype=DTYPE)
    v16 = torch.randn(batch, cache_len, NHEADS_KV, D, device=device, dtype=DTYPE)
    k_descale = k16.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX
    v_descale = v16.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX
    k8, v8 = to_fp8(k16.float() / k_descale[:, None]), to_fp8(v16.float() / v_descale[:, None])
    with torch.no_grad():
        ref16 = attention_ref(q[:1], k16[:1], v16[:1])[0]
        ref8 = attention_ref(q[:1], k8[:1].float() * k_descale[:, None], v8[:1].float() * v_descale[:, None])[0]
    return q, k16, v16, k8, v8, k_descale, v_descale, ref16, ref8


def step(q, k, v, seqlens, descales, splits, tile):
    args = validation.kvcache_args(q, k, v, cache_seqlens=seqlens, causal=True, num_splits=splits,
                                   **(dict(k_descale=descales[0], v_descale=descales[1]) if descales else {}))
    plan = decode.plan(q, k, v, args, tile)
    return (lambda: decode.attention_kv(q, k, v, args, tile)), plan


def kernel_times(graph, replays: int = 20) -> dict:
    """GPU us a replay of each kernel in ``graph`` (torch profiler, CUPTI): the split kernel against the combine,
    and what the step spends outside both (launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            times[event.key[:60]] = round(us / replays, 2)
    return times


def measure(name, fn, plan, ref, nbytes, timer, row_base):
    c = plan.config
    row = dict(row_base, variant=name, splits=plan.num_splits,
               tile=f"{c.BLOCK_M}x{c.BLOCK_N} w{c.num_warps} s{c.num_stages} h{getattr(c, 'heads', 1)}")
    try:
        err = common.max_abs_err(fn()[0][:1], ref)
        row["max_abs_err"] = err
        if not err <= MAX_ERR:
            row["status"] = f"wrong: max_abs_err {err:.2e}"
            return row
        graph = None if SMOKE else capture_graph(fn)
        times = timer(fn if SMOKE else graph.replay)
        row.update(common.timing_fields("graph", times))
        row["us"] = row["graph_ms"] * 1e3
        row["TBps"] = nbytes / (row["graph_ms"] * 1e-3) / 1e12
        row["status"] = "ok"
        if graph is not None and name in PROFILED:
            try:
                row["kernel_us"] = kernel_times(graph)
            except Exception as exc:  # the profile is a diagnostic: its failure leaves the timing standing
                row["kernel_us"] = {"error": common.describe_error(exc)[:120]}
    except Exception as exc:  # a tile that does not fit (shared memory, registers) is recorded, not fatal
        row["status"] = f"failed: {common.describe_error(exc)[:160]}"
    return row


def main():
    device = torch.device("cpu" if SMOKE else "cuda")
    sms = configs.sm_count(device)
    timer = common.cpu_timer(runs=1) if SMOKE else common.gpu_timer()
    rows = []
    start = time.time()
    for batch, cache_len in SHAPES:
        q, k16, v16, k8, v8, kd, vd, ref16, ref8 = build(batch, cache_len, device)
        seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
        base = dict(B=batch, L=cache_len)
        n16 = common.decode_bytes(batch, cache_len, NHEADS_KV, D, D, 2)
        n8 = n16 // 2
        cells = [("bf16 main", k16, v16, None, 0, None, ref16, n16),
                 ("bf16 main head-major", head_major(k16), head_major(v16), None, 0, None, ref16, n16),
                 ("fp8 main head-major", head_major(k8), head_major(v8), (kd, vd), 0, None, ref8, n8)]
        for name, tile, per_sm, hp in VARIANTS:
            if tile is None:
                cells.append((f"fp8 {name}", k8, v8, (kd, vd), 0, None, ref8, n8))
                continue
            tile = replace(tile, heads=hp)
            programs = batch * NHEADS_KV // hp * -(-GROUP * hp // tile.BLOCK_M)
            splits = configs.decode_splits(0, programs, cache_len, device, tile.BLOCK_N, per_sm=per_sm)
            cells.append((f"fp8 {name}", k8, v8, (kd, vd), splits, tile, ref8, n8))
        shape_rows = []
        for name, k, v, descales, splits, tile, ref, nbytes in cells:
            fn, plan = step(q, k, v, seqlens, descales, splits, tile)
            shape_rows.append(measure(name, fn, plan, ref, nbytes, timer, base))
            print(json.dumps(shape_rows[-1]), flush=True)
        bf16_us = shape_rows[0].get("us")
        for row in shape_rows:
            row["ratio"] = row["us"] / bf16_us if row.get("us") and bf16_us else None
        rows += shape_rows
        del q, k16, v16, k8, v8
        if not SMOKE:
            torch.cuda.empty_cache()
    gpu = "cpu" if SMOKE else torch.cuda.get_device_name()
    print(f"\n{gpu}, {sms} SMs, {time.time() - start:.0f} s")
    print(f"{'B x L':>10} {'variant':<28} {'tile':<18} {'splits':>6} {'us':>8} {'TB/s':>6} {'ratio':>6}  status")
    for r in rows:
        fmt = lambda x, s: format(x, s) if x is not None else "-"  # noqa: E731
        print(f"{r['B']:>3}x{r['L']:<6} {r['variant']:<28} {r['tile']:<18} {r['splits']:>6} {fmt(r.get('us'), '8.1f')} "
              f"{fmt(r.get('TBps'), '6.2f')} {fmt(r.get('ratio'), '6.3f')}  {r['status']}")
    for r in rows:
        if r.get("kernel_us"):
            print(f"{r['B']}x{r['L']} {r['variant']}: kernels (us a replay) {r['kernel_us']}")
    meta = dict(gpu=gpu, sms=sms, torch=torch.__version__, commit=common.git_commit())
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "decode-sweep.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
