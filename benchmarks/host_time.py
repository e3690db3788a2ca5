"""Host time per call of flash_attn_func next to torch's SDPA, on shapes small enough that the GPU
waits for the host (Llama-3-8B heads, 32 query / 8 KV, head dim 128, bf16, causal).

Each figure is the wall time of 1000 back-to-back calls (300 with a backward) after a warm-up,
divided by the count: while the kernels are shorter than the host's work per call, that is the
host's time. ``--label`` names the run (e.g. the commit) in the JSON.

    python benchmarks/host_time.py --label after -> $OUT (default /tmp)/h200-host-time-<label>.json

The decode rows take a new cache length every call, as transformers' growing cache gives (``measure_decode``);
the varlen rows pack 4 sequences into 512 tokens (``measure_varlen``), the sink rows carry a bf16 sink
(``measure_sink``), the mods rows ALiBi slopes, a bias or dropout (``measure_mods``). ``--only dense decode varlen sink
mods`` picks groups.
"""
import argparse, json, os, subprocess, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashtile


def per_call_us(fn, n=1000):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / n * 1e6, 1)


def events_us(fn, n=20):
    """GPU time of ``fn`` in us: the median over 7 repeats of the mean of ``n`` back-to-back calls (CUDA events,
    so the host's time is hidden behind the queue)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n * 1e3)
    return sorted(times)[3]


def kernel_copy(path: str, name: str):
    """The kernel source at ``path`` (e.g. from ``git show REV:path``) imported as module ``name`` beside the
    current kernels, so an A/B runs both versions in one process."""
    import importlib
    import shutil

    from flashtile.backends.triton import kernels
    shutil.copy(path, os.path.join(os.path.dirname(kernels.__file__), f"{name}.py"))
    return importlib.import_module(f"flashtile.backends.triton.kernels.{name}")


def git_commit():
    """The commit under test: ``FLASHTILE_GIT_COMMIT`` (the device copy has no .git), else git's."""
    return os.environ.get("FLASHTILE_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def rounds_option(default=2) -> int:
    """The ``--rounds`` a comparison script is run with."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=default)
    return parser.parse_args().rounds


def measure_all(measure, shapes):
    """``measure(*shape)`` of each shape from a fixed seed, each row printed as it comes."""
    torch.manual_seed(0)
    rows = []
    for shape in shapes:
        rows.append(measure(*shape))
        print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in rows[-1].items()}), flush=True)
    return rows


def save_results(name, rows, command, **meta):
    """Write ``rows`` with the versions, GPU and commit to ``$OUT/h200-<name>-<date>.json``; returns the path."""
    import datetime
    import triton
    meta = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                commit=git_commit(), command=command, **meta)
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"h200-{name}-{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return path


def measure(batch, seqlen, heads=32, heads_kv=8):
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qtg, ktg, vtg = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    row = {}
    with torch.no_grad():
        row["flashtile fwd, no grad"] = per_call_us(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
        row["sdpa fwd, no grad"] = per_call_us(
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
    row["flashtile fwd, requires grad"] = per_call_us(lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True))
    row["flashtile fwd+bwd"] = per_call_us(
        lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True).backward(dout), 300)
    row["sdpa fwd+bwd"] = per_call_us(
        lambda: F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True, enable_gqa=True).backward(
            dout.transpose(1, 2)), 300)
    return row


def measure_decode(passes=5, steps=200, heads=32, heads_kv=8):
    """Decode steps as transformers runs them with no CUDA graph: one query over a ``(1, heads_kv, L, 128)``
    cache passed transposed, a new length (and new strides) every call, as a cache grown by one token a step
    gives. The caches are built before each pass (their concatenation is not timed) with lengths no earlier
    call saw; us per call, best of ``passes``. Next to it the same call repeated on one cache length."""
    query = torch.randn(1, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
    calls = {
        "flashtile": lambda k, v: flashtile.flash_attn_func(query.transpose(1, 2), k.transpose(1, 2),
                                                            v.transpose(1, 2), causal=True),
        "sdpa": lambda k, v: F.scaled_dot_product_attention(query, k, v, enable_gqa=True),
    }
    row = {}
    # SDPA without cuDNN, which builds a plan for each new cache length (tens of ms a call).
    backends = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    with torch.no_grad(), backends:
        for name, call in calls.items():
            best = float("inf")
            for p in range(passes):
                start = 512 + (p + passes * (name == "sdpa")) * steps
                caches = [[torch.randn(1, heads_kv, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                          for n in range(start, start + steps)]
                call(*caches[0])
                torch.cuda.synchronize()
                t = time.perf_counter()
                for k, v in caches[1:]:
                    call(k, v)
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t) / (steps - 1) * 1e6)
            row[f"{name} decode, new cache length each call"] = round(best, 1)
            k, v = caches[0]
            row[f"{name} decode, one cache length"] = per_call_us(lambda: call(k, v))
    return row


def measure_sink(batch=1, seqlen=512, heads=32, heads_kv=8):
    """Calls with a sink in the model's dtype (gpt-oss's, bf16): a no-grad forward, and a forward + backward
    whose sink requires grad, at ``batch x seqlen``, causal; a decode step (one query over the cache)."""
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sink = torch.randn(heads, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    qg, kg, vg, sg = (x.clone().requires_grad_() for x in (q, k, v, sink))
    row = {}
    with torch.no_grad():
        row["flashtile fwd with sink, no grad"] = per_call_us(
            lambda: flashtile.flash_attn_func(q, k, v, causal=True, sink=sink))
        row["flashtile decode step with sink, no grad"] = per_call_us(
            lambda: flashtile.flash_attn_func(q[:, -1:], k, v, causal=True, sink=sink))
    row["flashtile fwd+bwd with sink, sink requires grad"] = per_call_us(
        lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True, sink=sg).backward(dout), 300)
    return row


def measure_mods(batch=1, seqlen=512, heads=32, heads_kv=8):
    """Calls with ALiBi slopes ``(nheads,)``, float32, an additive bf16 bias ``(1, nheads, seqlen, seqlen)`` that
    wants no gradient, or dropout: a no-grad forward and a forward + backward each, at ``batch x seqlen``, causal."""
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slopes = torch.rand(heads, device="cuda")
    bias = torch.randn(1, heads, seqlen, seqlen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    row = {}
    for name, mod in (("alibi", dict(alibi_slopes=slopes)), ("bias", dict(attn_bias=bias)),
                      ("dropout 0.1", dict(dropout_p=0.1))):
        with torch.no_grad():
            row[f"flashtile fwd with {name}, no grad"] = per_call_us(
                lambda: flashtile.flash_attn_func(q, k, v, causal=True, **mod))
        row[f"flashtile fwd+bwd with {name}"] = per_call_us(
            lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True, **mod).backward(dout), 300)
    return row


def measure_varlen(total=512, count=4, layers=8, steps=30, heads=32, heads_kv=8):
    """Packed sequences (``flash_attn_varlen_func``), causal, as a training loop over a packed batch runs them:
    ``count`` sequences filling ``total`` tokens. Rows: one batch called again and again, and training steps
    that each draw a new batch (new lengths, so a new longest length) and call it ``layers`` times
    (the offsets are made before timing). Next to them SDPA on one dense sequence of ``total`` tokens."""
    gen = torch.Generator().manual_seed(0)

    def batch():
        cuts = torch.randperm(total - 1, generator=gen)[:count - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, total]
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        return torch.tensor(bounds, dtype=torch.int32, device="cuda"), longest

    q = torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    cu, longest = batch()

    def call(a, b, c, offsets=cu, most=longest):
        return flashtile.flash_attn_varlen_func(a, b, c, offsets, offsets, most, most, causal=True)

    row = {}
    with torch.no_grad():
        row["flashtile varlen fwd, no grad, one batch"] = per_call_us(lambda: call(q, k, v))
    row["flashtile varlen fwd+bwd, one batch"] = per_call_us(lambda: call(qg, kg, vg).backward(dout), 300)
    batches = [batch() for _ in range(steps)]

    def steps_us():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for offsets, most in batches:
            for _ in range(layers):
                call(qg, kg, vg, offsets, most).backward(dout)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / (steps * layers) * 1e6

    steps_us()
    row[f"flashtile varlen fwd+bwd, new batch every {layers} calls"] = round(min(steps_us() for _ in range(3)), 1)
    qt, kt, vt = (x.detach().unsqueeze(0).transpose(1, 2).requires_grad_() for x in (q, k, v))
    row[f"sdpa fwd+bwd, dense 1x{total}"] = per_call_us(
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).backward(
            dout.unsqueeze(0).transpose(1, 2)), 300)
    return row


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="run")
    groups = ["dense", "decode", "varlen", "sink", "mods"]
    parser.add_argument("--only", choices=groups, nargs="*", default=groups)
    opts = parser.parse_args()
    result = {"label": opts.label, "commit": git_commit(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "device": torch.cuda.get_device_name(),
              "unit": "us per call (host-bound)", "rows": {}}
    if "dense" in opts.only:
        for batch, seqlen in [(1, 512), (1, 128)]:
            row = measure(batch, seqlen)
            result["rows"][f"{batch}x{seqlen}"] = row
            print(f"{batch}x{seqlen}", row, flush=True)
    # The other groups: one row each, under these names.
    for group, name, measure_group in (("decode", "decode 1x512+", measure_decode), ("sink", "sink 1x512", measure_sink),
                                       ("mods", "alibi or bias 1x512", measure_mods),
                                       ("varlen", "varlen 4 sequences, 512 tokens", measure_varlen)):
        if group in opts.only:
            result["rows"][name] = row = measure_group()
            print(name, row, flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"h200-host-time-{opts.label}.json")
    json.dump(result, open(path, "w"), indent=1)
    print("wrote", path)
