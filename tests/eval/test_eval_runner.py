"""`mindvl eval` and `mindvl search-resolution`: predictions equal independent chat calls, crashes resume to the
same rows, settings cannot be mixed, the best setting and the box plots come out of the scores."""

from __future__ import annotations

import json

import pytest
from eval_helpers import PX, eval_setup, generate_module

from mindvl.cli import main as cli_main
from mindvl.eval.benchmarks import BENCHMARKS
from mindvl.eval.resolution_search import best_settings, parse_grid
from mindvl.eval.runner import EvalSettings, evaluate_benchmark, read_predictions, truncate_at_stop
from mindvl.infer import chat, load_for_chat


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return eval_setup(tmp_path_factory.mktemp("runner"), n=5)


SETTINGS = dict(min_pixels=4 * PX, max_pixels=16 * PX, system=None, batch_size=2, max_new_tokens=6)


def test_predictions_equal_independent_chat_calls(setup, tmp_path):
    _, folder, _, benches = setup
    model, tok = load_for_chat(folder, device="cpu")
    summary = evaluate_benchmark(model, tok, "chartqa", benches["chartqa"], EvalSettings(**SETTINGS),
                                 tmp_path / "p.jsonl")
    rows = read_predictions(tmp_path / "p.jsonl")
    items = list(BENCHMARKS["chartqa"].load(benches["chartqa"]))
    assert [r["id"] for r in rows] == [it.id for it in items] and summary["n"] == 5
    for row, item in zip(rows, items, strict=True):
        answer = chat(model, tok, item.prompt, item.images, system=None, min_pixels=4 * PX, max_pixels=16 * PX,
                      max_new_tokens=6)
        assert row["prediction"] == answer.strip()
    assert summary["headline"] == "relaxed_overall"
    assert summary["min_pixels"] == 4 * PX and summary["max_pixels"] == 16 * PX


def test_perfect_and_empty_predictors_score_one_and_zero(setup, tmp_path, monkeypatch):
    _, folder, _, benches = setup
    model, tok = load_for_chat(folder, device="cpu")
    from mindvl.infer.chat import process_images, vision_processing

    items = list(BENCHMARKS["ocrbench"].load(benches["ocrbench"]))
    stop = tok.special.im_end

    def key(pixels) -> bytes:  # an item's processed image, whatever order the runner generates in
        return pixels.numpy().tobytes()

    keys = [key(process_images(it.images, SETTINGS["min_pixels"], SETTINGS["max_pixels"],
                               vision_processing(model))[0]) for it in items]
    assert len(set(keys)) == len(items)
    reply: dict[bytes, list[int]] = {}

    def oracle(model, prompts, max_new_tokens, **kw):  # each prompt's answer, then the stop token
        return [reply[key(p.pixel_values)] for p in prompts]

    monkeypatch.setattr(generate_module, "generate", oracle)
    reply.update({k: [*tok.encode(it.answers[0]), stop] for k, it in zip(keys, items, strict=True)})
    perfect = evaluate_benchmark(model, tok, "ocrbench", benches["ocrbench"], EvalSettings(**SETTINGS),
                                 tmp_path / "perfect.jsonl")
    assert perfect["exact_match"] == 1.0 and perfect["accuracy"] == 1.0 and perfect["hits"] == 5
    reply.update({k: [stop] for k in keys})
    empty = evaluate_benchmark(model, tok, "ocrbench", benches["ocrbench"], EvalSettings(**SETTINGS),
                               tmp_path / "empty.jsonl")
    assert empty["exact_match"] == 0.0 and empty["hits"] == 0


def test_a_crash_resumes_to_the_uninterrupted_rows(setup, tmp_path, monkeypatch):
    _, folder, _, benches = setup
    model, tok = load_for_chat(folder, device="cpu")
    settings = EvalSettings(**SETTINGS)
    reference = evaluate_benchmark(model, tok, "docvqa", benches["docvqa"], settings, tmp_path / "ref.jsonl")

    real = generate_module.generate
    calls = []

    def crash_on_second_batch(*args, **kw):
        calls.append(len(args[1]))
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        return real(*args, **kw)

    monkeypatch.setattr(generate_module, "generate", crash_on_second_batch)
    path = tmp_path / "run.jsonl"
    with pytest.raises(KeyboardInterrupt):
        evaluate_benchmark(model, tok, "docvqa", benches["docvqa"], settings, path)
    assert len(read_predictions(path)) == 2  # the first batch was kept
    with open(path, "a") as f:
        f.write('{"id": "torn')  # and a line torn mid-write is dropped and redone
    monkeypatch.setattr(generate_module, "generate", real)
    resumed = evaluate_benchmark(model, tok, "docvqa", benches["docvqa"], settings, path)
    assert read_predictions(path) == read_predictions(tmp_path / "ref.jsonl")
    assert resumed["anls"] == reference["anls"]

    with pytest.raises(ValueError, match="other settings.*max_pixels"):
        evaluate_benchmark(model, tok, "docvqa", benches["docvqa"], EvalSettings(**{**SETTINGS, "max_pixels": 64 * PX}),
                           path)


def test_stop_strings_and_settings_checks():
    assert truncate_at_stop("B. ASSISTANT: C", ["ASSISTANT:"]) == "B. "
    assert truncate_at_stop("plain", []) == "plain"
    with pytest.raises(ValueError, match="min_pixels"):
        EvalSettings(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="toolkit"):
        EvalSettings(toolkit="helm")


def test_grids():
    paper = parse_grid("paper")
    assert len(paper) == 24 and paper[0] == (4 * PX, 1280 * PX) and paper[-1] == (64 * PX, 8192 * PX)
    assert parse_grid("4,16:8") == [(4 * PX, 8 * PX)]  # 16 > 8 is skipped
    with pytest.raises(ValueError, match="MINS:MAXES"):
        parse_grid("big")


def test_best_settings_by_hand():
    scores = {"a": {"ocr": {"min4_max16": 0.5, "min4_max64": 0.7, "min16_max64": 0.7}},
              "b": {"ocr": {"min4_max16": 0.8, "min4_max64": 0.1, "min16_max64": 0.2}}}
    best = best_settings(scores)
    assert best["per_checkpoint"]["a"]["ocr"] == {"setting": "min4_max64", "min_pixels": 4 * PX,
                                                  "max_pixels": 64 * PX, "score": 0.7}  # first of a tie
    assert best["overall"]["ocr"]["checkpoint"] == "b" and best["overall"]["ocr"]["score"] == 0.8


def test_search_resolution_end_to_end(setup, tmp_path):
    root, a, b, benches = setup
    out = tmp_path / "search"
    code = cli_main(["search-resolution", f"a={a}", f"b={b}", "--bench", f"ocrbench={benches['ocrbench']}",
                     "--bench", f"chartqa={benches['chartqa']}", "--grid", "4,16:16,64", "--out", str(out),
                     "--no-system", "--limit", "3", "--max-new-tokens", "4", "--device", "cpu"])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert set(result["scores"]) == {"a", "b"}
    assert set(result["scores"]["a"]["ocrbench"]) == {"min4_max16", "min4_max64", "min16_max16", "min16_max64"}
    # Each cell is exactly what a plain evaluation at that setting gives.
    model, tok = load_for_chat(b, device="cpu")
    single = evaluate_benchmark(model, tok, "chartqa", benches["chartqa"],
                                EvalSettings(min_pixels=16 * PX, max_pixels=64 * PX, system=None, limit=3,
                                             max_new_tokens=4), tmp_path / "single.jsonl")
    assert result["scores"]["b"]["chartqa"]["min16_max64"] == single["relaxed_overall"]
    assert json.loads((out / "best.json").read_text()) == result["best"]
    assert (out / "boxplot_ocrbench.png").stat().st_size > 0 and (out / "boxplot_chartqa.png").is_file()
    assert "| a |" in (out / "results.md").read_text()


def test_eval_cli_writes_summaries(setup, tmp_path):
    _, a, _, benches = setup
    out = tmp_path / "eval"
    assert cli_main(["eval", str(a), "--bench", f"ocrbench={benches['ocrbench']}", "--out", str(out), "--limit", "2",
                     "--no-system", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["ocrbench"]["n"] == 2
    assert "ocrbench" in (out / "summary.md").read_text()
    assert cli_main(["eval", str(a), "--bench", "nope=/x", "--out", str(out)]) == 2  # one-line error, not a trace


def test_the_ocrbench_box_plot_is_in_percent_of_the_items():
    """Issue 43 item 8: OCRBench's headline is hits / 1000 whatever the item count (0.094 for 94 of 100), while the
    tables read 94%: its box plot shows the accuracy in percent of the items; other headlines as they are."""
    from mindvl.eval.resolution_search import box_plot_figure, plot_value

    rows = [{"score": 1.0, "category": "Regular Text Recognition"}] * 94 + \
        [{"score": 0.0, "category": "Regular Text Recognition"}] * 6
    for toolkit in ("lmms-eval", "vlmevalkit"):
        summary = BENCHMARKS["ocrbench"].summarise(rows, toolkit)
        summary["headline"] = BENCHMARKS["ocrbench"].headline(toolkit)
        assert plot_value(summary) == (pytest.approx(94.0), "accuracy (% of the items)")
    assert plot_value({"headline": "relaxed_overall", "relaxed_overall": 0.25, "accuracy": 0.2}) == \
        (0.25, "relaxed_overall")
    pytest.importorskip("matplotlib")
    fig = box_plot_figure({"merged": {"ocrbench": {"a": 94.0, "b": 90.0}}}, "ocrbench", "accuracy (% of the items)")
    assert fig.axes[0].get_ylabel() == "accuracy (% of the items)"
    assert max(fig.axes[0].get_ylim()) > 90
