"""Threat model, item 5: reads and writes stay inside the folders given. A run folder whose `.lock`,
`recipe.json` or `checkpoints/latest` is a symlink (or a FIFO) is refused before anything is written through it; a
safetensors index naming `../victim/model.safetensors` is refused; a symlinked side file (`merges.txt`, the run's
`recipe.json`) is not copied into an exported model folder. Each check plants a secret or victim file and asserts
it is unread and unchanged."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mindvl.train.parallel import ParallelEnv
from mindvl.train.runfolder import RunFolderError, claim_run_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_mindvl import tiny_model_folder  # noqa: E402

ENV = ParallelEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize("name", [".lock", "recipe.json", "metrics.jsonl", "checkpoints/latest",
                                  "checkpoints/step_00000002/train_state.json"])
def test_a_run_folder_with_a_symlink_is_refused_and_the_target_untouched(tmp_path, name):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, run / name)
    with pytest.raises(RunFolderError, match=f"{run / name} is a symlink"):
        claim_run_folder(run, resuming=True, overwrite=False, env=ENV)
    assert victim.read_text() == "precious"
    assert not (run / ".lock").exists() or name == ".lock"


def test_a_fifo_in_a_run_folder_is_refused_without_waiting(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(RunFolderError, match="not a regular file or folder"):
        claim_run_folder(run, resuming=True, overwrite=False, env=ENV)


def test_a_clean_run_folder_and_a_linked_output_dir_are_accepted(tmp_path):
    real = tmp_path / "real"
    (real / "checkpoints").mkdir(parents=True)
    os.symlink(real, tmp_path / "link")  # output_dir itself may be a link (a bigger disk)
    lock = claim_run_folder(tmp_path / "link", resuming=True, overwrite=False, env=ENV)
    assert lock is not None and (real / ".lock").is_file()
    lock.release()


def test_a_safetensors_index_naming_another_folder_is_refused(tmp_path):
    from mindvl.checkpoint.safetensors_io import INDEX_NAME, TensorFolder

    victim = tiny_model_folder(tmp_path / "victim")
    m = tmp_path / "m"
    m.mkdir()
    names = TensorFolder(victim).names()
    (m / INDEX_NAME).write_text(json.dumps({"weight_map": {n: "../victim/model.safetensors" for n in names}}))
    with pytest.raises(ValueError, match=f"{m / INDEX_NAME}: shard '../victim/model.safetensors' is not a plain "
                                         "file name"):
        TensorFolder(m)


def test_symlinked_side_files_are_not_copied_into_an_output(tmp_path):
    from mindvl.checkpoint.hf import mindvl_config_from_hf, read_config
    from mindvl.checkpoint.side_files import write_side_files

    src = tiny_model_folder(tmp_path / "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-TOKEN")
    (src / "merges.txt").unlink(missing_ok=True)
    os.symlink(secret, src / "merges.txt")
    out = tmp_path / "out"
    out.mkdir()
    config = mindvl_config_from_hf(read_config(src), src)
    with pytest.raises(ValueError, match=r"merges\.txt: the side file resolves outside"):
        write_side_files(out, config, [src])
    assert not any(b"SECRET-TOKEN" in p.read_bytes() for p in out.iterdir() if p.is_file())
    assert not (out / "merges.txt").exists()


def test_a_symlinked_run_recipe_is_not_exported(tmp_path):
    from mindvl.checkpoint.dcp_io import CheckpointReadError
    from mindvl.checkpoint.training import _copy_run_recipe

    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_00000001"
    ck.mkdir(parents=True)
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "SECRET-TOKEN"}')
    os.symlink(secret, run / "recipe.json")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointReadError, match="recipe.json: the run recipe resolves outside"):
        _copy_run_recipe(ck, out)
    assert not (out / "recipe.json").exists()
    (run / "recipe.json").unlink()
    (run / "recipe.json").write_text("{}")
    _copy_run_recipe(ck, out)
    assert (out / "recipe.json").read_text() == "{}"
