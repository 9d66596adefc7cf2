"""The `mindvl` command: a thin dispatcher.

Each sub-command lives in its own module under `mindvl.cli` and exposes `register(subparsers)`, which adds its
parser and sets `func` to a function taking the parsed namespace. The modules only parse arguments and call one
library function; no logic lives here.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
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
EXPECTED_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                   PermissionError)
# OSErrors that say what is wrong with the machine rather than with mindvl: a full disk or quota, a read-only or
# vanished file system. One line naming the path.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ESTALE}


def main(argv: list[str] | None = None) -> int:
    from mindvl.train.stops import RunStopped

    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MINDVL_DEBUG", "") not in ("", "0")
    try:
        result = args.func(args)
    except RunStopped as exc:  # preempted / too many bad steps: the message says what happened and what to do
        if debug:
            raise
        print(f"mindvl {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a training run (whose own handler checkpoints first)
        if debug:
            raise
        print(f"mindvl {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except (Exception, _checkpoint_exception()) as exc:
        # torch.distributed.checkpoint reports each rank's failure wrapped in a CheckpointException, which derives
        # from BaseException (so `except Exception` misses it): judge the first failing rank's own error.
        cause, last_file = _unwrap(exc)
        if debug or not _is_expected(cause) or _is_bug(cause, last_file):
            raise
        prefix = f"checkpoint I/O failed on rank {_first_rank(exc)}: " if cause is not exc else ""
        print(f"mindvl {args.command}: error: {prefix}{one_line(_message(cause))}", file=sys.stderr)
        return 2
    return int(result or 0)


def one_line(text: str) -> str:
    """The CLI's promise is one line per error: a message that spans lines (a YAML mark, a wrapped library
    message) is joined."""
    return " ".join(text.split())


def _checkpoint_exception() -> type[BaseException]:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch without distributed
        return KeyboardInterrupt  # already handled above: the clause then catches nothing new
    return CheckpointException


def _unwrap(exc: BaseException) -> tuple[BaseException, str | None]:
    """(the error to judge, the file of its innermost frame when only a recorded stack is left) for a
    CheckpointException; (exc, None) for anything else."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, _checkpoint_exception()) and failures:
        cause, stack = failures[min(failures)]
        return cause, (stack[-1].filename if stack else None)
    return exc, None


def _first_rank(exc: BaseException) -> int:
    return min(getattr(exc, "failures", None) or {0: None})


def _is_expected(exc: BaseException) -> bool:
    if isinstance(exc, EXPECTED_ERRORS):
        return True
    if isinstance(exc, ImportError) and exc.name is None and "pip install" in str(exc):
        return True  # mindvl's own "this needs the X extra: pip install ..." (a failed import itself has .name)
    return isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS


def _message(exc: BaseException) -> str:
    """The exception's text; an OSError's strerror and file name when it has no message of mindvl's own."""
    if isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where} (free space or fix the file system, then rerun)"
    return str(exc)


def _is_bug(exc: BaseException, last_file: str | None = None) -> bool:
    """A ValueError raised by torch or numpy internals (shape mismatches, ...) is a bug, not bad input: mindvl
    reports bad input from its own code (the innermost frame of the traceback is in mindvl or the stdlib). A missing
    file or a full disk is what it says wherever it is noticed (torch's checkpoint reader opens files too).
    `last_file`: that frame's file when the traceback itself is gone (an error recorded on another rank)."""
    if isinstance(exc, OSError):
        return False
    tb = exc.__traceback__
    last = last_file
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and any(f"{os.sep}{pkg}{os.sep}" in last for pkg in ("torch", "numpy", "transformers"))


if __name__ == "__main__":
    sys.exit(main())
