"""Training checkpoints: torch.distributed.checkpoint (DCP) for model + optimizer, JSON for the rest, atomically.

Layout under `OUTPUT_DIR/checkpoints/`:

    step_00000010/           a complete checkpoint
        .metadata, *.distcp  DCP shards: {"model": ..., "optim": ...} (any world size can read them)
        train_state.json     step, tokens, scheduler state, model config, tokenizer folder, recipe
        rank_00000.json      that rank's data-loader state and RNG states
    step_00000012.partial/   a save in progress (or one that crashed): never read, removed by the next save
    latest                   the name of the newest complete checkpoint; replaced (os.replace) only after the
                             checkpoint folder was renamed into place, so it never points at a partial save

Atomicity: every rank writes into `step_N.partial`; after a barrier rank 0 renames it to `step_N` and then moves
`latest`. A crash at any point leaves the previous `latest` and its folder untouched.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

LATEST = "latest"
TRAIN_STATE = "train_state.json"
PARTIAL = ".partial"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# ----------------------------------------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": repr(random.getstate()),
        "numpy": list(np.random.get_state(legacy=True)[1].tolist()),
        "numpy_pos": int(np.random.get_state(legacy=True)[2]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    random.setstate(ast.literal_eval(state["python"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------- save / load


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _finalize(partial: Path, final: Path, root: Path) -> None:
    """Rename the completed folder into place, then move the `latest` pointer (rank 0 only)."""
    if final.exists():  # the same step saved again (e.g. a resumed run re-saving its last step)
        shutil.rmtree(final)
    os.replace(partial, final)
    _write_json(root / LATEST, final.name)  # os.replace of a temp file: the pointer is never half-written


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when no process group exists; that is exactly the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any], rank_state: dict[str, Any], keep: int | None = None) -> Path:
    """Collective: every rank calls it. Writes `root/step_N` atomically and prunes to the newest `keep`."""
    root = Path(root)
    rank = _rank()
    final = root / step_name(step)
    partial = root / (step_name(step) + PARTIAL)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # left by a crashed save of the same step
            shutil.rmtree(partial)
        partial.mkdir()
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(partial), no_dist=not _distributed())
    _write_json(partial / f"rank_{rank:05d}.json", {**rank_state, "rng": rng_state()})
    if rank == 0:
        _write_json(partial / TRAIN_STATE, {**train_state, "step": step})
    _barrier()  # every rank's files are in the partial folder
    if rank == 0:
        _finalize(partial, final, root)
        prune(root, keep)
    _barrier()
    return final


def prune(root: Path, keep: int | None) -> None:
    """Delete all but the newest `keep` complete checkpoints, and stale partial folders of older steps."""
    latest = read_latest(root)
    complete = complete_checkpoints(root)
    if keep is not None:
        for p in complete[:-keep]:
            if latest is None or p != latest:
                shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(f"step_*{PARTIAL}"):
        if latest is not None and p.name < latest.name:
            shutil.rmtree(p, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under `root`, oldest first (a folder only gets its final name once complete)."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(PARTIAL)
                  and (p / TRAIN_STATE).is_file())


def read_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (via the `latest` pointer), or None."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / json.loads(pointer.read_text())
    if not (path / TRAIN_STATE).is_file():
        # Only possible after a crash while an existing step folder was being re-saved (a run resumed from an older
        # checkpoint): every folder with a final name is complete, so the newest of them is the right one.
        found = complete_checkpoints(root)
        if not found:
            raise ValueError(f"{pointer} points at {path.name}, which is missing, and no complete checkpoint exists")
        warnings.warn(f"{pointer} points at missing {path.name}; using {found[-1].name}", stacklevel=2)
        return found[-1]
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, a `checkpoints/` folder or a run's output folder -> the checkpoint folder to read."""
    p = Path(path)
    if (p / TRAIN_STATE).is_file():
        return p
    for root in (p, p / "checkpoints"):
        found = read_latest(root) if root.is_dir() else None
        if found is not None:
            return found
    raise FileNotFoundError(f"{p} is not a training checkpoint (no {TRAIN_STATE}, no checkpoints/latest)")


def read_train_state(ckpt: str | Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / TRAIN_STATE).read_text())


def load_checkpoint(ckpt: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective. Loads model (+ optimizer) in place, restores this rank's RNG; returns (train_state, rank_state)."""
    ckpt = Path(ckpt)
    rank = _rank()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=not _distributed())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    rank_file = ckpt / f"rank_{rank:05d}.json"
    if not rank_file.is_file():
        raise ValueError(f"{ckpt}: no state for rank {rank} ({rank_file.name}); resume with the same world size")
    rank_state = json.loads(rank_file.read_text())
    set_rng_state(rank_state.pop("rng"))
    return read_train_state(ckpt), rank_state


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model state on CPU (on every rank; rank 0 writes it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_checkpoint(ckpt: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """A training checkpoint -> a mindvl model folder (safetensors + config.json + tokenizer files), single process."""
    from mindvl.models import MindVL, MindVLConfig

    from .hf import save_pretrained

    ckpt = resolve_checkpoint(ckpt)
    train_state = read_train_state(ckpt)
    config = MindVLConfig.from_dict(train_state["model_config"])
    model = MindVL(config)
    state = {"model": model.state_dict()}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state["model"])
    side = train_state.get("side_files") or {}  # written by the trainer: the init model's folder, trained pixels
    pixels = side.get("pixels")
    return save_pretrained(model, out, overwrite=overwrite, side_files_from=side.get("from") or [],
                           pixels=tuple(pixels) if pixels else None, tokenizer_from=train_state.get("tokenizer_dir"))
