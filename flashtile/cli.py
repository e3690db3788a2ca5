"""Command line: ``python -m flashtile <command> [options]``.

Each command is a module with ``add_parser(subparsers)`` that registers its options and sets
``func`` (``func(args) -> exit code``); add a command by adding its module to ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import importlib

COMMANDS = ("flashtile.bench", "flashtile.tools.info", "flashtile.tools.memory", "flashtile.tools.qualify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashtile",
        description="flashtile: exact, IO-aware FlashAttention in Triton behind a PyTorch API.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
