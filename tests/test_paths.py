"""Every kernel path the dispatcher can choose, run at the lengths that select it (flashtile/paths.py).

On the CPU (CI): the cases of ``paths.CASES`` must cover every atom (kernel x head-dim family x dtype x MHA/GQA x
dense/packed, for float32 kernel x head-dim family and kernel x MHA/GQA x dense/packed; kernel x feature) that the
dispatcher produces over ``paths.sweep()`` on an sm_90 GPU of 132 SMs, so a
new path fails here until a case runs it. On a Hopper GPU: every case runs through the public API with no threshold
lowered; the profiler must show the kernels its name promises, and out, lse and every gradient are held to the
tolerance rule against the float32 reference.
"""
import pytest
import torch

import flashtile
from flashtile import paths, testing
from flashtile.backends.triton import configs
from flashtile.rng import draw_seed_offset, dropout_mask

# The Triton function each kernel id of paths.kernel_ids runs (fwd:/decode: prefixes; bwd: the pair's dK/dV label).
FWD_FUNCTIONS = {"triton": "attn_fwd", "gluon-sm90": "attn_fwd_sm90", "gluon-sm90-slim": "attn_fwd_sm90",
                 "gluon-sm90-ws": "attn_fwd_sm90_ws"}


def _case_id(case: paths.Case) -> str:
    feats = "+".join(case.features) or "plain"
    dims = f"d{case.headdim}" + (f"v{case.headdim_v}" if case.headdim_v != case.headdim else "")
    cache = f"-{case.cache}" if case.cache else ""
    return (f"{case.batch}x{case.seqlen_q}x{case.seqlen_k}-h{case.nheads}/{case.nheads_kv}-{dims}-{case.dtype[:4]}"
            f"-{case.mask.replace(',', '_')}-{feats}{cache}")


@pytest.fixture
def hopper_132(monkeypatch):
    """The dispatcher's view of an sm_90 GPU of 132 SMs (the H100 SXM and the H200), on any machine."""
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("ws_d192", [False, True], ids=["ws-d192-off", "ws-d192-on"])
def test_cases_cover_every_path(hopper_132, monkeypatch, ws_d192):
    """With configs.GLUON_WS_D192 switched off and on (the table holds it on)."""
    monkeypatch.setattr(configs, "GLUON_WS_D192", configs._FWD_SM90_GLUON_WS_D192 if ws_d192 else None)
    covered = set().union(*(paths.atoms(case, hopper_132) for case in paths.CASES))
    missing = {}
    for case in paths.sweep():
        for atom in paths.atoms(case, hopper_132) - covered:
            missing.setdefault(atom, case)
    assert not missing, (f"{len(missing)} dispatcher paths have no case in paths.CASES; e.g. "
                         + "; ".join(f"{atom} (from {case})" for atom, case in list(missing.items())[:5]))


def test_one_pass_cases_are_long_rows(hopper_132):
    """The one-pass backward is selected by lengths, not lowered floors: its cases are the long MHA rows that broke
    (issue: wrong dK/dV when the pair's split plan was summed over its output)."""
    one_pass = [c for c in paths.CASES if "bwd:one-pass" in {k for k, *_ in paths.atoms(c, hopper_132)}]
    assert one_pass and any(c.seqlen_k >= 4096 and c.nheads == c.nheads_kv for c in one_pass)


def test_one_pass_never_takes_split_parts(hopper_132):
    """The plan that broke dK/dV: a long MHA call whose pair would split its key blocks takes the one-pass kernel
    unsplit, and a deterministic one keeps the split pair."""
    call = paths.Case(1, 8192, 8192, 4, 4, mask="causal").call(hopper_132)
    args = (configs.bwd_config(128, torch.bfloat16, hopper_132, 128, 8192), 128, 128, torch.bfloat16, hopper_132,
            frozenset(), (-1, 0), 1, 4, 4, 8192, 8192)
    assert configs.bwd_choice(*args, False) == configs.BwdPlan(True, args[0])
    pair = configs.bwd_choice(*args, True)
    assert not pair.one_pass and pair.parts > 1
    fwd_name, bwd_name, _ = flashtile.backends.triton.describe(call)
    assert "one-pass" in bwd_name and "parts" not in bwd_name


def test_one_pass_override_is_refused_off_its_path(rng, device):
    """launch.backward's ``one_pass`` (a sweep's knobs) never runs another backward in its place: a call the one-pass
    kernel does not take (here float32, too short to fill a GPU), or one that also asks for the pair's tiles, raises a
    ValueError that names the argument."""
    from flashtile.backends import AttnArgs
    from flashtile.backends.triton import launch

    q, k, v = testing.make_qkv(1, 37, 65, 2, 1, 192, torch.float32, device, generator=rng)
    args = AttnArgs(softmax_scale=192 ** -0.5)
    out, lse = launch.forward(q, k, v, args)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    tiles = configs.one_pass_config(192)
    with pytest.raises(ValueError, match="one_pass: this call"):
        launch.backward(out, q, k, v, out, lse, args, *grads, one_pass=tiles)
    with pytest.raises(ValueError, match="one_pass: a one-pass override"):
        launch.backward(out, q, k, v, out, lse, args, *grads, config=configs.bwd_config(192, q.dtype, q.device),
                        one_pass=tiles)
    # 96-key CTAs: 192/128 alone (here 192/192), and no softcap.
    with pytest.raises(ValueError, match="one_pass: 96-key CTAs.*192/192"):
        launch.backward(out, q, k, v, out, lse, args, *grads, one_pass=configs.one_pass_config(192, keys96=True))
    v128 = v[..., :128].contiguous()
    capped = AttnArgs(softmax_scale=192 ** -0.5, softcap=30.0)
    out, lse = launch.forward(q, k, v128, capped)
    with pytest.raises(ValueError, match="one_pass: 96-key CTAs.*softcap"):
        launch.backward(out, q, k, v128, out, lse, capped, grads[0], grads[1], torch.empty_like(v128),
                        one_pass=configs.one_pass_config(192, keys96=True))
    # Nor packed sequences with a window (configs.ONE_PASS_96_APART: its key loops spill there).
    cu = testing.cu_seqlens_of([37, 28], device)
    packed = AttnArgs(softmax_scale=192 ** -0.5, causal=True, window_left=16, window_right=0, cu_seqlens_q=cu,
                      cu_seqlens_k=cu, max_seqlen_q=37, max_seqlen_k=37, total_k=65)
    q, k = (t[0].contiguous() for t in (q, k))
    out = torch.randn(65, 2, 128, generator=rng).to(device)
    with pytest.raises(ValueError, match=r"one_pass: 96-key CTAs.*'varlen', 'window'.*got 192/128"):
        launch.backward(out, q, k, out[:, :1], out, torch.zeros(2, 65, device=device), packed, torch.empty_like(q),
                        torch.empty_like(k), torch.empty_like(out[:, :1]),
                        one_pass=configs.one_pass_config(192, keys96=True))


def _inputs(case: paths.Case, rng, device):
    dtype = getattr(torch, case.dtype)
    if "varlen" in case.features:
        # Lengths up to the maximum the case names, one of them at it, one empty and one of a single row.
        pattern = [1.0, 0.37, 0.0, 1e-9, 0.51, 0.99, 0.13, 0.75]
        lengths_q = [max(0, round(case.seqlen_q * f)) if f > 1e-6 else 1 for f in pattern[:case.batch]]
        lengths_k = [max(0, round(case.seqlen_k * f)) if f > 1e-6 else 1 for f in pattern[:case.batch]]
        lengths_q[0], lengths_k[0] = case.seqlen_q, case.seqlen_k
        return lengths_q, lengths_k
    return testing.make_qkv(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_kv, case.headdim,
                            dtype, device, generator=rng)


def _options(case: paths.Case, rng, device) -> dict:
    options = {"causal": case.mask == "causal"}
    if case.mask not in ("full", "causal"):
        options["window_size"] = case.window
    if "softcap" in case.features:
        options["softcap"] = paths.SOFTCAP
    if "alibi" in case.features:
        options["alibi_slopes"] = (torch.rand(case.nheads, generator=rng) * 0.3 + 0.01).to(device)
    if "sink" in case.features:
        options["sink"] = torch.randn(case.nheads, generator=rng).to(device).requires_grad_()
    if "deterministic" in case.features:
        options["deterministic"] = True
    return options


def _kernels_run(fn) -> set:
    """The names of the CUDA kernels ``fn`` launches (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


def _expect_kernels(case, names: set, device):
    fwd_id, bwd_id = paths.kernel_ids(*flashtile.backends.triton.describe(case.call(device))[:2])
    kind, label = fwd_id.split()[0].split(":")
    wanted = ["attn_decode" if kind == "decode" and label == "triton" else FWD_FUNCTIONS[label]]
    if bwd_id is not None and bwd_id.startswith("bwd:one-pass"):
        wanted.append({"bwd:one-pass-wide": "attn_bwd_sm90_wide", "bwd:one-pass-wide-96": "attn_bwd_sm90_wide96"}
                      .get(bwd_id, "attn_bwd_sm90_ws"))
    elif bwd_id is not None:
        wanted += ["attn_bwd_dkdv_sm90" if bwd_id.startswith("bwd:gluon-sm90 ") else "bwd_dkdv", "bwd_dq"]
        if " parts" in bwd_id:
            wanted.append("bwd_sum_parts")
    missing = [name for name in wanted if name not in names]
    assert not missing, f"{fwd_id} / {bwd_id}: kernels {missing} did not run; ran {sorted(names)}"


def _run_attention(case, rng, device):
    dtype = getattr(torch, case.dtype)
    options = _options(case, rng, device)
    sink = options.pop("sink", None)
    if "varlen" in case.features:
        lengths_q, lengths_k = _inputs(case, rng, device)
        (_, names) = _kernels_run(lambda: testing.check_packed(
            rng, lengths_q, lengths_k, case.nheads, case.nheads_kv, dtype, (case.headdim, case.headdim_v), sink=sink,
            device=device, deterministic=options.pop("deterministic", False), **options))
        return names
    q, k, v = _inputs(case, rng, device)
    if case.headdim_v != case.headdim:
        v = torch.randn(*v.shape[:3], case.headdim_v, generator=rng).to(device, dtype).requires_grad_()
    dout = torch.randn(*q.shape[:3], case.headdim_v, generator=rng).to(device, dtype)
    reference = {name: value for name, value in options.items() if name != "deterministic"}
    bias = None
    if "bias" in case.features:
        bias = torch.randn(1, case.nheads, case.seqlen_q, case.seqlen_k, generator=rng).to(device, dtype)
        bias.requires_grad_()
        options["attn_bias"] = reference["attn_bias"] = bias
    if "dropout" in case.features:
        torch.manual_seed(11)
        reference["dropout_mask"] = dropout_mask(*draw_seed_offset(), case.batch, case.nheads, case.seqlen_q,
                                                 case.seqlen_k, 0.17, device=device)
        torch.manual_seed(11)
        options["dropout_p"] = reference["dropout_p"] = 0.17
    leaves = [t for t in (q, k, v, sink, bias) if t is not None]

    def run():
        out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, sink=sink, **options)
        return out, lse, torch.autograd.grad(out, leaves, dout)

    (out, lse, grads), names = _kernels_run(run)
    ours = {"out": out, "lse": lse, **dict(zip(["dq", "dk", "dv"] + (["dsink"] if sink is not None else [])
                                              + (["dbias"] if bias is not None else []), grads))}
    refs = [_reference_by_rows(q, k, v, dout, hi, sink, reference) for hi in (True, False)]
    testing.assert_results_close(ours, *refs, dtype)
    return names


def _reference_by_rows(q, k, v, dout, hi, sink, options) -> dict:
    """testing.reference_results one batch row at a time (its score matrices are the memory a case takes), the
    rows' results stacked and the shared leaves' gradients (dsink, dbias) added up."""
    rows = []
    for i in range(q.shape[0]):
        row = {name: value[i:i + 1] if name == "dropout_mask" else value for name, value in options.items()}
        rows.append(testing.reference_results(q[i:i + 1], k[i:i + 1], v[i:i + 1], dout[i:i + 1], hi=hi, sink=sink,
                                              **row))
    stacked = {"lse": torch.cat([r["lse"] for r in rows])}
    for name in rows[0]:
        if name in ("dsink", "dbias"):
            stacked[name] = sum(r[name] for r in rows)
        elif name != "lse":
            stacked[name] = torch.cat([r[name] for r in rows])
    return stacked


def _run_cache(case, rng, device):
    """flash_attn_with_kvcache: ``seqlen_q`` new tokens appended to each row's cache, then attended over; rows hold
    different lengths, one of them the full capacity."""
    dtype = getattr(torch, case.dtype)
    b, s_new, cap, hkv = case.batch, case.seqlen_q, case.seqlen_k, case.nheads_kv
    keys = torch.randn(b, cap, hkv, case.headdim, generator=rng).to(device, dtype)
    values = torch.randn(b, cap, hkv, case.headdim_v, generator=rng).to(device, dtype)
    q = torch.randn(b, s_new, case.nheads, case.headdim, generator=rng).to(device, dtype)
    lengths = torch.randint(s_new, cap + 1, (b,), generator=rng)
    lengths[0] = cap
    seqlens = (lengths - s_new).to(device=device, dtype=torch.int32)
    k_new = torch.stack([keys[i, lengths[i] - s_new: lengths[i]] for i in range(b)])
    v_new = torch.stack([values[i, lengths[i] - s_new: lengths[i]] for i in range(b)])
    # What the cache holds past each row's length before the append: never read.
    k_cache, v_cache = keys.clone(), values.clone()
    for i in range(b):
        k_cache[i, lengths[i] - s_new:], v_cache[i, lengths[i] - s_new:] = float("nan"), float("inf")
    block_table = None
    if case.cache == "paged":
        page = 256
        pages = cap // page
        order = torch.randperm(b * pages, generator=rng).to(device)
        block_table = order.view(b, pages).to(torch.int32)
        k_paged = torch.empty(b * pages, page, hkv, case.headdim, device=device, dtype=dtype)
        v_paged = torch.empty(b * pages, page, hkv, case.headdim_v, device=device, dtype=dtype)
        k_paged[order] = k_cache.view(b * pages, page, hkv, -1)
        v_paged[order] = v_cache.view(b * pages, page, hkv, -1)
        k_cache, v_cache = k_paged, v_paged
    options = _options(case, rng, device)
    options.pop("deterministic", None)
    (out, lse), names = _kernels_run(lambda: flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=block_table, return_softmax_lse=True,
        **options))
    for i in range(b):
        row = {name: (value[i:i + 1] if name == "alibi_slopes" and value.dim() == 2 else value)
               for name, value in options.items()}
        ref_hi, ref_lo = (testing.attention_ref(q[i:i + 1], keys[i:i + 1, :lengths[i]], values[i:i + 1, :lengths[i]],
                                                upcast=upcast, **row) for upcast in (True, False))
        atol = testing.ATOL[dtype][0]
        testing.assert_close_to_ref(f"out[{i}]", out[i:i + 1], ref_hi[0], ref_lo[0], atol)
        testing.assert_close_to_ref(f"lse[{i}]", lse[i:i + 1], ref_hi[1], ref_lo[1], atol)
    return names


# Cases of more (query, key) pairs than this run one after another on one xdist worker (scripts/gpu_tests.sh
# distributes by group): their references hold several GiB each.
LARGE_PAIRS = 1 << 28


@pytest.mark.skipif(not testing.HOPPER, reason="the dispatcher's paths are those of an sm_90 GPU")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xdist_group("large")) if c.pairs > LARGE_PAIRS
                                  else c for c in paths.CASES], ids=[_case_id(c) for c in paths.CASES])
def test_path(case, rng, clean_dispatch_state):
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        names = (_run_cache if case.cache else _run_attention)(case, rng, device)
    finally:
        torch.cuda.empty_cache()
    _expect_kernels(case, names, device)
    assert not flashtile.stats()["fallbacks"], flashtile.stats()["fallbacks"]
