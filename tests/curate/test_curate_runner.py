"""Engines, resume and trainability of the output."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from curate_helpers import run, shard_bytes

from mindvl.curate import PipelineConfig, run_pipeline
from mindvl.curate.stages import REGISTRY, MapStage
from mindvl.curate.synth import pairs_corpus

pytest.importorskip("faiss")
pytest.importorskip("imagehash")

STAGES = [{"image_filter": {"min_side": 16}}, {"text_filter": {"min_words": 3}}, {"phash_dedup": {"max_distance": 8}},
          {"embed": {"thumbnail": 6}}, {"cluster": {"k": 4, "target": 40, "floor": 2, "semdedup": 0.9995}}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return pairs_corpus(str(tmp_path_factory.mktemp("pairs")), 60, dup_fraction=0.4, n_files=3, seed=2)


class CrashOnce(MapStage):
    """Raises on the first batch of one shard while armed: an interrupted run."""

    name = "test_crash_once"
    armed = True

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.shard = cfg["shard"]

    def process(self, batch):
        if CrashOnce.armed and batch and batch[0].key.startswith(self.shard + "/"):
            raise RuntimeError("simulated crash")
        return batch, []


def test_interrupted_run_resumes_without_redoing_or_duplicating(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(REGISTRY, "test_crash_once", CrashOnce)
    stages = [*STAGES[:4], {"test_crash_once": {"shard": "s00003"}}, STAGES[4]]
    cfg = PipelineConfig.from_dict({"inputs": corpus.files, "output": str(tmp_path / "a"), "split": 2,
                                    "batch_size": 8, "stages": stages})
    monkeypatch.setattr(CrashOnce, "armed", True)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_pipeline(cfg)
    work = tmp_path / "a" / ".work"
    assert sorted(os.listdir(work / "seg1")) == [f"s0000{i}.{ext}" for i in range(3) for ext in
                                                 ("arrays.npz", "done.json", "tar")]  # no partial shard left
    finished = {p: os.path.getmtime(work / "seg0" / p) for p in os.listdir(work / "seg0")}
    monkeypatch.setattr(CrashOnce, "armed", False)
    result = run_pipeline(cfg)
    assert result.shards_run == 3 + 6  # the 3 unfinished shards of segment 1, then all 6 of segment 2
    assert {p: os.path.getmtime(work / "seg0" / p) for p in os.listdir(work / "seg0")} == finished
    assert run_pipeline(cfg).shards_run == 0  # a finished run is not redone
    ref = PipelineConfig.from_dict({**cfg.to_dict(), "output": str(tmp_path / "b")})
    run_pipeline(ref)  # uninterrupted
    assert shard_bytes(str(tmp_path / "a")) == shard_bytes(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="holds the output of a different pipeline"):
        run_pipeline(PipelineConfig.from_dict({**cfg.to_dict(), "seed": 1}))


def test_local_workers_give_the_same_output_as_one_process(tmp_path, corpus):
    report1, items1 = run(corpus.files, str(tmp_path / "one"), STAGES, split=2)
    report2, items2 = run(corpus.files, str(tmp_path / "two"), STAGES, split=2,
                          engine={"name": "local", "workers": 2})
    assert shard_bytes(str(tmp_path / "one")) == shard_bytes(str(tmp_path / "two"))
    assert report1["stages"].keys() == report2["stages"].keys()
    for label, s in report1["stages"].items():
        assert (s["in"], s["out"], s["dropped"]) == tuple(report2["stages"][label][k] for k in ("in", "out", "dropped"))
    # the second run's shards ran in worker processes (how many of the two took work depends on scheduling)
    done = [json.load(open(tmp_path / "two" / ".work" / seg / f)) for seg in ("seg0", "seg1", "seg2")
            for f in os.listdir(tmp_path / "two" / ".work" / seg) if f.endswith(".done.json")]
    assert len(done) == 18 and os.getpid() not in {d["pid"] for d in done}
    assert len(items1) == 40 and all("cluster" in it.meta for it in items1)
    # no record is dropped silently: at every step in - out = counted drops, and each step feeds the next
    chain = ["read", "0:image_filter", "1:text_filter", "2:phash_dedup:annotate", "2:phash_dedup", "3:embed",
             "4:cluster:annotate", "4:cluster"]
    st = report1["stages"]
    assert list(st) and set(st) == set(chain)
    for a, b in zip(chain, chain[1:], strict=False):
        assert st[a]["in"] - st[a]["out"] == sum(st[a]["dropped"].values())
        assert st[a]["out"] == st[b]["in"], (a, b)
    assert st["4:cluster"]["out"] == report1["written"] == len(items1)
    assert os.path.exists(tmp_path / "one" / "report_clusters.png")
    assert os.path.exists(tmp_path / "one" / "report_examples.png")


def test_unreachable_ray_cluster_is_a_one_line_error(tmp_path, corpus):
    pytest.importorskip("ray")
    from mindvl.curate.executors import run_ray

    with pytest.raises(ValueError, match=r"engine\.address: cannot reach the Ray cluster at '127\.0\.0\.1:1'"):
        run_ray([{"job": 1}], 1, "127.0.0.1:1", work=print)


@pytest.mark.slow
def test_ray_data_engine_matches_one_process(tmp_path, corpus):
    pytest.importorskip("ray")
    import ray

    run(corpus.files, str(tmp_path / "one"), STAGES[:3], split=2)
    try:
        run(corpus.files, str(tmp_path / "ray"), STAGES[:3], split=2, engine={"name": "ray", "workers": 2})
    finally:
        ray.shutdown()
    assert shard_bytes(str(tmp_path / "one")) == shard_bytes(str(tmp_path / "ray"))


@pytest.mark.slow
def test_curated_shards_train(tmp_path, corpus):
    from mindvl.cli import main

    run(corpus.files, str(tmp_path / "cur"), STAGES, split=2)
    recipe = {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"arch": {"text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                    "mrope_section": [1, 1, 2]},
                           "vision": {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                      "fullatt_block_indexes": [0]}}},
        "data": {"sources": [{"paths": [str(tmp_path / "cur" / "shards" / "*.tar")]}], "seq_len": 256,
                 "max_pixels": 16 * 28 * 28, "min_pixels": 4 * 28 * 28, "pack_buffer": 4, "strict": True},
        "phase": {"name": "multitask"}, "batch": {"global_batch_size": 1},
        "optim": {"lr": 1e-3}, "budget": {"max_steps": 3}, "checkpoint": {"every": 3, "keep": 1},
        "logging": {"progress": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 0
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics if "loss" in m][-1] == 3
    assert all(m["loss"] > 0 for m in metrics if "loss" in m)
