"""Reading files mindvl did not write: bounded JSON, regular files only, measured before read, paths kept inside.

Every reader of a received file (records, shards, benchmarks, traces, model and run folders) goes through these, so
a tiny crafted file cannot exhaust memory or recursion, and a name inside a file cannot reach outside its folder.
A problem raises `UntrustedInputError` (a ValueError) with a message that says what was wrong; callers add the
file and turn it into a `BadSample` (records) or the CLI's one line, exit 2 (everything else).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a record or config (real ones nest a handful deep)
MAX_INT_DIGITS = 64  # digits of one JSON integer (int("9" * 5000) is slow, and over 4300 digits a ValueError)
MAX_IMAGE_BYTES = 256 << 20  # default limit on one image file or member read whole (data.max_image_bytes)
MAX_VIDEO_BYTES = 4 << 30  # default limit on one video file handed to the decoder (data.video.max_video_bytes)


class UntrustedInputError(ValueError):
    """A received file breaks a limit or a rule of this module (the message names what, the caller names where)."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UntrustedInputError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether `value` nests containers deeper than `max_depth` (iterative: no recursion on crafted input)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if d > max_depth:
            return True
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return False


def loads_json(data: str | bytes | bytearray, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` with a nesting-depth and an integer-size limit. Raises ValueError (JSONDecodeError,
    UnicodeDecodeError or UntrustedInputError) for anything it will not return."""
    try:
        value = json.loads(data, parse_int=_bounded_int)
    except RecursionError:
        raise UntrustedInputError(f"JSON nested deeper than {max_depth} levels") from None
    if json_depth_exceeds(value, max_depth):
        raise UntrustedInputError(f"JSON nested deeper than {max_depth} levels")
    return value


def load_json_file(path: str | os.PathLike, max_bytes: int = 64 << 20, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A small JSON file (a config, index or state file): a regular file, at most `max_bytes`, bounded JSON.
    Errors are UntrustedInputError/ValueError/OSError naming the file."""
    raw = read_regular(path, max_bytes, what="JSON file")
    try:
        return loads_json(raw, max_depth)
    except ValueError as exc:
        raise UntrustedInputError(f"{path}: not valid JSON within mindvl's limits ({exc})") from exc


# ------------------------------------------------------------------------------------------------------- files


def regular_size(path: str | os.PathLike, what: str = "file") -> int:
    """The size of `path` if it is a regular file (symlinks to regular files are followed); else an error naming
    what it is (a FIFO or device would block or never end)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedInputError(f"{path}: the {what} is not a regular file ({_kind(st.st_mode)})")
    return st.st_size


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


class TooLargeError(UntrustedInputError):
    """A regular file over the byte limit it is read under."""


def open_regular(path: str | os.PathLike, max_bytes: int, what: str = "file", key: str | None = None):
    """A binary file object on `path` once it is known to be a regular file of at most `max_bytes` (opened
    non-blocking, then checked with fstat, so a FIFO or device is refused without blocking or reading)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedInputError(f"{path}: the {what} is not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise TooLargeError(f"{path}: the {what} has {st.st_size} bytes, over the limit of {max_bytes}"
                                + (f" ({key})" if key else ""))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, max_bytes: int, what: str = "file", key: str | None = None) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, measured before reading (opened non-blocking, so a FIFO
    that appeared after the check does not hang; the read stops at max_bytes + 1 whatever the file claims)."""
    with open_regular(path, max_bytes, what, key) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLargeError(f"{path}: the {what} grew past the limit of {max_bytes} bytes while read")
    return data


def inside(root: str | os.PathLike, name: str, what: str = "path") -> str:
    """`root/name` when it stays inside `root` after resolving `..` and symlinks, else an UntrustedInputError."""
    root_real = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root_real, name))
    if os.path.commonpath([root_real, target]) != root_real:
        raise UntrustedInputError(f"{what} {name!r} resolves outside {root}")
    return target


def regular_inside(root: str | os.PathLike, name: str, what: str = "file") -> str:
    """`root/name` resolved, when it is a regular file inside `root`, or (an HF hub cache snapshot, whose files are
    links into the repository's `blobs/`) inside `root/../../blobs`; else an UntrustedInputError."""
    root_real = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root_real, name))
    homes = [root_real]
    if os.path.basename(os.path.dirname(root_real)) == "snapshots":
        homes.append(os.path.join(os.path.dirname(os.path.dirname(root_real)), "blobs"))
    if not any(os.path.commonpath([h, target]) == h for h in homes):
        raise UntrustedInputError(f"{os.path.join(root, name)}: the {what} resolves outside {root}")
    regular_size(target, what)
    return target


def plain_name(name: Any, what: str = "file name") -> str:
    """`name` if it is a plain file name (no folder part, not `.`/`..`, no NUL); else an UntrustedInputError."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        raise UntrustedInputError(f"{what} {name!r} is not a plain file name inside its folder")
    return name


# --------------------------------------------------------------------------------------------------------- npz

MAX_DEFLATE_RATIO = 1100  # DEFLATE cannot expand more than ~1032x; a larger declared ratio is a lie or a bomb


def check_npz(path: str | os.PathLike, max_bytes: int | None = None) -> None:
    """Before `np.load`: every member of the .npz is stored or deflated (never bzip2/lzma, whose ratios are
    unbounded), declares an uncompressed size DEFLATE can reach from its compressed size, and holds one .npy array
    whose header's shape x itemsize fits in that declared size (numpy allocates what the header says before it
    reads). `max_bytes` bounds the sum of the arrays. Raises UntrustedInputError naming the member."""
    import zipfile
    from math import prod

    import numpy as np

    total = 0
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise UntrustedInputError(f"member {name} uses compression method {info.compress_type} (only stored "
                                          "or deflated members are read)")
            if info.file_size > info.compress_size * MAX_DEFLATE_RATIO + 4096:
                raise UntrustedInputError(f"member {name} declares {info.file_size} bytes from "
                                          f"{info.compress_size} compressed (a compression bomb)")
            with zf.open(info) as f:
                try:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                except ValueError as exc:
                    raise UntrustedInputError(f"member {name} is not a readable .npy array ({exc})") from None
            nbytes = prod(shape) * dtype.itemsize
            if nbytes > info.file_size:
                raise UntrustedInputError(f"member {name} declares shape {tuple(shape)} ({nbytes} bytes) but holds "
                                          f"{info.file_size} bytes")
            total += nbytes
    if max_bytes is not None and total > max_bytes:
        raise UntrustedInputError(f"its arrays hold {total} bytes, over the limit of {max_bytes}")
