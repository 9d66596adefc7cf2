"""Router traces on disk: the `RouterTrace` container and its `.npz` file format.

A trace holds, for every MoE layer and every token of a set of sequences, the ids of the top-k routed experts in
descending-score order (the only thing SRP/SCH and the cache simulations need; gate weights are optional). Sequences
have variable lengths, so tokens of all sequences are concatenated along one axis and `seq_offsets` marks the
boundaries, like `cu_seqlens` elsewhere in mindvl.

File format (one compressed `.npz`, loaded with `allow_pickle=False`, so no code runs on load):

| key | dtype / shape | meaning |
| --- | --- | --- |
| `format` | int64 scalar | format version, `TRACE_FORMAT_VERSION` |
| `topk_ids` | int8 or int16 `[L, N, k]` | expert ids in score order; int8 when `num_experts <= 127` |
| `seq_offsets` | int64 `[S+1]` | sequence boundaries into N: starts at 0, strictly increasing, ends at N |
| `num_experts` | int64 scalar | routed experts per layer (E) |
| `layer_names` | unicode `[L]` | module names of the MoE layers, in depth order |
| `topk_scores` | float16 `[L, N, k]` | optional router scores of the same experts |
| `meta` | unicode scalar | JSON object with provenance (model, family, corpus, ...) |
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mindvl.untrusted import check_npz, loads_json

TRACE_FORMAT_VERSION = 1


def id_dtype(num_experts: int) -> np.dtype:
    """The storage dtype of expert ids: int8 while every id fits (E <= 127), else int16 (E <= 32767)."""
    if num_experts <= 127:
        return np.dtype(np.int8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids; at most 32767 experts are supported")


@dataclass
class RouterTrace:
    """Top-k routing of L MoE layers over S sequences (N tokens in all).

    `topk_ids[l, n]` lists the k experts chosen for token n at layer l, best score first. Tokens of sequence i are
    `seq_offsets[i]:seq_offsets[i+1]`. Only routed experts are recorded (shared experts are never cached or counted).
    Construct with any integer array; `validate()` (called by `save_trace` and `load_trace`) checks shapes and
    ranges, and `__post_init__` converts ids to the storage dtype (`id_dtype`) and offsets to int64.
    """

    topk_ids: np.ndarray
    seq_offsets: np.ndarray
    num_experts: int
    layer_names: list[str]
    topk_scores: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_experts = int(self.num_experts)
        self.topk_ids = np.asarray(self.topk_ids)
        self.seq_offsets = np.asarray(self.seq_offsets)
        self.layer_names = [str(n) for n in self.layer_names]
        self.validate()
        # Convert only after validation so that out-of-range ids are reported, not silently wrapped.
        self.topk_ids = self.topk_ids.astype(id_dtype(self.num_experts), copy=False)
        self.seq_offsets = self.seq_offsets.astype(np.int64, copy=False)
        if self.topk_scores is not None:
            self.topk_scores = np.asarray(self.topk_scores).astype(np.float16, copy=False)

    # ---- shape properties -------------------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.seq_offsets.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def sequence(self, i: int) -> np.ndarray:
        """Top-k ids of sequence i for every layer, shape [L, T_i, k] (a view)."""
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range for a trace of {self.num_sequences} sequences")
        i %= self.num_sequences
        return self.topk_ids[:, self.seq_offsets[i] : self.seq_offsets[i + 1]]

    def sequences(self) -> list[np.ndarray]:
        """All sequences as a list of [L, T_i, k] views (the ragged form the metrics accept)."""
        return [self.sequence(i) for i in range(self.num_sequences)]

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency (shapes, id range, offsets, names, meta)."""
        ids, off = self.topk_ids, self.seq_offsets
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        id_dtype(self.num_experts)
        if ids.ndim != 3:
            raise ValueError(f"topk_ids must have shape [layers, tokens, k], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"topk_ids must be integers, got dtype {ids.dtype}")
        num_layers, num_tokens, k = ids.shape
        if num_layers < 1 or k < 1:
            raise ValueError(f"topk_ids needs at least one layer and k >= 1, got shape {ids.shape}")
        if k > self.num_experts:
            raise ValueError(f"k={k} experts per token exceeds num_experts={self.num_experts}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(
                f"expert ids must lie in [0, {self.num_experts}), found range [{int(ids.min())}, {int(ids.max())}]"
            )
        if off.ndim != 1 or off.shape[0] < 2 or not np.issubdtype(off.dtype, np.integer):
            raise ValueError(f"seq_offsets must be a 1-D integer array of S+1 >= 2 boundaries, got shape {off.shape}")
        if int(off[0]) != 0 or int(off[-1]) != num_tokens:
            raise ValueError(f"seq_offsets must start at 0 and end at the token count {num_tokens}, "
                             f"got {int(off[0])}..{int(off[-1])}")
        if np.any(np.diff(off) <= 0):
            raise ValueError("seq_offsets must be strictly increasing (every sequence needs at least one token)")
        if len(self.layer_names) != num_layers:
            raise ValueError(f"layer_names has {len(self.layer_names)} names for {num_layers} layers")
        if self.topk_scores is not None and np.shape(self.topk_scores) != ids.shape:
            raise ValueError(f"topk_scores shape {np.shape(self.topk_scores)} must equal topk_ids shape {ids.shape}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta must be JSON-serialisable: {exc}") from None
        if ids.size and k > 1:
            # Top-k ids of one token are distinct by construction; duplicates mean a broken tracer.
            srt = np.sort(ids.reshape(-1, k), axis=1)
            if np.any(srt[:, 1:] == srt[:, :-1]):
                raise ValueError("topk_ids repeats an expert within one token's top-k; ids must be distinct")


def save_trace(trace: RouterTrace, path: str | os.PathLike) -> Path:
    """Write `trace` to one compressed `.npz` atomically (temporary file in the same folder, then os.replace).

    The suffix `.npz` is added when missing (numpy would add it anyway). Returns the final path.
    """
    trace.validate()
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        "format": np.array(TRACE_FORMAT_VERSION, np.int64),
        "topk_ids": trace.topk_ids.astype(id_dtype(trace.num_experts), copy=False),
        "seq_offsets": trace.seq_offsets.astype(np.int64, copy=False),
        "num_experts": np.array(trace.num_experts, np.int64),
        "layer_names": np.array(trace.layer_names, dtype=np.str_).reshape(trace.num_layers),
        "meta": np.array(json.dumps(trace.meta, sort_keys=True)),
    }
    if trace.topk_scores is not None:
        arrays["topk_scores"] = np.asarray(trace.topk_scores).astype(np.float16, copy=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_trace(path: str | os.PathLike) -> RouterTrace:
    """Read a trace written by `save_trace`; every problem is a ValueError (or FileNotFoundError) naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"router trace {path} does not exist")
    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle and suggest allow_pickle: never for a trace
        raise ValueError(f"{path}: not a router trace (a trace is the .npz that `mindvl moe-trace` writes; this file "
                         "is not an .npz archive)")
    try:
        check_npz(path)  # member sizes, compression and array headers, before numpy allocates anything
        with np.load(path, allow_pickle=False) as data:
            files = set(data.files)
            missing = {"format", "topk_ids", "seq_offsets", "num_experts", "layer_names"} - files
            if missing:
                raise ValueError(f"missing arrays {sorted(missing)}; is it a mindvl router trace?")
            version = int(data["format"])
            if version > TRACE_FORMAT_VERSION:
                raise ValueError(f"format version {version} is newer than this mindvl reads ({TRACE_FORMAT_VERSION})")
            meta = loads_json(str(data["meta"])) if "meta" in files else {}
            return RouterTrace(
                topk_ids=data["topk_ids"],
                seq_offsets=data["seq_offsets"],
                num_experts=int(data["num_experts"]),
                layer_names=[str(n) for n in data["layer_names"].reshape(-1)],
                topk_scores=data["topk_scores"] if "topk_scores" in files else None,
                meta=meta,
            )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        # np.load raises these for truncated or non-npz files.
        raise ValueError(f"{path}: not a readable .npz router trace ({exc})") from None
