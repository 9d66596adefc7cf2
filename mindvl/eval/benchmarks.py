"""Local benchmark files in their public layouts, turned into prompts and scored as a toolkit does (eval-scoring.md).

Layouts read (§8):
  * HF parquet, as lmms-eval loads them (`echo840/OCRBench`, `lmms-lab(-encoder)/DocVQA` configs DocVQA and
    InfographicVQA, `lmms-lab(-encoder)/ChartQA`, `.../MME`, `.../MMBench` config en): one `.parquet` file or a
    folder of shards. Image cells are HF `Image` structs `{"bytes", "path"}` (raw bytes are accepted too).
  * VLMEvalKit TSV (`OCRBench.tsv`, `DocVQA_VAL.tsv`, `InfoVQA_VAL.tsv`, `ChartQA_TEST.tsv`, `MME.tsv`,
    `MMBench_DEV_EN.tsv`): base64 images, list answers as Python list literals.

Usage::

    bench = BENCHMARKS["ocrbench"]
    reader = bench.load("/data/OCRBench", toolkit="lmms-eval")     # streams BenchItems; bad rows skipped
    rows = [bench.score_item(generate(item.images, item.prompt), item) for item in reader]
    print(bench.summarise(rows), reader.report())

`BenchItem.prompt` is the toolkit's dataset-default prompt (§7; model-specific prompt overrides are not applied) and
`Benchmark.generation(toolkit)` its generation settings. `score_item` applies the toolkit's prediction pipeline
(`scorers.prepare_prediction`) and rule; its rows are plain JSON-able dicts, so a runner can store them and
`summarise` them later. `summarise` names the headline metric as the toolkit reports it (`Benchmark.headline`).

Bad rows (missing or empty required cell, undecodable image, unknown category, unparseable answer) are skipped,
counted by reason in `reader.skipped` (a `mindvl.data.skips.SkipLog`, which also logs the first few) and never stop
a run. A required column missing from a whole file skips all its rows under `missing_<column>`.

Split handling: lmms-eval reads one split per task (DocVQA/InfoVQA `validation`, ChartQA/MME/OCRBench `test`,
MMBench `dev`; §2.3, 3.2, 4.2, 8). In a folder, shards named `<split>-*.parquet` (HF's naming) for that split are
used when there are any, else every `.parquet` (then every `.tsv`) in it; a file path is read as given. Rows
without answers (the hidden test splits, §3.2, §6.1) are skipped as `missing_answers`. Nothing else about splits is
stated in eval-scoring.md.
"""

from __future__ import annotations

import ast
import base64
import binascii
import csv
import math
import os
import string
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from mindvl.data.schema import BadSample
from mindvl.data.skips import SkipLog

from . import scorers
from .scorers import LMMS_EVAL, VLMEVALKIT, check_toolkit

Row = dict[str, Any]

PARQUET, TSV = "parquet", "tsv"

# §3.2, §4.2, §5.4, §6.4, §7: the toolkits' dataset-default instructions.
SHORT_ANSWER = "\nAnswer the question using a single word or phrase."
CHARTQA_LMMS = "\nAnswer the question with a single word."
MME_VLM_SUFFIX = " Please answer yes or no."
MMBENCH_LMMS_OPTIONS = "There are several options:"
MMBENCH_LMMS_POST = "\nAnswer with the option's letter from the given choices directly."
MMBENCH_VLM_POST = "Please select the correct answer from the options above. \n"

# VLMEvalKit reads TSVs with pandas' defaults, which turn whole cells such as "", "NA" or "None" into NaN
# (`scorers.PANDAS_NA`; not in eval-scoring.md). Matters for empty hints and for options or answers spelled so.
# VLMEvalKit stores an image once and lets other rows name its `index` instead (ImageBaseDataset: an image cell
# of <= 64 characters is a reference). Not in eval-scoring.md; MMBench and MME TSVs rely on it.
_MAX_IMAGE_REF = 64


@dataclass
class BenchItem:
    """One benchmark question, ready for a model.

    id: the row's `index` (TSV, MMBench) or `questionId` (DocVQA/InfoVQA), else its 0-based row number in the
    benchmark's file order. images: decoded PIL images (EXIF-oriented, not converted). prompt: the toolkit's text
    prompt (images go before it, as both toolkits' default messages put them). answers: ground truths (MMBench:
    the answer letter). meta: what scoring needs (category, source, pair id, options, ...).
    """

    id: str
    images: list[Image.Image]
    prompt: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Generation:
    """Decoding settings of a benchmark under a toolkit (§7): greedy, at most `max_new_tokens`, stop strings.

    `max_new_tokens` is None under VLMEvalKit, which leaves the length to the model class, not the dataset.
    """

    max_new_tokens: int | None
    stop: tuple[str, ...] = ()
    do_sample: bool = False
    temperature: float = 0.0


class BenchReader(Iterator[BenchItem]):
    """A stream of BenchItems from one benchmark path; `skipped` counts bad rows by reason as it goes."""

    def __init__(self, benchmark: Benchmark, path: str | os.PathLike, toolkit: str):
        self.benchmark = benchmark
        self.toolkit = check_toolkit(toolkit)
        self.files = benchmark.files(path)  # raises now, not at the first next(), for a bad path
        self.skips = SkipLog(strict=False, context=f"eval:{benchmark.name}")
        self.n_rows = 0
        self.n_items = 0
        self._stream = self._generate()

    def __next__(self) -> BenchItem:
        return next(self._stream)

    @property
    def expected_rows(self) -> int | None:
        """Rows in the files from parquet metadata (for progress bars), or None when a TSV is among them."""
        if any(f.suffix != ".parquet" for f in self.files):
            return None
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    @property
    def skipped(self) -> dict[str, int]:
        return self.skips.state_dict()

    def report(self) -> str:
        """One line: items read and skips by reason."""
        skipped = ", ".join(f"{k}: {v}" for k, v in self.skipped.items())
        tail = f"; skipped {self.skips.total} ({skipped})" if skipped else ""
        return f"{self.benchmark.name}: {self.n_items} items from {self.n_rows} rows{tail}"

    def _generate(self) -> Iterator[BenchItem]:
        for file in self.files:
            rows = _parquet_rows(file) if file.suffix == ".parquet" else _tsv_rows(file)
            for row in rows:
                ordinal = self.n_rows
                self.n_rows += 1
                try:
                    item = self.benchmark.make_item(row, self.toolkit, ordinal)
                except BadSample as bad:
                    self.skips.record(bad)
                    continue
                except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a cell of an unexpected type
                    self.skips.record(BadSample("bad_row", row.get("_where", "?"), f"{type(exc).__name__}: {exc}"))
                    continue
                self.n_items += 1
                yield item


class Benchmark:
    """A benchmark spec: how to read its rows, prompt, score and summarise under each toolkit.

    Subclasses implement `_parse(row, toolkit) -> (prompt, answers, meta)` (raising BadSample for a bad row),
    `score_item` and `summarise`.
    """

    name: str = ""
    title: str = ""
    split: str = ""  # the split lmms-eval evaluates
    lmms_max_new_tokens: int = 0
    lmms_stop: tuple[str, ...] = ()
    headlines: Mapping[str, str] = {}
    # The columns `_parse` needs, per layout: named in the error when no row of a file could be read.
    columns: Mapping[str, str] = {}

    # -- reading ---------------------------------------------------------------------------------------------------

    def load(self, path: str | os.PathLike, toolkit: str = LMMS_EVAL) -> BenchReader:
        """Stream the benchmark's items from a `.parquet` file, a `.tsv` file or a folder of parquet shards."""
        return BenchReader(self, path, toolkit)

    def files(self, path: str | os.PathLike) -> list[Path]:
        """The files `load` reads for `path`, in order (see the module docstring for split handling)."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"{self.name}: benchmark path {p} does not exist")
        if p.is_file():
            if p.suffix not in (".parquet", ".tsv"):
                raise ValueError(f"{self.name}: {p} is neither a .parquet nor a .tsv file")
            return [p]
        shards = sorted(p.rglob("*.parquet"))
        of_split = [f for f in shards if f.name.startswith((f"{self.split}-", f"{self.split}."))]
        found = of_split or shards or sorted(p.rglob("*.tsv"))
        if not found:
            raise FileNotFoundError(f"{self.name}: no .parquet or .tsv files under {p}")
        return found

    def expected_layout(self) -> str:
        """The columns this benchmark reads, per file layout (for messages about files that do not fit)."""
        return "; ".join(f"{layout}: {cols}" for layout, cols in self.columns.items())

    def make_item(self, row: Row, toolkit: str, ordinal: int) -> BenchItem:
        """A BenchItem from one raw row, or BadSample (reason, where) for a row that cannot be one."""
        if "_bad" in row:  # a row the reader could not split into cells (or resolve the image of)
            raise BadSample(row["_bad"], row["_where"], row["_bad"].replace("_", " "))
        prompt, answers, meta = self._parse(row, toolkit)  # cheap checks before the image decode
        if not answers:
            raise BadSample("missing_answers", row["_where"], "row has no ground-truth answer (hidden test split?)")
        images = _decode_images(row)
        key = next((row[k] for k in ("index", "questionId") if _present(row.get(k))), ordinal)
        return BenchItem(id=str(key), images=images, prompt=prompt, answers=answers, meta=meta)

    def _parse(self, row: Row, toolkit: str) -> tuple[str, list[str], dict[str, Any]]:
        raise NotImplementedError

    # -- generation, scoring ---------------------------------------------------------------------------------------

    def generation(self, toolkit: str = LMMS_EVAL) -> Generation:
        """Decoding settings (§7): lmms-eval's task YAML values; VLMEvalKit leaves max_new_tokens to the model."""
        if check_toolkit(toolkit) == LMMS_EVAL:
            return Generation(max_new_tokens=self.lmms_max_new_tokens, stop=self.lmms_stop)
        return Generation(max_new_tokens=None)

    def headline(self, toolkit: str = LMMS_EVAL) -> str:
        """The key of the main metric in `summarise`'s result, as the toolkit names it."""
        return self.headlines[check_toolkit(toolkit)]

    def score_item(self, prediction: str | None, item: BenchItem, toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """One scored row: {"id", "prediction" (as the scorer saw it), "answers", "score", ...what `summarise`
        needs}. The prediction goes through `scorers.prepare_prediction` first (lmms-eval strips; VLMEvalKit reads an
        empty generation back as "nan")."""
        raise NotImplementedError

    def summarise(self, rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """The benchmark's metrics from `score_item` rows, named and scaled as the toolkit reports them; the key of
        the main one is `headline(toolkit)`. Breakdowns and counts (`n`, ...) ride along."""
        raise NotImplementedError

    def _row(self, item: BenchItem, prediction: str, score: float, **extra: Any) -> dict[str, Any]:
        return {"id": item.id, "prediction": prediction, "answers": list(item.answers), "score": score, **extra}


# ---------------------------------------------------------------------------------------------------------------
# The benchmarks
# ---------------------------------------------------------------------------------------------------------------


class OCRBench(Benchmark):
    """OCRBench v1 (§2). HF columns `dataset`, `question`, `question_type`, `answer` (list), `image`; TSV `index`,
    `image`, `question`, `answer` (list literal), `category`. Rows whose category is not one of §2.1's ten are
    skipped (`unknown_category`): neither toolkit's totals have a place for them."""

    name, title, split = "ocrbench", "OCRBench", "test"
    lmms_max_new_tokens = 128  # §2.3
    headlines = {LMMS_EVAL: "ocrbench_accuracy", VLMEVALKIT: "Final Score"}
    columns = {PARQUET: "question, question_type (one of OCRBench's 10 categories), answer (a list), image",
               TSV: "index, image, question, answer, category"}

    def _parse(self, row: Row, toolkit: str) -> tuple[str, list[str], dict[str, Any]]:
        question = _text(row, "question")
        if row["_layout"] == PARQUET:
            answers, category, source = _answer_list(row, "answer"), _text(row, "question_type"), row.get("dataset")
        else:
            answers, category = _answer_list(row, "answer", literal=True), _text(row, "category")
            # The TSV has no source column; HME100k is exactly the HME category in the official data (§2.1).
            source = scorers.HME_SOURCE if category == scorers.HME_CATEGORY else None
        if category not in scorers.OCRBENCH_CATEGORIES:
            raise BadSample("unknown_category", row["_where"], f"OCRBench category {category!r} is not one of §2.1's")
        prompt = question.strip() if toolkit == LMMS_EVAL else question  # §2.3: no instruction in either
        return prompt, answers, {"category": category, "source": source}

    def score_item(self, prediction: str | None, item: BenchItem, toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """§2.2: lmms-eval detects HME by the source dataset name, VLMEvalKit by the category."""
        toolkit = check_toolkit(toolkit)
        pred = scorers.prepare_prediction(prediction, toolkit)
        key = (item.meta["source"] or item.meta["category"]) if toolkit == LMMS_EVAL else item.meta["category"]
        hit = scorers.ocrbench_hit(pred, item.answers, key, toolkit)
        return self._row(item, pred, float(hit), category=item.meta["category"])

    def summarise(self, rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """lmms-eval: `ocrbench_accuracy` = hits / 1000 whatever the item count (§2.4-7). VLMEvalKit: hit counts per
        group, `Final Score` (0-1000) and `Final Score Norm` = Final / 10 (§2.2). Both add `n` (items scored) and
        `accuracy` = hits / n, ours: the toolkits' numbers are only accuracies on the full 1000 items."""
        toolkit = check_toolkit(toolkit)
        rows = list(rows)
        hits = int(sum(r["score"] for r in rows))
        extra = {"accuracy": _mean(r["score"] for r in rows), "n": len(rows)}
        if toolkit == LMMS_EVAL:
            return {"ocrbench_accuracy": hits / scorers.OCRBENCH_TOTAL, "hits": hits, **extra}
        per_cat = defaultdict(int)
        for r in rows:
            per_cat[r["category"]] += int(r["score"])
        out: dict[str, Any] = {"Text Recognition": sum(per_cat[c] for c in scorers.OCRBENCH_TEXT_RECOGNITION)}
        for cat in scorers.OCRBENCH_CATEGORIES[len(scorers.OCRBENCH_TEXT_RECOGNITION):]:
            out[cat] = per_cat[cat]
        out["Final Score"] = hits
        out["Final Score Norm"] = hits / 10
        return {**out, **extra}


class DocVQA(Benchmark):
    """DocVQA / InfoVQA validation, ANLS (§3). HF columns `questionId`, `question`, `answers` (list), `image`;
    TSV `index`, `image`, `question`, `answer` (list literal or a plain string), optional `split`, `category`."""

    split = "validation"
    lmms_max_new_tokens = 32  # §3.2
    headlines = {LMMS_EVAL: "anls", VLMEVALKIT: "Overall"}
    columns = {PARQUET: "questionId, question, answers (a list), image", TSV: "index, image, question, answer"}

    def __init__(self, name: str, title: str):
        self.name, self.title = name, title

    def _parse(self, row: Row, toolkit: str) -> tuple[str, list[str], dict[str, Any]]:
        question = _text(row, "question")
        if row["_layout"] == PARQUET:
            answers = _answer_list(row, "answers")
        else:
            answers = _answer_list(row, "answer", literal=True)
        return f"{question}{SHORT_ANSWER}", answers, _breakdown_meta(row)

    def score_item(self, prediction: str | None, item: BenchItem, toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        toolkit = check_toolkit(toolkit)
        pred = scorers.prepare_prediction(prediction, toolkit)
        return self._row(item, pred, scorers.anls(pred, item.answers, toolkit), **item.meta)

    def summarise(self, rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """lmms-eval: `anls` = mean in [0, 1]. VLMEvalKit: `Overall` = mean × 100, plus `split/<v>` and
        `category/<v>` means (×100) when the TSV has those columns (§3.1)."""
        return _mean_summary(list(rows), toolkit, "anls")


class ChartQA(Benchmark):
    """ChartQA test, relaxed accuracy (§4). HF columns `type` (human_test | augmented_test), `question`, `answer`,
    `image`; TSV `index`, `image`, `question`, `answer`, optional `split`, `category`. The original
    `ahmed-masry/ChartQA` layout (`query`, `label`) is not read: §8 does not give the type of its `label`."""

    name, title, split = "chartqa", "ChartQA", "test"
    lmms_max_new_tokens = 16  # §4.2
    headlines = {LMMS_EVAL: "relaxed_overall", VLMEVALKIT: "Overall"}
    columns = {PARQUET: "type, question, answer, image", TSV: "index, image, question, answer"}

    def _parse(self, row: Row, toolkit: str) -> tuple[str, list[str], dict[str, Any]]:
        question = _text(row, "question")
        if row["_layout"] == PARQUET:
            answers = _answer_list(row, "answer")
        else:  # VLMEvalKit `process_line` evals an answer that is a list literal (§3.3-8)
            answers = _answer_list(row, "answer", literal=True)
        suffix = CHARTQA_LMMS if toolkit == LMMS_EVAL else SHORT_ANSWER  # §4.2: "single word" vs "word or phrase"
        meta = {"type": row.get("type") if _present(row.get("type")) else None, **_breakdown_meta(row)}
        return f"{question}{suffix}", answers, meta

    def score_item(self, prediction: str | None, item: BenchItem, toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        toolkit = check_toolkit(toolkit)
        pred = scorers.prepare_prediction(prediction, toolkit)
        return self._row(item, pred, scorers.relaxed_accuracy(pred, item.answers, toolkit), **item.meta)

    def summarise(self, rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """lmms-eval: `relaxed_overall` (mean over all items, §12-6), `relaxed_human_split` (type human_test) and
        `relaxed_augmented_split` (any other type), each in [0, 1]; the split metrics only over rows that carry a
        `type` (the TSV has none) and only when they have rows. VLMEvalKit: `Overall` ×100 plus `split/<v>`,
        `category/<v>`."""
        toolkit = check_toolkit(toolkit)
        rows = list(rows)
        if toolkit == VLMEVALKIT:
            return _mean_summary(rows, toolkit, "relaxed_overall")
        out: dict[str, Any] = {"relaxed_overall": _mean(r["score"] for r in rows)}
        typed = [r for r in rows if r.get("type") is not None]
        human = [r["score"] for r in typed if r["type"] == "human_test"]
        augmented = [r["score"] for r in typed if r["type"] != "human_test"]
        if human:
            out["relaxed_human_split"] = _mean(human)
        if augmented:
            out["relaxed_augmented_split"] = _mean(augmented)
        out["n"] = len(rows)
        return out


class MME(Benchmark):
    """MME (§5). HF columns `question_id` (image path: the pair key), `image`, `question`, `answer`, `category`;
    TSV `index`, `image`, `question`, `answer`, `category`, `image_path` (pair key). Categories outside §5.1's 14
    are skipped (`unknown_category`)."""

    name, title, split = "mme", "MME", "test"
    lmms_max_new_tokens = 16  # §5.4
    headlines = {LMMS_EVAL: "mme_perception_score", VLMEVALKIT: "perception"}
    columns = {PARQUET: "question_id, image, question, answer, category (one of MME's 14)",
               TSV: "index, image, question, answer, category, image_path"}

    def _parse(self, row: Row, toolkit: str) -> tuple[str, list[str], dict[str, Any]]:
        question, answer, category = _text(row, "question"), _text(row, "answer"), _text(row, "category")
        pair = _text(row, "question_id" if row["_layout"] == PARQUET else "image_path")
        if category not in scorers.MME_CATEGORIES:
            raise BadSample("unknown_category", row["_where"], f"MME category {category!r} is not one of §5.1's")
        if toolkit == LMMS_EVAL:  # §5.4: the yes/no suffix is replaced by the short-answer instruction
            prompt = question.strip().replace(MME_VLM_SUFFIX, "") + SHORT_ANSWER
        else:  # the TSV question as is (it already ends in " Please answer yes or no.")
            prompt = question
        return prompt, [answer], {"category": category, "pair_id": pair}

    def score_item(self, prediction: str | None, item: BenchItem, toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        toolkit = check_toolkit(toolkit)
        pred = scorers.prepare_prediction(prediction, toolkit)
        correct = scorers.mme_correct(pred, item.answers[0], toolkit)
        return self._row(item, pred, float(correct), extracted=scorers.mme_yes_no(pred, toolkit), correct=correct,
                         **item.meta)

    def summarise(self, rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """lmms-eval: `mme_perception_score`, `mme_cognition_score`; VLMEvalKit: `perception`, `reasoning`, and a
        score per category (§5.2). Both add `total` (max 2800), `category/<c>` scores and `n`. Images whose pair is
        incomplete (a skipped row, a partial run) are left out and counted in `unpaired_images`; categories absent
        are listed in `missing_categories` (VLMEvalKit itself would raise, §5.2)."""
        toolkit = check_toolkit(toolkit)
        rows = list(rows)
        res = scorers.mme_score(rows, toolkit, strict=False)
        if toolkit == LMMS_EVAL:
            out: dict[str, Any] = {"mme_perception_score": res["perception"], "mme_cognition_score": res["cognition"]}
        else:
            out = {"perception": res["perception"], "reasoning": res["cognition"]}
        out["total"] = res["total"]
        for cat, v in res["categories"].items():
            out[f"category/{cat}"] = v["score"]
        out.update(unpaired_images=res["unpaired_images"], missing_categories=res["missing_categories"], n=len(rows))
        return out


class MMBench(Benchmark):
    """MMBench dev EN, CircularEval (§6). HF (config en) columns `index`, `question`, `hint`, `A`..`E`, `answer`,
    `category`, `L2-category`, `split`, `image`; TSV the same with `l2-category` and any upper-case letter column as
    an option. Option cells that are missing, NaN or "nan" are not options."""

    name, title, split = "mmbench", "MMBench", "dev"
    lmms_max_new_tokens = 1024  # §6.4
    lmms_stop = ("ASSISTANT:",)
    headlines = {LMMS_EVAL: "gpt_eval_score", VLMEVALKIT: "Overall"}
    columns = {PARQUET: "index, question, A..E (options), answer, image (hint, category optional)",
               TSV: "index, image, question, A, B, ... (options), answer (hint, category optional)"}

    def _parse(self, row: Row, toolkit: str) -> tuple[str, list[str], dict[str, Any]]:
        question = _text(row, "question")
        try:
            index = int(_text(row, "index"))  # old HF revisions typed it as a string (§6.5-6)
        except ValueError as exc:
            raise BadSample("bad_index", row["_where"], f"MMBench index {row.get('index')!r} is not an int") from exc
        answer = row.get("answer")
        answers = [str(answer).strip()] if _present(answer) and str(answer).strip() else []
        letters = "ABCDE" if row["_layout"] == PARQUET else string.ascii_uppercase
        choices = {c: str(row[c]) for c in letters if _option(row.get(c))}
        hint = row.get("hint")
        hint = str(hint) if _option(hint) else None
        prompt = _mmbench_prompt(question, hint, choices, toolkit)
        l2 = row.get("L2-category", row.get("l2-category"))
        meta = {
            "index": index,
            "group": scorers.mmbench_group(index),
            "choices": choices,
            "category": row.get("category"),
            "l2_category": l2 if _present(l2) else None,
        }
        return prompt, answers, meta

    def score_item(self, prediction: str | None, item: BenchItem, toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        toolkit = check_toolkit(toolkit)
        pred = scorers.prepare_prediction(prediction, toolkit)
        extracted = scorers.mmbench_extract(pred, item.meta["choices"], toolkit)
        correct = extracted is not None and extracted == item.answers[0]
        return self._row(item, pred, float(correct), extracted=extracted, answer=item.answers[0],
                         index=item.meta["index"], group=item.meta["group"], category=item.meta["category"],
                         l2_category=item.meta["l2_category"])

    def summarise(self, rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
        """CircularEval over groups that have their main row (index < 1e6), as both toolkits iterate (§6.2).

        lmms-eval: `gpt_eval_score` = accuracy × 100; VLMEvalKit: `Overall` in [0, 1]. Both add `category/<c>` and
        `l2-category/<c>` accuracies in [0, 1] (raw names: VLMEvalKit's l2 abbreviations are not in §6),
        `n_questions`, and `groups_without_main_row` (left out, e.g. after a truncated run)."""
        toolkit = check_toolkit(toolkit)
        groups: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
        for r in rows:
            groups[int(r["group"])].append(r)
        hits: dict[int, int] = {}
        mains: dict[int, Mapping[str, Any]] = {}
        for g, passes in groups.items():
            main = next((p for p in passes if int(p["index"]) == g), None)
            if main is None:
                continue
            mains[g] = main
            hits[g] = scorers.circular_hit([p["extracted"] for p in passes], [p["answer"] for p in passes])
        accuracy = _mean(hits.values())
        out: dict[str, Any] = {self.headline(toolkit): accuracy * 100 if toolkit == LMMS_EVAL else accuracy}
        for key, field_name in (("category", "category"), ("l2-category", "l2_category")):
            by: dict[str, list[int]] = defaultdict(list)
            for g, main in mains.items():
                if main.get(field_name) is not None:
                    by[str(main[field_name])].append(hits[g])
            out.update({f"{key}/{k}": _mean(v) for k, v in sorted(by.items())})
        out["n_questions"] = len(hits)
        out["groups_without_main_row"] = len(groups) - len(hits)
        return out


def _mmbench_prompt(question: str, hint: str | None, choices: Mapping[str, str], toolkit: str) -> str:
    """§6.4. lmms-eval: `"{hint} {question} There are several options:\\nA. ..\\nB. .."` + `"\\n"` + post-prompt
    (which itself starts with a newline: a blank line before the instruction), options A-E only. VLMEvalKit:
    `"Hint: ..\\n"` (if any) `"Question: ..\\n"` `"Options:\\nA. ..\\n"` and the instruction with its trailing
    space and newline."""
    if toolkit == LMMS_EVAL:
        lines = [MMBENCH_LMMS_OPTIONS] + [f"{k}. {v}" for k, v in sorted(choices.items()) if k in "ABCDE" and v]
        options = "\n".join(lines)
        query = f"{hint} {question} {options}" if hint is not None else f"{question} {options}"
        return f"{query}\n{MMBENCH_LMMS_POST}"
    prompt = f"Hint: {hint}\n" if hint is not None else ""
    prompt += f"Question: {question}\n"
    if choices:
        prompt += "Options:\n" + "".join(f"{k}. {v}\n" for k, v in choices.items()) + MMBENCH_VLM_POST
    return prompt


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (OCRBench(), DocVQA("docvqa", "DocVQA"), DocVQA("infovqa", "InfoVQA"), ChartQA(), MME(), MMBench())
}


def parse_bench_args(specs: Sequence[str]) -> dict[str, Path]:
    """`["ocrbench=/data/OCRBench", "chartqa=/data/chartqa.tsv"]` -> {name: path}, in the given order.

    Raises ValueError for a spec without `=`, an unknown name (listing the known ones) or a repeated name, and
    FileNotFoundError naming a path that does not exist.
    """
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip().lower()
        if not sep or not name or not path.strip():
            raise ValueError(f"benchmark spec {spec!r} is not NAME=PATH (e.g. ocrbench=/data/OCRBench)")
        if name not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {name!r} in {spec!r} (known: {', '.join(BENCHMARKS)})")
        if name in out:
            raise ValueError(f"benchmark {name!r} given twice")
        p = Path(path.strip()).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"benchmark {name}: path {p} does not exist")
        out[name] = p
    return out


# ---------------------------------------------------------------------------------------------------------------
# Rows: reading the two layouts
# ---------------------------------------------------------------------------------------------------------------


def _parquet_rows(path: Path, batch_size: int = 32) -> Iterator[Row]:
    """Rows of a parquet file as dicts, a batch at a time (images stay as HF `{"bytes", "path"}` structs)."""
    import pyarrow.parquet as pq  # only needed for parquet files

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            row["_layout"], row["_where"], row["_dir"] = PARQUET, f"{path}:row {n}", path.parent
            n += 1
            yield row


def _tsv_rows(path: Path) -> Iterator[Row]:
    """Rows of a VLMEvalKit TSV as dicts of strings; cells pandas would read as NaN become None.

    Image references (a cell of <= 64 characters naming another row's `index`) are resolved: a first pass finds
    them, a second keeps only the referenced images, the third streams. A ragged line is yielded with
    `_bad = "bad_tsv_row"` so that it is counted, not fatal.
    """
    refs: set[str] = set()
    for row in _tsv_cells(path):
        image = row.get("image")
        if image is not None and len(image) <= _MAX_IMAGE_REF:
            refs.add(image)
    targets: dict[str, str] = {}
    if refs:
        for row in _tsv_cells(path):
            index, image = row.get("index"), row.get("image")
            if index in refs and image is not None and len(image) > _MAX_IMAGE_REF:
                targets[index] = image
    for row in _tsv_cells(path):
        image = row.get("image")
        if image is not None and len(image) <= _MAX_IMAGE_REF:
            row["image"] = targets.get(image)
            if row["image"] is None:
                row["_bad"] = "unresolved_image_ref"
        yield row


def _tsv_cells(path: Path) -> Iterator[Row]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # base64 images are far over csv's 128 KiB default
    with open(path, newline="", encoding="utf-8-sig") as f:  # tolerate a BOM
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None:
            return
        for n, cells in enumerate(reader):
            where = f"{path}:line {n + 2}"
            if len(cells) != len(header):
                yield {"_layout": TSV, "_where": where, "_dir": path.parent, "_bad": "bad_tsv_row"}
                continue
            row: Row = {k: (None if v in scorers.PANDAS_NA else v) for k, v in zip(header, cells, strict=True)}
            row["_layout"], row["_where"], row["_dir"] = TSV, where, path.parent
            yield row


# ---------------------------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------------------------


def _present(value: Any) -> bool:
    """Not None and not a float NaN."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _option(value: Any) -> bool:
    """An MMBench option or hint cell that counts: present, non-empty, not the string "nan" (§6.4)."""
    return _present(value) and str(value) != "" and str(value) != "nan"


def _text(row: Row, column: str) -> str:
    """A required cell as a string, or BadSample `missing_<column>`."""
    value = row.get(column)
    if not _present(value):
        raise BadSample(f"missing_{column}", row["_where"], f"no `{column}` value")
    return str(value)


def _answer_list(row: Row, column: str, literal: bool = False) -> list[str]:
    """Ground truths from a list cell, a string cell, or (TSV, `literal=True`) a Python list literal in a string.

    VLMEvalKit `eval`s list-literal answers (§2.2, §3.1); `ast.literal_eval` is used here, never `eval`. A string
    that is not a list literal is one answer.
    """
    value = row.get(column)
    if not _present(value):
        raise BadSample(f"missing_{column}", row["_where"], f"no `{column}` value")
    if isinstance(value, str) and literal and value.lstrip().startswith("["):
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, list):
            value = parsed
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if _present(v)]
    return [str(value)]


def _breakdown_meta(row: Row) -> dict[str, Any]:
    """`split` / `category` cells that VLMEvalKit's `evaluate_heuristic` breaks `Overall` down by (§3.1, §4.1)."""
    return {k: str(row[k]) for k in ("split", "category") if _present(row.get(k))}


def _decode_images(row: Row) -> list[Image.Image]:
    """The row's images, decoded (mindvl.data.image.load_image: size check, full decode, EXIF orientation)."""
    from mindvl.data.image import ImageError, load_image

    where = row["_where"]
    blobs = _image_blobs(row)
    images = []
    for blob in blobs:
        try:
            images.append(load_image(blob))
        except ImageError as exc:
            raise BadSample(exc.reason, where, str(exc)) from exc
    return images


def _image_blobs(row: Row) -> list[bytes]:
    """Encoded image bytes from an HF Image struct / bytes cell (parquet) or base64 text (TSV, maybe a list)."""
    where, cell = row["_where"], row.get("image")
    if not _present(cell):
        raise BadSample("missing_image", where, "no `image` value")
    if row["_layout"] == PARQUET:
        cells = cell if isinstance(cell, list) else [cell]
        return [_struct_bytes(c, row["_dir"], where) for c in cells]
    texts = [cell]
    if cell.startswith("[") and cell.endswith("]"):  # VLMEvalKit `toliststr`: several images as a list literal
        try:
            texts = [str(t) for t in ast.literal_eval(cell)]
        except (ValueError, SyntaxError) as exc:
            raise BadSample("bad_base64", where, "image cell looks like a list but does not parse") from exc
    try:
        return [base64.b64decode(t, validate=True) for t in texts]
    except (binascii.Error, ValueError) as exc:
        raise BadSample("bad_base64", where, f"image cell is not base64 ({exc})") from exc


def _struct_bytes(cell: Any, folder: Path, where: str) -> bytes:
    if isinstance(cell, (bytes, bytearray)):
        return bytes(cell)
    if isinstance(cell, dict):
        if cell.get("bytes"):
            return bytes(cell["bytes"])
        if cell.get("path"):  # an HF Image stored by path only: relative to the parquet file, and inside its folder
            from mindvl.untrusted import MAX_IMAGE_BYTES, TooLargeError, UntrustedInputError, inside, read_regular

            try:
                p = inside(folder, str(cell["path"]), "image path")
                return read_regular(p, MAX_IMAGE_BYTES, "image")
            except TooLargeError as exc:
                raise BadSample("image_too_large", where, f"{exc}; it is not read") from exc
            except UntrustedInputError as exc:
                raise BadSample("missing_image", where, str(exc)) from exc
            except OSError as exc:
                raise BadSample("missing_image", where, f"image path {cell['path']} unreadable ({exc})") from exc
    raise BadSample("missing_image", where, f"image cell of type {type(cell).__name__} has no bytes")


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _mean_summary(rows: list[Mapping[str, Any]], toolkit: str, lmms_key: str) -> dict[str, Any]:
    """lmms-eval: {lmms_key: mean in [0, 1]}; VLMEvalKit `evaluate_heuristic`: `Overall` = mean × 100 and the same
    per `split` / `category` value (§3.1, §4.1)."""
    toolkit = check_toolkit(toolkit)
    scores = [float(r["score"]) for r in rows]
    if toolkit == LMMS_EVAL:
        return {lmms_key: _mean(scores), "n": len(rows)}
    out: dict[str, Any] = {"Overall": _mean(scores) * 100}
    for key in ("split", "category"):
        by: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            if r.get(key) is not None:
                by[str(r[key])].append(float(r["score"]))
        out.update({f"{key}/{k}": _mean(v) * 100 for k, v in sorted(by.items())})
    out["n"] = len(rows)
    return out


__all__ = [
    "BENCHMARKS",
    "BenchItem",
    "BenchReader",
    "Benchmark",
    "ChartQA",
    "DocVQA",
    "Generation",
    "MME",
    "MMBench",
    "OCRBench",
    "parse_bench_args",
]
