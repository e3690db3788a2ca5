"""The backend registry: explain() reports, strict mode, disabled backends, profiler names and
per-kernel counts. CPU-only rules are skipped on a GPU machine and the other way round."""
import dataclasses
import functools
import math
import warnings

import pytest
import torch

import flashtile
from flashtile.dispatch import disable_backends, force_backend
from flashtile.testing import make_qkv

HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU dispatch rules (Triton runs CPU tensors under the interpreter)")


pytestmark = pytest.mark.usefixtures("clean_dispatch_state")


def inputs(rng, dtype=torch.float16, headdim=64, requires_grad=False):
    device = "cuda" if HAS_CUDA else "cpu"
    return make_qkv(1, 37, 37, 4, 2, headdim, dtype, device, requires_grad=requires_grad, generator=rng)


def test_explain_names_backend_kernel_and_config(rng):
    report = flashtile.explain(*inputs(rng), causal=True)
    assert report.backend == "triton" and report.preferred == "triton" and not report.fallback
    assert report.kernel.startswith("flashtile.fwd[triton d=64 causal BM=")
    assert report.backward_kernel.startswith("flashtile.bwd[triton d=64 causal dkdv=")
    assert set(report.config) == {"fwd", "bwd_dkdv", "bwd_dq"}
    assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(report.config["fwd"])
    text = str(report)
    assert "triton" in text and report.kernel in text and "preferred backend" in text
    assert report.to_dict()["backend"] == "triton"


@pytest.mark.parametrize("window, seqlen, features, tile", [
    ((-1, -1), 512, {}, (128, 128)),  # full rows: the big tile at every length
    ((-1, 0), 4096, {}, (64, 64)),  # causal, short rows: the diagonal blocks waste less of a small tile
    ((-1, 0), 16384, {}, (128, 128)),  # causal, long rows
    ((1024, 0), 16384, {}, (64, 64)),  # a narrow window keeps rows short however long the sequence
    ((8192, 0), 16384, {}, (128, 128)),
    ((-1, -1), 4096, {"softcap": 30.0}, (64, 64)),  # tanh and exp2 share the special-function units
    ((-1, -1), 8192, {"softcap": 30.0}, (128, 128)),
    ((-1, 0), 16384, {"softcap": 30.0}, (64, 64)),
    ((-1, -1), 4096, {"bias": True}, (128, 64)),  # the bias tile needs shared memory too
])
def test_hopper_forward_tiles_follow_mask_row_length_and_features(monkeypatch, window, seqlen, features, tile):
    """The H200 d=128 forward tiles (configs.py) picked from the call's mask, keys per row, softcap and
    bias, and explain() names the tile the launcher will use."""
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    left, right = window
    cfg = configs.fwd_config(128, torch.bfloat16, cuda, seqlen, left, right,
                             softcap="softcap" in features, bias="bias" in features)
    assert (cfg.BLOCK_M, cfg.BLOCK_N) == tile
    described = tuple((name, f"{name}: test") for name in features)
    # With the Gluon kernel's floor out of reach, the Triton table decides.
    monkeypatch.setattr(configs, "GLUON_MIN_PAIRS", 1 << 60)
    call = AttentionCall(cuda, torch.bfloat16, 1, seqlen, seqlen, 1, 1, 128, right == 0, described, window=window)
    name, _, config = triton_backend.describe(call)
    assert f"BM={tile[0]} BN={tile[1]}]" in name and (config["fwd"]["BLOCK_M"], config["fwd"]["BLOCK_N"]) == tile


@pytest.mark.parametrize("headdim, headdim_v, features, fwd_tile, bwd_tiles", [
    (256, 256, (), (128, 64, 2), ((64, 32, 2), (128, 64, 1))),
    (160, 160, (), (128, 64, 2), ((64, 32, 2), (128, 64, 1))),  # padded to 256
    (192, 128, (), (128, 64, 3), ((64, 32, 2), (128, 64, 2))),  # 128-wide values leave room for a stage
    (256, 64, (), (128, 64, 3), ((64, 32, 2), (128, 64, 2))),
    (256, 256, ("bias",), (64, 64, 2), ((64, 32, 2), (128, 64, 1))),  # the bias tile needs shared memory too
    (192, 128, ("bias",), (64, 64, 2), ((64, 32, 2), (128, 64, 1))),  # a second dQ stage with the bias: 245760 B
    (128, 64, (), (128, 128, 3), ((32, 64, 3), (128, 64, 3))),  # narrower values change nothing at 128
])
def test_hopper_head_dim_256_tiles(monkeypatch, headdim, headdim_v, features, fwd_tile, bwd_tiles):
    """Head dims padded to 256 take the tuned tiles (configs.py), with a deeper pipeline when the values are
    at most half as wide (DeepSeek's 192/128); explain() names them."""
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    width = max(headdim, headdim_v)
    fwd = configs.fwd_config(width, torch.bfloat16, cuda, 4096, -1, -1, bias="bias" in features, head_dim_v=headdim_v)
    bwd = configs.bwd_config(width, torch.bfloat16, cuda, headdim_v, features=frozenset(features))
    assert (fwd.BLOCK_M, fwd.BLOCK_N, fwd.num_stages) == fwd_tile
    assert tuple((t.BLOCK_M, t.BLOCK_N, t.num_stages) for t in (bwd.dkdv, bwd.dq)) == bwd_tiles
    described = tuple((name, f"{name}: test") for name in features)
    monkeypatch.setattr(configs, "GLUON_MIN_PAIRS", 1 << 60)  # the Triton table's tiles
    call = AttentionCall(cuda, torch.bfloat16, 1, 4096, 4096, 1, 1, headdim, False, described, headdim_v=headdim_v)
    name, bwd_name, config = triton_backend.describe(call)
    assert config["fwd"]["num_stages"] == fwd_tile[2] and config["bwd_dq"]["num_stages"] == bwd_tiles[1][2]
    assert f"BM={fwd_tile[0]} BN={fwd_tile[1]}]" in name


@pytest.mark.parametrize("window, seqlen, features, headdim, kernel", [
    ((1024, 0), 16384, (), 128, "gluon-sm90-slim 64x64"),  # a narrow window: its edge blocks waste less of 64x64
    ((4096, 0), 16384, (), 128, "gluon-sm90 64x128"),  # a wide one leads on 64x128
    ((4096, 0), 16384, ("sink", "alibi"), 128, "gluon-sm90 64x128"),
    ((4096, 0), 16384, ("softcap",), 128, "gluon-sm90-slim 64x64"),
    ((2048, 2048), 16384, (), 128, "gluon-sm90 64x128"),
    ((-1, 0), 2048, (), 128, "gluon-sm90-slim 64x64"),  # short causal rows: three programs an SM
    ((-1, 0), 4096, (), 128, "gluon-sm90 64x128"),  # causal rows
    ((-1, 0), 8192, (), 128, "gluon-sm90-ws 64x128"),  # long causal rows: warp-specialized
    ((-1, 0), 16384, ("sink",), 128, "gluon-sm90-ws 64x128"),
    ((-1, -1), 2048, (), 128, "gluon-sm90 64x128"),  # full rows
    ((-1, -1), 4096, (), 128, "gluon-sm90-ws 64x128"),
    ((-1, -1), 4096, ("sink",), 128, "gluon-sm90-ws 64x128"),
    ((-1, -1), 4096, ("softcap",), 128, "gluon-sm90-ws 64x128"),  # softcap overlaps tanh with the PV matmul
    ((-1, -1), 8192, ("softcap",), 128, "triton"),  # ...but not on long full rows
    ((-1, 0), 16384, ("softcap",), 128, "gluon-sm90-ws 64x128"),
    ((-1, 0), 4096, ("softcap",), 128, "gluon-sm90 64x128"),
    ((-1, -1), 4096, ("alibi",), 128, "gluon-sm90-ws 64x128"),  # ALiBi: a linear bias off the diagonal
    ((-1, 0), 8192, ("alibi",), 128, "gluon-sm90-ws 64x128"),
    ((-1, 0), 4096, ("alibi",), 128, "gluon-sm90 64x128"),
    ((1024, 0), 16384, ("alibi", "sink"), 128, "gluon-sm90 64x64"),
    ((-1, 0), 4096, ("softcap", "alibi"), 128, "gluon-sm90 64x64"),  # the linear ALiBi cannot take softcap
    ((-1, -1), 4096, ("softcap", "alibi"), 128, "gluon-sm90 64x64"),
    ((1024, 0), 16384, ("dropout",), 128, "triton"),  # features the Gluon kernel lacks
    ((1024, 0), 16384, ("bias",), 128, "triton"),
    ((1024, 0), 16384, ("varlen",), 128, "gluon-sm90-slim 64x64"),  # packed sequences
    ((-1, 0), 2048, ("varlen",), 128, "gluon-sm90-slim 64x64"),
    ((-1, 0), 16384, ("varlen",), 128, "gluon-sm90 64x128"),
    ((1024, 0), 16384, ("varlen", "alibi"), 128, "gluon-sm90 64x64"),
    ((-1, 0), 16384, ("varlen", "dropout"), 128, "triton"),
    ((1024, 0), 16384, (), 64, "triton"),  # head dim other than 128
])
def test_hopper_forward_kernel_is_gluon_where_it_leads(monkeypatch, window, seqlen, features, headdim, kernel):
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    described = tuple((name, f"{name}: test") for name in features)
    batch = max(1, 16384 // seqlen)  # batch x seqlen = 16384 tokens, as in the variants benchmark
    call = AttentionCall(cuda, torch.bfloat16, batch, seqlen, seqlen, 16, 16, headdim, window[1] == 0, described,
                         window=window)
    name, _, config = triton_backend.describe(call)
    family = kernel.split()[0]
    assert name.startswith(f"flashtile.fwd[{family} d={headdim}")
    kernels = {"gluon-sm90": "gluon", "gluon-sm90-slim": "gluon-slim", "gluon-sm90-ws": "gluon-ws"}
    assert config["fwd"]["kernel"] == kernels.get(family, "triton")
    if family.startswith("gluon-sm90"):
        tile = kernel.split()[1]
        assert name.endswith(f"BM={tile.split('x')[0]} BN={tile.split('x')[1]}]")
    # fp32 and other GPUs never take it.
    rows = batch * 16 * seqlen
    assert configs.gluon_fwd_config(headdim, headdim, torch.float32, cuda, rows, seqlen, *window,
                                    frozenset(features)) is None
    monkeypatch.setattr(configs, "capability", lambda device: (8, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    assert configs.gluon_fwd_config(headdim, headdim, torch.bfloat16, cuda, rows, seqlen, *window,
                                    frozenset(features)) is None


@pytest.mark.parametrize("softcap, dtype, features, row_max", [
    (30.0, torch.bfloat16, (), 30.0 / math.log(2)),  # C = 43.3: m = C, the largest term is 1
    (50.0, torch.bfloat16, (), 102.0 - 50.0 / math.log(2)),  # C = 72.1: m = 102 - C keeps 2**-102 at -C
    (75 * math.log(2), torch.bfloat16, (), 102.0 - 75.0),  # the largest cap: the largest term is 2**48
    (52.0, torch.bfloat16, (), None),
    (50.0, torch.float16, (), None),  # P in float16 tops out at 65504
    (50.0, torch.bfloat16, ("alibi",), None),  # logits the cap does not bound
    (50.0, torch.bfloat16, ("sink",), None),
    (0.0, torch.bfloat16, (), None),
])
def test_softcap_holds_the_row_max_fixed_only_where_exp2_stays_in_range(softcap, dtype, features, row_max):
    from flashtile.backends.triton import configs
    got = configs.fixed_row_max(softcap, dtype, frozenset(features) | {"softcap"})
    if row_max is None:
        assert got is None
        return
    assert got == pytest.approx(row_max)
    bound = softcap / math.log(2)
    # exp2(s - m) over s in [-C, C]: the smallest term 2**-102 or more, the largest at most 2**48.
    assert -bound - got >= -102 - 1e-9 and bound - got <= 48 + 1e-9


@pytest.mark.parametrize("softcap, dtype, kernel", [
    (50.0, torch.bfloat16, "gluon-sm90-ws"),  # fixed row max: the Gluon kernel leads on long full rows too
    (60.0, torch.bfloat16, "triton"),
    (50.0, torch.float16, "triton"),
])
def test_long_full_softcap_rows_take_gluon_when_the_row_max_is_fixed(monkeypatch, softcap, dtype, kernel):
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    call = AttentionCall(torch.device("cuda", 0), dtype, 2, 8192, 8192, 16, 16, 128, False,
                         (("softcap", "softcap: test"),), softcap=softcap)
    name, _, _ = triton_backend.describe(call)
    assert name.startswith(f"flashtile.fwd[{kernel} d=128")


@pytest.mark.parametrize("tile, head_dim, head_dim_v, q_in_regs, programs", [
    ("_FWD_SM90_GLUON", 128, 128, True, 2), ("_FWD_SM90_GLUON_WIDE", 128, 128, False, 2),
    ("_FWD_SM90_GLUON_SLIM", 128, 128, False, 3),
    ("_FWD_SM90_GLUON_D256", 256, 256, False, 2), ("_FWD_SM90_GLUON", 192, 128, True, 2),
])
def test_gluon_tiles_fit_their_programs_per_sm(tile, head_dim, head_dim_v, q_in_regs, programs):
    """The shared-memory plan of each Gluon tile: two programs per SM (three for the slim tile) within 227 KB
    (Q, the key and value rings, 16-bit), Q in registers only where the scores and the accumulator leave room."""
    from flashtile.backends.triton import configs
    cfg = getattr(configs, tile)
    ring = configs.gluon_ring(cfg, head_dim)
    smem = 2 * (head_dim * (cfg.BLOCK_M + ring["K_STAGES"] * cfg.BLOCK_N) + head_dim_v * ring["V_STAGES"] * cfg.BLOCK_N)
    assert programs * (smem + 1024) <= 227 * 1024, (cfg, ring, smem)
    assert ring["Q_IN_REGS"] == q_in_regs


@pytest.mark.parametrize("head_dim, head_dim_v, features, tile", [
    (256, 256, (), "_FWD_SM90_GLUON_WS_D256"),  # 4096 keys: the warp-specialized floor
    (256, 256, ("window", "softcap", "alibi", "sink"), "_FWD_SM90_GLUON_D256"),
    (128, 128, (), "_FWD_SM90_GLUON_WS"),
    (128, 128, ("softcap", "alibi"), "_FWD_SM90_GLUON"),
    (64, 64, (), "_FWD_SM90_GLUON_WS_D64_C3"),
    (192, 128, ("headdim_v",), "_FWD_SM90_GLUON_WS_D192"),  # q and k read as 128 + 64 columns
    (192, 128, ("headdim_v", "window", "softcap", "alibi", "sink"), "_FWD_SM90_GLUON"),
    (192, 192, (), None),
    (256, 128, ("headdim_v",), None),
    (256, 256, ("dropout",), None),
])
def test_gluon_head_dims(monkeypatch, head_dim, head_dim_v, features, tile):
    """Head dims 64, 128 and 256 (q, k and v alike) and 192/128 take the Gluon kernels on 4096 full keys, with any of
    their features."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    window = (100, 0) if "window" in features else (-1, -1)
    cfg = configs.gluon_fwd_config(head_dim, head_dim_v, torch.bfloat16, torch.device("cuda", 0), 1 << 22, 4096,
                                   *window, frozenset(features), 30.0 if "softcap" in features else 0.0)
    assert cfg == (getattr(configs, tile) if tile else None)


@pytest.mark.parametrize("seqlen_k, causal, features, takes", [
    (4096, False, (), True), (4095, False, (), False), (8192, True, (), True), (8191, True, (), False),
    (8192, True, ("sink",), True), (4096, False, ("softcap",), True), (4096, False, ("alibi",), True),
    (4096, False, ("softcap", "alibi"), False), (4096, False, ("window",), False), (8192, True, ("window",), False),
])
@pytest.mark.parametrize("switched_on", [False, True], ids=["off", "on"])
def test_head_dim_64_takes_the_warp_specialized_forward_once_switched_on(monkeypatch, seqlen_k, causal, features,
                                                                          takes, switched_on):
    """At d=64 the warp-specialized forward takes the rows (GLUON_WS_FULL_KEYS / GLUON_WS_CAUSAL_KEYS keys) and
    features it takes at d=128 only while GLUON_WS_D64 holds its tile (off: the Triton kernel); plain causal rows
    under GLUON_SHORT_CAUSAL_KEYS keep the Gluon 64x64 tile either way."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "GLUON_WS_D64", configs._FWD_SM90_GLUON_WS_D64 if switched_on else None)
    window = (100, 0) if "window" in features else (-1, 0 if causal else -1)
    cuda = torch.device("cuda", 0)
    cfg = configs.gluon_fwd_config(64, 64, torch.bfloat16, cuda, 1 << 22, seqlen_k, *window, frozenset(features),
                                   30.0 if "softcap" in features else 0.0)
    assert cfg == (configs._FWD_SM90_GLUON_WS_D64 if takes and switched_on else None)
    assert configs.gluon_fwd_config(64, 64, torch.bfloat16, cuda, 1 << 22, 1000, -1, 0, frozenset()) == \
        configs._FWD_SM90_GLUON


@pytest.mark.parametrize("seqlen_k, causal, features, tile", [
    (4096, False, (), "_FWD_SM90_GLUON_WS_D64_C3"), (8192, True, ("sink",), "_FWD_SM90_GLUON_WS_D64_C3"),
    (4096, False, ("softcap",), "_FWD_SM90_GLUON_WS_D64_C3"), (4096, False, ("alibi",), "_FWD_SM90_GLUON_WS_D64"),
    (8192, True, ("alibi", "sink"), "_FWD_SM90_GLUON_WS_D64"), (4095, False, (), None), (8192, True, ("window",), None),
])
def test_head_dim_64_three_consumers_once_switched_on(monkeypatch, seqlen_k, causal, features, tile):
    """GLUON_WS_D64 set to the three-consumer tile (the table's row): it takes the rows the two-consumer tile takes,
    but ALiBi, whose linear bias spills in three consumers' 160 registers, keeps two consumers."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "GLUON_WS_D64", configs._FWD_SM90_GLUON_WS_D64_C3)
    window = (100, 0) if "window" in features else (-1, 0 if causal else -1)
    cfg = configs.gluon_fwd_config(64, 64, torch.bfloat16, torch.device("cuda", 0), 1 << 22, seqlen_k, *window,
                                   frozenset(features), 30.0 if "softcap" in features else 0.0)
    assert cfg == (getattr(configs, tile) if tile else None)
    assert configs._FWD_SM90_GLUON_WS_D64_C3.consumers == 3 and configs._FWD_SM90_GLUON_WS_D64.consumers == 2


def test_head_dim_64_three_consumers_are_on_in_the_table():
    """The d=64 row runs three consumers (H200 A/B: 1.05-1.11x two consumers on long rows); ALiBi keeps two."""
    from flashtile.backends.triton import configs
    assert configs.GLUON_WS_D64 is configs._FWD_SM90_GLUON_WS_D64_C3 and configs.GLUON_WS_D64.consumers == 3


@pytest.mark.parametrize("switch", [False, True])
@pytest.mark.parametrize("seqlen_k, window, features, takes_ws", [
    (4096, (-1, -1), (), True), (4100, (-1, -1), ("sink",), True), (16384, (-1, -1), ("softcap",), True),
    (8192, (-1, 0), (), True), (8200, (-1, 0), ("sink", "softcap"), True),
    (4095, (-1, -1), (), False), (8191, (-1, 0), (), False),  # under GLUON_WS_FULL_KEYS / GLUON_WS_CAUSAL_KEYS
    (16384, (-1, -1), ("alibi",), False), (16384, (4096, 0), ("window",), False),
    (16384, (-1, -1), ("varlen",), False),
])
def test_d256_takes_the_warp_specialized_tile_only_when_switched_on(monkeypatch, switch, seqlen_k, window, features,
                                                                    takes_ws):
    """GLUON_WS_D256 (on; None switches it off) sends long d=256 rows of its features to the warp-specialized kernel at
    d=128's floors; every other d=256 call, and all of them while it is off, keeps _FWD_SM90_GLUON_D256."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "GLUON_WS_D256", configs._FWD_SM90_GLUON_WS_D256 if switch else None)
    cfg = configs.gluon_fwd_config(256, 256, torch.bfloat16, torch.device("cuda", 0), 1 << 20, seqlen_k, *window,
                                   frozenset(features), 30.0 if "softcap" in features else 0.0)
    assert cfg == (configs._FWD_SM90_GLUON_WS_D256 if switch and takes_ws else configs._FWD_SM90_GLUON_D256)
    # A KV-cache call (the warp-specialized kernel reads no cache) keeps the 64x64 tile.
    assert configs.gluon_fwd_config(256, 256, torch.bfloat16, torch.device("cuda", 0), 1 << 20, seqlen_k, *window,
                                    frozenset(features), 30.0 if "softcap" in features else 0.0,
                                    warp_specialized=False) == configs._FWD_SM90_GLUON_D256


@pytest.mark.parametrize("tile, head_dim, head_dim_v, q_buffers", [
    ("_FWD_SM90_GLUON_WS", 128, 128, 2), ("_FWD_SM90_GLUON_WS_D256", 256, 256, 1),
    ("_FWD_SM90_GLUON_WS_D192", 192, 128, 1), ("_FWD_SM90_GLUON_WS_D64", 64, 64, 2),
    ("_FWD_SM90_GLUON_WS_D64_C3", 64, 64, 2),  # three consumers: buffers of 192 rows
])
def test_ws_tiles_fit_shared_memory(tile, head_dim, head_dim_v, q_buffers):
    """The warp-specialized forward's 16-bit plans: Q buffers of every consumer's 64 rows (two, or one where two would
    not fit beside the K and V rings: fwd_sm90_ws.q_buffers) and the rings, within the CTA's 227 KB."""
    from flashtile.backends.triton import configs
    from flashtile.backends.triton.kernels import fwd_sm90_ws
    cfg = getattr(configs, tile)
    ring = cfg.num_stages * cfg.BLOCK_N * (head_dim + head_dim_v) * 2
    buffers = fwd_sm90_ws.q_buffers(cfg.BLOCK_M, head_dim, 16, ring, cfg.consumers)
    assert buffers == q_buffers
    assert buffers * cfg.consumers * cfg.BLOCK_M * head_dim * 2 + ring + 1024 <= 227 * 1024


@pytest.mark.parametrize("switch", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("seqlen_k, window, features, takes_ws", [
    (4096, (-1, -1), (), True), (4157, (-1, -1), ("sink",), True), (16384, (-1, -1), ("softcap",), True),
    (8192, (-1, 0), (), True), (16384, (-1, 0), ("sink", "softcap"), True),
    (4095, (-1, -1), (), False), (8191, (-1, 0), (), False),  # under GLUON_WS_FULL_KEYS / GLUON_WS_CAUSAL_KEYS
    (16384, (-1, -1), ("alibi",), False), (16384, (-1, 0), ("alibi", "sink"), False),
    (16384, (4096, 0), ("window",), False), (16384, (-1, -1), ("varlen",), False),
])
def test_d192_takes_the_warp_specialized_tile_only_when_switched_on(monkeypatch, switch, seqlen_k, window, features,
                                                                    takes_ws):
    """GLUON_WS_D192 (None: off) sends long 192/128 rows of GLUON_WS_D192_FEATURES to the warp-specialized kernel at
    d=128's floors; every other 192/128 call, and all of them while it is off, keeps the 64x64 tile. ALiBi, windows
    and packed sequences are refused by the rule, and a KV-cache call (the kernel reads no cache) and 192/192 never
    take it."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "GLUON_WS_D192", configs._FWD_SM90_GLUON_WS_D192 if switch else None)
    cuda = torch.device("cuda", 0)
    features = frozenset(("headdim_v", *features))
    softcap = 30.0 if "softcap" in features else 0.0
    cfg = configs.gluon_fwd_config(192, 128, torch.bfloat16, cuda, 1 << 20, seqlen_k, *window, features, softcap)
    assert cfg == (configs._FWD_SM90_GLUON_WS_D192 if switch and takes_ws else configs._FWD_SM90_GLUON)
    assert configs.gluon_fwd_config(192, 128, torch.bfloat16, cuda, 1 << 20, seqlen_k, *window, features, softcap,
                                    warp_specialized=False) == configs._FWD_SM90_GLUON
    assert configs.gluon_fwd_config(192, 192, torch.bfloat16, cuda, 1 << 20, seqlen_k, *window,
                                    features - {"headdim_v"}, softcap) is None
    # Neither dtype nor other head dims see the switch: float32 stays off the Gluon kernels.
    assert configs.gluon_fwd_config(192, 128, torch.float32, cuda, 1 << 20, seqlen_k, *window, features,
                                    softcap) is None


@pytest.mark.parametrize("switch", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d192_warp_specialized_forward_is_named(monkeypatch, switch, causal):
    """describe() names the kernel that runs: DeepSeek's 1 x 16384 rows at 192/128 on the warp-specialized kernel
    (``gluon-sm90-ws d=192 ... headdim_v``, 128-key slots) once GLUON_WS_D192 is on, else the 64x64 Gluon tile."""
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    monkeypatch.setattr(configs, "GLUON_WS_D192", configs._FWD_SM90_GLUON_WS_D192 if switch else None)
    call = AttentionCall(torch.device("cuda", 0), torch.bfloat16, 1, 16384, 16384, 16, 16, 192, causal,
                         (("headdim_v", "headdim_v: test"),), headdim_v=128, window=(-1, 0 if causal else -1))
    name, _, tiles = triton_backend.describe(call)
    mask = "causal" if causal else "full"
    expected = "gluon-sm90-ws d=192 {} headdim_v BM=64 BN=128" if switch else "gluon-sm90 d=192 {} headdim_v BM=64 BN=64"
    assert name == f"flashtile.fwd[{expected.format(mask)}]", name
    assert tiles["fwd"]["kernel"] == ("gluon-ws" if switch else "gluon")


@pytest.mark.parametrize("tile, named", [("_FWD_SM90_GLUON_WS_D64", ""), ("_FWD_SM90_GLUON_WS_D64_C3", " consumers=3")])
def test_d64_warp_specialized_forward_names_its_consumers(monkeypatch, tile, named):
    """describe() names three consumer warpgroups (and their turns) where GLUON_WS_D64 runs them, so a profile of the
    switched-on row tells them from the two-consumer tile."""
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    monkeypatch.setattr(configs, "GLUON_WS_D64", getattr(configs, tile))
    call = AttentionCall(torch.device("cuda", 0), torch.bfloat16, 1, 16384, 16384, 32, 32, 64, True, (),
                         window=(-1, 0))
    name, _, tiles = triton_backend.describe(call)
    assert name == f"flashtile.fwd[gluon-sm90-ws d=64 causal{named} BM=64 BN=128]", name
    assert tiles["fwd"]["consumers"] == getattr(configs, tile).consumers
    monkeypatch.setattr(configs, "GLUON_WS_D64", dataclasses.replace(getattr(configs, tile), pingpong=True))
    assert triton_backend.describe(call)[0] == f"flashtile.fwd[gluon-sm90-ws d=64 causal{named} pingpong BM=64 BN=128]"


def test_small_calls_keep_the_triton_kernel_for_its_cheaper_launch(monkeypatch):
    """The Gluon kernel takes calls of at least GLUON_MIN_PAIRS (row, key) pairs: causal rows count half
    their keys, a window its width. KV-cache calls have their own floor, GLUON_KV_MIN_PAIRS."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    pairs = configs.GLUON_MIN_PAIRS

    def kernel(rows, seqlen_k, left, right):
        features = frozenset({"window"} if left >= 0 else ())
        cfg = configs.gluon_fwd_config(128, 128, torch.bfloat16, cuda, rows, seqlen_k, left, right, features)
        return cfg and cfg.kernel

    assert kernel(pairs // 1024, 1024, -1, -1) == "gluon"
    assert kernel(pairs // 1024 - 1, 1024, -1, -1) is None
    assert kernel(pairs // 1024, 2048, -1, 0) == "gluon-slim"  # causal: 1024 keys a row on average
    assert kernel(pairs // 1024, 2047, -1, 0) is None
    rows = -(-pairs // 1025)
    assert kernel(rows, 16384, 1024, 0) == "gluon-slim"  # a window of 1025 keys
    assert kernel(rows - 1, 16384, 1024, 0) is None
    assert kernel(32 * 16 * 512, 512, -1, -1) == "gluon"  # 32 x 512 at 16 heads: replayed, its kernel leads
    assert kernel(1 * 32 * 1024, 1024, -1, 0) is None  # 1 x 1024 causal at 32 heads: bound by the host
    # At head dim 256 a pair is twice the work: half as many pairs will do.
    d256 = configs.gluon_fwd_config(256, 256, torch.bfloat16, cuda, pairs // 2048, 1024, -1, -1, frozenset())
    assert d256 == configs._FWD_SM90_GLUON_D256
    assert configs.gluon_fwd_config(256, 256, torch.bfloat16, cuda, pairs // 2048 - 1, 1024, -1, -1,
                                    frozenset()) is None
    kv_pairs = configs.GLUON_KV_MIN_PAIRS
    assert kv_pairs > pairs
    chunk = functools.partial(configs.gluon_kv_config, 128, 128, torch.bfloat16, cuda)
    assert chunk(1, 128, 32, kv_pairs // (32 * 128), -1, 0, frozenset({"kvcache"})) == configs._FWD_SM90_GLUON_WIDE
    assert chunk(1, 128, 32, kv_pairs // (32 * 128) - 1, -1, 0, frozenset({"kvcache"})) is None


def test_short_causal_rows_take_the_narrow_gluon_tile(monkeypatch):
    """Causal rows of fewer than GLUON_SHORT_CAUSAL_KEYS keys take the Gluon 64x64 tile at d=128 (slimmed to
    three programs an SM unless they have ALiBi, as rows under GLUON_SLIM_CAUSAL_KEYS are); at d=64 they are the
    only calls the Gluon kernel takes (plain ones, not from a KV cache)."""
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    cuda = torch.device("cuda", 0)
    keys = configs.GLUON_SHORT_CAUSAL_KEYS

    def tile(head_dim, seqlen_k, right, *features):
        return configs.gluon_fwd_config(head_dim, head_dim, torch.bfloat16, cuda, 1 << 22, seqlen_k, -1, right,
                                        frozenset(features))

    assert tile(128, keys - 1, 0) == configs._FWD_SM90_GLUON_SLIM
    assert tile(128, keys - 1, 0, "softcap", "sink") == configs._FWD_SM90_GLUON_SLIM
    assert tile(128, keys - 1, 0, "softcap", "alibi") == configs._FWD_SM90_GLUON
    assert tile(128, keys, 0, "alibi") == configs._FWD_SM90_GLUON_WIDE
    slim_keys = configs.GLUON_SLIM_CAUSAL_KEYS
    assert tile(128, slim_keys - 1, 0) == configs._FWD_SM90_GLUON_SLIM
    assert tile(128, slim_keys - 1, 0, "sink") == configs._FWD_SM90_GLUON_SLIM
    assert tile(128, slim_keys - 1, 0, "alibi") == configs._FWD_SM90_GLUON_WIDE
    assert tile(128, slim_keys, 0) == configs._FWD_SM90_GLUON_WIDE
    assert tile(128, keys - 1, -1) == configs._FWD_SM90_GLUON_WIDE  # full rows
    assert tile(64, keys - 1, 0) == configs._FWD_SM90_GLUON
    assert tile(64, keys, 0) is None and tile(64, keys - 1, -1) is None
    assert tile(64, keys - 1, 0, "softcap") is None and tile(64, keys - 1, 0, "varlen") is None
    assert configs.gluon_kv_config(64, 64, torch.bfloat16, cuda, 64, 512, 32, keys - 1, -1, 0,
                                   frozenset({"kvcache"})) is None


@pytest.mark.parametrize("seqlen_q, features, page_size, window, kernel", [
    (2048, ("kvcache",), 0, (-1, 0), "gluon-sm90 64x128"),  # chunked prefill on a contiguous cache
    (512, ("kvcache",), 0, (-1, 0), "gluon-sm90 64x128"),
    (127, ("kvcache",), 0, (-1, 0), "triton"),  # fewer rows: the KV-cache kernel packs the GQA heads
    (1, ("kvcache",), 0, (-1, 0), "triton"),  # a decode step
    (2048, ("kvcache", "paged"), 16, (-1, 0), "triton"),  # pages: no TMA box spans them
    (2048, ("kvcache", "window"), 0, (1024, 0), "gluon-sm90-slim 64x64"),
    (2048, ("kvcache", "softcap", "alibi", "sink"), 0, (-1, 0), "gluon-sm90 64x64"),
])
def test_kvcache_chunked_prefill_takes_the_gluon_forward(monkeypatch, seqlen_q, features, page_size, window, kernel):
    """KV-cache calls of many query rows on a contiguous cache run the Gluon Hopper forward, and its name says so."""
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    described = tuple((name, f"{name}: test") for name in features)
    call = AttentionCall(torch.device("cuda", 0), torch.bfloat16, 4, seqlen_q, 16384, 32, 8, 128, window[1] == 0,
                         described, page_size=page_size, window=window)
    name, _, config = triton_backend.describe(call)
    family = kernel.split()[0]
    assert name.startswith(f"flashtile.decode[{family} d=128")
    if family.startswith("gluon-sm90"):
        tile = kernel.split()[1]
        assert name.endswith(f"BM={tile.split('x')[0]} BN={tile.split('x')[1]}]")
        assert config["decode"]["kernel"] == family.replace("-sm90", "")


@pytest.mark.parametrize("options", [
    {}, {"causal": True}, {"window_left": 10, "window_right": 0}, {"causal": True, "window_left": 10,
                                                                    "window_right": 0},
    {"window_right": 3}, {"softcap": 5.0}, {"dropout_p": 0.1}, {"softcap": 5.0, "causal": True},
])
def test_launcher_feature_names_match_the_dispatchers(options):
    """The launcher picks the Gluon kernel from the same feature names the dispatcher's describe() sees."""
    from flashtile.backends import AttnArgs, _features, present_features
    if options.get("causal"):
        options = {**options, "window_right": 0}
    args = AttnArgs(softmax_scale=0.125, **options)
    assert present_features(args, 64, 64) == tuple(name for name, _ in _features(args, 64, 64))


def test_tma_unfit_names_the_tensor_and_its_strides():
    from flashtile.backends.triton.launch import tma_unfit
    base = torch.zeros(1, 8, 2, 129, dtype=torch.float16)
    aligned = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    assert tma_unfit(aligned, aligned, aligned) is None
    reason = tma_unfit(aligned, base[..., 1:], aligned)
    assert reason.startswith("k starts at") and "(2064, 258, 129, 1)" in reason


def test_keys_per_row_under_a_window():
    from flashtile.backends.triton.configs import row_keys
    assert row_keys(16384, 1024, 0) == 1025
    assert row_keys(300, 1024, 0) == 300
    assert row_keys(16384, -1, 0) == 16384 and row_keys(16384, 8, -1) == 16384


def test_explain_runs_nothing_and_records_nothing(rng):
    flashtile.explain(*inputs(rng))
    assert flashtile.stats() == {"calls": {}, "kernels": {}, "fallbacks": {}, "device_errors": []}


def test_explain_unsupported_feature_names_it_for_every_backend(rng, monkeypatch):
    from flashtile.backends import torch_tiled
    from flashtile.backends import triton as triton_backend

    for module in (torch_tiled, triton_backend):  # every backend implements softcap: take it away
        monkeypatch.setattr(module, "FEATURES", module.FEATURES - {"softcap"})
    report = flashtile.explain(*inputs(rng), softcap=30.0)
    assert report.backend is None
    assert "softcap=30.0" in report.error and "not implemented" in report.error
    assert set(report.rejected) == {"triton", "torch"}
    assert all("softcap=30.0" in why for why in report.rejected.values())
    assert "cannot run this call" in str(report)


def test_explain_invalid_call_reports_the_validation_error(rng):
    q, k, v = inputs(rng)
    report = flashtile.explain(q, k, v[:, :30])
    assert report.backend is None and "k and v must have the same batch, seqlen and nheads" in report.error


@cpu_only
def test_explain_bf16_under_the_interpreter_is_a_fallback_naming_the_reason(rng):
    q, k, v = inputs(rng, dtype=torch.bfloat16)
    report = flashtile.explain(q, k, v)
    assert report.backend == "torch" and report.fallback
    assert "bfloat16" in report.fallback_reason and "FALLBACK" in str(report)


@cpu_only
def test_bf16_call_under_the_interpreter_runs_on_torch_and_is_recorded(rng):
    with pytest.warns(RuntimeWarning, match="bfloat16"):
        flashtile.flash_attn_func(*inputs(rng, dtype=torch.bfloat16))
    snapshot = flashtile.stats()
    assert snapshot["calls"] == {"torch": 1}
    assert list(snapshot["fallbacks"]) == ["Triton's interpreter computes bfloat16 wrongly (numpy has no bfloat16)"]


def test_disabled_preferred_backend_is_a_fallback(rng):
    with disable_backends("triton"):
        report = flashtile.explain(*inputs(rng))
        assert report.backend == "torch" and "disabled" in report.fallback_reason
        with pytest.warns(RuntimeWarning, match="disabled"):
            flashtile.flash_attn_func(*inputs(rng))
    assert flashtile.stats()["calls"] == {"torch": 1}


def test_disable_backends_from_the_environment(rng, monkeypatch):
    monkeypatch.setenv("FLASHTILE_DISABLE_BACKENDS", "triton")
    assert flashtile.explain(*inputs(rng)).backend == "torch"


def test_every_backend_disabled_is_an_error_naming_each(rng):
    with disable_backends("triton", "torch"), pytest.raises(RuntimeError, match=r"no flashtile backend.*triton: disabled.*torch: disabled"):
        flashtile.flash_attn_func(*inputs(rng))


def test_strict_mode_raises_with_the_reason(rng):
    flashtile.set_strict(True)
    with disable_backends("triton"), pytest.raises(flashtile.FallbackError, match="strict mode.*disabled"):
        flashtile.flash_attn_func(*inputs(rng))
    assert flashtile.stats()["calls"] == {}
    flashtile.set_strict(False)
    with disable_backends("triton"), pytest.warns(RuntimeWarning):
        flashtile.flash_attn_func(*inputs(rng))


def test_strict_mode_from_the_environment(rng, monkeypatch):
    monkeypatch.setenv("FLASHTILE_STRICT", "1")
    with disable_backends("triton"), pytest.raises(flashtile.FallbackError):
        flashtile.flash_attn_func(*inputs(rng))


def test_strict_mode_lets_preferred_calls_through(rng):
    flashtile.set_strict(True)
    flashtile.flash_attn_func(*inputs(rng))
    assert flashtile.stats()["calls"] == {"triton": 1}


def test_each_fallback_reason_warns_once(rng):
    with disable_backends("triton"):
        with pytest.warns(RuntimeWarning):
            flashtile.flash_attn_func(*inputs(rng))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            flashtile.flash_attn_func(*inputs(rng))
    assert list(flashtile.stats()["fallbacks"].values()) == [2]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_kernels_are_counted_forward_and_backward(rng, backend):
    q, k, v = inputs(rng, requires_grad=True)
    with force_backend(backend):
        report = flashtile.explain(q, k, v, causal=True)
        flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert flashtile.stats()["kernels"] == {report.kernel: 2, report.backward_kernel: 1}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_profiler_trace_names_the_kernels_that_ran(rng, backend):
    q, k, v = inputs(rng, requires_grad=True)
    with force_backend(backend):
        report = flashtile.explain(q, k, v, causal=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
            flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
    names = {event.name for event in trace.events()}
    assert report.kernel in names and report.backward_kernel in names
    assert f"flashtile.fwd[{backend} d=64 causal" in report.kernel


@pytest.mark.parametrize("case, one_pass", [
    ("plain", True), ("causal", True), ("window", True), ("softcap", True), ("sink", True), ("alibi", True),
    ("alibi-causal", True), ("alibi-two-sided", False), ("gqa-4", True), ("deterministic", False), ("few-ctas", False), ("dropout", False), ("fp32", False),
    ("head-dim-64", True), ("head-dim-64-short", False), ("head-dim-96", False), ("varlen", True),
    ("varlen-softcap", True),
    ("ampere", False),
    ("d192-128", True), ("d192-128-varlen-softcap", True), ("d192-128-alibi-two-sided", True),
    ("d192-128-deterministic", False), ("d192-128-few-ctas", False), ("d192-192", True), ("d256", True),
    ("d256-varlen-softcap", True), ("d256-alibi-two-sided", True), ("d256-gqa-4", True), ("d256-deterministic", False),
    ("d256-few-ctas", False),
])
def test_one_pass_backward_where_it_serves(monkeypatch, case, one_pass):
    """The one-pass Hopper backward takes 16-bit calls at head dim 128 (packed sequences, windows, softcap, sinks;
    ALiBi unless a right bound lies past the diagonal) whose 128-key CTAs fill the SMs, unless deterministic, and
    at head dim 64 those of 2^28+ visible pairs (1 x 4096 causal on 16 heads has 2^27); the wide kernel takes
    192/128, 192/192 and 256 (ALiBi with any window) once its 64-key CTAs fill the SMs; the rest keep the pair."""
    from dataclasses import replace

    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (8, 0) if case == "ampere" else (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    wide = case.startswith(("d192-128", "d256-"))
    kind = case.removeprefix("d192-128-").removeprefix("d256-") if wide else case
    features = {"window": ("window",), "softcap": ("softcap",), "sink": ("sink",), "alibi": ("alibi",),
                "alibi-causal": ("alibi",), "alibi-two-sided": ("alibi", "window"), "dropout": ("dropout",),
                "varlen": ("varlen",), "varlen-softcap": ("varlen", "softcap")}.get(kind, ())
    head_dim, head_dim_v = {"head-dim-64": (64, 64), "head-dim-64-short": (64, 64), "head-dim-96": (96, 96),
                            "d192-192": (192, 192)}.get(case, (256, 256) if case.startswith("d256") else
                                                         (192, 128) if wide else (128, 128))
    if head_dim_v != head_dim:
        features += ("headdim_v",)
    call = AttentionCall(cuda, torch.float32 if case == "fp32" else torch.bfloat16,
                         1 if kind in ("few-ctas", "head-dim-64-short") else 4,
                         4096, 4096, 16, 4 if kind == "gqa-4" else 16, head_dim,
                         kind not in ("plain", "alibi", "alibi-two-sided", "d192-128"),
                         tuple((name, f"{name}: test") for name in features),
                         window={"window": (1024, 0), "alibi-two-sided": (512, 512)}.get(
                             kind, (-1, -1 if kind in ("plain", "alibi", "d192-128") else 0)),
                         softcap=30.0 if "softcap" in kind else 0.0, headdim_v=head_dim_v)
    if kind == "deterministic":
        call = replace(call, deterministic=True)
    if case == "few-ctas":
        call = replace(call, nheads=4, nheads_kv=4)  # 32 key blocks x 4 heads: 128 CTAs for 132 SMs
    if case in ("d192-128-few-ctas", "d256-few-ctas"):
        call = replace(call, nheads=2, nheads_kv=2)  # 64 key blocks x 2 heads: 128 CTAs for 132 SMs
    _, bwd_name, config = triton_backend.describe(call)
    assert ("one-pass" in bwd_name) == one_pass, bwd_name
    assert ("bwd_one_pass" in config) == one_pass, config
    assert ("gluon-sm90-wide" in bwd_name) == (one_pass and head_dim in (192, 256)), bwd_name


@pytest.mark.parametrize("features, window, keys", [
    ((), (-1, -1), 96), ((), (-1, 0), 96), (("sink",), (-1, 0), 96), (("window",), (1024, 0), 64),
    (("softcap",), (-1, 0), 64), (("alibi",), (-1, 0), 64)], ids=["full", "causal", "causal-sink", "window",
                                                                   "softcap", "alibi"])
def test_packed_192_128_takes_96_key_ctas(monkeypatch, features, window, keys):
    """Packed 192/128 calls run the 96-key one-pass backward (kernels/bwd_sm90_wide96.py) as dense ones do, except
    with a window (its key loops spill on packed sequences: configs.ONE_PASS_96_APART), softcap or ALiBi, which keep
    the 64-key wide kernel; its name says BN96 (paths.kernel_ids: bwd:one-pass-wide-96), and the SM-fill rule counts
    the CTAs of the kernel that would run, over the longest sequence: 2 sequences of up to 4224 keys on 1 KV head
    fill 88 of 132 SMs with 96-key CTAs and keep the pair, all 132 with 64-key ones and take them."""
    from dataclasses import replace

    from flashtile import paths
    from flashtile.backends import AttentionCall
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.triton import configs
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    names = ("varlen", *features, "headdim_v")
    call = AttentionCall(torch.device("cuda", 0), torch.bfloat16, 8, 4096, 4096, 16, 4, 192, window[1] == 0,
                         tuple((name, f"{name}: test") for name in names), window=window,
                         softcap=30.0 if "softcap" in features else 0.0, headdim_v=128)
    fwd_name, bwd_name, config = triton_backend.describe(call)
    assert "one-pass" in bwd_name and f"BM64xBN{keys}]" in bwd_name, bwd_name
    assert config["bwd_one_pass"] == {"BLOCK_M": 64, "BLOCK_N": keys, "kernel": "gluon-wide"}
    assert paths.kernel_ids(fwd_name, bwd_name)[1] == ("bwd:one-pass-wide-96" if keys == 96 else "bwd:one-pass-wide")
    assert configs.one_pass_keys96(192, 128, frozenset(names) | ({"window"} if window[0] >= 0 else set())) == (
        keys == 96)
    few = replace(call, batch=2, seqlen_q=4224, seqlen_k=4224, nheads=2, nheads_kv=1)
    assert ("one-pass" in triton_backend.describe(few)[1]) == (keys == 64) and -(-4224 // 64) * 2 == 132


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backward(rng, monkeypatch, deterministic):
    """``deterministic`` travels with the call's arguments to the backend's backward."""
    from flashtile.dispatch import get_backend
    module = get_backend(flashtile.explain(*inputs(rng), causal=True).backend)
    seen = []
    original = module.backward

    def spy(dout, q, k, v, out, lse, args, *rest, **kwargs):
        seen.append(args.deterministic)
        return original(dout, q, k, v, out, lse, args, *rest, **kwargs)

    monkeypatch.setattr(module, "backward", spy)
    q, k, v = inputs(rng, requires_grad=True)
    flashtile.flash_attn_func(q, k, v, causal=True, deterministic=deterministic).sum().backward()
    assert seen == [deterministic]
