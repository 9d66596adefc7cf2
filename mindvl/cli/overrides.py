"""Recipe `key=value` overrides on the command line, accepted anywhere after a sub-command's positional arguments.

argparse matches all positionals of a command in one go: in `mindvl plan R --world-size 2 batch.x=2` the recipe and
an empty override list are consumed before `--world-size`, and the trailing `batch.x=2` is then "unrecognized". Rather
than each command working around that, every sub-command parser is a `CommandParser`: after parsing, the leftover
arguments that look like `key=value` are appended to the command's `overrides` (declared once, with
`add_overrides`). Anything else left over (an unknown flag, a stray word) stays an error, as before.
"""

from __future__ import annotations

import argparse
import re

# A recipe key (dotted path or alias) followed by `=`: `optim.lr=5e-4`, `max_steps=10`. Flags (`--x=1`) never match.
OVERRIDE = re.compile(r"^[A-Za-z_][\w.\-]*=")
DEST = "overrides"


def add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    """Declare the command's recipe overrides: `key=value` arguments, anywhere after its positional arguments."""
    parser.add_argument(DEST, nargs="*", metavar="key=value",
                        help=f"{help}; anywhere after the positional arguments, flags included")


class CommandParser(argparse.ArgumentParser):
    """A sub-command parser that collects trailing `key=value` arguments into its `overrides` (when it has them)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and any(a.dest == DEST for a in self._actions):
            # An unknown flag's value (`--nope a=b`) is not an override: only arguments that do not follow an
            # unrecognised flag move.
            kept: list[str] = []
            overrides = list(getattr(namespace, DEST, None) or [])
            for i, arg in enumerate(extras):
                after_flag = i > 0 and extras[i - 1].startswith("-") and "=" not in extras[i - 1]
                if OVERRIDE.match(arg) and not after_flag:
                    overrides.append(arg)
                else:
                    kept.append(arg)
            setattr(namespace, DEST, overrides)
            extras = kept
        return namespace, extras
