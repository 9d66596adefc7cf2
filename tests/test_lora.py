"""LoRA adapters: PEFT (the reference) loads mindvl's adapter folders onto the transformers model of the same base and
computes the same logits; mindvl loads PEFT's; merging equals base + adapter; the config's one-line errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_tiny import converted_qwen25vl, mm_kwargs, multimodal_ids, qwen3, random_pixels, rel_err

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.checkpoint.adapters import apply_adapter, load_adapted, read_adapter, save_adapter
from mindvl.models.lora import LoRAConfig, LoRALinear, inject_lora, merge_lora, merge_state
from mindvl.typed import build

peft = pytest.importorskip("peft")

VL_LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj", "qkv"],
           "modules": ["language_model", "visual"]}
ALL_LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj", "qkv", "fc1"],
            "modules": ["language_model", "visual", "projector"]}


@torch.no_grad()
def randomise_adapters(model, seed: int) -> None:
    """Non-zero B (a fresh adapter is the identity: it would hide a wrong name or scaling)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def vl_inputs():
    ids = multimodal_ids([5, [1, 4, 4], 7], seed=1)[None]
    pixels, grid = random_pixels([[1, 4, 4]], seed=2)
    return ids, pixels, grid


def mindvl_logits(model, ids, pixels=None, grid=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits


def hf_logits(model, ids, pixels=None, grid=None, vlm=None) -> torch.Tensor:
    kw = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": grid, **mm_kwargs(vlm, ids)}
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    hf, model = converted_qwen25vl(root, seed=3)
    return root, hf, model


def test_peft_loads_mindvls_adapter_onto_the_transformers_model(vl, tmp_path):
    root, hf, base = vl
    model = load_model(root / "mindvl")
    lora = build(LoRAConfig, VL_LORA, "model.lora")
    names = inject_lora(model, lora)
    assert any(n.startswith("visual.") for n in names) and "language_model.layers.1.mlp.down_proj" in names
    randomise_adapters(model, 0)
    with torch.no_grad():  # a fully trained projector travels as PEFT's modules_to_save
        model.projector.fc2.weight.add_(0.05)
    ids, pixels, grid = vl_inputs()
    ours = mindvl_logits(model.eval(), ids, pixels, grid)
    assert rel_err(ours, mindvl_logits(base, ids, pixels, grid)) > 1e-2  # the adapters change the function

    out = save_adapter(model.state_dict(), model.config, lora, tmp_path / "adapter", base=str(root / "mindvl"),
                       full_modules=["projector"])
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["model.visual.merger"]
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(out)).eval()
    theirs = hf_logits(peft_model, ids, pixels, grid, hf)
    assert rel_err(ours, theirs) <= 1e-5


def test_a_peft_saved_adapter_loads_into_mindvl(vl, tmp_path):
    root, hf, base = vl
    target = copy.deepcopy(hf)
    peft_cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "o_proj", "up_proj", "qkv"],
                               lora_dropout=0.0, init_lora_weights=False)  # random A and B
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(target, peft_cfg).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    ids, pixels, grid = vl_inputs()
    theirs = hf_logits(peft_model, ids, pixels, grid, hf)

    lora, adapters, full = read_adapter(tmp_path / "peft", base.config)
    assert lora.targets == ["o_proj", "q_proj", "qkv", "up_proj"] and not full
    model = apply_adapter(load_model(root / "mindvl"), tmp_path / "peft")
    assert rel_err(mindvl_logits(model, ids, pixels, grid), theirs) <= 1e-5
    merged = load_adapted(tmp_path / "peft", base=root / "mindvl")  # the path chat and eval take
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert rel_err(mindvl_logits(merged, ids, pixels, grid), theirs) <= 1e-5


def test_text_only_qwen3_adapter_round_trips_through_peft(tmp_path):
    hf = qwen3(tmp_path / "hf", seed=4)
    convert_from_hf(tmp_path / "hf", tmp_path / "mindvl")
    model = load_model(tmp_path / "mindvl")
    lora = build(LoRAConfig, {"r": 2, "alpha": 3}, "model.lora")  # every LLM linear layer
    inject_lora(model, lora)
    randomise_adapters(model, 1)
    save_adapter(model.state_dict(), model.config, lora, tmp_path / "a", base=str(tmp_path / "mindvl"))
    ids = torch.randint(2, 140, (1, 11), generator=torch.Generator().manual_seed(0))
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a")).eval()
    assert rel_err(mindvl_logits(model.eval(), ids), hf_logits(peft_model, ids)) <= 1e-5


def test_merging_equals_base_plus_adapter(vl):
    root, _, _ = vl
    model = load_model(root / "mindvl")
    assert "projector.fc1" in inject_lora(model, build(LoRAConfig, ALL_LORA, "model.lora"))
    randomise_adapters(model, 2)
    ids, pixels, grid = vl_inputs()
    adapted = mindvl_logits(model, ids, pixels, grid)
    lora = build(LoRAConfig, ALL_LORA, "model.lora")
    state = merge_state(model.state_dict(), lora.scaling)  # the streaming form (export --merge-adapters)
    merge_lora(model)  # the in-place form
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert rel_err(mindvl_logits(model, ids, pixels, grid), adapted) <= 1e-5
    plain = load_model(root / "mindvl")
    plain.load_state_dict(state)
    assert rel_err(mindvl_logits(plain, ids, pixels, grid), adapted) <= 1e-5


@pytest.mark.parametrize("raw, message", [
    ({"rank": 4}, "model.lora.rank: unknown key (known: r, alpha, dropout, targets, modules, quantize)"),
    ({"r": 0}, "model.lora.r: must be >= 1"),
    ({"modules": ["llm"]}, "model.lora.modules: unknown module 'llm' (known: visual, projector, language_model)"),
    ({"quantize": "int3"}, "model.lora.quantize: must be null or one of nf4"),
    ({"targets": ["lm_head"]}, "model.lora.targets: lm_head takes no adapter"),
])
def test_config_errors_are_one_line_and_name_the_key(raw, message):
    with pytest.raises(ValueError) as err:
        build(LoRAConfig, raw, "model.lora")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_target_matching_nothing_names_the_choices(vl):
    root, _, _ = vl
    with pytest.raises(ValueError, match=r"model.lora.targets: \['qproj'\] match no linear layer .*q_proj"):
        inject_lora(load_model(root / "mindvl"), build(LoRAConfig, {"targets": ["qproj"]}, "model.lora"))


def test_export_merge_adapters_and_merge_of_adapter_runs(vl, tmp_path):
    """`mindvl export ADAPTER --merge-adapters` folds an adapter into its base; `mindvl merge` of two folded runs is
    the base plus the mean of their updates (B A is averaged, not A and B apart); an adapter folder given to
    `merge` or to `export` without the flag is refused in one line naming the fix."""
    from mindvl.checkpoint.merge import merge_checkpoints
    from mindvl.cli import main

    root, _, _ = vl
    lora = build(LoRAConfig, {"r": 2, "alpha": 4, "targets": ["q_proj", "qkv"], "modules": ["language_model",
                                                                                          "visual"]}, "model.lora")
    deltas = []
    for seed in (0, 1):
        model = load_model(root / "mindvl")
        inject_lora(model, lora)
        randomise_adapters(model, seed)
        deltas.append({n + ".weight": layer.delta_weight() for n, layer in model.named_modules()
                       if isinstance(layer, LoRALinear)})
        save_adapter(model.state_dict(), model.config, lora, tmp_path / f"a{seed}", base=str(root / "mindvl"))
        out = str(tmp_path / f"m{seed}")
        assert main(["export", str(tmp_path / f"a{seed}"), "--merge-adapters", "--out", out]) == 0
    merge_checkpoints([tmp_path / "m0", tmp_path / "m1"], tmp_path / "avg")
    base, avg = load_model(root / "mindvl").state_dict(), load_model(tmp_path / "avg").state_dict()
    for name, value in base.items():
        expected = value + (deltas[0][name] + deltas[1][name]) / 2 if name in deltas[0] else value
        torch.testing.assert_close(avg[name], expected, rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match=r"is a LoRA adapter folder; merge the runs' final/ folders"):
        merge_checkpoints([tmp_path / "a0", tmp_path / "a1"], tmp_path / "bad")
    assert main(["export", str(tmp_path / "a0"), "--out", str(tmp_path / "x")]) == 2  # needs --merge-adapters


def test_load_model_reads_an_adapter_folder_as_its_merged_base(vl, tmp_path):
    root, _, base = vl
    model = load_model(root / "mindvl")
    lora = build(LoRAConfig, {"r": 2, "targets": ["v_proj"]}, "model.lora")
    inject_lora(model, lora)
    randomise_adapters(model, 3)
    save_adapter(model.state_dict(), model.config, lora, tmp_path / "a", base="../" + (root / "mindvl").name)
    (tmp_path / "a").rename(root / "adapter")  # a relative base path is read from the adapter folder
    ids, pixels, grid = vl_inputs()
    loaded = load_model(root / "adapter")  # what chat and eval call
    assert rel_err(mindvl_logits(loaded, ids, pixels, grid), mindvl_logits(model.eval(), ids, pixels, grid)) <= 1e-6


def test_shipped_lora_recipes_and_what_prepare_model_makes_trainable():
    """The packaged tiny/lora recipe and the MindVL-8B one-card recipes load; prepare_model (what the trainer and the
    planner run) leaves the adapters and the fully trained projector trainable and nothing else, so AdamW holds
    state for exactly those."""
    from pathlib import Path

    from mindvl.config import load_recipe
    from mindvl.models import MindVL
    from mindvl.train.lora import lora_config
    from mindvl.train.materialize import model_source
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import ParallelEnv, Prepared, prepare_model

    root = Path(__file__).resolve().parents[1] / "recipes" / "mindvl-8b"
    for name, quantize in (("sft-8k-lora-80g", None), ("sft-8k-qlora-24g", "nf4")):
        cfg = lora_config(load_recipe(root / f"{name}.yaml"))
        assert cfg.r == 64 and cfg.modules == ["language_model"] and cfg.quantize == quantize
    recipe = load_recipe("tiny/lora")
    env = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")
    from mindvl.data import load_tokenizer

    config, _ = model_source(recipe, load_tokenizer(), env)
    with torch.device("meta"):
        model = MindVL(config)
    done = Prepared()
    model = prepare_model(model, recipe, env, done)
    assert done.steps[:2] == ["freeze", "lora"] and done.lora_layers == 4 * 7
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if ".lora_" in n or n.startswith("projector.")}
    assert all(n.startswith("language_model.") for n in trainable if ".lora_" in n)
    assert done.trainable["visual"] == 0 and done.trainable["language_model"] == sum(
        p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    optimizer = build_optimizer(model, recipe.optim)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in model.named_parameters() if n in trainable)
