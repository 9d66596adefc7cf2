"""What a curation stage is.

A *map* stage sees one batch of Items at a time and returns the kept Items and the dropped ones with a reason:
`process(batch) -> (kept, [(item, reason)])`. It may annotate kept items (`item.meta`, `item.arrays`) and record
score values for the report's histograms (`self.observe(name, value)`). Map stages are pure functions of their
options, the seed and the item, so any number of workers on any engine produce the same output.

A *global* stage needs the whole corpus before it can decide (deduplication across shards, clustering). It runs in
three steps: `annotate(batch)` in the workers (compute what the decision needs, e.g. a hash or an embedding, stored in
`item.arrays` and so in the shard's sidecar), `plan(shards, workdir)` once in the driver (reads only the sidecars,
decides which keys to drop and which annotations to add, and writes them shard by shard), and the plan is applied
by the workers in the next pass. Models are loaded lazily in `setup()`, once per worker process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..items import Item

Dropped = list[tuple[Item, str]]


def stable_u64(*parts: Any) -> int:
    """A deterministic 64-bit value from any parts (sha256; not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class Options:
    """Validated stage options: `Options(cfg, {name: default}, where)`; unknown keys and wrong types raise a
    ValueError naming `where.key`. A default of None accepts any value of the documented type."""

    def __init__(self, cfg: Any, spec: dict[str, Any], where: str, types: dict[str, tuple] | None = None):
        if cfg is None:
            cfg = {}
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: options must be a mapping, got {type(cfg).__name__}")
        for key in cfg:
            if key not in spec:
                raise ValueError(f"{where}.{key}: unknown option (known: {', '.join(sorted(spec))})")
        types = types or {}
        self._values: dict[str, Any] = {}
        for key, default in spec.items():
            value = cfg.get(key, default)
            want = types.get(key) or ((type(default),) if default is not None else None)
            if want and value is not None:
                if float in want and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if isinstance(value, bool) and bool not in want or not isinstance(value, want):
                    names = "/".join(t.__name__ for t in want)
                    raise ValueError(f"{where}.{key}: expected {names}, got {value!r}")
            self._values[key] = value
        self.where = where

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError as exc:
            raise AttributeError(name) from exc

    def positive(self, *keys: str) -> None:
        for key in keys:
            v = self._values[key]
            if v is not None and not v > 0:
                raise ValueError(f"{self.where}.{key}: must be > 0, got {v}")


@dataclass(frozen=True)
class Histogram:
    """A score's histogram over [lo, hi] (values outside go to the end bins). Counts are kept at FINE x `bins` so
    the report can draw about `bins` bars over the range the data occupies, not the range any data could span."""

    lo: float
    hi: float
    bins: int

    FINE = 16

    @property
    def stored_bins(self) -> int:
        return self.bins * self.FINE


class Stage:
    """Base of every stage. `name` is the registry name; `where` names the stage in the pipeline file."""

    name = ""
    kind = "map"  # map | global
    histograms: dict[str, Histogram] = {}

    def __init__(self, cfg: Any, where: str, seed: int):
        self.where, self.seed = where, seed
        self._hist: dict[str, np.ndarray] = {}
        self.extra: dict[str, Any] = {}  # per-shard report values (e.g. OCR agreement counts)

    def setup(self) -> None:
        """Load models (called once per worker process, before the first batch)."""

    def observe(self, name: str, value: float) -> None:
        h = self.histograms[name]
        n = h.stored_bins
        counts = self._hist.setdefault(name, np.zeros(n, dtype=np.int64))
        i = int((value - h.lo) / (h.hi - h.lo) * n)
        counts[min(max(i, 0), n - 1)] += 1

    def take_histograms(self) -> dict[str, list[int]]:
        out = {k: v.tolist() for k, v in self._hist.items()}
        self._hist = {}
        return out

    def take_extra(self) -> dict[str, Any]:
        out, self.extra = self.extra, {}
        return out


class MapStage(Stage):
    kind = "map"

    def process(self, batch: list[Item]) -> tuple[list[Item], Dropped]:
        raise NotImplementedError


class RecordFilter(MapStage):
    """A map stage that keeps or drops each record on its own: `reason(item)` is None to keep it."""

    def reason(self, item: Item) -> str | None:
        raise NotImplementedError

    def process(self, batch: list[Item]) -> tuple[list[Item], Dropped]:
        kept, dropped = [], []
        for item in batch:
            r = self.reason(item)
            if r:
                dropped.append((item, r))
            else:
                kept.append(item)
        return kept, dropped


def with_first_image(batch: list[Item], keep_text_only: bool = False) -> tuple[list[tuple[Item, Any]], Dropped]:
    """[(item, its first image decoded)], and the items dropped because that image does not decode (`undecodable`,
    `decompression_bomb`) or is absent (`no_image`; with keep_text_only they are returned with None instead)."""
    from mindvl.data.image import ImageError

    out, dropped = [], []
    for item in batch:
        try:
            image = item.first_image()
        except ImageError as exc:
            dropped.append((item, "undecodable" if exc.reason == "corrupt_image" else exc.reason))
            continue
        if image is None and not keep_text_only:
            dropped.append((item, "no_image"))
            continue
        out.append((item, image))
    return out, dropped


class GlobalStage(Stage):
    kind = "global"

    def annotate(self, batch: list[Item]) -> tuple[list[Item], Dropped]:
        """Worker side, before the shard is written: add what `plan` reads from the sidecar."""
        return batch, []

    def plan(self, shards: list[tuple[str, str]], workdir: str, emit: Emit) -> dict[str, Any]:
        """Driver side: `shards` are (shard name, sidecar .npz path) in corpus order. Calls `emit(shard name,
        {"drop": {key: reason}, "meta": {key: {field: value}}})` at most once per shard (a shard never emitted
        has an empty plan) and returns the report dict.

        Memory contract: what the driver holds must not grow with the number of records (only with the number
        of clusters, groups or shards, and the stage's bounded options): read the sidecars shard by shard, keep
        per-record state in spill files under `workdir` (mindvl.curate.io.spill_*), emit shard by shard."""
        raise NotImplementedError


Emit = Callable[[str, dict], None]


def plan_in_memory(stage: GlobalStage, shards: list[tuple[str, str]], workdir: str) -> tuple[dict[str, dict], dict]:
    """({shard: plan}, report) of a global stage, the plans collected in a dict (tests and small corpora)."""
    plans: dict[str, dict] = {}

    def emit(name: str, plan: dict) -> None:
        assert name not in plans, f"{stage.where}: shard {name} emitted twice"
        plans[name] = plan

    report = stage.plan(shards, workdir, emit)
    return plans, report


REGISTRY: dict[str, type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    REGISTRY[cls.name] = cls
    return cls
