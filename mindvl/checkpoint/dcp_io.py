"""The one way mindvl reads (and the guard around how it writes) torch.distributed.checkpoint (DCP) folders.

Why a reader of our own: DCP's `FileSystemReader` unpickles `.metadata` with a plain `pickle.load`, and its default
load planner reads every non-tensor entry (the optimizer's param-group values) with an unrestricted `torch.load`.
Both run whatever code a crafted file names. Users resume and export checkpoints they did not write (shared run
folders, downloads), so every DCP read in mindvl goes through `read_dcp`, which

- unpickles `.metadata` with `MetadataUnpickler`: it admits exactly the classes DCP's `Metadata` is made of (the
  dataclasses of `torch.distributed.checkpoint.metadata`, the file system's `_StorageInfo`, `torch.Size`, dtypes,
  layouts, and the `pathlib` path DCP records as the checkpoint id). Any other global is refused with one line
  naming the file and the class, before anything in the pickle runs (the lookup fails, so nothing is called);
- loads non-tensor entries with `torch.load(weights_only=True)` (`SafeLoadPlanner`), tensors as DCP already does;
- checks, before reading any tensor, that every shard the metadata names is a plain file inside the checkpoint
  folder and long enough (a truncated shard is reported as such, not as a tensor-size mismatch deep in DCP);
- turns DCP's `CheckpointException` (a BaseException, which would bypass every `except Exception`) into a
  `CheckpointReadError` (a ValueError: the CLI prints one line and exits 2).

Why an allow-list and not a metadata format of our own: every DCP checkpoint (ours from before this reader, and any
other DCP writer's) keeps loading unchanged, DCP keeps resharding to any world size, and the allow-list fails closed:
a future torch that pickles a new class is refused by name (add it here after checking it), never run.

Saves: `write_failure` turns a failed DCP save into a one-line `CheckpointWriteError` that says "disk full" when the
file system is full (ENOSPC/EDQUOT anywhere in the failure, or almost no free space left after it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import io
import math
import os
import pickle
import re
import shutil
import stat
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"
PIN = ".pin"  # readers hold a shared flock on it; the pruner deletes a folder only under an exclusive one


class CheckpointReadError(ValueError):
    """A checkpoint that cannot be read: missing, truncated or damaged (the CLI prints one line, exit 2)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint whose pickles name something other than plain checkpoint data: refused, never unpickled."""


class CheckpointWriteError(ValueError):
    """A checkpoint save failed (disk full, read-only file system, ...); `latest` still names the previous one."""


# ------------------------------------------------------------------------------------------ the metadata allow-list


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for everything a DCP `.metadata` pickle may name.

    Built from torch's own modules rather than typed in, so it follows the installed torch: the classes defined in
    `torch.distributed.checkpoint.metadata` (Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...), the file
    system writer's `_StorageInfo`, and the torch values those hold (Size, dtypes, layouts via
    `torch.serialization._get_layout`, which maps a name to a layout). Calling any of them with arbitrary arguments
    only builds a value: none opens files, imports or evaluates anything.
    """
    allowed: dict[tuple[str, str], Any] = {}
    for name, obj in vars(dcp_metadata).items():
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__:
            allowed[(dcp_metadata.__name__, name)] = obj
    allowed[(_StorageInfo.__module__, _StorageInfo.__name__)] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for name, obj in vars(torch).items():
        if isinstance(obj, torch.dtype):
            allowed[("torch", name)] = obj
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (PosixPath, PurePosixPath):  # StorageMeta.checkpoint_id: the folder DCP saved into
        allowed[("pathlib", cls.__name__)] = cls
        allowed[(cls.__module__, cls.__name__)] = cls
    return allowed


_ALLOWED = _allowed_globals()


def _buildable() -> dict[type, frozenset[str]]:
    """The allowed classes a BUILD step may fill in (DCP's metadata dataclasses), each with the fields it may set."""
    out = {}
    for obj in _ALLOWED.values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            out[obj] = frozenset(f.name for f in dataclasses.fields(obj))
    return out


_BUILDABLE = _buildable()


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles a DCP `.metadata` admitting only `_ALLOWED`; anything else raises UnsafeCheckpointError.

    Every way a pickle reaches a callable (GLOBAL, STACK_GLOBAL, INST, OBJ, extension codes) goes through
    `find_class`, so refusing there means nothing named by the file is ever called. Exact (module, name) pairs:
    dotted names ("Metadata.__init__.__globals__") are not attribute-walked. BUILD (setting an object's state) is
    admitted only on a new instance of one of DCP's metadata dataclasses, with a dict of its own fields: a path,
    size or dtype object can not be given a state that prints one file and opens another. (The Python unpickler,
    so BUILD can be checked; a metadata file is small.)
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source
        self._built: set[int] = set()

    def _load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        fields = _BUILDABLE.get(type(inst))
        own_setstate = fields is not None and "__setstate__" in vars(type(inst))  # TensorProperties: a tuple
        if (fields is None or id(inst) in self._built
                or not (isinstance(state, tuple) if own_setstate else isinstance(state, dict))
                or (isinstance(state, dict) and not all(isinstance(k, str) and k in fields for k in state))):
            raise UnsafeCheckpointError(
                f"{self.source}: refusing to load it: it sets the state of a {type(inst).__module__}."
                f"{type(inst).__qualname__} in a way DCP never writes (it could make a path or size say one thing "
                "and mean another); get the checkpoint again from a source you trust")
        self._built.add(id(inst))
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self.source}: refusing to load it: it names {module}.{name}, which a checkpoint's metadata never "
                "contains (unpickling it could run code); get the checkpoint again from a source you trust") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: refusing to load it: it holds a persistent reference, which a "
                                    "checkpoint's metadata never contains")


def read_metadata(folder: str | os.PathLike) -> Metadata:
    """The checkpoint's DCP metadata, unpickled through the allow-list and checked against its shard files."""
    folder = Path(folder)
    path = folder / METADATA
    try:
        with open_in_checkpoint(path, MAX_METADATA_BYTES) as f:
            metadata = MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointReadError(f"{path} not found: {folder} is not a complete DCP checkpoint") from None
    except (UnsafeCheckpointError, CheckpointReadError):
        raise
    except RecursionError:
        raise CheckpointReadError(f"{path} is damaged (nested too deeply); resume or export an older "
                                  "checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, IndexError, TypeError, ValueError, KeyError,
            OSError, RuntimeError, OverflowError, MemoryError, struct.error) as exc:
        raise CheckpointReadError(f"{path} is truncated or damaged ({type(exc).__name__}: {_first_line(exc)}); "
                                  "resume or export an older checkpoint") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointReadError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    _check_shards(folder, metadata)
    return metadata


MAX_METADATA_BYTES = 1 << 30  # a .metadata file (a large sharded run's is tens of MB)
MAX_STORAGE_ENTRIES = 1 << 22  # shard locations in one checkpoint
MAX_BYTES_ENTRY = 64 << 20  # one non-tensor entry (a param group's values, a scheduler's state)
SHARD_OVERHEAD = 1 << 20  # torch.save's container around one stored tensor chunk


def open_in_checkpoint(path: Path, max_bytes: int):
    """A binary file object on `path`, a regular file (not a symlink, device or FIFO) of at most `max_bytes` inside
    a checkpoint folder: opened with O_NOFOLLOW and O_NONBLOCK, then checked with fstat (nothing blocks or is read
    before the check)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointReadError(f"{path} is a symlink; a checkpoint is a folder of regular files (copy the "
                                      "file in place of the link)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointReadError(f"{path} is not a regular file; a checkpoint is a folder of regular files")
        if st.st_size > max_bytes:
            raise CheckpointReadError(f"{path} has {st.st_size} bytes, over the limit of {max_bytes} for it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _exact_int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _entry_limit(metadata: Metadata, key: Any) -> int | None:
    """The most bytes the storage entry `key` may hold: its tensor chunk's bytes plus torch.save's container, or
    MAX_BYTES_ENTRY for a non-tensor entry (None: the entry's tensor metadata is not usable)."""
    md = metadata.state_dict_metadata.get(getattr(key, "fqn", None))
    if isinstance(md, dcp_metadata.BytesStorageMetadata):
        return MAX_BYTES_ENTRY
    if not isinstance(md, dcp_metadata.TensorStorageMetadata):
        return None
    index = getattr(key, "index", None)
    chunks = md.chunks
    if not isinstance(chunks, list) or not isinstance(index, int) or not 0 <= index < len(chunks):
        return None
    sizes = getattr(chunks[index], "sizes", None)
    dtype = getattr(md.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not isinstance(sizes, tuple) or not all(_exact_int(n) for n in sizes):
        return None
    return math.prod(sizes) * dtype.itemsize + SHARD_OVERHEAD


def _check_shards(folder: Path, metadata: Metadata) -> None:
    """Every shard location the metadata names: a plain file name (a str) directly inside `folder`, naming a regular
    file (not a symlink, device or FIFO) that holds [offset, offset + length) with both non-negative integers,
    no storage transforms, and a length its tensor chunk (or a non-tensor entry's cap) can need."""
    meta = folder / METADATA
    if not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointReadError(f"{meta} is not DCP metadata (no tensor table)")
    if len(metadata.storage_data) > MAX_STORAGE_ENTRIES or len(metadata.state_dict_metadata) > MAX_STORAGE_ENTRIES:
        raise CheckpointReadError(f"{meta} names more than {MAX_STORAGE_ENTRIES} entries; refusing to read it")
    needed: dict[str, int] = {}
    for key, info in metadata.storage_data.items():
        if type(info) is not _StorageInfo:
            raise CheckpointReadError(f"{meta}: a storage entry is a {type(info).__name__}, not a shard location")
        rel = info.relative_path
        if type(rel) is not str or not rel or "/" in rel or "\\" in rel or "\0" in rel or rel in (".", ".."):
            raise CheckpointReadError(f"{meta} names the shard {rel!r}, not a plain file name inside the checkpoint "
                                      "folder; refusing to read it")
        if not (_exact_int(info.offset) and _exact_int(info.length)):
            raise CheckpointReadError(f"{meta}: the shard entry for {rel!r} has no valid offset and length (both "
                                      "must be non-negative integers)")
        if info.transform_descriptors:
            raise CheckpointReadError(f"{meta}: the shard entry for {rel!r} names storage transforms "
                                      f"{info.transform_descriptors!r}, which mindvl never writes; refusing to read it")
        limit = _entry_limit(metadata, key)
        if limit is None or info.length > limit:
            raise CheckpointReadError(f"{meta}: the shard entry for {getattr(key, 'fqn', key)!r} holds "
                                      f"{info.length} bytes, more than its tensor can need; refusing to read it")
        needed[rel] = max(needed.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        try:
            st = os.lstat(folder / rel)
        except FileNotFoundError:
            raise CheckpointReadError(f"{folder / rel} is missing (named by {METADATA}): the checkpoint is "
                                      "incomplete") from None
        if not stat.S_ISREG(st.st_mode):
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CheckpointReadError(f"{folder / rel} is {what}; a checkpoint is a folder of regular files")
        if st.st_size < size:
            raise CheckpointReadError(f"{folder / rel} is truncated ({st.st_size} bytes, its metadata needs {size}); "
                                      "resume or export an older checkpoint")


def shard_bytes(folder: str | os.PathLike, prefix: str = "") -> int:
    """The bytes the checkpoint's storage entries hold for the entries whose name starts with `prefix` (after
    `read_metadata`'s checks): what a model read from it can weigh at most, in elements of one byte or more."""
    metadata = read_metadata(folder)
    return sum(info.length for key, info in metadata.storage_data.items()
               if str(getattr(key, "fqn", "")).startswith(prefix))


# ------------------------------------------------------------------------------------------------------ reading


class _ClosedFolderFileSystem(FileSystem):
    """DCP's file system, but a shard is opened only as a regular file, never through a symlink (O_NOFOLLOW), so
    one swapped in after `_check_shards` looked is still refused."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise CheckpointReadError(f"{path}: a checkpoint is only read here")
        with open_in_checkpoint(Path(path), 1 << 62) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader with `read_metadata` through the allow-list (read once, then cached) and shards
    opened as regular files only."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.fs = _ClosedFolderFileSystem()
        self.folder = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: mindvl never writes them
            raise CheckpointReadError(f"{self.folder}: no per-rank metadata")
        if self._metadata is None:
            self._metadata = read_metadata(self.folder)
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries are read with `torch.load(weights_only=True)`."""

    def __init__(self, reader: SafeFileSystemReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            info = self.reader.storage_data.get(read_item.storage_index)
            where = self.reader.folder / (info.relative_path if info is not None else "?")
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
            name = found.group(1) if found else ""
            name = name if "." in name or not name else f"builtins.{name}"  # torch drops the builtins module
            what = f"names {name}" if name else f"is not plain data ({_first_line(exc)})"
            raise UnsafeCheckpointError(
                f"{where}: refusing to load it: its entry {read_item.dest_index.fqn} {what}, which a checkpoint never "
                "contains (unpickling it could run code); get the checkpoint again from a source you trust") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_dcp(folder: str | os.PathLike, state: dict[str, Any], distributed: bool) -> None:
    """Collective when `distributed`: load `state` in place from the DCP checkpoint `folder` (any world size).

    Raises UnsafeCheckpointError (refused: nothing in it ran) or CheckpointReadError (missing, truncated, damaged),
    each with a one-line message; every rank raises the same kind.
    """
    folder = Path(folder)
    reader = SafeFileSystemReader(folder)
    problem: BaseException | None = None
    try:  # checked up front on every rank, so a bad file fails here and not inside DCP's collectives
        reader.read_metadata()
    except (CheckpointReadError, UnsafeCheckpointError) as exc:
        problem = exc
    problem = _agree(problem, distributed)
    if problem is not None:
        raise problem
    try:
        with warnings.catch_warnings():  # one process without a process group is exactly the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=not distributed)
    except CheckpointException as exc:
        raise _read_failure(folder, exc) from None
    except (OSError, RuntimeError, AssertionError, pickle.UnpicklingError) as exc:  # outside DCP's wrappers
        raise CheckpointReadError(f"{folder}: cannot read the checkpoint ({type(exc).__name__}: "
                                  f"{_first_line(exc)}); resume or export an older checkpoint") from None


def _agree(problem: BaseException | None, distributed: bool) -> BaseException | None:
    """Collective: the lowest rank's problem (or None) on every rank, so no rank enters DCP's collectives alone."""
    if not distributed or not (dist.is_available() and dist.is_initialized()):
        return problem
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if problem is None else (type(problem).__name__, str(problem)))
    for item in gathered:
        if item is not None:
            kind = UnsafeCheckpointError if item[0] == UnsafeCheckpointError.__name__ else CheckpointReadError
            return problem if problem is not None else kind(item[1])
    return None


def _failures(exc: CheckpointException) -> list[BaseException]:
    found = []
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            found.append(inner)
    return found


def _read_failure(folder: Path, exc: CheckpointException) -> ValueError:
    inner = _failures(exc)
    for e in inner:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise e
    for e in inner:
        if isinstance(e, (UnsafeCheckpointError, CheckpointReadError)):
            return e
    first = inner[0] if inner else exc
    if isinstance(first, FileNotFoundError):
        return CheckpointReadError(f"{folder}: {first.filename or 'a shard'} disappeared while it was read (was the "
                                   "checkpoint pruned by a running training?); read the run's newest checkpoint")
    return CheckpointReadError(f"{folder}: cannot read the checkpoint ({type(first).__name__}: {_first_line(first)}); "
                               "it is damaged: resume or export an older checkpoint")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------ pins against pruning


@contextlib.contextmanager
def pinned(folder: Path) -> Iterator[bool]:
    """Hold a shared lock on `folder/.pin` while reading it: the pruner skips a folder a reader holds.

    Yields True when the folder is pinned and still the one that was asked for (the pruner renames a folder away
    under its exclusive lock before deleting it, so a reader that got the lock late sees the name gone), False when
    it vanished (the caller re-resolves `latest` and tries again). Folders written before pins existed, and file
    systems without flock, are read unpinned (True).
    """
    try:
        fd = os.open(folder / PIN, os.O_RDONLY)
    except FileNotFoundError:  # vanished, or written before pins existed
        fd = None
    except OSError:  # unreadable pin: read unpinned
        fd = -1
    if fd is None or fd < 0:
        yield fd == -1 or folder.is_dir()
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            same = os.stat(folder / PIN).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        except OSError:  # no flock on this file system: read unpinned
            same = True
        yield same
    finally:
        os.close(fd)


def create_pin(folder: Path) -> None:
    (folder / PIN).touch()


def remove_unpinned(folder: Path, graveyard: Path) -> bool:
    """Delete `folder` unless a reader pins it (then keep it for the next prune): rename it to `graveyard` under an
    exclusive lock, then delete. Returns whether it was removed."""
    try:
        fd = os.open(folder / PIN, os.O_RDONLY)
    except FileNotFoundError:  # written before pins existed
        fd = None
    except OSError:
        return False
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a reader holds it
            except OSError:
                pass  # no flock here: delete as before pins existed
        if graveyard.exists():
            shutil.rmtree(graveyard, ignore_errors=True)
        try:
            os.replace(folder, graveyard)
        except OSError:
            return False
    finally:
        if fd is not None:
            os.close(fd)
    shutil.rmtree(graveyard, ignore_errors=True)
    return True


# ------------------------------------------------------------------------------------------------------ writing

_FULL = (errno.ENOSPC, errno.EDQUOT)
_LOW_SPACE = 1 << 20  # bytes free after a failed write below which the disk is called full


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo.extend(_failures(e))
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)


def write_failure(folder: Path, step_folder: str, latest: str | None, exc: BaseException) -> CheckpointWriteError:
    """One line for a failed checkpoint save into `folder` (KeyboardInterrupt/SystemExit pass through)."""
    causes = list(_chain(exc))
    for e in causes:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise e
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        free = None
    full = any(isinstance(e, OSError) and e.errno in _FULL for e in causes) or (free is not None and free < _LOW_SPACE)
    keeps = f"latest still names {latest}" if latest else "no earlier checkpoint exists"
    if full:
        room = f" ({free} bytes free)" if free is not None else ""
        return CheckpointWriteError(f"disk full while writing checkpoint {step_folder} at {folder}{room}; {keeps}. "
                                    "Free space (or lower checkpoint.keep, or move output_dir), then resume=auto")
    errors = [e for e in causes if not isinstance(e, CheckpointException)]
    first = errors[-1] if errors else exc
    return CheckpointWriteError(f"cannot write checkpoint {step_folder} at {folder} ({type(first).__name__}: "
                                f"{_first_line(first)}); {keeps}")
