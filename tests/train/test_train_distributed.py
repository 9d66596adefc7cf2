"""Two CPU processes (torchrun, gloo, FSDP2) train like one process on the same global batch."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from train_helpers import CLI, load_weights, raw_recipe, run, run_ranks, write_recipe

from mindvl.checkpoint.training import export_checkpoint


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_one_and_two(script, one, two, *one_overrides: str) -> None:
    """Train recipe `one` in one process and `two` on two processes (gloo, torchrun's environment); both must
    succeed."""
    r1 = run([sys.executable, str(script), "train", str(one), *one_overrides], timeout=300)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_ranks(script.parent, 2, ["train", str(two)], script=script)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "2 rank(s)" in r2.stdout


@pytest.mark.slow
def test_two_processes_fsdp_match_one_process(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")
    budget = {"max_steps": 3}
    one = write_recipe(tmp_path / "one.yaml", raw_recipe(tmp_path / "one", cache, budget=budget,
                                                         batch={"global_batch_size": 2, "data_shards": 2}))
    two = write_recipe(tmp_path / "two.yaml", raw_recipe(tmp_path / "two", cache, budget=budget,
                                                         batch={"global_batch_size": 2}))
    train_one_and_two(script, one, two, "parallel.fsdp=off")

    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(l1) == len(l2) == 3
    assert l1 == pytest.approx(l2, rel=1e-5)  # same packs, same global normalisation, different reduction order
    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5, msg=name)
    # The 2-rank DCP checkpoint reads back in one process (resharding) to the same weights.
    exported = load_weights(export_checkpoint(tmp_path / "two", tmp_path / "exp"))
    assert all(torch.equal(exported[n], w2[n]) for n in w2)
