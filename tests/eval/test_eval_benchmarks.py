"""mindvl.eval.benchmarks on tiny files written here in both public layouts (HF parquet, VLMEvalKit TSV):
columns, prompts, bad rows skipped and counted, scoring and summaries as each toolkit reports them."""

from __future__ import annotations

import base64
import csv
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_eval_scorers import OCRBENCH_GOLDEN

from mindvl.eval.benchmarks import BENCHMARKS, parse_bench_args

LMMS, VLM = "lmms-eval", "vlmevalkit"
OCR_PREDICTIONS = [g[1] for g in OCRBENCH_GOLDEN]


def png(colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(buf, format="PNG")
    return buf.getvalue()


def image_struct(data: bytes | None = None) -> dict:
    return {"bytes": png() if data is None else data, "path": None}


def b64(data: bytes | None = None) -> str:
    return base64.b64encode(png() if data is None else data).decode()


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_tsv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(header)
        w.writerows(rows)
    return path


# ---------------------------------------------------------------------------------------------------------------
# OCRBench: §9's 13 golden rows through real files, plus bad rows
# ---------------------------------------------------------------------------------------------------------------


def test_ocrbench_parquet_lmms(tmp_path):
    rows = [
        {"dataset": src, "question": "  What is written?  ", "question_type": cat, "answer": ans,
         "image": image_struct()}
        for ans, _, src, cat, _, _ in OCRBENCH_GOLDEN
    ]
    rows.insert(3, {**rows[0], "image": image_struct(b"\x89PNG but truncated")})
    rows.insert(6, {**rows[0], "answer": None})
    rows.append({**rows[0], "question_type": "Emoji Recognition"})
    path = write_parquet(tmp_path / "ocrbench" / "test-00000-of-00001.parquet", rows)

    bench = BENCHMARKS["ocrbench"]
    reader = bench.load(path.parent, LMMS)
    items = list(reader)
    assert len(items) == 13 and reader.n_rows == 16 and reader.expected_rows == 16
    assert reader.skipped == {"corrupt_image": 1, "missing_answer": 1, "unknown_category": 1}
    assert "13 items from 16 rows" in reader.report() and "corrupt_image: 1" in reader.report()
    assert items[0].prompt == "What is written?"  # lmms-eval: question.strip(), no instruction (§2.3)
    assert items[0].id == "0" and items[3].id == "4"  # row numbers, skipped rows included
    assert items[0].images[0].size == (8, 6)
    assert items[9].meta == {"category": OCRBENCH_GOLDEN[9][3], "source": "HME100k"}

    scored = [bench.score_item(pred, item, LMMS) for item, pred in zip(items, OCR_PREDICTIONS, strict=True)]
    assert [r["score"] for r in scored] == [g[4] for g in OCRBENCH_GOLDEN]
    summary = bench.summarise(scored, LMMS)
    assert summary["ocrbench_accuracy"] == pytest.approx(0.009)  # 9 hits / 1000, whatever ran (§2.4-7)
    assert summary["hits"] == 9 and summary["n"] == 13 and summary["accuracy"] == pytest.approx(9 / 13)
    assert bench.headline(LMMS) == "ocrbench_accuracy"


def test_ocrbench_tsv_vlmevalkit(tmp_path):
    header = ["index", "image", "question", "answer", "category"]
    rows = [[str(i), b64(), "What is written? ", repr(ans), cat] for i, (ans, _, _, cat, _, _) in
            enumerate(OCRBENCH_GOLDEN)]
    rows.append(["98", "!" * 100, "q", "['a']", "Regular Text Recognition"])  # not base64
    rows.append(["99", b64(), "q", "", "Regular Text Recognition"])  # empty cell: pandas NaN
    path = write_tsv(tmp_path / "OCRBench.tsv", header, rows)

    bench = BENCHMARKS["ocrbench"]
    reader = bench.load(path, VLM)
    items = list(reader)
    assert reader.skipped == {"bad_base64": 1, "missing_answer": 1} and reader.expected_rows is None
    assert items[0].prompt == "What is written? " and items[0].id == "0"  # VLMEvalKit: the question as is
    assert items[9].answers == ["y _ { 2 } = - 1\n", "y_2 = - 1\n"]  # the list literal, newlines included
    assert items[9].meta["source"] == "HME100k"  # derived from the category (the TSV has no source column)

    scored = [bench.score_item(pred, item, VLM) for item, pred in zip(items, OCR_PREDICTIONS, strict=True)]
    assert [r["score"] for r in scored] == [g[5] for g in OCRBENCH_GOLDEN]
    summary = bench.summarise(scored, VLM)
    golden = {"Text Recognition": 3, "Scene Text-centric VQA": 2, "Doc-oriented VQA": 0,
              "Key Information Extraction": 0, "Handwritten Mathematical Expression Recognition": 2,
              "Final Score": 7, "Final Score Norm": 0.7}
    assert {k: summary[k] for k in golden} == golden
    # the same TSV scored with lmms-eval's rules folds the full-width rows: 9 hits
    lmms_rows = [bench.score_item(pred, item, LMMS) for item, pred in zip(items, OCR_PREDICTIONS, strict=True)]
    assert bench.summarise(lmms_rows, LMMS)["hits"] == 9


def test_empty_prediction_reads_back_as_nan_in_vlmevalkit(tmp_path):
    path = write_tsv(tmp_path / "OCRBench.tsv", ["index", "image", "question", "answer", "category"],
                     [["0", b64(), "Read it", "['NA']", "Regular Text Recognition"]])
    bench = BENCHMARKS["ocrbench"]
    (item,) = bench.load(path, VLM)
    row = bench.score_item("", item, VLM)  # §2.4-5: the empty generation comes back as "nan", which contains "na"
    assert row["prediction"] == "nan" and row["score"] == 1.0
    assert bench.score_item("", item, LMMS)["score"] == 0.0
    assert bench.score_item(None, item, LMMS)["prediction"] == ""


# ---------------------------------------------------------------------------------------------------------------
# DocVQA / InfoVQA
# ---------------------------------------------------------------------------------------------------------------


def test_docvqa_parquet_split_selection_and_anls(tmp_path):
    folder = tmp_path / "DocVQA"
    val = [{"questionId": "q1", "question": "Who?", "answers": ["ab", "xy"], "image": image_struct()},
           {"questionId": "q2", "question": "When?", "answers": ["1/2/1997"], "image": image_struct()},
           {"questionId": "q3", "question": "What?", "answers": [], "image": image_struct()}]
    write_parquet(folder / "validation-00000-of-00001.parquet", val)
    write_parquet(folder / "test-00000-of-00001.parquet",
                  [{"questionId": "t1", "question": "Hidden?", "answers": None, "image": image_struct()}])

    bench = BENCHMARKS["docvqa"]
    assert [f.name for f in bench.files(folder)] == ["validation-00000-of-00001.parquet"]
    reader = bench.load(folder)
    items = list(reader)
    assert [i.id for i in items] == ["q1", "q2"] and reader.skipped == {"missing_answers": 1}
    assert items[0].prompt == "Who?\nAnswer the question using a single word or phrase."
    assert items[0].answers == ["ab", "xy"]

    for toolkit, first in ((LMMS, 2 / 3), (VLM, 5 / 6)):  # "a b   ": stripped (lmms) or raw length (VLM), §3.3-1
        rows = [bench.score_item("a b   ", items[0], toolkit), bench.score_item("1/2/97", items[1], toolkit)]
        assert rows[0]["score"] == pytest.approx(first) and rows[1]["score"] == pytest.approx(0.75)
        summary = bench.summarise(rows, toolkit)
        if toolkit == LMMS:
            assert summary == {"anls": pytest.approx((first + 0.75) / 2), "n": 2}
        else:
            assert summary == {"Overall": pytest.approx((first + 0.75) / 2 * 100), "n": 2}


def test_infovqa_tsv_answers_and_breakdown(tmp_path):
    header = ["index", "image", "question", "answer", "category"]
    rows = [["7", b64(), "How many?", "['12', 'twelve']", "count"],
            ["8", b64(), "Name?", "ITC Limited", "name"],
            ["9", b64(), "Name?", "[unclosed", "name"]]  # not a list literal: one plain answer
    path = write_tsv(tmp_path / "InfoVQA_VAL.tsv", header, rows)
    bench = BENCHMARKS["infovqa"]
    items = list(bench.load(path, VLM))
    assert [i.answers for i in items] == [["12", "twelve"], ["ITC Limited"], ["[unclosed"]]
    scored = [bench.score_item("twelve", items[0], VLM), bench.score_item("The answer is ITC Limited", items[1], VLM),
              bench.score_item("", items[2], VLM)]  # empty -> "nan": 1 - 8/9 < 0.5 -> 0
    assert [r["score"] for r in scored] == [1.0, 0.0, 0.0]
    summary = bench.summarise(scored, VLM)
    assert summary["Overall"] == pytest.approx(100 / 3)
    assert summary["category/count"] == 100.0 and summary["category/name"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# ChartQA
# ---------------------------------------------------------------------------------------------------------------


def test_chartqa_parquet_splits_and_prompts(tmp_path):
    docs = [("human_test", "10"), ("human_test", "Yes"), ("augmented_test", "3"), ("augmented_test", "7")]
    rows = [{"type": t, "question": "Value?", "answer": a, "image": image_struct()} for t, a in docs]
    path = write_parquet(tmp_path / "chartqa.parquet", rows)
    bench = BENCHMARKS["chartqa"]
    items = list(bench.load(path, LMMS))
    assert items[0].prompt == "Value?\nAnswer the question with a single word."  # §4.2: lmms-eval's own wording
    assert next(iter(bench.load(path, VLM))).prompt == "Value?\nAnswer the question using a single word or phrase."

    scored = [bench.score_item(p, it, LMMS) for p, it in zip(["10.4", "no", "3", "8"], items, strict=True)]
    assert bench.summarise(scored, LMMS) == {  # §9's split aggregation example
        "relaxed_overall": 0.5, "relaxed_human_split": 0.5, "relaxed_augmented_split": 0.5, "n": 4}
    assert bench.summarise(scored, VLM)["Overall"] == 50.0


def test_missing_column_skips_every_row(tmp_path):
    rows = [{"type": "human_test", "question": "Value?", "image": image_struct()}] * 3  # no `answer` column
    reader = BENCHMARKS["chartqa"].load(write_parquet(tmp_path / "c.parquet", rows))
    assert list(reader) == [] and reader.skipped == {"missing_answer": 3}


# ---------------------------------------------------------------------------------------------------------------
# MME
# ---------------------------------------------------------------------------------------------------------------


def test_mme_parquet_prompts_and_summary(tmp_path):
    q = "Is there a dog in this image? Please answer yes or no."
    rows = [
        {"question_id": "color/1.png", "image": image_struct(), "question": q, "answer": "Yes", "category": "color"},
        {"question_id": "color/1.png", "image": image_struct(), "question": q, "answer": "No", "category": "color"},
        {"question_id": "code_reasoning/2.png", "image": image_struct(), "question": q, "answer": "Yes",
         "category": "code_reasoning"},
        {"question_id": "code_reasoning/2.png", "image": image_struct(), "question": q, "answer": "No",
         "category": "code_reasoning"},
        {"question_id": "x/3.png", "image": image_struct(), "question": q, "answer": "No", "category": "colour"},
    ]
    path = write_parquet(tmp_path / "mme" / "test-00000-of-00001.parquet", rows)
    bench = BENCHMARKS["mme"]
    reader = bench.load(path.parent, LMMS)
    items = list(reader)
    assert reader.skipped == {"unknown_category": 1}
    # §5.4: lmms-eval swaps the yes/no suffix for the short-answer instruction; VLMEvalKit keeps the question
    assert items[0].prompt == "Is there a dog in this image?\nAnswer the question using a single word or phrase."
    assert next(iter(bench.load(path, VLM))).prompt == q

    preds = ["Yes", "No.", "Not sure", "No"]  # "Not sure" is "no" for lmms-eval, Unknown for VLMEvalKit
    lmms = bench.summarise([bench.score_item(p, it, LMMS) for p, it in zip(preds, items, strict=True)], LMMS)
    assert lmms["mme_perception_score"] == 200.0 and lmms["mme_cognition_score"] == 50.0  # code: acc 50 + acc+ 0
    vlm = bench.summarise([bench.score_item(p, it, VLM) for p, it in zip(preds, items, strict=True)], VLM)
    assert vlm["perception"] == 200.0 and vlm["reasoning"] == 50.0 and vlm["category/color"] == 200.0
    assert len(vlm["missing_categories"]) == 12  # VLMEvalKit itself would raise; reported instead

    # a pair broken by a skipped row is left out and counted, not fatal
    part = bench.summarise([bench.score_item("Yes", items[0], LMMS)], LMMS)
    assert part["unpaired_images"] == 1 and part["mme_perception_score"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# MMBench: TSV with VLMEvalKit image references, circular summaries
# ---------------------------------------------------------------------------------------------------------------

MMB_HEADER = ["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "l2-category", "split", "image"]


def _mmbench_tsv(tmp_path: Path) -> Path:
    img = b64()
    rows = [
        ["0", "What animal?", "", "teddy bear", "rabbit", "cat", "dog", "C", "animals", "perception", "dev", img],
        ["1000000", "What animal?", "", "rabbit", "cat", "dog", "teddy bear", "B", "animals", "perception", "dev", "0"],
        ["2000000", "What animal?", "", "cat", "dog", "teddy bear", "rabbit", "A", "animals", "perception", "dev", "0"],
        ["1", "Which colour?", "Look closely", "red", "blue", "green", "", "A", "colours", "perception", "dev",
         b64(png((0, 0, 200)))],
        ["1000001", "Which colour?", "Look closely", "blue", "green", "red", "", "C", "colours", "perception", "dev",
         "1"],
        ["5", "Broken image", "", "a", "b", "c", "d", "A", "x", "y", "dev", "!" * 100],
        ["6", "Dangling reference", "", "a", "b", "c", "d", "A", "x", "y", "dev", "999"],
        ["7", "Ragged line"],
    ]
    return write_tsv(tmp_path / "MMBench_DEV_EN.tsv", MMB_HEADER, rows)


def test_mmbench_tsv_reading(tmp_path):
    bench = BENCHMARKS["mmbench"]
    reader = bench.load(_mmbench_tsv(tmp_path), VLM)
    items = list(reader)
    assert [i.id for i in items] == ["0", "1000000", "2000000", "1", "1000001"]
    assert reader.skipped == {"bad_base64": 1, "unresolved_image_ref": 1, "bad_tsv_row": 1}
    assert items[1].images[0].tobytes() == items[0].images[0].tobytes()  # index reference resolved
    assert items[4].images[0].getpixel((0, 0)) == (0, 0, 200)
    assert items[3].meta["choices"] == {"A": "red", "B": "blue", "C": "green"}  # empty D is not an option
    assert items[1].meta["group"] == 0 and items[4].meta["group"] == 1
    assert items[0].prompt == (  # VLMEvalKit ImageMCQDataset.build_prompt; the empty hint is NaN: no Hint line
        "Question: What animal?\nOptions:\nA. teddy bear\nB. rabbit\nC. cat\nD. dog\n"
        "Please select the correct answer from the options above. \n")
    assert items[3].prompt.startswith("Hint: Look closely\nQuestion: Which colour?\n")

    lmms_item = list(bench.load(tmp_path / "MMBench_DEV_EN.tsv", LMMS))[3]
    assert lmms_item.prompt == (  # lmms-eval mmbench_doc_to_text: a blank line before the instruction (§6.4)
        "Look closely Which colour? There are several options:\nA. red\nB. blue\nC. green\n\n"
        "Answer with the option's letter from the given choices directly.")


@pytest.mark.parametrize("toolkit,headline,value", [(LMMS, "gpt_eval_score", 50.0), (VLM, "Overall", 0.5)])
def test_mmbench_circular_summary(tmp_path, toolkit, headline, value):
    bench = BENCHMARKS["mmbench"]
    items = list(bench.load(_mmbench_tsv(tmp_path), toolkit))
    # group 0: every pass right (one by option text); group 1: the second pass wrong
    preds = ["C", "cat", "The answer is A.", "A", "A"]
    rows = [bench.score_item(p, it, toolkit) for p, it in zip(preds, items, strict=True)]
    assert [r["extracted"] for r in rows] == ["C", "B", "A", "A", "A"]
    summary = bench.summarise(rows, toolkit)
    assert bench.headline(toolkit) == headline and summary[headline] == value
    assert summary["category/animals"] == 1.0 and summary["category/colours"] == 0.0
    assert summary["l2-category/perception"] == 0.5 and summary["n_questions"] == 2
    # without its main row a group is not counted (both toolkits iterate main rows)
    assert bench.summarise(rows[1:3], toolkit)["groups_without_main_row"] == 1


def test_mmbench_parquet_layout(tmp_path):
    row = {"index": "3", "question": "Pick one", "hint": "nan", "A": "x", "B": "y", "C": "z", "D": "w", "E": None,
           "answer": "B", "category": "c", "L2-category": "l2", "split": "dev", "image": image_struct()}
    hidden = {**row, "index": "4", "answer": None}  # test split: no answer
    path = write_parquet(tmp_path / "mmbench" / "dev-00000-of-00001.parquet", [row, hidden])
    reader = BENCHMARKS["mmbench"].load(path.parent, LMMS)
    items = list(reader)
    assert reader.skipped == {"missing_answers": 1}
    assert items[0].prompt.startswith("Pick one There are several options:\nA. x\n")  # "nan" hint dropped
    assert items[0].meta["choices"] == {"A": "x", "B": "y", "C": "z", "D": "w"}
    assert items[0].meta["l2_category"] == "l2" and items[0].meta["index"] == 3


# ---------------------------------------------------------------------------------------------------------------
# Registry, arguments, settings
# ---------------------------------------------------------------------------------------------------------------


def test_registry_generation_and_headlines():
    assert set(BENCHMARKS) == {"ocrbench", "docvqa", "infovqa", "chartqa", "mme", "mmbench"}
    tokens = {name: b.generation(LMMS).max_new_tokens for name, b in BENCHMARKS.items()}
    assert tokens == {"ocrbench": 128, "docvqa": 32, "infovqa": 32, "chartqa": 16, "mme": 16, "mmbench": 1024}
    assert BENCHMARKS["mmbench"].generation().stop == ("ASSISTANT:",)
    assert all(b.generation(VLM).max_new_tokens is None for b in BENCHMARKS.values())  # left to the model (§7)
    assert {n: b.headline(VLM) for n, b in BENCHMARKS.items()}["mme"] == "perception"
    with pytest.raises(ValueError, match="unknown toolkit"):
        BENCHMARKS["mme"].generation("lmms")


def test_parse_bench_args(tmp_path):
    f = write_tsv(tmp_path / "OCRBench.tsv", ["index"], [])
    assert parse_bench_args([f"ocrbench={f}", f"DocVQA={tmp_path}"]) == {"ocrbench": f, "docvqa": tmp_path}
    with pytest.raises(ValueError, match=r"unknown benchmark 'textvqa'.*known: ocrbench, docvqa, infovqa"):
        parse_bench_args([f"textvqa={f}"])
    with pytest.raises(FileNotFoundError, match="nowhere/at/all"):
        parse_bench_args([f"chartqa={tmp_path}/nowhere/at/all"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_bench_args([str(f)])
    with pytest.raises(ValueError, match="twice"):
        parse_bench_args([f"mme={f}", f"mme={f}"])


def test_load_errors(tmp_path):
    bench = BENCHMARKS["ocrbench"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bench.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .parquet or .tsv"):
        bench.load(tmp_path / "empty")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        bench.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="unknown toolkit"):
        bench.load(tmp_path / "x.json", "opencompass")
    empty_tsv = write_tsv(tmp_path / "e.tsv", ["index", "image", "question", "answer", "category"], [])
    assert list(bench.load(empty_tsv)) == []
