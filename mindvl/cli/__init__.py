"""The `mindvl` command: a thin dispatcher.

Each sub-command lives in its own module under `mindvl.cli` and exposes `register(subparsers)`, which adds its
parser and sets `func` to a function taking the parsed namespace. The modules only parse arguments and call one
library function; no logic lives here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Sub-command modules, in the order `mindvl --help` lists them.
COMMAND_MODULES = ("quickstart", "train", "plan", "export", "convert", "merge", "chat", "eval", "search_resolution",
                   "data", "curate", "moe_trace", "moe_analyze", "ablate")


def build_parser() -> argparse.ArgumentParser:
    from mindvl import __version__

    from .overrides import CommandParser

    parser = argparse.ArgumentParser(prog="mindvl", description="Train multimodal LLMs the MindVL way.")
    parser.add_argument("--version", action="version", version=f"mindvl {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of every error (also MINDVL_DEBUG=1)")
    # CommandParser: recipe `key=value` overrides are accepted anywhere after a command's positionals.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"mindvl.cli.{name}").register(sub)
    return parser


# Expected errors: bad input or configuration, reported in one line naming what to fix (exit 2). Anything else is a
# bug and shows its traceback; `--debug` shows the traceback of expected errors too.
EXPECTED_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    from mindvl.train.stops import RunStopped

    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MINDVL_DEBUG", "") not in ("", "0")
    try:
        result = args.func(args)
    except RunStopped as exc:  # preempted / too many bad steps: the message says what happened and what to do
        if debug:
            raise
        print(f"mindvl {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except EXPECTED_ERRORS as exc:
        if debug or _is_bug(exc):
            raise
        print(f"mindvl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


def _is_bug(exc: BaseException) -> bool:
    """A ValueError raised by torch or numpy internals (shape mismatches, ...) is a bug, not bad input: mindvl
    reports bad input from its own code (the innermost frame of the traceback is in mindvl or the stdlib)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and any(f"{os.sep}{pkg}{os.sep}" in last for pkg in ("torch", "numpy", "transformers"))


if __name__ == "__main__":
    sys.exit(main())
