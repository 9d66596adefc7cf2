"""HF import, MindVL composition, sharded safetensors folders and their error messages."""

from __future__ import annotations

import json

import hf_tiny as H
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mindvl.checkpoint import (
    TensorFolder,
    compose,
    conv3d_to_matmul,
    convert_from_hf,
    load_model,
    matmul_to_conv3d,
    save_pretrained,
)
from mindvl.checkpoint.hf import default_mrope_section
from mindvl.cli import main as cli_main


def test_patch_embed_matmul_equals_conv3d_and_round_trips():
    gen = torch.Generator().manual_seed(0)
    conv_w = torch.randn(8, 3, 2, 14, 14, generator=gen)
    rows = torch.randn(5, 3 * 2 * 14 * 14, generator=gen)
    ref = F.conv3d(rows.view(5, 3, 2, 14, 14), conv_w, stride=(2, 14, 14)).view(5, 8)
    torch.testing.assert_close(rows @ conv3d_to_matmul(conv_w).T, ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(matmul_to_conv3d(conv3d_to_matmul(conv_w), 3, 2, 14), conv_w)
    with pytest.raises(ValueError, match=r"expected a matmul weight \[D, 1176\]"):
        matmul_to_conv3d(torch.zeros(8, 100), 3, 2, 14)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    H.qwen25vl(root / "vl", seed=3)
    # A Qwen3 whose width differs from the VL's LLM (48), as Qwen3-8B differs from Qwen2.5-VL-72B's LLM.
    H.qwen3(root / "q3", seed=4, tie=False, hidden=40)
    (root / "q3" / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 151, "content": "<|image_pad|>"}, {"id": 152, "content": "<|video_pad|>"},
        {"id": 150, "content": "<|vision_start|>"}, {"id": 153, "content": "<|vision_end|>"}]}))
    return root


def test_convert_writes_shards_index_and_loads_identically(hf_folders, tmp_path):
    out = convert_from_hf(hf_folders / "vl", tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(TensorFolder(out).names())
    single = convert_from_hf(hf_folders / "vl", tmp_path / "single")
    a, b = load_model(out).state_dict(), load_model(single).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    src = load_file(hf_folders / "vl" / "model.safetensors")
    assert torch.equal(a["visual.patch_embed.weight"], src["visual.patch_embed.proj.weight"].reshape(64, -1))
    assert torch.equal(a["projector.fc2.weight"], src["visual.merger.mlp.2.weight"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "mindvl"


def test_load_lists_missing_unexpected_and_misshaped_tensors_in_one_error(hf_folders, tmp_path):
    out = convert_from_hf(hf_folders / "vl", tmp_path / "m")
    tensors = load_file(out / "model.safetensors")
    del tensors["language_model.norm.weight"]
    tensors["language_model.extra.weight"] = torch.zeros(2)
    tensors["projector.fc1.bias"] = torch.zeros(3)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_model(out)
    msg = str(err.value)
    assert "1 missing: language_model.norm.weight" in msg
    assert "1 unexpected: language_model.extra.weight" in msg
    assert "1 mis-shaped: projector.fc1.bias: checkpoint (3,) vs model (256,)" in msg


def test_pickled_checkpoints_are_refused_not_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(FileNotFoundError, match="found pickled .*pytorch_model.bin.*never unpickles"):
        TensorFolder(tmp_path)


def test_hf_folder_given_to_from_pretrained_says_to_convert(hf_folders):
    with pytest.raises(ValueError, match="mindvl convert --from-hf"):
        load_model(hf_folders / "q3")


def test_unsupported_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        convert_from_hf(tmp_path, tmp_path / "out")


def test_existing_output_is_kept_unless_overwrite_is_asked(hf_folders, tmp_path):
    out = tmp_path / "m"
    convert_from_hf(hf_folders / "q3", out)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        convert_from_hf(hf_folders / "vl", out)
    assert (out / "model.safetensors").read_bytes() == before
    model = load_model(convert_from_hf(hf_folders / "vl", tmp_path / "vl"))
    save_pretrained(model, out, overwrite=True)
    assert load_model(out).visual is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "vl"]  # no temporary folders left behind


def test_atomic_save_leaves_no_partial_folder_on_crash(hf_folders, tmp_path, monkeypatch):
    import mindvl.checkpoint.hf as hf

    model = load_model(convert_from_hf(hf_folders / "q3", tmp_path / "src"))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "_write_config", crash)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "dst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_compose_takes_vision_and_llm_weights_and_seeds_the_projector(hf_folders, tmp_path):
    out = compose(hf_folders / "vl", hf_folders / "q3", tmp_path / "mindvl", seed=7)
    model = load_model(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["projector_seed"] == 7 and cfg["text"]["mrope_section"] == default_mrope_section(16) == [2, 3, 3]
    assert cfg["image_token_id"] == 151  # read from the language model's tokenizer
    assert (out / "tokenizer.json").is_file()
    vis = load_file(hf_folders / "vl" / "model.safetensors")
    lang = load_file(hf_folders / "q3" / "model.safetensors")
    sd = model.state_dict()
    assert torch.equal(sd["visual.blocks.2.attn.qkv.weight"], vis["visual.blocks.2.attn.qkv.weight"])
    q_norm = "layers.1.self_attn.q_norm.weight"
    assert torch.equal(sd[f"language_model.{q_norm}"], lang[f"model.{q_norm}"])
    assert sd["projector.fc2.weight"].shape == (40, 256)  # vision width 64 * 4 -> Qwen3 width 40
    assert not torch.equal(sd["projector.fc1.weight"], vis["visual.merger.mlp.0.weight"])  # new, not the VL's merger
    again = load_model(compose(hf_folders / "vl", hf_folders / "q3", tmp_path / "again", seed=7))
    other = load_model(compose(hf_folders / "vl", hf_folders / "q3", tmp_path / "other", seed=8))
    assert torch.equal(again.state_dict()["projector.fc1.weight"], sd["projector.fc1.weight"])
    assert not torch.equal(other.state_dict()["projector.fc1.weight"], sd["projector.fc1.weight"])


def test_composed_model_keeps_the_llm_text_behaviour_and_runs_images(hf_folders, tmp_path):
    model = load_model(compose(hf_folders / "vl", hf_folders / "q3", tmp_path / "c", seed=1))
    hf_q3 = H.qwen3(seed=4, tie=False, hidden=40)  # the same weights as the saved folder
    ids = H.multimodal_ids([19], seed=2)[None]
    with torch.no_grad():
        # M-RoPE with equal rows is exactly 1-D RoPE: text logits must equal the source Qwen3's.
        assert H.rel_err(model(input_ids=ids).logits, hf_q3(input_ids=ids).logits) <= 1e-4
        ids = H.multimodal_ids([3, [1, 8, 12], 4], seed=3)[None]
        pixels, grid = H.random_pixels([[1, 8, 12]])
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
    assert logits.shape == (1, ids.shape[1], H.VOCAB) and torch.isfinite(logits).all()


def test_compose_rejects_a_text_model_as_vision_source(hf_folders, tmp_path):
    with pytest.raises(ValueError, match="--vision-from must be a Qwen2.5-VL checkpoint"):
        compose(hf_folders / "q3", hf_folders / "q3", tmp_path / "x")


def test_cli_convert_and_one_line_errors(hf_folders, tmp_path, capsys):
    assert cli_main(["convert", "--from-hf", str(hf_folders / "vl"), "--out", str(tmp_path / "a")]) == 0
    assert load_model(tmp_path / "a").visual is not None
    assert cli_main(["convert", "--vision-from", str(hf_folders / "vl"), "--language-from",
                     str(hf_folders / "q3"), "--out", str(tmp_path / "b"), "--seed", "3"]) == 0
    # these folders carry no tokenizer: each conversion says so in one warning line (issue 43 item 4)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings and all(w.startswith("mindvl convert: warning:") and "no tokenizer.json" in w for w in warnings)
    assert cli_main(["convert", "--from-hf", str(hf_folders / "vl"), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--overwrite" in err[0]
    assert cli_main(["convert", "--from-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c")]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_export_to_hf_round_trips_through_transformers(hf_folders, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM

    assert cli_main(["convert", "--from-hf", str(hf_folders / "vl"), "--out", str(tmp_path / "m")]) == 0
    assert cli_main(["convert", "--to-hf", str(tmp_path / "m"), "--out", str(tmp_path / "back")]) == 0
    original = load_file(hf_folders / "vl" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "back", attn_implementation="eager")
    source = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_folders / "vl", attn_implementation="eager")
    ids = H.multimodal_ids([4, [1, 8, 8], 3], seed=1)[None]
    pixels, grid = H.random_pixels([[1, 8, 8]], seed=2)
    with torch.no_grad():
        a = reloaded(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, **H.mm_kwargs(reloaded, ids)).logits
        b = source(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, **H.mm_kwargs(source, ids)).logits
    assert torch.equal(a, b)

    convert_from_hf(hf_folders / "q3", tmp_path / "q3")
    assert cli_main(["convert", "--to-hf", str(tmp_path / "q3"), "--out", str(tmp_path / "q3back")]) == 0
    q3 = Qwen3ForCausalLM.from_pretrained(tmp_path / "q3back")
    src = load_file(hf_folders / "q3" / "model.safetensors")
    assert all(torch.equal(q3.state_dict()[k], v) for k, v in src.items())


def test_export_refuses_a_composition_without_a_transformers_class(hf_folders, tmp_path, capsys):
    compose(hf_folders / "vl", hf_folders / "q3", tmp_path / "c")
    assert cli_main(["convert", "--to-hf", str(tmp_path / "c"), "--out", str(tmp_path / "x")]) == 2
    assert "has a qwen3 LLM, so keep it in mindvl's format" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
