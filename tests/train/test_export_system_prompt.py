"""An exported checkpoint carries its run's recipe.json, so eval and chat default to the system turn the model was
trained with (`data.default_system`), not to the chat template's Qwen default."""

from __future__ import annotations

import json

import pytest
from train_helpers import raw_recipe

from mindvl.checkpoint.training import export_checkpoint, read_latest
from mindvl.cli import main
from mindvl.config import load_recipe
from mindvl.data.tokenizer import load_tokenizer
from mindvl.infer.chat import conversation_prompt, training_system, user_message
from mindvl.train.trainer import train

transformers = pytest.importorskip("transformers")


def test_an_exported_checkpoint_keeps_the_training_system_turn(tmp_path, capsys):
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 1}, checkpoint={"every": 1})
    assert raw["data"]["default_system"] is None  # trained without a system turn
    train(load_recipe(raw=raw))
    step = read_latest(out / "checkpoints")

    exported = export_checkpoint(step, tmp_path / "exp")
    assert json.loads((exported / "recipe.json").read_text()) == json.loads((out / "recipe.json").read_text())
    system, source = training_system(exported)
    assert system is None and source.endswith(f"{exported / 'recipe.json'}")

    # the chat template carries it too (issue 43 item 5): without the recipe the folder's template says the same, and
    # transformers' apply_chat_template renders what mindvl chat does (no system turn), for final/ and the export
    (exported / "recipe.json").unlink()
    assert training_system(exported) == (None, f"the default of the folder's chat template, "
                                               f"{exported / 'chat_template.jinja'}")
    for folder in (exported, out / "final"):
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        theirs = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
        tok = load_tokenizer(folder)
        ours = conversation_prompt(tok, [user_message("hi", 0)], None, [], system=None).input_ids.tolist()
        assert theirs == ours, hf.decode(theirs)
        assert json.loads((folder / "generation_config.json").read_text())["transformers_version"] == \
            transformers.__version__

    # a step folder outside a run folder: nothing to copy, the export still succeeds
    lone = tmp_path / "lone" / "x" / step.name
    lone.parent.mkdir(parents=True)
    step.rename(lone)
    assert not (export_checkpoint(lone, tmp_path / "exp2") / "recipe.json").exists()


def test_chat_says_which_system_turn_it_uses_and_renders_it(tmp_path, capsys, monkeypatch):
    import importlib

    from mindvl.infer import load_for_chat

    out = tmp_path / "run"
    train(load_recipe(raw=raw_recipe(out, tmp_path / "cache", budget={"max_steps": 1})))
    chat_module = importlib.import_module("mindvl.infer.chat")
    _, tok = load_for_chat(out / "final", device="cpu")
    rendered = []

    def fake_generate(model, prompts, **kw):  # the prompt as the model would see it; an empty answer
        rendered.append(tok.decode(prompts[0].input_ids.tolist()))
        return [[] for _ in prompts]

    monkeypatch.setattr(chat_module, "generate", fake_generate)
    assert main(["chat", str(out / "final"), "--prompt", "hi", "--device", "cpu"]) == 0
    assert "(system prompt none (no system turn): data.default_system of the training run" in capsys.readouterr().err
    assert "system" not in rendered[-1] and "hi" in rendered[-1]
    assert main(["chat", str(out / "final"), "--prompt", "hi", "--device", "cpu", "--system", "Be brief."]) == 0
    assert "system prompt" not in capsys.readouterr().err  # given explicitly: nothing to say
    assert "system\nBe brief." in rendered[-1]
