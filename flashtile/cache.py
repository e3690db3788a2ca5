"""KV caches for generation loops that do not bring an inference engine of their own.

:class:`KVCache` preallocates the keys and values of ``batch`` sequences up to ``max_seqlen`` tokens and
keeps each sequence's length in an int32 tensor on the device. :meth:`KVCache.attend` appends a step's
keys and values, attends and advances the lengths without a host synchronization, so a decode step
can be captured in a CUDA graph.

:class:`PagedKVCache` keeps keys and values in fixed-size pages that all sequences share, handed out by
an allocator on the host (Python lists: the engine side). Sequences grow page by page and give their
pages back when freed; :meth:`PagedKVCache.fork` starts a sequence from another's prefix and shares
its full pages (parallel sampling, beam search, a common system prompt).

A generation loop (the "model" is random projections)::

    import torch
    import flashtile

    device, dtype = ("cuda", torch.float16) if torch.cuda.is_available() else ("cpu", torch.float32)
    batch, width, nheads, nheads_kv, headdim = 2, 256, 8, 2, 32
    w_q, w_k, w_v = (torch.randn(width, n * headdim, device=device, dtype=dtype) / width**0.5
                     for n in (nheads, nheads_kv, nheads_kv))
    w_out = torch.randn(nheads * headdim, width, device=device, dtype=dtype) / (nheads * headdim) ** 0.5

    cache = flashtile.KVCache(batch, max_seqlen=128, nheads_kv=nheads_kv, headdim=headdim, dtype=dtype, device=device)
    x = torch.randn(batch, 10, width, device=device, dtype=dtype)  # the prompt: 10 tokens
    for step in range(20):
        q = (x @ w_q).unflatten(-1, (nheads, headdim))      # (batch, seqlen, nheads, headdim)
        k = (x @ w_k).unflatten(-1, (nheads_kv, headdim))
        v = (x @ w_v).unflatten(-1, (nheads_kv, headdim))
        out = cache.attend(q, k, v, causal=True)           # appends k, v; attends; advances the lengths
        x = out[:, -1:].flatten(-2) @ w_out                # the next step's input: (batch, 1, width)
    print(cache.seqlens)                                   # tensor([29, 29], dtype=torch.int32)

    # The same on pages, with a sequence forked from the first one's prompt:
    paged = flashtile.PagedKVCache(num_blocks=32, page_size=16, nheads_kv=nheads_kv, headdim=headdim,
                                   dtype=dtype, device=device)
    seqs = [paged.allocate() for _ in range(batch)]
    x = torch.randn(batch, 10, width, device=device, dtype=dtype)
    for step in range(20):
        q, k, v = ((x @ w).unflatten(-1, (-1, headdim)) for w in (w_q, w_k, w_v))
        out = paged.attend(q, k, v, seqs, causal=True)     # takes new pages as the sequences grow
        x = out[:, -1:].flatten(-2) @ w_out
    child = paged.fork(seqs[0], prefix_len=20)            # shares the first page (16 tokens), copies the second
    paged.free(seqs[1])                                    # its 2 pages go back to the free list
    print(paged.length(child), paged.num_free_pages)      # 20 29
"""
from __future__ import annotations

import math

import torch

from . import device_errors, validation
from .interface import flash_attn_with_kvcache

# Arguments of flash_attn_with_kvcache that the caches fill in themselves.
_OWN_ARGUMENTS = ("cache_seqlens", "cache_batch_idx", "block_table", "k_descale", "v_descale")


def _descales(dtype, k_descale, v_descale, nheads_kv: int, device) -> tuple:
    """An FP8 cache's descales as float32 tensors (a float: one for every KV head); None for a 16-bit cache."""
    if dtype != torch.float8_e4m3fn:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale and v_descale apply to a torch.float8_e4m3fn cache, got dtype={dtype}")
        return None, None
    if k_descale is None or v_descale is None:
        raise ValueError("a torch.float8_e4m3fn cache needs k_descale and v_descale (a float, or float32 (nheads_kv,) or "
                         f"(batch, nheads_kv) tensors): the cache holds k / k_descale; got k_descale={k_descale!r}, "
                         f"v_descale={v_descale!r}")
    return tuple(torch.full((nheads_kv,), float(d), device=device) if isinstance(d, (int, float)) else d
                 for d in (k_descale, v_descale))


def _check_options(options: dict) -> None:
    for name in _OWN_ARGUMENTS:
        if name in options:
            raise TypeError(f"attend() fills {name} from the cache's own bookkeeping; it cannot be passed")


def _rows(k_descale, v_descale, batch: int) -> dict:
    """The descales of the first ``batch`` rows (a per-row descale is sliced; a per-head one is shared)."""
    if k_descale is None:
        return {}
    return {name: d[:batch] if d.dim() == 2 else d for name, d in (("k_descale", k_descale), ("v_descale", v_descale))}


class KVCache:
    """Contiguous KV cache of ``batch`` sequences of up to ``max_seqlen`` tokens each.

    ``dtype=torch.float8_e4m3fn`` makes an FP8 cache (half the bytes of a 16-bit one): pass ``k_descale`` and
    ``v_descale`` (a float, or float32 ``(nheads_kv,)`` or ``(batch, nheads_kv)``); new 16-bit keys and values
    are stored as ``x / descale`` in e4m3 (saturated at 448) and read back times the descale.

    Attributes:
        k: ``(batch, max_seqlen, nheads_kv, headdim)`` in ``dtype`` on ``device``.
        v: ``(batch, max_seqlen, nheads_kv, headdim_v)`` (``headdim_v`` defaults to ``headdim``).
        seqlens: int32 ``(batch,)`` on ``device``: the tokens each sequence holds (starts at 0).

    See the module docstring for a generation loop.
    """

    def __init__(self, batch: int, max_seqlen: int, nheads_kv: int, headdim: int, dtype=torch.float16, device=None,
                 headdim_v: int | None = None, k_descale=None, v_descale=None):
        if batch < 1 or max_seqlen < 1:
            raise ValueError(f"KVCache needs batch >= 1 and max_seqlen >= 1, got batch={batch}, max_seqlen={max_seqlen}")
        self.k = torch.zeros(batch, max_seqlen, nheads_kv, headdim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, max_seqlen, nheads_kv, headdim_v or headdim, dtype=dtype, device=device)
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=self.k.device)
        # dtype=torch.float8_e4m3fn: the cache holds k / k_descale (see flash_attn_with_kvcache).
        self.k_descale, self.v_descale = _descales(dtype, k_descale, v_descale, nheads_kv, self.k.device)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_seqlen(self) -> int:
        return self.k.shape[1]

    def attend(self, q, k=None, v=None, *, causal=True, new_lengths=None, **options):
        """Append ``k``, ``v`` to the first ``q.shape[0]`` sequences, attend, and advance their lengths.

        Args:
            q: ``(batch, seqlen_q, nheads, headdim)``, ``batch <= self.batch``.
            k, v: the new tokens ``(batch, seqlen_new, nheads_kv, headdim)`` (v: ``headdim_v``), or None
                to attend without appending.
            causal: bottom-right aligned causal mask (True, what a decoder wants).
            new_lengths: optional int32 ``(batch,)`` on the cache's device: advance row ``b`` by
                ``new_lengths[b] <= seqlen_new`` instead of ``seqlen_new`` (right-padded prompts of
                different lengths; the padding written past a row's length is overwritten next step).
            options: the other arguments of :func:`flashtile.flash_attn_with_kvcache` (rotary tables,
                window_size, softcap, alibi_slopes, sink, cache_leftpad, num_splits,
                return_softmax_lse, ...), passed through.

        Returns what :func:`flashtile.flash_attn_with_kvcache` returns. Nothing here synchronizes with the
        host: the lengths are advanced on the device, so the call can be captured in a CUDA graph.
        """
        _check_options(options)
        batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
        if batch is not None and batch > self.batch:
            raise ValueError(f"q has batch {batch} but this KVCache holds {self.batch} sequences (q {tuple(q.shape)})")
        seqlens = self.seqlens[:batch]
        if new_lengths is not None:
            new_lengths = self._checked_lengths(new_lengths, seqlens, k)
        result = flash_attn_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=seqlens, causal=causal,
                                         **_rows(self.k_descale, self.v_descale, batch), **options)
        if k is not None:
            seqlens.add_(k.shape[1] if new_lengths is None else new_lengths)
        return result

    def _checked_lengths(self, new_lengths, seqlens, k) -> torch.Tensor:
        """``new_lengths`` as an int32 tensor on the cache's device whose values lie in ``[0, seqlen_new]``.
        Its values are read on the host where :func:`~flashtile.validation.values_checked` allows it (always on
        CPU); otherwise they are clamped on the device and a bad one is noted in the error record (no sync)."""
        if k is None:
            raise ValueError("new_lengths says how far each sequence advances after appending k and v; got k=None")
        seqlen_new = k.shape[1]
        if not isinstance(new_lengths, torch.Tensor):
            new_lengths = torch.tensor(new_lengths, dtype=torch.int32)
        if new_lengths.dtype.is_floating_point or new_lengths.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"new_lengths must hold integers, got dtype {new_lengths.dtype}")
        if tuple(new_lengths.shape) != tuple(seqlens.shape):
            raise ValueError(f"new_lengths must have shape (batch,) = {tuple(seqlens.shape)}, got "
                             f"{tuple(new_lengths.shape)}")
        new_lengths = new_lengths.to(device=seqlens.device, dtype=torch.int32)
        if validation.values_checked(seqlens.device):
            low, high = torch.stack([new_lengths.min(), new_lengths.max()]).tolist()
            device_errors.check_if_strict()  # the host waited for the device: strict mode reads the record
            if low < 0 or high > seqlen_new:
                bad = low if low < 0 else high
                raise ValueError(f"new_lengths must lie between 0 and seqlen_new={seqlen_new} (the tokens appended), "
                                 f"got {bad}")
            return new_lengths
        device_errors.note_on_device("new_lengths", (new_lengths < 0) | (new_lengths > seqlen_new), new_lengths)
        return new_lengths.clamp(0, seqlen_new)

    def reset(self) -> None:
        """Empty every sequence (the memory is kept and reused)."""
        self.seqlens.zero_()


class PagedKVCache:
    """Paged KV cache: ``num_blocks`` pages of ``page_size`` tokens, shared by the sequences it holds.

    The allocator lives on the host: a free list of pages, each sequence's pages and length, and a
    reference count per page (a page shared by forked sequences is returned when the last one is
    freed). Only :meth:`block_table` and :meth:`seqlens` send data to the device.

    Attributes:
        k: ``(num_blocks, page_size, nheads_kv, headdim)`` in ``dtype`` on ``device``.
        v: ``(num_blocks, page_size, nheads_kv, headdim_v)``.

    :meth:`attend` is one step of a generation loop (see the module docstring). It keeps the host
    bookkeeping, so it cannot be captured in a CUDA graph; to capture a decode step, :meth:`reserve`
    the pages first, copy :meth:`block_table` and :meth:`seqlens` into static tensors and capture
    :func:`flashtile.flash_attn_with_kvcache` on those.
    """

    def __init__(self, num_blocks: int, page_size: int, nheads_kv: int, headdim: int, dtype=torch.float16,
                 device=None, headdim_v: int | None = None, max_blocks_per_seq: int | None = None, k_descale=None,
                 v_descale=None):
        if num_blocks < 1 or page_size < 1:
            raise ValueError(f"PagedKVCache needs num_blocks >= 1 and page_size >= 1, got num_blocks={num_blocks}, "
                             f"page_size={page_size}")
        self.k = torch.zeros(num_blocks, page_size, nheads_kv, headdim, dtype=dtype, device=device)
        self.v = torch.zeros(num_blocks, page_size, nheads_kv, headdim_v or headdim, dtype=dtype, device=device)
        # dtype=torch.float8_e4m3fn: pages hold k / k_descale, one descale per KV head (a float or (nheads_kv,)).
        self.k_descale, self.v_descale = _descales(dtype, k_descale, v_descale, nheads_kv, self.k.device)
        # A fixed block-table width (e.g. for CUDA graphs); None: as wide as the longest sequence of a call.
        self.max_blocks_per_seq = max_blocks_per_seq
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out page 0 first
        self._refs = [0] * num_blocks
        self._pages: dict = {}
        self._lengths: dict = {}
        self._next_id = 0

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def length(self, seq) -> int:
        """The tokens sequence ``seq`` holds."""
        return self._lengths[self._known(seq)]

    def pages(self, seq) -> list:
        """The page ids of sequence ``seq``, in order (a copy)."""
        return list(self._pages[self._known(seq)])

    def allocate(self, seq=None):
        """Register a new, empty sequence; returns its id (``seq``, or the next free int). It takes
        pages only as it grows."""
        if seq is None:
            while self._next_id in self._pages:
                self._next_id += 1
            seq = self._next_id
        elif seq in self._pages:
            raise ValueError(f"sequence {seq!r} is already allocated")
        self._pages[seq] = []
        self._lengths[seq] = 0
        return seq

    def free(self, seq) -> None:
        """Forget sequence ``seq``; each of its pages returns to the free list unless another sequence shares it."""
        for page in self._pages.pop(self._known(seq)):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        del self._lengths[seq]

    def reserve(self, seq, num_tokens: int) -> None:
        """Take the pages sequence ``seq`` needs to hold ``num_tokens`` more tokens."""
        pages = self._pages[self._known(seq)]
        needed = self._pages_needed(seq, num_tokens)
        if self.max_blocks_per_seq is not None and needed > self.max_blocks_per_seq:
            raise ValueError(
                f"sequence {seq!r} would need {needed} pages for {self._lengths[seq]} + {num_tokens} tokens, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq} (page_size={self.page_size})"
            )
        self._take(pages, needed - len(pages))

    def _pages_needed(self, seq, num_tokens: int) -> int:
        """The pages sequence ``seq`` must hold for ``num_tokens`` more tokens."""
        return math.ceil((self._lengths[seq] + num_tokens) / self.page_size)

    def fork(self, seq, prefix_len: int | None = None, new_seq=None):
        """A new sequence holding the first ``prefix_len`` tokens of ``seq`` (default: all of them).

        The pages the prefix fills completely are shared (never written again: both sequences append
        past them); a partly filled last page is copied to a page of the new sequence's own, so each
        can append to it. Returns the new sequence's id.
        """
        length = self.length(seq)
        prefix_len = length if prefix_len is None else prefix_len
        if not 0 <= prefix_len <= length:
            raise ValueError(f"prefix_len must be between 0 and the {length} tokens of sequence {seq!r}, got {prefix_len}")
        if new_seq is not None and new_seq in self._pages:
            raise ValueError(f"sequence {new_seq!r} is already allocated")
        full, partial = divmod(prefix_len, self.page_size)
        shared = self._pages[seq][:full]
        copied = []
        # Every check is made before a page is taken: a fork that raises changes nothing.
        if partial:
            self._take(copied, 1)
            source = self._pages[seq][full]
            self.k[copied[0]].copy_(self.k[source])
            self.v[copied[0]].copy_(self.v[source])
        child = self.allocate(new_seq)
        for page in shared:
            self._refs[page] += 1
        self._pages[child] = shared + copied
        self._lengths[child] = prefix_len
        return child

    def block_table(self, seqs, width: int | None = None) -> torch.Tensor:
        """int32 ``(len(seqs), width)`` on the cache's device: row ``b`` lists the pages of ``seqs[b]``,
        then 0s. ``width`` defaults to ``max_blocks_per_seq``, else to the most pages any of them has."""
        rows = [self._pages[self._known(seq)] for seq in seqs]
        width = width or self.max_blocks_per_seq or max(1, max(len(row) for row in rows))
        if any(len(row) > width for row in rows):
            raise ValueError(f"a sequence has {max(len(row) for row in rows)} pages, more than the width {width}")
        table = [row + [0] * (width - len(row)) for row in rows]
        return torch.tensor(table, dtype=torch.int32).to(self.k.device, non_blocking=True)

    def seqlens(self, seqs) -> torch.Tensor:
        """int32 ``(len(seqs),)`` on the cache's device: the tokens each sequence holds."""
        lengths = [self.length(seq) for seq in seqs]
        return torch.tensor(lengths, dtype=torch.int32).to(self.k.device, non_blocking=True)

    def attend(self, q, k, v, seqs, *, causal=True, new_lengths=None, **options):
        """Append ``k``, ``v`` to sequences ``seqs`` (taking pages as needed), attend, and advance their lengths.

        Args:
            q: ``(batch, seqlen_q, nheads, headdim)`` with ``batch == len(seqs)``.
            k, v: the new tokens ``(batch, seqlen_new, nheads_kv, headdim)`` (v: ``headdim_v``), or None.
            seqs: the distinct sequence ids of the batch rows, from :meth:`allocate` or :meth:`fork`.
            causal: bottom-right aligned causal mask.
            new_lengths: optional ints (a list or a tensor) ``<= seqlen_new``: advance sequence ``b`` by
                ``new_lengths[b]`` instead of ``seqlen_new`` (right-padded prompts).
            options: the other arguments of :func:`flashtile.flash_attn_with_kvcache`, passed through.

        Returns what :func:`flashtile.flash_attn_with_kvcache` returns.
        """
        _check_options(options)
        seqs = list(seqs)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs must be distinct sequences (each is written to), got {seqs}")
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] != len(seqs):
            raise ValueError(f"q has batch {q.shape[0]} but {len(seqs)} sequences were given (q {tuple(q.shape)})")
        seqlen_new = 0 if k is None else k.shape[1]
        if new_lengths is None:
            new_lengths = [seqlen_new] * len(seqs)
        elif isinstance(new_lengths, torch.Tensor):
            new_lengths = new_lengths.tolist()
        if len(new_lengths) != len(seqs) or not all(0 <= added <= seqlen_new for added in new_lengths):
            raise ValueError(f"new_lengths must hold one int between 0 and seqlen_new={seqlen_new} per sequence, "
                             f"got {list(new_lengths)} for {len(seqs)} sequences")
        # All or nothing: the pages every sequence needs are counted before any is taken, and given back if the
        # call raises, so a failed attend leaves the cache as it was.
        held = {seq: len(self._pages[self._known(seq)]) for seq in seqs}
        needed = [self._pages_needed(seq, seqlen_new) - held[seq] for seq in seqs]
        if sum(max(n, 0) for n in needed) > len(self._free):
            raise RuntimeError(
                f"PagedKVCache is out of pages: this step needs {sum(max(n, 0) for n in needed)} more, "
                f"{len(self._free)} free of {self.num_blocks} (page_size={self.page_size}); free finished sequences or "
                "build it with more num_blocks; nothing was changed")
        try:
            for seq in seqs:
                self.reserve(seq, seqlen_new)
            result = flash_attn_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=self.seqlens(seqs),
                                             block_table=self.block_table(seqs), causal=causal,
                                             k_descale=self.k_descale, v_descale=self.v_descale, **options)
        except BaseException:
            for seq, count in held.items():
                taken = self._pages[seq][count:]
                del self._pages[seq][count:]
                for page in reversed(taken):
                    self._refs[page] = 0
                    self._free.append(page)
            raise
        for seq, added in zip(seqs, new_lengths):
            self._lengths[seq] += added
        return result

    def _known(self, seq):
        if seq not in self._pages:
            raise KeyError(f"sequence {seq!r} is not in this PagedKVCache (allocate() it first; freed ones are gone)")
        return seq

    def _take(self, pages: list, count: int) -> None:
        """Move ``count`` pages from the free list to ``pages``."""
        if count <= 0:
            return
        if count > len(self._free):
            raise RuntimeError(
                f"PagedKVCache is out of pages: {count} more needed, {len(self._free)} free of {self.num_blocks} "
                f"(page_size={self.page_size}); free finished sequences or build it with more num_blocks"
            )
        for _ in range(count):
            page = self._free.pop()
            self._refs[page] = 1
            pages.append(page)
