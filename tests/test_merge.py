"""Streaming checkpoint merging: weighted averages against hand averages, the language-model merge, refusals."""

from __future__ import annotations

import json
import shutil

import hf_tiny as H
import pytest
import torch
from safetensors.torch import load_file, save_file

import mindvl.checkpoint.merge as merge_mod
from mindvl.checkpoint import TensorFolder, load_model, save_pretrained
from mindvl.checkpoint.merge import (
    merge_checkpoints,
    merge_language_model,
    normalise_weights,
    transplant_vision_tower,
)
from mindvl.checkpoint.safetensors_io import StreamingShardWriter
from mindvl.cli import main as cli_main
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

# Matches tests/hf_tiny.qwen3(hidden=32): the LLM a MindVL composition would be built on.
TEXT = dict(family="qwen3", vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
            max_position_embeddings=512, tie_word_embeddings=False)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[1])
TOKENS = dict(image_token_id=H.IMAGE_TOKEN, video_token_id=H.VIDEO_TOKEN, vision_start_token_id=H.VISION_START,
              vision_end_token_id=H.VISION_END)


def mllm_config(vision: dict | None = None, **text) -> MindVLConfig:
    return MindVLConfig(text=TextConfig(**{**TEXT, "mrope_section": [2, 3, 3], **text}),
                        vision=VisionConfig(**{**VISION, **(vision or {})}), **TOKENS)


def randomised(config: MindVLConfig, seed: int, dtype: torch.dtype = torch.float32) -> MindVL:
    """Random weights everywhere (init_weights alone gives unit norms and zero biases, which hide mix-ups)."""
    model = MindVL(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.to(dtype)


def state(model: MindVL) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Three fp32 MLLMs (different shard layouts), two bf16 ones, their state dicts."""
    root = tmp_path_factory.mktemp("merge")
    models = {name: randomised(mllm_config(), seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    models.update({name: randomised(mllm_config(), seed, torch.bfloat16) for name, seed in (("p", 4), ("q", 5))})
    for name, model in models.items():
        save_pretrained(model, root / name, max_shard_bytes=30_000 if name == "b" else 2**30)
    (root / "a" / "tokenizer.json").write_text('{"added_tokens": []}')
    return root, {name: state(m) for name, m in models.items()}


def hand_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """sum_i w_i x_i / sum_i w_i in float64: the reference, independent of mindvl's accumulation."""
    total = sum(weights)
    return {k: sum(w / total * s[k].double() for w, s in zip(weights, states, strict=True)) for k in states[0]}


def assert_all_close(out_folder, reference: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    merged = load_model(out_folder).state_dict()
    assert merged.keys() == reference.keys()
    for name, ref in reference.items():
        assert merged[name].dtype == dtype, name
        torch.testing.assert_close(merged[name], ref.to(dtype), msg=name)


def test_two_and_three_checkpoints_equal_the_hand_average_and_load(ckpts, tmp_path):
    root, states = ckpts
    res = merge_checkpoints([root / "a", root / "b"], tmp_path / "ab")
    assert res.weights == [0.5, 0.5] and res.averaged == len(states["a"]) and res.copied == 0
    assert_all_close(tmp_path / "ab", hand_average([states["a"], states["b"]], [1, 1]), torch.float32)

    res = merge_checkpoints([root / "a", root / "b", root / "c"], tmp_path / "abc", weights=[1, 2, 1],
                            max_shard_bytes=50_000)
    assert res.weights == [0.25, 0.5, 0.25] and len(res.files) > 1
    assert_all_close(tmp_path / "abc", hand_average([states[n] for n in "abc"], [1, 2, 1]), torch.float32)
    index = json.loads((tmp_path / "abc" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(states["a"])
    cfg = json.loads((tmp_path / "abc" / "config.json").read_text())
    assert cfg["source"]["merged_from"] == [str((root / n).resolve()) for n in "abc"]
    assert cfg["source"]["merge_weights"] == [0.25, 0.5, 0.25]
    assert cfg["text"] == json.loads((root / "a" / "config.json").read_text())["text"]
    assert (tmp_path / "abc" / "tokenizer.json").is_file()  # side files come from the first input


def test_a_zero_weight_input_is_checked_but_contributes_nothing(ckpts, tmp_path):
    root, states = ckpts
    merge_checkpoints([root / "a", root / "b"], tmp_path / "m", weights=[0, 5])
    merged = load_file(tmp_path / "m" / "model.safetensors")
    assert all(torch.equal(merged[k], states["b"][k]) for k in states["b"])


def test_bf16_inputs_are_averaged_in_fp32_and_written_as_bf16_or_as_asked(ckpts, tmp_path):
    root, states = ckpts
    ref = hand_average([states["p"], states["q"]], [3, 1])
    merge_checkpoints([root / "p", root / "q"], tmp_path / "bf16", weights=[3, 1])
    assert_all_close(tmp_path / "bf16", ref, torch.bfloat16)
    merge_checkpoints([root / "p", root / "q"], tmp_path / "fp32", weights=[3, 1], dtype="fp32")
    assert_all_close(tmp_path / "fp32", ref, torch.float32)


def test_mixed_input_dtypes_need_an_explicit_dtype(ckpts, tmp_path):
    root, states = ckpts
    with pytest.raises(ValueError, match=r"is torch.float32 in .*a but torch.bfloat16 in .*p; choose .* --dtype"):
        merge_checkpoints([root / "a", root / "p"], tmp_path / "m")
    merge_checkpoints([root / "a", root / "p"], tmp_path / "m", dtype=torch.float32)
    assert_all_close(tmp_path / "m", hand_average([states["a"], states["p"]], [1, 1]), torch.float32)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A mindvl text-only base and a transformers Qwen3ForCausalLM folder with the MLLM's LLM architecture."""
    root = tmp_path_factory.mktemp("bases")
    text_only = randomised(MindVLConfig(text=TextConfig(**TEXT)), 11)
    save_pretrained(text_only, root / "mindvl_text")
    hf = H.qwen3(root / "hf_qwen3", seed=12, tie=False, hidden=32)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return root, state(text_only), hf_state


def check_lm_merge(out, mllm: dict[str, torch.Tensor], base_lm: dict[str, torch.Tensor], weights) -> None:
    """Vision tower and projector bit-identical to the MLLM; language model = the hand average with the base."""
    merged = load_model(out).state_dict()
    assert merged.keys() == mllm.keys()
    lm = [k for k in mllm if k.startswith("language_model.")]
    assert set(lm) == set(base_lm) and len(lm) < len(mllm)
    for name in mllm:
        if name in base_lm:
            ref = hand_average([{name: mllm[name]}, {name: base_lm[name]}], weights)[name]
            torch.testing.assert_close(merged[name], ref.to(mllm[name].dtype), msg=name)
        else:
            assert torch.equal(merged[name], mllm[name]), name


def test_language_model_merge_with_a_mindvl_text_only_base(ckpts, bases, tmp_path):
    (root, states), (broot, text_state, _) = ckpts, bases
    res = merge_checkpoints([root / "a"], tmp_path / "m", language_model_from=broot / "mindvl_text")
    assert res.weights == [0.5, 0.5] and res.copied == sum(not k.startswith("language_model.") for k in states["a"])
    check_lm_merge(tmp_path / "m", states["a"], text_state, [1, 1])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["text"]["mrope_section"] == [2, 3, 3]  # the MLLM's positions, not the base's 1-D RoPE
    assert cfg["source"]["merged_tensors"] == "language_model"
    assert cfg["source"]["merged_from"][1] == str((broot / "mindvl_text").resolve())


def test_language_model_merge_with_a_transformers_qwen3_folder(ckpts, bases, tmp_path):
    (root, states), (broot, _, hf_state) = ckpts, bases
    # The reference renames by hand: HF `model.X` is mindvl `language_model.X`, `lm_head.weight` likewise.
    base_lm = {"language_model." + k.removeprefix("model."): v for k, v in hf_state.items()}
    merge_language_model(root / "a", broot / "hf_qwen3", tmp_path / "fp32", weights=[3, 1])
    check_lm_merge(tmp_path / "fp32", states["a"], base_lm, [3, 1])
    # A bf16 MLLM keeps its dtype; the fp32 base only donates weights.
    merge_language_model(root / "p", broot / "hf_qwen3", tmp_path / "bf16")
    check_lm_merge(tmp_path / "bf16", states["p"], base_lm, [1, 1])


def test_language_model_merge_refuses_a_different_llm(ckpts, tmp_path):
    root, _ = ckpts
    save_pretrained(randomised(MindVLConfig(text=TextConfig(**{**TEXT, "vocab_size": 200})), 0), tmp_path / "v200")
    with pytest.raises(ValueError, match=r"v200: its language model differs from .*a's in text.vocab_size "
                                         r"\(160 vs 200"):
        merge_language_model(root / "a", tmp_path / "v200", tmp_path / "m")
    (tmp_path / "dsv3").mkdir()
    (tmp_path / "dsv3" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match=r"dsv3: a deepseek_v3 checkpoint's tensors are restructured on import, .*"
                                         r"convert it first \(mindvl convert --from-hf"):
        merge_language_model(root / "a", tmp_path / "dsv3", tmp_path / "m")
    with pytest.raises(ValueError, match="pass exactly one"):
        merge_checkpoints([root / "a", root / "b"], tmp_path / "m", language_model_from=tmp_path / "v200")
    assert not (tmp_path / "m").exists()


def test_transplanted_vision_tower_is_the_donors_and_the_rest_the_bases(ckpts, tmp_path):
    root, states = ckpts
    res = transplant_vision_tower(root / "a", root / "b", tmp_path / "t")  # b is sharded: names are found per shard
    got = load_model(tmp_path / "t").state_dict()
    visual = [k for k in got if k.startswith("visual.")]
    assert got.keys() == states["a"].keys() and res.averaged == 0
    assert (res.transplanted, res.copied) == (len(visual), len(states["a"]) - len(visual))
    assert f"the vision tower ({len(visual)} tensors) from {root / 'b'}" in res.describe()
    assert visual and any(k.startswith("projector.") for k in got) and any(k.startswith("language_model.") for k in got)
    for name, tensor in got.items():
        want = states["b" if name.startswith("visual.") else "a"][name]
        assert torch.equal(tensor, want), name
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["source"]["merged_tensors"] == "visual" and cfg["source"]["merge_weights"] == [0.0, 1.0]
    # A bf16 donor into an fp32 base: the base's dtype, the donor's values.
    transplant_vision_tower(root / "a", root / "p", tmp_path / "t16")
    got16 = load_model(tmp_path / "t16").state_dict()
    for name in visual:
        assert got16[name].dtype == torch.float32 and torch.equal(got16[name], states["p"][name].float()), name


def test_a_vision_tower_of_another_shape_is_refused_naming_the_key(ckpts, tmp_path):
    root, _ = ckpts
    save_pretrained(randomised(mllm_config(vision={"intermediate_size": 64}), 9), tmp_path / "wide")
    with pytest.raises(ValueError, match=r"differs from .* in vision\.intermediate_size"):
        transplant_vision_tower(root / "a", tmp_path / "wide", tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_different_architectures_are_refused_naming_the_key(ckpts, tmp_path):
    root, _ = ckpts
    save_pretrained(randomised(mllm_config(num_hidden_layers=3), 0), tmp_path / "deep")
    with pytest.raises(ValueError, match=r"deep/config.json differs from .*a/config.json in text.num_hidden_layers "
                                         r"\(2 vs 3\)"):
        merge_checkpoints([root / "a", tmp_path / "deep"], tmp_path / "m")
    # Provenance fields may differ: they say where a model came from, not what it is.
    shutil.copytree(root / "b", tmp_path / "b2")
    cfg = json.loads((tmp_path / "b2" / "config.json").read_text())
    cfg.update(source={"converted_from": "elsewhere"}, projector_seed=7)
    (tmp_path / "b2" / "config.json").write_text(json.dumps(cfg))
    merge_checkpoints([root / "a", tmp_path / "b2"], tmp_path / "ok")


def edited_copy(src, dst, edit) -> None:
    """A copy of single-file model folder `src` whose tensors went through `edit(dict)`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


def test_different_tensor_names_and_shapes_are_refused_naming_them(ckpts, tmp_path):
    root, _ = ckpts

    def rename(t):
        t["language_model.extra.weight"] = t.pop("language_model.norm.weight")

    edited_copy(root / "c", tmp_path / "renamed", rename)
    with pytest.raises(ValueError, match=r"renamed and .*a hold different tensors: .*renamed lacks 1 tensor\(s\): "
                                         r"language_model.norm.weight and has extra 1 tensor\(s\): "
                                         r"language_model.extra.weight"):
        merge_checkpoints([root / "a", tmp_path / "renamed"], tmp_path / "m")

    def reshape(t):
        t["projector.fc1.bias"] = torch.zeros(3)

    edited_copy(root / "c", tmp_path / "reshaped", reshape)
    with pytest.raises(ValueError, match=r"tensor projector.fc1.bias has shape \(128,\) in .*a but \(3,\) in "
                                         r".*reshaped"):
        merge_checkpoints([root / "a", tmp_path / "reshaped"], tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("weights", "message"), [
    ([1.0], r"1 weight\(s\) for 2 checkpoints"),
    ([1.0, -0.5], r"weights must be finite and >= 0"),
    ([0.0, 0.0], r"are all zero"),
    ([1.0, float("nan")], r"weights must be finite"),
])
def test_bad_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        normalise_weights(weights, ["a", "b"])


def test_existing_output_is_kept_unless_overwrite(ckpts, tmp_path):
    root, states = ckpts
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        merge_checkpoints([root / "a", root / "b"], tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    merge_checkpoints([root / "a", root / "b"], tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="is also an input"):
        merge_checkpoints([root / "a", root / "b"], root / "b", overwrite=True)


def test_an_interrupted_merge_leaves_no_output(ckpts, tmp_path, monkeypatch):
    root, _ = ckpts
    real, calls = merge_mod._combine, []

    def failing(entry):
        calls.append(entry.name)
        if len(calls) == 5:
            raise RuntimeError("simulated crash")
        return real(entry)

    monkeypatch.setattr(merge_mod, "_combine", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        merge_checkpoints([root / "a", root / "b"], tmp_path / "m", max_shard_bytes=10_000)
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary folder
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "old.txt").write_text("previous")
    calls.clear()
    with pytest.raises(RuntimeError):
        merge_checkpoints([root / "a", root / "b"], tmp_path / "m", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and (tmp_path / "m" / "old.txt").read_text() == "previous"


def test_cli_merge_prints_what_it_wrote_and_reports_errors_in_one_line(ckpts, bases, tmp_path, capsys):
    root, states = ckpts
    broot = bases[0]
    assert cli_main(["merge", str(root / "a"), str(root / "b"), "--out", str(tmp_path / "m"), "--weights", "1,3",
                     "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'm'}: {len(states['a'])} tensors averaged") and "0.25, 0.75" in out
    assert_all_close(tmp_path / "m", hand_average([states["a"], states["b"]], [1, 3]), torch.bfloat16)
    assert cli_main(["merge", str(root / "a"), "--out", str(tmp_path / "lm"),
                     "--language-model-from", str(broot / "hf_qwen3")]) == 0
    assert "copied from" in capsys.readouterr().out
    assert cli_main(["merge", str(root / "a"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "mindvl merge: error: merging needs at least two checkpoints (or one with --language-model-from BASE)"
    assert cli_main(["merge", str(root / "a"), str(broot / "hf_qwen3"), "--out", str(tmp_path / "x")]) == 2
    assert "is a 'qwen3' checkpoint, not a mindvl model folder" in capsys.readouterr().err


def test_streaming_writer_output_reads_back_with_safetensors(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=gen).bfloat16(), "s": torch.tensor(2.5), "i": torch.arange(7),
               "e": torch.zeros(0, 4), "b": torch.tensor([True, False, True]), "h": torch.randn(9, generator=gen)}
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with StreamingShardWriter(tmp_path / "multi", plan, max_shard_bytes=40) as writer:
        for k, v in tensors.items():
            writer.add(k, v)
        files = writer.close()
    assert len(files) > 2
    folder = TensorFolder(tmp_path / "multi")
    for k, v in tensors.items():
        got = folder.get(k)
        assert got.dtype == v.dtype and torch.equal(got, v), k
    with StreamingShardWriter(tmp_path / "one", plan) as writer:
        for k, v in tensors.items():
            writer.add(k, v)
        assert writer.close() == ["model.safetensors"]
    assert all(torch.equal(load_file(tmp_path / "one" / "model.safetensors")[k], v) for k, v in tensors.items())
    with StreamingShardWriter(tmp_path / "bad", plan) as writer:
        with pytest.raises(ValueError, match=r"expected tensor 'w' torch.bfloat16 \(3, 5\) next, got 's'"):
            writer.add("s", tensors["s"])
        writer.add("w", tensors["w"])
        with pytest.raises(ValueError, match=r"only 1 of 6 planned tensors were written \(next missing: 's'\)"):
            writer.close()
