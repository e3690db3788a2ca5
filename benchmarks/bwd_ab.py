"""The backward at the headline shapes (B = 16384 // N, H = 2048 // d, bf16, full and causal) for the flashtile tree
on PYTHONPATH: with --check, out, LSE and every gradient held to the tolerance rule first (heads cut so the float32
reference fits in 4 GiB of scores), then timed (do_bench median, backward alone on a retained graph).

    PYTHONPATH=/tmp/base python benchmarks/bwd_ab.py base 192/128 192 --check
    SEQLENS="4096" PYTHONPATH=. python benchmarks/bwd_ab.py new 64

-> one line a shape, and JSON lines appended to $OUT (default /tmp)/bwd_ab.jsonl."""
import json, os, sys, torch, triton
import flashtile
from flashtile import testing

tag = sys.argv[1]
dims = [a for a in sys.argv[2:] if not a.startswith("--")]
check = "--check" in sys.argv
seqlens = [int(x) for x in os.environ.get("SEQLENS", "1024 4096 16384").split()]
rows = []
for spec in dims:
    d, dv = (int(x) for x in (spec.split("/") * 2)[:2])
    for n in seqlens:
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            checked = None
            if check:
                hc = max(1, min(h, (1 << 30) // (b * n * n)))
                g = torch.Generator().manual_seed(n + d)
                try:
                    q, k, v = testing.make_qkv(b, n, n, hc, hc, d, torch.bfloat16, "cuda", requires_grad=True,
                                               generator=g)
                    if dv != d:
                        v = torch.randn(b, n, hc, dv, generator=g).to("cuda", torch.bfloat16).requires_grad_()
                    do = torch.randn(b, n, hc, dv, generator=g).to("cuda", torch.bfloat16)
                    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
                    grads = torch.autograd.grad(out, (q, k, v), do)
                    ours = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))}
                    hi = testing.reference_results(q, k, v, do, hi=True, causal=causal)
                    lo = testing.reference_results(q, k, v, do, hi=False, causal=causal)
                    testing.assert_results_close(ours, hi, lo, torch.bfloat16)
                    checked = f"ok H={hc}"
                except AssertionError as e:
                    checked = "FAIL " + str(e).splitlines()[0][:200]
                del q, k, v, do
                torch.cuda.empty_cache()
            q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(b, n, h, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            do = torch.randn(b, n, h, dv, device="cuda", dtype=torch.bfloat16)
            before = set(flashtile.stats()["kernels"])
            out = flashtile.flash_attn_func(q, k, v, causal=causal)
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            kern = [x for x in flashtile.stats()["kernels"] if x.startswith("flashtile.bwd[")]
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         warmup=50, rep=300)
            flops = 2.5 * 2 * b * h * n * n * (d + dv) * (0.5 if causal else 1.0)
            row = dict(tag=tag, d=d, dv=dv, n=n, causal=causal, ms=ms, tflops=flops / ms / 1e9, checked=checked,
                       bwd_kernels=sorted(set(kern)))
            rows.append(row)
            print(f"{tag:8s} d{d}/{dv} n{n:5d} {'causal' if causal else 'full  '} {row['tflops']:6.1f} TF/s"
                  f"  {checked}  {[x for x in kern if x not in before] or kern[-1:]}", flush=True)
            del q, k, v, do, out
            torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_ab.jsonl"), "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
