"""Training checkpoints: torch.distributed.checkpoint (DCP) for model + optimizer, JSON for the rest, atomically.

Layout under `OUTPUT_DIR/checkpoints/`:

    step_00000010/           a complete checkpoint
        .metadata, *.distcp  DCP shards: {"model": ..., "optim": ...} (any world size can read them); a LoRA run's
                             "model" leaves its frozen parameters out (train_state's `frozen_base` references the
                             base they are read from again: checkpoint.frozen_base)
        train_state.json     step, tokens, scheduler state, model config, tokenizer folder, recipe
        rank_00000.json      that rank's data-loader state and RNG states
    step_00000012.partial/   a save in progress (or one that crashed): never read, removed by the next save
    latest                   the name of the newest complete checkpoint; replaced (os.replace) only after the
                             checkpoint folder was renamed into place, so it never points at a partial save

Atomicity: every rank writes into `step_N.partial`; after a barrier rank 0 renames it to `step_N` and then moves
`latest`. A crash at any point leaves the previous `latest` and its folder untouched. `AsyncCheckpointer` writes the
shards in the background and keeps the same protocol (the rename waits until every rank's write finished). A failed
save (a full disk, ...) raises one line (`dcp_io.CheckpointWriteError`) on every rank and leaves `latest` as it was.

Trust (the bad-step guard decides): a save may be told its weights are not trusted (written during a bad-step streak,
or the one whose weights gave the streak's first bad step); it is still written but does not move `latest`, and
`point_latest` moves `latest` back to the last good checkpoint when a streak begins.

Readers: every DCP read goes through `dcp_io.read_dcp` (no code from checkpoints). Readers that may run beside a
training (export) pin the folder (`dcp_io.pinned`); the pruner skips pinned folders and renames a folder away before
deleting it, so a reader either reads a whole checkpoint or retries on the new `latest`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import sys
import warnings
from collections.abc import Callable
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

from mindvl.untrusted import UntrustedInputError, loads_json, regular_inside

from .dcp_io import (
    CheckpointReadError,
    CheckpointWriteError,
    create_pin,
    open_in_checkpoint,
    pinned,
    read_dcp,
    read_metadata,
    remove_unpinned,
    shard_bytes,
    write_failure,
)
from .frozen_base import KEY as FROZEN_BASE

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


def _place(partial: Path, final: Path) -> None:
    """Rename the completed folder into place (rank 0)."""
    if final.exists():  # the same step saved again (e.g. a resumed run re-saving its last step)
        graveyard = final.with_name(final.name + ".replaced" + PARTIAL)
        if graveyard.exists():
            shutil.rmtree(graveyard)
        os.replace(final, graveyard)  # out of the way at once; a reader of the old one retries on `latest`
        shutil.rmtree(graveyard, ignore_errors=True)
    os.replace(partial, final)


def _finalize(partial: Path, final: Path, root: Path) -> None:
    """Rename the completed folder into place, then move the `latest` pointer (rank 0 only)."""
    _place(partial, final)
    _write_json(root / LATEST, final.name)  # os.replace of a temp file: the pointer is never half-written


def point_latest(root: str | Path, ckpt: Path | None) -> None:
    """Rank 0: point `latest` at `ckpt` (a bad-step streak began: the newer checkpoints hold untrusted weights), or
    remove it when no checkpoint is trusted (resume=auto then refuses rather than resuming bad weights)."""
    pointer = Path(root) / LATEST
    if ckpt is not None:
        _write_json(pointer, Path(ckpt).name)
    elif pointer.exists():
        pointer.unlink()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when no process group exists; that is exactly the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# Decides, when a save completes, whether its weights are trusted (moves `latest`); None: always.
Trust = Callable[[Path], bool] | None


def _model_options(whole: bool) -> StateDictOptions:
    """The model entries a checkpoint holds: all (`whole`), or (a LoRA run: `frozen_base` in its train state) all but
    the frozen parameters, which the run reads from its base again (checkpoint.frozen_base)."""
    return StateDictOptions() if whole else StateDictOptions(ignore_frozen_params=True, strict=False)


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any], rank_state: dict[str, Any], keep: int | None = None,
                    protect: Path | None = None, trusted: Trust = None) -> Path:
    """Collective: every rank calls it. Writes `root/step_N` atomically and prunes to the newest `keep` (never
    deleting `protect`). `latest` moves to it unless `trusted(step_N)` says no. A failed write raises
    CheckpointWriteError on every rank (one line: "disk full ..." when it is) and leaves `latest` as it was.
    A train state with a `frozen_base` reference: the frozen parameters are left out."""
    root, partial, final = _begin(root, step)
    state = {"model": get_model_state_dict(model, options=_model_options(FROZEN_BASE not in train_state)),
             "optim": get_optimizer_state_dict(model, optimizer)}

    def write() -> None:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=str(partial), no_dist=not _distributed())
        _write_small_files(partial, step, train_state, rank_state)

    _guarded_write(root, final, write)
    _complete(root, partial, final, keep, protect, trusted)
    return final


def _guarded_write(root: Path, final: Path, write: Callable[[], Any]) -> Any:
    """Collective: run `write`; if it fails on any rank, every rank raises the same CheckpointWriteError."""
    message, result = None, None
    try:
        result = write()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; interrupts pass through
        message = str(write_failure(root, final.name, _latest_name(root), exc))
    message = _agreed_message(message)
    if message is not None:
        raise CheckpointWriteError(message)
    return result


def _agreed_message(message: str | None) -> str | None:
    """Collective: the lowest rank's message (or None) on every rank."""
    if not _distributed():
        return message
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return next((m for m in gathered if m is not None), None)


def _latest_name(root: Path) -> str | None:
    try:
        return _small_json(root / LATEST)
    except (OSError, ValueError):
        return None


def _begin(root: str | Path, step: int) -> tuple[Path, Path, Path]:
    root = Path(root)
    final = root / step_name(step)
    partial = root / (step_name(step) + PARTIAL)
    message = None
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a crashed save of the same step
                shutil.rmtree(partial)
            partial.mkdir()
            create_pin(partial)
        except OSError as exc:
            message = str(write_failure(root, final.name, _latest_name(root), exc))
    message = _agreed_message(message)
    if message is not None:
        raise CheckpointWriteError(message)
    return root, partial, final


def _write_small_files(partial: Path, step: int, train_state: dict[str, Any], rank_state: dict[str, Any]) -> None:
    rank = _rank()
    _write_json(partial / f"rank_{rank:05d}.json", {**rank_state, "rng": rng_state()})
    if rank == 0:
        _write_json(partial / TRAIN_STATE, {**train_state, "step": step})


def _complete(root: Path, partial: Path, final: Path, keep: int | None, protect: Path | None,
              trusted: Trust = None) -> None:
    _barrier()  # every rank's files are in the partial folder
    if _rank() == 0:
        if trusted is None or trusted(final):
            _finalize(partial, final, root)
        else:  # written, but its weights are not trusted: `latest` stays on the last good checkpoint
            _place(partial, final)
        prune(root, keep, protect)
    _barrier()


class AsyncCheckpointer:
    """`checkpoint.async_save`: the DCP shards are written by a background thread while training continues, with
    the same atomic protocol. `save` snapshots the state to CPU memory (the next optimizer step cannot change what
    is written), starts the write into `step_N.partial` and returns; `finish` (collective) waits for the write on
    every rank, then renames to `step_N` and moves `latest` (asking `trusted` then, not at `save`: a streak may
    have begun meanwhile). Until then `latest` names the previous checkpoint, so a process killed mid-write leaves
    that one loadable. The background writes use their own gloo process group so their collectives never interleave
    with the training step's.
    """

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if _distributed() else None
        if self.group is None:  # the background thread's save warns that it assumes one process: it is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self.pending: tuple[Any, Path, Path, Path, int | None, Path | None, Trust] | None = None

    def save(self, root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any], rank_state: dict[str, Any], keep: int | None = None,
             protect: Path | None = None, trusted: Trust = None) -> Path:
        """Collective. Starts writing `root/step_N` (finishing the previous save first); returns its final path."""
        self.finish()
        root, partial, final = _begin(root, step)
        state = {"model": get_model_state_dict(model, options=_model_options(FROZEN_BASE not in train_state)),
                 "optim": get_optimizer_state_dict(model, optimizer)}

        def start():
            with _single_process_quiet():
                future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group,
                                        no_dist=not _distributed())
            _write_small_files(partial, step, train_state, rank_state)  # RNG and data state of this very step
            return future

        future = _guarded_write(root, final, start)
        self.pending = (future, root, partial, final, keep, protect, trusted)
        return final

    def written_here(self) -> bool:
        """This rank's shards are on disk (or nothing is pending): not collective."""
        return self.pending is None or self.pending[0].done()

    def finish(self) -> Path | None:
        """Collective: wait for the pending write and put it into place; returns its path (None if none)."""
        if self.pending is None:
            return None
        future, root, partial, final, keep, protect, trusted = self.pending
        self.pending = None
        _guarded_write(root, final, future.result)  # re-raises a failed write, as one line on every rank
        _complete(root, partial, final, keep, protect, trusted)
        return final


def prune(root: Path, keep: int | None, protect: Path | None = None) -> None:
    """Delete all but the newest `keep` complete checkpoints (never `latest` or `protect`: the last good checkpoint),
    and stale partial folders of older steps. A checkpoint a reader pins (`mindvl export` beside the training) is
    left for the next prune."""
    latest = read_latest(root)
    complete = complete_checkpoints(root)
    if keep is not None:
        for p in complete[:-keep]:
            if (latest is None or p != latest) and (protect is None or p.name != Path(protect).name):
                remove_unpinned(p, p.with_name(p.name + ".pruned" + PARTIAL))
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
    try:
        name = _small_json(pointer)
    except FileNotFoundError:  # removed this instant (point_latest)
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointReadError(f"{pointer} is damaged ({exc}); point it at a checkpoint folder name, e.g. "
                                  f'"step_00000010", or resume=PATH') from None
    if not isinstance(name, str) or not name.startswith("step_") or "/" in name or "\\" in name:
        raise CheckpointReadError(f"{pointer} holds {name!r}, not a checkpoint folder name like \"step_00000010\"")
    path = root / name
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
    if (p / "config.json").is_file():  # a run's final/, an export, a conversion: nothing left to export
        raise ValueError(f"{p} is already a model folder (config.json + safetensors), not a training checkpoint: chat, "
                         f"eval and merge read it as it is and training starts from it with model.init_from={p}; "
                         f"transformers' layout: mindvl convert --to-hf {p} --out DIR")
    raise FileNotFoundError(f"{p} is not a training checkpoint (no {TRAIN_STATE}, no checkpoints/latest)")


MAX_JSON_BYTES = 256 << 20  # train_state.json, rank states, `latest`


def _small_json(path: Path) -> Any:
    """A JSON file of a checkpoint folder: a regular file (no symlink, FIFO or device), bounded size and nesting."""
    with open_in_checkpoint(path, MAX_JSON_BYTES) as f:
        return loads_json(f.read())


def _read_json(path: Path) -> Any:
    try:
        return _small_json(path)
    except CheckpointReadError:
        raise
    except FileNotFoundError:
        raise CheckpointReadError(f"{path} is missing: the checkpoint is incomplete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointReadError(f"{path} is truncated or damaged ({exc})") from None


def read_train_state(ckpt: str | Path) -> dict[str, Any]:
    return _read_json(Path(ckpt) / TRAIN_STATE)


def load_checkpoint(ckpt: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    require_rank_state: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Collective. Loads model (+ optimizer) in place (DCP reshards them to this world size), restores this rank's
    RNG; returns (train_state, rank_state). Without `require_rank_state` a rank the checkpoint has no state for (an
    elastic resume onto more ranks) gets None. An unreadable checkpoint raises CheckpointReadError on every rank
    (the model may then be partly overwritten: load another checkpoint into it); a crafted one UnsafeCheckpointError.
    """
    ckpt = Path(ckpt)
    rank = _rank()
    train_state = read_train_state(ckpt)
    options = _model_options(FROZEN_BASE not in train_state)  # the frozen base: the caller's (checked by it)
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    read_dcp(ckpt, state, distributed=_distributed())
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    rank_file = ckpt / f"rank_{rank:05d}.json"
    # Each rank reads its own file, so a damaged one fails on that rank alone: the verdict is voted, and every rank
    # raises the same one-line error (or, under resume=auto, falls back to the same older checkpoint).
    problem, rank_state = None, None
    if not rank_file.is_file():
        if require_rank_state:
            problem = f"{ckpt}: no state for rank {rank} ({rank_file.name}); resume with the same world size"
    else:
        try:
            rank_state = _read_json(rank_file)
            rng = rank_state.pop("rng") if isinstance(rank_state, dict) else None
            if not isinstance(rng, dict):
                raise CheckpointReadError(f"{rank_file} is damaged: no RNG state object (key 'rng')")
            set_rng_state(rng)
        except CheckpointReadError as exc:
            problem = f"{exc} [rank {rank}]"
        except (KeyError, TypeError, ValueError, SyntaxError) as exc:  # a field of the RNG state is unusable
            problem = f"{rank_file} is damaged: its RNG state does not load ({type(exc).__name__}: {exc}) [rank {rank}]"
    problem = _agreed_message(problem)
    if problem is not None:
        raise CheckpointReadError(problem)  # a ValueError: the CLI prints it as one line
    return train_state, rank_state


def load_newest_readable(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
                         ) -> tuple[Path, dict[str, Any], dict[str, Any] | None] | None:
    """Collective (`resume=auto`): load `latest`; if it is truncated or damaged, the next older complete checkpoint,
    and so on, saying so in one line per skipped checkpoint. Returns (checkpoint, train_state, rank_state), or None
    when `root` holds no checkpoint. A crafted checkpoint (UnsafeCheckpointError) is refused, never skipped."""
    root = Path(root)
    latest = read_latest(root)
    if latest is None:
        if complete_checkpoints(root):
            raise ValueError(f"resume=auto: {root} holds checkpoints but no `latest` (a bad-step stop found no "
                             "checkpoint it could trust, or a crash hit the first save); resume=PATH to pick one, "
                             "or overwrite=true to start over")
        return None
    candidates = [latest] + [p for p in reversed(complete_checkpoints(root)) if p.name < latest.name]
    for i, ckpt in enumerate(candidates):
        try:
            train_state, rank_state = load_checkpoint(ckpt, model, optimizer, require_rank_state=False)
            problem = None
            try:
                read_rank_states(ckpt)
            except CheckpointReadError as exc:
                problem = str(exc)
            problem = _agreed_message(problem)  # every rank falls back, or none does
            if problem is not None:
                raise CheckpointReadError(problem)
            return ckpt, train_state, rank_state
        except CheckpointReadError as exc:
            if i + 1 == len(candidates):
                raise CheckpointReadError(f"{exc} (and no older complete checkpoint is readable)") from None
            if _rank() == 0:
                print(f"mindvl: warning: checkpoint {ckpt} is unreadable, resuming from {candidates[i + 1].name} "
                      f"instead: {exc}", file=sys.stderr, flush=True)
    return None


def read_rank_states(ckpt: str | Path) -> list[dict[str, Any]]:
    """Every rank's saved state (data positions, RNG) in rank order: what an elastic resume redistributes."""
    files = sorted(Path(ckpt).glob("rank_*.json"))
    return [_read_json(f) for f in files]


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model state on CPU (on every rank; rank 0 writes it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# Export beside a running training: how often to follow `latest` when the checkpoint being read is pruned.
EXPORT_ATTEMPTS = 20


# `mindvl export` of a QLoRA checkpoint: turns the base's adapted weights into what the run multiplied by (their NF4
# round trip; mindvl.train.qlora.quantize_like_run, passed in by the CLI: checkpoint does not import train).
BaseQuantizer = Callable[[nn.Module, dict[str, Any]], None]


def export_checkpoint(ckpt: str | Path, out: str | Path, overwrite: bool = False,
                      quantizer: BaseQuantizer | None = None) -> Path:
    """A training checkpoint -> a mindvl model folder (safetensors + config.json + tokenizer files), single process.

    Safe beside a running training: the checkpoint is pinned while it is read (the pruner leaves it alone); given a
    run or `checkpoints/` folder, a checkpoint pruned before the pin is replaced by the new `latest`."""
    follow = not (Path(ckpt) / TRAIN_STATE).is_file()  # a run folder: follow `latest`; a step folder: that one
    for _ in range(EXPORT_ATTEMPTS):
        folder = resolve_checkpoint(ckpt)
        with pinned(folder) as ok:
            if ok:
                try:
                    model, train_state = _read_model(folder, quantizer)
                except CheckpointReadError:
                    if not follow or folder.is_dir():
                        raise
                    continue  # pruned while being read (a folder written before pins existed): next `latest`
                break
        if not follow:
            raise CheckpointReadError(f"{folder} was deleted while it was being read (pruned by a running training?); "
                                      "export the run folder to get its newest checkpoint")
    else:
        raise CheckpointReadError(f"{ckpt}: its newest checkpoint was pruned {EXPORT_ATTEMPTS} times while being "
                                  "read; raise checkpoint.keep or export when the training pauses")
    from .hf import save_pretrained

    side = train_state.get("side_files") or {}  # written by the trainer: the init model's folder, trained pixels
    pixels = side.get("pixels")
    adapted = _adapted_state(model)
    if adapted is not None:  # a LoRA run: the merged weights here, the adapters (PEFT layout) in OUT/adapter
        from mindvl.models.lora import merge_lora

        merge_lora(model)
    written = save_pretrained(model, out, overwrite=overwrite, side_files_from=side.get("from") or [],
                              pixels=tuple(pixels) if pixels else None, tokenizer_from=train_state.get("tokenizer_dir"),
                              **_trained_system(side))
    if adapted is not None:
        _write_run_adapter(adapted, model.config, train_state, written)
    _copy_run_recipe(folder, written)
    return written


def _trained_system(side_files: dict[str, Any]) -> dict[str, Any]:
    """save_pretrained's `system`: the run's data.default_system (the trainer records it with the side files; a
    checkpoint written before it did leaves the chat template as it is)."""
    return {"system": side_files["system"]} if "system" in side_files else {}


def _adapted_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    from mindvl.models.lora import lora_layers

    return {k: v.clone() for k, v in model.state_dict().items()} if any(True for _ in lora_layers(model)) else None


def _write_run_adapter(state: dict[str, torch.Tensor], config, train_state: dict[str, Any], out: Path) -> None:
    """OUT/adapter as the trainer writes final/adapter (train_state["adapters"]: the LoRA config, the modules the
    phase trained in full, the base folder)."""
    from mindvl.models.lora import LoRAConfig
    from mindvl.typed import build

    from .adapters import save_adapter

    saved = train_state.get("adapters") or {}
    lora = build(LoRAConfig, saved.get("lora") or train_state["recipe"]["model"]["lora"], "model.lora")
    save_adapter(state, config, lora, out / "adapter", base=saved.get("base"),
                 full_modules=saved.get("full_modules") or [])


def _copy_run_recipe(checkpoint: Path, out: Path) -> None:
    """The run's `recipe.json` (RUN/checkpoints/step_N -> RUN/recipe.json) travels with an exported checkpoint, as it
    sits beside a run's `final/`: eval and chat read the system turn the model was trained with from it
    (`data.default_system`) instead of guessing from the chat template. Written atomically; absent when the
    checkpoint lives outside a run folder."""
    run = checkpoint.parent.parent
    if not (run / "recipe.json").is_file():
        return
    try:  # a regular file inside the run folder only: a symlink to a secret is not exported with the model
        recipe = regular_inside(run, "recipe.json", "run recipe")
    except UntrustedInputError as exc:
        raise CheckpointReadError(f"{exc}; mindvl copies only regular files inside the run folder") from None
    tmp = out / f".recipe.json.tmp{os.getpid()}"
    shutil.copyfile(recipe, tmp)
    os.replace(tmp, out / "recipe.json")


def _check_model_fits_shards(folder: Path, config) -> None:
    """Before anything is allocated: the model `train_state.json` describes (built on the meta device, which
    allocates nothing) has no more parameters than the checkpoint's model entries hold bytes (a parameter is at
    least one byte), so a tiny checkpoint cannot make export build a 40 GB model."""
    from mindvl.models import MindVL

    try:
        with torch.device("meta"):
            numel = sum(p.numel() for p in MindVL(config).parameters())
    except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:
        raise CheckpointReadError(f"{folder / TRAIN_STATE}: model_config describes a model that cannot be built "
                                  f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})") from None
    held = shard_bytes(folder, "model.")
    if numel > held:
        raise CheckpointReadError(f"{folder / TRAIN_STATE}: model_config describes {numel} parameters, but the "
                                  f"checkpoint's model shards hold {held} bytes; it does not belong to these shards")


def _read_model(folder: Path, quantizer: BaseQuantizer | None = None) -> tuple[nn.Module, dict[str, Any]]:
    from mindvl.models import MindVL, MindVLConfig

    train_state = read_train_state(folder)
    try:
        config = MindVLConfig.from_dict(train_state["model_config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder / TRAIN_STATE}: model_config is not a valid model config ({exc})") from None
    if FROZEN_BASE not in train_state:  # every weight comes from the shards: they must be able to hold the model
        _check_model_fits_shards(folder, config)
    model = MindVL(config)
    lora = (train_state.get("recipe") or {}).get("model", {}).get("lora")
    if lora is not None:  # a LoRA run's checkpoint holds the adapters (and, before frozen_base, the base weights)
        from mindvl.models.lora import LoRAConfig, inject_lora
        from mindvl.typed import build

        inject_lora(model, build(LoRAConfig, lora, "model.lora"))
    state = {"model": model.state_dict()}
    if FROZEN_BASE in train_state:  # the base from where the run read it, checked; the rest from the checkpoint
        from .frozen_base import read_base

        ref = train_state[FROZEN_BASE]
        base = read_base(ref, config, str(folder))
        saved = {k.removeprefix("model.") for k in read_metadata(folder).state_dict_metadata if k.startswith("model.")}
        missing = set(state["model"]) - set(base) - saved
        if missing:
            raise CheckpointReadError(f"{folder}: neither the checkpoint nor its base holds {sorted(missing)[:3]} "
                                      f"({len(missing)} tensors); export a checkpoint of this run's recipe")
        model.load_state_dict(base, strict=False)
        if ref.get("quantize"):  # QLoRA: the adapted base weights as the run used them
            if quantizer is None:
                raise ValueError(f"{folder}: a QLoRA checkpoint ({ref['quantize']} base); export it with the CLI "
                                 "(mindvl export), which redoes the quantization")
            quantizer(model, ref)
        state = {"model": {k: v for k, v in state["model"].items() if k in saved}}
    read_dcp(folder, state, distributed=False)
    model.load_state_dict(state["model"], strict=FROZEN_BASE not in train_state)
    return model, train_state
