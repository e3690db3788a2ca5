"""The warp-specialized Hopper forward at head dims 64, 256 and 192/128 (configs.GLUON_WS_D64 / GLUON_WS_D256 /
GLUON_WS_D192) against the kernel each head dim ran before it, in one run: evidence for those config rows; with
``--fp8`` the FP8 forward. Run on two package trees (benchmarks/ab_trees.sh) it compares two versions of a kernel.

Through ``launch.forward(config=...)``, bf16, the headline's shapes (B = 16384 // N, H = 2048 // d; N 1k/4k/16k,
full and causal; at 192/128 DeepSeek's: values of 128, H = 16, B = 8192 // N, so 2 x 4096 and 1 x 16384); variants
by head dim:

  d=64   triton  configs.fwd_config's Triton tile
         ws      configs._FWD_SM90_GLUON_WS_D64: 2 x 64-row consumers, two slots of 128 keys (98.7 KB)
         ws-s4   the same with four slots (164.3 KB)
         ws-c3   configs._FWD_SM90_GLUON_WS_D64_C3: 3 x 64-row consumers (192-row CTAs), two 128-key slots (115.1 KB)
         ws-c3-n64  the same with 64-key slots (82.3 KB)
         ws-c3-pp   ws-c3 with the consumers taking turns at the tensor cores, 0, 1, 2, 0, ... (FA3's scheduler
                    barrier at three warpgroups)
  d=256  gluon   configs._FWD_SM90_GLUON_D256: one warpgroup, 64x64, one K and one V slot
         ws      configs._FWD_SM90_GLUON_WS_D256: two 64-key slots each of K and V, one Q buffer (197 KB)
         ws-n32  the same with 32-key slots and two Q buffers (197 KB)
  d=192  gluon   configs._FWD_SM90_GLUON: one warpgroup, 64x64, q and k as 128 + 64 columns, two slots each
         ws      configs._FWD_SM90_GLUON_WS_D192: two 128-key slots each of K and V, one Q buffer (213 KB)
         ws-n64  the same with 64-key slots and two Q buffers (181 KB)
         ws-n64-s3  64-key slots, three of them (222 KB)
  d=128  ws      configs._FWD_SM90_GLUON_WS
  --fp8  fp8     the FP8 forward on inputs quantized beforehand (fp8.forward_fp8_sm90, the launcher under the FP8
                 bench's fp8_kernel, out and lse allocated each call), its outputs checked by RMSE (bench.fp8's limit)
         fp8-c3  fp8.FP8_CANDIDATES["c3"]: three consumer warpgroups (192-row tiles); d64 one-level 128-key slots, d128
                 64-key slots with turns
         fp8-n128  fp8.FP8_CANDIDATES["n128"]: d256 with two 128-key slots and turns (FlashAttention-3's FP8 tile)

Each variant's out and lse on the first two heads of batch row 0 are held to the tolerance rule against float32
attention before any timing (a wrong or failing variant is reported, not timed); then ``triton.testing.do_bench``
(L2 flushed) times the correct ones, interleaved, ``--rounds`` rounds. One line a shape: TF/s of each and each
against the first variant.

    python benchmarks/gluon_ws_heads.py [--dims 64 256 192] [--seqlens 1024 4096 16384] [--rounds 2]
        -> $OUT (default /tmp)/h200-gluon-ws-heads-<date>.json
    python benchmarks/gluon_ws_heads.py --dims 192 --seqlens 4096 16384    # issue 46's 192/128 rows
    python benchmarks/gluon_ws_heads.py --dims 64 --seqlens 4096 16384 --rounds 2   # issue 46's d=64 rows: 2 or 3
                                                                                     # consumer warpgroups
    python benchmarks/gluon_ws_heads.py --fp8 --dims 64 128 256 --seqlens 4096 16384 --rounds 2  # issue 45: the FP8
                                                                                     # candidates against the default
    bash benchmarks/ab_trees.sh /tmp/base benchmarks/gluon_ws_heads.py 2 --fp8 --dims 64 128 256 --seqlens 4096 16384
"""
import argparse
import dataclasses
import itertools
import os
import statistics
import sys

import torch
import triton

from flashtile import validation
from flashtile.backends.triton import configs, fp8, launch, quant
from flashtile.bench import common
from flashtile.bench.fp8 import FP8_RMSE_LIMIT
from flashtile.testing import ATOL, assert_close_to_ref, attention_ref, make_qkv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import save_results  # noqa: E402

TOKENS, WIDTH, REF_HEADS = 16384, 2048, 2
# DeepSeek's MLA heads (q and k of 192, v of 128) as the bench suite runs them: 16 heads, 2 x 4096.
HEAD_DIM_V, D192_TOKENS, D192_HEADS = {192: 128}, 8192, 16


def shape(head_dim: int, seqlen: int) -> tuple:
    """``(batch, heads, head_dim_v)`` of the head dim's row at ``seqlen`` keys."""
    if head_dim == 192:
        return max(1, D192_TOKENS // seqlen), D192_HEADS, HEAD_DIM_V[192]
    return TOKENS // seqlen, WIDTH // head_dim, head_dim


def variants(head_dim: int, seqlen: int, causal: bool) -> dict:
    """name -> tile, the kernel the head dim ran before first."""
    if head_dim == 128:
        return {"ws": configs._FWD_SM90_GLUON_WS}
    if head_dim == 64:
        ws = configs._FWD_SM90_GLUON_WS_D64
        before = configs.fwd_config(64, torch.bfloat16, torch.device("cuda"), seqlen, -1, 0 if causal else -1)
        c3 = configs._FWD_SM90_GLUON_WS_D64_C3
        return {"triton": before, "ws": ws, "ws-s4": dataclasses.replace(ws, num_stages=4), "ws-c3": c3,
                "ws-c3-n64": dataclasses.replace(c3, BLOCK_N=64), "ws-c3-pp": dataclasses.replace(c3, pingpong=True)}
    if head_dim == 192:
        ws = configs._FWD_SM90_GLUON_WS_D192
        return {"gluon": configs._FWD_SM90_GLUON, "ws": ws, "ws-n64": dataclasses.replace(ws, BLOCK_N=64),
                "ws-n64-s3": dataclasses.replace(ws, BLOCK_N=64, num_stages=3)}
    ws = configs._FWD_SM90_GLUON_WS_D256
    return {"gluon": configs._FWD_SM90_GLUON_D256, "ws": ws, "ws-n32": dataclasses.replace(ws, BLOCK_N=32)}


def fp8_variants(head_dim: int) -> dict:
    """name -> fp8.Fp8Tile of an --fp8 run: the head dim's own first (None: the launcher's default, so a package tree
    without Fp8Tile runs it too), then fp8.FP8_CANDIDATES' rows at ``head_dim``."""
    candidates = getattr(fp8, "FP8_CANDIDATES", {})
    return {"fp8": None, **{f"fp8-{name}": tiles[head_dim] for name, tiles in candidates.items() if head_dim in tiles}}


def fp8_call(quantized: tuple, attn, tile) -> tuple:
    """``(out, lse)`` of the FP8 kernel on ``quantized`` (quant.quantize's six tensors) on ``tile`` (None: the head
    dim's own), out and lse allocated as the API does."""
    q8, k8, v_t, q_descale, k_descale, v_descale = quantized
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty(q8.shape[0], q8.shape[2], q8.shape[1], dtype=torch.float32, device=q8.device)
    fp8.forward_fp8_sm90(q8, k8, v_t, q_descale, k_descale, v_descale, out, lse, attn,
                         **({} if tile is None else dict(tile=tile)))
    return out, lse


def wrong(out, lse, ref_hi, ref_lo, fp8_out: bool = False) -> str:
    """'' when the first heads of batch row 0 pass the tolerance rule (``fp8_out``: the FP8 bench's RMSE limit on
    out), else why not."""
    if fp8_out:
        rmse = (out[:1, :, :REF_HEADS].float() - ref_hi[0]).pow(2).mean().sqrt().item()
        return f"out RMSE {rmse:.3g} > {FP8_RMSE_LIMIT}" if rmse > FP8_RMSE_LIMIT or rmse != rmse else ""
    try:
        assert_close_to_ref("out", out[:1, :, :REF_HEADS], ref_hi[0], ref_lo[0], ATOL[torch.bfloat16][0])
        assert_close_to_ref("lse", lse[:1, :REF_HEADS], ref_hi[1], ref_lo[1], ATOL[torch.bfloat16][0])
    except AssertionError as error:
        return str(error).splitlines()[0]
    return ""


def one_shape(head_dim: int, seqlen: int, causal: bool, rounds: int, use_fp8: bool = False) -> dict:
    batch, nheads, head_dim_v = shape(head_dim, seqlen)
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, torch.bfloat16, "cuda", requires_grad=False)
    v = v[..., :head_dim_v].contiguous()
    attn = validation.attn_args(q, k, v, causal=causal)
    heads = [t[:1, :, :REF_HEADS] for t in (q, k, v)]
    ref_hi = attention_ref(*heads, causal=causal, upcast=True)
    ref_lo = attention_ref(*heads, causal=causal, upcast=False)
    row = dict(d=head_dim, dv=head_dim_v, N=seqlen, B=batch, H=nheads, causal=causal, notes=[], tiles={}, ms={},
               tflops={})
    if use_fp8:
        quantized = quant.quantize(q, k, v)
        tiles = fp8_variants(head_dim)
        row["tiles"] = {name: (fp8.fp8_tile(head_dim, attn) if tile is None else tile)._asdict()
                        for name, tile in tiles.items()}
        calls = {name: lambda tile=tile: fp8_call(quantized, attn, tile) for name, tile in tiles.items()}
    else:
        tiles = variants(head_dim, seqlen, causal)
        row["tiles"] = {name: dataclasses.asdict(cfg) for name, cfg in tiles.items()}
        calls = {name: lambda cfg=cfg: launch.forward(q, k, v, attn, config=cfg) for name, cfg in tiles.items()}
    runs = {}
    for name, fn in calls.items():
        try:
            out, lse = fn()
            torch.cuda.synchronize()
        except Exception as error:  # a variant that cannot run is reported, the others go on
            row["notes"].append(f"{name} FAILED: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        bad = wrong(out, lse, ref_hi, ref_lo, use_fp8)
        if bad:
            row["notes"].append(f"{name} WRONG: {bad}")
            continue
        runs[name] = fn
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=50))
    flops = common.attn_flops(batch, nheads, seqlen, seqlen, head_dim, causal, head_dim_v)
    for name, ts in times.items():
        row["ms"][name] = ts
        row["tflops"][name] = common.tflops(flops, statistics.median(ts))
    return row


def line(row: dict) -> str:
    tf = row["tflops"]
    first = next(iter(row["tiles"]))
    mask = "causal" if row["causal"] else "full  "
    parts = [f"d{row['d']}/{row['dv']:<3} N{row['N']:<5} B{row['B']:<2} H{row['H']:<2} {mask}"]
    parts += [f"{name} {value:6.1f}" for name, value in tf.items()]
    parts += [f"{name}/{first} {tf[name] / tf[first]:.3f}" for name in tf if name != first and first in tf]
    return " | ".join(parts + row["notes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256], choices=[64, 128, 256, 192],
                        help="q/k head dims (192: values of 128)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 forward (head dims 64, 128, 256) instead")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds a variant")
    args = parser.parse_args()
    rows = []
    for head_dim, seqlen, causal in itertools.product(args.dims, args.seqlens, (False, True)):
        rows.append(one_shape(head_dim, seqlen, causal, args.rounds, args.fp8))
        print(line(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    name = "gluon-ws-heads" + ("-fp8" if args.fp8 else "")
    print(save_results(name, rows, " ".join(sys.argv), rounds=args.rounds))


if __name__ == "__main__":
    main()
