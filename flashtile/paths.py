"""Every kernel path the dispatcher can choose, and a set of calls that runs each one (the GPU suite's map).

A *path* is what :func:`flashtile.backends.triton.describe` names for a call: the forward kernel and its tile, the
backward's kernels (the one-pass kernel, or the dK/dV + dQ pair with its tiles, split parts and stream), each with
the head-dim family, MHA or GQA, dense or packed, and each feature that switches the kernel's code. The atoms of a
call are those facts, one per (kernel, property); :data:`SWEEP` asks the dispatcher about a grid of calls (head dims,
dtypes, lengths, batch and head counts, masks, features, KV caches), and :data:`CASES` is a small set of calls whose
atoms cover every atom of the sweep. ``tests/test_paths.py`` checks the cover on the CPU (so a new path the
dispatcher can take fails CI until a case runs it) and runs every case on a Hopper GPU at its real lengths.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch

# Softcap's value in the cases (below 51.9, where the Hopper forward holds the row max fixed on long bf16 rows).
SOFTCAP = 30.0


@dataclass(frozen=True)
class Case:
    """One call: ``(batch, seqlen_q, seqlen_k, nheads, nheads_kv)``, head dims of q/k and of v, dtype, ``mask``
    (``"full"``, ``"causal"`` or a window ``"L,R"``), the optional ``features`` it uses (softcap, alibi, sink, bias,
    dropout, varlen, deterministic), and ``cache``: ``""`` for attention, ``"contiguous"`` or ``"paged"`` for
    ``flash_attn_with_kvcache`` over a full cache of ``seqlen_k`` keys (no backward)."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int = 128
    headdim_v: int = 128
    dtype: str = "bfloat16"
    mask: str = "full"
    features: tuple = ()
    cache: str = ""

    @property
    def window(self) -> tuple:
        if self.mask == "full":
            return (-1, -1)
        if self.mask == "causal":
            return (-1, 0)
        left, right = self.mask.split(",")
        return int(left), int(right)

    @property
    def pairs(self) -> int:
        """(query, key) pairs over all heads: what a case costs."""
        return self.batch * self.nheads * self.seqlen_q * self.seqlen_k

    def call(self, device: torch.device):
        """The dispatcher's view of this case (:class:`flashtile.backends.AttentionCall`)."""
        from .backends import AttentionCall

        left, right = self.window
        causal = self.mask == "causal"
        features = [(name, name) for name in ("dropout",) if name in self.features]
        if self.mask not in ("full", "causal"):
            features.append(("window", "window"))
        features += [(name, name) for name in ("softcap", "alibi", "sink", "bias") if name in self.features]
        if self.cache:
            features.append(("kvcache", "kvcache"))
            if self.cache == "paged":
                features.append(("paged", "paged"))
        if "varlen" in self.features:
            features.append(("varlen", "varlen"))
        if self.headdim_v != self.headdim:
            features.append(("headdim_v", "headdim_v"))
        return AttentionCall(device, getattr(torch, self.dtype), self.batch, self.seqlen_q, self.seqlen_k,
                             self.nheads, self.nheads_kv, self.headdim, causal, tuple(features),
                             headdim_v=self.headdim_v, page_size=256 if self.cache == "paged" else 0,
                             window=(left, 0 if causal else right),
                             softcap=SOFTCAP if "softcap" in self.features else 0.0,
                             deterministic="deterministic" in self.features)


def kernel_ids(fwd_name: str, bwd_name: str) -> tuple:
    """The kernels a call's profiler names say run: the forward's label and tile, and the backward's (the one-pass
    kernel, wide or not; or the pair's dK/dV label and tile, whether split, the dQ tile and whether alongside)."""
    fwd = re.match(r"flashtile\.(fwd|decode)\[(\S+) ", fwd_name)
    tile = re.search(r"BM=(\d+) BN=(\d+)\]", fwd_name)
    fwd_id = f"{fwd.group(1)}:{fwd.group(2)} {tile.group(1)}x{tile.group(2)}"
    if not bwd_name:
        return fwd_id, None
    if "one-pass" in bwd_name:
        keys96 = "-96" if "xBN96]" in bwd_name else ""
        return fwd_id, f"bwd:one-pass-wide{keys96}" if "gluon-sm90-wide" in bwd_name else "bwd:one-pass"
    dkdv = re.search(r"dkdv=((?:\S+ )?)BM(\d+)xBN(\d+)", bwd_name)
    dq = re.search(r"dq=BM(\d+)xBN(\d+)", bwd_name)
    label = dkdv.group(1).strip() or "triton"
    parts = " parts" if " parts=" in bwd_name else ""
    stream = "+stream" if "+stream" in bwd_name else ""
    return fwd_id, f"bwd:{label} {dkdv.group(2)}x{dkdv.group(3)}{parts} dq {dq.group(1)}x{dq.group(2)}{stream}"


def atoms(case: Case, device: torch.device) -> frozenset:
    """What running ``case`` tests: each kernel with the head-dim family, dtype, MHA/GQA and dense/packed, and
    each kernel with each feature and mask kind the call uses."""
    from .backends import triton as backend

    fwd_name, bwd_name, _ = backend.describe(case.call(device))
    shape = (f"d{case.headdim}/{case.headdim_v}", case.dtype, "gqa" if case.nheads != case.nheads_kv else "mha",
             "packed" if "varlen" in case.features else "dense")
    mask = "window" if case.mask not in ("full", "causal") else case.mask
    result = set()
    for kernel in kernel_ids(fwd_name, bwd_name):
        if kernel is None:
            continue
        if case.dtype == "float32":
            # The float32 kernels are the 16-bit ones' Triton source on FMA dots; a call's kernels take 8-10 s to
            # compile for sm_90 at d=96 (bf16 1-3 s), ~50 s a case in the GPU suite. Each kernel at each head-dim
            # family, and each with MHA/GQA x dense/packed at some head dim: not the full product.
            result.update({(kernel, *shape[:2]), (kernel, *shape[1:])})
        else:
            result.add((kernel, *shape))
        result.update((kernel, feature) for feature in (mask, *case.features))
    return frozenset(result)


def sweep() -> list:
    """The grid of calls the dispatcher is asked about: every head-dim family and dtype, short to long rows, few
    and many programs, MHA and GQA, each mask and feature alone, packed sequences, decode-shaped calls and KV
    caches."""
    head_dims = [(32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
    shapes = [(b, s, s, h, hkv) for s in (256, 1024, 4096, 16384) for b in (1, 8) for h, hkv in ((2, 2), (16, 16),
                                                                                               (16, 4))]
    shapes += [(b, sq, sk, 32, 8) for b in (1, 16) for sq in (1, 16) for sk in (4096, 32768)]
    masks = ["full", "causal", "1024,0", "255,63"]
    features = [(), ("softcap",), ("alibi",), ("sink",), ("bias",), ("dropout",), ("varlen",), ("deterministic",)]
    cases = [Case(*shape, d, dv, dtype, mask, feature)
             for (d, dv), dtype, shape, mask, feature in itertools.product(
                 head_dims, ("bfloat16", "float32"), shapes, masks, features)
             if not (feature == ("bias",) or feature == ("dropout",)) or shape[1] * shape[2] <= 4096 * 4096]
    caches = [Case(b, sq, sk, 32, 8, d, d, "bfloat16", mask, feature, cache)
              for (d, _) in head_dims for b, sq, sk in ((1, 1, 32768), (16, 1, 4096), (4, 16, 4096), (1, 1024, 8192))
              for mask in ("causal", "1024,0") for feature in ((), ("softcap",), ("alibi",), ("sink",))
              for cache in ("contiguous", "paged")]
    return cases + caches


# Long MHA rows at head dim 128 on few heads: the one-pass backward where the pair would have split its key blocks
# (the plan that once summed never-written parts over its dK/dV), with each feature, keys not a multiple of 128.
ONE_PASS_LONG = [
    Case(1, 8192, 8192, 4, 4, mask="full"),
    Case(1, 8192, 8192, 4, 4, mask="causal"),
    Case(1, 4096, 4157, 4, 4, mask="causal", features=("softcap",)),
    Case(1, 4096, 4157, 4, 4, mask="causal", features=("alibi",)),
    Case(1, 4096, 4157, 4, 4, mask="causal", features=("sink",)),
    Case(1, 8192, 8192, 4, 4, mask="full", features=("sink",)),
]
# Chosen greedily from the sweep (most uncovered atoms per pair first) and held fixed here, so that a change of the
# dispatcher that adds a path fails tests/test_paths.py until a case for it is added.
CASES = ONE_PASS_LONG + [
    # The warp-specialized forward at head dim 256 (one Q buffer), and the 96-key one-pass backward at 192/128 with
    # a window; the wide backward's sink at 256.
    Case(1, 16, 32768, 32, 8, 256, 256, "bfloat16", "full", ("sink",)),
    Case(1, 16, 32768, 32, 8, 256, 256, "bfloat16", "full", ("deterministic",)),
    Case(1, 16384, 16384, 2, 2, 256, 256, "bfloat16", "causal", ("softcap",)),
    Case(1, 1, 4096, 32, 8, 192, 128, "bfloat16", "1024,0"),
    # The one-pass backward at head dim 64 (calls of 2^28+ visible pairs), MHA and GQA, dense and packed.
    Case(1, 4096, 4096, 16, 16, 64, 64, "bfloat16", "full"),
    Case(2, 4096, 4096, 16, 4, 64, 64, "bfloat16", "causal", ("sink",)),
    Case(1, 8192, 8192, 16, 16, 64, 64, "bfloat16", "causal", ("varlen",)),
    Case(4, 4096, 4096, 16, 4, 64, 64, "bfloat16", "causal", ("alibi", "varlen")),
    Case(2, 8192, 8192, 16, 16, 64, 64, "bfloat16", "1024,0", ("softcap",)),
    # The wide one-pass backward (d192/128): a long causal row whose keys end mid-CTA, then the greedy picks.
    Case(2, 4096, 4157, 16, 16, 192, 128, "bfloat16", "causal"),
    Case(8, 256, 256, 16, 16, 192, 128, "bfloat16", "1024,0", ("alibi",)),
    Case(1, 256, 256, 2, 2, 192, 128, "bfloat16", "causal", ("softcap",)),
    Case(1, 1, 4096, 32, 8, 192, 128, "bfloat16", "full", ("sink",)),
    Case(8, 256, 256, 16, 16, 192, 128, "bfloat16", "full", ("varlen",)),
    # The 64x64 forward at 192/128, GQA, under the warp-specialized floors: the 4096-key cases above take the
    # warp-specialized kernel (configs.GLUON_WS_D192).
    Case(8, 1024, 1024, 16, 4, 192, 128, "bfloat16", "full", ("deterministic",)),
    # Packed sequences with a window keep the 64-key CTAs at 192/128 (configs.ONE_PASS_96_APART), MHA and GQA.
    Case(8, 256, 256, 16, 16, 192, 128, "bfloat16", "1024,0", ("varlen",)),
    Case(8, 512, 512, 16, 4, 192, 128, "bfloat16", "255,63", ("varlen",)),
    # The wide one-pass backward at head dim 256 (one Q/dO slot): a long causal row ending mid-CTA, GQA with a
    # window and softcap, packed sequences.
    Case(2, 4096, 4157, 16, 16, 256, 256, "bfloat16", "causal"),
    Case(8, 1024, 1024, 16, 4, 256, 256, "bfloat16", "1024,0", ("softcap",)),
    Case(8, 256, 256, 16, 16, 256, 256, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 32, 32, "bfloat16", "full", ("softcap",)),
    Case(1, 256, 256, 2, 2, 32, 32, "bfloat16", "causal", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 32, 32, "bfloat16", "1024,0", ("alibi",)),
    Case(1, 1, 4096, 32, 8, 32, 32, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 32, 32, "bfloat16", "full", ("dropout",)),
    Case(1, 256, 256, 2, 2, 32, 32, "bfloat16", "full", ("deterministic",)),
    Case(1, 4096, 4096, 2, 2, 32, 32, "bfloat16", "full", ("softcap",)),
    Case(1, 4096, 4096, 2, 2, 32, 32, "bfloat16", "full", ("bias",)),
    Case(1, 4096, 4096, 2, 2, 32, 32, "bfloat16", "full", ("dropout",)),
    Case(1, 4096, 4096, 2, 2, 32, 32, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 32, 32, "bfloat16", "causal", ("sink",)),
    Case(1, 4096, 4096, 16, 4, 32, 32, "bfloat16", "full", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 64, 64, "bfloat16", "full", ("sink",)),
    Case(1, 256, 256, 2, 2, 64, 64, "bfloat16", "full", ("bias",)),
    Case(1, 1, 4096, 32, 8, 64, 64, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 64, 64, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 2, 2, 64, 64, "bfloat16", "full", ("alibi",)),
    Case(1, 4096, 4096, 2, 2, 64, 64, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 64, 64, "bfloat16", "full", ("deterministic",)),
    Case(1, 4096, 4096, 16, 4, 64, 64, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 96, 96, "bfloat16", "full", ("softcap",)),
    Case(1, 256, 256, 2, 2, 96, 96, "bfloat16", "causal", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 96, 96, "bfloat16", "full", ("softcap",)),
    Case(1, 1, 4096, 32, 8, 96, 96, "bfloat16", "causal", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 96, 96, "bfloat16", "1024,0", ("bias",)),
    Case(1, 1, 4096, 32, 8, 96, 96, "bfloat16", "full", ("sink",)),
    Case(1, 256, 256, 2, 2, 96, 96, "bfloat16", "full", ("sink",)),
    Case(1, 256, 256, 2, 2, 96, 96, "bfloat16", "full", ("bias",)),
    Case(1, 1, 4096, 32, 8, 96, 96, "bfloat16", "full", ("deterministic",)),
    Case(1, 256, 256, 16, 4, 96, 96, "bfloat16", "full", ("deterministic",)),
    Case(1, 256, 256, 16, 4, 96, 96, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 2, 2, 96, 96, "bfloat16", "full", ("dropout",)),
    Case(1, 4096, 4096, 2, 2, 96, 96, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 96, 96, "bfloat16", "causal", ("sink",)),
    Case(1, 4096, 4096, 16, 4, 96, 96, "bfloat16", "causal", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 96, 96, "bfloat16", "full", ("alibi",)),
    Case(1, 16384, 16384, 2, 2, 96, 96, "bfloat16", "full", ("softcap",)),
    Case(8, 4096, 4096, 16, 16, 96, 96, "bfloat16", "causal", ("deterministic",)),
    Case(8, 4096, 4096, 16, 16, 96, 96, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 128, 128, "bfloat16", "full", ("sink",)),
    Case(1, 1, 4096, 32, 8, 128, 128, "bfloat16", "1024,0", ("alibi",)),
    Case(1, 256, 256, 2, 2, 128, 128, "bfloat16", "causal", ("alibi",)),
    Case(1, 1, 4096, 32, 8, 128, 128, "bfloat16", "causal", ("dropout",)),
    Case(1, 256, 256, 2, 2, 128, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 128, 128, "bfloat16", "full", ("bias",)),
    Case(1, 1, 4096, 32, 8, 128, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 16, 4, 128, 128, "bfloat16", "full", ("alibi",)),
    Case(1, 256, 256, 16, 4, 128, 128, "bfloat16", "causal", ("varlen",)),
    Case(8, 256, 256, 16, 16, 128, 128, "bfloat16", "causal", ("varlen",)),
    Case(1, 16, 32768, 32, 8, 128, 128, "bfloat16", "causal", ("varlen",)),
    Case(1, 4096, 4096, 2, 2, 128, 128, "bfloat16", "full", ("softcap",)),
    Case(1, 4096, 4096, 2, 2, 128, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 2, 2, 128, 128, "bfloat16", "full", ("bias",)),
    Case(8, 1024, 1024, 16, 4, 128, 128, "bfloat16", "causal", ("deterministic",)),
    Case(8, 1024, 1024, 16, 16, 128, 128, "bfloat16", "causal", ("sink",)),
    Case(8, 1024, 1024, 16, 16, 128, 128, "bfloat16", "full", ("deterministic",)),
    Case(8, 1024, 1024, 16, 16, 128, 128, "bfloat16", "causal", ("varlen",)),
    Case(8, 1024, 1024, 16, 16, 128, 128, "bfloat16", "1024,0", ("alibi",)),
    Case(8, 1024, 1024, 16, 4, 128, 128, "bfloat16", "1024,0", ("alibi",)),
    Case(1, 4096, 4096, 16, 4, 128, 128, "bfloat16", "causal", ("alibi",)),
    Case(1, 4096, 4096, 16, 4, 128, 128, "bfloat16", "1024,0", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 128, 128, "bfloat16", "full", ("deterministic",)),
    Case(1, 4096, 4096, 16, 4, 128, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 128, 128, "bfloat16", "1024,0", ("softcap",)),
    Case(16, 16, 8192, 32, 8, 128, 128, "bfloat16", "causal", ("alibi",)),
    Case(1, 256, 256, 2, 2, 192, 128, "bfloat16", "1024,0", ("bias",)),
    Case(1, 1, 4096, 32, 8, 192, 128, "bfloat16", "full", ("softcap",)),
    Case(1, 1, 4096, 32, 8, 192, 128, "bfloat16", "causal", ("varlen",)),
    Case(1, 256, 256, 2, 2, 192, 128, "bfloat16", "full", ("alibi",)),
    Case(1, 256, 256, 2, 2, 192, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 192, 128, "bfloat16", "full", ("bias",)),
    Case(1, 256, 256, 16, 4, 192, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 2, 2, 192, 128, "bfloat16", "full", ("softcap",)),
    Case(1, 4096, 4096, 2, 2, 192, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 2, 2, 192, 128, "bfloat16", "full", ("sink",)),
    Case(1, 4096, 4096, 16, 4, 192, 128, "bfloat16", "full", ("deterministic",)),
    Case(1, 4096, 4096, 16, 4, 192, 128, "bfloat16", "full", ("dropout",)),
    Case(1, 4096, 4096, 16, 4, 192, 128, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 256, 256, "bfloat16", "full", ("dropout",)),
    Case(1, 1, 4096, 32, 8, 256, 256, "bfloat16", "full", ("deterministic",)),
    Case(1, 256, 256, 2, 2, 256, 256, "bfloat16", "full", ("varlen",)),
    Case(1, 1, 4096, 32, 8, 256, 256, "bfloat16", "full", ("varlen",)),
    Case(1, 256, 256, 2, 2, 256, 256, "bfloat16", "full", ("bias",)),
    Case(1, 1, 4096, 32, 8, 256, 256, "bfloat16", "full", ("dropout",)),
    Case(1, 256, 256, 16, 4, 256, 256, "bfloat16", "full", ("varlen",)),
    Case(1, 1024, 1024, 16, 4, 256, 256, "bfloat16", "1024,0", ("sink",)),
    Case(1, 4096, 4096, 2, 2, 256, 256, "bfloat16", "causal", ("alibi",)),
    Case(1, 4096, 4096, 2, 2, 256, 256, "bfloat16", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 256, 256, "bfloat16", "full", ("bias",)),
    Case(1, 4096, 4096, 16, 4, 256, 256, "bfloat16", "full", ("varlen",)),
    # float32 (the Triton kernels on FMA dots): each forward/backward kernel at each head-dim family, each with
    # MHA/GQA x dense/packed and each feature and mask at some head dim (atoms()), features combined to share compiles.
    Case(1, 256, 256, 2, 2, 32, 32, "float32", "full", ("softcap", "alibi", "varlen", "deterministic")),
    Case(1, 1, 4096, 32, 8, 192, 128, "float32", "causal", ("alibi", "sink", "varlen", "deterministic")),
    Case(1, 256, 256, 2, 2, 64, 64, "float32", "1024,0", ("sink", "bias")),
    Case(1, 1, 4096, 32, 8, 256, 256, "float32", "full", ("softcap", "dropout")),
    Case(1, 4096, 4096, 2, 2, 96, 96, "float32", "full", ("softcap", "alibi", "varlen", "deterministic")),
    Case(1, 4096, 4096, 2, 2, 192, 128, "float32", "full", ("softcap", "alibi", "varlen", "deterministic")),
    Case(1, 4096, 4096, 2, 2, 128, 128, "float32", "causal", ("sink", "bias")),
    Case(1, 4096, 4096, 2, 2, 256, 256, "float32", "causal", ("sink", "bias")),
    Case(1, 1, 4096, 32, 8, 96, 96, "float32", "causal", ("dropout",)),
    Case(1, 256, 256, 2, 2, 192, 128, "float32", "1024,0", ("bias",)),
    Case(1, 4096, 4096, 16, 4, 32, 32, "float32", "full", ("dropout",)),
    Case(1, 1, 4096, 32, 8, 128, 128, "float32", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 64, 64, "float32", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 192, 128, "float32", "full", ("dropout",)),
    Case(1, 256, 256, 2, 2, 192, 128, "float32", "full", ("varlen",)),
    Case(1, 4096, 4096, 16, 4, 192, 128, "float32", "full", ("varlen",)),
    Case(4, 16, 4096, 32, 8, 32, 32, "bfloat16", "causal", ("softcap",), "contiguous"),
    Case(4, 16, 4096, 32, 8, 64, 64, "bfloat16", "1024,0", ("alibi",), "contiguous"),
    Case(4, 16, 4096, 32, 8, 96, 96, "bfloat16", "causal", ("sink",), "contiguous"),
    Case(4, 16, 4096, 32, 8, 128, 128, "bfloat16", "causal", (), "contiguous"),
    Case(1, 1024, 8192, 32, 8, 128, 128, "bfloat16", "causal", ("softcap",), "contiguous"),
    Case(1, 1024, 8192, 32, 8, 128, 128, "bfloat16", "causal", ("alibi",), "contiguous"),
    Case(1, 1024, 8192, 32, 8, 128, 128, "bfloat16", "causal", ("sink",), "contiguous"),
    Case(1, 1, 32768, 32, 8, 192, 192, "bfloat16", "causal", (), "contiguous"),
    Case(4, 16, 4096, 32, 8, 192, 192, "bfloat16", "causal", ("softcap",), "contiguous"),
    Case(4, 16, 4096, 32, 8, 192, 192, "bfloat16", "causal", ("sink",), "contiguous"),
    Case(4, 16, 4096, 32, 8, 256, 256, "bfloat16", "1024,0", ("alibi",), "contiguous"),
    Case(1, 1024, 8192, 32, 8, 256, 256, "bfloat16", "causal", ("softcap",), "contiguous"),
    Case(1, 1024, 8192, 32, 8, 256, 256, "bfloat16", "causal", ("alibi",), "contiguous"),
    Case(1, 1024, 8192, 32, 8, 256, 256, "bfloat16", "causal", ("sink",), "contiguous"),
]
