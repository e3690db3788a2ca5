"""The FP8 Hopper forward (kernels/fwd_sm90_fp8.py) through its launcher, ``fp8.forward_fp8_sm90``, on an sm_90
GPU only.

Inputs are quantized here as FlashAttention-3 takes them: float8_e4m3fn with one descale per (batch row, KV head),
V transposed ``(batch, heads_kv, headdim, seqlen_k)``. The reference is float32 attention on the *dequantized*
inputs, so the inputs' own rounding is no part of the error; what remains is P's: the kernel rounds
``P * 448`` to e4m3 (3 mantissa bits, at most 2^-4 relative) before the PV product. Emulated on CPU (P rounded
block by block as the kernel does, float64 elsewhere) that gives an output relative RMSE of 0.020-0.025 over
the shapes below, so ``REL_RMSE`` is 0.035; and each element's error is at most 2^-4 times the attention over
|V| (each p_j v_j off by at most 2^-4 of itself), plus bf16's rounding of the output and ``ATOL`` for
P's e4m3 subnormals and the FP8 wgmma's accumulation. The lse comes from the float32 P: within ``LSE_ATOL_PER_128`` per 128 of head dim.
Outputs start as NaN; every element must be written. Lengths are awkward (1, 63, 129, 1000, 4133) and batch 2
with GQA 8/2, plus the long rows the dispatcher sends here (8k-16k).
"""
import pytest
import torch
import triton
import triton.language as tl

from flashtile import testing
from flashtile.backends import AttnArgs
from flashtile.backends.triton import fp8
from flashtile.backends.triton.kernels.common import row_block
from flashtile.fp8 import kernel_v_layout

hopper = pytest.mark.skipif(not testing.HOPPER, reason="the FP8 Gluon forward runs on sm_90 only")

REL_RMSE = 0.035
P_ROUNDING = 2.0 ** -4
ATOL = 1e-2
# The FP8 wgmma adds its products with about 13 mantissa bits: the scores' error grows with the head dim (an
# H200 run at d=256, 4133 rows, causal, block descales: 0.0113), so the lse's bound does too.
LSE_ATOL_PER_128 = 1e-2
E4M3_MAX = 448.0


def row_descales(descale: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Each row's descale, ``(batch, seqlen, heads_kv, 1, 1)``, from a (batch, heads_kv) or per-block
    (batch, heads_kv, blocks) one."""
    if descale.dim() == 2:
        return descale[:, None, :, None, None]
    rows = descale.repeat_interleave(fp8.DESCALE_BLOCK, dim=2)[..., :seqlen]
    return rows.transpose(1, 2)[..., None, None]


def quantize(x: torch.Tensor, nheads_kv: int, blocks: bool = False) -> tuple:
    """``x`` (batch, seqlen, heads, d) as e4m3 with one float32 descale per (batch row, KV head) (its group of
    query heads share it), or with ``blocks`` per (batch row, KV head, block of DESCALE_BLOCK rows):
    ``(x8, descale)``, ``x ~ x8 * descale``."""
    batch, seqlen, nheads, d = x.shape
    groups = x.reshape(batch, seqlen, nheads_kv, nheads // nheads_kv, d)
    if blocks:
        n = -(-seqlen // fp8.DESCALE_BLOCK)
        padded = torch.nn.functional.pad(groups.abs(), (0, 0, 0, 0, 0, 0, 0, n * fp8.DESCALE_BLOCK - seqlen))
        amax = padded.reshape(batch, n, fp8.DESCALE_BLOCK, nheads_kv, -1).amax(dim=(2, 4)).transpose(1, 2)
    else:
        amax = groups.abs().amax(dim=(1, 3, 4))
    descale = (amax / E4M3_MAX).clamp_min(1e-12).float().contiguous()
    x8 = (groups / row_descales(descale, seqlen)).to(torch.float8_e4m3fn)
    return x8.reshape(x.shape), descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    batch, seqlen, nheads, d = x8.shape
    nheads_kv = descale.shape[1]
    groups = x8.float().reshape(batch, seqlen, nheads_kv, nheads // nheads_kv, d)
    return (groups * row_descales(descale, seqlen)).reshape(x8.shape)


def fp8_inputs(rng, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, q_blocks=False, k_blocks=False):
    """Quantized q, k, V^T, their descales (q's and k's per block as asked), and the dequantized q, k, v."""
    q, k, v = testing.make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, torch.float32, "cuda",
                               requires_grad=False, generator=rng)
    (q8, q_ds), (k8, k_ds), (v8, v_ds) = (quantize(t, nheads_kv, blocks) for t, blocks in
                                          ((q, q_blocks), (k, k_blocks), (v, False)))
    return (q8, k8, kernel_v_layout(v8), q_ds, k_ds, v_ds), (dequantize(q8, q_ds), dequantize(k8, k_ds),
                                                         dequantize(v8, v_ds))


def run(inputs, seqlen_q, causal=False, window=(-1, -1), softcap=0.0, tile=None):
    """``forward_fp8_sm90`` into NaN-poisoned out and lse (on ``tile``, an fp8.Fp8Tile, else the head dim's own);
    returns them."""
    q8, k8, v_t, q_ds, k_ds, v_ds = inputs
    batch, _, nheads, head_dim = q8.shape
    out = torch.full((batch, seqlen_q, nheads, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((batch, nheads, seqlen_q), float("nan"), dtype=torch.float32, device="cuda")
    left, right = window
    args = AttnArgs(softmax_scale=head_dim ** -0.5, causal=causal, window_left=left,
                    window_right=0 if causal else right, softcap=softcap)
    assert fp8.fp8_sm90_supported(args, head_dim) is None
    fp8.forward_fp8_sm90(q8, k8, v_t, q_ds, k_ds, v_ds, out, lse, args, tile)
    return out, lse


def check(out, lse, deq, causal=False, window=(-1, -1), softcap=0.0):
    """Hold out and lse to the tolerances above against float32 attention on the dequantized inputs."""
    q, k, v = deq
    options = dict(causal=causal, window_size=window, softcap=softcap)
    ref, ref_lse = testing.attention_ref(q, k, v, **options)
    ref_abs, _ = testing.attention_ref(q, k, v.abs(), **options)
    assert not out.isnan().any(), "out: elements left unwritten (NaN)"
    assert not lse.isnan().any(), "lse: elements left unwritten (NaN)"
    out = out.float()
    err = (out - ref).abs()
    rel_rmse = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()
    assert rel_rmse < REL_RMSE, f"out: relative RMSE {rel_rmse:.4f} >= {REL_RMSE}"
    bound = P_ROUNDING * ref_abs + 2.0 ** -8 * ref.abs() + ATOL
    worst = (err - bound).flatten().argmax()
    assert (err <= bound).all(), (f"out: error {err.flatten()[worst].item():.4g} over its bound "
                                  f"{bound.flatten()[worst].item():.4g} at flat index {worst.item()}")
    # Rows that see no key: lse -inf (and out 0, which the bound above holds it to) in both.
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse: -inf rows differ from the reference"
    seen = torch.isfinite(ref_lse)
    lse_err = (lse[seen] - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
    lse_atol = LSE_ATOL_PER_128 * max(1, q.shape[-1] // 128)
    assert lse_err < lse_atol, f"lse: max error {lse_err:.4g} >= {lse_atol}"


MODES = {"full": {}, "causal": dict(causal=True), "window": dict(window=(256, 0)), "softcap": dict(softcap=30.0),
         "causal-softcap": dict(causal=True, softcap=30.0)}
# fp8.FP8_CANDIDATES' tiles (n128 runs plain d256 calls: fp8.FP8_PLAIN_TILES; c3 is off), each forced by name
# and head dim.
CANDIDATES = [pytest.param(name, head_dim, id=f"{name}-d{head_dim}") for name, tiles in fp8.FP8_CANDIDATES.items()
              for head_dim in tiles]


@hopper
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 63), (63, 129), (129, 1000), (1000, 129), (1000, 1000),
                                                (4133, 4133)])
def test_fp8_forward(rng, head_dim, mode, seqlen_q, seqlen_k):
    """Batch 2, GQA 8/2: every mode at awkward lengths (rows that see no key: 1000 causal queries on 129 keys)."""
    options = MODES[mode]
    inputs, deq = fp8_inputs(rng, 2, seqlen_q, seqlen_k, 8, 2, head_dim)
    out, lse = run(inputs, seqlen_q, **options)
    check(out, lse, deq, **options)


@hopper
@pytest.mark.parametrize("head_dim,batch,seqlen,nheads,nheads_kv,mode", [
    (128, 1, 16384, 2, 1, "causal"), (128, 1, 8192, 2, 2, "full"), (256, 1, 8192, 2, 1, "causal"),
    (256, 2, 4096, 2, 2, "full")])
def test_fp8_forward_long(rng, head_dim, batch, seqlen, nheads, nheads_kv, mode):
    """The lengths the dispatcher sends to this kernel (4k-16k keys)."""
    options = MODES[mode]
    inputs, deq = fp8_inputs(rng, batch, seqlen, seqlen, nheads, nheads_kv, head_dim)
    out, lse = run(inputs, seqlen, **options)
    check(out, lse, deq, **options)


def block_scaled(rng, seqlen_q, seqlen_k, head_dim, q_blocks, k_blocks):
    """Batch 2, GQA 8/2 inputs scaled by a different factor per 128-row block of q and k, quantized with per-block
    descales where asked: ``(kernel inputs, dequantized q, k, v)`` as :func:`fp8_inputs` gives them."""
    q, k, v = testing.make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, torch.float32, "cuda", requires_grad=False,
                               generator=rng)
    for t in (q, k):
        blocks = 2.0 ** (torch.rand(-(-t.shape[1] // fp8.DESCALE_BLOCK), generator=rng) * 2 - 1)
        t.mul_(blocks.repeat_interleave(fp8.DESCALE_BLOCK)[:t.shape[1]].to("cuda")[None, :, None, None])
    (q8, q_ds), (k8, k_ds), (v8, v_ds) = (quantize(t, 2, blocks) for t, blocks in
                                          ((q, q_blocks), (k, k_blocks), (v, False)))
    return (q8, k8, kernel_v_layout(v8), q_ds, k_ds, v_ds), (dequantize(q8, q_ds), dequantize(k8, k_ds),
                                                             dequantize(v8, v_ds))


@hopper
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mode", ["causal", "softcap"])
@pytest.mark.parametrize("q_blocks,k_blocks", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(129, 1000), (4133, 4133)])
def test_fp8_block_descales(rng, head_dim, mode, q_blocks, k_blocks, seqlen_q, seqlen_k):
    """Per-block descales of Q and K (block quantization): a tile's rows and each key block read their own. The
    inputs are scaled by a different factor per 128-row block, so a block that read another's descale would fail."""
    options = MODES[mode]
    inputs, deq = block_scaled(rng, seqlen_q, seqlen_k, head_dim, q_blocks, k_blocks)
    out, lse = run(inputs, seqlen_q, **options)
    check(out, lse, deq, **options)


@hopper
@pytest.mark.parametrize("name,head_dim", CANDIDATES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 63), (63, 129), (129, 1000), (1000, 129), (193, 385),
                                                (4133, 4133)])
def test_fp8_candidate_tiles(rng, name, head_dim, mode, seqlen_q, seqlen_k):
    """fp8.FP8_CANDIDATES' tiles forced: every mode at awkward lengths, batch 2, GQA 8/2 (193 rows: one past a
    three-consumer tile of 192; 1000 causal queries on 129 keys: rows that see no key)."""
    options = MODES[mode]
    inputs, deq = fp8_inputs(rng, 2, seqlen_q, seqlen_k, 8, 2, head_dim)
    out, lse = run(inputs, seqlen_q, **options, tile=fp8.FP8_CANDIDATES[name][head_dim])
    check(out, lse, deq, **options)


@hopper
@pytest.mark.parametrize("name,head_dim", CANDIDATES)
@pytest.mark.parametrize("batch,seqlen,nheads,nheads_kv,mode", [(1, 16384, 2, 1, "causal"), (1, 8192, 2, 2, "full"),
                                                                (2, 4096, 2, 2, "full")])
def test_fp8_candidate_tiles_long(rng, name, head_dim, batch, seqlen, nheads, nheads_kv, mode):
    """The candidates at the lengths the dispatcher sends to this kernel (4k-16k keys)."""
    options = MODES[mode]
    inputs, deq = fp8_inputs(rng, batch, seqlen, seqlen, nheads, nheads_kv, head_dim)
    out, lse = run(inputs, seqlen, **options, tile=fp8.FP8_CANDIDATES[name][head_dim])
    check(out, lse, deq, **options)


# Each candidate at each length: one parameter, so the default run (tests/conftest.py's covering set) keeps them all.
CANDIDATE_BLOCK_LENGTHS = [
    pytest.param(name, head_dim, seqlen_q, seqlen_k, id=f"{name}-d{head_dim}-{seqlen_q}x{seqlen_k}")
    for name, tiles in fp8.FP8_CANDIDATES.items() for head_dim in tiles
    for seqlen_q, seqlen_k in [(64, 300), (129, 1000), (193, 385), (4133, 4133)]]


@hopper
@pytest.mark.parametrize("name,head_dim,seqlen_q,seqlen_k", CANDIDATE_BLOCK_LENGTHS)
def test_fp8_candidate_block_descales(rng, name, head_dim, seqlen_q, seqlen_k):
    """Per-block Q and K descales on the candidates: a three-consumer tile of 192 rows spans two Q descale blocks,
    its third consumer's rows in the second; 64 and 193 rows: the last tile's later consumers start past the rows
    and read the last block (kernels/common.row_block; under compute-sanitizer memcheck, nothing past the tensor)."""
    inputs, deq = block_scaled(rng, seqlen_q, seqlen_k, head_dim, True, True)
    out, lse = run(inputs, seqlen_q, causal=True, tile=fp8.FP8_CANDIDATES[name][head_dim])
    check(out, lse, deq, causal=True)


@hopper
@pytest.mark.parametrize("name,head_dim", CANDIDATES)
@pytest.mark.parametrize("mode", ["full", "causal"])
def test_fp8_candidate_repeatable(rng, name, head_dim, mode):
    """A candidate gives the same bits run to run (no race between the producer's refills and the consumers')."""
    inputs, _ = fp8_inputs(rng, 2, 2000, 2000, 8, 2, head_dim)
    tile = fp8.FP8_CANDIDATES[name][head_dim]
    first = run(inputs, 2000, **MODES[mode], tile=tile)
    for _ in range(3):
        again = run(inputs, 2000, **MODES[mode], tile=tile)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@hopper
@pytest.mark.parametrize("seqlen,mode", [(4133, "full"), (16384, "causal")])
def test_fp8_two_level_d128(rng, monkeypatch, seqlen, mode):
    """d128 on the other tile of fp8.FP8_TILES: 64-key blocks, O summed in float32 a block at a time."""
    monkeypatch.setitem(fp8.FP8_TILES, 128, (64, 4, True))
    options = MODES[mode]
    inputs, deq = fp8_inputs(rng, 1, seqlen, seqlen, 2, 1, 128)
    out, lse = run(inputs, seqlen, **options)
    check(out, lse, deq, **options)


@hopper
def test_fp8_broadcast_descales(rng):
    """Descales given as one value expanded over (batch, KV head) (strides 0), as FA3's callers pass them."""
    inputs, _ = fp8_inputs(rng, 2, 300, 300, 8, 2, 128)
    q8, k8, v_t, _, _, _ = inputs
    scales = [torch.tensor(s, device="cuda").expand(2, 2) for s in (0.01, 0.02, 0.005)]
    out, lse = run((q8, k8, v_t, *scales), 300, causal=True)
    deq = tuple(dequantize(t, s.contiguous()) for t, s in ((q8, scales[0]), (k8, scales[1]),
                                                          (v_t.permute(0, 3, 1, 2), scales[2])))
    check(out, lse, deq, causal=True)


@hopper
@pytest.mark.parametrize("mode", ["full", "causal"])
def test_fp8_repeatable(rng, mode):
    """Two runs give the same bits (no race between the producer's refills and the consumers' reads)."""
    inputs, _ = fp8_inputs(rng, 2, 2000, 2000, 8, 2, 128)
    first = run(inputs, 2000, **MODES[mode])
    for _ in range(3):
        again = run(inputs, 2000, **MODES[mode])
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@hopper
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mode", ["full", "causal", "window"])
def test_fp8_pingpong_same_bits(rng, monkeypatch, head_dim, mode):
    """The consumers' turns (fp8.FP8_PINGPONG) change when each issues its matmuls, not what they compute: with
    and without them the output and lse have the same bits. 4133 rows of batch 2 x 8 heads are 528 tiles, several
    a CTA (turn phases carried across tiles); causal and window tiles give the two consumers different key blocks
    (turns taken on blocks released unread)."""
    options = MODES[mode]
    inputs, deq = fp8_inputs(rng, 2, 4133, 4133, 8, 2, head_dim)
    monkeypatch.setitem(fp8.FP8_PINGPONG, head_dim, True)
    out, lse = run(inputs, 4133, **options)
    check(out, lse, deq, **options)
    monkeypatch.setitem(fp8.FP8_PINGPONG, head_dim, False)
    plain = run(inputs, 4133, **options)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


def test_fp8_supported_reasons():
    """Calls the kernel lacks get a reason (no GPU needed)."""
    args = AttnArgs(softmax_scale=0.1)
    assert fp8.fp8_sm90_supported(args, 128) is None
    assert "head dim 96" in fp8.fp8_sm90_supported(args, 96)
    cu = torch.zeros(2, dtype=torch.int32)
    varlen = AttnArgs(softmax_scale=0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=cu[:1])
    assert fp8.fp8_sm90_supported(varlen, 128) is None
    dense_used = AttnArgs(softmax_scale=0.1, seqused_k=cu[:1])
    assert "seqused_k without packed sequences" in fp8.fp8_sm90_supported(dense_used, 128)
    assert "ALiBi" in fp8.fp8_sm90_supported(AttnArgs(softmax_scale=0.1, alibi_slopes=torch.ones(1, 2)), 128)


def test_fp8_tile_consumers_checked():
    """A tile of a consumer count the kernel lacks is refused, naming the tile (no GPU needed: refused before the
    launch); the candidates' consumers all run."""
    fp8_type = torch.float8_e4m3fn
    q, k = torch.zeros(1, 64, 2, 128, dtype=fp8_type), torch.zeros(1, 64, 1, 128, dtype=fp8_type)
    v_t = torch.zeros(1, 1, 128, 64, dtype=fp8_type)
    scale = torch.ones(1, 1)
    out, lse = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16), torch.empty(1, 2, 64)
    with pytest.raises(ValueError, match="consumers must be one of"):
        fp8.forward_fp8_sm90(q, k, v_t, scale, scale, scale, out, lse, AttnArgs(softmax_scale=0.1),
                             fp8.Fp8Tile(128, 2, False, False, 4))
    assert {tile.consumers for tiles in fp8.FP8_CANDIDATES.values() for tile in tiles.values()} <= {2, 3}
    assert all(set(tiles) <= set(fp8.FP8_TILES) for tiles in fp8.FP8_CANDIDATES.values())


@triton.jit
def _row_block_probe(ROWS, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, row_block(tl.load(ROWS + offs), tl.load(ROWS + N + offs), fp8.DESCALE_BLOCK))


@pytest.mark.parametrize("consumers", [2, 3])
def test_each_consumer_reads_a_q_descale_block_inside_the_tensor(device, consumers):
    """The Q descale block a consumer reads (kernels/common.row_block of its first row, as the kernel's three
    consumers do): its own rows' block while they lie inside the ``seqlen_q`` rows, and never past the
    ``cdiv(seqlen_q, 128)`` blocks of the descale tensor: a 192-row tile's last consumers may start past the end
    (1 row: rows 64 and 128; 193 rows: 256 and 320, block 2 of 2). Every tile of every length up to 4 tiles of 192."""
    rows, lengths = [], []
    for seqlen_q in range(1, 4 * 192 + 2):
        for start_m in range(-(-seqlen_q // (consumers * 64))):
            for wg in range(consumers):
                rows.append(start_m * consumers * 64 + wg * 64)
                lengths.append(seqlen_q)
    n = triton.next_power_of_2(len(rows))
    pad = n - len(rows)
    first = torch.tensor(rows + [0] * pad, dtype=torch.int32)
    seqlen = torch.tensor(lengths + [1] * pad, dtype=torch.int32)
    out = torch.full((n, ), -1, dtype=torch.int32, device=device)
    _row_block_probe[(1, )](torch.cat([first, seqlen]).to(device), out, N=n)
    block, first, seqlen = out.cpu()[:len(rows)], first[:len(rows)], seqlen[:len(rows)]
    blocks = (seqlen + fp8.DESCALE_BLOCK - 1) // fp8.DESCALE_BLOCK
    assert bool(((block >= 0) & (block < blocks)).all()), "a descale block past the tensor"
    inside = first < seqlen
    assert torch.equal(block[inside], first[inside] // fp8.DESCALE_BLOCK)


def test_fp8_no_keys(device):
    """No keys: every row's output is 0 and its lse -inf, without a launch (runs on CPU too)."""
    fp8_type = torch.float8_e4m3fn
    q = torch.randn(2, 5, 4, 128).to(device=device, dtype=fp8_type)
    k = torch.empty(2, 0, 2, 128, dtype=fp8_type, device=device)
    v_t = torch.empty(2, 2, 128, 0, dtype=fp8_type, device=device)
    scale = torch.ones(2, 2, device=device)
    out = torch.full((2, 5, 4, 128), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((2, 4, 5), float("nan"), device=device)
    fp8.forward_fp8_sm90(q, k, v_t, scale, scale, scale, out, lse, AttnArgs(softmax_scale=0.1))
    assert (out == 0).all() and (lse == float("-inf")).all()


@hopper
@pytest.mark.parametrize("cu", [[0, 300, 900], [0, 400, 200, 600], [-5, 100, 600], [0, 129, 600, 700]])
@pytest.mark.parametrize("k_blocks", [False, True])
def test_fp8_varlen_bad_offsets_stay_inside(rng, cu, k_blocks):
    """Packed sequences whose offsets run past the 600 tokens, decrease or start below 0: out and lse are views
    into buffers with poisoned guard rows either side, which keep their bits; the rows inside are finite and the
    bad offset is in the device error record (flashtile/device_errors.py)."""
    from flashtile import device_errors
    total, guard, nheads, nheads_kv, d = 600, 64, 8, 2, 128
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    batch, longest = len(cu) - 1, 700
    q8, k8 = (torch.randn(total, h, d, generator=rng).to("cuda", torch.float8_e4m3fn) for h in (nheads, nheads_kv))
    v_t = kernel_v_layout(torch.randn(total, nheads_kv, d, generator=rng).to("cuda", torch.float8_e4m3fn), cu_t)
    blocks = -(-longest // fp8.DESCALE_BLOCK)
    q_ds = torch.full((batch, nheads_kv), 0.01, device="cuda")
    k_ds = torch.full((batch, nheads_kv, blocks) if k_blocks else (batch, nheads_kv), 0.01, device="cuda")
    out_buf = torch.full((total + 2 * guard, nheads, d), 7.0, dtype=torch.bfloat16, device="cuda")
    lse_buf = torch.full((nheads, total + 2 * guard), 7.0, device="cuda")
    out, lse = out_buf[guard:guard + total], lse_buf[:, guard:guard + total]
    out.zero_(), lse.zero_()
    args = AttnArgs(softmax_scale=d ** -0.5, causal=True, window_right=0, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                    max_seqlen_q=longest, max_seqlen_k=longest)
    device_errors.clear()
    fp8.forward_fp8_sm90(q8, k8, v_t, q_ds, k_ds, q_ds, out, lse, args)
    torch.cuda.synchronize()
    assert (out_buf[:guard] == 7.0).all() and (out_buf[guard + total:] == 7.0).all(), "out: a guard row was written"
    assert (lse_buf[:, :guard] == 7.0).all() and (lse_buf[:, guard + total:] == 7.0).all(), "lse: guard written"
    assert torch.isfinite(out.float()).all() and not lse.isnan().any()
    found = device_errors.pending()
    device_errors.clear()
    assert found and found[0]["argument"] in ("cu_seqlens_q", "cu_seqlens_k"), found


@hopper
def test_fp8_varlen_next_sequence_never_leaks(rng):
    """The keys past a packed sequence in its last key block are the next sequence's: NaN values there (and in
    the rows past the last sequence) must not reach this sequence's output (the producer zeroes them in V^T)."""
    lengths, nheads, d = [100, 29, 200], 4, 128
    total = sum(lengths) + 40
    cu = torch.tensor([0, 100, 129, 329], dtype=torch.int32, device="cuda")
    q8, k8 = (torch.randn(total, nheads, d, generator=rng).to("cuda", torch.float8_e4m3fn) for _ in range(2))
    v8 = torch.randn(1, total, nheads, d, generator=rng).to("cuda", torch.float8_e4m3fn)
    v8[0, 100:129] = float("nan")
    v8[0, 329:] = float("nan")
    scale = torch.full((3, nheads), 0.02, device="cuda")
    out = torch.full((total, nheads, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((nheads, total), float("nan"), device="cuda")
    args = AttnArgs(softmax_scale=d ** -0.5, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
    fp8.forward_fp8_sm90(q8, k8, kernel_v_layout(v8[0], cu), scale, scale, scale, out, lse, args)
    assert torch.isfinite(out[:100].float()).all() and torch.isfinite(out[129:329].float()).all()
    assert (out[329:] == 0).all() and (lse[:, 329:] == float("-inf")).all()
    assert out[100:129].isnan().all(), "the sequence whose own values are NaN keeps them"
