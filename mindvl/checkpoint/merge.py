"""Streaming weight averaging of mindvl model folders: the paper's model merging (MindVL §5.3, §6.3).

Three recipes:
- `merge_checkpoints(inputs, out)`: the weighted average of whole models of one architecture. MindVL-8B is the plain
  mean of the SFT models trained at 2K, 4K and 8K sequence length.
- `merge_checkpoints([mllm], out, language_model_from=base)` (or `merge_language_model`): only the language model is
  averaged with a base LLM's; the vision tower and projector are copied bit for bit from the multimodal checkpoint.
  MindVL-671B-A37B is the 4K SFT model with its LLM merged with DeepSeek-V3 to keep the pure-text ability.
- `transplant_vision_tower(base, donor, out)`: `base` with `donor`'s vision tower, copied (bit for bit where the
  dtypes agree): a pretrained ViT behind a fresh projector and a pretrained LLM, how the paper's models start.

Weights are relative and are normalised to sum to 1: `2,1,1` means 0.5/0.25/0.25, and the default is the uniform mean
(the paper's "simple averaging"; 0.5/0.5 for the language-model merge). Normalising keeps the result a convex
combination, which is what weight averaging means; unnormalised weights would rescale every tensor. Negative weights,
all-zero weights or a count that differs from the checkpoints are errors. A zero weight is allowed: that checkpoint is
still checked for compatibility but never read.

Memory: the output is planned from the input headers (names, dtypes, shapes), then each tensor is read from every
input in turn, accumulated in float32 (float64 if an input is float64) and written straight to its shard with
`StreamingShardWriter`, so the peak is about one accumulator plus one input tensor, not whole models (measured: ~4.8x
the largest bf16 tensor whatever the depth, 0.14-0.31x the inputs; benchmarks/RESULTS.md). Inputs are reopened per
tensor on purpose: a safetensors handle kept open maps its file, and every page read stays resident, so holding the
handles would count the whole input size against the process.

Dtypes: `dtype=None`/"keep" writes each tensor in its input dtype. For a whole-model merge the inputs must agree (a
tensor stored as bf16 in one and fp32 in another is an error asking for `dtype`); for the language-model merge the
multimodal checkpoint's dtype wins, since the base only donates weights. Integer tensors are never averaged: they must
be equal in every input and are copied.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mindvl.models import MindVLConfig

from .hf import (
    CONFIG_NAME,
    _convert_tensor,
    _converted_shape,
    check_tensors,
    detect_family,
    expected_shapes,
    mindvl_config_from_hf,
    read_config,
)
from .hf_keys import mindvl_name
from .safetensors_io import DEFAULT_SHARD_BYTES, StreamingShardWriter, TensorFolder, atomic_output_folder
from .side_files import write_side_files

# config.json fields that record where a model came from, not what it is; they may differ between merged inputs.
PROVENANCE_KEYS = ("source", "projector_seed")
# Text-config fields a base LLM may differ in from the MLLM's language model without changing any weight: the MLLM
# adds M-RoPE sections for image positions, and the position limit is a setting, not a parameter.
LM_MERGE_IGNORED_TEXT_KEYS = ("mrope_section", "max_position_embeddings")
LM_PREFIX = "language_model."
VISUAL_PREFIX = "visual."
# HF families whose LLM tensors map one to one onto mindvl's by name, so a base can be read in place. Others (a
# deepseek_v3's per-expert tensors are stacked on import) are converted once with `mindvl convert` first.
RENAME_ONLY_FAMILIES = ("qwen3", "qwen2", "qwen2_5_vl")
# Elements per accumulation step. Adding a bf16 tensor into a float32 one makes a float32 copy of the input first;
# stepping through flat chunks bounds that temporary at 4 MB instead of a whole (e.g. embedding-sized) tensor. Small
# temporaries also keep glibc from raising its mmap threshold, which otherwise left freed heap resident (measured with
# benchmarks/bench_merge_memory.py: 16 MB chunks peaked ~90 MB higher).
ACCUMULATE_CHUNK = 1 << 20
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class _Source:
    """One input tensor: where it is stored and its weight in the average."""

    folder: TensorFolder
    name: str
    weight: float

    def read(self, out_name: str) -> torch.Tensor:
        tensor = self.folder.get(self.name)  # opens the shard for this one tensor (see the module docstring)
        # hf.py's per-tensor conversion for HF-named inputs; the identity for everything mindvl already stores.
        return _convert_tensor(out_name, tensor)


@dataclass(frozen=True)
class _Entry:
    """One output tensor and the inputs it is computed from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    sources: tuple[_Source, ...]


@dataclass(frozen=True)
class MergeResult:
    """What a merge wrote; `describe()` is the one-line summary `mindvl merge` prints."""

    out: Path
    inputs: list[str]
    weights: list[float]
    averaged: int  # tensors averaged over the inputs
    copied: int  # tensors copied from the first input (the vision tower and projector of a language-model merge)
    total_bytes: int
    files: list[str]
    transplanted: int = 0  # vision-tower tensors copied from the second input (transplant_vision_tower)

    def describe(self) -> str:
        if self.transplanted:
            return (f"wrote {self.out}: the vision tower ({self.transplanted} tensors) from {self.inputs[1]}, "
                    f"{self.copied} tensors from {self.inputs[0]}; {self.total_bytes / 1e6:.1f} MB in "
                    f"{len(self.files)} file(s)")
        weights = ", ".join(f"{w:.4g}" for w in self.weights)
        copied = f", {self.copied} copied from {self.inputs[0]}" if self.copied else ""
        return (f"wrote {self.out}: {self.averaged} tensors averaged over {', '.join(self.inputs)} "
                f"(weights {weights}){copied}; {self.total_bytes / 1e6:.1f} MB in {len(self.files)} file(s)")


# ------------------------------------------------------------------------------------------------------ API


def merge_checkpoints(inputs: list[str | os.PathLike], out: str | os.PathLike, weights: list[float] | None = None,
                      overwrite: bool = False, dtype: torch.dtype | str | None = None,
                      language_model_from: str | os.PathLike | None = None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> MergeResult:
    """Average mindvl model folders of one architecture into `out` (atomically; an existing `out` needs overwrite).

    With `language_model_from`, `inputs` is the one multimodal checkpoint and only its language model is averaged with
    that base LLM (see `merge_language_model`). `weights` are relative and normalised to sum to 1; default uniform.
    `dtype`: None/"keep", "bf16", "fp16", "fp32" or a torch float dtype for the written floating-point tensors.
    """
    paths = [Path(p) for p in inputs]
    if language_model_from is not None:
        if len(paths) != 1:
            raise ValueError(f"--language-model-from merges one multimodal checkpoint with the base LLM, but "
                             f"{len(paths)} checkpoints were given; pass exactly one")
        return merge_language_model(paths[0], language_model_from, out, weights, overwrite, dtype, max_shard_bytes)
    if len(paths) < 2:
        raise ValueError("merging needs at least two checkpoints (or one with --language-model-from BASE)")
    norm = normalise_weights(weights, [str(p) for p in paths])
    out_dtype = parse_dtype(dtype)
    _check_out_is_not_an_input(Path(out), paths)
    configs, folders = zip(*(_open_mindvl(p) for p in paths), strict=True)
    for path, cfg in zip(paths[1:], configs[1:], strict=True):
        _check_same_architecture(paths[0], configs[0], path, cfg)
    shapes = [f.shapes() for f in folders]
    for path, found in zip(paths[1:], shapes[1:], strict=True):
        _check_same_tensors(paths[0], shapes[0], path, found)
    check_tensors(shapes[0], expected_shapes(configs[0]), str(paths[0]))
    dtypes = [f.dtypes() for f in folders]
    entries = []
    for name in folders[0].names():
        written = _agreed_dtype(name, [(p, d[name]) for p, d in zip(paths, dtypes, strict=True)], out_dtype)
        sources = tuple(_Source(f, name, w) for f, w in zip(folders, norm, strict=True))
        entries.append(_Entry(name, written, shapes[0][name], sources))
    config = _merged_config(configs[0], paths, configs, norm, "all")
    return _write(entries, Path(out), config, paths[0], overwrite, max_shard_bytes, paths, norm)


def merge_language_model(mllm: str | os.PathLike, base: str | os.PathLike, out: str | os.PathLike,
                         weights: list[float] | None = None, overwrite: bool = False,
                         dtype: torch.dtype | str | None = None,
                         max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> MergeResult:
    """Average the language model of multimodal checkpoint `mllm` with base LLM `base`; copy vision and projector.

    `base` is a mindvl folder (its `language_model.*` tensors are used) or a transformers LLM folder that
    `mindvl convert` can import (Qwen3/Qwen2 `model.layers...` names), read in place: names are mapped lazily with
    hf.py's key map and no converted copy is written. Its text config must match the MLLM's (vocabulary, widths,
    layers, heads, norms, RoPE base, tying); only M-RoPE sections and the position limit may differ. `weights`
    applies to (mllm, base), default 0.5/0.5.
    """
    mllm, base = Path(mllm), Path(base)
    norm = normalise_weights(weights, [str(mllm), str(base)])
    out_dtype = parse_dtype(dtype)
    _check_out_is_not_an_input(Path(out), [mllm, base])
    cfg, folder = _open_mindvl(mllm)
    base_cfg, base_folder, base_names = _open_language_model(base)
    _check_same_text_config(mllm, cfg, base, base_cfg)
    shapes = folder.shapes()
    check_tensors(shapes, expected_shapes(cfg), str(mllm))
    base_header = base_folder.shapes()
    base_shapes = {n: _converted_shape(n, base_header[h]) for n, h in base_names.items()}
    lm_shapes = {n: s for n, s in shapes.items() if n.startswith(LM_PREFIX)}
    _check_same_tensors(mllm, lm_shapes, base, base_shapes, what="language-model tensors")
    dtypes = folder.dtypes()
    entries = []
    for name in folder.names():
        # The MLLM's dtype wins: the base only donates weights (see the module docstring).
        written = _written_dtype(dtypes[name], out_dtype)
        if name in lm_shapes:
            sources = (_Source(folder, name, norm[0]), _Source(base_folder, base_names[name], norm[1]))
        else:
            sources = (_Source(folder, name, 1.0),)
        entries.append(_Entry(name, written, shapes[name], sources))
    config = _merged_config(cfg, [mllm, base], [cfg, base_cfg], norm, "language_model")
    return _write(entries, Path(out), config, mllm, overwrite, max_shard_bytes, [mllm, base], norm)


def transplant_vision_tower(base: str | os.PathLike, donor: str | os.PathLike, out: str | os.PathLike,
                            overwrite: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> MergeResult:
    """`base` with its vision tower (`visual.*`) replaced by `donor`'s, bit for bit where the dtypes agree (else in
    `base`'s dtype); the projector and language model stay `base`'s. The paper's starting point at toy scale: a
    pretrained ViT, a freshly initialised projector and a pretrained LLM (`base` is then a model whose projector was
    never trained). Both are mindvl folders whose vision configs and vision tensors agree; the text parts may differ
    (the projector maps into `base`'s LLM).
    """
    base, donor = Path(base), Path(donor)
    _check_out_is_not_an_input(Path(out), [base, donor])
    cfg, folder = _open_mindvl(base)
    donor_cfg, donor_folder = _open_mindvl(donor)
    diff = _first_difference(asdict(cfg.vision), asdict(donor_cfg.vision), "vision.")
    if diff:
        raise ValueError(f"{donor / CONFIG_NAME} differs from {base / CONFIG_NAME} in {diff}; a vision tower moves "
                         "only between models of one vision architecture")
    shapes = folder.shapes()
    check_tensors(shapes, expected_shapes(cfg), str(base))
    visual = {n: s for n, s in shapes.items() if n.startswith(VISUAL_PREFIX)}
    donor_visual = {n: s for n, s in donor_folder.shapes().items() if n.startswith(VISUAL_PREFIX)}
    _check_same_tensors(base, visual, donor, donor_visual, what="vision-tower tensors")
    dtypes = folder.dtypes()
    # Every tensor in `base`'s dtype (the donor only donates weights, as the base LLM of a language-model merge).
    entries = [_Entry(name, dtypes[name], shapes[name],
                      (_Source(donor_folder if name in visual else folder, name, 1.0),)) for name in folder.names()]
    # Provenance as for the other merges: the vision tensors with weights 0 (base) and 1 (donor).
    config = _merged_config(cfg, [base, donor], [cfg, donor_cfg], [0.0, 1.0], "visual")
    result = _write(entries, Path(out), config, base, overwrite, max_shard_bytes, [base, donor], [0.0, 1.0])
    return replace(result, copied=result.copied - len(visual), transplanted=len(visual))


def normalise_weights(weights: list[float] | None, inputs: list[str]) -> list[float]:
    """Relative weights -> weights summing to 1; None -> uniform."""
    n = len(inputs)
    if weights is None:
        return [1.0 / n] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weight(s) for {n} checkpoints ({', '.join(inputs)}); give one per checkpoint")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {weights}")
    total = sum(weights)
    if total == 0:
        raise ValueError(f"weights {weights} are all zero; give at least one checkpoint a positive weight")
    return [w / total for w in weights]


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """None/"keep" -> None (inputs' dtype); "bf16"/"fp16"/"fp32" or a torch float dtype -> that dtype."""
    if dtype is None or dtype == "keep":
        return None
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise ValueError(f"dtype {dtype!r} is not one of keep, bf16, fp16, fp32")


# --------------------------------------------------------------------------------------------- inputs, checks


def _refuse_training_folder(path: Path) -> None:
    """A run folder or training checkpoint holds DCP shards, which merge never reads: say how to get a model folder."""
    if (path / CONFIG_NAME).is_file():
        return
    if (path / "adapter_config.json").is_file():  # averaging A and B apart is not averaging the updates B A
        raise ValueError(f"{path} is a LoRA adapter folder; merge the runs' final/ folders (their merged weights), or "
                         f"fold it first: mindvl export {path} --merge-adapters --out DIR, and merge DIR")
    if any((path / marker).exists() for marker in ("train_state.json", "latest", "checkpoints")):
        raise ValueError(f"{path} is a training run or checkpoint, not a model folder; export it first "
                         f"(mindvl export {path} --out DIR) and merge DIR")


def _open_mindvl(path: Path) -> tuple[MindVLConfig, TensorFolder]:
    _refuse_training_folder(path)
    raw = read_config(path)
    if raw.get("model_type") != "mindvl":
        raise ValueError(f"{path} is a {raw.get('model_type')!r} checkpoint, not a mindvl model folder; import it "
                         f"first: mindvl convert --from-hf {path} --out OUT")
    try:
        cfg = MindVLConfig.from_dict(raw, str(path / CONFIG_NAME))  # ValueErrors name the file
    except TypeError as exc:
        raise ValueError(f"{path / CONFIG_NAME}: {exc}") from None
    return cfg, TensorFolder(path)


def _open_language_model(base: Path) -> tuple[MindVLConfig, TensorFolder, dict[str, str]]:
    """A base LLM's config, its tensors and {mindvl name: stored name} for its language-model tensors."""
    _refuse_training_folder(base)
    raw = read_config(base)
    family = detect_family(raw, str(base / CONFIG_NAME))
    if family == "mindvl":
        cfg, folder = _open_mindvl(base)
        return cfg, folder, {n: n for n in folder.names() if n.startswith(LM_PREFIX)}
    if family not in RENAME_ONLY_FAMILIES:
        raise ValueError(f"{base}: a {family} checkpoint's tensors are restructured on import, so it cannot be read in "
                         f"place; convert it first (mindvl convert --from-hf {base} --out BASE) and merge with BASE")
    cfg = mindvl_config_from_hf(raw, base)
    folder = TensorFolder(base)
    names: dict[str, str] = {}
    for stored in folder.names():
        name = mindvl_name(stored, family)
        if name is None or not name.startswith(LM_PREFIX):
            continue  # buffers mindvl recomputes, and a VLM base's vision tower, are not part of the LLM
        if name in names:
            raise ValueError(f"{base}: tensors {names[name]!r} and {stored!r} both map to {name!r}; keep one")
        names[name] = stored
    if cfg.text.tie_word_embeddings:
        names.pop(f"{LM_PREFIX}lm_head.weight", None)  # some exports store the tied copy anyway
    return cfg, folder, names


def _check_out_is_not_an_input(out: Path, inputs: list[Path]) -> None:
    for path in inputs:
        if out.resolve() == path.resolve():
            raise ValueError(f"--out {out} is also an input; write the merge to a new folder")


def _architecture(config: MindVLConfig) -> dict[str, Any]:
    data = config.to_dict()
    for key in PROVENANCE_KEYS:
        data.pop(key, None)
    return data


def _check_same_architecture(ref: Path, ref_cfg: MindVLConfig, path: Path, cfg: MindVLConfig) -> None:
    diff = _first_difference(_architecture(ref_cfg), _architecture(cfg))
    if diff:
        raise ValueError(f"{path / CONFIG_NAME} differs from {ref / CONFIG_NAME} in {diff}; only checkpoints of one "
                         "architecture can be merged")


def _check_same_text_config(mllm: Path, cfg: MindVLConfig, base: Path, base_cfg: MindVLConfig) -> None:
    mine, theirs = asdict(cfg.text), asdict(base_cfg.text)
    for key in LM_MERGE_IGNORED_TEXT_KEYS:
        mine.pop(key, None)
        theirs.pop(key, None)
    diff = _first_difference(mine, theirs, "text.")
    if diff:
        raise ValueError(f"{base}: its language model differs from {mllm}'s in {diff}; --language-model-from needs "
                         "the LLM architecture the multimodal model was built on")


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """'key.path (value in a vs value in b)' for the first differing entry of two JSON-like values, else None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            missing = object()
            diff = _first_difference(a.get(key, missing), b.get(key, missing), f"{prefix}{key}.")
            if diff:
                return diff
        return None
    if a == b:
        return None
    return f"{prefix.rstrip('.')} ({_short(a)} vs {_short(b)})"


def _short(value: Any) -> str:
    if not isinstance(value, (dict, list, str, int, float, bool, type(None))):
        return "absent"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_same_tensors(ref: Path, ref_shapes: dict[str, tuple[int, ...]], path: Path,
                        shapes: dict[str, tuple[int, ...]], what: str = "tensors") -> None:
    missing = sorted(set(ref_shapes) - set(shapes))
    extra = sorted(set(shapes) - set(ref_shapes))
    if missing or extra:
        parts = [f"lacks {_names(missing)}" if missing else "", f"has extra {_names(extra)}" if extra else ""]
        raise ValueError(f"{path} and {ref} hold different {what}: {path} " + " and ".join(p for p in parts if p))
    for name, shape in ref_shapes.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {tuple(shape)} in {ref} but {tuple(shapes[name])} in {path}")


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return f"{len(names)} tensor(s): {shown}" + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _agreed_dtype(name: str, dtypes: list[tuple[Path, torch.dtype]], requested: torch.dtype | None) -> torch.dtype:
    """The written dtype of a whole-model merge: the requested one for floats, else the one every input has."""
    if requested is not None and all(d.is_floating_point for _, d in dtypes):
        return requested
    (first_path, first), *rest = dtypes
    for path, dtype in rest:
        if dtype != first:
            raise ValueError(f"tensor {name} is {first} in {first_path} but {dtype} in {path}; choose the output "
                             "dtype with --dtype bf16|fp32")
    return first


def _written_dtype(kept: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    return requested if requested is not None and kept.is_floating_point else kept


# -------------------------------------------------------------------------------------------------- writing


def _merged_config(config: MindVLConfig, paths: list[Path], configs: list[MindVLConfig], weights: list[float],
                   merged: str) -> MindVLConfig:
    """The first input's config with provenance: what was merged, with which weights, and the inputs' own sources."""
    out = MindVLConfig.from_dict(config.to_dict())
    out.source = {
        "merged_from": [str(p.resolve()) for p in paths],
        "merge_weights": weights,
        "merged_tensors": merged,
        "parent_sources": [c.source for c in configs],
    }
    return out


def _write(entries: list[_Entry], out: Path, config: MindVLConfig, side_files_from: Path, overwrite: bool,
           max_shard_bytes: int, inputs: list[Path], weights: list[float]) -> MergeResult:
    plan = [(e.name, e.dtype, e.shape) for e in entries]
    with atomic_output_folder(out, overwrite) as tmp:
        with StreamingShardWriter(tmp, plan, max_shard_bytes) as writer:
            for entry in entries:
                writer.add(entry.name, _combine(entry))
            files = writer.close()
        (tmp / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        write_side_files(tmp, config, [side_files_from])  # side files of the first (multimodal) input
    averaged = sum(len(e.sources) > 1 for e in entries)
    return MergeResult(out, [str(p) for p in inputs], weights, averaged, len(entries) - averaged,
                       writer.total_bytes, files)


def _combine(entry: _Entry) -> torch.Tensor:
    """The output tensor of one entry: a copy, the weighted average of floating inputs, or an agreed integer."""
    if len(entry.sources) == 1:
        return entry.sources[0].read(entry.name).to(entry.dtype)  # a no-op (bit-identical) when the dtype is kept
    if entry.dtype.is_floating_point:  # the written dtype is floating exactly when the inputs are
        return _weighted_average(entry).to(entry.dtype)
    return _agreed_integer(entry)


def _weighted_average(entry: _Entry) -> torch.Tensor:
    """sum_i w_i * x_i with one accumulator and one input tensor alive at a time."""
    wide = torch.float64 if entry.dtype == torch.float64 else torch.float32
    acc = torch.zeros(entry.shape, dtype=wide)
    for source in entry.sources:
        if source.weight == 0:
            continue  # checked for compatibility, never read
        tensor = source.read(entry.name)
        if tensor.dtype == torch.float64:
            acc = acc.double()  # never narrow a float64 input
        flat_acc, flat_in = acc.view(-1), tensor.reshape(-1)
        for start in range(0, flat_acc.numel(), ACCUMULATE_CHUNK):
            stop = start + ACCUMULATE_CHUNK
            flat_acc[start:stop].add_(flat_in[start:stop], alpha=source.weight)  # in acc's (wide) dtype
        del tensor, flat_in
    return acc


def _agreed_integer(entry: _Entry) -> torch.Tensor:
    first = entry.sources[0].read(entry.name)
    for source in entry.sources[1:]:
        if not torch.equal(source.read(entry.name), first):
            raise ValueError(f"integer tensor {entry.name} differs between {entry.sources[0].folder.folder} and "
                             f"{source.folder.folder}; integer tensors cannot be averaged")
    return first
