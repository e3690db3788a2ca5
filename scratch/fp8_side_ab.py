"""A/B of the FP8 side costs (branch wip-fp8-side; the lead removes this file before merging): the fused quantize
step of flash_attn_fp8_func alone, and the FP8-cache against the bf16-cache decode step, at the shapes of
``python -m flashtile bench --suite fp8``. Runs on whatever flashtile tree is first on PYTHONPATH, so one device
call can time main and the branch side by side:

    for tree in /path/main /path/branch; do PYTHONPATH=$tree python scratch/fp8_side_ab.py; done

One line a case. Quantize: checked first against its torch twin (torch_fp8.quantize: e4m3 values and descales;
a differing e4m3 value is one step off where the rotation's fp32 sums round the other way, rarely), then timed
as the bench suite times it (triton.testing.do_bench, L2 flushed: host time shows where the host is slower than
the GPU), and its GPU time alone (torch profiler: every kernel the call launches, summed). End to end:
flash_attn_fp8_func against flash_attn_func (bf16) at N=4096, d128, the cell furthest below its bar. Decode:
flashtile.bench.fp8.decode_cell (checked against fp32 attention on the dequantized cache, then each step
replayed in a CUDA graph).

``--sweep``: the decode cells again with each FP8 tile of SWEEP (BLOCK_M, BLOCK_N, warps, stages, programs an
SM) put in configs.DECODE_SM90_FP8 / DECODE_FP8_PROGRAMS_PER_SM (the split count follows the programs an SM).
``--quant-sweep`` (this branch only): the quantize cells again with each (warps, register cap) of QUANT_SWEEP.
``--decode-only`` / ``--quantize-only``: one half.
"""
import os
import sys
import time

import torch

# bfloat16 on the GPU, as the bench suite; --cpu-smoke (tiny shapes under TRITON_INTERPRET=1) takes float16.
DTYPE = torch.bfloat16


def quantize_check(q, k, v):
    """``(fraction of e4m3 values that differ from the twin's, largest descale relative difference)``; raises
    when a value differs by more than one e4m3 step."""
    from flashtile.backends import torch_fp8
    from flashtile.backends.triton import quant
    ours = quant.quantize(q, k, v)
    twin = torch_fp8.quantize(q, k, v)
    differ, descale_err = 0.0, 0.0
    for name, a, b in zip(("q8", "k8", "v8_t", "q_descale", "k_descale", "v_descale"), ours, twin):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        a, b = a.float(), b.float()
        if "descale" in name:
            descale_err = max(descale_err, ((a - b).abs() / b.abs()).max().item())
            continue
        mask = a != b
        differ = max(differ, mask.float().mean().item())
        assert ((a - b).abs() <= b.abs() / 8 + 2 ** -9)[mask].all(), f"{name}: a value off by more than one step"
    return differ, descale_err


def device_us(fn, calls: int = 20) -> float:
    """GPU time a call of ``fn``: every CUDA kernel it launches, summed (torch profiler), averaged."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total / calls


def host_us(fn, calls: int = 50) -> float:
    """Host time a call of ``fn`` (launches queued, no wait): wall time of ``calls`` calls, averaged."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


SWEEP = ((16, 128, 8, 3, 2), (16, 128, 4, 3, 3), (16, 128, 4, 3, 2), (16, 128, 8, 3, 3), (16, 64, 4, 3, 3),
         (16, 128, 4, 4, 2), (16, 256, 8, 2, 1))


def decode_rows(timer, device, label: str = "") -> bool:
    """The bench's decode cells, one line each; False when one failed."""
    from flashtile.bench import fp8
    ok = True
    for batch, cache_len in fp8.DECODE_SHAPES:
        graphs = device.type == "cuda"
        row = fp8.decode_cell(batch, cache_len, timer, device, graphs=graphs)
        if row.get("status") != "ok":
            ok = False
            print(f"decode{label} B={batch} L={cache_len}: {row.get('status')}", flush=True)
            continue
        how = "graph" if graphs else "step"
        print(f"decode{label} B={batch} L={cache_len} GQA 32/8 d128 ({how}): bf16 {row[f'bf16_{how}_ms'] * 1e3:.1f} us "
              f"({row[f'bf16_{how}_GBps']:.0f} GB/s) | fp8 {row[f'fp8_{how}_ms'] * 1e3:.1f} us "
              f"({row[f'fp8_{how}_GBps']:.0f} GB/s) | fp8/bf16 {row[f'fp8_over_bf16_{how}']:.3f} (bar 0.55) | max err "
              f"bf16 {row['bf16_max_abs_err']:.1e} fp8 {row['fp8_max_abs_err']:.1e} | {row['fp8_kernel']}", flush=True)
        if graphs:
            torch.cuda.empty_cache()
    return ok


def sweep(timer, device) -> bool:
    """decode_rows under each FP8 tile of SWEEP."""
    from flashtile.backends.triton import configs, decode
    table, per_sm = configs.DECODE_SM90_FP8[128], configs.DECODE_FP8_PROGRAMS_PER_SM
    ok = True
    try:
        for block_m, block_n, warps, stages, programs in SWEEP:
            configs.DECODE_SM90_FP8[128] = (configs.TileConfig(block_m, block_n, warps, stages), *table[1:])
            configs.DECODE_FP8_PROGRAMS_PER_SM = programs
            decode._plan.cache_clear()
            ok &= decode_rows(timer, device, f" [fp8 tile {block_m}x{block_n} w{warps} s{stages}, {programs} an SM]")
    finally:
        configs.DECODE_SM90_FP8[128], configs.DECODE_FP8_PROGRAMS_PER_SM = table, per_sm
        decode._plan.cache_clear()
    return ok


QUANT_SWEEP = {128: ((8, 128), (16, 64), (8, 255)), 256: ((8, 255), (16, 128))}


def quant_sweep(timer, device) -> bool:
    """quantize_rows under each (warps, maxnreg) of QUANT_SWEEP (quant._WARPS / quant._MAXNREG, this branch)."""
    from flashtile.backends.triton import quant
    if not hasattr(quant, "_MAXNREG"):
        print("--quant-sweep: this tree has no quant._WARPS/_MAXNREG table", flush=True)
        return True
    warps, maxnreg = dict(quant._WARPS), dict(quant._MAXNREG)
    ok = True
    try:
        for head_dim, choices in QUANT_SWEEP.items():
            for w, m in choices:
                quant._WARPS[head_dim], quant._MAXNREG[head_dim] = w, m
                quant._QUANT._cache.clear()
                quant._QUANT._by_value.clear()
                ok &= quantize_rows(timer, device, head_dims=(head_dim, ), label=f" [w{w} maxnreg {m}]",
                                    end_to_end=False)
    finally:
        quant._WARPS.update(warps)
        quant._MAXNREG.update(maxnreg)
        quant._QUANT._cache.clear()
        quant._QUANT._by_value.clear()
    return ok


def quantize_rows(timer, device, head_dims=None, label: str = "", end_to_end: bool = True) -> bool:
    """The quantize cells and (``end_to_end``) the end-to-end cells, one line each; False when one failed."""
    import flashtile
    from flashtile.backends.triton import quant
    from flashtile.bench import common, fp8
    failed = False
    for head_dim in head_dims or fp8.HEAD_DIMS:
        for seqlen in fp8.SEQLENS:
            batch, nheads = fp8.TOKENS // seqlen, fp8.WIDTH // head_dim
            q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device=device, dtype=DTYPE) for _ in range(3))
            try:
                differ, descale_err = quantize_check(q, k, v)
                ms = common.timing_fields("t", timer(lambda: quant.quantize(q, k, v)))["t_ms"]
                gpu = device_us(lambda: quant.quantize(q, k, v)) if device.type == "cuda" else float("nan")
                host = host_us(lambda: quant.quantize(q, k, v)) if device.type == "cuda" else float("nan")
                nbytes = 3 * q.numel() * 2 + 3 * q.numel() + v.numel() * 2  # read q,k,v (v twice), write e4m3
                print(f"quantize{label} d={head_dim} B={batch} N={seqlen} H={nheads}: do_bench {ms * 1e3:.1f} us | GPU "
                      f"{gpu:.1f} us ({nbytes / gpu / 1e6:.0f} GB/s) | host {host:.1f} us/call | e4m3 differing "
                      f"{differ:.1e}, descale rel err {descale_err:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                failed = True
                print(f"quantize{label} d={head_dim} N={seqlen}: FAILED {type(exc).__name__}: {exc}", flush=True)
    if not end_to_end:
        return not failed
    batch, seqlen, nheads, head_dim = (4, 4096, 16, 128) if device.type == "cuda" else (1, 256, 2, 128)
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device=device, dtype=DTYPE) for _ in range(3))
    for causal in (False, True):
        bf16 = common.timing_fields("t", timer(lambda: flashtile.flash_attn_func(q, k, v, causal=causal)))["t_ms"]
        e2e = common.timing_fields("t", timer(lambda: flashtile.flash_attn_fp8_func(q, k, v, causal=causal)))["t_ms"]
        print(f"end to end d=128 B={batch} N={seqlen} causal={causal}: bf16 {bf16 * 1e3:.1f} us, fp8 e2e {e2e * 1e3:.1f} us, "
              f"x bf16 {bf16 / e2e:.2f} (bar 1.4 at N >= 8k)", flush=True)
    return not failed


def main() -> int:
    global DTYPE
    import flashtile
    from flashtile.bench import common, fp8
    if "--cpu-smoke" in sys.argv:
        # The script's own control flow on tiny shapes (TRITON_INTERPRET=1): no timing worth reading.
        DTYPE, device, timer = torch.float16, torch.device("cpu"), common.cpu_timer(runs=1)
        fp8.HEAD_DIMS, fp8.SEQLENS, fp8.TOKENS, fp8.WIDTH, fp8.DECODE_SHAPES = (128, ), (256, ), 512, 256, ((2, 512), )
        name = "cpu"
    else:
        device, timer, name = torch.device("cuda"), common.gpu_timer(), torch.cuda.get_device_name()
    print(f"flashtile {os.path.dirname(flashtile.__file__)} on {name}", flush=True)
    failed = False
    if "--decode-only" not in sys.argv:
        failed |= not quantize_rows(timer, device)
        if "--quant-sweep" in sys.argv:
            failed |= not quant_sweep(timer, device)
    if "--quantize-only" not in sys.argv:
        failed |= not decode_rows(timer, device)
        if "--sweep" in sys.argv:
            failed |= not sweep(timer, device)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
