"""PEFT adapter folders both ways for every layout the README allows, on a tiny Qwen2.5-VL with tied and untied
embeddings: adapters on the LLM, the ViT or the projector, any other of them trained in full. mindvl -> PEFT: PEFT
loads the folder onto transformers' model with mindvl's logits (relative 1e-4); a flat `modules_to_save`, every
tensor of each saved module, the Conv3d patch embedding, a tied model's trained head. PEFT -> mindvl: an adapter
PEFT made and saved (its own modules_to_save) gives PEFT's logits in mindvl, and folding it in (`mindvl export
--merge-adapters`) gives the unmerged logits within 1e-5. An adapter on the projector inside a ViT saved whole has
no PEFT layout: refused in one line."""

from __future__ import annotations

import copy
import json

import hf_tiny as H
import pytest
import torch
from hf_tiny import mm_kwargs, multimodal_ids, random_pixels, rel_err
from safetensors.torch import load_file

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.checkpoint.adapters import apply_adapter, fold_adapter, load_adapted, save_adapter
from mindvl.models.lora import LoRAConfig, inject_lora
from mindvl.typed import build

peft = pytest.importorskip("peft")

TOL, MERGE_TOL = 1e-4, 1e-5
TARGETS = {"language_model": ["q_proj", "v_proj"], "visual": ["qkv"], "projector": ["fc1"]}
PEFT_TARGETS = {"language_model": r"model\.language_model\.layers\.\d+\.self_attn\.(q_proj|v_proj)",
                "visual": r"model\.visual\.blocks\.\d+\.attn\.qkv", "projector": r"model\.visual\.merger\.mlp\.0"}
# (adapted modules, modules trained in full, transformers' modules_to_save for them: flat)
LAYOUTS = [
    (["language_model"], ["visual"], ["model.visual"]),  # the projector frozen, inside the ViT saved whole
    (["language_model"], ["visual", "projector"], ["model.visual"]),
    (["language_model", "visual"], ["projector"], ["model.visual.merger"]),
    (["visual"], ["language_model"], ["lm_head", "model.language_model"]),
    (["visual", "projector"], ["language_model"], ["lm_head", "model.language_model"]),
    (["projector"], ["language_model"], ["lm_head", "model.language_model"]),
]
IDS = [f"lora-{'+'.join(a)}_full-{'+'.join(f)}" for a, f, _ in LAYOUTS]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def base(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tied" if request.param else "untied")
    hf = H.qwen25vl(root / "hf", seed=3, tie=request.param)
    convert_from_hf(root / "hf", root / "mindvl")
    return root, hf, request.param


def inputs():
    ids = multimodal_ids([5, [1, 4, 4], 7], seed=1)[None]
    pixels, grid = random_pixels([[1, 4, 4]], seed=2)
    return ids, pixels, grid


def ours(model, ids, pixels, grid) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits


def theirs(model, vlm, ids, pixels, grid) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, **mm_kwargs(vlm, ids)).logits


@torch.no_grad()
def trained(model, adapted: list[str], full: list[str], seed: int) -> LoRAConfig:
    """`model` with random adapters on `adapted` (non-zero B) and every parameter of `full` moved: a run's end."""
    lora = build(LoRAConfig, {"r": 4, "alpha": 8, "targets": sorted({t for m in adapted for t in TARGETS[m]}),
                              "modules": adapted}, "model.lora")
    inject_lora(model, lora)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".lora_" in name or name.split(".")[0] in full:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return lora


@pytest.mark.parametrize("adapted,full,to_save", LAYOUTS, ids=IDS)
def test_mindvl_adapter_loads_in_peft_and_folds_in(base, tmp_path, adapted, full, to_save):
    root, hf, _ = base
    model = load_model(root / "mindvl")
    lora = trained(model, adapted, full, seed=0)
    ids, pixels, grid = inputs()
    want = ours(model, ids, pixels, grid)
    out = save_adapter(model.state_dict(), model.config, lora, tmp_path / "a", base=str(root / "mindvl"),
                       full_modules=full)
    # (tied: `lm_head` is listed too, holding the trained embedding)
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == to_save
    saved = load_file(str(out / "adapter_model.safetensors"))
    hf_state = hf.state_dict()
    for top in to_save:  # every tensor of each saved module, in transformers' names and shapes
        names = {k for k in hf_state if k == top + ".weight" or k.startswith(top + ".")}
        assert names and {"base_model.model." + k for k in names} <= set(saved), top
        for k in names:
            assert saved["base_model.model." + k].shape == hf_state[k].shape, k
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(out))
    assert rel_err(theirs(peft_model, hf, ids, pixels, grid), want) <= TOL
    assert rel_err(ours(load_adapted(out, merge=False), ids, pixels, grid), want) <= MERGE_TOL  # read back
    fold_adapter(out, tmp_path / "folded")
    assert rel_err(ours(load_model(tmp_path / "folded"), ids, pixels, grid), want) <= MERGE_TOL


@pytest.mark.parametrize("adapted,full,to_save", LAYOUTS, ids=IDS)
def test_peft_made_adapter_loads_in_mindvl_and_folds_in(base, tmp_path, adapted, full, to_save):
    root, hf, tied = base
    target = "^(" + "|".join(PEFT_TARGETS[m] for m in adapted) + ")$"
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target, modules_to_save=to_save, lora_dropout=0.0,
                          init_lora_weights=False)
    torch.manual_seed(7)
    peft_model = peft.get_peft_model(copy.deepcopy(hf), cfg)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        params = dict(peft_model.named_parameters())
        for name, p in params.items():
            if "modules_to_save.default" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        if tied and "lm_head" in to_save:  # a tied model's head is its embedding: PEFT's two copies agree
            head = [p for n, p in params.items() if n.endswith("lm_head.modules_to_save.default.weight")]
            embed = [p for n, p in params.items() if n.endswith("embed_tokens.weight") and "modules_to_save" in n]
            head[0].copy_(embed[0])
    peft_model.save_pretrained(tmp_path / "peft")
    ids, pixels, grid = inputs()
    want = theirs(peft_model, hf, ids, pixels, grid)
    model = apply_adapter(load_model(root / "mindvl"), tmp_path / "peft")
    got = ours(model, ids, pixels, grid)
    assert rel_err(got, want) <= TOL
    assert rel_err(got, ours(load_model(root / "mindvl"), ids, pixels, grid)) > 1e-2  # the adapter matters
    fold_adapter(tmp_path / "peft", tmp_path / "folded", base=root / "mindvl")
    assert rel_err(ours(load_model(tmp_path / "folded"), ids, pixels, grid), got) <= MERGE_TOL


def test_an_adapted_projector_inside_a_vit_saved_whole_is_refused_in_one_line(base, tmp_path):
    root, _, _ = base
    model = load_model(root / "mindvl")
    lora = trained(model, ["projector"], ["visual"], seed=1)
    with pytest.raises(ValueError, match=r"^save_adapter: \['model.visual'\] trained in full hold adapted layers "
                                         r"\(model.visual.merger.mlp.0\.\.\.\)") as err:
        save_adapter(model.state_dict(), model.config, lora, tmp_path / "a", full_modules=["visual"])
    assert "\n" not in str(err.value)


def test_a_peft_adapter_on_a_transformers_base_names_base_and_convert_keeps_a_null_bos(base, tmp_path):
    """A PEFT adapter records the transformers folder it was made on: load_model says to import it and to give
    `--base`. `convert --to-hf` keeps generation_config's `bos_token_id: null` in config.json (transformers would
    otherwise fall back to Qwen's 151643, outside this vocabulary)."""
    import shutil

    from mindvl.checkpoint.hf_export import export_to_hf

    root, hf, _ = base
    cfg = peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(hf), cfg).save_pretrained(tmp_path / "peft")
    adapter_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    adapter_cfg["base_model_name_or_path"] = str(root / "hf")
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(adapter_cfg))
    with pytest.raises(ValueError, match=r"import it first \(mindvl convert --from-hf .*\) and give OUT as the base "
                                         r"\(--base OUT\)"):
        load_model(tmp_path / "peft")
    shutil.copytree(root / "mindvl", tmp_path / "mindvl")
    gen = json.loads((tmp_path / "mindvl" / "generation_config.json").read_text())
    gen["bos_token_id"] = None
    (tmp_path / "mindvl" / "generation_config.json").write_text(json.dumps(gen))
    export_to_hf(tmp_path / "mindvl", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "bos_token_id" in config and config["bos_token_id"] is None
