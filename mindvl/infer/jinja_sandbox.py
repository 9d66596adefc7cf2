"""Rendering a chat template from a model folder mindvl did not write: sandboxed, time- and size-bounded.

A chat template is a Jinja program. jinja2's `ImmutableSandboxedEnvironment` already refuses attribute access to
Python internals and caps `range()` at 100,000 items, but not time or memory: nested loops run for hours, and
`'x' * 6000000000` allocates 6 GB in one step. `render_template` adds

- a time limit, checked on every line the template's compiled code runs (a trace function: rendering a template
  is done once per folder, so the tracing cost does not matter);
- a size limit on everything the template builds in one step (`*`, `**`, `%` are checked before they run) and on
  its output (checked as it streams).

Over a limit is a `TemplateLimitError` (a ValueError naming the file: the CLI prints one line, exit 2).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sized
from typing import Any

MAX_SECONDS = 2.0
MAX_OUTPUT_CHARS = 1 << 20  # a rendered conversation prefix; real ones are a few hundred characters


class TemplateLimitError(ValueError):
    """A chat template that runs too long or builds too much."""


def _sandbox(where: str, max_chars: int):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > max_chars:
                        raise TemplateLimitError(f"{where}: the chat template builds a value of {len(seq) * n} "
                                                 f"items, over the limit of {max_chars}")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
                raise TemplateLimitError(f"{where}: the chat template raises to the power {right}")
            if operator == "%" and isinstance(left, str) and len(left) > max_chars:
                raise TemplateLimitError(f"{where}: the chat template formats a string over {max_chars} characters")
            result = super().call_binop(context, operator, left, right)
            if operator == "%" and isinstance(result, Sized) and len(result) > max_chars:
                raise TemplateLimitError(f"{where}: the chat template formats a string over {max_chars} characters")
            return result

    return BoundedSandbox()


def render_template(template: str, where: str, max_seconds: float = MAX_SECONDS, max_chars: int = MAX_OUTPUT_CHARS,
                    **variables: Any) -> str:
    """`template` rendered with `variables` in jinja2's immutable sandbox, within `max_seconds` and `max_chars`.
    Raises TemplateLimitError over a limit; jinja2's own errors (syntax, undefined, security) pass through."""
    env = _sandbox(where, max_chars)
    compiled = env.from_string(template)
    deadline = time.monotonic() + max_seconds

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"{where}: the chat template ran for more than {max_seconds:g} s; refusing it")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        out, n = [], 0
        for chunk in compiled.generate(**variables):
            n += len(chunk)
            if n > max_chars:
                raise TemplateLimitError(f"{where}: the chat template renders more than {max_chars} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        sys.settrace(previous)
