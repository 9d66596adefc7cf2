"""Small held-out benchmark files for the quickstart, in the exact parquet layouts `mindvl.eval.benchmarks` reads.

`write_synthetic_benchmarks(out_dir, n, seed)` renders images with `mindvl.data.synth`'s generators (the same OCR,
chart and document tasks the tiny recipes train on, with the same kind of questions and answers) and writes

    out_dir/ocrbench/test-00000-of-00001.parquet         echo840/OCRBench columns (eval-scoring.md §8)
    out_dir/chartqa/test-00000-of-00001.parquet          lmms-lab/ChartQA columns
    out_dir/docvqa/validation-00000-of-00001.parquet     lmms-lab/DocVQA (config DocVQA) columns

returning {name: folder}, ready for `BENCHMARKS[name].load(folder)` or `mindvl eval ocrbench=FOLDER`. The files carry
Hugging Face `datasets` feature metadata, so `datasets.load_dataset("parquet", ...)` (and lmms-eval) decode the image
column as images.

Held out: training samples draw from `random.Random(f"mindvl-synth:{seed}:{i}")` (`synth.make_record`); these draw
from `random.Random(f"mindvl-bench:{name}:{seed}:{i}")`, a different stream for every seed, so the images (sizes,
colours, positions, fonts, texts) are independent of any training set rather than a re-draw of it. Item i depends
only on (name, seed, i), so a larger n extends a smaller one.

The ChartQA `type` is `augmented_test` for every item: ChartQA's augmented split is its machine-generated questions,
which is what these template questions are. OCRBench items are `Regular Text Recognition` from source
`mindvl-synth`.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from mindvl.data import synth

SYNTH_SOURCE = "mindvl-synth"
OCR_CATEGORY = "Regular Text Recognition"
SYNTH_BENCHMARKS = ("ocrbench", "chartqa", "docvqa")

# HF `datasets` Features, as `Features.to_dict()` writes them into parquet metadata.
_STR = {"dtype": "string", "_type": "Value"}
_INT = {"dtype": "int64", "_type": "Value"}
_STR_LIST = {"feature": _STR, "_type": "Sequence"}
_IMAGE = {"_type": "Image"}


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _rng(name: str, seed: int, i: int) -> random.Random:
    return random.Random(f"mindvl-bench:{name}:{seed}:{i}")


def _image_cell(name: str, i: int, image: Image.Image) -> dict[str, Any]:
    return {"bytes": _png(image), "path": f"{name}_{i:06d}.png"}


def _ocrbench_row(i: int, seed: int, ocr_task: str = "ocr") -> dict[str, Any]:
    image, question, answer = synth.GENERATORS[ocr_task](_rng("ocrbench", seed, i))
    return {"dataset": SYNTH_SOURCE, "question": question, "question_type": OCR_CATEGORY, "answer": [answer],
            "image": _image_cell("ocrbench", i, image)}


def _chartqa_row(i: int, seed: int, task: str = "chart") -> dict[str, Any]:
    image, question, answer = synth.GENERATORS[task](_rng("chartqa", seed, i))
    return {"type": "augmented_test", "question": question, "answer": answer,
            "image": _image_cell("chartqa", i, image)}


def _docvqa_row(i: int, seed: int, task: str = "doc") -> dict[str, Any]:
    image, question, answer = synth.GENERATORS[task](_rng("docvqa", seed, i))
    return {"questionId": str(i), "question": question, "question_types": ["form"],
            "image": _image_cell("docvqa", i, image), "docId": i, "ucsf_document_id": f"synth{seed}_{i:06d}",
            "ucsf_document_page_no": "1", "answers": [answer], "data_split": "validation"}


# name -> (split file prefix, row maker, HF features)
_LAYOUTS: dict[str, tuple[str, Callable[..., dict[str, Any]], dict[str, Any]]] = {
    "ocrbench": ("test", _ocrbench_row, {"dataset": _STR, "question": _STR, "question_type": _STR,
                                         "answer": _STR_LIST, "image": _IMAGE}),
    "chartqa": ("test", _chartqa_row, {"type": _STR, "question": _STR, "answer": _STR, "image": _IMAGE}),
    "docvqa": ("validation", _docvqa_row, {"questionId": _STR, "question": _STR, "question_types": _STR_LIST,
                                           "image": _IMAGE, "docId": _INT, "ucsf_document_id": _STR,
                                           "ucsf_document_page_no": _STR, "answers": _STR_LIST,
                                           "data_split": _STR}),
}


def _arrow_type(feature: dict[str, Any]) -> Any:
    import pyarrow as pa

    kind = feature["_type"]
    if kind == "Image":
        return pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    if kind == "Sequence":
        return pa.list_(_arrow_type(feature["feature"]))
    return {"string": pa.string(), "int64": pa.int64()}[feature["dtype"]]


def _write_parquet(path: Path, rows: list[dict[str, Any]], features: dict[str, Any]) -> None:
    """One parquet file with the HF feature metadata; written to a temporary name and renamed (atomic)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(k, _arrow_type(f)) for k, f in features.items()])
    schema = schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def write_synthetic_benchmarks(
    out_dir: str | os.PathLike, n: int = 100, seed: int = 0, benchmarks: Sequence[str] = SYNTH_BENCHMARKS,
    ocr_task: str = "ocr", chart_task: str = "chart", doc_task: str = "doc",
) -> dict[str, Path]:
    """Write n items for each of `benchmarks` (a subset of ocrbench, chartqa, docvqa) under out_dir.

    `ocr_task` picks the synth generator behind the OCRBench items: `ocr` (words and numbers in many fonts) or
    `digits` (short digit strips, what the quickstart's tiny model learns to read). `chart_task` / `doc_task` pick
    ChartQA's and DocVQA's: `chart` / `doc` (full-size charts and documents) or `minichart` / `minidoc` (the small
    ones the tiny recipes train on, issue 29).

    Returns {name: folder holding the single `<split>-00000-of-00001.parquet` shard}.
    """
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    tasks = {"ocrbench": ocr_task, "chartqa": chart_task, "docvqa": doc_task}
    for key, task in zip(("ocr_task", "chart_task", "doc_task"), tasks.values(), strict=True):
        if task not in synth.GENERATORS:
            raise ValueError(f"{key} {task!r} is not a synth task (known: {', '.join(synth.GENERATORS)})")
    unknown = [b for b in benchmarks if b not in _LAYOUTS]
    if unknown:
        raise ValueError(f"no synthetic layout for {', '.join(unknown)} (known: {', '.join(_LAYOUTS)})")
    out: dict[str, Path] = {}
    for name in benchmarks:
        split, make_row, features = _LAYOUTS[name]
        folder = Path(out_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        rows = [make_row(i, seed, tasks[name]) for i in range(n)]
        _write_parquet(folder / f"{split}-00000-of-00001.parquet", rows, features)
        out[name] = folder
    return out
