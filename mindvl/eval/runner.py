"""Evaluate a model on local benchmark files: generate, score with the toolkit's rules, write predictions, summarise.

    settings = EvalSettings(min_pixels=4 * 28 * 28, max_pixels=1280 * 28 * 28)
    summary = evaluate_benchmark(model, tok, "ocrbench", "/data/OCRBench", settings, "out/ocrbench.jsonl")

Items are read `SORT_WINDOW` batches at a time; within that window they are generated in length-sorted batches of
at most `batch_size` prompts and `token_budget` tokens (mindvl.infer.batching), so each batch's rows are alike in
length and the device decodes full batches. Predictions are written one JSON line per item as soon as its batch is
scored (flushed), so a crash loses at most one batch: a rerun with the same file reads the finished items back and
generates only the rest. A finished run rewrites the file in the benchmark's item order (the scores are per item,
so the order of generation never shows). The settings the predictions were made with are stored beside them
(`*.settings.json`); resuming with different settings is an error rather than a silent mix. A torn last line (a
crash mid-write) is dropped and its item redone.

Every row also carries `exact_match` (the stripped prediction equals one of the answers, case-sensitive): the
toolkits' rules are lenient in different ways (OCRBench counts an answer *contained* in the prediction), and exact
match is the plain measure a small model's progress is reported in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

from mindvl.data.template import DEFAULT_SYSTEM

from .benchmarks import BENCHMARKS, BenchItem
from .scorers import check_toolkit, prepare_prediction

# VLMEvalKit leaves the answer length to the model class; this is the budget used when neither side sets one.
FALLBACK_MAX_NEW_TOKENS = 128
# Items read (and length-sorted) at a time, in batches of `batch_size`: a larger window sorts better and holds more
# decoded images in memory.
SORT_WINDOW = 8


@dataclass
class EvalSettings:
    """How items are turned into model inputs. None pixel limits mean the model folder's (or Qwen2-VL's) own."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    toolkit: str = "lmms-eval"
    system: str | None = DEFAULT_SYSTEM  # the system turn the model was trained with (None: no system turn)
    batch_size: int = 8
    limit: int | None = None  # evaluate only the first `limit` items
    max_new_tokens: int | None = None  # None: the benchmark's own (lmms-eval task YAML), else 128

    def __post_init__(self) -> None:
        self.toolkit = check_toolkit(self.toolkit)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        lo, hi = self.min_pixels, self.max_pixels
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_pixels ({lo}) must not exceed max_pixels ({hi})")


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    return prediction.strip() in {a.strip() for a in answers}


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    """Cut the text at the first stop string, as the toolkits' `until` does."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


class NoItemsScored(ValueError):
    """No row of a benchmark's files became an item (wrong files for the benchmark, hidden-answer split, ...)."""


def no_items_message(bench, reader) -> str:
    """One line: the benchmark, the files, why every row was skipped and which columns the benchmark reads."""
    files = ", ".join(str(f) for f in reader.files[:3]) + (f" (+{len(reader.files) - 3} more)"
                                                             if len(reader.files) > 3 else "")
    reasons = ", ".join(f"{k}: {v}" for k, v in reader.skipped.items())
    why = f"all {reader.n_rows} rows skipped ({reasons})" if reader.n_rows else "the files hold no rows"
    return (f"{bench.name}: no item scored from {files}: {why}; {bench.title} expects the columns "
            f"{bench.expected_layout()}. Are these {bench.title} files (--bench {bench.name}=PATH)?")


# ---------------------------------------------------------------------------------------------- predictions file


def read_predictions(path: Path) -> list[dict[str, Any]]:
    """Finished rows of an earlier (possibly crashed) run; a torn last line is dropped from the file."""
    if not path.is_file():
        return []
    rows, good_bytes = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # only the last line can be torn: everything before it was flushed whole
            good_bytes += len(line)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return rows


def item_exact_matches(path: Path) -> list[float]:
    """Per-item exact match of one finished predictions file, in item-id order, so two models' files on the same
    benchmark pair item by item (the quickstart's merged-vs-SFT table, the ablation's paired comparisons)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["exact_match"] for r in sorted(rows, key=lambda r: str(r["id"]))]


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace the predictions file by `rows` (written beside it, then renamed: never half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)


def _check_settings(meta_path: Path, settings: dict[str, Any], resuming: bool) -> None:
    if resuming and meta_path.is_file():
        before = json.loads(meta_path.read_text())
        if before != settings:
            diff = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
            raise ValueError(f"{meta_path.parent}: the predictions there were made with other settings ({diff}); "
                             "write to another output folder or delete them")
    write_json(meta_path, settings)


# ----------------------------------------------------------------------------------------------------- evaluate


def _batches(items: Iterator[BenchItem], size: int) -> Iterator[list[BenchItem]]:
    while batch := list(islice(items, size)):
        yield batch


def evaluate_benchmark(model, tok, name: str, path: str | os.PathLike, settings: EvalSettings,
                       predictions: str | os.PathLike, pixel_defaults: tuple[int, int] | None = None,
                       progress=None, processing=None, token_budget: int | None = None) -> dict[str, Any]:
    """Generate and score every item of benchmark `name` at `path`; returns the toolkit's summary plus `n`,
    `exact_match`, `skipped` (bad rows by reason), the pixel limits and the patch size used. `progress(done,
    total)` is called after each batch when given. `processing` (mindvl.data.processors.VisionProcessing, the model
    folder's: `mindvl.infer.chat.folder_processing`) cuts the images; None: the model's tower family's.
    `token_budget` bounds a batch's prompt + vision + answer tokens (None: mindvl.infer.batching's default)."""
    from mindvl.data.image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PATCH_SIZE
    from mindvl.infer.batching import DEFAULT_TOKEN_BUDGET, generate_sorted
    from mindvl.infer.chat import conversation_prompt, process_images, stop_ids, user_message, vision_processing

    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})")
    bench = BENCHMARKS[name]
    if processing is None:
        processing = vision_processing(model)
    lo, hi = pixel_defaults or (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    lo = settings.min_pixels if settings.min_pixels is not None else lo
    hi = settings.max_pixels if settings.max_pixels is not None else hi
    if lo > hi:
        raise ValueError(f"min_pixels ({lo}) exceeds max_pixels ({hi})")
    gen = bench.generation(settings.toolkit)
    max_new = settings.max_new_tokens or gen.max_new_tokens or FALLBACK_MAX_NEW_TOKENS

    out = Path(predictions)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {**asdict(settings), "benchmark": name, "path": str(path), "min_pixels": lo, "max_pixels": hi,
              "max_new_tokens": max_new}
    rows = read_predictions(out)
    _check_settings(out.with_name(out.name + ".settings.json"), record, resuming=bool(rows))
    done = {r["id"] for r in rows}

    reader = bench.load(path, settings.toolkit)
    items = islice(reader, settings.limit) if settings.limit else reader
    total = min(filter(None, (reader.expected_rows, settings.limit)), default=None)
    stops = stop_ids(tok)
    order: dict[str, int] = {}  # item id -> its place in the benchmark, for the final rewrite

    def in_order(stream: Iterator[BenchItem]) -> Iterator[BenchItem]:
        for it in stream:
            order.setdefault(it.id, len(order))
            if it.id not in done:
                yield it

    with open(out, "a") as f:
        for window in _batches(in_order(items), settings.batch_size * SORT_WINDOW):
            prompts = []
            for item in window:
                pixels, grids = process_images(item.images, lo, hi, processing)
                message = user_message(item.prompt, len(item.images))
                prompts.append(conversation_prompt(tok, [message], pixels, grids, settings.system))

            def write(indices: list[int], outputs: list[list[int]], window: list[BenchItem] = window) -> None:
                for i, ids in zip(indices, outputs, strict=True):
                    item = window[i]
                    text = truncate_at_stop(tok.decode([t for t in ids if t not in stops], skip_special_tokens=True),
                                            gen.stop)
                    row = bench.score_item(text, item, settings.toolkit)
                    row["id"] = item.id
                    row["exact_match"] = float(exact_match(text, item.answers))
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    rows.append(row)
                f.flush()
                if progress is not None:
                    progress(len(rows), total)

            generate_sorted(model, prompts, max_new, token_budget=token_budget or DEFAULT_TOKEN_BUDGET,
                            max_batch=settings.batch_size, on_batch=write, stop_token_ids=stops)
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    _rewrite(out, rows)
    if not rows:  # every row skipped: a score over 0 items (nan) would read as a result
        raise NoItemsScored(no_items_message(bench, reader))
    summary = bench.summarise(rows, settings.toolkit)
    empty = prepare_prediction("", settings.toolkit)  # how the toolkit stores an empty generation
    summary.update(n=len(rows), exact_match=sum(r["exact_match"] for r in rows) / max(1, len(rows)),
                   headline=bench.headline(settings.toolkit), skipped=reader.skipped, min_pixels=lo, max_pixels=hi,
                   patch_size=processing.patch_size if processing is not None else PATCH_SIZE,
                   empty_answers=sum(not r["prediction"].strip() or r["prediction"] == empty for r in rows))
    return summary


def with_system(settings: EvalSettings, model_dir: str | os.PathLike, from_model: bool, log=print) -> EvalSettings:
    """`settings` with the system turn the model was trained with when `from_model` (see
    `mindvl.infer.chat.training_system`), else as given; logs which system prompt is used and why."""
    from mindvl.infer.chat import describe_system, training_system

    if from_model:
        system, source = training_system(model_dir)
        settings = replace(settings, system=system)
    else:
        source = "as given (--system / --no-system)"
    log(f"{model_dir}: system prompt {describe_system(settings.system)}: {source}")
    return settings


def evaluate(model_dir: str | os.PathLike, benches: dict[str, Path], out: str | os.PathLike,
             settings: EvalSettings, tokenizer: str | os.PathLike | None = None, device: str | None = None,
             log=print, system_from_model: bool = False) -> dict[str, dict[str, Any]]:
    """`mindvl eval`: every benchmark of `benches` for one model folder; writes OUT/<bench>/predictions.jsonl,
    OUT/summary.json and OUT/summary.md; returns {bench: summary}. `system_from_model`: use the system turn the
    model was trained with (its run's recipe or its chat template) instead of `settings.system`."""
    from mindvl.infer.chat import folder_processing, load_for_chat, pixel_limits
    from mindvl.progress import Progress

    settings = with_system(settings, model_dir, system_from_model, log)
    model, tok = load_for_chat(model_dir, tokenizer, device)
    processing = folder_processing(model_dir, model)  # the folder's processor (16-px patches for Qwen3-VL)
    out = Path(out)
    summaries = {}
    for name, path in benches.items():
        with Progress(f"eval {name}", unit="items") as bar:
            summary = evaluate_benchmark(model, tok, name, path, settings, out / name / "predictions.jsonl",
                                         pixel_limits(model_dir, processing), processing=processing,
                                         progress=lambda done, total: bar.update(done, total))
        summaries[name] = summary
        empty = f" ({summary['empty_answers']} of them answered with nothing)" if summary["empty_answers"] else ""
        log(f"{name}: {summary['headline']} = {summary[summary['headline']]:.4g}, exact match "
            f"{summary['exact_match']:.1%} over {summary['n']} items{empty}")
    write_json(out / "summary.json", {"model": str(model_dir), "settings": asdict(settings), "results": summaries})
    (out / "summary.md").write_text(summary_table({str(model_dir): summaries}))
    return summaries


def summary_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one row per model, one column per benchmark's headline metric (and its exact match)."""
    benches = sorted({b for per in results.values() for b in per})
    head = "| model | " + " | ".join(f"{b} ({_headline(results, b)}) | {b} exact" for b in benches) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(benches))]
    for model, per in results.items():
        cells = []
        for b in benches:
            s = per.get(b)
            cells += [f"{s[s['headline']]:.4g}", f"{s['exact_match']:.1%}"] if s else ["", ""]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _headline(results: dict[str, dict[str, dict[str, Any]]], bench: str) -> str:
    return next(per[bench]["headline"] for per in results.values() if bench in per)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    os.replace(tmp, path)
