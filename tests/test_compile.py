"""torch.compile(fullgraph=True) of models that call flashtile: no graph break, the same values and
gradients as eager, one graph for many sequence lengths, and dispatch still recorded at run time."""
import pytest
import torch
from torch._dynamo.utils import counters

import flashtile
from flashtile import flash_attn_func, flash_attn_qkvpacked_func
from flashtile.dispatch import disable_backends

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32


class Block(torch.nn.Module):
    """Pre-norm causal self-attention with GQA, as in a decoder layer."""

    def __init__(self, width=64, nheads=4, nheads_kv=2):
        super().__init__()
        self.nheads, self.nheads_kv, self.headdim = nheads, nheads_kv, width // nheads
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, (nheads + 2 * nheads_kv) * self.headdim)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(
            [self.nheads * self.headdim, self.nheads_kv * self.headdim, self.nheads_kv * self.headdim], dim=-1)
        q = q.view(batch, seqlen, self.nheads, self.headdim)
        k = k.view(batch, seqlen, self.nheads_kv, self.headdim)
        v = v.view(batch, seqlen, self.nheads_kv, self.headdim)
        return x + self.out(flash_attn_func(q, k, v, causal=True).reshape(batch, seqlen, -1))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    flashtile.reset_stats()
    yield
    torch._dynamo.reset()


def run(model, x):
    out = model(x)
    out.float().square().mean().backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_block_compiles_fullgraph_and_matches_eager(backend, compile_backend):
    torch.manual_seed(0)
    model = Block().to(DEVICE, DTYPE)
    x = torch.randn(2, 45, 64, device=DEVICE, dtype=DTYPE)
    eager_out, eager_grads = run(model, x)
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    out, grads = run(compiled, x)
    assert counters["graph_break"] == {}
    tol = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, eager_out, **tol)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, **tol)
    # Dispatch ran inside the op at run time: eager + compiled calls, each with its backward.
    assert flashtile.stats()["calls"] == {backend: 2}
    assert sum(flashtile.stats()["kernels"].values()) == 4


def test_dynamo_explain_sees_no_graph_break(backend):
    model = Block().to(DEVICE, DTYPE)
    explanation = torch._dynamo.explain(model)(torch.randn(1, 20, 64, device=DEVICE, dtype=DTYPE))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_new_sequence_lengths_do_not_recompile(backend):
    model = Block().to(DEVICE, DTYPE)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for seqlen in (17, 33, 64, 100):
        compiled(torch.randn(2, seqlen, 64, device=DEVICE, dtype=DTYPE)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert flashtile.stats()["calls"] == {backend: 4}


def test_packed_qkv_compiles(backend):
    qkv = torch.randn(2, 31, 3, 4, 16, device=DEVICE, dtype=DTYPE, requires_grad=True)
    eager = flash_attn_qkvpacked_func(qkv, causal=True)
    (grad,) = torch.autograd.grad(eager.sum(), qkv)
    compiled = torch.compile(lambda t: flash_attn_qkvpacked_func(t, causal=True), fullgraph=True, backend="aot_eager")
    out = compiled(qkv)
    (compiled_grad,) = torch.autograd.grad(out.sum(), qkv)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(compiled_grad, grad)


def test_fallback_is_recorded_when_compiled():
    model = Block().to(DEVICE, DTYPE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with disable_backends("triton"), pytest.warns(RuntimeWarning, match="disabled"):
        compiled(torch.randn(1, 9, 64, device=DEVICE, dtype=DTYPE))
    snapshot = flashtile.stats()
    assert snapshot["calls"] == {"torch": 1} and len(snapshot["fallbacks"]) == 1


def test_unimplemented_feature_is_refused_when_tracing(monkeypatch):
    """A feature no backend declares is refused while tracing, naming it (here: softcap, taken away)."""
    from flashtile.backends import torch_tiled
    from flashtile.backends import triton as triton_backend

    for module in (torch_tiled, triton_backend):
        monkeypatch.setattr(module, "FEATURES", module.FEATURES - {"softcap"})
    q = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=DTYPE)
    compiled = torch.compile(lambda t: flash_attn_func(t, t, t, softcap=30.0), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"softcap=30.0.*not implemented"):
        compiled(q)


def variant_inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, dtype=DTYPE):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype).requires_grad_()

    q, k, v = draw(2, 37, 4, 16), draw(2, 45, 2, 16), draw(2, 45, 2, 32)  # GQA, headdim_v = 32
    return q, k, v, draw(4, dtype=torch.float32), draw(2, 1, 37, 45)


def variant_call(q, k, v, sink, bias, dropout_p=0.0):
    return flash_attn_func(q, k, v, causal=True, window_size=(10, -1), softcap=5.0, sink=sink, attn_bias=bias,
                           alibi_slopes=torch.full((4,), 0.1, device=DEVICE), dropout_p=dropout_p)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_variants_compile_and_match_eager(backend, dropout_p):
    """Window, softcap, ALiBi, a learnable sink, a learnable broadcast bias, headdim_v and dropout through
    the custom op: no graph break; out and every gradient (dsink, dbias included) equal eager's under
    the same torch.manual_seed (dropout's counters are drawn when the op runs)."""
    inputs = variant_inputs()
    torch.manual_seed(5)
    eager = variant_call(*inputs, dropout_p=dropout_p)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), inputs)
    compiled = torch.compile(variant_call, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    out = compiled(*inputs, dropout_p=dropout_p)
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    assert counters["graph_break"] == {}
    assert out.shape == (2, 37, 4, 32)
    tol = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, eager, **tol)
    for name, grad, eager_grad in zip(("dq", "dk", "dv", "dsink", "dbias"), grads, eager_grads):
        assert grad.shape == eager_grad.shape and grad.dtype == eager_grad.dtype, name
        torch.testing.assert_close(grad, eager_grad, **tol, msg=name)


@pytest.mark.parametrize("lengths_q", [[11, 0, 25], [1, 0, 1]], ids=["prefill", "decode-step"])
def test_varlen_compiles(backend, lengths_q):
    """Packed sequences through torch.compile; a decode step (one query a sequence) takes the Triton
    backend's KV-cache kernel under the interpreter."""
    from flashtile import flash_attn_varlen_func
    from flashtile.testing import cu_seqlens_of

    generator = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths_q) + 4, 2, 16, generator=generator).to(DEVICE, DTYPE).requires_grad_()
    k, v = (torch.randn(40, 2, 16, generator=generator).to(DEVICE, DTYPE).requires_grad_() for _ in range(2))
    cu_q, cu_k = cu_seqlens_of(lengths_q, DEVICE), cu_seqlens_of([11, 0, 25], DEVICE)  # 4 rows past the end
    end = sum(lengths_q)

    def call(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), 25, causal=True)

    eager = call(q, k, v)
    (eager_dq,) = torch.autograd.grad(eager[:end].sum(), q)
    out = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    (dq,) = torch.autograd.grad(out[:end].sum(), q)
    assert counters["graph_break"] == {}
    torch.testing.assert_close(out[:end], eager[:end])
    torch.testing.assert_close(dq, eager_dq)
