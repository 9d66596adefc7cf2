"""The one HF key table (mindvl.checkpoint.hf_keys), read both ways, against the names transformers really writes.

For a tiny Qwen2.5-VL, Qwen3, Qwen2 and DeepSeek-V3 built and saved by transformers: every tensor of the saved
folder imports to a parameter of the mindvl model its config describes (together: exactly that model's state_dict,
DeepSeek's per-expert weights stacked), and exporting every mindvl tensor gives back exactly the saved names; the
names transformers keeps in memory (>= 4.52 prefixes, 5.x fused experts) import to the same parameters.
"""

from __future__ import annotations

import hf_tiny as H
import pytest
import torch

from mindvl.checkpoint.hf import CONFIG_NAME, expected_shapes, mindvl_config_from_hf, read_config
from mindvl.checkpoint.hf_keys import KEY_TABLES, key_map, mindvl_name
from mindvl.checkpoint.safetensors_io import TensorFolder


def _qwen2(folder, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=H.VOCAB, tie_word_embeddings=False,
                      max_position_embeddings=256)
    torch.manual_seed(seed)
    model = H.randomise(Qwen2ForCausalLM(cfg), seed).eval()
    model.save_pretrained(folder)
    return model


BUILDERS = {
    "qwen2_5_vl": lambda folder: H.qwen25vl(folder, seed=1),
    "qwen3": lambda folder: H.qwen3(folder, seed=2, tie=False),
    "qwen2": _qwen2,
    "deepseek_v3": lambda folder: H.deepseek_v3(folder, seed=3),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def saved(request, tmp_path_factory):
    """(family, transformers model, its saved folder, the mindvl state_dict shapes its config describes)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = BUILDERS[request.param](folder)
    raw = read_config(folder)
    assert raw["model_type"] == request.param, f"{folder / CONFIG_NAME} names {raw['model_type']!r}"
    return request.param, model, folder, expected_shapes(mindvl_config_from_hf(raw, folder))


def _import(family: str, hf_names) -> dict[str, set[int | None]]:
    """{mindvl name: the expert indices stacked into it ({None} for a plain rename)} for these HF names."""
    out: dict[str, set[int | None]] = {}
    for hf in hf_names:
        got = key_map(family).to_ours(hf)
        if got is not None:
            out.setdefault(got.name, set()).add(got.expert)
    return out


def test_every_saved_tensor_imports_to_the_mindvl_model(saved):
    family, _, folder, expected = saved
    imported = _import(family, TensorFolder(folder).names())
    assert set(imported) == set(expected)
    for name, experts in imported.items():  # a stack has every expert once, a rename no index
        want = set(range(expected[name][0])) if name.endswith(("gate_proj", "up_proj", "down_proj")) and \
            ".experts." in name else {None}
        assert experts == want, name


def test_export_gives_back_exactly_the_saved_names(saved):
    family, _, folder, expected = saved
    keys = key_map(family)
    exported = []
    for name, shape in expected.items():
        exported += [hf for hf, _ in keys.hf_tensors(name, torch.empty(shape, device="meta"))]
    assert len(exported) == len(set(exported))
    assert set(exported) == set(TensorFolder(folder).names())
    for hf in exported:  # and each name imports back to the tensor it was exported from
        back = keys.to_ours(hf)
        again = keys.hf_tensors(back.name, torch.empty(expected[back.name], device="meta"))
        assert hf in [h for h, _ in again]


def test_in_memory_names_import_to_the_same_parameters(saved):
    """transformers >= 4.52 keeps `model.visual.` / `model.language_model.`; 5.x fuses experts' gate and up."""
    family, model, _, expected = saved
    imported = set()
    for name in _import(family, model.state_dict()):
        if name.endswith(".experts.gate_up_proj"):  # split by the importer (TensorPlan), not renamed
            imported |= {name.replace("gate_up_proj", "gate_proj"), name.replace("gate_up_proj", "up_proj")}
        else:
            imported.add(name)
    assert imported == set(expected)


def test_tables_cover_the_families_the_importer_detects_and_skip_rotary_buffers():
    assert set(KEY_TABLES) == {"qwen2_5_vl", "qwen3", "qwen2", "deepseek_v3", "mindvl", "qwen3_vl", "qwen3_vl_moe",
                               "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}
    assert mindvl_name("model.layers.0.self_attn.rotary_emb.inv_freq", "qwen2") is None
    assert mindvl_name("mtp.layers.0.mlp.gate_proj.weight", "qwen3_5") is None  # Qwen3.5's MTP head: dropped
    assert mindvl_name("language_model.norm.weight", "mindvl") == "language_model.norm.weight"
    assert mindvl_name("some.unknown.tensor", "qwen3") == "some.unknown.tensor"  # reported later as unexpected
    with pytest.raises(ValueError, match="no transformers name for tensor 'projector.fc1.weight' in a qwen3"):
        key_map("qwen3").to_hf("projector.fc1.weight")
