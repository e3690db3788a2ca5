"""A/B of the FP8 Hopper forward at the bench shapes (branch wip-fp8-fwd; the lead removes this before merging).

For the flashtile tree on PYTHONPATH: at each shape of ``python -m flashtile bench --suite fp8`` (d 128 and 256,
N 4k/8k/16k, causal and not, B = 16384 // N, H = 2048 // d) it quantizes bf16 inputs as the bench does
(``quant.quantize``), checks the FP8 kernel's output and lse on the first heads of batch row 0 against float32
attention of the *dequantized* inputs (so only the kernel's own rounding counts: tests/test_fwd_fp8_sm90.py's
bounds), then times it with ``triton.testing.do_bench``, each variant interleaved round by round, and the bf16 forward
once for the ratio. One line a shape. Variants (where the tree has ``FP8_PINGPONG``): ``pp1``/``pp0`` pingpong
on/off; with ``--d256-n128`` also ``n128`` at d256: 128-key blocks, 2 stages, pingpong on.

    python scratch/fp8_fwd_ab.py --d256-n128         # branch: pp1, pp0 (+ n128 at d256)
    python scratch/fp8_fwd_ab.py                     # main (no switch): the tree's kernel as it is
    python scratch/fp8_fwd_ab.py --dims 128 --seqlens 16384 --rounds 5
"""
import argparse
import statistics

import torch
import triton

import flashtile
from flashtile import fp8, validation
from flashtile.backends import torch_fp8
from flashtile.backends.triton import fp8 as fp8_launch
from flashtile.backends.triton import quant
from flashtile.bench import common
from flashtile.bench.fp8 import HEAD_DIMS, SEQLENS, TOKENS, WIDTH
from flashtile.testing import attention_ref

REF_HEADS = 2
# tests/test_fwd_fp8_sm90.py: output relative RMSE (P's e4m3 rounding) and lse error per 128 of head dim.
REL_RMSE = 0.035
LSE_ATOL_PER_128 = 1e-2


def reference(quantized, causal: bool):
    """float32 ``(out, lse)`` of the first REF_HEADS heads of batch row 0, on the dequantized inputs (q and k
    rotated alike, which leaves the scores as they are)."""
    q8, k8, v8_t, q_ds, k_ds, v_ds = quantized
    q = torch_fp8.dequantize(q8[:1, :, :REF_HEADS], q_ds[:1, :REF_HEADS])
    k = torch_fp8.dequantize(k8[:1, :, :REF_HEADS], k_ds[:1, :REF_HEADS])
    v = torch_fp8.dequantize(v8_t[:1, :REF_HEADS].permute(0, 3, 1, 2), v_ds[:1, :REF_HEADS])
    return attention_ref(q, k, v, causal=causal)


def check(out, lse, ref_out, ref_lse, head_dim: int) -> str:
    """'' when the kernel's first heads are within the test bounds, else what is off."""
    o = out[:1, :, :REF_HEADS].float()
    rel = ((o - ref_out).pow(2).mean().sqrt() / ref_out.pow(2).mean().sqrt()).item()
    lse_err = (lse[:1, :REF_HEADS].float() - ref_lse).abs().max().item()
    bad = []
    if not torch.isfinite(o).all() or rel > REL_RMSE:
        bad.append(f"out rel rmse {rel:.3g}")
    if not lse_err <= LSE_ATOL_PER_128 * head_dim / 128:
        bad.append(f"lse max err {lse_err:.3g}")
    return ", ".join(bad), rel, lse_err


DEFAULTS = {}


def apply(variant: dict, head_dim: int) -> None:
    """Set the launcher's pingpong and tile of ``head_dim`` to ``variant``'s (the tree's own where it names none)."""
    if not hasattr(fp8_launch, "FP8_PINGPONG"):
        return
    defaults = DEFAULTS.setdefault(head_dim, (fp8_launch.FP8_PINGPONG[head_dim], fp8_launch.FP8_TILES[head_dim]))
    fp8_launch.FP8_PINGPONG[head_dim] = variant.get("pingpong", defaults[0])
    fp8_launch.FP8_TILES[head_dim] = variant.get("tile", defaults[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds a variant")
    parser.add_argument("--pingpong", type=int, nargs="+", default=[1, 0], help="FP8_PINGPONG settings to compare")
    parser.add_argument("--d256-n128", action="store_true", help="also d256 with (128, 2, False) tiles, pingpong")
    args = parser.parse_args()
    has_switch = hasattr(fp8_launch, "FP8_PINGPONG")
    print(f"flashtile {flashtile.__file__} on {torch.cuda.get_device_name()}; pingpong switch: {has_switch}")
    for head_dim in args.dims:
        variants = {"fp8": {}}
        if has_switch:
            variants = {f"pp{v}": {"pingpong": bool(v)} for v in args.pingpong}
            if head_dim == 256 and args.d256_n128:
                variants["n128"] = {"pingpong": True, "tile": (128, 2, False)}
        for seqlen in args.seqlens:
            for causal in (False, True):
                batch, nheads = TOKENS // seqlen, WIDTH // head_dim
                q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                attn = validation.attn_args(q, k, v, causal=causal)
                quantized = quant.quantize(q, k, v)
                ref_out, ref_lse = reference(quantized, causal)
                flops = common.fwd_flops(batch, nheads, seqlen, head_dim, causal)
                cells = []
                runs = {}
                for name, variant in variants.items():
                    apply(variant, head_dim)
                    out, lse = fp8.attention(*quantized, attn, v_transposed=True)
                    torch.cuda.synchronize()
                    bad, rel, lse_err = check(out, lse, ref_out, ref_lse, head_dim)
                    cells.append(f"{name} rel {rel:.4f} lse {lse_err:.2e}{' WRONG: ' + bad if bad else ''}")
                    if not bad:
                        runs[name] = variant
                fn = lambda: fp8.attention(*quantized, attn, v_transposed=True)  # noqa: E731
                times = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, variant in runs.items():
                        apply(variant, head_dim)
                        times[name].append(triton.testing.do_bench(fn, warmup=10, rep=50))
                apply({}, head_dim)
                bf16_ms = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
                                                  warmup=10, rep=50)
                line = [f"d{head_dim} N{seqlen} B{batch} H{nheads} {'causal' if causal else 'full  '}",
                        f"bf16 {common.tflops(flops, bf16_ms):6.1f}"]
                for name, ts in times.items():
                    ms = statistics.median(ts)
                    line.append(f"{name} {common.tflops(flops, ms):6.1f} TF/s ({bf16_ms / ms:.2f}x bf16)")
                print(" | ".join(line + cells), flush=True)
                del q, k, v, quantized


if __name__ == "__main__":
    main()
