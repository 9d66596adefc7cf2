"""The testbed's synthetic tasks (issue 29): sized digit strips are the `digits` strip enlarged as the processor
would, the small bar chart's answers agree with the bars drawn (measured from the pixels), the small form's answer is
one of its lines, the sized charts and forms are the page resized to the resolution grid's sizes, and the held-out
ChartQA / DocVQA files can be made of them."""

from __future__ import annotations

import random

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mindvl.data.synth import COLOURS, GENERATORS, PAGE_SIZED_SHAPES, SIZED_SHAPES
from mindvl.eval.synth_bench import write_synthetic_benchmarks


def test_digits_sized_is_the_strip_or_its_bicubic_enlargement():
    shapes = set()
    for i in range(40):
        img, q, text = GENERATORS["digits_sized"](random.Random(f"t:{i}"))
        ref, ref_q, ref_text = GENERATORS["digits"](random.Random(f"t:{i}"))  # the same draws, before enlarging
        assert (q, text) == (ref_q, ref_text)
        shapes.add((img.height, img.width))
        expected = ref if img.size == ref.size else ref.resize(img.size, Image.BICUBIC)
        assert np.array_equal(np.asarray(img), np.asarray(expected))
    assert shapes == set(SIZED_SHAPES)  # every size shows up in 40 draws, the canonical one included


@pytest.mark.parametrize("task", ["minichart", "minidoc"])
def test_sized_pages_are_the_page_or_its_bicubic_resize_to_the_grid_sizes(task):
    shapes = set()
    for i in range(60):
        img, q, answer = GENERATORS[f"{task}_sized"](random.Random(f"p:{i}"))
        ref, ref_q, ref_answer = GENERATORS[task](random.Random(f"p:{i}"))  # the same draws, before resizing
        assert (q, answer) == (ref_q, ref_answer)
        shapes.add((img.height, img.width))
        expected = ref if img.size == ref.size else ref.resize(img.size, Image.BICUBIC)
        assert np.array_equal(np.asarray(img), np.asarray(expected))
    assert shapes == {(112, 224), *PAGE_SIZED_SHAPES}  # every size shows up in 60 draws, the page's own included


def test_sized_pages_cover_the_ablation_grid():
    # Every setting of the ablation's resolution grid, at both scales, turns a 224 x 112 page into a size the sized
    # tasks train on (the processor's own resize arithmetic, transformers' smart_resize): a model trained on them has
    # seen every size the grid shows it.
    from mindvl.ablate.plan import SCALES
    from mindvl.data.image import smart_resize
    from mindvl.eval.resolution_search import parse_grid

    for scale in SCALES.values():
        sizes = {smart_resize(112, 224, min_pixels=lo, max_pixels=hi) for lo, hi in parse_grid(scale.grid)}
        assert sizes == {(112, 224), *PAGE_SIZED_SHAPES}


def _bars(img: Image.Image) -> list[tuple[int, int]]:
    """(left x, height in pixels) of each bar: runs of columns holding a palette colour."""
    a = np.asarray(img).astype(int)
    palette = np.array(list(COLOURS.values())[:6])
    is_bar = (np.abs(a[:, :, None, :] - palette[None, None]).sum(-1) == 0).any(-1)  # [h, w]
    cols = is_bar.sum(0)
    bars, x = [], 0
    while x < len(cols):
        if cols[x] > 0:
            start = x
            while x < len(cols) and cols[x] > 0:
                x += 1
            bars.append((start, int(cols[start:x].max())))
        x += 1
    return bars


def test_minichart_answers_match_the_bars_drawn():
    seen = {"value": 0, "highest": 0}
    for i in range(60):
        img, q, answer = GENERATORS["minichart"](random.Random(f"c:{i}"))
        assert img.size == (224, 112)
        bars = _bars(img)
        assert len(bars) == 3
        heights = [h for _, h in bars]
        if q == "Which bar is the highest?":  # which letter: the next test
            seen["highest"] += 1
        else:
            seen["value"] += 1
            assert 10 <= int(answer) <= 99
            # A bar spans value% of the 62-pixel plot height (base 90, the values' row 28) plus its base row: the
            # asked bar's height matches its value, within the rounding of a pixel.
            h = heights["ABC".index(q.removeprefix("What is the value of bar ").removesuffix("?"))]
            assert abs(h - (62 * int(answer) / 100 + 1)) <= 1, (q, answer, heights)
    assert seen["value"] > 10 and seen["highest"] > 10


def test_minichart_highest_is_the_tallest_bars_label():
    # Bars are lettered A, B, C from the left: the answer is the letter at the tallest bar's position.
    asked = 0
    for i in range(60):
        img, q, answer = GENERATORS["minichart"](random.Random(f"h:{i}"))
        if q != "Which bar is the highest?":
            continue
        heights = [h for _, h in _bars(img)]
        assert answer == "ABC"[heights.index(max(heights))]
        asked += 1
    assert asked > 10


def test_minidoc_answer_is_on_the_form():
    for i in range(30):
        img, q, answer = GENERATORS["minidoc"](random.Random(f"d:{i}"))
        assert img.size == (224, 112)
        if q == "What is the title of this form?":
            kind, number = answer.split()
            assert kind in ("Invoice", "Receipt", "Order", "Report") and 10 <= int(number) <= 99
        else:
            key = q.removeprefix("What is the ").removesuffix(" on this form?")
            assert key.title() in ("Total", "Code") and 10 <= int(answer) <= 99


def test_benchmarks_can_use_the_small_tasks(tmp_path):
    from mindvl.eval.synth_bench import _rng

    benches = write_synthetic_benchmarks(tmp_path, n=3, seed=5, benchmarks=["chartqa", "docvqa"],
                                         chart_task="minichart", doc_task="minidoc")
    chart = pq.read_table(next(benches["chartqa"].glob("*.parquet"))).to_pylist()
    doc = pq.read_table(next(benches["docvqa"].glob("*.parquet"))).to_pylist()
    for i in range(3):
        _, q, a = GENERATORS["minichart"](_rng("chartqa", 5, i))
        assert (chart[i]["question"], chart[i]["answer"]) == (q, a)
        _, q, a = GENERATORS["minidoc"](_rng("docvqa", 5, i))
        assert (doc[i]["question"], doc[i]["answers"]) == (q, [a])


def test_chart_and_form_training_questions_end_as_the_benchmark_prompts_do(tmp_path):
    # The evaluation appends the toolkit's short-answer instruction (lmms-eval ChartQA / DocVQA, VLMEvalKit ChartQA);
    # the training questions must carry the same words, and the held-out items stay bare (no double suffix).
    from mindvl.data.synth import make_record
    from mindvl.eval.benchmarks import CHARTQA_LMMS, SHORT_ANSWER

    expected = {"minichart": {CHARTQA_LMMS, SHORT_ANSWER}, "minidoc": {SHORT_ANSWER},
                "minichart_sized": {CHARTQA_LMMS, SHORT_ANSWER}, "minidoc_sized": {SHORT_ANSWER}}
    for task, suffixes in expected.items():
        seen = set()
        for i in range(40):
            record, _, _ = make_record(i, 3, [task])
            prompt = record["messages"][0]["content"].replace("<image>", "").rstrip("\n")
            suffix = next(s for s in suffixes if prompt.endswith(s))
            seen.add(suffix)
            _, bare, _ = GENERATORS[task](random.Random(f"mindvl-synth:3:{i}:{task}"))  # any draw: never suffixed
            assert not any(bare.endswith(s) for s in suffixes)
        assert seen == suffixes
    benches = write_synthetic_benchmarks(tmp_path, n=5, seed=5, benchmarks=["chartqa"], chart_task="minichart")
    rows = pq.read_table(next(benches["chartqa"].glob("*.parquet"))).to_pylist()
    assert all(r["question"].endswith("?") for r in rows)
