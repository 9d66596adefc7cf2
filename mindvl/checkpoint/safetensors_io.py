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
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 1024**3


class TensorFolder:
    """Read access to the tensors of a safetensors folder without loading them all: names, shapes, one tensor."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"{self.folder} is not a folder")
        index = self.folder / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.folder / shard for name, shard in weight_map.items()}
        elif (self.folder / SINGLE_NAME).is_file():
            with safe_open(self.folder / SINGLE_NAME, framework="pt") as f:
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
            with safe_open(path, framework="pt") as f:
                for name in names:
                    out[name] = tuple(f.get_slice(name).get_shape())
        return out

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    def iter_tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, one file open at a time and one tensor in memory at a time."""
        wanted = set(self.file_of if names is None else names)
        for path, file_names in self._by_file().items():
            with safe_open(path, framework="pt") as f:
                for name in file_names:
                    if name in wanted:
                        yield name, f.get_tensor(name)

    def _by_file(self) -> dict[Path, list[str]]:
        groups: dict[Path, list[str]] = {}
        for name, path in self.file_of.items():
            groups.setdefault(path, []).append(name)
        return groups


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
