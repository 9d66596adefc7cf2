"""Threat model, item 2: a checkpoint is a closed folder of regular files. A `.metadata` built only from allowed
classes, a shard or `.metadata` that is a symlink, a device or a FIFO, offsets and lengths outside the file or
beyond what a tensor needs, storage transforms, and a `train_state.json` describing a model larger than its shards:
each is refused with one CheckpointReadError/UnsafeCheckpointError naming the file, before anything large is read
or allocated and without waiting on a FIFO."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from mindvl.checkpoint.dcp_io import CheckpointReadError, UnsafeCheckpointError, read_dcp, read_metadata
from mindvl.checkpoint.training import TRAIN_STATE, export_checkpoint


def small_checkpoint(folder: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(folder), no_dist=True)
    return folder


def rewrite(folder: Path, edit) -> None:
    """Unpickle the genuine metadata (plain pickle: it is ours), let `edit` change it, pickle it back."""
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def shard_of(folder: Path) -> Path:
    (shard,) = [p for p in folder.iterdir() if p.suffix == ".distcp"]
    return shard


class _SplitPath:
    """Pickles as a PosixPath whose BUILD step sets its slots: it prints as the in-folder shard but joins to an
    absolute path elsewhere (what a plain unpickler builds from allowed classes alone)."""

    def __init__(self, shown: str, real: str):
        self.shown, self.real = shown, real

    def __reduce__(self):
        return (PosixPath, (self.shown,), (None, {"_parts": ["/", *self.real.strip("/").split("/")], "_str": self.shown,
                                                  "_drv": "", "_root": "/"}))


def test_build_on_an_allowed_class_is_refused(tmp_path):
    ck = small_checkpoint(tmp_path / "ck")
    outside = tmp_path / "outside.distcp"
    shutil.copy(shard_of(ck), outside)
    name = shard_of(ck).name

    def split(meta):
        for info in meta.storage_data.values():
            info.relative_path = _SplitPath(name, str(outside))

    rewrite(ck, split)
    with open(ck / ".metadata", "rb") as f:  # the control: a plain unpickler gives a path that lies
        info = next(iter(pickle.load(f).storage_data.values()))
    assert str(info.relative_path) == name and str(ck / info.relative_path) == str(outside)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing to load it: it sets the state of a "
                                                    r"pathlib\.PosixPath"):
        read_metadata(ck)


def test_a_dataclass_build_with_foreign_keys_is_refused(tmp_path):
    ck = small_checkpoint(tmp_path / "ck")
    assert read_metadata(ck).storage_data  # genuine metadata (every BUILD on a dataclass, own fields) passes
    (ck / ".metadata").write_bytes(_with_extra_field(ck))
    with pytest.raises(UnsafeCheckpointError, match="sets the state"):
        read_metadata(ck)


def _with_extra_field(ck: Path) -> bytes:
    with open(ck / ".metadata", "rb") as f:
        meta = pickle.load(f)
    info = next(iter(meta.storage_data.values()))
    info.__dict__["open_instead"] = "/etc/passwd"  # a state key that is not a field of _StorageInfo
    return pickle.dumps(meta)


@pytest.mark.parametrize("kind", ["symlink_to_dev_zero", "fifo", "symlink_outside"])
def test_a_shard_that_is_not_a_regular_file_in_the_folder_is_refused(tmp_path, kind):
    ck = small_checkpoint(tmp_path / "ck")
    shard = shard_of(ck)
    outside = tmp_path / "outside.distcp"
    shutil.copy(shard, outside)
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    else:
        os.symlink("/dev/zero" if kind == "symlink_to_dev_zero" else outside, shard)
    what = "not a regular file" if kind == "fifo" else "a symlink"
    with pytest.raises(CheckpointReadError, match=f"{shard.name} is {what}"):
        read_metadata(ck)


def test_a_fifo_or_symlinked_metadata_is_refused_without_waiting(tmp_path):
    ck = small_checkpoint(tmp_path / "ck")
    (ck / ".metadata").unlink()
    os.mkfifo(ck / ".metadata")
    with pytest.raises(CheckpointReadError, match=r"\.metadata is not a regular file"):
        read_metadata(ck)
    (ck / ".metadata").unlink()
    os.symlink("/dev/zero", ck / ".metadata")
    with pytest.raises(CheckpointReadError, match=r"\.metadata is a symlink"):
        read_metadata(ck)


@pytest.mark.parametrize("field,value,message", [
    ("offset", -1, "no valid offset and length"),
    ("length", -1, "no valid offset and length"),
    ("length", 12 << 30, "more than its tensor can need"),
    ("offset", 1.5, "no valid offset and length"),
    ("relative_path", "../outside.distcp", "not a plain file name"),
    ("relative_path", PosixPath("x.distcp"), "not a plain file name"),
    ("transform_descriptors", ["zstd"], "storage transforms"),
])
def test_bad_shard_entries_are_refused(tmp_path, field, value, message):
    ck = small_checkpoint(tmp_path / "ck")
    if field == "length":  # a sparse 12 GiB shard: the file is long enough, the entry asks for too much
        with open(shard_of(ck), "r+b") as f:
            f.truncate(13 << 30)

    def edit(meta):
        setattr(next(iter(meta.storage_data.values())), field, value)

    rewrite(ck, edit)
    with pytest.raises(CheckpointReadError, match=message):
        read_metadata(ck)


def test_an_entry_past_the_end_of_its_shard_is_refused(tmp_path):
    ck = small_checkpoint(tmp_path / "ck")
    with open(shard_of(ck), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointReadError, match="is truncated"):
        read_dcp(ck, {}, distributed=False)


def test_export_refuses_a_train_state_larger_than_its_shards_before_building(tmp_path, monkeypatch):
    """A 40 GB model_config with a tiny checkpoint: refused from the meta-device count, MindVL never built."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_mindvl import tiny_model

    import mindvl.models as models
    from mindvl.checkpoint.training import save_checkpoint

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = model.config.to_dict()
    save_checkpoint(tmp_path / "run", 1, model, opt, {"model_config": config, "recipe": {}}, {})
    ck = tmp_path / "run" / "step_00000001"
    state = json.loads((ck / TRAIN_STATE).read_text())
    state["model_config"]["text"].update(hidden_size=1 << 14, intermediate_size=1 << 16, num_hidden_layers=40)
    (ck / TRAIN_STATE).write_text(json.dumps(state))
    built = []
    real = models.MindVL
    monkeypatch.setattr(models, "MindVL", lambda cfg: built.append(torch.get_default_device()) or real(cfg))
    with pytest.raises(CheckpointReadError, match=r"train_state\.json: model_config describes \d+ parameters, but "
                                                  r"the checkpoint's model shards hold \d+ bytes"):
        export_checkpoint(ck, tmp_path / "out")
    assert all(d.type == "meta" for d in built)
    state["model_config"]["text"]["vocab_size"] = 2**70
    (ck / TRAIN_STATE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"train_state\.json"):
        export_checkpoint(ck, tmp_path / "out")


def test_a_fifo_train_state_is_refused_without_waiting(tmp_path):
    from mindvl.checkpoint.training import read_train_state

    (tmp_path / TRAIN_STATE).unlink(missing_ok=True)
    os.mkfifo(tmp_path / TRAIN_STATE)
    with pytest.raises(CheckpointReadError, match="not a regular file"):
        read_train_state(tmp_path)


def test_dcp_opens_shards_without_following_links(tmp_path):
    """A shard swapped for a link after the metadata check is still refused where DCP opens it."""
    from mindvl.checkpoint.dcp_io import SafeFileSystemReader

    ck = small_checkpoint(tmp_path / "ck")
    reader = SafeFileSystemReader(ck)
    reader.read_metadata()
    shard = shard_of(ck)
    with reader.fs.create_stream(shard, "rb") as f:
        assert f.read(4)
    shard.rename(tmp_path / "real.distcp")
    os.symlink(tmp_path / "real.distcp", shard)
    with pytest.raises(CheckpointReadError, match="is a symlink"):
        with reader.fs.create_stream(shard, "rb"):
            pass
