"""Tensor + sequence parallelism (parallel.tensor_parallel) on gloo, with the tiny recipe's packed multi-sample rows,
images and M-RoPE: one forward/backward at TP=2 (2 processes) and TP=2 x FSDP=2 (4 processes) gives the one-process
loss and gradients; training at TP=2 and at TP=2 x FSDP=2 gives the one-process losses, gradient norms and final
weights; a DCP
checkpoint written at TP=2 resumes at TP=1; bad sizes get one-line errors naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from train_helpers import CLI, ODD_VOCAB, PARALLEL_EPS, assert_same_run, raw_recipe, run, run_ranks, write_recipe

from mindvl.config import load_recipe

HERE = Path(__file__).parent
TOL = 1e-5


@pytest.mark.parametrize(("procs", "family", "checkpointing"), [(2, "qwen3", "off"), (4, "qwen2", "full")])
def test_tp_forward_backward_equals_one_process(tmp_path, procs, family, checkpointing):
    """Qwen3 (q/k norms on the local heads) at TP=2; Qwen2 (qkv bias: Qwen2.5-VL's LLM) at TP=2 x FSDP=2 with
    every block recomputed in the backward (full activation checkpointing: the sequence gathers run again)."""
    r = run_ranks(tmp_path, procs, [str(tmp_path), "2", family, checkpointing], timeout=400,
                  script=HERE / "tp_worker.py")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def tp_raw(out: Path, cache: Path, tp: int) -> dict:
    """The tiny test recipe with an odd vocabulary (701: a split that floors V / N loses a row) and AdamW eps 1e-5
    (at which weights agree within 1e-5: train_helpers.PARALLEL_EPS), 3 steps."""
    raw = raw_recipe(out, cache, budget={"max_steps": 3}, batch={"global_batch_size": 2, "data_shards": 2},
                     checkpoint={"every": 2, "keep": 2})
    raw["model"]["arch"]["text"]["vocab_size"] = ODD_VOCAB
    raw["optim"]["eps"] = PARALLEL_EPS
    raw["parallel"] = {"tensor_parallel": tp}
    return raw


@pytest.mark.slow
def test_tp_training_equals_one_process_and_resumes_at_tp1(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")

    def recipe(name: str, tp: int) -> str:
        return str(write_recipe(tmp_path / f"{name}.yaml", tp_raw(tmp_path / name, cache, tp)))

    one = run([sys.executable, str(script), "train", recipe("one", 1), "parallel.fsdp=off"], timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    # TP=2 on 2 processes (one data shard reading both data shards in turn) and TP=2 x FSDP=2 on 4: 3 steps each
    for name, n in (("tp2x2", 2), ("tp2x4", 4)):
        r = run_ranks(tmp_path, n, ["train", recipe(name, 2)], timeout=500, script=script)
        assert r.returncode == 0, r.stderr[-3000:]
        assert_same_run(tmp_path / "one", tmp_path / name, TOL)

    # The TP=2 checkpoint of step 2 (DCP: TP shards saved with their global shapes, optimizer state too) resumes at
    # TP=1 in one process: step 3 and the final weights equal the uninterrupted run's (the data state is per data
    # shard; the two TP ranks held the same one).
    step2 = tmp_path / "tp2x2" / "checkpoints" / "step_00000002"
    r = run([sys.executable, str(script), "train", recipe("tp1", 1), "parallel.fsdp=off",
             f"checkpoint.resume={step2}"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "elastic" not in r.stdout
    assert_same_run(tmp_path / "one", tmp_path / "tp1", TOL, steps=slice(2, None))


def test_bad_tensor_parallel_sizes_name_the_key(tmp_path):
    from mindvl.models import MindVL, MindVLConfig, TextConfig
    from mindvl.train.parallel import ParallelLayout
    from mindvl.train.tensor_parallel import check_tensor_parallel

    raw = tp_raw(tmp_path / "x", tmp_path / "cache", 4)  # the tiny model: 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: 4 must divide "
                                         r"model\.arch\.text\.num_key_value_heads \(2\)$"):
        load_recipe(raw=raw)
    raw["parallel"]["tensor_parallel"] = 0
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: must be an integer >= 1, got 0$"):
        load_recipe(raw=raw)
    raw = tp_raw(tmp_path / "x", tmp_path / "cache", 2)
    raw["model"]["arch"]["text"]["family"] = "deepseek_v3"
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: 2: tensor parallelism splits dense"):
        load_recipe(raw=raw)
    load_recipe(raw=tp_raw(tmp_path / "x", tmp_path / "cache", 2))
    # the layout: the world size and expert parallelism
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: 4 must divide the world size 6$"):
        ParallelLayout(6, tp=4)
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: 2 with parallel\.expert_parallel 2"):
        ParallelLayout(8, tp=2, ep=2)
    layout = ParallelLayout(8, rank=5, tp=2)
    assert (layout.dp_size, layout.dp_rank) == (4, 2)
    # at run time (a model given by folder): against the built model
    with torch.device("meta"):
        model = MindVL(MindVLConfig(text=TextConfig(vocab_size=64, hidden_size=16, intermediate_size=18,
                                                    num_hidden_layers=1, num_attention_heads=4,
                                                    num_key_value_heads=4, head_dim=4)))
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: 16 must divide the language model's "
                                         r"num_attention_heads \(4\)$"):
        check_tensor_parallel(16, model)
    with pytest.raises(ValueError, match=r"^parallel\.tensor_parallel: 4 must divide the language model's "
                                         r"intermediate_size \(18\)$"):
        check_tensor_parallel(4, model)
    check_tensor_parallel(2, model)


def test_planner_traces_a_tensor_parallel_step(tmp_path):
    """`mindvl plan` runs the real TP + FSDP preparation and step on fake ranks: at TP=2 x FSDP=2 of 4 ranks,
    rank 0's optimizer state is 8 bytes (two fp32 AdamW moments) per element it holds, counted by hand: a split
    weight's TP half (rows of a column split and of the head, columns of a row split), then FSDP's ceil(dim0 / 2)
    rows of it; every other trainable weight, FSDP's rows of the whole; plus one fp32 step count per parameter.
    The TP collectives are the estimate's for the traced packs, reported beside FSDP's."""
    import math

    from mindvl.models import MindVL
    from mindvl.plan import estimate, get_device, model_config, plan
    from mindvl.plan.planner import format_report

    raw = tp_raw(tmp_path / "p", tmp_path / "cache", 2)
    raw["batch"], raw["budget"] = {"global_batch_size": 2}, {"max_steps": 1}
    recipe = load_recipe(raw=raw)
    r = plan(recipe, 4, get_device("h100-80g"))
    config = model_config(recipe)[0]
    with torch.device("meta"):
        meta = MindVL(config)
    col = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")

    def held(name: str, p: torch.Tensor) -> int:
        shape = list(p.shape)
        if name.startswith("language_model.") and any(f".{c}." in name for c in col):
            shape[0] = -(-shape[0] // 2)  # rank 0's rows: torch.chunk's ceil (the odd vocabulary: 351 of 701)
        elif name.startswith("language_model.") and (".o_proj." in name or ".down_proj." in name):
            shape[1] //= 2
        return math.ceil(shape[0] / 2) * math.prod(shape[1:])

    params = list(meta.named_parameters())
    assert r.breakdown["optimizer_state"] == 8 * sum(held(n, p) for n, p in params) + 4 * len(params)
    assert r.tensor_parallel == 2 and "2 data shards x TP 2" in format_report(r)
    tokens = sum(p["tokens"] for p in r.packs) / len(r.packs)
    assert r.comm_bytes_per_step["tp_reduce_scatter"] == pytest.approx(
        config.text.num_hidden_layers * 4 * tokens * config.text.hidden_size * 2 * 0.5)
    assert r.comm_bytes_per_step["tp_all_gather"] > r.comm_bytes_per_step["tp_reduce_scatter"]
    assert r.comm_bytes_per_step["all_gather"] > 0  # FSDP over the 2 data shards
    assert estimate.tensor_parallel_bytes(config, tokens, 10, 1, 1, False) == {}
