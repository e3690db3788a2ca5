"""The kernel launches scripts/gpu_sanitize.sh runs under compute-sanitizer: each kernel family once, on inputs
of awkward sizes, each tensor its own allocation (run with PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that a read or
write past a tensor leaves its allocation, which memcheck sees. Then calls with bad index values (the host
checks off, as by default on CUDA): they must stay inside their tensors and be recorded.

    python scripts/sanitize_launches.py [all | ws]     # ws: only the warp-specialized kernels (for racecheck)

Prints the kernels the calls were planned on and exits 1 when a family did not run or a bad value went unrecorded.
"""
import os
import sys

import torch

import flashtile
from flashtile.backends.triton import configs

DEVICE = "cuda"
BF16 = torch.bfloat16


def randn(*shape, dtype=BF16, grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def fwd_bwd(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, headdim_v=None, **options):
    q = randn(batch, seqlen_q, nheads, headdim, grad=True)
    k = randn(batch, seqlen_k, nheads_kv, headdim, grad=True)
    v = randn(batch, seqlen_k, nheads_kv, headdim_v or headdim, grad=True)
    flashtile.flash_attn_func(q, k, v, **options).sum().backward()


def varlen_fwd_bwd(lengths, nheads, headdim, spare=3, headdim_v=None, **options):
    # Rows past cu_seqlens[-1]: the tail kernel fills them.
    total = sum(lengths)
    cu = int32([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k = (randn(total + spare, nheads, headdim, grad=True) for _ in range(2))
    v = randn(total + spare, nheads, headdim_v or headdim, grad=True)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), **options)
    out.sum().backward()


def kvcache(batch, capacity, seqlen_q, seqlen_new, nheads, nheads_kv, headdim, paged=False, **options):
    q = randn(batch, seqlen_q, nheads, headdim)
    k, v = (randn(batch, seqlen_new, nheads_kv, headdim) for _ in range(2))
    if paged:
        page_size = 16
        per_row = -(-capacity // page_size)
        k_cache, v_cache = (randn(batch * per_row + 1, page_size, nheads_kv, headdim) for _ in range(2))
        options["block_table"] = torch.randperm(batch * per_row, device=DEVICE).view(batch, per_row).to(torch.int32)
    else:
        k_cache, v_cache = (randn(batch, capacity, nheads_kv, headdim) for _ in range(2))
    # Every row ends at the capacity but the last ones; rotary over half the head dim.
    lengths = int32([capacity - max(seqlen_q, seqlen_new) - b for b in range(batch)])
    cos, sin = (randn(capacity, headdim // 4, dtype=torch.float32) for _ in range(2))
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos, rotary_sin=sin,
                                      causal=True, **options)


def families():
    # Forward and backward: the Triton kernels (d64, d40), the Gluon forward and the two-kernel Gluon dK/dV
    # backward (d128, deterministic keeps it off the one-pass kernel).
    fwd_bwd(2, 177, 211, 4, 2, 64, causal=True)
    fwd_bwd(1, 65, 129, 3, 1, 40, softcap=20.0, window_size=(33, 5))
    fwd_bwd(2, 2100, 2100, 8, 8, 128, causal=True, deterministic=True)  # past GLUON_MIN_PAIRS: the Gluon forward
    varlen_fwd_bwd([300, 1, 0, 129, 777], 4, 128, deterministic=True)
    varlen_fwd_bwd([65, 3, 190], 2, 64, causal=True)
    # q/k head dim 192: the backward pair reads and writes it as 128 columns and a 64-column tail.
    fwd_bwd(1, 201, 333, 4, 2, 192, 128, causal=True)
    varlen_fwd_bwd([70, 1, 190], 2, 192)
    # Decode with split-KV and the combine; append with rotary; paged and contiguous.
    kvcache(3, 1000, 1, 1, 8, 2, 128, num_splits=4)
    kvcache(2, 333, 1, 2, 4, 4, 64, paged=True, num_splits=3)
    kvcache(2, 4096, 300, 300, 8, 8, 128)


def fp8():
    """The fused FP8 quantize and the Gluon FP8 forward, dense (d128 causal, d256 full) and packed (sequences
    starting off 16-key boundaries: packed V^T's gaps, rows past the last sequence), and decode steps on an e4m3
    cache (two KV heads a program, split-KV) with appends."""
    q, k, v = (randn(2, 1100, 4, 128) for _ in range(3))
    flashtile.flash_attn_fp8_func(q, k, v, causal=True)
    # d256 without a mask: two 128-key slots (fp8.FP8_PLAIN_TILES), the last key block partial.
    q, k, v = (randn(2, 1100, 2, 256) for _ in range(3))
    flashtile.flash_attn_fp8_func(q, k, v)
    lengths = [300, 7, 1000, 77]
    cu = int32([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v = (randn(sum(lengths) + 5, 4, 128) for _ in range(3))
    flashtile.flash_attn_varlen_fp8_func(q, k, v, cu, cu, max(lengths), max(lengths))
    for batch, capacity in ((3, 5000), (1, 40000)):
        k_cache, v_cache = (randn(batch, capacity, 8, 128).to(torch.float8_e4m3fn) for _ in range(2))
        k, v = (randn(batch, 1, 8, 128) for _ in range(2))
        descale = torch.full((batch, 8), 0.02, device=DEVICE)
        flashtile.flash_attn_with_kvcache(randn(batch, 1, 32, 128), k_cache, v_cache, k, v,
                                          cache_seqlens=int32([capacity - 1 - b for b in range(batch)]), causal=True,
                                          k_descale=descale, v_descale=descale)


WS_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))


def warp_specialized(small: bool):
    """The one-pass backward (d128 MHA bf16 with CTAs enough to fill the GPU; the wide kernel at 192/128 dense
    and packed, 192/192 packed and 256 dense, GQA) and the warp-specialized forward.
    ``small`` (racecheck, which runs a kernel hundreds of times slower): a few CTAs, the Hopper kernels taken
    by telling the plans the GPU has one SM and any amount of work is enough."""
    batch, nheads, keys = (1, 2, 384) if small else (2, 8, 2048)
    if small:
        configs.sm_count = lambda device: 1
        configs.GLUON_MIN_PAIRS = 0
    assert -(-keys // configs.ONE_PASS_KEYS) * nheads * batch >= configs.sm_count(torch.device(DEVICE))
    fwd_bwd(batch, keys, keys, nheads, nheads, 128, causal=True)
    varlen_fwd_bwd([200, 7, 300] if small else [1100, 7, 2100, 900], nheads, 128)
    fwd_bwd(batch, keys, keys - 37, nheads, nheads, 192, 128, causal=True)
    varlen_fwd_bwd([200, 7, 300] if small else [1100, 7, 2100, 900], nheads, 192, causal=True)
    varlen_fwd_bwd([200, 7, 300] if small else [1100, 7, 2100, 900], nheads, 192, headdim_v=128, causal=True)
    fwd_bwd(batch, keys - 37, keys, nheads, nheads // 2, 256, causal=True)
    # The warp-specialized forward at head dims 64 (three consumers), 128, 256 and 192/128: keys from
    # GLUON_WS_FULL_KEYS on, rows x keys x (d + dv) from GLUON_MIN_PAIRS x 256 on (d=64: twice the rows).
    for head_dim, head_dim_v in WS_HEAD_DIMS:
        q = randn(1, 256 if small else (4608 if head_dim == 64 else 2304), 2 if small else 4, head_dim)
        k = randn(1, configs.GLUON_WS_FULL_KEYS + 77, 2 if small else 4, head_dim)
        v = randn(1, configs.GLUON_WS_FULL_KEYS + 77, 2 if small else 4, head_dim_v)
        flashtile.flash_attn_func(q, k, v)


def bad_values():
    """Calls with bad index values, each with the argument its record must name."""
    q, k, v = (randn(2, 1, 4, 64) for _ in range(3))
    k_cache, v_cache = (randn(2, 64, 4, 64) for _ in range(2))
    pages = randn(4, 16, 4, 64)
    packed = randn(24, 4, 64)
    bad, used = int32([0, 4, 30]), int32([0, 4, 24])
    yield "cache_batch_idx", lambda: flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=int32([0, 0]), cache_batch_idx=int32([0, 2]))
    yield "cache_seqlens", lambda: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                                     cache_seqlens=int32([63, 64]))
    yield "block_table", lambda: flashtile.flash_attn_with_kvcache(
        q, pages, pages.clone(), k, v, cache_seqlens=int32([3, 20]), block_table=int32([[0, 1], [2, 9]]))
    yield "cu_seqlens", lambda: flashtile.flash_attn_varlen_func(packed, packed, packed, bad, bad, 26, 26)
    yield "seqused_k", lambda: flashtile.flash_attn_varlen_func(packed, packed, packed, used, used, 20, 20,
                                                                seqused_k=int32([10, 20]))


def main(mode: str) -> int:
    # The bad values must reach the kernels: no host checks (the test suite's setting may be in the environment).
    for name in ("FLASHTILE_VALIDATE_VALUES", "FLASHTILE_VALIDATE_VARLEN"):
        os.environ.pop(name, None)
    torch.manual_seed(0)
    flashtile.reset_stats()
    if mode == "ws":
        warp_specialized(small=True)
    else:
        families()
        fp8()
        warp_specialized(small=False)
    torch.cuda.synchronize()
    kernels = flashtile.stats()["kernels"]
    for name, count in sorted(kernels.items()):
        print(f"  {count} x {name}")
    wanted = (["one-pass", "gluon-sm90-wide"] if mode == "ws"
              else ["triton", "gluon", "one-pass", "gluon-sm90-wide", "decode", " fp8 ", "fp8_cache"])
    # Every warp-specialized forward, by head dim (a call under the kernel's floors would run another one).
    wanted += [f"gluon-sm90-ws d={d} " for d, _ in WS_HEAD_DIMS]
    missing = [w for w in wanted if not any(w in name for name in kernels)]
    status = 0
    if missing:
        print(f"sanitize_launches: no planned kernel matched {missing}")
        status = 1
    if mode != "ws":
        flashtile.check_device_errors()
        for name, call in bad_values():
            call()
            try:
                flashtile.check_device_errors()
                print(f"sanitize_launches: a bad {name} went unrecorded")
                status = 1
            except ValueError as error:
                if name not in str(error):
                    print(f"sanitize_launches: expected {name} in the record, got: {error}")
                    status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "all"))
