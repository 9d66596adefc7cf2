"""Does a change to the trainer keep training bit-identical? Run the tiny quickstart phases with one tree, then
another, and compare everything they wrote.

    PYTHONPATH=OLD_TREE python benchmarks/trainer_bit_identity.py run  /tmp/old   # e.g. a `git archive` of main
    PYTHONPATH=NEW_TREE python benchmarks/trainer_bit_identity.py run  /tmp/new
    python benchmarks/trainer_bit_identity.py compare /tmp/old /tmp/new

`run` trains the embedded tiny recipes (mindvl/recipes/tiny), shortened (a few steps, 24 samples per synthetic set,
packs of 512 tokens) so both trees finish in minutes, in these scenarios:
- warmup -> multitask (with validation loss every 2 steps) -> sft-512 (async checkpoint writes), each from the
  previous phase's `final/`, checkpoints every 1-2 steps: the quickstart's chain;
- badstep: NaN gradients at steps 2 and 3 (MINDVL_FAULT_NAN_STEPS), skipped, the run continues;
- badstop: the same with optim.max_bad_steps=2: the run stops (TooManyBadSteps);
- preempt: SIGTERM after step 2 is logged: the run checkpoints at step 3 and stops (Preempted, PREEMPTED marker),
  then resume=auto finishes it.
It saves one record (`record.pt`): per scenario the returned losses and steps or the stop message, metrics.jsonl
without its timing fields, every checkpoint's DCP state (model and optimizer tensors) and small files, `latest`,
the final folder's tensors and files, data_report.json and the PREEMPTED marker (its time removed).
`compare` walks both records: tensors with torch.equal, floats with == (exact; NaN equals NaN), the rest with ==,
and prints every difference (exit 1) or "bit-identical".
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# Wall-clock fields: they differ between any two runs.
TIMING_KEYS = {"step_time_s", "data_s", "forward_s", "backward_s", "optimizer_s", "tokens_per_s", "mfu", "time"}
SHORT = ["data.seq_len=512", "checkpoint.keep=10", "logging.every=1"]


def _normalise(value: Any, root: str) -> Any:
    """Paths under the run's root and the package's folder become relative: the two runs write to different folders,
    and the trees under comparison live in different folders (the tokenizer's path is recorded)."""
    if isinstance(value, str):
        import mindvl

        return value.replace(root, "<ROOT>").replace(str(Path(mindvl.__file__).parent), "<MINDVL>")
    if isinstance(value, dict):
        return {k: _normalise(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v, root) for v in value]
    return value


def _dcp_state(folder: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", weights_only=False)


def _folder(folder: Path, root: str) -> dict[str, Any]:
    """Every file of a run folder that training decides: tensors loaded, JSON parsed, timing fields dropped."""
    from mindvl.checkpoint.safetensors_io import TensorFolder

    rec: dict[str, Any] = {}
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rec["metrics"] = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]
    for name in ("data_report.json", "recipe.json"):
        if (folder / name).is_file():
            rec[name] = json.loads((folder / name).read_text())
    marker = folder / "PREEMPTED"
    if marker.is_file():
        rec["PREEMPTED"] = {k: v for k, v in json.loads(marker.read_text()).items() if k != "time"}
    ckpts = folder / "checkpoints"
    if ckpts.is_dir():
        for c in sorted(ckpts.iterdir()):
            if c.is_file():
                rec[f"checkpoints/{c.name}"] = c.read_text()
                continue
            rec[f"checkpoints/{c.name}/state"] = _dcp_state(c)
            for f in sorted(c.glob("*.json")):
                rec[f"checkpoints/{c.name}/{f.name}"] = json.loads(f.read_text())
    final = folder / "final"
    if final.is_dir():
        rec["final/tensors"] = {n: t.clone() for n, t in TensorFolder(final).iter_tensors()}
        for f in sorted(final.iterdir()):
            if f.suffix != ".safetensors" and f.is_file():
                rec[f"final/{f.name}"] = f.read_bytes()
    return _normalise(rec, root)


def _train(recipe: Path, out: Path, cache: Path, items: list[str]) -> dict[str, Any]:
    from mindvl.config import load_recipe
    from mindvl.train.stops import RunStopped
    from mindvl.train.trainer import train

    cfg = load_recipe(recipe, [f"output_dir={out}", f"data.synth_cache={cache}", *items])
    try:
        result = train(cfg)
    except RunStopped as exc:
        return {"stopped": type(exc).__name__, "message": exc.message}
    return {"steps": result.steps, "losses": result.losses}


def run(root: Path) -> None:
    from mindvl.quickstart import capped_sources, recipe_dir, sft_overrides
    from mindvl.train import sinks

    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    tiny, cache = recipe_dir(), root / "synth"

    def cap(name: str) -> list[str]:
        return capped_sources(tiny / name, 24)

    record: dict[str, Any] = {}

    def phase(name: str, recipe: str, items: list[str], env: dict[str, str] | None = None) -> None:
        os.environ.update(env or {})
        try:
            result = _train(tiny / recipe, root / name, cache, [*cap(recipe), *SHORT, *items])
        finally:
            for k in env or {}:
                os.environ.pop(k)
        record[name] = {"result": _normalise(result, str(root)), **_folder(root / name, str(root))}
        print(f"{name}: {result.get('losses', result.get('message'))}", flush=True)

    phase("warmup", "warmup.yaml", ["budget.max_steps=4", "checkpoint.every=2"])
    phase("multitask", "multitask.yaml", ["budget.max_steps=4", "checkpoint.every=2", "eval.every=2",
                                          "data.eval_fraction=0.2", f"init_from={root / 'warmup' / 'final'}"])
    phase("sft-512", "sft.yaml", [*sft_overrides(512, 16), "budget.max_steps=3", "checkpoint.every=1",
                                  "checkpoint.async_save=true", f"init_from={root / 'multitask' / 'final'}"])
    nan = {"MINDVL_FAULT_NAN_STEPS": "2,3"}
    phase("badstep", "warmup.yaml", ["budget.max_steps=5", "checkpoint.every=1"], nan)
    phase("badstop", "warmup.yaml", ["budget.max_steps=5", "checkpoint.every=1", "optim.max_bad_steps=2"], nan)

    # SIGTERM once step 2 is logged: the vote of step 3 stops the run after that step's checkpoint.
    log = sinks.MetricSinks.log

    def log_then_signal(self, rec: dict, *args, **kw):
        log(self, rec, *args, **kw)
        if rec["step"] == 2:
            signal.raise_signal(signal.SIGTERM)

    sinks.MetricSinks.log = log_then_signal  # type: ignore[method-assign]
    try:
        phase("preempt", "warmup.yaml", ["budget.max_steps=5", "checkpoint.every=10"])
    finally:
        sinks.MetricSinks.log = log  # type: ignore[method-assign]
    record["preempt-stopped"] = record.pop("preempt")
    phase("preempt", "warmup.yaml", ["budget.max_steps=5", "checkpoint.every=10", "resume=auto"])
    torch.save(record, root / "record.pt")
    print(f"record: {root / 'record.pt'}")


def _diff(a: Any, b: Any, where: str, out: list[str]) -> None:
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b)):
            out.append(f"{where}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{where}/{k}: only in {'new' if k not in a else 'old'}")
            else:
                _diff(a[k], b[k], f"{where}/{k}", out)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{where}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif type(a) is not type(b) or a != b:
        out.append(f"{where}: {a!r:.80} != {b!r:.80}")


def _count(rec: Any) -> tuple[int, int]:
    """(tensors, other leaves) compared."""
    if torch.is_tensor(rec):
        return 1, 0
    if isinstance(rec, dict):
        rec = list(rec.values())
    if isinstance(rec, list | tuple):
        pairs = [_count(v) for v in rec]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return 0, 1


def compare(old: Path, new: Path) -> int:
    a, b = (torch.load(p / "record.pt", weights_only=False) for p in (old, new))
    diffs: list[str] = []
    _diff(a, b, "", diffs)
    for d in diffs:
        print(d)
    tensors, leaves = _count(a)
    losses = sum(len(s["result"].get("losses", [])) for s in a.values())
    print(f"{len(a)} scenarios, {losses} returned losses, {tensors} tensors, {leaves} other values compared: "
          + ("bit-identical" if not diffs else f"{len(diffs)} differences"))
    return 1 if diffs else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
