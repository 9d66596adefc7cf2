"""mindvl.checkpoint.side_files: what a model folder gets beside its weights, from a source folder or fresh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindvl.checkpoint.side_files import write_side_files
from mindvl.data.tokenizer import QWEN2_VL_CHAT_TEMPLATE, load_tokenizer
from mindvl.data.video import VideoSettings, settings_from_processor_config
from mindvl.models import MindVLConfig, TextConfig, VisionConfig

TOK = load_tokenizer(None)
SP = TOK.special
TEXT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def config(vision: bool) -> MindVLConfig:
    text = TextConfig(vocab_size=TOK.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    v = VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, fullatt_block_indexes=[0])
    return MindVLConfig(text=text, vision=v if vision else None, image_token_id=SP.image_pad,
                        video_token_id=SP.video_pad, vision_start_token_id=SP.vision_start,
                        vision_end_token_id=SP.vision_end)


def source(folder: Path, **files: dict | str) -> Path:
    folder.mkdir()
    TOK.tokenizer.save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        name = name.replace("__", ".")
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_fresh_files_for_a_folder_with_only_a_tokenizer(tmp_path):
    src = source(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    written = write_side_files(out, config(True), [src], pixels=(3136, 12544))
    assert set(written) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                            "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json"}
    tok_cfg = read(out, "tokenizer_config.json")
    assert (tok_cfg["eos_token"], tok_cfg["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert tok_cfg["chat_template"] == QWEN2_VL_CHAT_TEMPLATE
    assert (out / "chat_template.jinja").read_text() == QWEN2_VL_CHAT_TEMPLATE  # where processors read it
    gen = read(out, "generation_config.json")
    assert gen["eos_token_id"] == [SP.im_end, SP.endoftext] and gen["pad_token_id"] == SP.endoftext
    assert gen["bos_token_id"] == SP.endoftext and gen["do_sample"] is False
    proc = read(out, "preprocessor_config.json")
    assert (proc["min_pixels"], proc["max_pixels"]) == (3136, 12544)
    assert proc["size"] == {"shortest_edge": 3136, "longest_edge": 12544}
    assert proc["patch_size"] == 14 and proc["merge_size"] == 2 and proc["temporal_patch_size"] == 2
    # The video processor keeps transformers' Qwen2-VL defaults (video pixels are independent of the image's).
    vid = read(out, "video_preprocessor_config.json")
    assert settings_from_processor_config(vid) == VideoSettings()
    assert vid["video_processor_type"] == "Qwen2VLVideoProcessor" and vid["temporal_patch_size"] == 2


def test_source_files_are_kept_and_completed(tmp_path):
    qwen_gen = {"do_sample": True, "temperature": 0.1, "top_k": 1, "eos_token_id": SP.endoftext, "bos_token_id": 5}
    proc = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 50176},
            "resample": 3, "custom": 1}
    src = source(tmp_path / "src", tokenizer_config__json={"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|x|>"},
                 chat_template__jinja="{{ '<|image_pad|>' }} custom", generation_config__json=qwen_gen,
                 preprocessor_config__json=proc)
    out = tmp_path / "out"
    out.mkdir()
    write_side_files(out, config(True), [src])
    tok_cfg = read(out, "tokenizer_config.json")
    assert tok_cfg["tokenizer_class"] == "Qwen2Tokenizer" and tok_cfg["eos_token"] == "<|x|>"
    assert tok_cfg["chat_template"] == "{{ '<|image_pad|>' }} custom"  # the source's (it renders images)
    assert (out / "chat_template.jinja").read_text() == tok_cfg["chat_template"]
    gen = read(out, "generation_config.json")
    assert gen["temperature"] == 0.1 and gen["top_k"] == 1 and gen["bos_token_id"] == 5  # sampling defaults kept
    assert gen["eos_token_id"] == [SP.endoftext, SP.im_end]
    got = read(out, "preprocessor_config.json")
    assert got["custom"] == 1 and got["resample"] == 3  # the source's, with both pixel layouts written
    assert (got["min_pixels"], got["max_pixels"], got["size"]["longest_edge"]) == (3136, 50176, 50176)
    # trained pixels replace the source's
    write_side_files(out, config(True), [src], pixels=(6272, 25088))
    got = read(out, "preprocessor_config.json")
    assert (got["min_pixels"], got["max_pixels"], got["size"]) == (6272, 25088, {"shortest_edge": 6272,
                                                                                 "longest_edge": 25088})


@pytest.mark.parametrize("vision", [True, False])
def test_a_text_only_template(tmp_path, vision):
    """A Qwen3-style template renders no images: replaced for a model with a vision tower, kept for a text model."""
    src = source(tmp_path / "src", tokenizer_config__json={"chat_template": TEXT_TEMPLATE})
    out = tmp_path / "out"
    out.mkdir()
    written = write_side_files(out, config(vision), [src])
    want = QWEN2_VL_CHAT_TEMPLATE if vision else TEXT_TEMPLATE
    assert read(out, "tokenizer_config.json")["chat_template"] == want
    assert ("preprocessor_config.json" in written) is vision


def test_tokenizer_from_wins_and_files_come_from_the_first_source_that_has_them(tmp_path):
    model_dir = source(tmp_path / "model", generation_config__json={"temperature": 0.7})
    tok_dir = source(tmp_path / "tok", tokenizer_config__json={"model_max_length": 77})
    out = tmp_path / "out"
    out.mkdir()
    write_side_files(out, config(False), [model_dir], tokenizer_from=tok_dir / "tokenizer.json")
    assert read(out, "tokenizer_config.json")["model_max_length"] == 77
    assert read(out, "generation_config.json")["temperature"] == 0.7


# Qwen3's way: a system turn only when the conversation has one (no literal default)
QWEN3_LIKE = ("{% if messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
              "{% endif %}{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
              "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [QWEN2_VL_CHAT_TEMPLATE, QWEN3_LIKE], ids=["qwen2-vl", "no-literal-default"])
@pytest.mark.parametrize("system", [None, "Be terse.", 'Answer as JSON: {"n": 1}'])
def test_exported_template_renders_the_trained_system_turn(tmp_path, template, system):
    """Issue 43 item 5: a model folder written with the system turn its run trained with (data.default_system) has a
    chat template whose default is that turn, so transformers' apply_chat_template (the reference) gives the ids
    mindvl chat renders (encode_conversation with that default_system); an explicit system turn still wins."""
    from transformers import PreTrainedTokenizerFast

    from mindvl.data.schema import Message
    from mindvl.data.template import encode_conversation

    src = source(tmp_path / "src", tokenizer_config__json={"chat_template": template})
    out = tmp_path / "out"
    out.mkdir()
    write_side_files(out, config(vision=False), [src], system=system)
    saved = read(out, "tokenizer_config.json")["chat_template"]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    for messages in ([Message("user", "What is 2+2?")],
                     [Message("system", "Other."), Message("user", "Hi"), Message("assistant", "Hello"),
                      Message("user", "Bye")]):
        theirs = hf.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                        chat_template=saved, tokenize=True, return_dict=True)["input_ids"]
        ours = encode_conversation(TOK, messages, [], default_system=system).input_ids.tolist()
        assert theirs == ours, hf.decode(theirs)
    again = tmp_path / "again"  # a run started from that folder with another system turn: replaced, not stacked
    again.mkdir()
    write_side_files(again, config(vision=False), [out], system="Second.")
    theirs = hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True, return_dict=True,
                                    chat_template=read(again, "tokenizer_config.json")["chat_template"])["input_ids"]
    assert theirs == encode_conversation(TOK, [Message("user", "x")], [], default_system="Second.").input_ids.tolist()


def test_the_template_is_kept_without_a_trained_system_and_generation_config_names_installed_transformers(tmp_path):
    from importlib.metadata import version

    src = source(tmp_path / "src", tokenizer_config__json={"chat_template": QWEN2_VL_CHAT_TEMPLATE})
    out = tmp_path / "out"
    out.mkdir()
    write_side_files(out, config(vision=True), [src])  # convert, compose, merge: no recipe, the source's template
    assert read(out, "tokenizer_config.json")["chat_template"] == QWEN2_VL_CHAT_TEMPLATE
    assert (out / "chat_template.jinja").read_text() == QWEN2_VL_CHAT_TEMPLATE
    assert read(out, "generation_config.json")["transformers_version"] == version("transformers")
