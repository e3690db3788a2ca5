"""Decode rows: one new query token per sequence against a KV cache of ``L`` tokens.

Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head dim 128), every sequence of
the batch at the same cache length. Providers and layouts:

- ``flashtile``: ``flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...,
  block_table=..., causal=True, num_splits=0)`` (flash-attn's signature) on the contiguous cache
  ``(B, L, Hkv, D)`` and on paged caches ``(num_blocks, page_size, Hkv, D)`` with page sizes 16 and
  256, the pages of each sequence scattered in a random order. Marked ``n/a`` until the function
  exists.
- ``flash_attn``: ``flash_attn.flash_attn_with_kvcache``, the same calls, when installed.
- ``cudnn``, ``flash``, ``efficient``, ``math``: torch SDPA with ``enable_gqa=True`` under that
  backend, on ``(B, Hkv, L, D)`` contiguous copies of the cache (what a server built on SDPA would
  store); no mask: with one query, torch's top-left causal mask would hide every key but the first.

Time per step is the median of CUDA-event times (L2 flushed before each run), host overhead
included: a step launched from Python is what a server pays. The ``graph`` columns replay the
same call captured in a ``torch.cuda.CUDAGraph``, which takes the host out. Achieved bandwidth is
the K and V bytes one step must read over its time, and its fraction of the ceiling
(:data:`common.H200_COPY_TBPS`, the H200's measured copy bandwidth).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import time
from typing import Callable, NamedTuple

import torch

from . import common, gpu, providers, validate

HEADS, KV_HEADS, HEADDIM = 32, 8, 128
LAYOUTS = {"contiguous": None, "paged16": 16, "paged256": 256}
PROVIDERS = ("flashtile", "flash_attn", "cudnn", "flash", "efficient", "math")
PAGED_PROVIDERS = ("flashtile", "flash_attn")  # SDPA has no paged cache
REF_BATCH = 2  # the reference covers the first sequences of the batch


class DecodeShape(NamedTuple):
    batch: int
    cache_len: int
    nheads: int = HEADS
    nheads_kv: int = KV_HEADS
    headdim: int = HEADDIM
    dtype: str = "bf16"

    def key(self, provider: str, layout: str) -> dict:
        return {"prov": provider, "layout": layout, "page_size": LAYOUTS[layout], "dtype": self.dtype,
                "B": self.batch, "L": self.cache_len, "H": self.nheads, "Hkv": self.nheads_kv, "D": self.headdim}

    def bytes(self) -> int:
        elt = torch.finfo(common.DTYPES[self.dtype]).bits // 8
        return common.decode_bytes(self.batch, self.cache_len, self.nheads_kv, self.headdim, self.headdim, elt)


def bandwidth_ceiling_tbps(gpu_name: str | None) -> float | None:
    """The measured copy bandwidth of ``gpu_name`` in TB/s, where we have one (the H200)."""
    return common.H200_COPY_TBPS if gpu_name and "H200" in gpu_name.upper() else None


def cells(shapes, layouts, chosen) -> list[tuple[DecodeShape, str, str]]:
    """Every (shape, provider, layout) to measure, in order; SDPA providers on the contiguous cache only."""
    out = []
    for shape in shapes:
        for prov in PROVIDERS:
            if prov not in chosen:
                continue
            for layout in layouts:
                if layout == "contiguous" or prov in PAGED_PROVIDERS:
                    out.append((shape, prov, layout))
    return out


def make_cache(shape: DecodeShape, device) -> dict:
    """Seeded q ``(B, 1, H, D)`` and contiguous K/V caches ``(B, L, Hkv, D)``, all full (``cache_seqlens = L``);
    paged copies and the SDPA layout are made on first use."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = common.DTYPES[shape.dtype]
    q = torch.randn((shape.batch, 1, shape.nheads, shape.headdim), generator=gen, device=device, dtype=dtype)
    kv_shape = (shape.batch, shape.cache_len, shape.nheads_kv, shape.headdim)
    k, v = (torch.randn(kv_shape, generator=gen, device=device, dtype=dtype) for _ in range(2))
    seqlens = torch.full((shape.batch,), shape.cache_len, dtype=torch.int32, device=device)
    return {"q": q, "k": k, "v": v, "cache_seqlens": seqlens, "paged": {}, "bhsd": None}


def paged_cache(cache: dict, page_size: int):
    """``(k_pages, v_pages, block_table)``: ``(num_blocks, page_size, Hkv, D)`` pools and an int32
    ``(B, pages per sequence)`` table; page ``i`` of sequence ``b`` sits in block ``block_table[b, i]``,
    the blocks in a random (seeded) order, as a server's allocator leaves them."""
    if page_size not in cache["paged"]:
        k, v = cache["k"], cache["v"]
        batch, length = k.shape[:2]
        per_seq = math.ceil(length / page_size)
        order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(1)).to(k.device)

        def scatter(x):
            padded = x
            if per_seq * page_size != length:
                padded = x.new_zeros((batch, per_seq * page_size, *x.shape[2:]))
                padded[:, :length] = x
            pool = x.new_empty((batch * per_seq, page_size, *x.shape[2:]))
            pool[order] = padded.reshape(batch * per_seq, page_size, *x.shape[2:])
            return pool

        table = order.view(batch, per_seq).to(torch.int32)
        cache["paged"][page_size] = (scatter(k), scatter(v), table)
    return cache["paged"][page_size]


def _kvcache_call(fn: Callable, cache: dict, layout: str) -> Callable:
    """``fn(q, k_cache, v_cache, cache_seqlens=..., [block_table=...], causal=True, num_splits=0)``."""
    k, v, table = cache["k"], cache["v"], None
    if LAYOUTS[layout]:
        k, v, table = paged_cache(cache, LAYOUTS[layout])
    kwargs = {"cache_seqlens": cache["cache_seqlens"], "causal": True}
    if table is not None:
        kwargs["block_table"] = table
    try:
        if "num_splits" in inspect.signature(fn).parameters:
            kwargs["num_splits"] = 0  # 0: the implementation picks the split count
    except (TypeError, ValueError):  # a builtin without a signature: flash-attn's default is 0 anyway
        pass
    q = cache["q"]
    return lambda: fn(q, k, v, **kwargs)


def build(prov: str, cache: dict, layout: str) -> providers.Provider:
    """The provider's decode step (``Provider.fwd``), with its scope and output layout."""
    if prov == "flashtile":
        import flashtile

        fn = getattr(flashtile, "flash_attn_with_kvcache", None)
        if fn is None:
            raise common.Unavailable("flashtile.flash_attn_with_kvcache is not implemented yet")
        return providers.Provider(_kvcache_call(fn, cache, layout), (), None, contextlib.nullcontext(), False)
    if prov == "flash_attn":
        try:
            module = importlib.import_module("flash_attn")
        except ImportError as exc:
            raise common.Unavailable(f"flash_attn is not installed ({type(exc).__name__})") from None
        call = _kvcache_call(module.flash_attn_with_kvcache, cache, layout)
        return providers.Provider(call, (), None, contextlib.nullcontext(), False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if layout != "contiguous":
        raise common.Unsupported(f"{prov}: torch SDPA has no paged KV cache")
    if cache["bhsd"] is None:
        cache["bhsd"] = tuple(x.transpose(1, 2).contiguous() for x in (cache["q"], cache["k"], cache["v"]))
    qt, kt, vt = cache["bhsd"]
    call = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
    return providers.Provider(call, (), None, sdpa_kernel(getattr(SDPBackend, providers.SDPA_BACKENDS[prov])), True)


def _output(out, heads_first: bool) -> torch.Tensor:
    """A provider's output as ``(B, 1, H, D)`` (flash-attn style APIs may return ``(out, lse)``)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.transpose(1, 2) if heads_first else out


def capture_graph(fn: Callable) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first, as capture requires).

    A call that synchronizes the host cannot be captured, and a failed capture can leave the stream
    in a bad state; so the call first runs once with torch's sync debug mode set to raise, which
    names the offending operation instead."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        raise RuntimeError(f"not capturable: the call synchronizes with the host ({exc})") from None
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def measure(prov: str, cache: dict, shape: DecodeShape, layout: str, timer, reference=None, profile: bool = False,
            graphs: bool = True, ceiling_tbps: float | None = None) -> dict:
    """One decode cell: time per step (and per graph replay), bandwidth, error, kernels; failures as text."""
    row = shape.key(prov, layout)
    try:
        p = build(prov, cache, layout)
    except Exception as exc:  # noqa: BLE001 - not available / not supported: a marked cell
        row["err"] = common.describe_error(exc)
        return row
    cuda = cache["q"].is_cuda
    with torch.no_grad(), p.scope:
        try:
            start = time.perf_counter()
            out = _output(p.fwd(), p.heads_first)
            common.synchronize(out.device)
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            if reference is not None:
                try:
                    row.update(validate.verdict({"out": out[: reference.hi["out"].shape[0]]}, reference))
                    row["ref_batch"] = reference.hi["out"].shape[0]
                except Exception as exc:  # noqa: BLE001 - a check that cannot run is no pass
                    row["invalid"] = f"check failed: {common.describe_error(exc)}"
            del out
            if not row.get("invalid"):
                row.update(common.timing_fields("step", timer(p.fwd)))
        except Exception as exc:  # noqa: BLE001
            row["err"] = common.describe_error(exc)
        if row.get("invalid"):
            graphs = profile = False
        if "err" not in row and profile:
            try:
                row.update(common.kernel_proof(p.fwd, cuda))
            except Exception as exc:  # noqa: BLE001
                row["profile_err"] = common.describe_error(exc)
        if "err" not in row and graphs:
            if not cuda:
                row["graph_err"] = "Unavailable: CUDA graphs need a CUDA device"
            else:
                graph = None
                try:
                    graph = capture_graph(p.fwd)
                    row.update(common.timing_fields("graph", timer(graph.replay)))
                except Exception as exc:  # noqa: BLE001
                    row["graph_err"] = common.describe_error(exc)
                del graph
    add_rates(row, shape, ceiling_tbps)
    gpu._free_cuda()
    return row


def add_rates(row: dict, shape: DecodeShape, ceiling_tbps: float | None) -> None:
    """Achieved GB/s of the K/V read, and its fraction of the bandwidth ceiling, for steps and graph replays."""
    for prefix in ("step", "graph"):
        rate = common.gbps(shape.bytes(), row.get(f"{prefix}_ms"))
        if rate is not None:
            row[f"{prefix}_GBps"] = rate
            if ceiling_tbps:
                row[f"{prefix}_frac_peak"] = rate / (ceiling_tbps * 1e3)


def reference(cache: dict) -> validate.Reference:
    """Both sides of the tolerance rule for the output of the first :data:`REF_BATCH` sequences, ``(b, 1, H, D)``:
    fp32 (fp64 on CPU) attention and the same in the cache's dtype."""
    b = min(REF_BATCH, cache["q"].shape[0])
    return validate.output_reference(cache["q"][:b], cache["k"][:b], cache["v"][:b], heads=cache["q"].shape[2])


def run(shapes, layouts, chosen, device, timer, check: bool, on_row: Callable, graphs: bool = True,
        ceiling_tbps: float | None = None) -> list[dict]:
    """Every decode cell; ``on_row(label, row)`` after each. Kernel names are recorded for every cell."""
    rows = []
    todo = cells(shapes, layouts, chosen)
    for shape in dict.fromkeys(s for s, _, _ in todo):
        mine = [(prov, layout) for s, prov, layout in todo if s == shape]
        try:
            cache = make_cache(shape, device)
            ref = reference(cache) if check else None
        except Exception as exc:  # noqa: BLE001
            label = common.describe_error(exc)
            for prov, layout in mine:
                rows.append({**shape.key(prov, layout), "err": label})
                on_row(label_of(rows[-1]), rows[-1])
            gpu._free_cuda(collect=True)
            continue
        for prov, layout in mine:
            try:
                row = measure(prov, cache, shape, layout, timer, ref, profile=True, graphs=graphs,
                              ceiling_tbps=ceiling_tbps)
            except Exception as exc:  # noqa: BLE001 - e.g. a cleanup after a broken CUDA context
                row = {**shape.key(prov, layout), "err": common.describe_error(exc)}
            rows.append(row)
            on_row(label_of(row), row)
        del cache
        gpu._free_cuda(collect=True)
    return rows


def label_of(row: dict) -> str:
    return f"decode B={row['B']} L={row['L']} {row['layout']} {row['prov']}"


def progress_text(row: dict) -> str:
    if row.get("err"):
        return f"failed: {row['err']}"
    if row.get("invalid"):
        return f"INVALID, not timed: {row['invalid']}"
    text = f"{row['step_ms'] * 1e3:.1f} us/step {row.get('step_GBps', 0):.0f} GB/s"
    if row.get("graph_ms"):
        text += f"; graph {row['graph_ms'] * 1e3:.1f} us"
    elif row.get("graph_err"):
        text += f"; graph failed: {row['graph_err']}"
    if row.get("max_abs_err") is not None:
        text += f", err {row['max_abs_err']:.1e}"
    return text
