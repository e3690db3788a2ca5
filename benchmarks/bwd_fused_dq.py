"""Tried and not kept: a 5-matmul backward in Triton. One program per key block computes dK and dV as
bwd_dkdv does and also dQ's share, dS K, which it adds to a float32 dQ through the TMA's reduce-add
(``tensor_descriptor.atomic_add``: no per-element atomics, no pointer registers); a copy casts it.
Against ``launch.backward`` (dK/dV and dQ kernels, 7 matmuls) in one run, bf16, with the preprocess,
the zeroing of dQ and the cast included:

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/bwd_fused_dq.py [BM,BN,warps,stages[,mode] ...]
    HD=64 ...                                    # head dim 64 shapes

``softcap [cfgs]`` as the first argument times softcap against plain, pair and fused each, on the variants bar's
shapes (``results/h200-bwd-fused-dq-softcap-2026-11-23.json``).

``mode``: 2 dQ by reduce-add (default), 3 the same on dQ^T (K^T dS, a (batch, heads, dim, seq) buffer),
4 a plain TMA store instead of the add (wrong dQ: what the add itself costs), 0 no dQ at all (dK/dV
alone). Results: BENCHMARKS.md, results/h200-bwd-fused-dq-2026-11-22.json. On a CPU the interpreter
checks the logic (pointer atomics: it has no descriptor reduce).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.backends import AttnArgs
from flashtile.backends.triton import launch
from flashtile.backends.triton.kernels.bwd import bwd_preprocess
from flashtile.backends.triton.kernels.common import LOG2E, q_block_range, run_bounds, score_scale, scores, tile_ptrs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from d256_fwd_tiles import time_it  # noqa: E402


@triton.jit
def _inner(dk, dv, k, v, q_ptrs, do_ptrs, lse2_ptr, delta_ptr, dq_desc, dq_ptrs, stride_dqm, off_b, off_h, stride_qm,
           stride_dom,
           start_n, offs_n, lo, hi, seqlen_q, seqlen_k, qk_scale, softcap2, softmax_scale, window_left, window_right,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
           MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, TMA: tl.constexpr,
           MODE: tl.constexpr, SOFTCAP: tl.constexpr):
    offs_m = lo + tl.arange(0, BLOCK_M)
    q_ptrs += lo * stride_qm
    do_ptrs += lo * stride_dom
    for start_m in range(lo, hi, BLOCK_M):
        q = tl.load(q_ptrs)
        lse2 = tl.load(lse2_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
        qk_t = tl.dot(k, tl.trans(q))
        s_t, t_t = scores(qk_t, offs_m[None, :], offs_n[:, None], start_n, seqlen_q, seqlen_k, qk_scale, softcap2,
                          0.0, 0, 0, 0, window_left, window_right,
                          MASK, MASK_LEFT, MASK_RIGHT, SOFTCAP, TMA, False, "")  # TMA: on a GPU, so fast tanh
        p_t = tl.math.exp2(s_t - lse2[None, :])
        do = tl.load(do_ptrs)
        dp_t = tl.dot(v, tl.trans(do))
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = p_t * (dp_t - delta[None, :]) * softmax_scale
        if SOFTCAP:
            # d(c * tanh(x / c)) / dx = 1 - tanh^2.
            ds_t = ds_t * (1.0 - t_t * t_t)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if MODE == 2 or MODE == 4:
            dq = tl.dot(tl.trans(ds_t), k)
            if not TMA:
                tl.atomic_add(dq_ptrs + start_m * stride_dqm, dq)
            elif MODE == 2:
                dq_desc.atomic_add([off_b.to(tl.int32), start_m, off_h, 0], dq.reshape([1, BLOCK_M, 1, HEAD_DIM]))
            else:
                dq_desc.store([off_b.to(tl.int32), start_m, off_h, 0], dq.reshape([1, BLOCK_M, 1, HEAD_DIM]))
        if MODE == 3:
            dqt = tl.dot(tl.trans(k), ds_t)
            dq_desc.atomic_add([off_b.to(tl.int32), off_h, 0, start_m], dqt.reshape([1, 1, HEAD_DIM, BLOCK_M]))
        offs_m += BLOCK_M
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def bwd_fused(Q, K, V, DO, DK, DV, LSE2, DELTA, dq_desc, DQ_ACC, softmax_scale, softcap, window_left, window_right,
              stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
              stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, group,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, TMA: tl.constexpr, MODE: tl.constexpr,
              SOFTCAP: tl.constexpr):
    """Q, DO share strides; K, V, DK, DV share strides (contiguous experiment inputs)."""
    start_n = tl.program_id(0)
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_off = off_b * stride_kb + off_hk * stride_kh
    k = tl.load(tile_ptrs(K + kv_off, offs_n, stride_kn, offs_d))
    v = tl.load(tile_ptrs(V + kv_off, offs_n, stride_kn, offs_d))
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = score_scale(softmax_scale, softcap, SOFTCAP)
    softcap2 = softcap * LOG2E
    lo, full_lo, full_hi, hi = q_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, True)
    for g in range(group):
        off_h = off_hk * group + g
        q_ptrs = tile_ptrs(Q + off_b * stride_qb + off_h * stride_qh, offs_m, stride_qm, offs_d)
        do_ptrs = tile_ptrs(DO + off_b * stride_qb + off_h * stride_qh, offs_m, stride_qm, offs_d)
        dq_ptrs = tile_ptrs(DQ_ACC + off_b * stride_qb + off_h * stride_qh, offs_m, stride_qm, offs_d)
        row = off_b * stride_lse_b + off_h * stride_lse_h
        for run in tl.static_range(3):
            run_lo, run_hi = run_bounds(run, lo, full_lo, full_hi, hi)
            if (run != 0 or MASK_RIGHT) and (run != 2 or MASK_LEFT):
                dk, dv = _inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE2 + row, DELTA + row, dq_desc, dq_ptrs, stride_qm,
                                off_b, off_h,
                                stride_qm, stride_qm, start_n * BLOCK_N, offs_n, run_lo, run_hi, seqlen_q, seqlen_k,
                                qk_scale, softcap2, softmax_scale, window_left, window_right, BLOCK_M, BLOCK_N,
                                HEAD_DIM, run != 1, MASK_LEFT, MASK_RIGHT, TMA, MODE, SOFTCAP)
    tl.store(tile_ptrs(DK + kv_off, offs_n, stride_kn, offs_d), dk.to(DK.dtype.element_ty))
    tl.store(tile_ptrs(DV + kv_off, offs_n, stride_kn, offs_d), dv.to(DV.dtype.element_ty))

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))


def make(B, S, H, Hk, window, dtype, D=128, seed=0, softcap=0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, S, H, D, device=DEV, dtype=dtype, generator=g)
    k, v = (torch.randn(B, S, Hk, D, device=DEV, dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn(B, S, H, D, device=DEV, dtype=dtype, generator=g)
    left, right = window
    args = AttnArgs(softmax_scale=D ** -0.5, causal=right == 0 and left < 0, window_left=left, window_right=right,
                    softcap=softcap)
    out, lse = launch.forward(q, k, v, args)
    return q, k, v, do, out, lse, args


def base(t):
    q, k, v, do, out, lse, args = t
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    launch.backward(do, q, k, v, out, lse, args, dq, dk, dv)
    return dq, dk, dv


def fused(t, cfg, info=None):
    q, k, v, do, out, lse, args = t
    B, S, H, D = q.shape
    Hk = k.shape[2]
    BM, BN, w, s = cfg[:4]
    mode = cfg[4] if len(cfg) > 4 else 2
    if mode == 3:
        dq_acc = torch.zeros(B, H, D, S, device=q.device, dtype=torch.float32)
        desc = TensorDescriptor.from_tensor(dq_acc, [1, 1, D, BM])
    else:
        dq_acc = torch.zeros(B, S, H, D, device=q.device, dtype=torch.float32)
        desc = TensorDescriptor.from_tensor(dq_acc, [1, BM, 1, D])
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    bwd_preprocess[(triton.cdiv(S, 64), H, B)](out, do, lse, delta, lse2, out, out.stride(0), out.stride(1),
                                               out.stride(2), do.stride(0), do.stride(1), do.stride(2), 0, 0, 0,
                                               lse.stride(0), lse.stride(1), S, HEAD_DIM_ACTUAL=D, HEAD_DIM=D,
                                               BLOCK_M=64, ZERO_DQ=False)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    left, right = args.window_left, args.window_right
    kern = bwd_fused[(S // BN, Hk, B)](q, k, v, do, dk, dv, lse2, delta, desc, dq_acc, args.softmax_scale,
                                       args.softcap, left, right,
                                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                       lse.stride(0), lse.stride(1), S, S, H // Hk,
                                       HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, MASK_LEFT=left >= 0, MASK_RIGHT=right >= 0,
                                       TMA=DEV == 'cuda', MODE=mode, SOFTCAP=args.softcap > 0,
                                       num_warps=w, num_stages=s)
    if info is not None:
        info.update(regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None))
    if mode == 3:
        dq_acc = dq_acc.permute(0, 3, 1, 2)
    return dq_acc.to(q.dtype), dk, dv


def tflops(B, S, H, window, ms):
    left, right = window
    if right == 0 and left < 0:
        pairs = S * (S + 1) / 2
    elif left >= 0:
        pairs = sum(min(i, left) + 1 for i in range(S))
    else:
        pairs = S * S
    return 2.5 * 4 * B * H * int(os.environ.get('HD', '128')) * pairs / ms / 1e9


CFGS = [(32, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2),
        (64, 128, 8, 2), (16, 64, 4, 3), (32, 128, 4, 2)]


def softcap_run(cfgs, rounds=3):
    """Softcap against plain, the current pair and the fused kernel each, on the variants bar's shapes."""
    res = dict(torch=torch.__version__, triton=triton.__version__, check=[], time=[])
    for shape, win in [((2, 1024, 4, 2), (-1, -1)), ((2, 1024, 4, 2), (-1, 0)), ((1, 2048, 4, 4), (256, 0))]:
        t = make(*shape, win, torch.bfloat16, seed=1, softcap=30.0)
        ref = base(t)
        for cfg in cfgs:
            info = {}
            got = fused(t, cfg, info)
            err = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, ref)]
            res["check"].append(dict(shape=shape, win=win, cfg=cfg, rel_err_vs_base=err, **info))
            print("check", shape, win, cfg, err, info, flush=True)
    for shape in [(4, 4096, 16, 16), (2, 8192, 16, 16)]:
        for win in [(-1, -1), (-1, 0)]:
            plain, capped = (make(*shape, win, torch.bfloat16, softcap=c) for c in (0.0, 50.0))
            fns = {"pair plain": lambda: base(plain), "pair softcap": lambda: base(capped)}
            for cfg in cfgs:
                fns[f"fused{cfg} plain"] = (lambda c: lambda: fused(plain, c))(cfg)
                fns[f"fused{cfg} softcap"] = (lambda c: lambda: fused(capped, c))(cfg)
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    times[name].append(time_it(fn, n=5, calls=10))
            row = dict(shape=shape, win=win, **{name: sorted(ts)[rounds // 2] for name, ts in times.items()})
            res["time"].append(row)
            ref = row["pair plain"]
            print(shape, win, "  ".join(f"{name}={v:.3f}ms({v / ref:.3f})" for name, v in row.items()
                                        if name not in ("shape", "win")), flush=True)
    res["commit"] = os.environ.get("FLASHTILE_GIT_COMMIT", "")
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "fused_softcap.json"), "w"), indent=1)


if __name__ == "__main__":
    res = dict(torch=torch.__version__, triton=triton.__version__, check=[], time=[])
    if DEV == "cpu":
        for win in [(-1, -1), (-1, 0), (40, 0)]:
            for cap in (0.0, 5.0):
                t = make(1, 128, 2, 1, win, torch.float32, softcap=cap)
                ref = base(t)
                got = fused(t, (16, 32, 4, 1))
                print(win, cap, [float((a - b).abs().max()) for a, b in zip(got, ref)])
        sys.exit()
    if sys.argv[1:2] == ["softcap"]:
        softcap_run([tuple(map(int, c.split(","))) for c in sys.argv[2:]] or [(64, 128, 8, 3), (64, 128, 8, 2)])
        sys.exit()
    D = int(os.environ.get("HD", "128"))
    cfgs = [tuple(map(int, c.split(","))) for c in sys.argv[1:]] or CFGS
    for shape, win in [((2, 1024, 4, 2), (-1, -1)), ((2, 1024, 4, 2), (-1, 0)), ((1, 2048, 4, 4), (256, 0))]:
        t = make(*shape, win, torch.bfloat16, D=D, seed=1)
        ref = base(t)
        for cfg in cfgs:
            info = {}
            try:
                got = fused(t, cfg, info)
                err = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, ref)]
            except Exception as e:  # noqa
                err = repr(e)[:300]
            res["check"].append(dict(shape=shape, win=win, cfg=cfg, rel_err_vs_base=err, **info))
            print("check", shape, win, cfg, err, info, flush=True)
    shapes = [((4, 4096, 16, 16), (-1, -1)), ((4, 4096, 16, 16), (-1, 0)), ((1, 16384, 16, 16), (-1, 0)),
              ((1, 16384, 16, 16), (1024, 0)), ((4, 4096, 32, 8), (-1, 0))]
    if D == 64:
        shapes = [((4, 4096, 32, 32), (-1, -1)), ((4, 4096, 32, 32), (-1, 0)), ((1, 16384, 32, 32), (-1, 0)),
                  ((16, 1024, 32, 32), (-1, 0)), ((16, 1024, 32, 32), (-1, -1))]
    for shape, win in shapes:
        t = make(*shape, win, torch.bfloat16, D=D)
        row = dict(shape=shape, win=win)
        row["base"] = time_it(lambda: base(t), n=5, calls=10)
        for cfg in cfgs:
            try:
                row[str(cfg)] = time_it(lambda: fused(t, cfg), n=5, calls=10)
            except Exception as e:  # noqa
                row[str(cfg)] = repr(e)[:200]
        row["base2"] = time_it(lambda: base(t), n=5, calls=10)
        res["time"].append(row)
        B, S, H, _ = shape
        print(shape, win, " ".join(f"{k}={v:.3f}ms/{tflops(B, S, H, win, v):.0f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items() if k not in ("shape", "win")), flush=True)
    res["commit"] = os.environ.get("FLASHTILE_GIT_COMMIT", "")
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "fused.json"), "w"), indent=1)
