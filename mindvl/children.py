"""Python children that mindvl starts never import from the working directory.

`python -m X` and `python -c ...` put the current folder first on `sys.path`, so a received folder holding a
`multiprocessing/` or `mindvl/plan/` package would run its code in every child started from there (spawned loader
or curation workers, the resource tracker, the planner child). Every Python child mindvl starts therefore runs with
Python's safe path (`PYTHONSAFEPATH=1`, what `-P` sets) and an explicit, absolute `PYTHONPATH` whose first entry is
the folder that holds this mindvl package (so a source checkout without an install still finds itself).

- `child_env()`: the environment for a `subprocess` child (`python_command` adds `-P` too);
- `spawn_context()`: a multiprocessing spawn context whose processes (and the resource tracker it needs) start with
  that environment; the parent's own `os.environ` is changed only while a child is being started.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from multiprocessing import context as mp_context
from multiprocessing import resource_tracker
from pathlib import Path

PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)  # the folder that holds the mindvl package
_ENV_LOCK = threading.Lock()


def safe_pythonpath(current: str | None) -> str:
    """PACKAGE_PARENT, then the absolute entries of `current` (empty entries, which mean the working directory, are
    dropped; relative ones are made absolute against the folder they mean now)."""
    parts = [PACKAGE_PARENT]
    for p in (current or "").split(os.pathsep):
        if p:
            p = os.path.abspath(p)
            if p not in parts:
                parts.append(p)
    return os.pathsep.join(parts)


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) with the safe path and an absolute PYTHONPATH, plus `extra`."""
    env = dict(os.environ if base is None else base)
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = safe_pythonpath(env.get("PYTHONPATH"))
    env.update(extra)
    return env


def python_command(*args: str) -> list[str]:
    """`python -P ARGS...` with this interpreter (run it with `env=child_env()`)."""
    return [sys.executable, "-P", *args]


@contextlib.contextmanager
def safe_environ() -> Iterator[None]:
    """This process's environment carries the safe path while the block starts children (they copy it at exec)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in ("PYTHONSAFEPATH", "PYTHONPATH")}
        os.environ.update({k: v for k, v in child_env().items() if k in saved})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class SafeSpawnProcess(mp_context.SpawnProcess):
    """A spawned process whose interpreter starts with the safe path: spawn runs `python -c 'from multiprocessing.spawn
    import spawn_main ...'`, which would otherwise import `multiprocessing` from the working directory."""

    @staticmethod
    def _Popen(process_obj):  # noqa: N802 (multiprocessing's name)
        with safe_environ():
            return mp_context.SpawnProcess._Popen(process_obj)


class SafeSpawnContext(mp_context.SpawnContext):
    Process = SafeSpawnProcess


def spawn_context() -> SafeSpawnContext:
    """The spawn context for worker pools (`ProcessPoolExecutor(mp_context=spawn_context())`). The resource tracker
    (another `python -c` child, started by the pool's first queue) is started here with the safe path too."""
    if sys.platform != "win32":
        with safe_environ():
            resource_tracker.ensure_running()
    return SafeSpawnContext()
