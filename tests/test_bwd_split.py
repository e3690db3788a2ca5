"""An under-filled backward (``configs.bwd_kv_plan``): when few KV heads or short batches leave SMs
idle, several dK/dV programs share one key block's query rows, each storing float32 partial sums that
the launcher adds up after the kernel, and the dQ kernel runs alongside on a second stream. Any split
count must give the unsplit gradients to float32 rounding, for every feature the backward serves, and
the public API must still meet the reference with it on.
"""
import pytest
import torch

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.backends import AttnArgs
from flashtile.backends.triton import configs, launch
from flashtile.testing import assert_results_close, make_qkv, random_like, reference_results

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_split_rule(monkeypatch):
    """``(parts, alongside)`` on a 132-SM GPU: below 4 programs an SM, parts for about 4 programs an
    SM, rounded up to a power of two, of at least BWD_KV_MIN_ROWS_PER_SPLIT query rows, at most
    BWD_KV_MAX_SPLITS, with the dQ kernel alongside; only for backwards of BWD_SPLIT_MIN_PAIRS pairs or
    more."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    big = configs.BWD_SPLIT_MIN_PAIRS
    plan = configs.bwd_kv_plan
    # 1 x 8192, one KV head, 64-key blocks: 128 programs want 5 parts (-> 8), 8192 rows allow 4.
    assert plan(128, 8192, big, gpu) == (4, True)
    assert plan(128, 32768, big, gpu) == (8, True)
    assert plan(512, 8192, big, gpu) == (2, True)
    assert plan(1, 10**7, big, gpu) == (configs.BWD_KV_MAX_SPLITS, True)
    # Enough programs, rows too short for a second part, or too little work: as before.
    assert plan(528, 8192, big, gpu) == (1, False)
    assert plan(4096, 16384, big, gpu) == (1, False)
    assert plan(16, 2047, big, gpu) == (1, False)
    assert plan(128, 8192, big - 1, gpu) == (1, False)
    # 1 x 4096 causal with 1 query head (8 Mi pairs) stays as it was; with 2 (16 Mi) it splits, and so
    # does 1 x 8192 with 8/1 heads.
    assert configs.bwd_plan(1, 1, 1, 4096, 4096, (-1, 0), 64, gpu) == (1, False)
    assert configs.bwd_plan(1, 2, 1, 4096, 4096, (-1, 0), 64, gpu) == (2, True)
    assert configs.bwd_plan(1, 8, 1, 8192, 8192, (-1, 0), 64, gpu) == (4, True)
    # A sliding window bounds the rows a key block sees.
    assert plan(16, configs.row_keys(16384, 1024, 0), big, gpu) == (1, False)


def _dense(rng, device, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim=32, dtype=torch.float32):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype=dtype, device=device,
                       generator=rng)
    return q.detach(), k.detach(), v.detach()


CASES = {
    "gqa-causal": dict(shape=(1, 150, 150, 4, 2), args=dict(causal=True, window_right=0)),
    "mqa-full-rect": dict(shape=(2, 97, 130, 3, 1), args=dict()),
    "window": dict(shape=(1, 200, 180, 2, 2), args=dict(window_left=40, window_right=10)),
    "softcap-alibi": dict(shape=(1, 140, 160, 4, 2), args=dict(causal=True, window_right=0, softcap=5.0),
                          alibi=True),
    "dropout": dict(shape=(1, 130, 120, 2, 1), args=dict(dropout_p=0.3, seed=1234, offset=8)),
    "bias": dict(shape=(2, 90, 110, 2, 1), args=dict(), bias=True),
}


def _args(case, q, rng):
    kwargs = dict(CASES[case]["args"])
    batch, nheads = q.shape[0], q.shape[2]
    if CASES[case].get("alibi"):
        kwargs["alibi_slopes"] = (torch.rand(batch, nheads, generator=rng) * 0.5).to(q.device)
    if CASES[case].get("bias"):
        bias = torch.randn(batch, 1, q.shape[1], CASES[case]["shape"][2], generator=rng).to(q.device)
        kwargs["attn_bias"] = bias.expand(batch, nheads, -1, -1)
    return AttnArgs(softmax_scale=q.shape[-1] ** -0.5, **kwargs)


def _backward(q, k, v, dout, out, lse, args, splits):
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    dbias = None
    if args.attn_bias is not None:
        dbias = torch.full(args.attn_bias.shape, float("nan"), device=q.device)
    launch.backward(dout, q, k, v, out, lse, args, *grads, dbias=dbias, kv_splits=splits)
    return grads + ([dbias] if dbias is not None else [])


@pytest.mark.parametrize("case", list(CASES))
def test_split_matches_unsplit(device, rng, case):
    """Every split count, including ones that leave some parts empty, gives the unsplit dK and dV
    (float32 sums in another order); dQ (and dS for the bias) come from another kernel, unchanged."""
    q, k, v = _dense(rng, device, *CASES[case]["shape"])
    args = _args(case, q, rng)
    out, lse = launch.forward(q, k, v, args)
    dout = random_like(q, rng)
    base = _backward(q, k, v, dout, out, lse, args, 1)
    for splits in (2, 7):
        got = _backward(q, k, v, dout, out, lse, args, splits)
        assert torch.equal(got[0], base[0]), f"dq changed with {splits} parts"
        for name, a, b in zip(("dk", "dv"), got[1:3], base[1:3]):
            assert not torch.isnan(a).any(), f"{name}: NaN with {splits} parts"
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= 1e-5 * max(scale, 1.0), f"{name} with {splits} parts"
        if len(got) > 3:
            assert torch.equal(got[3], base[3]), f"dbias changed with {splits} parts"


def test_split_varlen_tail_and_seqused(device, rng):
    """Packed sequences (one empty), keys past seqused_k and tokens past cu_seqlens[-1]: the parts of
    such keys add up to 0, never to NaN, and the rest matches the unsplit gradients."""
    lens_q, lens_k = [37, 0, 81], [50, 9, 64]
    tail = 5
    cu_q = torch.tensor([0, 37, 37, 118], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 50, 59, 123], dtype=torch.int32, device=device)
    seqused = torch.tensor([40, 9, 64], dtype=torch.int32, device=device)
    gen = lambda rows, heads: torch.randn(rows, heads, 32, generator=rng).to(device)  # noqa: E731
    q, k, v = gen(sum(lens_q) + tail, 4), gen(sum(lens_k) + tail, 2), gen(sum(lens_k) + tail, 2)
    args = AttnArgs(softmax_scale=32 ** -0.5, causal=True, window_right=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), seqused_k=seqused)
    out, lse = launch.forward(q, k, v, args)
    dout = random_like(q, rng)
    base = _backward(q, k, v, dout, out, lse, args, 1)
    for splits in (2, 5):
        got = _backward(q, k, v, dout, out, lse, args, splits)
        for name, a, b in zip(("dk", "dv"), got[1:3], base[1:3]):
            assert not torch.isnan(a).any(), f"{name}: NaN with {splits} parts"
            assert float(a[sum(lens_k):].abs().max()) == 0.0, f"{name}: tail tokens with {splits} parts"
            assert float(a[40:50].abs().max()) == 0.0, f"{name}: keys past seqused_k with {splits} parts"
            assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1.0)


def _api_results(fn, q, k, v, dout, **kwargs):
    out, lse, _ = fn(q, k, v, return_attn_probs=True, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads, nheads_kv", [(4, 1), (2, 2)], ids=["mqa4-1", "mha2"])
def test_api_splits_against_reference(device, rng, monkeypatch, nheads, nheads_kv, causal):
    """Through the public API, with the rule choosing the parts (the interpreter pretends 8 SMs, so
    these few programs are split): the tolerance rule against the float64 reference holds."""
    chosen = []
    rule = configs.bwd_plan
    monkeypatch.setattr(configs, "bwd_plan", lambda *a: chosen.append(rule(*a)) or chosen[-1])
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    seqlen = 203 if device == "cpu" else 8192
    q, k, v = make_qkv(1, seqlen, seqlen, nheads, nheads_kv, 64, dtype=dtype, device=device, generator=rng)
    dout = random_like(q, rng)
    ours = _api_results(flash_attn_func, q, k, v, dout, causal=causal)
    refs = [reference_results(q, k, v, dout, hi=hi, causal=causal) for hi in (True, False)]
    assert_results_close(ours, *refs, dtype)
    assert chosen and chosen[-1][0] > 1, f"the rule chose {chosen}: this test no longer covers split key blocks"


def test_api_varlen_splits_against_reference(device, rng, monkeypatch):
    """Varlen through the API with two parts forced, one sequence empty: the tolerance rule against
    the float64 reference holds for the output, lse and every gradient."""
    monkeypatch.setattr(configs, "bwd_plan", lambda *a: (2, True))
    cu = torch.tensor([0, 70, 70, 203], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(203, h, 32, generator=rng).to(device=device, dtype=torch.float16).requires_grad_()
               for h in (4, 2, 2))
    dout = random_like(q, rng)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 133, 133, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ours = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    refs = [reference_results(q, k, v, dout, hi=hi, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
            for hi in (True, False)]
    assert_results_close(ours, *refs, torch.float16)


@pytest.mark.cuda
def test_forked_backward_in_cuda_graph(rng):
    """On the GPU the split backward forks the dQ kernel onto a second stream; captured in a CUDA
    graph and replayed on new inputs it gives the eager gradients."""
    q, k, v = make_qkv(1, 8192, 8192, 8, 1, 128, dtype=torch.bfloat16, device="cuda", generator=rng)
    dout = random_like(q, rng)
    assert configs.bwd_plan(1, 8, 1, 8192, 8192, (-1, 0), 64, q.device) == (4, True)

    def step():
        return torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        q.copy_(torch.randn(q.shape, generator=rng).to(q))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(("dq", "dk", "dv"), captured, eager):
        assert torch.equal(a, b), f"{name}: graph replay differs from eager"


def test_explain_names_the_parts(device, rng):
    """The backward's profiler name (and explain()) says when key blocks are split: parts=N."""
    import flashtile
    from flashtile.dispatch import force_backend

    q, k, v = make_qkv(1, 203, 203, 4, 1, 64, dtype=torch.float16, device=device, generator=rng)
    block_n = configs.bwd_config(64, q.dtype, q.device).dkdv.BLOCK_N
    parts, alongside = configs.bwd_plan(1, 4, 1, 203, 203, (-1, 0), block_n, q.device)
    with force_backend("triton"):
        text = str(flashtile.explain(q, k, v, causal=True))
    backward = next(line for line in text.splitlines() if line.startswith("backward"))
    assert (f" parts={parts} " in backward) == (parts > 1), backward
    assert ("+stream]" in backward) == (alongside and device == "cuda"), backward
    if device == "cpu":
        assert parts > 1, "the interpreter's 8 SMs no longer split this call: the name goes untested"
