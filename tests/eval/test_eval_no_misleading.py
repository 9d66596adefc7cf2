"""Results that cannot mislead: an evaluation that scored nothing is an error naming why, a search whose settings
all tie names no best, the box plot explains itself, and eval uses (and prints) the system prompt the model was
trained with."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from eval_helpers import eval_setup, generate_module

from mindvl.cli import main as cli_main
from mindvl.data.template import DEFAULT_SYSTEM
from mindvl.eval.resolution_search import best_lines, best_settings, box_plot_figure
from mindvl.eval.runner import EvalSettings, NoItemsScored, evaluate_benchmark
from mindvl.infer import load_for_chat
from mindvl.infer.chat import template_default_system, training_system


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return eval_setup(tmp_path_factory.mktemp("misleading"), n=4)


# ------------------------------------------------------------------------------------------- zero scored items


def test_ocrbench_files_read_as_docvqa_are_an_error_naming_why(setup, tmp_path):
    _, folder, _, benches = setup
    model, tok = load_for_chat(folder, device="cpu")
    with pytest.raises(NoItemsScored) as err:
        evaluate_benchmark(model, tok, "docvqa", benches["ocrbench"], EvalSettings(system=None, max_new_tokens=2),
                           tmp_path / "p.jsonl")
    msg = str(err.value)
    # The benchmark, the file, the skip reason with its count (OCRBench's column is `answer`, DocVQA reads
    # `answers`) and the columns DocVQA expects.
    assert msg.startswith("docvqa: no item scored from ")
    assert str(benches["ocrbench"]) in msg
    assert "all 4 rows skipped (missing_answers: 4)" in msg
    assert "questionId, question, answers (a list), image" in msg
    assert "\n" not in msg


def test_eval_cli_exits_2_with_the_message(setup, tmp_path, capsys):
    _, folder, _, benches = setup
    code = cli_main(["eval", str(folder), "--bench", f"docvqa={benches['ocrbench']}", "--out", str(tmp_path / "e"),
                     "--no-system", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert "docvqa: no item scored" in err and "missing_answers: 4" in err
    assert not (tmp_path / "e" / "summary.json").exists()  # no summary claiming a score


# ---------------------------------------------------------------------------------- searches where all tie


def test_best_settings_name_no_best_when_every_score_ties():
    zeros = {"a": {"ocr": {"min4_max16": 0.0, "min4_max64": 0.0}}, "b": {"ocr": {"min4_max16": 0.0,
                                                                               "min4_max64": 0.0}}}
    best = best_settings(zeros)
    assert best["per_checkpoint"]["a"]["ocr"]["setting"] is None
    assert best["per_checkpoint"]["a"]["ocr"]["no_best"] == "every one of the 2 settings scores 0: no setting is better"
    overall = best["overall"]["ocr"]
    assert overall["checkpoint"] is None and overall["setting"] is None and overall["min_pixels"] is None
    assert overall["score"] == 0.0 and "every one of the 4 (checkpoint, setting) pairs scores 0" in overall["no_best"]
    assert best_lines(best) == [f"no best setting for ocr: {overall['no_best']}"]

    # One checkpoint better, but flat over its settings: the checkpoint is named, no setting is.
    mixed = {"a": {"ocr": {"min4_max16": 0.5, "min4_max64": 0.5}}, "b": {"ocr": {"min4_max16": 0.1,
                                                                               "min4_max64": 0.2}}}
    best = best_settings(mixed)
    assert best["overall"]["ocr"]["checkpoint"] == "a" and best["overall"]["ocr"]["setting"] is None
    assert best["per_checkpoint"]["b"]["ocr"]["setting"] == "min4_max64"
    assert best_lines(best)[0].startswith("best for ocr: a (0.5) at any setting: every one of the 2 settings")

    nans = {"a": {"ocr": {"min4_max16": math.nan, "min4_max64": math.nan}}}
    assert best_settings(nans)["overall"]["ocr"]["no_best"].startswith("none of the 2 (checkpoint, setting) pairs")


def test_search_cli_with_all_zero_scores_says_so(setup, tmp_path, monkeypatch, capsys):
    _, folder, other, benches = setup
    _, tok = load_for_chat(folder, device="cpu")
    monkeypatch.setattr(generate_module, "generate", lambda model, prompts, *a, **kw: [[tok.special.im_end]
                                                                                     for _ in prompts])
    out = tmp_path / "search"
    assert cli_main(["search-resolution", f"a={folder}", f"b={other}", "--bench", f"ocrbench={benches['ocrbench']}",
                     "--grid", "4:16,64", "--out", str(out), "--no-system", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "no best setting for ocrbench: every one of the 4 (checkpoint, setting) pairs scores 0" in printed
    assert "best for ocrbench:" not in printed
    best = json.loads((out / "best.json").read_text())
    assert best["overall"]["ocrbench"]["checkpoint"] is None and best["overall"]["ocrbench"]["no_best"]
    assert "**" not in (out / "results.md").read_text()  # no cell is bold: none is the best


def _inside(inner, outer, tol=1.0) -> bool:
    return (inner.x0 >= outer.x0 - tol and inner.y0 >= outer.y0 - tol and inner.x1 <= outer.x1 + tol
            and inner.y1 <= outer.y1 + tol)


@pytest.mark.parametrize("n_ckpt", [2, 5])
def test_box_plot_explains_itself(n_ckpt):
    import matplotlib.pyplot as plt

    zeros = {f"checkpoint-{i}": {"ocrbench": {"min4_max16": 0.0, "min4_max64": 0.0}} for i in range(n_ckpt)}
    fig = box_plot_figure(zeros, "ocrbench", "ocrbench_accuracy")
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    # The title fits in the figure (it was cut with 2 checkpoints), axes are labelled.
    assert _inside(ax.title.get_window_extent(renderer), fig.bbox)
    assert ax.get_xlabel() == "checkpoint" and ax.get_ylabel() == "ocrbench_accuracy"
    # A legend for the median, the mean marker and the dots, beside the axes (not over a box), inside the figure.
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["median", "mean", "one setting"]
    box = legend.get_window_extent(renderer)
    assert box.x0 >= ax.get_window_extent(renderer).x1 and _inside(box, fig.bbox)
    # All scores equal: 0 sits inside the y range (not on the frame) and a note says no setting is better.
    lo, hi = ax.get_ylim()
    assert lo < 0 < hi
    assert any("no setting is better" in t.get_text() for t in ax.texts)
    plt.close(fig)

    spread = {"a": {"ocr": {"s1": 0.1, "s2": 0.4}}, "b": {"ocr": {"s1": 0.3, "s2": 0.3}}}
    fig = box_plot_figure(spread, "ocr", "acc")
    assert not fig.axes[0].texts  # a real spread: no note
    plt.close(fig)


# ------------------------------------------------------------------------------------------ system prompt


def test_training_system_follows_the_run_then_the_merge_then_the_template(setup, tmp_path):
    _, folder, _, _ = setup
    # A run's final/ beside the run's recipe.json (what the trainer writes): the recipe's data.default_system.
    runs = []
    for name, system in (("r1", None), ("r2", None), ("r3", "Be brief.")):
        shutil.copytree(folder, tmp_path / name / "final")
        (tmp_path / name / "recipe.json").write_text(json.dumps({"data": {"default_system": system}}))
        runs.append(tmp_path / name / "final")
    assert training_system(runs[0])[0] is None and "r1/recipe.json" in training_system(runs[0])[1]
    assert training_system(runs[2])[0] == "Be brief."
    # A recipe without the key trained with the data config's default.
    (tmp_path / "r1" / "recipe.json").write_text(json.dumps({"data": {}}))
    assert training_system(runs[0])[0] == DEFAULT_SYSTEM
    (tmp_path / "r1" / "recipe.json").write_text(json.dumps({"data": {"default_system": None}}))

    def merged(name, inputs):
        out = shutil.copytree(folder, tmp_path / name)
        cfg = json.loads((out / "config.json").read_text())
        cfg["source"] = {"merged_from": [str(p) for p in inputs]}
        (out / "config.json").write_text(json.dumps(cfg))
        return out

    # A merge of runs that agree: their system; of runs that disagree: the folder's chat template's default.
    system, source = training_system(merged("m12", runs[:2]))
    assert system is None and "2 merged models" in source
    system, source = training_system(merged("m13", [runs[0], runs[2]]))
    assert system == DEFAULT_SYSTEM and "chat_template.jinja" in source
    # A bare model folder: its chat template (Qwen2-VL's, whose default system turn is Qwen's).
    assert training_system(folder) == (DEFAULT_SYSTEM, f"the default of the folder's chat template, "
                                                       f"{folder / 'chat_template.jinja'}")


def test_template_default_system_by_rendering():
    no_default = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    assert template_default_system(no_default) is None
    custom = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nBe brief."
              "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    assert template_default_system(custom) == "Be brief."


def test_eval_uses_and_prints_the_training_system(setup, tmp_path, capsys):
    _, folder, _, benches = setup
    run = tmp_path / "run"
    shutil.copytree(folder, run / "final")
    (run / "recipe.json").write_text(json.dumps({"data": {"default_system": None}}))
    common = ["--bench", f"chartqa={benches['chartqa']}", "--limit", "2", "--max-new-tokens", "3", "--device", "cpu"]
    assert cli_main(["eval", str(run / "final"), "--out", str(tmp_path / "auto"), *common]) == 0
    printed = capsys.readouterr().out
    assert "system prompt none (no system turn): data.default_system of the training run" in printed
    assert cli_main(["eval", str(run / "final"), "--out", str(tmp_path / "none"), "--no-system", *common]) == 0
    assert "system prompt none (no system turn): as given" in capsys.readouterr().out
    assert cli_main(["eval", str(run / "final"), "--out", str(tmp_path / "qwen"), "--system", DEFAULT_SYSTEM,
                     *common]) == 0
    rows = {name: (tmp_path / name / "chartqa" / "predictions.jsonl").read_text() for name in ("auto", "none")}
    assert rows["auto"] == rows["none"]  # the default is exactly --no-system for a model trained without one
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["settings"]["system"] is None
    qwen = json.loads((tmp_path / "qwen" / "chartqa" / "predictions.jsonl.settings.json").read_text())
    assert qwen["system"] == DEFAULT_SYSTEM


def test_eval_counts_empty_answers(setup, tmp_path, monkeypatch, capsys):
    _, folder, _, benches = setup
    _, tok = load_for_chat(folder, device="cpu")
    answers = iter([[tok.special.im_end], [*tok.encode("7"), tok.special.im_end], [*tok.encode("  "),
                                                                                   tok.special.im_end]])
    monkeypatch.setattr(generate_module, "generate", lambda model, prompts, *a, **kw: [next(answers)
                                                                                     for _ in prompts])
    assert cli_main(["eval", str(folder), "--bench", f"ocrbench={benches['ocrbench']}", "--out", str(tmp_path / "e"),
                     "--limit", "3", "--no-system", "--device", "cpu"]) == 0
    assert "exact match 0.0% over 3 items (2 of them answered with nothing)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["results"]["ocrbench"]["empty_answers"] == 2
