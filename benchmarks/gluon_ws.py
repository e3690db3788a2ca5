"""The warp-specialized Hopper forward (kernels/fwd_sm90_ws.py) against the one-warpgroup 64x128 tile it
replaces on long rows and against cuDNN (SDPA's backend), in one run: evidence for configs._FWD_SM90_GLUON_WS,
its key floors and its grid (``configs.ws_ctas``: persistent CTAs or a CTA per tile).

Through ``launch.forward(config=...)``, bf16, d=128; each variant is first checked against float32 attention
on the same inputs (two heads), then timed in ``--rounds`` interleaved rounds (CUDA events over 20
back-to-back calls). Reports median and best TFLOP/s of visible pairs.

    python benchmarks/gluon_ws.py --rounds 3 -> $OUT (default /tmp)/h200-gluon-ws-<date>.json
    python benchmarks/gluon_ws.py mods      -> ...-gluon-ws-mods-<date>.json: softcap 50 and ALiBi against
                                               plain on the variants suite's mods shapes
    python benchmarks/gluon_ws.py window [OLD=path] [TILES=64x4,128x2] [GRIDS=persistent]
                                            -> ...-gluon-ws-window-<date>.json: sliding windows on the
                                               dispatched tile against the warp-specialized kernel's key
                                               tiles and grids (and full rows); with OLD,
                                               also the kernel source at that path, interleaved
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile.backends import AttnArgs
from flashtile.backends.triton import configs, launch
from flashtile.bench.variants import visible_pairs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import events_us, kernel_copy, measure_all, rounds_option, save_results  # noqa: E402

# (batch, seqlen, query heads, KV heads, causal, feature: "", "sink", "softcap" (50) or "alibi")
SHAPES = [(b, s, 16, 16, False, "") for b, s in ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))]
SHAPES += [(b, s, 16, 16, True, "") for b, s in ((8, 2048), (4, 4096), (2, 8192), (1, 16384))]
SHAPES += [(4, 4096, 32, 8, False, ""), (4, 4096, 32, 8, True, ""), (1, 16384, 32, 8, True, "")]
SHAPES += [(4, 4096, 16, 16, False, "sink"), (2, 8192, 16, 16, True, "sink")]
# The variants suite's mods shapes (batch x seqlen = 16384): softcap and ALiBi against plain.
MODS = [(b, s, 16, 16, causal, feature) for feature in ("", "softcap", "alibi") for causal in (False, True)
        for b, s in ((4, 4096), (2, 8192))]
# Sliding windows (batch, seqlen, query heads, KV heads, (left, right)): right -1 (full rows, no left bound) or 0.
WINDOWS = [(1, 16384, 16, 16, (1024, 0)), (2, 8192, 16, 16, (1024, 0)), (4, 4096, 32, 8, (1024, 0)),
           (1, 16384, 16, 16, (4096, 0)), (16, 1024, 16, 16, (-1, -1)), (8, 2048, 16, 16, (-1, -1)),
           (4, 4096, 16, 16, (-1, -1)), (2, 8192, 16, 16, (-1, -1))]
WS_TILES = {"64x3": configs.TileConfig(64, 64, 4, 3, kernel="gluon-ws"),
            "64x4": configs.TileConfig(64, 64, 4, 4, kernel="gluon-ws"),
            "128x2": configs.TileConfig(64, 128, 4, 2, kernel="gluon-ws")}
# The grids tried, CTAs from (causal, tiles, SMs): one CTA an SM walking tiles round robin, or a CTA per tile.
SCHEDULES = {
    "ws persistent": lambda causal, tiles, sms: min(tiles, sms),
    "ws per-tile": lambda causal, tiles, sms: tiles,
}


def reference(q, k, v, causal, sink, softcap, slopes, window_left=-1):
    """float32 attention of the first two query heads (``window_left``: keys more than that before a row's
    diagonal are hidden, -1 none)."""
    kv_heads = [0, 1 // (q.shape[2] // k.shape[2])]
    qf = q[:, :, :2].float().transpose(1, 2)
    kf, vf = (t[:, :, kv_heads].float().transpose(1, 2) for t in (k, v))
    s = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        idx = torch.arange(s.shape[-1], device=s.device)
        s = s - slopes[:2].view(1, 2, 1, 1) * (idx[:, None] - idx[None, :]).abs()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if window_left >= 0:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(-window_left - 1),
                          float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink[:2].view(1, 2, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = s.softmax(-1)[..., :kf.shape[2]]
    return (p @ vf).transpose(1, 2)


def measure(batch, seqlen, heads, heads_kv, causal, feature, rounds):
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sink = torch.randn(heads, device="cuda") if feature == "sink" else None
    softcap = 50.0 if feature == "softcap" else 0.0
    slopes = (2.0 ** (-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)) if feature == "alibi" else None
    args = AttnArgs(softmax_scale=128 ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                    sink=sink, softcap=softcap, alibi_slopes=None if slopes is None else slopes.expand(batch, -1))
    rule = configs.ws_ctas

    def run(name):
        if name == "wide":
            return launch.forward(q, k, v, args, config=configs._FWD_SM90_GLUON_WIDE)
        configs.ws_ctas = SCHEDULES[name]
        try:
            return launch.forward(q, k, v, args, config=configs._FWD_SM90_GLUON_WS)
        finally:
            configs.ws_ctas = rule

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=heads != heads_kv)

    providers = {name: (lambda name=name: run(name)) for name in ("wide", *SCHEDULES)}
    if not feature:
        providers["cudnn"] = cudnn
    row = dict(shape=f"{batch}x{seqlen}", heads=f"{heads}/{heads_kv}", mask="causal" if causal else "full",
               feature=feature, rule="per-tile" if rule(causal, 2, 1) == 2 else "persistent")
    expected = reference(q[:1], k[:1], v[:1], causal, sink, softcap, slopes)
    for name in ("wide", *SCHEDULES):
        out, _ = providers[name]()
        row[f"{name} max err"] = float((out[:1, :, :2].float() - expected).abs().max())
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    flops = 4 * batch * heads * 128 * pairs
    times = {name: [] for name in providers}
    for _ in range(rounds):
        for name, fn in providers.items():
            times[name].append(events_us(fn))
    row["us"] = {name: [round(t, 1) for t in ts] for name, ts in times.items()}
    row["median TFLOP/s"] = {name: round(flops / sorted(ts)[len(ts) // 2] / 1e6) for name, ts in times.items()}
    row["best TFLOP/s"] = {name: round(flops / min(ts) / 1e6) for name, ts in times.items()}
    return row


def old_launch(path: str):
    """The warp-specialized launch with the kernel source at ``path``."""
    from flashtile.backends.triton.fastlaunch import CachedLaunch
    module = kernel_copy(path, "_fwd_sm90_ws_old")
    return CachedLaunch(module.attn_fwd_sm90_ws, launch._FWD_SM90_WS.dynamic_names)


def measure_window(batch, seqlen, heads, heads_kv, window, rounds, old=None, tiles=tuple(WS_TILES),
                   grids=("persistent", "per-tile")):
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = AttnArgs(softmax_scale=128 ** -0.5, causal=window[1] == 0, window_left=window[0], window_right=window[1])
    rule = configs.ws_ctas
    new = launch._FWD_SM90_WS

    def run(name):
        if name == "dispatch":
            return launch.forward(q, k, v, args)
        version, tile, grid = name.split(" ")
        configs.ws_ctas = SCHEDULES["ws " + grid]
        launch._FWD_SM90_WS = old if version == "old" else new
        try:
            return launch.forward(q, k, v, args, config=WS_TILES[tile])
        finally:
            configs.ws_ctas = rule
            launch._FWD_SM90_WS = new

    versions = ("new", "old") if old is not None else ("new", )
    names = ["dispatch"] + [f"{version} {tile} {grid}" for tile in tiles for grid in grids for version in versions]
    row = dict(shape=f"{batch}x{seqlen}", heads=f"{heads}/{heads_kv}", mask=f"window {window}")
    expected = reference(q[:1], k[:1], v[:1], window[1] == 0, None, 0.0, None, window[0])
    for name in names:
        out, _ = run(name)
        row[f"{name} max err"] = float((out[:1, :, :2].float() - expected).abs().max())
    flops = 4 * batch * heads * 128 * visible_pairs(seqlen, window[1] == 0, window[0])
    times = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            times[name].append(events_us(lambda: run(name)))
    row["us"] = {name: [round(t, 1) for t in ts] for name, ts in times.items()}
    row["median us"] = {name: round(sorted(ts)[len(ts) // 2], 1) for name, ts in times.items()}
    row["median TFLOP/s"] = {name: round(flops / sorted(ts)[len(ts) // 2] / 1e6) for name, ts in times.items()}
    return row


if __name__ == "__main__":
    if "window" in sys.argv[1:]:
        command = " ".join(["python benchmarks/gluon_ws.py"] + sys.argv[1:])
        sys.argv.remove("window")
        options = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("--"))
        sys.argv = [a for a in sys.argv if "=" not in a or a.startswith("--")]
        old = old_launch(options["OLD"]) if "OLD" in options else None
        picks = dict(tiles=options.get("TILES", ",".join(WS_TILES)).split(","),
                     grids=options.get("GRIDS", "persistent,per-tile").split(","))
        rounds = rounds_option(3)
        rows = measure_all(lambda *shape: measure_window(*shape, rounds, old, **picks), WINDOWS)
        save_results("gluon-ws-window", rows, command)
        for row in rows:
            print(f"{row['shape']:>9} {row['heads']:>5} {row['mask']:>18}",
                  " ".join(f"{name}={tf}" for name, tf in row["median TFLOP/s"].items()))
            print(" " * 35, " ".join(f"{name} err={row[name + ' max err']:.4f}" for name in row["median us"]))
        sys.exit(0)
    mods = "mods" in sys.argv[1:]
    if mods:
        sys.argv.remove("mods")
    rounds = rounds_option(3)
    rows = measure_all(lambda *shape: measure(*shape, rounds), MODS if mods else SHAPES)
    save_results("gluon-ws-mods" if mods else "gluon-ws", rows,
                 f"python benchmarks/gluon_ws.py{' mods' if mods else ''} --rounds {rounds}")
    for row in rows:
        print(f"{row['shape']:>9} {row['heads']:>5} {row['mask']:>6} {row['feature']:7}",
              " ".join(f"{name}={tf}" for name, tf in row["median TFLOP/s"].items()))
