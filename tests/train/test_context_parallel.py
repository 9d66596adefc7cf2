"""Context parallelism (parallel.context_parallel): the Ulysses all-to-all attention equals plain attention; CP=2
training over 2 gloo processes (packed multi-sample rows with images and M-RoPE) equals the 1-process run step by
step (losses and gradient norms within 1e-5 relative, final weights within 1e-5 at AdamW eps 1e-5), and so does
CP=2 x FSDP 2 over 4 processes (KV heads replicated at CP=4 too); a checkpoint written at CP=2 resumes at CP=1 in
one process (DCP resharding); bad sizes get one-line errors naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from train_helpers import CLI, ODD_VOCAB, PARALLEL_EPS, assert_same_run, raw_recipe, run, run_ranks, write_recipe

from mindvl.config import load_recipe

HERE = Path(__file__).parent
TOL = 1e-5  # float32


def cp_raw(out: Path, cache: Path, cp: int, batch: dict | None = None, **parallel) -> dict:
    """The tiny test recipe (4 heads, 2 KV heads, M-RoPE, a 2-block ViT, 192-token packs of several samples with
    images, an odd vocabulary of 701, AdamW eps 1e-5: train_helpers.PARALLEL_EPS), 3 steps of 2 packs each unless
    `batch` says otherwise."""
    raw = raw_recipe(out, cache, budget={"max_steps": 3}, batch=batch or {"global_batch_size": 2},
                     checkpoint={"every": 1, "keep": 3})
    raw["model"]["arch"]["text"]["vocab_size"] = ODD_VOCAB
    raw["optim"]["eps"] = PARALLEL_EPS
    raw["parallel"] = {"context_parallel": cp, **parallel}
    return raw


def test_ulysses_attention_equals_plain_attention(tmp_path):
    """2 and 4 ranks: q/k/v chunks through the all-to-all attention (forward and backward, KV heads fewer than the
    ranks at 4) equal one process's varlen attention on the whole row (see the worker)."""
    for n in (2, 4):
        r = run_ranks(tmp_path, n, [], timeout=300, script=HERE / "cp_attention_worker.py")
        assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
def test_cp_training_equals_one_process_and_resumes_at_cp1(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")

    def recipe(name: str, cp: int) -> str:
        return str(write_recipe(tmp_path / f"{name}.yaml", cp_raw(tmp_path / name, cache, cp)))

    one = run([sys.executable, str(script), "train", recipe("one", 1), "parallel.fsdp=off"], timeout=900)
    assert one.returncode == 0, one.stderr[-2000:]

    r = run_ranks(tmp_path, 2, ["train", recipe("cp2", 2)], timeout=900, script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "cp2", TOL)

    # The CP=2 checkpoint of step 2 (DCP, FSDP-sharded over the 2 context ranks) resumes at CP=1 in one process
    # (same data shard: the CP group read one shard): step 3 and the final weights equal the uninterrupted run.
    step2 = tmp_path / "cp2" / "checkpoints" / "step_00000002"
    r = run([sys.executable, str(script), "train", recipe("cp1", 1), "parallel.fsdp=off",
             f"checkpoint.resume={step2}"], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "cp1", TOL, steps=slice(2, None))


@pytest.mark.slow
def test_cp2_by_fsdp2_over_4_processes_equals_one_process(tmp_path):
    """4 processes: 2 data shards x CP 2 (each CP group reads its own shard: 4 packs per step), with activation
    checkpointing (the all-to-alls run again in the recomputation), against one process reading the same 2
    shards."""
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")

    def recipe(name: str, cp: int) -> str:
        raw = cp_raw(tmp_path / name, cache, cp, batch={"global_batch_size": 4, "data_shards": 2},
                     activation_checkpointing="full")
        return str(write_recipe(tmp_path / f"{name}.yaml", raw))

    one = run([sys.executable, str(script), "train", recipe("one", 1), "parallel.fsdp=off"], timeout=900)
    assert one.returncode == 0, one.stderr[-2000:]
    r = run_ranks(tmp_path, 4, ["train", recipe("cp2x2", 2)], timeout=1200, script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "cp2x2", TOL)


def test_bad_context_parallel_sizes_name_the_key(tmp_path):
    from mindvl.models import MindVL, MindVLConfig, TextConfig
    from mindvl.train.context_parallel import check_context_parallel
    from mindvl.train.parallel import ParallelLayout

    with pytest.raises(ValueError, match=r"^parallel\.context_parallel: 3 must divide "
                                         r"model\.arch\.text\.num_attention_heads \(4\)"):
        load_recipe(raw=cp_raw(tmp_path / "x", tmp_path / "c", 3))
    with pytest.raises(ValueError, match=r"^parallel\.context_parallel: must be an integer >= 1, got 0"):
        load_recipe(raw=cp_raw(tmp_path / "x", tmp_path / "c", 0))
    raw = cp_raw(tmp_path / "x", tmp_path / "c", 2)
    raw["parallel"]["fsdp"] = False
    with pytest.raises(ValueError, match=r"^parallel\.context_parallel: 2 needs FSDP"):
        load_recipe(raw=raw)
    with pytest.raises(ValueError, match=r"^parallel\.context_parallel: 2 must divide the world size 3$"):
        ParallelLayout(3, 0, cp=2)
    with pytest.raises(ValueError, match=r"^parallel\.context_parallel: 2 with parallel\.expert_parallel 2"):
        ParallelLayout(4, 0, ep=2, cp=2)
    # at run time (a model given by folder): checked against the built model's heads
    with torch.device("meta"):
        model = MindVL(MindVLConfig(text=TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=8)))
    with pytest.raises(ValueError, match=r"^parallel\.context_parallel: 4 must divide the language model's "
                                         r"num_attention_heads \(2\)"):
        check_context_parallel(4, 4, model)
    check_context_parallel(2, 4, model)


def test_shard_labels_gives_every_target_to_one_rank():
    """Over the ranks of a group the kept next-token targets partition the pack's targets (hand-checked layout:
    two samples of 5 and 4 tokens, rank chunks [0, 4) [4, 9) at CP=2)."""
    from mindvl.conventions import IGNORE_INDEX
    from mindvl.models.loss import next_token_targets
    from mindvl.train.context_parallel import chunk_bounds, shard_labels

    labels = torch.tensor([-100, 11, 12, 13, 14, -100, 21, 22, 23])
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    full = next_token_targets(labels, cu)
    parts = [next_token_targets(shard_labels({"labels": labels}, 2, c)["labels"], cu) for c in range(2)]
    assert chunk_bounds(9, 2, 0) == (0, 4) and chunk_bounds(9, 2, 1) == (4, 9)
    assert parts[0].tolist() == [11, 12, 13, 14] + [IGNORE_INDEX] * 5  # targets at tokens 0..3
    assert parts[1].tolist() == [IGNORE_INDEX] * 4 + [IGNORE_INDEX, 21, 22, 23, IGNORE_INDEX]
    merged = torch.where(parts[0] != IGNORE_INDEX, parts[0], parts[1])
    assert torch.equal(merged, full)


def test_planner_traces_a_context_parallel_step(tmp_path):
    """`mindvl plan` runs prepare_model and the step with the CP hooks on a fake 4-rank world: FSDP gathers over
    data shards x context (per micro-batch the same bytes as without CP at the same world), and the Ulysses
    all-to-alls are counted by hand: per layer and micro-batch q, k, v and the output ([T/2, heads, 8] each, 4 query
    and 2 KV heads), half of each leaving the rank, in bf16, forward + backward + the recomputation."""
    from mindvl.plan import get_device, plan
    from mindvl.plan.planner import format_report

    def planned(cp: int):
        raw = cp_raw(tmp_path / f"p{cp}", tmp_path / "cache", cp, batch={"global_batch_size": 4},
                     activation_checkpointing="full")
        return plan(load_recipe(raw=raw), 4, get_device("h100-80g"))

    with_cp, without = planned(2), planned(1)
    assert (with_cp.accumulation, without.accumulation) == (2, 1)  # 2 data shards instead of 4
    assert with_cp.comm_bytes_per_step["all_gather"] == pytest.approx(2 * without.comm_bytes_per_step["all_gather"])
    mean = with_cp.tokens_per_step / 4  # tokens per step / global batch: the mean pack length
    per_token = 4 * 8 + 2 * 8 + 2 * 8 + 4 * 8
    hand = 2 * 2 * 3 * (mean / 2 * 1 / 2) * per_token * 2  # micro x layers x (fwd, bwd, recompute) x rows x 2 B
    assert with_cp.comm_bytes_per_step["context_all_to_all"] == pytest.approx(hand, rel=1e-3)
    assert "context_all_to_all" not in without.comm_bytes_per_step
    report = format_report(with_cp)
    assert "context all-to-all" in report and "data shards x context 2" in report
    # A plan that does not fit because of its activations names the next CP size first (4 divides 4 heads, 4 ranks)
    import dataclasses

    from mindvl.plan.planner import verdict

    big = dataclasses.replace(with_cp, capacity_bytes=1, breakdown={**with_cp.breakdown, "activations": 10**12})
    assert "try parallel.context_parallel=4, --world-size 8" in verdict(big)
    assert "context_parallel" not in verdict(dataclasses.replace(big, context_parallel=4))  # 8 divides no 4 heads
