"""A very small recipe (tiny towers, short packs, few synthetic samples) shared by the training tests."""

from __future__ import annotations

import copy
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from mindvl.checkpoint.safetensors_io import TensorFolder
from mindvl.checkpoint.training import read_latest
from mindvl.config import load_recipe
from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.train.parallel import ParallelEnv

BASE = {
    "seed": 0,
    "model": {"arch": {"text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                "mrope_section": [1, 1, 2]},
                       "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                  "fullatt_block_indexes": [1]}}},
    "data": {"sources": [{"synth": {"tasks": ["ocr", "chart"], "n": 48, "seed": 5}}], "seq_len": 192,
             "max_pixels": 16 * 28 * 28, "min_pixels": 4 * 28 * 28, "pack_buffer": 8, "default_system": None},
    "phase": {"name": "multitask"},
    "batch": {"global_batch_size": 2},
    "optim": {"lr": 1e-3, "min_lr": 1e-4, "grad_clip": 1.0, "weight_decay": 0.01},
    "budget": {"max_steps": 4},
    "checkpoint": {"every": 1, "keep": 3},
    "logging": {"progress": False, "tensorboard": False, "plot": False},
}


# An odd vocabulary above the tokenizer's 686 ids: a vocabulary split that floors V / N (686 splits evenly on 2 ranks)
# loses a row and fails the comparisons.
ODD_VOCAB = 701
# AdamW eps at which weights after a few steps equal another layout's within 1e-5: at the recipes' 1e-8, a 6e-10
# float32 difference in a near-zero embedding gradient (a token no pack holds) becomes a 5e-5 step in that weight.
PARALLEL_EPS = 1e-5


def raw_recipe(out: Path, cache: Path, **sections) -> dict:
    raw = copy.deepcopy(BASE)
    raw["output_dir"] = str(out)
    raw["data"]["synth_cache"] = str(cache)
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return raw


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in TensorFolder(folder).iter_tensors()}


def crash_then_resume(monkeypatch, raw: dict, step: int) -> dict[str, torch.Tensor]:
    """Train `raw` until a simulated crash right after the step-`step` checkpoint is finalized, then again with
    resume=auto; the final weights."""
    import pytest

    import mindvl.checkpoint.training as training
    from mindvl.train.trainer import train

    real_finalize = training._finalize

    def crash_after_step(partial, final, root):
        real_finalize(partial, final, root)
        if final.name == training.step_name(step):
            raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(training, "_finalize", crash_after_step)
    with pytest.raises(KeyboardInterrupt):
        train(load_recipe(raw=raw))
    monkeypatch.setattr(training, "_finalize", real_finalize)
    train(load_recipe(raw=raw, overrides=["resume=auto"]))
    return load_weights(Path(raw["output_dir"]) / "final")


def records(out: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def latest_step(out: Path) -> int:
    """The step of a run's `latest` checkpoint (0 while none is complete or `latest` is mid-write)."""
    try:
        found = read_latest(out / "checkpoints")
    except (ValueError, json.JSONDecodeError, FileNotFoundError):
        return 0
    return int(found.name.split("_")[1]) if found else 0


def assert_same_run(ref: Path, other: Path, tol: float, steps: slice = slice(None)) -> None:
    """`other` logged the same steps as `ref[steps]` with losses and gradient norms within `tol` relative and the
    same token counts (a context or tensor group's packs counted once), and its final weights equal `ref`'s within
    `tol`. The gradient norm is the one check that sees a wrongly scaled gradient: clipping and AdamW's division by
    its own second moment hide a factor of 2 from the losses and weights (a CP gradient averaged over the data
    shards instead of the FSDP group)."""
    import pytest

    ra, rb = records(ref)[steps], records(other)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] and rb
    for x, y in zip(ra, rb, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=tol, abs=0), (x["step"], x["loss"], y["loss"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=tol, abs=0), \
            (x["step"], "grad_norm", x["grad_norm"], y["grad_norm"])
        assert x["tokens"] == y["tokens"], (x, y)
    wa, wb = load_weights(ref / "final"), load_weights(other / "final")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=tol, msg=name)


CLI = "import sys; from mindvl.cli import main; sys.exit(main())"


def mindvl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", CLI, *args]


def write_recipe(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def env() -> dict:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"  # same kernels (and reduction order) in every process of a comparison
    e["PYTHONWARNINGS"] = "ignore"
    return e


def python(argv: list[str]) -> list[str]:
    """`python ARGV` (a script or `-c CODE`, then its arguments), forked from the tests' fork server when it runs
    (tests/prefork.py: torch and mindvl already imported; MINDVL_TEST_PREFORK=0 turns it off)."""
    import prefork  # tests/prefork.py: on the path in the test process (conftest), not in the worker scripts

    return prefork.command(argv, env())


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    if cmd[0] == sys.executable and len(cmd) > 1 and (cmd[1] == "-c" or cmd[1].endswith(".py")):
        cmd = python(cmd[1:])
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, args: list[str], world: int = 2, extra_env: dict | None = None,
           script: Path | None = None, logs: Path | None = None) -> list[subprocess.Popen]:
    """`world` processes of `mindvl ARGS` (or of `script ARGS`) with torchrun's environment variables, no torchrun
    in between: each rank's exit code and signals are the caller's, and no launcher process (its torch import and
    agent: ~2.5 CPU-s a launch, RESULTS.md) is started. torchrun itself is tested where it matters (test_requeue.py).
    Output: pipes, or with `logs` the files logs/rank_N.out and .err."""
    if script is None:
        script = tmp_path / "cli.py"
        script.write_text(CLI + "\n")
    port = free_port()
    procs = []
    for rank in range(world):
        e = env() | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if logs is None:
            out = err = subprocess.PIPE
        else:
            logs.mkdir(parents=True, exist_ok=True)
            out, err = open(logs / f"rank_{rank}.out", "w"), open(logs / f"rank_{rank}.err", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(python([str(script), *args]), env=e | (extra_env or {}), stdout=out,
                                      stderr=err, text=True))
        if logs is not None:
            out.close()
            err.close()
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) per rank; a rank still running after `timeout` s is killed, with every other."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def run_ranks(tmp_path: Path, world: int, args: list[str], timeout: float = 300,
              script: Path | None = None) -> subprocess.CompletedProcess:
    """`launch` and wait, as torchrun would: the first failing rank's exit code (0 if none failed), every rank's
    stdout and stderr in rank order. As torchrun does, a failed rank stops the others (they would otherwise wait
    for it in a collective until gloo's timeout)."""
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=tmp_path))
    procs = launch(tmp_path, args, world, script=script, logs=logs)
    deadline = time.time() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # the others' own error lines first
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    code = next((rc for rc in codes if rc != 0), 0)
    read = [(logs / f"rank_{r}.out").read_text() for r in range(world)]
    errs = [(logs / f"rank_{r}.err").read_text() for r in range(world)]
    return subprocess.CompletedProcess(args, code, "".join(read), "".join(errs))


def latest_name(out: Path) -> str | None:
    """The checkpoint `out`'s training names `latest` now, or None (none yet, or the pointer is mid-replace)."""
    try:
        found = read_latest(out / "checkpoints")
    except (ValueError, FileNotFoundError):
        return None
    return found.name if found else None


@contextmanager
def training_in_background(recipe: Path, out: Path, wait_s: float = 300) -> Iterator[subprocess.Popen]:
    """`mindvl train recipe` in a child process (stderr piped), yielded once `out` has its first `latest`
    checkpoint (so readers can race the checkpoints that follow); killed on exit if it still runs."""
    trainer = subprocess.Popen(mindvl_cmd("train", str(recipe)), env=env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + wait_s
        while latest_name(out) is None:
            if trainer.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"no checkpoint from the training (rc {trainer.poll()}): "
                                   f"{trainer.stderr.read()[-2000:] if trainer.poll() is not None else ''}")
            time.sleep(0.05)
        yield trainer
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


# One CPU process, no process group: what the in-process step tests run on.
CPU_ENV = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")


def recipe_and_packs(tmp: Path, n: int = 2):
    """The tiny test recipe, its tokenizer and the first `n` packs of its data (model input dicts)."""
    recipe = load_recipe(raw=raw_recipe(tmp / "o", tmp / "cache"))
    tok = load_tokenizer()
    packs = [p.to_torch() for p in itertools.islice(build_loader(DataConfig.from_dict(recipe.data), tok), n)]
    return recipe, tok, packs
