"""Command-line tools: ``python -m flashtile info``, ``memory`` and ``qualify``.

Each tool is a module with ``add_parser(subparsers)`` (see :mod:`flashtile.cli`). This module
holds what they share: the readable-error rule and byte formatting. A :class:`ToolError`
(a bad path, a malformed or incomplete config) ends a command with exit status 2 and one line
on stderr, never a traceback.
"""
from __future__ import annotations

import functools
import json
import sys

EXIT_USAGE = 2  # argparse's own status for bad arguments; a bad config file is the same kind of mistake


class ToolError(Exception):
    """A mistake in what the user gave a command; the message is shown as is, on one line."""


def readable_errors(command: str):
    """Decorate a command's ``run(args)``: a :class:`ToolError` prints one line and returns 2."""

    def decorate(run):
        @functools.wraps(run)
        def wrapper(args) -> int:
            try:
                return run(args)
            except ToolError as error:
                message = " ".join(str(error).split())
                print(f"python -m flashtile {command}: error: {message}", file=sys.stderr)
                return EXIT_USAGE

        return wrapper

    return decorate


def format_bytes(n: float) -> str:
    """Binary units: ``512 B``, ``2.00 KiB``, ``1.50 GiB``, ``768 MiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "PiB":
            break
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"


def print_json(payload: dict) -> None:
    print(json.dumps(payload, indent=1, default=str))


def int_list(text: str) -> list[int]:
    """``"64,257"`` -> ``[64, 257]`` (argparse type; with ``nargs="+"`` both ``64 257`` and ``64,257`` work)."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"expected integers separated by commas, got {text!r}") from None


def flatten(groups) -> list[int] | None:
    return [x for group in groups for x in group] if groups else None
