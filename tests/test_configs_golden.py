"""flashtile/backends/triton/configs.py chooses what it chose when tests/data/configs_golden.json was written.

Every public config function is called over a grid of head dims, dtypes, lengths, windows, features and
devices (CPU, and a CUDA device whose capability and SM count are mocked: Hopper with 132 or 114 SMs, Ampere
and Ada with 108), and every module-level value is recorded. The golden file was written on 900e1c4, before
configs.py's comments became tables, so a layout change that moves a value or a branch fails here; a change of
a chosen config must rewrite the file on purpose:

    PYTHONPATH=. python tests/test_configs_golden.py   # rewrites tests/data/configs_golden.json

``one_pass_bwd``, ``deterministic`` and the ONE_PASS_* values are left out: their rule is being changed on its own.
"""
import dataclasses
import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from flashtile.backends.triton import configs  # noqa: E402

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "configs_golden.json"
# name -> (device, capability, SMs); None: the CPU (interpreter) device.
DEVICES = {"cpu": None, "h100": (9, 0, 132), "h20": (9, 0, 114), "a100": (8, 0, 108), "l40": (8, 9, 142)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (16, 32, 48, 64, 96, 128, 160, 192, 256)
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (192, 128), (256, 256), (96, 96), (128, 64), (256, 128))
SEQLENS = (0, 1, 100, 512, 1000, 2048, 4096, 8192, 16384, 32768)
WINDOWS = ((-1, -1), (-1, 0), (0, 0), (127, 0), (1023, 0), (4095, 0), (8191, 0), (255, 255), (-1, 64), (100, -1))
FEATURES = (frozenset(), frozenset({"window"}), frozenset({"softcap"}), frozenset({"alibi"}), frozenset({"sink"}),
            frozenset({"softcap", "alibi"}), frozenset({"varlen"}), frozenset({"bias"}), frozenset({"dropout"}),
            frozenset({"headdim_v"}), frozenset({"kvcache"}), frozenset({"kvcache", "paged"}),
            frozenset({"window", "softcap", "sink", "varlen"}))


def encode(value):
    """A JSON-able, order-stable form of a config function's result or a module value."""
    if isinstance(value, configs.TileConfig):
        consumers = f" c{value.consumers}" if value.consumers != 2 else ""
        turns = " pingpong" if value.pingpong else ""
        return (f"{value.BLOCK_M}x{value.BLOCK_N} w{value.num_warps} s{value.num_stages} {value.kernel}{consumers}"
                f"{turns}")
    if isinstance(value, configs.BwdConfig):
        return {"dkdv": encode(value.dkdv), "dq": encode(value.dq)}
    if isinstance(value, (frozenset, set)):
        return sorted(encode(v) for v in value)
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def module_values() -> dict:
    """Every module-level constant and table of configs.py."""
    return {name: encode(value) for name, value in sorted(vars(configs).items())
            if not name.startswith(("__", "ONE_PASS"))
            if name.lstrip("_").isupper() or (name.startswith("_") and isinstance(value, (dict, tuple, frozenset)))
            or isinstance(value, (configs.TileConfig, configs.BwdConfig))}


def with_device(name, fn):
    """``fn(device)`` with configs' capability and SM count mocked for ``name``."""
    spec = DEVICES[name]
    saved = configs.capability, configs.sm_count
    try:
        if spec is None:
            device = torch.device("cpu")
        else:
            device = torch.device("cuda")
            configs.capability = lambda d: spec[:2]
            configs.sm_count = lambda d: spec[2]
        return fn(device)
    finally:
        configs.capability, configs.sm_count = saved


def choices() -> dict:
    """Each public function's result for every point of its grid, in grid order."""
    out = {}

    def grid(name, fn, *axes):
        rows = []
        for dev in DEVICES:
            rows += with_device(dev, lambda device: [encode(fn(device, *point)) for point in itertools.product(*axes)])
        out[name] = rows

    def fwd(device, hd, dt, seqlen_k, window, flags, hd_v):
        softcap, bias, dropout = flags
        return configs.fwd_config(hd, DTYPES[dt], device, seqlen_k, *window, softcap=softcap, bias=bias,
                                  head_dim_v=hd_v, dropout=dropout)

    grid("fwd_config", fwd, HEAD_DIMS, DTYPES, SEQLENS, WINDOWS, tuple(itertools.product((False, True), repeat=3)),
         (0, 128))
    grid("bwd_config", lambda device, hd, dt, hd_v, keys, feats: configs.bwd_config(
        hd, DTYPES[dt], device, head_dim_v=hd_v, row_keys=keys, features=feats),
        HEAD_DIMS, DTYPES, (0, 64, 128), SEQLENS, FEATURES)
    grid("gluon_dkdv_config", lambda device, hds, dt, feats: configs.gluon_dkdv_config(
        *hds, DTYPES[dt], device, feats), HEAD_DIM_PAIRS, DTYPES, FEATURES)

    def gluon_fwd(device, hds, dt, rows, seqlen_k, window, feats, softcap, extra):
        keys_per_row, min_pairs, ws = extra
        return configs.gluon_fwd_config(*hds, DTYPES[dt], device, rows, seqlen_k, *window, feats, softcap=softcap,
                                        keys_per_row=keys_per_row, min_pairs=min_pairs, warp_specialized=ws)

    grid("gluon_fwd_config", gluon_fwd, HEAD_DIM_PAIRS, ("bf16", "fp16"), (16, 16 * 4096, 64 * 16384),
         (0, 100, 1000, 2048, 4096, 8192, 16384), WINDOWS[:7], FEATURES, (0.0, 50.0), ((None, None, True), (300, 1, False)))
    grid("gluon_kv_config", lambda device, hds, dt, shape, window, feats, softcap: configs.gluon_kv_config(
        *hds, DTYPES[dt], device, *shape, *window, feats, softcap=softcap),
        HEAD_DIM_PAIRS, ("bf16", "fp32"), ((4, 2048, 32, 10240), (1, 64, 32, 8192), (8, 128, 32, 2048),
                                           (1, 128, 8, 128), (16, 512, 16, 32768)),
        WINDOWS, FEATURES, (0.0, 50.0))
    grid("fixed_row_max", lambda device, softcap, dt, feats: configs.fixed_row_max(softcap, DTYPES[dt], feats),
         (0.0, 1.0, 30.0, 50.0, 51.9, 52.0, 60.0, 100.0), DTYPES, FEATURES)
    grid("row_keys/mean_row_keys", lambda device, n, window: (configs.row_keys(n, *window),
                                                              configs.mean_row_keys(n, *window)), SEQLENS, WINDOWS)
    grid("bwd_kv_plan", lambda device, programs, rows, pairs: configs.bwd_kv_plan(programs, rows, pairs, device),
         (0, 1, 3, 8, 33, 132, 600), (1, 64, 100, 2048, 4096, 8192, 65536), (0, 1 << 20, 16 << 20, 1 << 30))
    grid("bwd_plan", lambda device, shape, window, block_n: configs.bwd_plan(*shape, window, block_n, device),
         ((1, 4, 1, 4096, 4096), (1, 32, 8, 2048, 2048), (4, 16, 16, 4096, 4096), (2, 8, 2, 100, 8192),
          (1, 2, 1, 16384, 16384)), WINDOWS, (32, 64, 128))
    grid("with_gluon_dkdv", lambda device, cfg, gluon, parts: configs.with_gluon_dkdv(
        cfg, gluon, lambda block_n: (parts if block_n == 64 else parts + 1, parts > 1)),
        (configs._BWD_SM90[128], configs._BWD_SM90_LONG[128]), (None, configs._BWD_DKDV_SM90_GLUON), (1, 2, 4))
    grid("dense_takes_decode", lambda device, shape, feats, dt: configs.dense_takes_decode(
        *shape, feats, DTYPES[dt], device),
        ((1, 1, 512, 32, 8), (1, 1, 128, 32, 8), (1, 1, 100, 8, 8), (16, 1, 8192, 32, 8), (1, 4, 8192, 32, 8),
         (1, 8, 8192, 32, 8), (1, 40, 4096, 8, 8), (1, 1, 0, 32, 8), (70000, 1, 512, 8, 1), (64, 1, 1024, 32, 8)),
        FEATURES, DTYPES)
    grid("decode_config", lambda device, hd, dt, rows, page: configs.decode_config(
        hd, DTYPES[dt], device, rows, page), HEAD_DIMS, DTYPES, (1, 4, 16, 17, 32, 33, 128), (0, 16, 64, 256))
    grid("decode_plan", lambda device, hd, dt, shape, splits, page: configs.decode_plan(
        hd, DTYPES[dt], device, *shape, num_splits=splits, page_size=page),
        (64, 128, 256), ("bf16", "fp32"), ((4, 8, 512), (4, 8, 32768), (4, 128, 8192), (16, 8, 1024), (1, 1, 100),
                                           (40, 32, 4096), (4, 1, 131072)), (0, 1, 3, 200), (0, 16, 64, 256))
    grid("decode_plan fp8", lambda device, hd, shape, splits, page: configs.decode_plan(
        hd, torch.bfloat16, device, *shape, num_splits=splits, page_size=page, fp8=True),
        (64, 128, 256), ((4, 8, 512), (4, 128, 32768), (4, 8, 131072), (16, 8, 1024), (40, 32, 4096)), (0, 3),
        (0, 16, 256))
    grid("decode_splits", lambda device, splits, programs, capacity, block_n, gather: configs.decode_splits(
        splits, programs, capacity, device, block_n, gather),
        (0, 1, 7, 500), (1, 8, 32, 132, 1000), (1, 128, 1024, 8192, 131072), (16, 32, 64, 128), (False, True))
    grid("decode_splits min_keys", lambda device, programs, capacity: configs.decode_splits(
        0, programs, capacity, device, 64, min_keys=64), (1, 8, 132), (128, 1024, 8192))
    grid("ws_ctas", lambda device, causal, tiles, sms: configs.ws_ctas(causal, tiles, sms),
         (False, True), (1, 100, 132, 1000), (114, 132))
    grid("gluon_ring", lambda device, cfg, hd: configs.gluon_ring(cfg, hd),
         (configs._FWD_SM90_GLUON, configs._FWD_SM90_GLUON_WIDE, configs._FWD_SM90_GLUON_SLIM,
          configs._FWD_SM90_GLUON_WS, configs._FWD_SM90_GLUON_D256, configs.TileConfig(64, 64, 4, 3, "gluon")),
         (64, 128, 192, 256))
    grid("padded_head_dim", lambda device, hd: configs.padded_head_dim(hd), (1, 8, 16, 17, 48, 64, 65, 96, 128, 129,
                                                                           160, 192, 200, 256))
    grid("sm_count", lambda device: configs.sm_count(device))
    return out


def runs(rows: list) -> dict:
    """``rows`` run-length encoded: the distinct results, and [index of the result, repeats] in grid order."""
    vocab, out = [], []
    for row in rows:
        text = json.dumps(row, sort_keys=True)
        if text not in vocab:
            vocab.append(text)
        index = vocab.index(text)
        if out and out[-1][0] == index:
            out[-1][1] += 1
        else:
            out.append([index, 1])
    return {"results": [json.loads(v) for v in vocab], "runs": out}


def expand(encoded: dict) -> list:
    return [encoded["results"][index] for index, repeats in encoded["runs"] for _ in range(repeats)]


def snapshot() -> dict:
    return {"values": module_values(), "choices": {name: runs(rows) for name, rows in choices().items()}}


def test_configs_choose_what_the_golden_file_holds():
    golden = json.loads(GOLDEN.read_text())
    now = json.loads(json.dumps(snapshot()))
    assert now["values"].keys() == golden["values"].keys()
    for name, value in golden["values"].items():
        assert now["values"][name] == value, f"configs.{name} changed"
    assert now["choices"].keys() == golden["choices"].keys()
    for name, encoded in golden["choices"].items():
        rows, new = expand(encoded), expand(now["choices"][name])
        assert len(new) == len(rows), name
        changed = [i for i, (a, b) in enumerate(zip(new, rows)) if a != b]
        assert not changed, f"{name}: {len(changed)} of {len(rows)} grid points changed, first at index {changed[0]}"


def test_the_grid_reaches_every_branch():
    """The grid is not trivial: each function returns several different configs over it."""
    golden = json.loads(GOLDEN.read_text())["choices"]
    assert len(golden["fwd_config"]["results"]) >= 10
    assert len(golden["gluon_fwd_config"]["results"]) == 8  # None and seven Gluon tiles (d=64: three consumers, ALiBi two)
    assert len(golden["bwd_config"]["results"]) >= 8
    assert len(golden["decode_plan"]["results"]) >= 20


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(snapshot(), separators=(",", ":")) + "\n")
    print(GOLDEN, GOLDEN.stat().st_size, "bytes")
