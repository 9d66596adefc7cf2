"""`mindvl data plan RECIPE`: what a recipe's mixture means over its phase's token budget, and how it differs from
the paper's tables (seed 002, appendix B: Table 11 warm-up, Table 12 interleaved, the multitask instruction table,
Table 13 text, the SFT table; stored verbatim in mindvl/assets/paper_tables/*.csv).

For each source: its share of the mixture's draws (ratio / sum of ratios), the tokens it contributes over the
budget, its share of those tokens that are vision tokens, and the epochs of it the budget implies. Tokens per
sample are measured on the local files when they exist (the first `probe` records, through the same parse and
tokenize path as training; images and videos are sized from their headers, nothing is decoded); a source without
local files takes the mean of the measured ones (all equal when none is local, so tokens follow the draw shares;
the plan says so). The number of records of a local JSONL file is its count of non-blank lines; of a tar shard its
count of keys.

Comparison with the paper: each source is matched by name to the paper's table rows and its share set beside the
published percentage (for the multitask phase, whose three tables each sum to 100%, renormalised over each
table's sources); category subtotals beside the published
subtotals (Table 11). Rows of the paper that the recipe lacks, and recipe sources that no table names, are listed.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import DataConfig
from .image import ImageError
from .schema import BadSample
from .template import MERGE_UNIT

PAPER_TABLES = Path(__file__).resolve().parent.parent / "assets" / "paper_tables"
# Which of the paper's tables describe each phase (recipe `phase.name`), and the phase budgets in tokens.
PHASE_TABLES = {
    "warmup": ("warmup",),
    "multitask": ("multitask-interleaved", "multitask-instruction", "multitask-text"),
    "sft": ("sft",),
}
PAPER_BUDGETS = {"warmup": 256_000_000_000, "multitask": 179_000_000_000, "sft": 12_000_000_000}


@dataclass
class PaperRow:
    table: str
    category: str
    dataset: str
    count: int
    percent: float
    decimals: int  # as published


def paper_rows(table: str) -> list[PaperRow]:
    with open(PAPER_TABLES / f"{table}.csv", newline="") as f:
        return [PaperRow(table, r["category"], r["dataset"], int(r["count"]), float(r["percent"]),
                         len(r["percent"].partition(".")[2])) for r in csv.DictReader(f)]


def paper_subtotals(table: str) -> dict[str, float]:
    path = PAPER_TABLES / f"{table}-subtotals.csv"
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        return {r["category"]: float(r["percent"]) for r in csv.DictReader(f) if r["category"] != "Total"}


@dataclass
class SourcePlan:
    name: str
    category: str
    ratio: float
    share: float = 0.0  # % of the mixture's draws
    local_records: int | None = None  # None: no local files
    tokens_per_sample: float | None = None  # measured (None: not measured)
    vision_per_sample: float | None = None
    tokens: float = 0.0  # over the budget
    samples: float = 0.0
    epochs: float | None = None
    paper_percent: float | None = None
    plan_percent: float | None = None  # share renormalised within the matched paper table
    table: str | None = None
    skipped: dict[str, int] = field(default_factory=dict)


def _local_files(paths: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in paths:
        pattern = os.path.expanduser(pattern)
        matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files.extend(m for m in matched if os.path.isfile(m))
    return files


def _count_records(path: str) -> int:
    if path.endswith(".tar"):
        keys = set()
        with tarfile.open(path) as tf:
            for m in tf:
                if m.isfile():
                    base = os.path.basename(m.name).partition(".")[0]
                    keys.add(os.path.join(os.path.dirname(m.name), base))
        return len(keys)
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _probe(files: list[str], cfg: DataConfig, source: int, probe: int, tok) -> tuple[float, float, dict[str, int]]:
    """Mean tokens and vision tokens per sample over the first `probe` usable records (images sized from headers)."""
    from PIL import Image

    from mindvl.untrusted import TooLargeError, UntrustedInputError, open_regular

    from .captions import caption_sample, prompt_set
    from .processors import grid_for_image, video_layout_qwen3
    from .sources import SourceReader, item_to_conversation, resolve_files
    from .template import encode_conversation, encode_document
    from .video import VideoError, video_grid, video_settings

    src = cfg.sources[source]
    reader = SourceReader(src, source, resolve_files(files, src.format, src.name), 0, 1, cfg.seed, max_epochs=1,
                          max_record_bytes=cfg.record_byte_limit(), max_media_bytes=cfg.max_image_bytes)
    lo, hi = cfg.pixels_for(source)
    processing = cfg.vision_processing()
    qwen3 = processing.family == "qwen3_vl"
    tokens = vision = n = 0
    skipped: dict[str, int] = {}
    while n < probe:
        item = reader.next()
        if item is None:
            break
        try:
            if isinstance(item, BadSample):
                raise item
            conv = item_to_conversation(item)
            if conv.kind == "caption":
                conv = caption_sample(conv, prompt_set(src.caption_prompts), cfg.seed)
            grids = []
            for img in conv.images:
                try:
                    fp = io.BytesIO(img.data) if img.data is not None else open_regular(
                        img.name, cfg.max_image_bytes, "image", "data.max_image_bytes")
                    with fp, Image.open(fp) as im:
                        grids.append(grid_for_image(im.height, im.width, processing, lo, hi))
                except TooLargeError as exc:
                    raise BadSample("image_too_large", conv.where, str(exc)) from exc
                except UntrustedInputError as exc:
                    raise BadSample("missing_image", conv.where, str(exc)) from exc
                except OSError as exc:
                    raise BadSample("corrupt_image", conv.where, str(exc)) from exc
                except ImageError as exc:
                    raise BadSample(exc.reason, conv.where, str(exc)) from exc
            settings = video_settings(cfg.video)
            stamps = None
            try:
                if qwen3:
                    layouts = [video_layout_qwen3(v.data if v.data is not None else v.name, processing,
                                                  cfg.video.fps, cfg.video.max_decoded_frames,
                                                  cfg.video.max_video_bytes) for v in conv.videos]
                    vgrids, stamps = [g for g, _ in layouts], [t for _, t in layouts]
                else:
                    vgrids = [video_grid(v.data if v.data is not None else v.name, settings) for v in conv.videos]
            except VideoError as exc:
                raise BadSample(exc.reason, conv.where, str(exc)) from exc
            if conv.kind == "document":
                enc = encode_document(tok, conv.text, grids, max_tokens=cfg.seq_len)
            else:
                enc = encode_conversation(tok, conv.messages, grids, cfg.default_system, cfg.train_on_prompt, vgrids,
                                          max_tokens=cfg.seq_len, video_timestamps=stamps)
        except BadSample as bad:
            skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
            continue
        tokens += min(len(enc.input_ids), cfg.seq_len)
        vision += sum(t * h * w // MERGE_UNIT for t, h, w in [*grids, *vgrids])
        n += 1
    if n == 0:
        return 0.0, 0.0, skipped
    return tokens / n, vision / n, skipped


def _phase(recipe: dict) -> str:
    phase = (recipe.get("phase") or {}).get("name", "")
    return str(phase)


def _model_folder_processor(raw: dict, path: str):
    """The processor config of the recipe's `model.init_from` (or `model.compose.vision`) folder, when it has one
    (relative paths are the recipe file's); None otherwise (Qwen2-VL's, or the model's at train time)."""
    from .processors import folder_spec

    model = raw.get("model") or {}
    folder = model.get("init_from") or (model.get("compose") or {}).get("vision")
    if not isinstance(folder, str):
        return None
    full = Path(folder) if Path(folder).is_absolute() else Path(path).parent / folder
    return folder_spec(full)


def plan_recipe(raw: dict, path: str = "<recipe>", probe: int = 200, tokenizer: Any = None) -> dict:
    """The plan of a recipe (its YAML as a dict; `path` names it in messages) as a JSON-able dict."""
    if not isinstance(raw, dict) or "data" not in raw:
        raise ValueError(f"{path}: the recipe has no `data:` section")
    cfg = DataConfig.from_dict(raw["data"], "data")
    if cfg.processor is None:  # the processor of the folder the model starts from, as the trainer chooses it
        cfg.processor = _model_folder_processor(raw, path)
    phase = _phase(raw)
    budget, budget_source = recipe_budget(raw, cfg.seq_len)
    if budget is None:
        budget = PAPER_BUDGETS.get(phase, 0)
        if budget <= 0:
            raise ValueError(f"{path}: neither budget.max_tokens nor budget.max_steps is set and phase {phase!r} "
                             "has no paper budget")
    total_ratio = sum(s.ratio for s in cfg.sources)
    plans = [SourcePlan(s.name, s.category, s.ratio, 100 * s.ratio / total_ratio) for s in cfg.sources]
    tok = None
    for i, (s, p) in enumerate(zip(cfg.sources, plans, strict=True)):
        files = _local_files(s.paths) if s.paths else []
        if not files:
            continue
        p.local_records = sum(_count_records(f) for f in files)
        if tok is None:
            from .tokenizer import TextTokenizer, load_tokenizer

            tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer or cfg.tokenizer)
        p.tokens_per_sample, p.vision_per_sample, p.skipped = _probe(files, cfg, i, probe, tok)
    measured = [p.tokens_per_sample for p in plans if p.tokens_per_sample]
    assumed = not measured or len(measured) < len(plans)
    # Sources without a measurement take the mean of the measured ones (or 1: tokens follow the draw shares).
    default_tps = sum(measured) / len(measured) if measured else 1.0
    weights = [p.share * (p.tokens_per_sample or default_tps) for p in plans]
    for p, w in zip(plans, weights, strict=True):
        p.tokens = budget * w / sum(weights)
        p.samples = p.tokens / (p.tokens_per_sample or default_tps) if measured else 0.0
        if p.local_records and p.tokens_per_sample:
            p.epochs = p.samples / p.local_records

    # Against the paper's tables.
    comparison: list[dict] = []
    rows = [r for t in PHASE_TABLES.get(phase, ()) for r in paper_rows(t)]
    by_name = {r.dataset: r for r in rows}
    tables = PHASE_TABLES.get(phase, ())
    for t in tables:
        matched = [p for p in plans if p.name in by_name and by_name[p.name].table == t]
        # One table for the phase: its percentages are of the whole phase (a source the table does not name, such
        # as Table 11's unattributed remainder, still counts). Several: each is renormalised over its own sources.
        within = 100.0 if len(tables) == 1 else sum(p.share for p in matched)
        for p in matched:
            r = by_name[p.name]
            p.table, p.paper_percent = t, r.percent
            p.plan_percent = 100 * p.share / within if within else 0.0
            if round(p.plan_percent, r.decimals) != round(r.percent, r.decimals):
                comparison.append({"table": t, "dataset": p.name, "paper": r.percent,
                                   "plan": round(p.plan_percent, r.decimals + 2)})
    names = {p.name for p in plans}
    # A recipe none of whose sources is a dataset of the phase's tables (the tiny recipes' synthetic data) is not a
    # version of the paper's mixture: listing all of the paper's rows as "missing" would say nothing about it.
    paper_recipe = bool(names & set(by_name))
    missing = [f"{r.table}: {r.dataset}" for r in rows if r.dataset not in names] if paper_recipe else []
    extra = [p.name for p in plans if p.name not in by_name] if paper_recipe else []

    categories: dict[str, dict[str, float]] = {}
    for p in plans:
        c = categories.setdefault(p.category or "(none)", {"share": 0.0, "tokens": 0.0})
        c["share"] += p.share
        c["tokens"] += p.tokens
    subtotal_diffs = []
    for t in PHASE_TABLES.get(phase, ()) if paper_recipe else ():
        for cat, pct in paper_subtotals(t).items():
            got = categories.get(cat, {}).get("share", 0.0)
            if round(got, 2) != round(pct, 2):
                subtotal_diffs.append({"category": cat, "paper": pct, "plan": round(got, 2),
                                       "paper_rows_sum": round(sum(r.percent for r in rows if r.category == cat), 2)})
    vision_known = [p for p in plans if p.vision_per_sample is not None and p.tokens_per_sample]
    vision_share = None
    if vision_known:
        tok_sum = sum(p.tokens for p in vision_known)
        vision_share = 100 * sum(p.tokens * p.vision_per_sample / p.tokens_per_sample for p in vision_known) / tok_sum
    return {
        "recipe": str(path), "phase": phase, "budget_tokens": budget, "budget_from_recipe": budget_source is not None,
        "budget_source": budget_source, "paper_recipe": paper_recipe,
        "paper_budget_tokens": PAPER_BUDGETS.get(phase),
        "tokens_assumed_equal_per_sample": assumed,
        "vision_token_share": vision_share,
        "sources": [p.__dict__ for p in plans],
        "categories": {k: {"share": v["share"], "tokens": v["tokens"]} for k, v in categories.items()},
        "differences": {"percent": comparison, "subtotals": subtotal_diffs, "missing_from_recipe": missing,
                        "not_in_paper": extra},
    }


def recipe_budget(raw: dict, seq_len: int) -> tuple[int | None, str | None]:
    """(tokens, how they were counted) of the recipe's own budget: `budget.max_tokens`, or `budget.max_steps` x
    `batch.global_batch_size` x `data.seq_len` (packed slots: an upper bound on the tokens the steps see; the
    trainer's own conversion the other way); (None, None) when it sets neither."""
    budget = raw.get("budget") or {}
    if budget.get("max_tokens"):
        return int(budget["max_tokens"]), "budget.max_tokens"
    if budget.get("max_steps"):
        steps, batch = int(budget["max_steps"]), int((raw.get("batch") or {}).get("global_batch_size", 1))
        return steps * batch * seq_len, (f"budget.max_steps {steps} x batch.global_batch_size {batch} x "
                                         f"data.seq_len {seq_len}, packed slots")
    return None, None


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_plan(plan: dict) -> str:
    out = io.StringIO()
    w = out.write
    w(f"recipe {plan['recipe']}  phase {plan['phase'] or '?'}  budget {_tokens(plan['budget_tokens'])} tokens")
    paper_recipe = plan.get("paper_recipe", True)
    if not plan["budget_from_recipe"]:
        w(" (the recipe sets no budget: the paper's budget for this phase)")
    elif plan.get("budget_source") and plan["budget_source"] != "budget.max_tokens":
        w(f" ({plan['budget_source']})")
    if plan["budget_from_recipe"] and paper_recipe and plan["paper_budget_tokens"] and \
            plan["paper_budget_tokens"] != plan["budget_tokens"]:
        w(f" (paper: {_tokens(plan['paper_budget_tokens'])})")
    w("\n")
    if plan["tokens_assumed_equal_per_sample"]:
        w("note: sources without local files are assumed to have the mean sample length of the measured ones "
          "(all equal when none is local): their tokens follow the draw shares\n")
    vs = plan["vision_token_share"]
    w(f"vision tokens: {'n/a (no local files)' if vs is None else f'{vs:.1f}% of the measured tokens'}\n\n")
    w(f"{'source':<40} {'category':<14} {'share %':>9} {'paper %':>9} {'tokens':>9} {'tok/smp':>8} {'vis %':>6} "
      f"{'records':>10} {'epochs':>7}\n")
    for s in plan["sources"]:
        paper = "" if s["paper_percent"] is None else f"{s['paper_percent']:.4g}"
        tps = "" if s["tokens_per_sample"] is None else f"{s['tokens_per_sample']:.0f}"
        vis = "" if not s["tokens_per_sample"] else f"{100 * s['vision_per_sample'] / s['tokens_per_sample']:.0f}"
        recs = "" if s["local_records"] is None else str(s["local_records"])
        ep = "" if s["epochs"] is None else f"{s['epochs']:.2f}"
        w(f"{s['name'][:40]:<40} {s['category'][:14]:<14} {s['share']:>9.4f} {paper:>9} {_tokens(s['tokens']):>9} "
          f"{tps:>8} {vis:>6} {recs:>10} {ep:>7}\n")
    w("\ncategory subtotals\n")
    for name, c in plan["categories"].items():
        w(f"  {name:<24} {c['share']:>8.2f}%  {_tokens(c['tokens']):>9} tokens\n")
    d = plan["differences"]
    w("\ndifferences from the paper's tables\n")
    if not paper_recipe:
        w(f"  not compared: none of the recipe's sources is a dataset of the paper's {plan['phase'] or '?'} "
          "tables (not a paper recipe)\n" if PHASE_TABLES.get(plan["phase"]) else
          f"  not compared: the paper has no data table for phase {plan['phase'] or '?'}\n")
        return out.getvalue()
    if not any(d.values()):
        w("  none: every dataset percentage and category subtotal equals the published one\n")
    for c in d["percent"]:
        w(f"  {c['table']}: {c['dataset']}: plan {c['plan']}% vs paper {c['paper']}%\n")
    for c in d["subtotals"]:
        w(f"  subtotal {c['category']}: plan {c['plan']:.2f}% vs paper {c['paper']:.2f}% (the paper's own rows add "
          f"up to {c['paper_rows_sum']:.2f}%)\n")
    if d["missing_from_recipe"]:
        w(f"  in the paper, not in the recipe ({len(d['missing_from_recipe'])}): "
          f"{', '.join(d['missing_from_recipe'][:10])}{' ...' if len(d['missing_from_recipe']) > 10 else ''}\n")
    if d["not_in_paper"]:
        w(f"  in the recipe, not in the paper's tables: {', '.join(d['not_in_paper'])}\n")
    return out.getvalue()


def plan_json(plan: dict) -> str:
    return json.dumps(plan, indent=1)
