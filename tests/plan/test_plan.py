"""The planner on a reduced model: the real step on a fake cluster of 8 and 64 ranks, checked against hand counts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os

import prefork
import pytest
import torch

from mindvl.config import load_recipe
from mindvl.models import MindVL
from mindvl.plan import get_device, plan, preset_config, verdict
from mindvl.plan.planner import reserve_bytes

ARCH = {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "mrope_section": [2, 3, 3]},
        "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                   "fullatt_block_indexes": [1]}}


def reduced_recipe(tmp_path, global_batch: int, **parallel):
    raw = {"output_dir": str(tmp_path / "out"), "model": {"arch": ARCH},
           "data": {"sources": [{"synth": {"tasks": ["ocr"], "n": 8}}], "seq_len": 512,
                    "max_pixels": 64 * 28 * 28, "synth_cache": str(tmp_path / "cache")},
           "phase": {"name": "multitask"}, "batch": {"global_batch_size": global_batch},
           "budget": {"max_steps": 1}, "parallel": {"activation_checkpointing": True, **parallel}}
    return load_recipe(raw=raw)


def rank0_numel(config, world: int) -> int:
    """Elements rank 0 holds of every parameter: FSDP2 shards dim 0 in ceil(d0 / world) rows."""
    with torch.device("meta"):
        model = MindVL(config)
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.parameters())


def check_traced_step(d: dict, config, world: int) -> None:
    """The JSON of a plan at `world` ranks: keys, and what can be counted by hand."""
    for key in ("fits", "peak_bytes_per_rank", "capacity_bytes", "reserve_bytes", "breakdown", "flops_per_step",
                "comm_bytes_per_step", "est_step_time_s", "est_mfu", "world_size", "device"):
        assert key in d
    assert d["fits"] and d["world_size"] == world and d["micro_batches_per_rank"] == 2
    b = d["breakdown"]
    assert sum(b.values()) == d["peak_bytes_per_rank"]
    # AdamW's two fp32 moments of rank 0's shards, counted by hand
    assert b["optimizer_state"] == pytest.approx(8 * rank0_numel(config, world), rel=0.01)
    assert b["activations"] > 0 and b["loss_temporaries"] >= 0
    # the prefetch window: two packs' pixel rows (fp32) resident, not the whole step's
    assert b["data_buffers"] == pytest.approx(2 * d["packs"][0]["patches"] * 1176 * 4, rel=0.01)
    # all-gathers per micro-batch: blocks twice (forward + backward), the root once; bf16; a ring sends (N-1)/N
    assert d["comm_bytes_per_step"]["all_gather"] > 0
    # no efficiency was measured on an H100 for this family: no time, and the report says why
    assert d["est_mfu"] is None and d["est_step_time_s"] is None and d["time_source"].startswith("no time")


def test_planner_at_64_ranks_and_verdicts(tmp_path):
    recipe = reduced_recipe(tmp_path, 128)
    result = plan(recipe, 64, get_device("h100-80g"))
    check_traced_step(json.loads(json.dumps(result.to_dict())), result_config(recipe), 64)
    assert verdict(result).startswith("fits:")
    # the same trace against a device too small for it: a one-line verdict naming the largest part and the knobs
    tiny = get_device("custom:mem_gb=0.1,tflops=100,hbm_gbs=1000,intra_gbs=100,inter_gbs=10")
    small = dataclasses.replace(result, device=tiny, capacity_bytes=tiny.memory_bytes,
                                reserve_bytes=reserve_bytes(tiny, result.peak_bytes_per_rank),
                                activation_checkpointing="off")
    line = verdict(small)
    assert not small.fits and "\n" not in line and line.startswith("does not fit")
    part = max(small.breakdown, key=small.breakdown.get)
    assert f"largest part: {part}" in line
    for knob in ("--world-size 128", "activation_checkpointing=full", "data.seq_len", "data.max_pixels"):
        assert knob in line


def test_plan_cli_at_8_ranks_prints_json(tmp_path):
    import subprocess

    import yaml

    recipe = reduced_recipe(tmp_path, 16)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe.to_dict()))
    argv = ["-c", "import sys; from mindvl.cli import main; sys.exit(main())", "plan", str(path),
            "--world-size", "8", "--device", "910b2-64g", "--json"]
    # forked with torch and mindvl imported (tests/prefork.py): the CLI's output and exit code as from `python -c`
    cmd = prefork.command(argv, dict(os.environ))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["device"]["name"] == "910b2-64g"
    check_traced_step(d, result_config(recipe), 8)
    bad = subprocess.run(cmd[:-2] + ["v100"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown device 'v100'; known: h100-80g" in bad.stderr


MOE = {"text": {"family": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
                "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
                "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mrope_section": [1, 1, 2]}}


def test_planner_runs_a_mixture_of_experts_model(tmp_path):
    """DeepSeek-V3-style MoE: routing over fake scores is taken as balanced; the same parallelize and step run."""
    raw = reduced_recipe(tmp_path, 16).to_dict()
    raw["model"] = {"arch": MOE}
    raw["phase"] = {"name": "multitask", "trainable": ["language_model"]}
    recipe = load_recipe(raw=raw)
    result = plan(recipe, 8, get_device("h100-80g"))
    assert result.breakdown["optimizer_state"] == pytest.approx(8 * rank0_numel(result_config(recipe), 8),
                                                                rel=0.01)
    assert result.breakdown["activations"] > 0


def result_config(recipe):
    from mindvl.plan import model_config

    return model_config(recipe)[0]


def test_bad_input_names_what_is_known(tmp_path):
    with pytest.raises(ValueError, match="known: h100-80g, h200, a100-80g, 910b1, 910b2-64g, rtx4090-24g, custom"):
        get_device("v100")
    with pytest.raises(ValueError, match="known: .*qwen3-8b"):
        preset_config("llama-3-8b")
    with pytest.raises(ValueError, match="missing tflops"):
        get_device("custom:mem_gb=10")


def test_traced_attention_has_the_fused_kernels_memory_for_mla_head_sizes():
    """MLA's V head (128) is smaller than Q/K's (192): CPU sdpa would fall back to its math path and build fp32
    [heads, L, L] scores that no accelerator kernel holds. Under the planner's `fused_attention_memory` V is padded as
    the flash/npu backends pad it: the same output (checked on real tensors against plain sdpa), and no [L, L]
    tensor in the fake trace (checked on every op's output)."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from mindvl.plan.simulate import fused_attention_memory

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 24, d, generator=g) for d in (12, 12, 8))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with fused_attention_memory():
        padded = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-6)

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            return out

    L = 512
    for fused in (False, True):
        with FakeTensorMode(), Shapes() as shapes:
            q, k = (torch.empty(1, 16, L, 192, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            v = torch.empty(1, 16, L, 128, dtype=torch.bfloat16, requires_grad=True)
            with fused_attention_memory() if fused else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
        scores = [s for s in shapes.seen if s[-2:] == (L, L)]
        assert out.shape == (1, 16, L, 128) and bool(scores) != fused, scores[:3]


def test_untied_embedding_is_resharded_after_the_forward(tmp_path):
    """parallelize gives an untied input embedding its own FSDP group: after the forward (on a fake world of 8) it is
    back to rank 0's shard (ceil(V / 8) rows) while the root's head stays gathered for the backward; a tied
    embedding (it is the head) stays in the root. The planner's count: the table is gathered twice per micro-batch."""
    from mindvl.config import ParallelSection
    from mindvl.models import MindVLConfig, TextConfig
    from mindvl.plan import estimate
    from mindvl.plan.fake import MetadataGateway, fake_world
    from mindvl.plan.packs import PackShape, fake_pack
    from mindvl.train.parallel import ParallelEnv, own_embedding_group, parallelize

    text = {k: v for k, v in ARCH["text"].items() if k != "mrope_section"}
    for tied in (False, True):
        config = MindVLConfig(text=TextConfig(vocab_size=100, tie_word_embeddings=tied, **text))
        with fake_world(8) as world:
            with torch.device("meta"):
                model = MindVL(config)
            assert (own_embedding_group(model) is None) == tied
            counts = estimate.param_counts(model)
            embed_numel = model.language_model.embed_tokens.weight.numel()
            head_numel = 0 if tied else model.language_model.lm_head.weight.numel()
            model = parallelize(model, ParallelEnv(0, 8, 0, torch.device("cpu"), "fake"),
                                ParallelSection(mixed_precision="bf16"))
            world.materialize(model)
            with world.mode, MetadataGateway():
                out = model(**fake_pack(PackShape([32]), config, world.fake))
            embedding = model.language_model.embed_tokens.weight
            if tied:  # the root's parameter, kept gathered after the forward
                assert embedding.shape == (100, 64) and not hasattr(embedding, "to_local")
                assert counts.root_params == embed_numel + 64  # + the final norm
            else:
                assert embedding.to_local().shape == (13, 64)  # ceil(100 / 8) rows: resharded
                assert tuple(model.language_model.lm_head.weight.shape) == (100, 64)
                assert counts.root_params == head_numel + 64
            assert out.loss_sum.dim() == 0
