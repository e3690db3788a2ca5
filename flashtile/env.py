"""Environment variables read on every call, at the cost of a dict lookup.

``os.environ.get`` encodes the name and decodes the value each time (about 1 us); a decode step reads
several switches (strict mode, disabled backends, value checks, poisoned buffers), so this module
looks names up in the mapping ``os.environ`` keeps of its encoded entries. A variable set or removed
through ``os.environ`` (``monkeypatch.setenv`` too) is seen by the next call, as with ``os.environ.get``.
"""
from __future__ import annotations

import os

# os.environ's own table of encoded names and values (CPython's os._Environ), None where it has none.
_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_encoded: dict = {}


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``."""
    if _DATA is None or _ENCODE is None or _DECODE is None:
        return os.environ.get(name, default)
    key = _encoded.get(name)
    if key is None:
        key = _encoded[name] = _ENCODE(name)
    value = _DATA.get(key)
    return default if value is None else _DECODE(value)


def flag(name: str) -> bool:
    """Whether switch ``name`` is on: set to anything but ``""`` or ``"0"``."""
    return get(name, "0") not in ("", "0")
