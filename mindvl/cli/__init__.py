"""The `mindvl` command: a thin dispatcher.

Each sub-command lives in its own module under `mindvl.cli` and exposes `register(subparsers)`, which adds its
parser and sets `func` to a function taking the parsed namespace. The modules only parse arguments and call one
library function; no logic lives here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command modules, in the order `mindvl --help` lists them.
COMMAND_MODULES = ("quickstart", "train", "plan", "export", "convert", "merge", "chat", "eval", "search_resolution",
                   "data", "moe_trace", "moe_analyze")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindvl", description="Train multimodal LLMs the MindVL way.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"mindvl.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        # Bad input is reported in one line naming what to fix, not as a traceback.
        print(f"mindvl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
