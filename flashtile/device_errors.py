"""The device-side error record: bad index values a kernel met, kept on the device until read.

Checking an index tensor's values on the host costs a device->host copy that stalls the host, so on
CUDA it runs only with ``FLASHTILE_VALIDATE_VALUES=1`` (:func:`flashtile.validation.values_checked`).
Without it, the kernels still keep every read and write inside the tensors they were given (they
clamp or mask each index), and the first bad value they meet goes into a small int32 tensor on its
device, written with an atomic: ``[argument id, value, index, count]``. Nothing reads it on the
call's path; :func:`check_device_errors` (and :func:`flashtile.stats`, and strict mode at the
points that synchronize anyway) read it later. The contract is written out in docs/reliability.md.
"""
from __future__ import annotations

import threading

import torch

# Argument ids as the kernels write them (0 = no error); what a bad value of each one is.
ARGUMENTS = {
    1: ("cu_seqlens_q", "an offset below 0, below the previous offset, or past the packed query tokens"),
    2: ("cu_seqlens_k", "an offset below 0, below the previous offset, or past the packed key tokens"),
    3: ("seqused_k", "below 0 or more keys than the sequence has (cu_seqlens_k[b + 1] - cu_seqlens_k[b])"),
    4: ("cache_seqlens", "below 0, or with the new tokens past the cache capacity (the tokens past it were not written)"),
    5: ("cache_batch_idx", "not a row of k_cache (below 0 or >= batch_cache; nothing was read or written for it)"),
    6: ("cache_leftpad", "below 0 or past cache_seqlens"),
    7: ("block_table", "not a page of k_cache (below 0 or >= num_blocks; nothing was read or written there)"),
    8: ("max_seqlen_q", "less than a sequence's length (the rows past it were not computed)"),
    9: ("max_seqlen_k", "less than a sequence's number of keys (the gradients of the keys past it were not computed)"),
    10: ("new_lengths", "below 0 or past seqlen_new (the tokens appended); clamped into that range"),
}
ARGUMENT_IDS = {name: code for code, (name, _) in ARGUMENTS.items()}
# Slots of the record.
CODE, VALUE, INDEX, COUNT = range(4)

_lock = threading.Lock()
_records: dict = {}
# What check_device_errors raised last, as pending() gives it (for tests and tools that want the fields).
last_raised: dict | None = None


def record(device) -> torch.Tensor:
    """The int32 ``(4,)`` error record of ``device``, made (zeroed) on first use and kept."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rec = _records.get(device)
    if rec is None:
        with _lock:
            rec = _records.get(device)
            if rec is None:
                rec = torch.zeros(4, dtype=torch.int32, device=device)
                _records[device] = rec
    return rec


def note(name: str, index: int, value: int, device="cpu") -> None:
    """Record a bad value found on the host (the torch backend's checks) in ``device``'s record, as a kernel
    would (on CUDA this writes to the device: call it only where the values were read anyway)."""
    rec = record(device)
    with _lock:
        if int(rec[CODE]) == 0:
            rec[CODE], rec[VALUE], rec[INDEX] = ARGUMENT_IDS[name], int(value), int(index)
        rec[COUNT] += 1


def packed_spans(cu_seqlens: list, total: int, name: str, device="cpu") -> list:
    """``(start, end)`` of each sequence of a packed tensor of ``total`` rows, as the kernels take them
    (``kernels/common.py: packed_span``): an offset below 0, decreasing or past ``total`` is noted and clamped.
    The torch backend's twin of the kernels' (it computes every row, so a short ``max_seqlen`` harms nothing)."""
    spans = []
    for b in range(len(cu_seqlens) - 1):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if start < 0 or end < start or end > total:
            note(name, b if start < 0 else b + 1, start if start < 0 else end, device)
        start = min(max(start, 0), total)
        end = min(max(end, start), total)
        spans.append((start, end))
    return spans


def used_keys(seqused: int, keys: int, b: int, device="cpu") -> int:
    """``seqused_k[b]`` as the kernels take it: noted when below 0 or past the sequence's ``keys``, and clamped."""
    if seqused < 0 or seqused > keys:
        note("seqused_k", b, seqused, device)
    return min(max(seqused, 0), keys)


def note_on_device(name: str, bad: torch.Tensor, values: torch.Tensor) -> None:
    """Note the first ``values[i]`` where ``bad[i]`` in the record of their device with a few tensor ops and no
    host sync (the first noted error is kept, as the kernels' atomics keep it)."""
    rec = record(values.device)
    index = bad.to(torch.int32).argmax()
    found = bad.any()
    first = found & (rec[CODE] == 0)
    update = torch.stack([torch.full_like(rec[CODE], ARGUMENT_IDS[name]), values[index].to(torch.int32),
                          index.to(torch.int32)])
    rec[:3] = torch.where(first, update, rec[:3])
    rec[COUNT] += found.to(torch.int32)


def pending() -> list:
    """Every device's record that holds an error, as ``{"device", "argument", "index", "value", "count"}``
    dicts; reading a CUDA record waits for the work queued before it (one device->host copy)."""
    found = []
    for device, rec in list(_records.items()):
        code, value, index, count = rec.tolist()
        if code:
            name = ARGUMENTS.get(code, (f"argument #{code}", ""))[0]
            found.append(dict(device=str(device), argument=name, index=index, value=value, count=count))
    return found


def message(error: dict) -> str:
    name = error["argument"]
    code = ARGUMENT_IDS.get(name)
    meaning = ARGUMENTS[code][1] if code else "out of range"
    index, value = error["index"], error["value"]
    if name.startswith("max_seqlen"):
        where, shown = f"{name} (sequence {index})", f"has length {value}"
    elif name == "block_table":
        where, shown = f"block_table[{index}, :]", f"holds {value}"
    else:
        where, shown = f"{name}[{index}]", f"= {value}"
    return (f"a kernel on {error['device']} met a bad index value: {where} {shown}: {meaning}; "
            f"{error['count']} program(s) met bad values since the last check. Set FLASHTILE_VALIDATE_VALUES=1 to "
            "have every call's index values checked on the host before launch")


def clear() -> None:
    """Zero every record."""
    for rec in list(_records.values()):
        rec.zero_()


def check_device_errors() -> None:
    """Raise ``ValueError`` naming the argument and the first bad value any kernel recorded since the last
    check, and clear the records; return quietly when there is none. On CUDA this waits for the queued work
    (one small device->host copy per device)."""
    global last_raised
    found = pending()
    if found:
        clear()
        last_raised = found[0]
        raise ValueError(message(found[0]))


def check_if_strict() -> None:
    """In strict mode, :func:`check_device_errors` (called where the host waits for the device anyway)."""
    from .dispatch import strict_enabled

    if strict_enabled() and _records:
        check_device_errors()
