"""`prepare_model` is the one preparation of a model: a transform added to `train.parallel.TRANSFORMS` once runs in
the planner's trace with no other edit (and the layout its meshes come from validates its dimensions)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from mindvl.config import load_recipe
from mindvl.plan import get_device, plan
from mindvl.train import parallel
from mindvl.train.parallel import ParallelLayout

ARCH = {"text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 8, "mrope_section": [1, 1, 2]},
        "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                   "fullatt_block_indexes": [1]}}
EXTRA = 1 << 20  # float32 elements of the buffer the dummy transform adds: 4 MiB, far above the trace's noise


def tiny_recipe(tmp_path):
    return load_recipe(raw={"output_dir": str(tmp_path / "out"), "model": {"arch": ARCH},
                            "data": {"sources": [{"synth": {"tasks": ["ocr"], "n": 4}}], "seq_len": 128,
                                     "max_pixels": 16 * 28 * 28, "synth_cache": str(tmp_path / "cache")},
                            "phase": {"name": "multitask"}, "batch": {"global_batch_size": 4},
                            "budget": {"max_steps": 1}})


def test_a_transform_registered_once_appears_in_the_planner_trace(tmp_path, monkeypatch):
    recipe = tiny_recipe(tmp_path)
    device = get_device("h100-80g")
    without = plan(recipe, 2, device)
    seen: list[tuple[bool, int]] = []

    def dummy(model, ctx):
        # a resident buffer (counted with the parameters by FSDP's tracker) and a hook on the projector's forward
        model.register_buffer("dummy_state", torch.zeros(EXTRA, device="meta"))
        model.projector.register_forward_hook(
            lambda mod, args, out: seen.append((isinstance(out, FakeTensor), ctx.layout.dp_size)))
        return model

    steps = [*parallel.TRANSFORMS]
    steps.insert([name for name, _ in steps].index("fsdp"), ("dummy", dummy))
    monkeypatch.setattr(parallel, "TRANSFORMS", steps)
    with_dummy = plan(recipe, 2, device)

    # the planner's step ran the transformed model: on fake tensors, with the layout of its 2 simulated ranks
    assert seen and all(s == (True, 2) for s in seen)
    # ... and traced the buffer: rank 0's resident parameters grew by exactly its bytes, nothing else moved
    assert with_dummy.breakdown["parameters"] - without.breakdown["parameters"] == 4 * EXTRA
    assert with_dummy.peak_bytes_per_rank - without.peak_bytes_per_rank == 4 * EXTRA
    assert with_dummy.params == without.params  # a buffer is no parameter


def test_layout_dimensions_multiply_to_the_world_and_give_the_data_parallel_size():
    layout = ParallelLayout(8, rank=5, ep=4)
    assert (layout.dp_size, layout.dp_rank, layout.expert_replicas) == (8, 5, 2)
    assert ParallelLayout(1).dp_size == 1
    with pytest.raises(ValueError, match=r"^parallel: data shards 3 x context 1 x tensor 1 must equal the world "
                                         r"size 4$"):
        ParallelLayout(4, dp_shard=3)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel: 4 must divide the world size 6$"):
        ParallelLayout(6, ep=4)
    with pytest.raises(ValueError, match=r"^parallel\.expert_parallel: expert parallelism needs more than one"):
        ParallelLayout(1, ep=2)
    assert (ParallelLayout(4, rank=3, tp=2).dp_size, ParallelLayout(4, rank=3, tp=2).dp_rank) == (2, 1)
    cp = ParallelLayout(8, rank=5, cp=2)  # context parallelism: ranks 4 and 5 share data shard 2
    assert (cp.dp_size, cp.dp_rank, cp.cp_rank, cp.fsdp_size) == (4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"context parallelism \(2\) and tensor parallelism \(2\) together"):
        ParallelLayout(8, cp=2, tp=2)
