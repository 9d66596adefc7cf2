"""Expert parallelism (parallel.expert_parallel): all-to-all dispatch equals one process; EP=2 and EP=4 training over
2 and 4 gloo processes equals the 1-process run step by step (losses, router-bias balancing, MaxVio, final weights);
checkpoints written at EP=4 resume at EP=2 and load at EP=1; bad EP sizes get one-line errors naming the key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_train_moe import moe_raw
from train_helpers import CLI, load_weights, run, run_ranks, write_recipe

from mindvl.checkpoint.training import export_checkpoint
from mindvl.config import load_recipe

HERE = Path(__file__).parent
TOL = 1e-5  # float32; measured ~5e-7


def test_all_to_all_dispatch_equals_one_process(tmp_path):
    """2 ranks, 16 experts; rank 0 sends nothing to rank 1, experts 1 and 15 get no token (see the worker)."""
    r = run_ranks(tmp_path, 2, [], script=HERE / "ep_dispatch_worker.py")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def ep_raw(out: Path, cache: Path, ep: int, **kw) -> dict:
    """The MoE training recipe with 16 experts (8 per group, top-2): every EP rank holds several experts."""
    raw = moe_raw(out, cache, budget={"max_steps": 3}, batch={"global_batch_size": 4, "data_shards": 4},
                  checkpoint={"every": 2, "keep": 2}, **kw)
    raw["model"]["arch"]["text"].update(n_routed_experts=16, n_group=2, topk_group=1)
    raw["parallel"] = {"expert_parallel": ep}
    return raw


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, steps: slice = slice(None)) -> None:
    ra, rb = records(a)[steps], records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        assert abs(x["loss"] - y["loss"]) <= TOL, (x["step"], x["loss"], y["loss"])
        assert x["moe_max_violation"] == pytest.approx(y["moe_max_violation"], abs=1e-6)
    wa, wb = load_weights(a / "final"), load_weights(b / "final")
    assert wa.keys() == wb.keys()
    for name in wa:  # includes every router's e_score_correction_bias, moved by 3 balancing updates
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=TOL, msg=name)


@pytest.mark.slow
def test_ep_training_equals_one_process_and_resumes_across_ep_sizes(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")  # ranks inherit MINDVL_PEAK_TFLOPS (tests/conftest.py)

    def recipe(name: str, ep: int) -> str:
        return str(write_recipe(tmp_path / f"{name}.yaml", ep_raw(tmp_path / name, cache, ep)))

    one = run([sys.executable, str(script), "train", recipe("one", 1), "parallel.fsdp=off"], timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    bias = load_weights(tmp_path / "one" / "final")["language_model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # the routers were balanced during the run

    # EP=2 over 2 processes and EP=4 over 4 (8 and 4 experts per rank, no expert replicas): 3 steps each
    for name, n in (("ep2x2", 2), ("ep4x4", 4)):
        r = run_ranks(tmp_path, n, ["train", recipe(name, n)], timeout=400, script=script)
        assert r.returncode == 0, r.stderr[-3000:]
        assert_same_run(tmp_path / "one", tmp_path / name)

    # The EP=4 checkpoint of step 2 (DCP: experts saved with their global [E, ...] shape, optimizer state too)
    # resumes at EP=2 on the same 4 processes (each expert slice now FSDP-sharded over 2 replicas): step 3 and the
    # final weights equal the uninterrupted run. (The data state is per rank, so resuming needs the same world.)
    step2 = tmp_path / "ep4x4" / "checkpoints" / "step_00000002"
    r = run_ranks(tmp_path, 4, ["train", recipe("ep2x4", 2), f"checkpoint.resume={step2}"], timeout=400,
                  script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "ep2x4", steps=slice(2, None))
    # ... and loads at EP=1 in one process: the same weights as the 1-process run's own step-2 checkpoint.
    at_ep1 = load_weights(export_checkpoint(step2, tmp_path / "ep1"))
    ref = load_weights(export_checkpoint(tmp_path / "one" / "checkpoints" / "step_00000002", tmp_path / "ref"))
    for name in ref:
        torch.testing.assert_close(at_ep1[name], ref[name], rtol=0, atol=TOL, msg=name)


def test_bad_expert_parallel_sizes_name_the_key(tmp_path):
    from mindvl.models import MindVL, MindVLConfig, TextConfig
    from mindvl.train.expert_parallel import check_expert_parallel

    raw = ep_raw(tmp_path / "x", tmp_path / "cache", 3)
    with pytest.raises(ValueError, match=r"parallel\.expert_parallel: 3 must divide .*n_routed_experts \(16\)"):
        load_recipe(raw=raw)
    raw = ep_raw(tmp_path / "x", tmp_path / "cache", 2)
    raw["model"]["arch"]["text"] = {"hidden_size": 32}
    with pytest.raises(ValueError, match=r"parallel\.expert_parallel: 2 asks for expert parallelism, but "
                                         r"model\.arch\.text is a dense qwen3"):
        load_recipe(raw=raw)
    # at run time (models given by folder): checked against the built model and the world size
    with torch.device("meta"):
        dense = MindVL(MindVLConfig(text=TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=8)))
        moe = MindVL(MindVLConfig(text=TextConfig(vocab_size=64, **{**ep_raw(tmp_path, tmp_path, 1)["model"]["arch"][
            "text"], "mrope_section": None})))
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel: 2 asks .* dense"):
        check_expert_parallel(2, 2, dense)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel: 4 must divide the world size 2$"):
        check_expert_parallel(4, 2, moe)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel: 32 must divide the number of routed experts"):
        check_expert_parallel(32, 32, moe)
    check_expert_parallel(4, 8, moe)


def test_ep_dispatch_under_fake_tensors_assumes_balanced_routing():
    """The planner runs the step on fake tensors over a fake process group: no routing to read, so each rank is
    assumed to send and receive T*k/ep rows; shapes (and bf16 grouped GEMMs) go through forward and backward."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mindvl.models.moe import RoutedExperts
    from mindvl.train.expert_parallel import apply_expert_parallel
    from mindvl.train.parallel import ParallelLayout

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        with torch.device("meta"):
            experts = RoutedExperts(16, 32, 16, "silu")
        apply_expert_parallel(experts, ParallelLayout(8, dist.get_rank(), ep=4).meshes("cpu").expert)
        with FakeTensorMode(allow_non_fake_inputs=True):
            experts.to_empty(device="cpu").to(torch.bfloat16)
            x = torch.randn(10, 32, dtype=torch.bfloat16, requires_grad=True)
            out = experts(x, torch.randint(0, 16, (10, 2)), torch.rand(10, 2))
            out.sum().backward()
            assert out.shape == (10, 32) and experts.gate_proj.grad.to_local().shape == (4, 16, 32)
    finally:
        dist.destroy_process_group()


def plan_recipe(tmp_path, ep: int, world: int):
    raw = ep_raw(tmp_path / f"p{ep}x{world}", tmp_path / "cache", ep)
    raw["model"]["arch"]["text"].update(hidden_size=64, moe_intermediate_size=64)
    raw["batch"], raw["budget"] = {"global_batch_size": world}, {"max_steps": 1}
    raw["phase"] = {"name": "multitask", "trainable": ["language_model"]}
    return load_recipe(raw=raw)


def planned_ep(tmp_path, ep: int, world: int):
    from mindvl.plan import get_device, plan

    return plan(plan_recipe(tmp_path, ep, world), world, get_device("h100-80g"))


def test_planner_traces_an_expert_parallel_step(tmp_path):
    """`mindvl plan` runs the real parallelize + step: with expert_parallel 2 of 8 fake ranks the experts are EP x
    FSDP sharded over all 8, so rank 0's optimizer state equals the plain-FSDP plan's (experts are 2/3 of it)."""
    with_ep, without = planned_ep(tmp_path, 2, 8), planned_ep(tmp_path, 1, 8)
    assert with_ep.breakdown["optimizer_state"] == pytest.approx(without.breakdown["optimizer_state"], rel=0.02)
    assert with_ep.breakdown["activations"] > 0
    # the token all-to-all is counted: 1 MoE layer, top-2 rows of which half leave the rank, bf16, 4 transfers
    tokens = sum(p["tokens"] for p in with_ep.packs) / len(with_ep.packs)
    assert with_ep.comm_bytes_per_step["all_to_all"] == pytest.approx(1 * 4 * tokens * 2 * 0.5 * 64 * 2, rel=0.01)
    assert "all_to_all" not in without.comm_bytes_per_step


def test_planner_ep_with_fewer_local_experts_than_replicas_holds_1_over_w_of_every_weight(tmp_path):
    """At scale E < W (256 experts, 512 ranks): 16 experts, EP 4 of 32 fake ranks leaves 4 local experts to split
    over 8 replicas. Rank 0 must hold 1/32 of every parameter (AdamW: 8 bytes per element it holds), counted by hand
    from the model's parameter total; FSDP's default dim-0 split held one whole local expert per rank (2x), which
    this would have caught. The collectives are counted by hand too: the experts (3 x 16 x 64 x 64 per MoE layer)
    are gathered in bf16 (forward + backward) and reduced in fp32 as 1/4 slices over 8 replicas, the rest over 32."""
    import math

    from mindvl.models import MindVL
    from mindvl.plan import model_config

    r = planned_ep(tmp_path, 4, 32)
    total, trainable = r.params["total"], r.params["trainable"]  # the language model trains, the ViT is frozen
    with torch.device("meta"):
        meta = MindVL(model_config(plan_recipe(tmp_path, 4, 32))[0])
    # rank 0's elements: experts exactly 1/32; every other (trainable) weight in FSDP's ceil(dim0 / 32)-row chunks
    params = list(meta.language_model.named_parameters())
    held = sum(p.numel() // 32 if ".experts." in n else math.ceil(p.shape[0] / 32) * (p.numel() // p.shape[0])
               for n, p in params)
    # AdamW: two fp32 moments per element held, and one fp32 step count per parameter
    assert r.breakdown["optimizer_state"] == 8 * held + 4 * len(params)
    experts = 3 * 16 * 64 * 64  # one MoE layer (first_k_dense_replace 1 of 2 layers)
    ring, replica_ring = 31 / 32, 7 / 8
    gathered = (2 * (total - experts) * ring + 2 * experts / 4 * replica_ring) * 2  # the root once: see below
    assert gathered - (total - experts) * ring * 2 < r.comm_bytes_per_step["all_gather"] < gathered
    assert r.comm_bytes_per_step["reduce_scatter"] == pytest.approx(
        ((trainable - experts) * ring + experts / 4 * replica_ring) * 4, rel=1e-9)


def test_expert_slices_split_evenly_over_their_replicas():
    """parallelize on a fake world of 32 ranks at EP 4: every routed-expert parameter of rank 0 is exactly 1/32 of
    the global tensor (split on an inner dim over the 8 replicas), and keeps its global [E, ...] shape."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mindvl.config import ParallelSection
    from mindvl.models import MindVL, MindVLConfig, TextConfig
    from mindvl.train.expert_parallel import replica_shard_dim
    from mindvl.train.parallel import ParallelEnv, parallelize

    text = {**ep_raw(Path("x"), Path("c"), 4)["model"]["arch"]["text"], "mrope_section": None}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=32)
    try:
        with torch.device("meta"):
            model = MindVL(MindVLConfig(text=TextConfig(vocab_size=64, **text)))
        parallelize(model, ParallelEnv(0, 32, 0, torch.device("cpu"), "fake"),
                    ParallelSection(expert_parallel=4, mixed_precision="bf16"))
        experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
        assert experts
        for name, p in experts:
            assert p.shape[0] == 16 and p.to_local().numel() * 32 == p.numel(), (name, p.to_local().shape)
    finally:
        dist.destroy_process_group()
    assert replica_shard_dim(torch.Size([4, 64, 32]), 8) == 1
    assert replica_shard_dim(torch.Size([4, 6, 32]), 8) == 2
    assert replica_shard_dim(torch.Size([16, 6, 5]), 8) == 0  # no inner dim divides: FSDP's padded dim-0 split
