"""Reading sources: JSONL files and WebDataset tar shards, split over (rank, worker), resumable.

A source is a list of files (globs expanded, sorted). Each epoch its files are shuffled with a seed derived from
(seed, source, epoch), laid end to end, and the whole is cut into as many stretches of equal bytes as there are
reading slots (ranks x workers); slot s reads stretch (s + r) mod n_slots, r a seeded rotation per epoch. A stretch
is a list of *units*, byte ranges of files: a JSONL line belongs to the range holding its first byte (a range finds
its first line by reading forward from its start offset, never by scanning from byte 0), a tar key to the range
holding its first member's header. So every slot reads the same number of bytes per epoch, however many records
each file holds (dealing whole files made a 2-rank run over 97/143/66-record files train 56 records twice and 56
never in one epoch's steps), every record is read once per epoch across all slots, and all ranks agree on the deal
without talking to each other. A source with fewer records than slots leaves some slots' shares empty in an epoch;
those slots move on to the next epoch (the rotation gives every slot its turn at every record).

A `SourceReader` walks one slot's units and yields `RawItem`s; its position (epoch, unit, byte offset, line) is its
whole state. `read_ref(ref)` reads one record again from its byte offset, which is how the packing buffer is
restored on resume without storing samples in the checkpoint.

Records are measured before they are parsed: a JSONL line (or a tar key's text members together) longer than
`max_record_bytes` is never held whole, never JSON-parsed; it comes out as a `BadSample` with reason
`record_too_large` (file:line or shard:key), and the reader skips over it in 1 MiB chunks. Image and video members
of a tar key do not count there: each is measured from its header against `max_image_bytes` (`image_too_large`,
unread; a sparse member declaring gigabytes in a tiny shard is one), and its decoded size against `max_image_pixels`.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import random
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from mindvl.untrusted import MAX_IMAGE_BYTES, UntrustedInputError, inside, loads_json

from .config import SourceConfig
from .records import parse_record
from .schema import BadSample, Conversation, ImageRef, SampleRef

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_MEMBER_EXTENSIONS = ("mp4", "avi", "mkv", "mov", "webm", "m4v")  # as mindvl.data.video.VIDEO_EXTENSIONS
READ_CHUNK = 1 << 20  # how much of an over-long line is held at once while it is skipped


def resolve_files(paths: list[str], fmt: str, where: str) -> list[tuple[str, str]]:
    """Expand globs (sorted) into [(path, format)]. Missing, unreadable or all-empty sources raise clear errors."""
    files: list[str] = []
    for pattern in paths:
        pattern = os.path.expanduser(pattern)
        matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matched = [m for m in matched if not os.path.isdir(m)]
        if not matched:
            raise FileNotFoundError(f"{where}: no file matches {pattern!r}")
        files.extend(matched)
    out = []
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where}: file not found: {path}")
        if not os.access(path, os.R_OK):
            raise FileNotFoundError(f"{where}: file is not readable: {path}")
        kind = fmt if fmt != "auto" else ("tar" if path.endswith(".tar") else "jsonl")
        out.append((os.path.abspath(path), kind))
    if sum(os.path.getsize(p) for p, _ in out) == 0:
        raise ValueError(f"{where}: every file is empty ({len(out)} file(s)); an empty source would train on nothing")
    return out


@dataclass(frozen=True)
class Unit:
    """Part `part` of `parts` of file `file` (index into the source's file list), or, given `lo`/`hi`, the records of
    that file whose first byte (a tar key's first header) lies in [lo, hi)."""

    file: int
    part: int
    parts: int
    lo: int | None = None
    hi: int | None = None

    @property
    def span(self) -> tuple[int, int] | None:
        return None if self.lo is None or self.hi is None else (self.lo, self.hi)


def derived_seed(*parts: Any) -> int:
    """A stable 64-bit seed from any values (hashlib, not Python's salted hash())."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def empty_epoch_limit(n_slots: int) -> int:
    """Consecutive epochs without a record after which a slot gives up on a source. A record lands in a given
    slot's share with probability 1/n_slots per epoch (the seeded rotation of the stretches), so a source with even
    one record fails this with probability below (1 - 1/n)^(32n + 32) < e^-32."""
    return 32 * n_slots + 32


def tar_data_end(path: str, size: int) -> int:
    """Where a tar shard's members end: the zero blocks after them (end-of-archive marker, padding to tar's 10 KiB
    records) are not data. Reads the last 64 KiB."""
    tail = min(size, 1 << 16)
    with open(path, "rb") as f:
        f.seek(size - tail)
        data = f.read(tail)
    end = size - tail + len(data.rstrip(b"\0"))
    return min(size, -(-end // 512) * 512)


def file_weights(files: list[tuple[str, str]]) -> list[int]:
    """Bytes of records per file, what the deal splits evenly: a JSONL file's size, a tar shard's up to where its
    members end (a tiny shard is mostly padding). Measured once per reader: a stat per file, plus a 64 KiB read at
    the end of each tar shard."""
    return [tar_data_end(path, os.path.getsize(path)) if kind == "tar" else os.path.getsize(path)
            for path, kind in files]


def slot_units(weights: list[int], n_slots: int, slot: int, seed: int, source: int, epoch: int) -> list[Unit]:
    """Slot `slot`'s units of one epoch: its stretch of the epoch's shuffled files laid end to end (`weights`: bytes
    per file, `file_weights`), cut at multiples of total/n_slots bytes. Together the slots' units cover every byte of
    every file exactly once, so every record is read once per epoch across all slots (a record belongs to the unit
    holding its first byte), and the slots' shares of bytes differ by at most one."""
    order = list(range(len(weights)))
    rng = random.Random(derived_seed("units", seed, source, epoch))
    rng.shuffle(order)
    stretch = (slot + rng.randrange(n_slots)) % n_slots
    total = sum(weights)
    lo, hi = total * stretch // n_slots, total * (stretch + 1) // n_slots
    units, start = [], 0
    for f in order:
        a, b = max(lo, start), min(hi, start + weights[f])
        if a < b:
            units.append(Unit(f, 0, 1, a - start, b - start))
        start += weights[f]
    return units


def legacy_slot_units(n_files: int, n_slots: int, slot: int, seed: int, source: int, epoch: int) -> list[Unit]:
    """The deal of data states written before byte stretches (stream state version 1): whole files (cut into
    `parts` when there were fewer files than slots) shuffled and dealt round-robin. Only read to continue such a
    state through the elastic path."""
    parts = max(1, -(-n_slots // n_files))
    units = [Unit(f, p, parts) for f in range(n_files) for p in range(parts)]
    random.Random(derived_seed("units", seed, source, epoch)).shuffle(units)
    return units[slot::n_slots]


@dataclass
class RawItem:
    """One record as read from disk, before parsing: a JSONL line or a tar key's members (suffix -> bytes)."""

    ref: SampleRef
    where: str
    kind: str  # jsonl | tar
    line: bytes = b""
    members: dict[str, bytes] | None = None
    base_dir: str = ""
    key: str = ""
    # Its source trusts images named by absolute path (SourceConfig.absolute_paths); else only paths inside
    # the records' folder are read (a received corpus must not make mindvl read ~/.netrc into a training sample).
    absolute_paths: bool = False


# ----------------------------------------------------------------------------------------------------------- JSONL


def _skip_line(f: io.BufferedReader) -> int:
    """Read past the rest of the current line (newline included) in bounded chunks (8 KiB, growing to READ_CHUNK:
    a typical line costs one small read, a huge one is scanned at memchr speed); the bytes skipped."""
    n, size = 0, 8192
    while True:
        chunk = f.read(size)
        if not chunk:
            return n
        i = chunk.find(b"\n")
        if i >= 0:
            f.seek(i + 1 - len(chunk), io.SEEK_CUR)
            return n + i + 1
        n, size = n + len(chunk), min(2 * size, READ_CHUNK)


def _text_bytes(f: io.BufferedReader, offset: int, n: int) -> int:
    """Length of the line of `n` bytes at `offset` without its line ending (one byte is read back)."""
    f.seek(offset + n - 1)
    return n - 1 if f.read(1) == b"\n" else n


def read_bounded_line(f: io.BufferedReader, limit: int | None) -> tuple[bytes | None, int]:
    """(the next line, its length in bytes with the newline). A line whose text (newline excluded) is longer than
    `limit` bytes comes back as None: it is skipped in chunks, so at most `limit` + 1 MiB of it is ever held."""
    if limit is None:
        raw = f.readline()
        return raw, len(raw)
    raw = f.readline(limit + 1)
    if len(raw) <= limit or raw.endswith(b"\n"):
        return raw, len(raw)
    n = len(raw)
    del raw  # the part read so far is dropped before the rest is skipped
    return None, n + _skip_line(f)


def _jsonl_start(f: io.BufferedReader, lo: int) -> tuple[int, int]:
    """(byte offset, line number) of the first line whose first byte is at or after `lo`.

    Only a range starting at byte 0 knows its line numbers (1-based); the others read forward from their start
    offset to the next line start instead of counting lines from byte 0 (which made every part start a scan of the
    file, in every slot, every epoch). They report line 0 ("unknown"), and their records are named by byte offset
    instead."""
    if lo == 0:
        return 0, 1
    f.seek(lo - 1)
    return lo - 1 + _skip_line(f), 0  # the line straddling lo belongs to the range before


def next_line_start(path: str, pos: int) -> tuple[int, int]:
    """(byte offset of the first line starting at or after `pos`, its line number or 0 when not known)."""
    with open(path, "rb") as f:
        return _jsonl_start(f, pos)


def jsonl_where(path: str, offset: int, line: int) -> str:
    """How messages name a JSONL record: file:line, or file@byte when the line number is not known."""
    return f"{path}:{line}" if line > 0 else f"{path}@byte{offset}"


def too_large(where: str, size: int, limit: int, what: str = "record",
              key: str = "data.max_record_bytes") -> BadSample:
    """The `record_too_large` BadSample (`key`: the setting that holds `limit`, as the message names it)."""
    return BadSample("record_too_large", where,
                     f"{what} is {size} bytes, over {key} = {limit}; it is skipped without being "
                     f"parsed (shorten or split it, or raise {key})")


def iter_jsonl(path: str, file_index: int, source: int, unit: Unit, offset: int | None, line: int,
               max_bytes: int | None = None, span: tuple[int, int] | None = None) -> Iterator[
    tuple[RawItem | BadSample, int, int]
]:
    """Yield (item, next_offset, next_line) for the lines of `unit` (or, given `span` = (lo, hi), of the lines whose
    first byte is in [lo, hi)), starting at `offset` (None: the range's start). A line over `max_bytes` is yielded
    as a `record_too_large` BadSample without being held or parsed."""
    size = os.path.getsize(path)
    lo, hi = span if span is not None else (size * unit.part // unit.parts, size * (unit.part + 1) // unit.parts)
    hi = min(hi, size)
    with open(path, "rb") as f:
        if offset is None:
            offset, line = _jsonl_start(f, lo)
        f.seek(offset)
        base_dir = os.path.dirname(path)
        while offset < hi:
            raw, n = read_bounded_line(f, max_bytes)
            if not n:
                break
            this_offset, this_line = offset, line
            offset += n
            line += 1 if line > 0 else 0  # 0: unknown (a part that starts mid-file)
            where = jsonl_where(path, this_offset, this_line)
            if raw is None:
                bad = too_large(where, _text_bytes(f, this_offset, n), max_bytes)  # type: ignore[arg-type]
                f.seek(offset)
                yield bad, offset, line
                continue
            if not raw.strip():
                continue  # blank lines are not records
            ref = SampleRef(source, file_index, this_offset, this_line)
            item = RawItem(ref, where, "jsonl", line=raw, base_dir=base_dir)
            yield item, offset, line


def read_jsonl_line(path: str, ref: SampleRef, max_bytes: int | None = None) -> RawItem | BadSample:
    where = jsonl_where(path, ref.offset, ref.line)
    with open(path, "rb") as f:
        f.seek(ref.offset)
        raw, n = read_bounded_line(f, max_bytes)
        if raw is None:
            return too_large(where, _text_bytes(f, ref.offset, n), max_bytes)  # type: ignore[arg-type]
    return RawItem(ref, where, "jsonl", line=raw, base_dir=os.path.dirname(path))


# ------------------------------------------------------------------------------------------------------------- tar


def _split_key(name: str) -> tuple[str, str]:
    """WebDataset naming: 'dir/abc.0.jpg' -> key 'dir/abc', suffix '0.jpg' (the key ends at the basename's first
    dot)."""
    dirname, base = os.path.split(name)
    stem, dot, suffix = base.partition(".")
    return (os.path.join(dirname, stem) if dirname else stem), suffix


class ShardError(Exception):
    """A tar shard that cannot be read further (truncated or corrupt headers)."""


def iter_tar(path: str, file_index: int, source: int, unit: Unit, offset: int | None, ordinal: int,
             max_bytes: int | None = None, span: tuple[int, int] | None = None,
             max_media_bytes: int = MAX_IMAGE_BYTES) -> Iterator[
    tuple[RawItem | BadSample, int, int]
]:
    """Yield (item or BadSample, next_offset, next_ordinal) for the keys of `unit` (every parts-th key), and given
    `span` = (lo, hi) only those whose first member's header offset is in [lo, hi) (the reader still starts at
    `offset`, a header offset, and walks the headers up to lo; member data is only read for yielded keys).

    `offset` is the header offset of the next key's first member and `ordinal` its 0-based key index in the shard.
    A key whose text members (everything but images and videos) add up to more than `max_bytes` is yielded as a
    `record_too_large` BadSample, its members unread; one whose image or video member is over `max_media_bytes`
    (measured from its header) as an `image_too_large` BadSample.
    """
    offset = 0 if offset is None else offset
    lo, hi = span if span is not None else (0, None)
    with open(path, "rb") as f:
        f.seek(offset)
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.ReadError as exc:
            if offset == 0 and os.path.getsize(path) > 0:
                raise ShardError(f"{path}: not a readable tar shard ({exc})") from exc
            return  # an empty remainder (offset at the end-of-archive blocks)
        group: list[tarfile.TarInfo] = []
        key = None
        while True:
            try:
                member = tf.next()
            except (tarfile.ReadError, EOFError, OSError) as exc:
                if group and ordinal % unit.parts == unit.part and group[0].offset >= lo:
                    # The pending key's last member is cut off: report it by shard:key, then give up on the shard.
                    bad = BadSample("tar_member_unreadable", f"{path}:{key}",
                                    f"shard is truncated or corrupt in this key ({exc}); the rest of the shard is "
                                    "skipped; re-create it")
                    yield bad, os.path.getsize(path), ordinal + 1
                    return
                raise ShardError(f"{path}: tar shard is truncated or corrupt after offset {offset} ({exc})") from exc
            if member is not None and not member.isfile():
                continue
            member_key = _split_key(member.name)[0] if member is not None else None
            if group and member_key != key:
                next_offset = member.offset if member is not None else os.path.getsize(path)
                if ordinal % unit.parts == unit.part and group[0].offset >= lo:
                    yield (_read_group(tf, path, file_index, source, key, group, ordinal, max_bytes,
                                       max_media_bytes), next_offset, ordinal + 1)
                ordinal += 1
                offset = next_offset
                group = []
            if member is None:
                return
            if not group and hi is not None and member.offset >= hi:
                return  # the next key starts past this range
            key = member_key
            group.append(member)


def tar_keys(path: str, unit: Unit, offset: int | None, ordinal: int, span: tuple[int, int]) -> list[
    tuple[int, int, int]
]:
    """(header offset, key ordinal, bytes up to the next key) of every key of `unit` whose first header lies in
    span = [lo, hi), walking the headers from `offset` (a key's first header, key ordinal `ordinal`); only headers are
    read. Where the shard becomes unreadable the list ends (the reader reports the damage when it gets there)."""
    lo, hi = span
    out: list[tuple[int, int, int]] = []
    with open(path, "rb") as f:
        f.seek(offset or 0)
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.ReadError:
            return out
        start, key = None, None
        while True:
            try:
                member = tf.next()
                end = member.offset if member is not None else tf.offset
            except (tarfile.ReadError, EOFError, OSError):
                member, end = None, os.path.getsize(path)
            if member is not None and not member.isfile():
                continue
            member_key = _split_key(member.name)[0] if member is not None else None
            if start is not None and member_key != key:
                if ordinal % unit.parts == unit.part and start >= lo:
                    out.append((start, ordinal, end - start))
                ordinal, start = ordinal + 1, None
            if member is None:
                return out
            if start is None:
                if member.offset >= hi:
                    return out
                start, key = member.offset, member_key


def _is_media(suffix: str) -> bool:
    ext = suffix.rsplit(".", 1)[-1].lower()
    return ext in IMAGE_EXTENSIONS or ext in VIDEO_MEMBER_EXTENSIONS


def _read_group(tf: tarfile.TarFile, path: str, file_index: int, source: int, key: str,
                members: list[tarfile.TarInfo], ordinal: int, max_bytes: int | None = None,
                max_media_bytes: int = MAX_IMAGE_BYTES) -> RawItem | BadSample:
    ref = SampleRef(source, file_index, members[0].offset, ordinal)
    where = f"{path}:{key}"
    if max_bytes is not None:  # measured from the headers, before any member is read
        text = sum(m.size for m in members if not _is_media(_split_key(m.name)[1]))
        if text > max_bytes:
            return too_large(where, text, max_bytes, "the key's text (its non-image members)")
    for m in members:  # images and videos: each measured from its header (a sparse member can declare gigabytes)
        if _is_media(_split_key(m.name)[1]) and m.size > max_media_bytes:
            return BadSample("image_too_large", where, f"member {m.name} is {m.size} bytes, over data.max_image_bytes "
                             f"= {max_media_bytes}; it is not read (raise the limit if the file is genuine)")
    data: dict[str, bytes] = {}
    for m in members:
        suffix = _split_key(m.name)[1]
        try:
            fobj = tf.extractfile(m)
            if fobj is None:
                raise tarfile.ReadError("not a regular file")
            data[suffix] = fobj.read()
            if len(data[suffix]) != m.size:
                raise tarfile.ReadError(f"read {len(data[suffix])} of {m.size} bytes")
        except (tarfile.TarError, OSError, EOFError) as exc:
            return BadSample("tar_member_unreadable", where,
                             f"member {m.name} is unreadable ({exc}); re-create the shard")
    return RawItem(ref, where, "tar", members=data, key=key)


def read_tar_key(path: str, ref: SampleRef, max_bytes: int | None = None,
                 max_media_bytes: int = MAX_IMAGE_BYTES) -> RawItem | BadSample:
    """Read the key whose first member's header is at ref.offset."""
    unit = Unit(0, 0, 1)
    for item, _, _ in iter_tar(path, ref.file, ref.source, unit, ref.offset, ref.line, max_bytes,
                               max_media_bytes=max_media_bytes):
        return item
    raise ShardError(f"{path}: no key at offset {ref.offset}; the shard changed since the checkpoint")


# ---------------------------------------------------------------------------------------------------- raw -> record


def item_to_conversation(item: RawItem) -> Conversation:
    """Parse a RawItem into a validated Conversation (BadSample on any problem)."""
    if item.kind == "jsonl":
        try:
            record = loads_json(item.line)
        except ValueError as exc:  # malformed, not UTF-8, nested too deep, or an integer too long
            raise BadSample("bad_json", item.where, f"malformed JSON line ({exc}); fix or delete the line") from exc

        def resolve(name: str) -> ImageRef:
            if os.path.isabs(name):
                if item.absolute_paths:
                    return ImageRef(name)
                raise BadSample("image_absolute", item.where, f"image {name!r} is an absolute path; records are read "
                                "with images inside their folder unless their source is trusted (a training recipe: "
                                f"absolute_paths: true on data source {item.ref.source})")
            base = os.path.normpath(item.base_dir)
            if item.absolute_paths:  # a trusted source may link its folder to an image store elsewhere
                path = os.path.normpath(os.path.join(base, name))
                if os.path.commonpath([base, path]) == base:
                    return ImageRef(path)
            else:  # `../../home/.netrc`, or `img.png -> /home/user/.netrc`: symlinks resolved, as curate checks
                try:
                    return ImageRef(inside(base, name, "image"))
                except UntrustedInputError:
                    pass
            raise BadSample("image_outside", item.where, f"image {name!r} resolves outside the record's folder "
                            f"{base} (through `..` or a symlink); give a path to a file inside it (or an absolute "
                            f"path, with absolute_paths: true on data source {item.ref.source} if you trust it)")

        return parse_record(record, item.where, resolve)

    members = item.members or {}
    caption = None
    if "txt" in members:  # a WebDataset caption shard: image + txt (the .json, if any, is metadata)
        try:
            caption = members["txt"].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadSample("bad_record", item.where, f"txt member is not UTF-8 ({exc}); re-create the shard") from exc
    if "json" not in members and caption is None:
        raise BadSample("bad_record", item.where, "key has no .json record member (nor a .txt caption)")
    try:
        record = loads_json(members["json"]) if "json" in members else {}
    except ValueError as exc:
        raise BadSample("bad_json", item.where, f"malformed .json member ({exc}); re-create the shard") from exc
    image_suffixes = sorted(
        (s for s in members if s.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS), key=_natural_key
    )

    def resolve_member(name: str) -> ImageRef:
        for suffix in (name, name[len(item.key) + 1:] if name.startswith(item.key + ".") else None):
            if suffix is not None and suffix in members:
                return ImageRef(f"{item.where}.{suffix}", members[suffix])
        raise BadSample("missing_image", item.where, f"image {name!r} is not a member of this key")

    return parse_record(record, item.where, resolve_member, image_suffixes, caption)


def _natural_key(s: str) -> list:
    out: list = []
    for part in s.split("."):
        out.append((0, int(part), "") if part.isdigit() else (1, 0, part))
    return out


# ------------------------------------------------------------------------------------------------------ the reader


@dataclass
class ReaderState:
    """Position of one source in one slot: the next record is unit `unit` of `epoch`, at byte `offset` (None: the
    unit's start) with line number / key ordinal `line`.

    `carry` holds pieces handed over by an elastic resume (mindvl.data.elastic), read before the regular epochs:
    each is [epoch, file, part, parts, offset or None, line, lo, hi]: the records of unit (file, part of parts) of
    an earlier slot layout whose first byte (a tar key's first header) lies in [lo, hi), read from `offset` on
    (pieces of six entries, written before byte ranges existed, are the whole unit)."""

    epoch: int = 0
    unit: int = 0
    offset: int | None = None
    line: int = 0
    carry: list[list] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {"epoch": self.epoch, "unit": self.unit, "offset": self.offset, "line": self.line}
        if self.carry:
            d["carry"] = [list(p) for p in self.carry]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ReaderState:
        return cls(int(d["epoch"]), int(d["unit"]), None if d["offset"] is None else int(d["offset"]), int(d["line"]),
                   [list(p) for p in d.get("carry", [])])


class SourceReader:
    """Reads one source's records for one slot, epoch after epoch (or one epoch if `max_epochs=1`).

    `next()` returns a RawItem, or a BadSample for a record that was unreadable at the container level (tar member,
    truncated shard); `None` when `max_epochs` is reached.
    """

    def __init__(self, cfg: SourceConfig, source: int, files: list[tuple[str, str]], slot: int, n_slots: int,
                 seed: int, max_epochs: int | None = None, state: ReaderState | None = None,
                 max_record_bytes: int | None = None, max_media_bytes: int = MAX_IMAGE_BYTES):
        self.cfg, self.source, self.files = cfg, source, files
        self.slot, self.n_slots, self.seed, self.max_epochs = slot, n_slots, seed, max_epochs
        self.max_record_bytes = max_record_bytes
        self.max_media_bytes = max_media_bytes
        self.state = state or ReaderState()
        self._weights: list[int] | None = None  # file_weights, measured once (the deal of every epoch uses them)
        self._it: Iterator | None = None
        self._units: list[Unit] | None = None
        self._units_epoch = -1

    def _epoch_units(self) -> list[Unit]:
        if self._units_epoch != self.state.epoch:
            if self._weights is None:
                self._weights = file_weights(self.files)
            self._units = slot_units(self._weights, self.n_slots, self.slot, self.seed, self.source, self.state.epoch)
            self._units_epoch = self.state.epoch
        return self._units  # type: ignore[return-value]

    def next(self) -> RawItem | BadSample | None:
        return self._with_source_rules(self._read())

    def _with_source_rules(self, item):
        """What the source's config says about reading its records travels with each raw item."""
        if isinstance(item, RawItem) and self.cfg.absolute_paths:
            return replace(item, absolute_paths=True)
        return item

    def _read(self) -> RawItem | BadSample | None:
        while self.state.carry:
            item = self._next_carried()
            if item is not None:
                return item
        start_epoch = self.state.epoch
        while True:
            if self.max_epochs is not None and self.state.epoch >= self.max_epochs:
                return None
            if self.state.epoch > start_epoch + empty_epoch_limit(self.n_slots):
                # A source with fewer records than slots leaves some slots without a record in an epoch; that is
                # normal (the slot moves on to the next epoch's deal). This many empty epochs in a row means the
                # source has no records at all (e.g. only blank lines).
                raise ValueError(
                    f"source {self.cfg.name!r}: no record in {self.state.epoch - start_epoch} epochs for reading slot "
                    f"{self.slot} of {self.n_slots}; the source's files hold no records")
            units = self._epoch_units()
            if self.state.unit >= len(units):
                self.state = ReaderState(self.state.epoch + 1, 0, None, 0)
                self._it = None
                continue
            if self._it is None:
                unit = units[self.state.unit]
                path, kind = self.files[unit.file]
                opener = self._opener(kind)
                self._it = opener(path, unit.file, self.source, unit, self.state.offset, self.state.line,
                                  self.max_record_bytes, unit.span)
            try:
                item, offset, line = next(self._it)
            except StopIteration:
                self._advance_unit()
                continue
            except ShardError as exc:
                # The rest of this shard is unreadable: report it once and go on with the next unit.
                unit = units[self.state.unit]
                self._advance_unit()
                return BadSample("tar_unreadable", self.files[unit.file][0], f"{exc}; the rest of the shard is skipped")
            except OSError as exc:
                unit = units[self.state.unit]
                raise FileNotFoundError(f"cannot read {self.files[unit.file][0]}: {exc}") from exc
            self.state = ReaderState(self.state.epoch, self.state.unit, offset, line)
            return item

    def _next_carried(self) -> RawItem | BadSample | None:
        """The next record of the first carried piece (None when that piece is used up: it is dropped)."""
        epoch, file, part, parts, offset, line, *span = self.state.carry[0]
        path, kind = self.files[file]
        if self._it is None:
            opener = self._opener(kind)
            self._it = opener(path, file, self.source, Unit(file, part, parts), offset, line, self.max_record_bytes,
                              (int(span[0]), int(span[1])) if span else None)
        try:
            item, offset, line = next(self._it)
        except StopIteration:
            self.state = replace(self.state, carry=self.state.carry[1:])
            self._it = None
            return None
        except ShardError as exc:
            self.state = replace(self.state, carry=self.state.carry[1:])
            self._it = None
            return BadSample("tar_unreadable", path, f"{exc}; the rest of the shard is skipped")
        self.state = replace(self.state, carry=[[epoch, file, part, parts, offset, line, *span],
                                                *self.state.carry[1:]])
        return item

    def _opener(self, kind: str):
        return partial(iter_tar, max_media_bytes=self.max_media_bytes) if kind == "tar" else iter_jsonl

    def _advance_unit(self) -> None:
        self.state = ReaderState(self.state.epoch, self.state.unit + 1, None, 0, self.state.carry)
        self._it = None

    def read_ref(self, ref: SampleRef) -> RawItem | BadSample:
        path, kind = self.files[ref.file]
        if kind == "tar":
            return self._with_source_rules(read_tar_key(path, ref, self.max_record_bytes, self.max_media_bytes))
        return self._with_source_rules(read_jsonl_line(path, ref, self.max_record_bytes))
