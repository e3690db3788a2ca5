"""Chunked prefill through ``flash_attn_with_kvcache``: the Gluon Hopper forward against the KV-cache kernel
(evidence for configs.GLUON_KV_MIN_QUERIES), with the dense API and SDPA's cuDNN backend on the same keys.

Each call appends ``new`` tokens to a contiguous bf16 cache after ``cached`` keys (32 query / 8 KV heads,
d=128, causal, bottom-right aligned) and attends. Rows: "dispatched" is the call as dispatched; "kv kernel" the
same call with the Gluon route turned off (GLUON_KV_MIN_QUERIES raised); "gluon" with it forced (no row or
pair threshold); "dense" is ``flash_attn_func`` on
the cache's keys copied out ((batch, cached + new) keys, no append); "cudnn" is SDPA's cuDNN backend on
those keys with the bottom-right causal mask as a boolean tensor and the KV heads repeated. Outputs are
checked against each other first; times are medians of 15 CUDA-event timings of one call, rounds interleaved.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/kv_prefill.py   # writes $OUT/kv-prefill.json
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.backends.triton import configs
from flashtile.testing import causal_lower_right_mask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from d256_fwd_tiles import time_it  # noqa: E402

SHAPES = [  # (batch, cached, new)
    (4, 8192, 16), (4, 8192, 32), (4, 8192, 64), (4, 8192, 128), (4, 8192, 256), (4, 8192, 512), (4, 8192, 2048),
    (1, 8192, 128), (1, 8192, 512), (16, 2048, 128), (1, 30000, 2048), (8, 2048, 1024), (2, 4096, 4096),
]
# Each row's variants: the call as dispatched, the Gluon route off, and the Gluon route forced (no thresholds).
VARIANTS = {"dispatched": {}, "kv kernel": {"GLUON_KV_MIN_QUERIES": 1 << 30},
            "gluon": {"GLUON_KV_MIN_QUERIES": 1, "GLUON_KV_MIN_PAIRS": 0}}
HEADS, HEADS_KV, D = 32, 8, 128


def case(batch, cached, new):
    gen = torch.Generator().manual_seed(batch * 100003 + cached + new)
    draw = lambda *shape: torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)  # noqa: E731
    capacity = cached + new + 256
    k_cache, v_cache = draw(batch, capacity, HEADS_KV, D), draw(batch, capacity, HEADS_KV, D)
    q, k_new, v_new = draw(batch, new, HEADS, D), draw(batch, new, HEADS_KV, D), draw(batch, new, HEADS_KV, D)
    seqlens = torch.full((batch,), cached, dtype=torch.int32, device="cuda")
    keys = cached + new

    def kv():
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)

    def variant(settings):
        def run():
            defaults = {name: getattr(configs, name) for name in settings}
            for name, value in settings.items():
                setattr(configs, name, value)
            try:
                return kv()
            finally:
                for name, value in defaults.items():
                    setattr(configs, name, value)
        return run

    calls = {name: variant(settings) for name, settings in VARIANTS.items()}
    # The dispatcher plans a kind of call once (and names its kernel then): the dispatched call goes first.
    flashtile.reset_stats()
    calls["dispatched"]()
    kernels = sorted(flashtile.stats()["kernels"])
    out_gluon, out_kv = calls["gluon"](), calls["kv kernel"]()
    k_dense, v_dense = k_cache[:, :keys].contiguous(), v_cache[:, :keys].contiguous()

    def dense():
        return flashtile.flash_attn_func(q, k_dense, v_dense, causal=True)

    qt = q.transpose(1, 2)
    kt, vt = (t.transpose(1, 2).repeat_interleave(HEADS // HEADS_KV, 1) for t in (k_dense, v_dense))
    mask = causal_lower_right_mask(new, keys, device="cuda")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

    errors = {name: float((out.float() - out_gluon.float()).abs().max())
              for name, out in (("kv kernel", out_kv), ("dense", dense()), ("cudnn", cudnn().transpose(1, 2)))}
    calls.update(dense=dense, cudnn=cudnn)
    times = {name: [] for name in calls}
    for _ in range(3):
        for name, fn in calls.items():
            times[name].append(time_it(fn, n=15, calls=1))
    flop = 4 * batch * HEADS * D * (new * cached + new * (new + 1) / 2)
    row = dict(batch=batch, cached=cached, new=new, kernels=kernels, max_diff_vs_gluon=errors)
    for name, ts in times.items():
        ms = sorted(ts)[1]
        row[name] = dict(ms=ms, rounds=ts, tflops=flop / ms / 1e9)
    return row


if __name__ == "__main__":
    rows = []
    for shape in SHAPES:
        rows.append(case(*shape))
        r = rows[-1]
        print(f"{r['batch']} x {r['cached']} + {r['new']}: " + ", ".join(
            f"{name} {r[name]['ms']:.3f}" for name in (*VARIANTS, "dense", "cudnn"))
              + f" ms; dispatched: {r['kernels']}", flush=True)
    result = dict(torch=torch.__version__, triton=__import__("triton").__version__, device=torch.cuda.get_device_name(),
                  commit=os.environ.get("FLASHTILE_GIT_COMMIT"), heads=[HEADS, HEADS_KV], headdim=D, rows=rows)
    with open(os.path.join(os.environ.get("OUT", "."), "kv-prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
