"""The pipeline file (`mindvl curate PIPELINE.yaml`): inputs, output, engine and the ordered stages.

```yaml
inputs: [data/pairs/*.jsonl]     # files or globs: JSONL (+ images), WebDataset .tar shards, .parquet
format: auto                     # auto (by extension) | jsonl | tar | parquet
split: 1                         # cut every input file into this many shards (more parallelism, finer resume)
output: curated/                 # shards/*.tar (trainable by `mindvl train`), report.{md,json}, *.png
seed: 0
batch_size: 64                   # records per batch handed to each stage
max_record_bytes: 8388608        # a JSONL line / tar key's text / parquet record over it is skipped unparsed
engine: {name: local, workers: 2, address: null}   # inprocess | local | ray (address: an existing Ray cluster)
stages:                          # in order; each is {stage_name: {options}}
  - image_filter: {min_side: 64, max_aspect_ratio: 4}
  - text_filter: {min_words: 3, scripts: [latin], max_repetition: 0.3}
  - phash_dedup: {max_distance: 8}
  - embed: {model: thumbnail}
  - cluster: {k: 64, max_cluster_size: 5000, target: 100000, floor: 10, semdedup: 0.95}
```
Validation happens at load, before any work: unknown keys, unknown stage names, wrong option types and missing
model folders raise one-line errors naming the key (`stages[3].cluster.k: ...`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from mindvl.data.config import RECORD_BYTES_PER_TOKEN
from mindvl.typed import build, check_keys

from .io import INPUT_FORMATS
from .stages import REGISTRY, Stage

ENGINES = ("inprocess", "local", "ray")
_TOP_KEYS = ("inputs", "format", "split", "output", "seed", "batch_size", "max_record_bytes", "engine", "stages")
# The trainer's default record limit at seq_len 32K (mindvl.data.config): curation never drops a record that a recipe
# of up to 32K tokens would train on, and never holds or parses more than this per record.
DEFAULT_MAX_RECORD_BYTES = RECORD_BYTES_PER_TOKEN * 32768


# Stage options that name local files or folders (model folders, score heads, OCR vocabularies).
STAGE_PATH_KEYS = ("model", "head", "classifier", "vocabulary")
EMBED_BUILTINS = ("thumbnail",)  # `embed: {model: thumbnail}` is a built-in, not a folder


def resolve_file_paths(d: dict, base: str) -> None:
    """The same rule as training recipes: relative input paths written in a pipeline file (`inputs`, stage model
    folders, heads, vocabularies) resolve against the file's folder `base`; `output` and command-line paths
    (--inputs, --output) against the working directory."""

    def resolve(value: Any) -> Any:
        if not isinstance(value, str) or not value or os.path.isabs(os.path.expanduser(value)) \
                or value in EMBED_BUILTINS:
            return value
        return os.path.normpath(os.path.join(base, value))

    inputs = d.get("inputs")
    if isinstance(inputs, str):
        d["inputs"] = resolve(inputs)
    elif isinstance(inputs, list):
        d["inputs"] = [resolve(p) for p in inputs]
    for entry in d.get("stages") or []:
        if isinstance(entry, dict) and len(entry) == 1:
            (opts,) = entry.values()
            if isinstance(opts, dict):
                for key in STAGE_PATH_KEYS:
                    if key in opts:
                        opts[key] = resolve(opts[key])


@dataclass
class EngineConfig:
    name: str = "inprocess"
    workers: int = 1
    address: str | None = None  # Ray: an existing cluster ("host:port" or "ray://..."); None starts a local one


@dataclass
class PipelineConfig:
    inputs: list[str]
    output: str
    stages: list[tuple[str, dict]]
    format: str = "auto"
    split: int = 1
    seed: int = 0
    batch_size: int = 64
    engine: EngineConfig = field(default_factory=EngineConfig)
    source: str = "<dict>"  # the file it came from, for messages
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> PipelineConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: the pipeline must be a mapping")
        try:
            check_keys(d, _TOP_KEYS, "")
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        inputs = d.get("inputs")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(p, str) for p in inputs):
            raise ValueError(f"{source}: inputs: a non-empty list of files or globs is required")
        output = d.get("output")
        if not isinstance(output, str) or not output:
            raise ValueError(f"{source}: output: an output folder is required")
        fmt = d.get("format", "auto")
        if fmt not in INPUT_FORMATS:
            raise ValueError(f"{source}: format: must be one of {', '.join(INPUT_FORMATS)}, got {fmt!r}")
        ints = {}
        for key, default, lo in (("split", 1, 1), ("seed", 0, None), ("batch_size", 64, 1),
                                 ("max_record_bytes", DEFAULT_MAX_RECORD_BYTES, 1)):
            v = d.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
                raise ValueError(f"{source}: {key}: expected an integer{f' >= {lo}' if lo else ''}, got {v!r}")
            ints[key] = v
        eng = d.get("engine", {}) or {}
        if isinstance(eng, str):
            eng = {"name": eng}
        if not isinstance(eng, dict):
            raise ValueError(f"{source}: engine: must be a mapping {{name, workers, address}}")
        try:
            engine = build(EngineConfig, eng, "engine")
            check_engine(engine, "engine")
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        raw_stages = d.get("stages")
        if not isinstance(raw_stages, list) or not raw_stages:
            raise ValueError(f"{source}: stages: a non-empty list of {{stage_name: options}} is required")
        stages = []
        for i, entry in enumerate(raw_stages):
            where = f"stages[{i}]"
            if isinstance(entry, str):
                entry = {entry: {}}
            if not isinstance(entry, dict) or len(entry) != 1:
                raise ValueError(f"{source}: {where}: must be one {{stage_name: options}} mapping")
            (name, opts), = entry.items()
            if name not in REGISTRY:
                raise ValueError(f"{source}: {where}: unknown stage {name!r} (known: {', '.join(sorted(REGISTRY))})")
            stages.append((name, dict(opts or {})))
        cfg = cls(list(inputs), output, stages, fmt, ints["split"], ints["seed"], ints["batch_size"], engine, source,
                  ints["max_record_bytes"])
        try:
            cfg.build_stages()  # validate every stage's options (and model folders) now, not hours later
        except (ValueError, FileNotFoundError) as exc:
            raise type(exc)(f"{source}: {exc}") from exc
        return cfg

    @classmethod
    def load(cls, path: str, overrides: dict[str, Any] | None = None) -> PipelineConfig:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"pipeline file not found: {path}")
        with open(path) as f:
            try:
                d = yaml.safe_load(f)
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        if not isinstance(d, dict):
            raise ValueError(f"{path}: the pipeline must be a mapping of inputs, output, stages ...")
        resolve_file_paths(d, os.path.dirname(os.path.abspath(path)))
        for key, value in (overrides or {}).items():  # command-line values: relative to the working directory
            if value is not None:
                d[key] = value
        return cls.from_dict(d, path)

    def build_stages(self) -> list[Stage]:
        return [REGISTRY[name](opts, f"stages[{i}].{name}", self.seed) for i, (name, opts) in enumerate(self.stages)]

    def resolve_inputs(self) -> list[str]:
        files: list[str] = []
        for pattern in self.inputs:
            pattern = os.path.expanduser(pattern)
            matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
            matched = [m for m in matched if os.path.isfile(m)]
            if not matched:
                raise FileNotFoundError(f"{self.source}: inputs: no file matches {pattern!r}")
            files.extend(matched)
        return files

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "format": self.format, "split": self.split, "output": self.output,
                "seed": self.seed, "batch_size": self.batch_size,
                "engine": {"name": self.engine.name, "workers": self.engine.workers, "address": self.engine.address},
                "stages": [{name: opts} for name, opts in self.stages],
                # only when set: runs from before the key keep their fingerprint (resume)
                **({"max_record_bytes": self.max_record_bytes}
                   if self.max_record_bytes != DEFAULT_MAX_RECORD_BYTES else {})}

    def fingerprint(self) -> str:
        """What decides the output (not the engine or worker count): a resumed run must match it."""
        d = self.to_dict()
        d.pop("engine")
        d.pop("output")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def check_engine(engine: EngineConfig, where: str) -> None:
    if engine.name not in ENGINES:
        raise ValueError(f"{where}.name: unknown engine {engine.name!r} (known: {', '.join(ENGINES)})")
    if not isinstance(engine.workers, int) or isinstance(engine.workers, bool) or engine.workers < 1:
        raise ValueError(f"{where}.workers: expected an integer >= 1, got {engine.workers!r}")
    if engine.address is not None and not isinstance(engine.address, str):
        raise ValueError(f"{where}.address: expected a string, got {engine.address!r}")
