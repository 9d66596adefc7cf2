"""What chat and eval accept as a model folder (issue 43 items 2 and 3): an adapter folder reads as its merged model
with that model's tokenizer, processor and trained system turn (a LoRA run's final/adapter: the run's; an adapter
elsewhere: its base's); a run folder, a checkpoint and an already exported folder get a hint naming the next command.
The reference for the adapter is the merged model folder the run writes beside it (final/): the same answer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_mindvl import tiny_model_folder

from mindvl.checkpoint import load_model, save_pretrained
from mindvl.checkpoint.adapters import load_adapted, save_adapter
from mindvl.cli import main
from mindvl.data.template import DEFAULT_SYSTEM
from mindvl.infer.chat import model_files_folder, pixel_limits, training_system
from mindvl.models.lora import LoRAConfig, inject_lora
from mindvl.typed import build

QUESTION = ["--prompt", "What is shown?", "--max-new-tokens", "5", "--device", "cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run's layout: RUN/recipe.json (trained without a system turn), RUN/final (merged weights + side files)
    and RUN/final/adapter (PEFT layout, base = a model folder whose chat template has Qwen's default system turn)."""
    root = tmp_path_factory.mktemp("adapter-run")
    base = tiny_model_folder(root / "base")
    model = load_model(base)
    lora = build(LoRAConfig, {"r": 2, "alpha": 4, "targets": ["q_proj", "v_proj"]}, "model.lora")
    inject_lora(model, lora)
    with torch.no_grad():  # a non-zero update (a fresh adapter is the identity and would hide a lost adapter)
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    lone = save_adapter(model.state_dict(), model.config, lora, root / "lone-adapter", base=str(base))
    out = root / "run"
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps({"data": {"default_system": None}}))
    (out / "checkpoints").mkdir()
    save_pretrained(load_adapted(lone), out / "final", side_files_from=[base], system=None)
    shutil.copytree(lone, out / "final" / "adapter")
    return root


def test_an_adapter_in_a_run_reads_as_the_runs_final_model(run, capsys):
    adapter, final = run / "run" / "final" / "adapter", run / "run" / "final"
    assert model_files_folder(adapter) == final
    assert training_system(adapter) == (None, f"data.default_system of the training run, {run / 'run' / 'recipe.json'}")
    assert pixel_limits(adapter) == pixel_limits(final)
    assert main(["chat", str(final), *QUESTION]) == 0
    want = capsys.readouterr()
    assert main(["chat", str(adapter), *QUESTION]) == 0  # before: "has no tokenizer.json; pass ... --tokenizer"
    got = capsys.readouterr()
    assert got.out == want.out and got.out.strip()
    assert "system prompt none (no system turn): data.default_system of the training run" in got.err


def test_an_adapter_elsewhere_reads_its_bases_tokenizer_and_template(run, capsys):
    lone = run / "lone-adapter"
    assert model_files_folder(lone) == run / "base"
    system, source = training_system(lone)
    assert system == DEFAULT_SYSTEM and str(run / "base") in source
    assert main(["chat", str(lone), *QUESTION, "--no-system"]) == 0
    assert main(["chat", str(run / "run" / "final"), *QUESTION]) == 0  # same weights, same (no) system turn
    first, second = capsys.readouterr().out.splitlines()
    assert first == second


def test_eval_reads_an_adapter_folder(run, tmp_path):
    """The eval runner's model loading and system turn (what `mindvl eval ADAPTER` calls before any benchmark)."""
    from mindvl.eval.runner import EvalSettings, with_system
    from mindvl.infer.chat import load_for_chat

    model, tok = load_for_chat(run / "run" / "final" / "adapter", device="cpu")
    assert tok.vocab_size <= model.config.text.vocab_size
    said = []
    settings = with_system(EvalSettings(), run / "run" / "final" / "adapter", True, said.append)
    assert settings.system is None and "data.default_system of the training run" in said[0]


def test_a_run_folder_or_checkpoint_names_the_model_folder_to_use(run, tmp_path, capsys):
    assert main(["chat", str(run / "run"), *QUESTION]) == 2
    err = capsys.readouterr().err
    assert f"is a training run, not a model folder; use its final model, {run / 'run' / 'final'}" in err
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    (ckpt / "train_state.json").write_text("{}")
    assert main(["eval", str(ckpt), "--bench", f"ocrbench={tmp_path}", "--out", str(tmp_path / "ev"),
                 "--device", "cpu"]) == 2
    assert f"export it first (mindvl export {ckpt} --out DIR)" in capsys.readouterr().err


def test_export_of_a_model_folder_says_it_is_one_already(run, tmp_path, capsys):
    final = run / "run" / "final"
    assert main(["export", str(final), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"{final} is already a model folder" in err and "chat, eval and merge read it as it is" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--video", "clip.mp4"], "video file not found: clip.mp4"),  # a wrong path before "install PyAV"
    (["--image", "photo.png"], "image file not found: photo.png"),
])
def test_arguments_are_checked_before_the_model_loads(tmp_path, capsys, extra, message):
    """Issue 43 item 9: the folder does not even exist, so a message about the arguments proves they come first."""
    assert main(["chat", str(tmp_path / "no-model"), "--prompt", "hi", *extra]) == 2
    assert message in capsys.readouterr().err


def test_eval_checks_its_numbers_before_the_model_loads(tmp_path, capsys):
    argv = ["eval", str(tmp_path / "no-model"), "--bench", f"ocrbench={tmp_path}", "--out", str(tmp_path / "o")]
    assert main([*argv, "--max-new-tokens", "-1"]) == 2
    assert "--max-new-tokens must be >= 1, got -1" in capsys.readouterr().err
    assert main([*argv, "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err
