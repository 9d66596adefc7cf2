"""Reading curation inputs and writing shards.

Inputs are the formats mindvl trains on: JSONL with image files beside it, WebDataset tar shards (read with
mindvl.data's own readers, so a record curate accepts is a record `mindvl train` accepts), and parquet files with
image bytes. The unit of work is a *shard*: one input file, or one of `split` parts of it (a JSONL byte range or
every split-th tar key, exactly mindvl.data's `Unit`; parquet row groups dealt round-robin).

Outputs are WebDataset tar shards in mindvl's layout: `<key>.json` (the record without image names), `<key>.0.png`,
`<key>.1.jpg`... (the original bytes), plus `<key>.meta.json` (curation annotations; ignored by the trainer). Vectors
(embeddings) go to a sidecar `<shard>.arrays.npz` in the work folder. Files appear atomically (written to a
temporary name, then renamed), with fixed tar header fields so equal inputs give byte-identical shards.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mindvl.data.records import parse_record
from mindvl.data.schema import BadSample, ImageRef
from mindvl.data.sources import RawItem, Unit, item_to_conversation, iter_jsonl, iter_tar, too_large
from mindvl.untrusted import MAX_IMAGE_BYTES, TooLargeError, UntrustedInputError, inside, loads_json, read_regular

from .items import Item, image_extension

SHARDS_DIR = "shards"  # OUT/shards/*.tar: a run's trainable output (the runner writes it, iter_output reads it)

INPUT_FORMATS = ("auto", "jsonl", "tar", "parquet")
MAX_RECORD_BYTES_KEY = "max_record_bytes"  # the pipeline file's key, as record_too_large messages name it


@dataclass(frozen=True)
class ShardTask:
    """One unit of work: part `part` of `parts` of `path` (format `kind`), written as shard `name`."""

    name: str
    path: str
    kind: str
    part: int = 0
    parts: int = 1
    max_record_bytes: int | None = None  # a record (JSONL line, tar key's text, parquet record cell) over it is skipped

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "kind": self.kind, "part": self.part, "parts": self.parts,
                "max_record_bytes": self.max_record_bytes}

    @classmethod
    def from_dict(cls, d: dict) -> ShardTask:
        return cls(d["name"], d["path"], d["kind"], int(d["part"]), int(d["parts"]), d.get("max_record_bytes"))


def input_kind(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.endswith(".tar"):
        return "tar"
    if path.endswith(".parquet"):
        return "parquet"
    return "jsonl"


def input_tasks(files: list[str], fmt: str, split: int, max_record_bytes: int | None = None) -> list[ShardTask]:
    """Shards in a fixed order: file by file, part by part. Names carry no dots (they become tar key prefixes)."""
    tasks = []
    for path in files:
        kind = input_kind(path, fmt)
        for part in range(split):
            tasks.append(ShardTask(f"s{len(tasks):05d}", os.path.abspath(path), kind, part, split, max_record_bytes))
    return tasks


# ------------------------------------------------------------------------------------------------------- readers


def _strip_image_names(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("images", "image")}


def _jsonl_item(task: ShardTask, ordinal: int, raw: RawItem) -> Item:
    # validation exactly as the trainer does it (BadSample on any problem); every image path, absolute or not, is
    # then checked below to be a regular file inside the record's folder before its bytes are copied
    conv = item_to_conversation(replace(raw, absolute_paths=True))
    if getattr(conv, "videos", None):
        raise BadSample("video_unsupported", raw.where, "records with videos are not curated (image stages only); "
                        "curate them apart")
    images = []
    for ref in conv.images:
        if ref.data is not None:
            images.append(ref.data)
            continue
        try:  # the bytes are copied into the output: only a regular file inside the record's folder, measured first
            inside(raw.base_dir, ref.name, "image")  # symlinks resolved: a link to a secret is not copied either
            images.append(read_regular(ref.name, MAX_IMAGE_BYTES, "image"))
        except TooLargeError as exc:
            raise BadSample("image_too_large", raw.where, f"{exc}; it is not read") from exc
        except UntrustedInputError as exc:
            raise BadSample("missing_image", raw.where, str(exc)) from exc
        except OSError as exc:
            raise BadSample("missing_image", raw.where, f"image file not found or unreadable: {ref.name}") from exc
    members = raw.members or {}
    record = loads_json(raw.line) if raw.kind == "jsonl" else (loads_json(members["json"]) if "json" in members
                                                               else {})
    if getattr(conv, "kind", "chat") == "caption":
        record["caption"] = conv.text  # a tar key's txt caption goes into the written record
    return Item(f"{task.name}/{ordinal:08d}", _strip_image_names(record), images, raw.where,
                meta={"source": task.path})


def _iter_parquet(task: ShardTask) -> Iterator[Item | BadSample]:
    """Parquet rows: a `json` (or `record`) column holding the record as a JSON string, or `messages` /
    `conversations` columns (JSON strings or lists of structs), or a `caption` (or document `text`) column; images
    in `images` (a list of binary or of {bytes, path} structs) or `image` (binary or a struct)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(task.path)
    ordinal = 0
    for rg in range(pf.num_row_groups):
        if rg % task.parts != task.part:
            continue
        for row_i, row in enumerate(pf.read_row_group(rg).to_pylist()):
            where = f"{task.path}:rowgroup{rg}:row{row_i}"
            ordinal += 1
            try:
                yield _parquet_item(task, ordinal - 1, row, where)
            except BadSample as bad:
                yield bad


def _image_bytes(value: Any, where: str) -> bytes:
    if isinstance(value, dict):
        value = value.get("bytes")
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise BadSample("missing_image", where, "image cell holds no bytes")
    return bytes(value)


def _record_cells_bytes(row: dict) -> int:
    """The bytes of a parquet row's record cells (the text the record is parsed from; images do not count)."""
    cells = [row.get(c) for c in ("json", "record", "messages", "conversations", "system", "caption", "text")]
    return sum(len(c.encode()) if isinstance(c, str) else len(json.dumps(c).encode()) if c is not None else 0
               for c in cells)


def _parquet_item(task: ShardTask, ordinal: int, row: dict, where: str) -> Item:
    limit = task.max_record_bytes
    if limit is not None and (size := _record_cells_bytes(row)) > limit:
        # pyarrow has read the row group already (its size is the file writer's choice); what is bounded here is
        # the parsing and everything after it, as the trainer's readers bound it
        raise too_large(where, size, limit, key=MAX_RECORD_BYTES_KEY)
    raw_record = row.get("json", row.get("record"))
    if raw_record is not None:
        try:
            record = loads_json(raw_record)
        except (ValueError, TypeError) as exc:  # malformed, nested too deep, an integer too long, not a string
            raise BadSample("bad_json", where, f"malformed JSON in the record column ({exc})") from exc
    else:
        record = {}
        for col in ("messages", "conversations", "system", "caption", "text"):
            value = row.get(col)
            if value is not None and isinstance(value, str) and col in ("messages", "conversations"):
                try:
                    value = loads_json(value)
                except ValueError as exc:
                    raise BadSample("bad_json", where, f"malformed JSON in the {col} column ({exc})") from exc
            if value is not None:
                record[col] = value
    cells = row.get("images", row.get("image"))
    cells = [] if cells is None else (cells if isinstance(cells, list) else [cells])
    images = [_image_bytes(c, where) for c in cells]
    names = [f"{i}.png" for i in range(len(images))]
    parse_record(record if isinstance(record, dict) else None, where,
                 lambda name: ImageRef(name, images[names.index(name)]), names)
    return Item(f"{task.name}/{ordinal:08d}", _strip_image_names(record), images, where, meta={"source": task.path})


def iter_input(task: ShardTask) -> Iterator[Item | BadSample]:
    """The records of one input shard as Items, or BadSample for each record that cannot be used."""
    if task.kind == "parquet":
        yield from _iter_parquet(task)
        return
    unit = Unit(0, task.part, task.parts)
    opener = iter_tar if task.kind == "tar" else iter_jsonl
    # mindvl.data's bounded readers: a line or tar key's text over the limit is never held whole nor parsed
    for ordinal, (raw, _, _) in enumerate(opener(task.path, 0, 0, unit, None, 0, task.max_record_bytes)):
        if isinstance(raw, BadSample):
            if raw.reason == "record_too_large":  # name the pipeline's setting, not the trainer's
                text = str(raw).removeprefix(f"{raw.where}: ").replace("data.max_record_bytes", MAX_RECORD_BYTES_KEY)
                raw = BadSample(raw.reason, raw.where, text)
            yield raw
            continue
        try:
            yield _jsonl_item(task, ordinal, raw)
        except BadSample as bad:
            yield bad


def iter_output(out: str) -> Iterator[Item]:
    """Every record of a finished run's output shards (OUT/shards/*.tar), in shard order."""
    shards = os.path.join(os.path.abspath(out), SHARDS_DIR)
    for name in sorted(os.listdir(shards)):
        if name.endswith(".tar"):
            yield from iter_shard(os.path.join(shards, name))


def iter_shard(path: str, arrays_path: str | None = None) -> Iterator[Item]:
    """Read back a shard this module wrote (with its sidecar arrays, if any)."""
    arrays = read_sidecar(arrays_path) if arrays_path and os.path.exists(arrays_path) else {}
    index = {name: {k: i for i, k in enumerate(keys)} for name, (keys, _) in arrays.items()}
    for raw, _, _ in iter_tar(path, 0, 0, Unit(0, 0, 1), None, 0):
        if isinstance(raw, BadSample):
            raise ValueError(f"{path}: intermediate shard is unreadable ({raw}); delete it and rerun")
        members = raw.members or {}
        # every "<n>.<ext>" member is image n, whatever its extension (undecodable bytes are written as .bin)
        images = [members[s] for s in sorted((s for s in members if s.split(".")[0].isdigit()),
                                             key=lambda s: int(s.split(".")[0]))]
        meta = json.loads(members.get("meta.json", b"{}"))
        item = Item(raw.key, json.loads(members["json"]), images, meta.pop("_where", raw.where), meta=meta)
        for name, (_, values) in arrays.items():
            i = index[name].get(raw.key)
            if i is not None:
                item.arrays[name] = values[i]
        yield item


def read_sidecar(path: str, names: tuple[str, ...] | None = None) -> dict[str, tuple[list[str], np.ndarray]]:
    """A shard's sidecar arrays: {name: (keys, values [n, ...])} (only `names`, if given)."""
    out = {}
    with np.load(path, allow_pickle=False) as z:
        for f in z.files:
            if f.endswith("__keys") or (names is not None and f not in names):
                continue
            out[f] = ([str(k) for k in z[f"{f}__keys"]], z[f])
    return out


# -------------------------------------------------------------------------------------------------------- writer


def _add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # fixed header fields: identical inputs give identical bytes
    info.mode = 0o644
    tf.addfile(info, io.BytesIO(data))


class ShardWriter:
    """Writes Items to a tar shard (and their arrays to a sidecar .npz) under temporary names; `close()` renames
    both into place, so a shard is either complete or absent."""

    def __init__(self, path: str, arrays_path: str | None = None):
        self.path, self.arrays_path = path, arrays_path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._tmp = path + ".tmp"
        self._tf = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)
        self._arrays: dict[str, tuple[list[str], list[np.ndarray]]] = {}  # name -> (keys, values)
        self.count = 0

    def write(self, item: Item) -> None:
        _add_member(self._tf, f"{item.key}.json", json.dumps(item.record, ensure_ascii=False).encode())
        for i, data in enumerate(item.images):
            _add_member(self._tf, f"{item.key}.{i}.{image_extension(data)}", data)
        meta = dict(item.meta, _where=item.where)
        _add_member(self._tf, f"{item.key}.meta.json", json.dumps(meta, ensure_ascii=False, sort_keys=True).encode())
        if self.arrays_path is not None:
            for name, a in item.arrays.items():
                keys, values = self._arrays.setdefault(name, ([], []))
                keys.append(item.key)
                values.append(np.asarray(a))
        self.count += 1

    def close(self) -> None:
        self._tf.close()
        if self.arrays_path is not None:
            tmp = self.arrays_path + ".tmp.npz"
            out: dict[str, np.ndarray] = {}
            for name, (keys, values) in self._arrays.items():
                out[name] = np.stack(values)
                out[f"{name}__keys"] = np.asarray(keys, dtype=str)
            np.savez(tmp, **out)
            os.replace(tmp, self.arrays_path)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._tf.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=_json_default)
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ------------------------------------------------------------------------------------ driver-side spill files
# Global plans keep per-record state on disk, not in the driver's memory: flat binary files of one numpy dtype,
# appended shard by shard (so rows are in corpus order) and read back in bounded chunks.

SPILL_CHUNK = 1 << 18  # rows per chunk read back (at most a few MB for the row types used here)


def spill_append(path: str, rows: np.ndarray) -> None:
    """Append rows (a 1-D or 2-D array of a fixed dtype) to a flat binary file."""
    with open(path, "ab") as f:
        np.ascontiguousarray(rows).tofile(f)


def spill_rows(path: str, dtype: Any, width: int = 1) -> int:
    """Number of rows in a spill file (0 when it does not exist)."""
    if not os.path.exists(path):
        return 0
    return os.path.getsize(path) // (np.dtype(dtype).itemsize * width)


def spill_read(path: str, dtype: Any, start: int = 0, count: int = -1, width: int = 1) -> np.ndarray:
    """Rows [start, start + count) of a spill file ([n] or [n, width])."""
    if not os.path.exists(path):
        return np.zeros((0, width) if width > 1 else 0, dtype=dtype)
    item = np.dtype(dtype).itemsize * width
    a = np.fromfile(path, dtype=dtype, count=count * width if count >= 0 else -1, offset=start * item)
    return a.reshape(-1, width) if width > 1 else a


def spill_chunks(path: str, dtype: Any, width: int = 1, chunk: int = SPILL_CHUNK):
    """The rows of a spill file in chunks of at most `chunk` rows, in file order."""
    n = spill_rows(path, dtype, width)
    for a in range(0, n, chunk):
        yield spill_read(path, dtype, a, min(chunk, n - a), width)
