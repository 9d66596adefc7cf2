"""The run folder (`output_dir`): one run at a time, and a fresh run never silently mixes with an old one.

- A lock: rank 0 holds an exclusive `fcntl.flock` on `OUTPUT_DIR/.lock` for the whole run and writes its pid and
  host into it. The kernel drops the lock when the process dies (even by SIGKILL), so a stale file never blocks a
  restart; a second run into the same folder fails at once, naming the holder.
- A fresh run (no `resume=`) into a folder that holds a finished or partial run (checkpoints, metrics, `final/`)
  is refused unless `overwrite=true`, which deletes those outputs first.
- No writes through links: a run folder (its top level, `checkpoints/` and each checkpoint in it) that holds a
  symlink, FIFO or device is refused before anything is written (a received run folder's `.lock` or `recipe.json`
  linked elsewhere would make `resume=auto` overwrite that file). `output_dir` itself may be a link.

The decision is rank 0's and is shared (agree.agreed_error), so every rank raises the same error and none waits
in a collective.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from pathlib import Path

from .agree import agreed_error
from .parallel import ParallelEnv

LOCK = ".lock"
# What a previous run leaves behind; a fresh run into a folder holding any of them must resume or overwrite.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "final", "data_report.json", "tensorboard", "loss.png")


class RunFolderError(ValueError):
    """The output folder is busy or holds another run (an expected error: the CLI prints one line)."""


class RunLock:
    """An exclusive lock on `folder/.lock` (POSIX advisory lock; released on close or process death)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process holds it
            os.close(fd)
            raise RunFolderError(f"{self.path.parent} is in use by another run ({describe_holder(self.path)}); "
                                 "wait for it, stop it, or choose another output_dir") from None
        except OSError as exc:  # a file system without flock (some network mounts): run, but say so
            os.close(fd)
            warnings.warn(f"cannot lock {self.path} ({exc}); running without the run-folder lock", stacklevel=2)
            return
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock; the file stays (harmless)
            self._fd = None


def describe_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on host {info['host']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"


def check_no_links(folder: Path) -> None:
    """RunFolderError naming the first entry of the run folder that is not a regular file or a real folder (looked
    for at the top level, in `checkpoints/` and in each checkpoint folder: everywhere a run writes)."""
    todo = [folder]
    if (folder / "checkpoints").is_dir() and not (folder / "checkpoints").is_symlink():
        todo.append(folder / "checkpoints")
    while todo:
        here = todo.pop(0)
        try:
            entries = list(os.scandir(here))
        except FileNotFoundError:
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_symlink() or not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)):
                what = "a symlink" if entry.is_symlink() else "not a regular file or folder"
                raise RunFolderError(f"{entry.path} is {what}; a run folder holds only its own files (a run writes "
                                     "through no links): remove it, or choose another output_dir")
            if here != folder and entry.is_dir(follow_symlinks=False) and entry.name.startswith("step_"):
                todo.append(Path(entry.path))


def previous_outputs(folder: Path) -> list[str]:
    return [name for name in RUN_OUTPUTS if (folder / name).exists()]


def claim_run_folder(folder: Path, resuming: bool, overwrite: bool, env: ParallelEnv) -> RunLock | None:
    """Collective. Lock `folder` (rank 0) and check that a fresh run may write there; every rank raises the same
    RunFolderError otherwise. Returns the lock to release at the end (rank 0), or None."""
    lock, message = None, None
    if env.is_main:
        try:
            check_no_links(folder)
            lock = RunLock(folder)
            lock.acquire()
            found = previous_outputs(folder)
            if found and not resuming:
                if not overwrite:
                    raise RunFolderError(
                        f"{folder} already holds a run ({', '.join(found)}); continue it with resume=auto, or "
                        "start over with overwrite=true (deletes those outputs), or choose another output_dir")
                for name in found:
                    target = folder / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
        except RunFolderError as exc:
            if lock is not None:
                lock.release()
            lock, message = None, str(exc)
    message = agreed_error(message, env)
    if message is not None:
        raise RunFolderError(message)
    return lock
