"""Synthetic held-out benchmarks: written in the HF parquet layouts, read back by mindvl.eval.benchmarks, scored."""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
import pytest

from mindvl.data.synth import make_record
from mindvl.eval.benchmarks import BENCHMARKS
from mindvl.eval.synth_bench import write_synthetic_benchmarks

N = 6


@pytest.fixture(scope="module")
def bench_dirs(tmp_path_factory):
    return write_synthetic_benchmarks(tmp_path_factory.mktemp("synth_bench"), n=N, seed=3)


def test_layout_and_metadata(bench_dirs):
    assert set(bench_dirs) == {"ocrbench", "chartqa", "docvqa"}
    expected = {"ocrbench": ("test", {"dataset", "question", "question_type", "answer", "image"}),
                "chartqa": ("test", {"type", "question", "answer", "image"}),
                "docvqa": ("validation", {"questionId", "question", "question_types", "image", "docId",
                                          "ucsf_document_id", "ucsf_document_page_no", "answers", "data_split"})}
    for name, (split, columns) in expected.items():
        (shard,) = bench_dirs[name].glob("*.parquet")
        assert shard.name == f"{split}-00000-of-00001.parquet"
        schema = pq.read_schema(shard)
        assert set(schema.names) == columns
        features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
        assert features["image"] == {"_type": "Image"} and set(features) == columns


@pytest.mark.parametrize("toolkit", ["lmms-eval", "vlmevalkit"])
def test_round_trip_perfect_and_empty_predictors(bench_dirs, toolkit):
    headline_perfect = {"ocrbench": 1.0, "chartqa": 1.0, "docvqa": 1.0}
    for name, folder in bench_dirs.items():
        bench = BENCHMARKS[name]
        reader = bench.load(folder, toolkit)
        items = list(reader)
        assert len(items) == N and reader.skipped == {}
        for item in items:
            assert len(item.images) == 1 and item.images[0].size[0] % 28 == 0
            assert item.answers and all(a.strip() for a in item.answers) and item.prompt
        perfect = bench.summarise([bench.score_item(item.answers[0], item, toolkit) for item in items], toolkit)
        empty = bench.summarise([bench.score_item("", item, toolkit) for item in items], toolkit)
        if name == "ocrbench":  # the toolkits' OCRBench numbers are hit counts (over 1000 in lmms-eval)
            assert perfect["accuracy"] == headline_perfect[name] and empty["accuracy"] == 0.0
            assert perfect["hits" if toolkit == "lmms-eval" else "Final Score"] == N
        else:
            scale = 1.0 if toolkit == "lmms-eval" else 100.0
            key = bench.headline(toolkit)
            assert perfect[key] == headline_perfect[name] * scale and empty[key] == 0.0


def test_questions_are_the_training_kind(bench_dirs):
    items = {name: list(BENCHMARKS[name].load(folder)) for name, folder in bench_dirs.items()}
    ocr_questions = {"What text is written in the image?", "Read the text in the image.", "OCR this image."}
    assert {i.prompt for i in items["ocrbench"]} <= ocr_questions
    assert all(i.prompt.startswith(("In this", "Which category")) for i in items["chartqa"])
    assert all(i.prompt.startswith(("According to the document", "What is the title")) for i in items["docvqa"])


def test_deterministic_and_held_out(bench_dirs, tmp_path):
    again = write_synthetic_benchmarks(tmp_path / "again", n=N + 2, seed=3, benchmarks=["ocrbench"])
    first = pq.read_table(next(bench_dirs["ocrbench"].glob("*.parquet"))).to_pylist()
    longer = pq.read_table(next(again["ocrbench"].glob("*.parquet"))).to_pylist()
    assert longer[:N] == first  # item i depends only on (seed, i): a larger n extends a smaller one
    other_seed = write_synthetic_benchmarks(tmp_path / "s4", n=N, seed=4, benchmarks=["ocrbench"])
    assert pq.read_table(next(other_seed["ocrbench"].glob("*.parquet"))).to_pylist() != first

    # no benchmark image is a training image of the same seed (the tiny recipes train on seeds 0-2)
    def digest(image):
        return hashlib.sha256(image.tobytes() + repr(image.size).encode()).hexdigest()

    bench_images = {digest(i.images[0]) for name, folder in bench_dirs.items() for i in BENCHMARKS[name].load(folder)}
    train_images = {digest(make_record(i, 3, ["ocr", "chart", "doc"])[1]) for i in range(40)}
    assert len(bench_images) == 3 * N and not bench_images & train_images


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="n must be > 0"):
        write_synthetic_benchmarks(tmp_path, n=0)
    with pytest.raises(ValueError, match="no synthetic layout for mme"):
        write_synthetic_benchmarks(tmp_path, n=1, benchmarks=["mme"])
