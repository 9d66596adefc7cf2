"""Sharded safetensors folders, read and written one tensor at a time.

Layout (transformers'): `model.safetensors` alone, or `model-0000k-of-0000n.safetensors` shards plus
`model.safetensors.index.json` mapping every tensor name to its shard. Only safetensors are read: pickled
`*.bin` / `*.pt` checkpoints are refused rather than unpickled (loading a pickle can run arbitrary code).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mindvl.untrusted import UntrustedInputError, loads_json, plain_name, read_regular

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 1024**3
# torch dtype <-> the dtype tags of safetensors headers (the format's spec lists them).
_DTYPE_TAGS: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_TAG_DTYPES = {tag: dtype for dtype, tag in _DTYPE_TAGS.items()}
# safetensors' own bound on the JSON header; a larger length field is a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000
MAX_INDEX_BYTES = 256 << 20  # a model.safetensors.index.json (a 1T-parameter model's is a few MB)
_FIX = "re-export or re-download it"


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Read the header of one .safetensors file and check it against the file size: a ValueError naming the file
    (and tensor) for a truncated file, an absurd header length or an offset past the end, instead of the
    library's multi-line error. Reads the header only."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes is too short for a safetensors file; {_FIX}")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"{path}: the header length field says {n} bytes but the file has {size}: not a "
                             f"safetensors file, or corrupt; {_FIX}")
        raw = fh.read(n)
    try:
        header = loads_json(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({exc}); {_FIX}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object; {_FIX}")
    data_bytes = size - 8 - n
    cut = []  # (end, name) of tensors whose data runs past the end of the file
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets in the header; {_FIX}")
        if offsets[1] > data_bytes:
            cut.append((offsets[1], name))
    if cut:
        end, name = min(cut)  # the first tensor cut off
        more = f" (and {len(cut) - 1} more)" if len(cut) > 1 else ""
        raise ValueError(f"{path}: tensor {name!r}{more} ends at byte {end} of the data but the file holds "
                         f"{data_bytes} data bytes: the file is truncated or corrupt; {_FIX}")


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator:
    """`safe_open(path)` whose errors (a corrupt header, a truncated file) are one-line ValueErrors naming the
    file."""
    try:
        f = safe_open(path, framework="pt")
    except SafetensorError as exc:
        check_safetensors_file(path)  # usually says precisely what is wrong
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); {_FIX}") from None
    with f:
        yield f


class TensorFolder:
    """Read access to the tensors of a safetensors folder without loading them all: names, shapes, one tensor."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"{self.folder} is not a folder")
        index = self.folder / INDEX_NAME
        if index.is_file():
            self.file_of = {name: self.folder / shard for name, shard in _read_index(index).items()}
        elif (self.folder / SINGLE_NAME).is_file():
            with open_safetensors(self.folder / SINGLE_NAME) as f:
                self.file_of = {name: self.folder / SINGLE_NAME for name in f.keys()}  # noqa: SIM118
        else:
            pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in self.folder.glob(pattern))
            hint = ""
            if pickled:
                hint = (f" (found pickled {pickled[:3]}: re-save them as safetensors, e.g. with transformers' "
                        "save_pretrained(..., safe_serialization=True); mindvl never unpickles checkpoints)")
            raise FileNotFoundError(f"{self.folder}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
        missing = sorted({str(p) for p in self.file_of.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{self.folder}: the index names missing shard file(s) {missing}")

    def names(self) -> list[str]:
        return list(self.file_of)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor shapes from the file headers; nothing is loaded."""
        out: dict[str, tuple[int, ...]] = {}
        for path, names in self._by_file().items():
            with open_safetensors(path) as f:
                for name in names:
                    out[name] = tuple(f.get_slice(name).get_shape())
        return out

    def dtypes(self) -> dict[str, torch.dtype]:
        """Tensor dtypes from the file headers; nothing is loaded."""
        out: dict[str, torch.dtype] = {}
        for path, names in self._by_file().items():
            with open_safetensors(path) as f:
                for name in names:
                    tag = f.get_slice(name).get_dtype()
                    if tag not in _TAG_DTYPES:
                        raise ValueError(f"{path}: tensor {name!r} has dtype {tag}, which mindvl does not read")
                    out[name] = _TAG_DTYPES[tag]
        return out

    def get(self, name: str) -> torch.Tensor:
        with open_safetensors(self.file_of[name]) as f:
            return f.get_tensor(name)

    def iter_tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, one file open at a time and one tensor in memory at a time."""
        wanted = set(self.file_of if names is None else names)
        for path, file_names in self._by_file().items():
            with open_safetensors(path) as f:
                for name in file_names:
                    if name in wanted:
                        yield name, f.get_tensor(name)

    def _by_file(self) -> dict[Path, list[str]]:
        groups: dict[Path, list[str]] = {}
        for name, path in self.file_of.items():
            groups.setdefault(path, []).append(name)
        return groups


def _read_index(index: Path) -> dict[str, str]:
    """The weight map of a model.safetensors.index.json: tensor name -> shard file name."""
    try:
        weight_map = loads_json(read_regular(index, MAX_INDEX_BYTES, "safetensors index")).get("weight_map")
    except (ValueError, AttributeError) as exc:  # not JSON, not UTF-8, too deep or large, not a regular file
        raise ValueError(f"{index}: not a safetensors index ({exc}); {_FIX}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names; {_FIX}")
    for shard in set(weight_map.values()):
        try:  # a shard beside the index: `../victim/model.safetensors` would read another folder's weights
            plain_name(shard, "shard")
        except UntrustedInputError as exc:
            raise ValueError(f"{index}: {exc}; {_FIX}") from None
    return weight_map


class ShardedWriter:
    """Streams tensors into shards of at most `max_shard_bytes`, then writes the index (transformers' layout)."""

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in shard for shard in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # clone() detaches views and shared storage, which safetensors refuses to serialise.
        self._pending[name] = tensor.detach().to("cpu").contiguous().clone()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, str(self.folder / f"shard-{len(self._shards):05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish writing; returns the shard file names."""
        self._flush()
        n = len(self._shards)
        if n == 0:
            raise ValueError("no tensors were written")
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(self.folder / f"shard-{i:05d}.tmp", self.folder / final)
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        return names


class StreamingShardWriter:
    """Writes a tensor list known in advance straight to disk, holding no tensor after `add` returns.

    `ShardedWriter` buffers a whole shard (up to `max_shard_bytes`) because safetensors' `save_file` wants every
    tensor of a file at once. When the names, dtypes and shapes are known beforehand (e.g. from input headers, as
    in a merge), each shard's header can be written first and the tensors appended one by one in `plan` order, so
    memory stays at one tensor. The shards, their names and the index are the same as `ShardedWriter`'s. Use it as
    a context manager so an error closes the open file.
    """

    def __init__(self, folder: str | os.PathLike, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if not plan:
            raise ValueError("no tensors to write")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._shards = _plan_shards(plan, max_shard_bytes)
        self._queue = [(shard_i, name, dtype, shape) for shard_i, shard in enumerate(self._shards)
                       for name, dtype, shape in shard]
        self._next = 0
        self._file = None
        self.total_bytes = 0

    def __enter__(self) -> StreamingShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor; its name, dtype and shape must be the plan's."""
        if self._next >= len(self._queue):
            raise ValueError(f"tensor {name!r} is not in the plan (all {len(self._queue)} tensors were written)")
        shard_i, want, dtype, shape = self._queue[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want, dtype, tuple(shape)):
            raise ValueError(f"expected tensor {want!r} {dtype} {tuple(shape)} next, got {name!r} {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        if self._file is None:
            self._file = open(self.folder / f"shard-{shard_i:05d}.tmp", "wb")  # noqa: SIM115 (closed below)
            self._file.write(_header_bytes(self._shards[shard_i]))
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        # A uint8 view of the same memory, written as is: safetensors stores little-endian, like x86/ARM hosts.
        self._file.write(flat.view(torch.uint8).numpy().data)
        self.total_bytes += flat.numel() * flat.element_size()
        self._next += 1
        last_of_shard = self._next == len(self._queue) or self._queue[self._next][0] != shard_i
        if last_of_shard:
            self._file.close()
            self._file = None

    def close(self) -> list[str]:
        """Check every planned tensor arrived, name the shards and write the index; returns the shard file names."""
        if self._next != len(self._queue):
            missing = self._queue[self._next][1]
            raise ValueError(f"only {self._next} of {len(self._queue)} planned tensors were written "
                             f"(next missing: {missing!r})")
        n = len(self._shards)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(self.folder / f"shard-{i:05d}.tmp", self.folder / final)
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t, _, _ in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        return names


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def _plan_shards(plan: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int) -> list[list]:
    """Split the plan into shards the way `ShardedWriter` does: a new shard when the next tensor would overflow."""
    shards: list[list] = [[]]
    size = 0
    seen: set[str] = set()
    for name, dtype, shape in plan:
        if name in seen:
            raise ValueError(f"tensor {name!r} planned twice")
        if dtype not in _DTYPE_TAGS:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        seen.add(name)
        nbytes = _nbytes(dtype, shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, tuple(shape)))
        size += nbytes
    return shards


def _header_bytes(shard: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The safetensors preamble: u64 little-endian header length, then the JSON header padded to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in shard:
        end = offset + _nbytes(dtype, shape)
        header[name] = {"dtype": _DTYPE_TAGS[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensor data then starts 8-byte aligned, as safetensors itself writes
    return len(text).to_bytes(8, "little") + text


@contextlib.contextmanager
def atomic_output_folder(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder that becomes `out` only when the block completes without error.

    A crash leaves `out` untouched (either absent or the previous complete version). An existing `out` is an error
    unless `overwrite` is set.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another output folder or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
