"""LoRA on a tiny DeepSeek-V3-style MoE (MLA attention, a dense first layer, 16 routed experts + a shared expert)
under expert parallelism: EP=2 over 2 gloo processes equals 1 process (losses, final weights, adapters); adapters go
on the attention, the dense MLP and the shared experts, never on the routed experts or the router (mindvl.models.lora
says why); the checkpoints hold the adapters only."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from test_expert_parallel import ep_raw
from test_lora_train import initial_weights
from train_helpers import CLI, assert_same_run, load_weights, run, run_ranks, write_recipe

from mindvl.checkpoint.adapters import read_adapter
from mindvl.checkpoint.dcp_io import read_metadata
from mindvl.config import load_recipe
from mindvl.models import MindVLConfig

MLA_LORA = {"r": 4, "alpha": 8, "modules": ["language_model"],
            "targets": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def lora_ep_raw(out, cache, ep: int) -> dict:
    raw = ep_raw(out, cache, ep, phase={"name": "sft", "trainable": []},
                 optim={"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 0.0})
    raw["model"]["lora"] = dict(MLA_LORA)
    return raw


@pytest.mark.slow
def test_lora_with_expert_parallelism_equals_one_process(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")
    one = write_recipe(tmp_path / "one.yaml", lora_ep_raw(tmp_path / "one", cache, 1))
    r = run([sys.executable, str(script), "train", str(one), "parallel.fsdp=off"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    two = write_recipe(tmp_path / "two.yaml", lora_ep_raw(tmp_path / "two", cache, 2))
    r = run_ranks(tmp_path, 2, ["train", str(two)], timeout=400, script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "two", 1e-5)

    final = load_weights(tmp_path / "two" / "final")
    config = MindVLConfig.from_dict(json.loads((tmp_path / "two" / "final" / "config.json").read_text()))
    _, adapters, _ = read_adapter(tmp_path / "two" / "final" / "adapter", config)
    layers = {n.rsplit(".", 1)[0] for n in adapters}
    assert "language_model.layers.1.mlp.shared_experts.up_proj" in layers
    assert "language_model.layers.0.mlp.down_proj" in layers and "language_model.layers.1.self_attn.kv_b_proj" in layers
    assert not any(".experts." in n or ".gate." in n for n in adapters)  # routed experts and router: frozen
    assert all(bool(t.abs().sum() > 0) for n, t in adapters.items() if n.endswith("lora_B"))
    # the routed experts and routers are the base's, bit for bit (frozen, and no adapter merged into them)
    _, start = initial_weights(load_recipe(raw=lora_ep_raw(tmp_path / "x", cache, 2)))
    moe = [n for n in final if ".mlp.experts." in n or ".mlp.gate." in n]
    assert moe and all(torch.equal(final[n], start[n]) for n in moe)
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000002"
    saved = {k for k in read_metadata(ckpt).state_dict_metadata if k.startswith("model.")}
    assert saved and all(".lora_" in k or k.endswith("e_score_correction_bias") for k in saved), sorted(saved)[:4]
