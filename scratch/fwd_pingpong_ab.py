"""A/B of the bf16 warp-specialized forward with and without pingpong (branch wip-fwd-pingpong; the lead removes
this before merging).

For the flashtile tree on PYTHONPATH, at the headline dense shapes (B = 16384 // N, H = 2048 // d, d 64/128/256,
N 1k/4k/16k, causal and not) through ``launch.forward(config=...)`` (the tile override the tuning scripts use):

  table  the tile the dispatcher picks (its kernel named in the line)
  ws     the warp-specialized forward, configs._FWD_SM90_GLUON_WS (forced where the table picks another kernel;
         d 64 and 128 only: d256 does not fit its shared memory)
  ws-pp  the same with its consumers taking turns, configs._FWD_SM90_GLUON_WS_PINGPONG (trees that have it)

Each variant's out and lse on the first REF_HEADS heads of batch row 0 are held to the tolerance rule against
float32 attention (flashtile.testing.assert_close_to_ref), ws and ws-pp are compared bit for bit, and the correct
variants are timed with ``triton.testing.do_bench``, interleaved round by round. One line a shape: TF/s of each,
and ws-pp / ws.

    python scratch/fwd_pingpong_ab.py
    python scratch/fwd_pingpong_ab.py --dims 128 --seqlens 16384 --rounds 5
"""
import argparse
import itertools
import statistics
import time

import torch
import triton

import flashtile
from flashtile import validation
from flashtile.backends.triton import configs, launch
from flashtile.bench import common
from flashtile.bench.suite import TOKENS, WIDTH
from flashtile.testing import ATOL, assert_close_to_ref, attention_ref, make_qkv

REF_HEADS = 2
WS_HEAD_DIMS = (64, 128)


def variants(head_dim: int) -> dict:
    """name -> tile override (None: the dispatcher's own) for ``head_dim``."""
    found = {"table": None}
    if head_dim in WS_HEAD_DIMS:
        found["ws"] = configs._FWD_SM90_GLUON_WS
        if hasattr(configs, "_FWD_SM90_GLUON_WS_PINGPONG"):
            found["ws-pp"] = configs._FWD_SM90_GLUON_WS_PINGPONG
    return found


def table_kernel(q, causal: bool) -> str:
    """The dispatcher's forward for this call, as its tile config says."""
    batch, seqlen, nheads, head_dim = q.shape
    cfg = configs.gluon_fwd_config(head_dim, head_dim, q.dtype, q.device, batch * nheads * seqlen, seqlen, -1,
                                   0 if causal else -1, frozenset())
    cfg = cfg or configs.fwd_config(head_dim, q.dtype, q.device, seqlen, -1, 0 if causal else -1)
    return f"{cfg.kernel} {cfg.BLOCK_M}x{cfg.BLOCK_N}"


def wrong(out, lse, ref_hi, ref_lo) -> str:
    """'' when the first heads of batch row 0 pass the tolerance rule, else why not."""
    try:
        assert_close_to_ref("out", out[:1, :, :REF_HEADS], ref_hi[0], ref_lo[0], ATOL[torch.bfloat16][0])
        assert_close_to_ref("lse", lse[:1, :REF_HEADS], ref_hi[1], ref_lo[1], ATOL[torch.bfloat16][0])
    except AssertionError as error:
        return str(error).splitlines()[0]
    return ""


def one_shape(head_dim: int, seqlen: int, causal: bool, rounds: int) -> str:
    """The line of one headline shape: each variant checked, the correct ones timed round by round."""
    batch, nheads = TOKENS // seqlen, WIDTH // head_dim
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, torch.bfloat16, "cuda", requires_grad=False)
    attn = validation.attn_args(q, k, v, causal=causal)
    heads = [t[:1, :, :REF_HEADS] for t in (q, k, v)]
    ref_hi = attention_ref(*heads, causal=causal, upcast=True)
    ref_lo = attention_ref(*heads, causal=causal, upcast=False)
    notes, runs, results = [], {}, {}
    for name, cfg in variants(head_dim).items():
        try:
            out, lse = launch.forward(q, k, v, attn, config=cfg)
            torch.cuda.synchronize()
        except Exception as error:  # a variant that cannot run is reported, the others go on
            notes.append(f"{name} FAILED: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        bad = wrong(out, lse, ref_hi, ref_lo)
        if bad:
            notes.append(f"{name} WRONG: {bad}")
            continue
        results[name] = (out, lse)
        runs[name] = lambda cfg=cfg: launch.forward(q, k, v, attn, config=cfg)
    if "ws" in results and "ws-pp" in results:
        same = all(torch.equal(a, b) for a, b in zip(results["ws"], results["ws-pp"]))
        notes.append("same bits" if same else "BITS DIFFER")
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=50))
    flops = common.fwd_flops(batch, nheads, seqlen, head_dim, causal)
    tf = {name: common.tflops(flops, statistics.median(ts)) for name, ts in times.items()}
    line = [f"d{head_dim:<3} N{seqlen:<5} B{batch:<2} H{nheads:<2} {'causal' if causal else 'full  '}",
            f"table ({table_kernel(q, causal)})"]
    line += [f"{name} {value:6.1f}" for name, value in tf.items()]
    if "ws" in tf and "ws-pp" in tf:
        line.append(f"pp/ws {tf['ws-pp'] / tf['ws']:.3f}")
    return " | ".join(line + notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds a variant")
    args = parser.parse_args()
    start = time.time()
    print(f"flashtile {flashtile.__file__} on {torch.cuda.get_device_name()}; "
          f"pingpong tile: {hasattr(configs, '_FWD_SM90_GLUON_WS_PINGPONG')}", flush=True)
    for head_dim, seqlen, causal in itertools.product(args.dims, args.seqlens, (False, True)):
        print(one_shape(head_dim, seqlen, causal, args.rounds), flush=True)
        torch.cuda.empty_cache()
    print(f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
