"""Run the ablation: per seed, train the stages the chosen claims need, make the merges, evaluate every model, then
hand the per-seed results to `mindvl.ablate.analysis` and `mindvl.ablate.report`.

    summary = run_ablation(["merge", "phases"], seeds=4, out="runs/ablate", scale="tiny")

Layout under OUT (every piece is reused by a rerun, so an interrupted ablation resumes where it stopped):

    bench/                     held-out synthetic OCRBench / ChartQA / DocVQA (the quickstart's), shared by all seeds
    synth/                     the synthetic training sets (seed-independent), generated once
    tower/seed<t>/             the pretrained vision tower's chain (plan.TOWER_FROM at seed t) and tower.json (what
                               it reads), trained once before any seed
    seed<s>/start              `text` with the pretrained tower transplanted in: where the warm-up starts
    seed<s>/<stage>/           one training run each (quickstart.run_phase: phase.json once finished, else resume)
    seed<s>/merged, lm-merged  the merges
    seed<s>/eval/<model>/...   per-item predictions (resumable), text/<task>.jsonl for the text probe
    seed<s>/results.json       that seed's scores, once all of it is done
    ablation.json, report.md, *.png

The building blocks are the quickstart's (`run_phase`, `sft_overrides`, `eval_settings`, `write_benchmarks`) and
mindvl's merge and resolution search, so the ablation measures exactly the pipeline the quickstart runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mindvl.quickstart import DEFAULT_SETTING, PX, eval_settings, recipe_dir, run_phase, write_benchmarks

from .plan import (
    CLAIMS,
    MERGES,
    RUN_ORDER,
    SCALES,
    STAGES,
    TOWER,
    TOWER_FROM,
    TOWER_SEED,
    Scale,
    labels_for,
    stages_for,
)
from .text_eval import TEXT_TASK, evaluate_text

RESULTS = "results.json"
TOWER_INFO = "tower.json"  # under OUT/tower/seed<t>: prepare_tower's record of the tower it made
TRAINING_LIMITS = [(4 * PX, 64 * PX)]  # DEFAULT_SETTING: the training recipes' own (min_pixels, max_pixels)


def seed_overrides(seed: int) -> list[str]:
    """What a seed changes: the training seed, the model's init seed and the data order."""
    return [f"seed={seed}", f"model.init_seed={seed}", f"data.seed={seed}"]


def check_request(claims: list[str], seeds: int, scale: str | Scale, verdicts: bool) -> None:
    if not isinstance(scale, Scale) and scale not in SCALES:
        raise ValueError(f"--scale {scale!r}: choose from {', '.join(SCALES)}")
    if seeds < 1:
        raise ValueError(f"--seeds {seeds}: must be >= 1")
    if verdicts and seeds < 2:
        raise ValueError(f"--seeds {seeds}: a verdict needs at least 2 seeds (intervals are over paired seeds); "
                         "give --seeds 2 or more, or --no-verdict for a one-seed trial")


def run_ablation(claims: list[str], seeds: int, out: str | Path, scale: str | Scale = "tiny",
                 recipes: str | Path | None = None, overrides: list[str] | None = None, verdicts: bool = True,
                 log=print, report_only: bool = False, jobs: int = 1, vision: str = "trained",
                 tower_seed: int | None = None) -> dict[str, Any]:
    """Train, merge and evaluate seeds 0..seeds-1 for `claims`, then write OUT/report.md, PNGs and ablation.json;
    returns the analysis (see mindvl.ablate.analysis.analyse). `scale` names one of SCALES or is a Scale.

    `vision`: where every seed's vision tower starts. `trained` (default): a pretrained tower, the paper's set-up,
    trained here once at `tower_seed` (default plan.TOWER_SEED; see `prepare_tower`); `random`: each seed's own
    seeded init (the records before session 11); else a mindvl model folder whose `visual.*` is transplanted.

    `jobs` > 1: that many seeds at once, each in its own process with cores / jobs threads (a tiny model gains
    little from a second thread: 1.35x measured, so two one-thread seeds use two cores better than one two-thread
    seed); the synthetic sets are generated first, once.

    `report_only`: train nothing; report the claims that enough seeds (2, or 1 without verdicts) have finished so far
    (e.g. while a long ablation is still running in another process)."""
    check_request(claims, seeds, scale, verdicts)
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: must be >= 1")
    if vision not in ("trained", "random") and not (Path(vision) / "config.json").is_file():
        raise ValueError(f"--vision-tower {vision}: not a mindvl model folder (no config.json there); give one, or "
                         "trained or random")
    out = Path(out)
    recipes = Path(recipes) if recipes else recipe_dir()
    overrides = list(overrides or [])
    sc = scale if isinstance(scale, Scale) else SCALES[scale]
    start = time.perf_counter()
    config = {"claims": claims, "seeds": seeds, "scale": scale if isinstance(scale, str) else "custom",
              "steps": sc.steps, "bench_items": sc.bench_items, "grid": sc.grid, "overrides": overrides,
              "recipes": str(recipes), "report_only": report_only}
    if report_only:
        files = [out / f"seed{seed}" / RESULTS for seed in range(seeds)]
        per_seed = [json.loads(p.read_text()) for p in files if p.is_file()]
        need = 2 if verdicts else 1
        ready = [c for c in claims if sum(c in s["claims"] for s in per_seed) >= need]
        if not ready:
            raise ValueError(f"{out}: no claim of {', '.join(claims)} is finished by {need} seed(s) yet; nothing to "
                             "report")
        # The runs may have used another budget than the one named now: report what they were trained with.
        trained = {name: t["steps"] for s in per_seed for name, t in s["training"].items()}
        config.update(scale="as trained", steps=trained, vision=_vision_of(per_seed[0]))
        return _finish(ready, per_seed, verdicts, out, config, start, log)
    benches = _benchmarks(out / "bench", sc.bench_items)
    config["jobs"] = jobs
    parallel = jobs > 1 and seeds > 1
    if parallel:
        prepare_synth(claims, out, recipes, sc, overrides, log)  # once, not raced by every worker
    # The tower's chain keeps its own recipes and budget: the overrides are the ablation's, for the seeds' runs
    # (`max_steps=40` would starve the tower under its reading gate, found only after its whole chain had trained).
    tower = prepare_tower(vision, TOWER_SEED if tower_seed is None else tower_seed, out, recipes, sc, benches, log)
    config["vision"] = tower or "random"
    tower_final = Path(tower["final"]) if tower else None
    if parallel:
        per_seed = _run_seeds_parallel(claims, seeds, out, recipes, sc, overrides, benches, jobs, tower_final, log)
        return _finish(claims, per_seed, verdicts, out, config, start, log)
    per_seed = []
    for seed in range(seeds):
        t0 = time.perf_counter()
        log(f"--- seed {seed} ---")
        per_seed.append(run_seed(claims, seed, out, recipes, sc, overrides, benches, log, tower_final))
        log(f"seed {seed} done in {time.perf_counter() - t0:.0f} s")
    return _finish(claims, per_seed, verdicts, out, config, start, log)


def _vision_of(seed_result: dict[str, Any]) -> str | dict[str, Any]:
    """The tower a finished seed started from (its budget's `vision`), described as prepare_tower describes it."""
    vision = seed_result["budget"].get("vision", "random")
    return vision if vision == "random" else tower_record(Path(vision))


def tower_record(final: Path) -> dict[str, Any]:
    """What is known of the model folder `final` whose tower the seeds take: prepare_tower's tower.json where it
    made that folder (OUT/tower/seed<t>/<TOWER_FROM>/final), else only where it is."""
    info = final.parent.parent / TOWER_INFO
    if info.is_file():
        record = json.loads(info.read_text())
        if Path(record["final"]).resolve() == final.resolve():
            return record
    return {"source": str(final), "final": str(final)}


def _seed_worker(threads: int, claims: list[str], seed: int, out: Path, recipes: Path, sc: Scale,
                 overrides: list[str], benches: dict[str, Path], tower: Path | None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    result = run_seed(claims, seed, out, recipes, sc, overrides, benches,
                      lambda line: print(f"[seed {seed}] {line}", flush=True), tower)
    print(f"[seed {seed}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return result


def _run_seeds_parallel(claims: list[str], seeds: int, out: Path, recipes: Path, sc: Scale, overrides: list[str],
                        benches: dict[str, Path], jobs: int, tower: Path | None, log) -> list[dict[str, Any]]:
    """Seeds in `jobs` spawned processes (the synthetic sets and the tower made beforehand); results in seed
    order."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    from mindvl.children import spawn_context

    threads = max(1, (os.cpu_count() or 1) // jobs)
    log(f"--- seeds 0..{seeds - 1}, {jobs} at a time, {threads} thread(s) each ---")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn_context()) as pool:
        futures = [pool.submit(_seed_worker, threads, claims, seed, out, recipes, sc, overrides, benches, tower)
                   for seed in range(seeds)]
        return [f.result() for f in futures]


def prepare_synth(claims: list[str], out: Path, recipes: Path, sc: Scale, overrides: list[str], log=print) -> None:
    """Generate every synthetic set the claims' stages read (they are seed-independent) into OUT/synth."""
    from mindvl.config import load_recipe
    from mindvl.data import DataConfig
    from mindvl.data.synth import ensure_synth

    for name in stages_for(labels_for(claims)):
        stage = STAGES[name]
        cfg = load_recipe(recipes / stage.recipe, [*stage.extra, f"max_steps={sc.steps[stage.recipe]}", *overrides])
        for source in DataConfig.from_dict(cfg.data).sources:
            if source.synth is not None:
                ensure_synth(out / "synth", list(source.synth.tasks), source.synth.n, source.synth.seed)
    log(f"synthetic sets ready under {out / 'synth'}")


def _finish(claims: list[str], per_seed: list[dict[str, Any]], verdicts: bool, out: Path, config: dict[str, Any],
            start: float, log) -> dict[str, Any]:
    from mindvl.eval.runner import write_json

    from .analysis import analyse
    from .report import write_report

    for s in per_seed:  # single packs are noisy: the report compares the first and last tenth of each run
        for t in s["training"].values():
            t["loss_start"], t["loss_end"] = loss_ends(Path(t["final"]).parent / "metrics.jsonl")
    analysis = analyse(claims, per_seed, verdicts)
    analysis["config"] = {**config, "claims": claims}
    analysis["seconds"] = round(time.perf_counter() - start, 1)
    write_json(out / "ablation.json", analysis)
    report = write_report(out, analysis)
    log(f"ablation done in {analysis['seconds']} s; report: {report}")
    return analysis


def loss_ends(metrics: Path) -> tuple[float, float]:
    """Mean loss over the first and over the last tenth of a run's logged steps (at least one step each)."""
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if line.strip()]
    k = max(1, len(losses) // 10)
    return sum(losses[:k]) / k, sum(losses[-k:]) / k


def _benchmarks(folder: Path, n: int) -> dict[str, Path]:
    """The quickstart's held-out benchmark files, written once (a rerun must see the very same items)."""
    from mindvl.eval.runner import write_json

    marker = folder / "items.json"
    if marker.is_file() and json.loads(marker.read_text()).get("n") == n:
        return {name: folder / name for name in json.loads(marker.read_text())["benchmarks"]}
    benches = write_benchmarks(folder, n)
    write_json(marker, {"n": n, "benchmarks": list(benches)})
    return benches


def train_stages(names: list[str], root: Path, seed: int, steps: dict[str, int], recipes: Path, cache: Path,
                 overrides: list[str], models: dict[str, Path], log=print) -> dict[str, Any]:
    """Train the stages `names` (parents first) that `models` lacks into ROOT/<stage> at `seed`, each from its
    parent's final weights; a parent that is a merge (`start`) is made when first needed. Adds each final folder to
    `models`; returns {stage: its run_phase summary, less the recipe}."""
    training: dict[str, Any] = {}
    for name in [n for n in names if n not in models]:
        stage = STAGES[name]
        if stage.parent in MERGES and stage.parent not in models:
            models[stage.parent] = make_merge(stage.parent, root, models, log)
        parent = models[stage.parent] if stage.parent else None
        extra = [*stage.extra, f"max_steps={steps[stage.recipe]}", *seed_overrides(seed), *overrides]
        summary = run_phase(name, recipes / stage.recipe, root, cache, parent, extra, log)
        training[name] = {k: v for k, v in summary.items() if k != "recipe"}
        models[name] = Path(summary["final"])
    return training


def prepare_tower(vision: str, seed: int, out: Path, recipes: Path, sc: Scale, benches: dict[str, Path],
                  log=print) -> dict[str, Any] | None:
    """The pretrained vision tower every seed starts from (None for `random`): for `trained`, plan.TOWER_FROM's
    chain at `seed` with `sc.tower_steps` and the recipes as they are (no key=value override of the ablation reaches
    it: they are the seeds'), trained once under OUT/tower/seed<seed> (a rerun reuses it, a changed budget is refused
    by run_phase), then its ChartQA and DocVQA exact match at the training resolution, which must reach
    `sc.tower_reads`; else `vision` names a mindvl model folder. Returns what OUT/tower/.../tower.json holds."""
    from mindvl.eval.runner import write_json

    if vision == "random":
        return None
    if vision != "trained":  # a model folder (run_ablation checked it is one)
        return tower_record(Path(vision))
    root = out / "tower" / f"seed{seed}"
    models: dict[str, Path] = {}  # no TOWER here: the chain's own tower starts seeded random
    log(f"--- pretrained vision tower: {TOWER_FROM} chain at seed {seed} under {root} ---")
    training = train_stages(stages_for([TOWER_FROM]), root, seed, sc.tower_steps, recipes, out / "synth", [],
                            models, log)
    final = models[TOWER_FROM]
    reads = _reads_pages(final, root / "eval", benches)
    info = {"source": "trained", "seed": seed, "stage": TOWER_FROM, "steps": sc.tower_steps, "final": str(final),
            "reads": reads, "training": training}
    write_json(root / TOWER_INFO, info)
    log(f"tower: ChartQA {reads['chartqa']:.1%}, DocVQA {reads['docvqa']:.1%} at the training resolution")
    if min(reads.values()) < sc.tower_reads:
        raise ValueError(f"{root}: the pretrained tower's chain reads ChartQA {reads['chartqa']:.1%} and DocVQA "
                         f"{reads['docvqa']:.1%}, under the {sc.tower_reads:.0%} it must reach; give another "
                         "--tower-seed (its chain trains anew), or --vision-tower random")
    return info


def _reads_pages(model: Path, out: Path, benches: dict[str, Path]) -> dict[str, float]:
    """`model`'s ChartQA and DocVQA exact match at the training resolution."""
    from mindvl.eval.resolution_search import search_resolution
    from mindvl.eval.runner import item_exact_matches

    pages = {b: benches[b] for b in ("chartqa", "docvqa")}
    search_resolution({TOWER: model}, pages, TRAINING_LIMITS, out, eval_settings(), device="cpu",
                      log=lambda line: None)
    items = {b: item_exact_matches(out / TOWER / b / f"{DEFAULT_SETTING}.jsonl") for b in pages}
    return {b: round(sum(v) / len(v), 4) for b, v in items.items()}


def run_seed(claims: list[str], seed: int, out: Path, recipes: Path, sc: Scale, overrides: list[str],
             benches: dict[str, Path], log=print, tower: Path | None = None) -> dict[str, Any]:
    """One seed's training, merges and evaluations; returns (and stores as seed<s>/results.json) its scores.
    `tower`: the pretrained model whose vision tower `start` takes (None: `text`'s own seeded tower).

    Claims are worked through cheapest first and results.json is rewritten after each, so a seed stopped part-way
    already holds the finished claims' numbers (and a rerun picks up from there)."""
    from mindvl.eval.runner import write_json

    root = out / f"seed{seed}"
    done = root / RESULTS
    budget = {"steps": sc.steps, "bench_items": sc.bench_items, "grid": sc.grid, "overrides": overrides,
              "recipes": str(recipes), "vision": str(tower) if tower else "random"}
    result: dict[str, Any] = {"seed": seed, "budget": budget, "claims": [], "models": {}, "training": {},
                              "scores": {}, "eval_seconds": 0.0}
    if done.is_file():
        result = json.loads(done.read_text())
        result.setdefault("budget", budget).setdefault("vision", "random")  # written before the pretrained tower
        if result["budget"] != budget:
            keys = sorted(k for k in budget if result["budget"].get(k) != budget[k])
            raise ValueError(f"{done} was made with another budget (differs in {', '.join(keys)}); write to another "
                             "--out or delete it")
        if set(claims) <= set(result["claims"]):
            log(f"seed {seed}: reused {done}")
            return result
    models = {label: Path(path) for label, path in result["models"].items()}
    if tower is not None:
        models[TOWER] = tower
    for claim in sorted(claims, key=RUN_ORDER.index):
        if claim in result["claims"]:
            continue
        labels = labels_for([claim])
        result["training"].update(train_stages(stages_for(labels), root, seed, sc.steps, recipes, out / "synth",
                                               overrides, models, log))
        for name in [m for m in MERGES if m in labels]:
            models[name] = make_merge(name, root, models, log)
        t0 = time.perf_counter()
        scores = evaluate_models({label: models[label] for label in labels}, [claim], root / "eval", benches, sc,
                                 log)
        for label, per in scores.items():
            result["scores"].setdefault(label, {}).update(per)
        result["eval_seconds"] = round(result["eval_seconds"] + time.perf_counter() - t0, 1)
        result["models"] = {label: str(path) for label, path in models.items() if label != TOWER}
        result["claims"].append(claim)
        write_json(done, result)
    return result


def make_merge(name: str, root: Path, models: dict[str, Path], log=print) -> Path:
    """`start` (text with the pretrained tower; `text` itself when there is none), `merged` (the SFT average) or
    `lm-merged` (the 4K SFT model's language model averaged with the base LLM); an existing merge is reused (merges
    are written atomically, so a folder there is complete)."""
    from mindvl.checkpoint.merge import merge_checkpoints, transplant_vision_tower

    kind, inputs = MERGES[name]
    if kind == "transplant" and inputs[1] not in models:
        return models[inputs[0]]
    target = root / name
    if (target / "config.json").is_file():
        return target
    if kind == "average":
        merge_checkpoints([models[i] for i in inputs], target)
    elif kind == "transplant":
        transplant_vision_tower(models[inputs[0]], models[inputs[1]], target)
    else:
        mllm, base = inputs
        merge_checkpoints([models[mllm]], target, language_model_from=models[base])
    log(f"{name:>9}: {kind} of {', '.join(inputs)}")
    return target


def evaluate_models(models: dict[str, Path], claims: list[str], out: Path, benches: dict[str, Path], sc: Scale,
                    log=print) -> dict[str, Any]:
    """{label: {"items": {bench: [exact match per item at the training resolution]}, "grid": {bench: {setting:
    exact match}} (claim 2's models), "text": [exact match per text item]}}."""
    from mindvl.eval.resolution_search import parse_grid, search_resolution
    from mindvl.eval.runner import item_exact_matches

    grid_labels = {label for c in claims if CLAIMS[c].grid for label in CLAIMS[c].variants.values()}
    grid_benches = {b: benches[b] for c in claims for b in CLAIMS[c].grid}
    quiet = lambda line: None  # noqa: E731
    scores: dict[str, Any] = {label: {} for label in models}
    grid = parse_grid(sc.grid)
    labels = sorted(grid_labels & set(models))
    if labels and grid_benches and len(grid) > 1:
        search = search_resolution({lb: models[lb] for lb in labels}, grid_benches, grid, out, eval_settings(),
                                   device="cpu", log=quiet)
        for label in labels:
            scores[label]["grid"] = search["exact_match"][label]
    # Every model at the training resolution. The predictions folder is the grid's: a setting evaluated there (the
    # default is one of the grid's) is read back, not evaluated again.
    search_resolution(dict(models), benches, TRAINING_LIMITS, out, eval_settings(), device="cpu", log=quiet)
    for label in models:
        scores[label]["items"] = {b: item_exact_matches(out / label / b / f"{DEFAULT_SETTING}.jsonl")
                                  for b in benches}
    for label, folder in models.items():
        scores[label]["text"] = evaluate_text(folder, out / label / "text" / f"{TEXT_TASK}.jsonl", sc.bench_items)
        ocr = sum(scores[label]["items"]["ocrbench"]) / len(scores[label]["items"]["ocrbench"])
        log(f"{label:>16}: OCR exact match {ocr:.1%}, text exact match "
            f"{sum(scores[label]['text']) / len(scores[label]['text']):.1%}")
    return scores

