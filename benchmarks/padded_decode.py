"""transformers' batched decode over a left-padded cache (``generate()`` on a padded batch), one attention call
through the integration: wall ms per call (the integration reads the mask on the host once a call), max error
against the integration's eager attention in float32, and the kernels that ran. bf16, 32/8 heads, d=128, one
query a row, each row left-padded by up to half the cache. Run it with two trees on PYTHONPATH to compare.

    FLASHTILE_NO_VENV=1 PYTHONPATH=$PWD python benchmarks/padded_decode.py
"""
import json
import time
import types

import torch

import flashtile
from flashtile.integrations.transformers import _eager_attention, flashtile_attention_forward

layer = types.SimpleNamespace(is_causal=True, training=False)
out = {"module": flashtile.__file__}
torch.manual_seed(0)
for b, L in ((8, 4096), (8, 16384), (32, 2048)):
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 8, L, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pads = torch.randint(0, L // 2, (b,), device="cuda")
    mask = torch.arange(L, device="cuda")[None] >= pads[:, None]
    with torch.no_grad():
        def call():
            return flashtile_attention_forward(layer, q, k, v, mask)[0]

        result = call()
        ref, _ = _eager_attention(q.float(), k.float(), v.float(), mask, causal=True, window=(-1, -1), scale=None,
                                  softcap=0.0, sink=None, dropout_p=0.0, position_bias=None, packed=None)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        out[f"{b}x{L}"] = dict(ms=round((time.perf_counter() - start) / 50 * 1e3, 3),
                               err=round((result.float() - ref).abs().max().item(), 4))
print(json.dumps(out), flush=True)
print(json.dumps(flashtile.stats()["kernels"]))
