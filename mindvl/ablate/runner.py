"""Run the ablation: per seed, train the stages the chosen claims need, make the merges, evaluate every model, then
hand the per-seed results to `mindvl.ablate.analysis` and `mindvl.ablate.report`.

    summary = run_ablation(["merge", "phases"], seeds=3, out="runs/ablate", scale="tiny")

Layout under OUT (every piece is reused by a rerun, so an interrupted ablation resumes where it stopped):

    bench/                     held-out synthetic OCRBench / ChartQA / DocVQA (the quickstart's), shared by all seeds
    synth/                     the synthetic training sets (seed-independent), generated once
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

from .plan import CLAIMS, MERGES, RUN_ORDER, SCALES, STAGES, Scale, labels_for, stages_for
from .text_eval import TEXT_TASK, evaluate_text

RESULTS = "results.json"


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
                 log=print, report_only: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Train, merge and evaluate seeds 0..seeds-1 for `claims`, then write OUT/report.md, PNGs and ablation.json;
    returns the analysis (see mindvl.ablate.analysis.analyse). `scale` names one of SCALES or is a Scale.

    `jobs` > 1: that many seeds at once, each in its own process with cores / jobs threads (a tiny model gains
    little from a second thread: 1.35x measured, so two one-thread seeds use two cores better than one two-thread
    seed); the synthetic sets are generated first, once.

    `report_only`: train nothing; report the claims that enough seeds (2, or 1 without verdicts) have finished so far
    (e.g. while a long ablation is still running in another process)."""
    check_request(claims, seeds, scale, verdicts)
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: must be >= 1")
    out = Path(out)
    recipes = Path(recipes) if recipes else recipe_dir()
    sc = scale if isinstance(scale, Scale) else SCALES[scale]
    start = time.perf_counter()
    config = {"claims": claims, "seeds": seeds, "scale": scale if isinstance(scale, str) else "custom",
              "steps": sc.steps, "bench_items": sc.bench_items, "grid": sc.grid, "overrides": list(overrides or []),
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
        config.update(scale="as trained", steps=trained)
        return _finish(ready, per_seed, verdicts, out, config, start, log)
    benches = _benchmarks(out / "bench", sc.bench_items)
    config["jobs"] = jobs
    if jobs > 1 and seeds > 1:
        per_seed = _run_seeds_parallel(claims, seeds, out, recipes, sc, list(overrides or []), benches, jobs, log)
        return _finish(claims, per_seed, verdicts, out, config, start, log)
    per_seed = []
    for seed in range(seeds):
        t0 = time.perf_counter()
        log(f"--- seed {seed} ---")
        per_seed.append(run_seed(claims, seed, out, recipes, sc, list(overrides or []), benches, log))
        log(f"seed {seed} done in {time.perf_counter() - t0:.0f} s")
    return _finish(claims, per_seed, verdicts, out, config, start, log)


def _seed_worker(threads: int, claims: list[str], seed: int, out: Path, recipes: Path, sc: Scale,
                 overrides: list[str], benches: dict[str, Path]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    result = run_seed(claims, seed, out, recipes, sc, overrides, benches,
                      lambda line: print(f"[seed {seed}] {line}", flush=True))
    print(f"[seed {seed}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return result


def _run_seeds_parallel(claims: list[str], seeds: int, out: Path, recipes: Path, sc: Scale, overrides: list[str],
                        benches: dict[str, Path], jobs: int, log) -> list[dict[str, Any]]:
    """Seeds in `jobs` spawned processes; results in seed order."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    prepare_synth(claims, out, recipes, sc, overrides, log)  # once, not raced by every worker
    threads = max(1, (os.cpu_count() or 1) // jobs)
    log(f"--- seeds 0..{seeds - 1}, {jobs} at a time, {threads} thread(s) each ---")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_seed_worker, threads, claims, seed, out, recipes, sc, overrides, benches)
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


def run_seed(claims: list[str], seed: int, out: Path, recipes: Path, sc: Scale, overrides: list[str],
             benches: dict[str, Path], log=print) -> dict[str, Any]:
    """One seed's training, merges and evaluations; returns (and stores as seed<s>/results.json) its scores.

    Claims are worked through cheapest first and results.json is rewritten after each, so a seed stopped part-way
    already holds the finished claims' numbers (and a rerun picks up from there)."""
    from mindvl.eval.runner import write_json

    root = out / f"seed{seed}"
    done = root / RESULTS
    budget = {"steps": sc.steps, "bench_items": sc.bench_items, "grid": sc.grid, "overrides": overrides,
              "recipes": str(recipes)}
    result: dict[str, Any] = {"seed": seed, "budget": budget, "claims": [], "models": {}, "training": {},
                              "scores": {}, "eval_seconds": 0.0}
    if done.is_file():
        result = json.loads(done.read_text())
        if result.get("budget", budget) != budget:
            keys = sorted(k for k in budget if result["budget"].get(k) != budget[k])
            raise ValueError(f"{done} was made with another budget (differs in {', '.join(keys)}); write to another "
                             "--out or delete it")
        if set(claims) <= set(result["claims"]):
            log(f"seed {seed}: reused {done}")
            return result
    models = {label: Path(path) for label, path in result["models"].items()}
    for claim in sorted(claims, key=RUN_ORDER.index):
        if claim in result["claims"]:
            continue
        labels = labels_for([claim])
        for name in [n for n in stages_for(labels) if n not in models]:  # shared stages: once per seed
            stage = STAGES[name]
            parent = models[stage.parent] if stage.parent else None
            extra = [*stage.extra, f"max_steps={sc.steps[stage.recipe]}", *seed_overrides(seed), *overrides]
            summary = run_phase(name, recipes / stage.recipe, root, out / "synth", parent, extra, log)
            result["training"][name] = {k: v for k, v in summary.items() if k != "recipe"}
            models[name] = Path(summary["final"])
        for name in [m for m in MERGES if m in labels]:
            models[name] = make_merge(name, root, models, log)
        t0 = time.perf_counter()
        scores = evaluate_models({label: models[label] for label in labels}, [claim], root / "eval", benches, sc,
                                 log)
        for label, per in scores.items():
            result["scores"].setdefault(label, {}).update(per)
        result["eval_seconds"] = round(result["eval_seconds"] + time.perf_counter() - t0, 1)
        result["models"] = {label: str(path) for label, path in models.items()}
        result["claims"].append(claim)
        write_json(done, result)
    return result


def make_merge(name: str, root: Path, models: dict[str, Path], log=print) -> Path:
    """`merged` (the SFT average) or `lm-merged` (the 4K SFT model's language model averaged with the base LLM);
    an existing merge is reused (merges are written atomically, so a folder there is complete)."""
    from mindvl.checkpoint.merge import merge_checkpoints

    target = root / name
    if (target / "config.json").is_file():
        return target
    kind, inputs = MERGES[name]
    if kind == "average":
        merge_checkpoints([models[i] for i in inputs], target)
    else:
        mllm, base = inputs
        merge_checkpoints([models[mllm]], target, language_model_from=models[base])
    log(f"{name:>9}: {kind} merge of {', '.join(inputs)}")
    return target


def evaluate_models(models: dict[str, Path], claims: list[str], out: Path, benches: dict[str, Path], sc: Scale,
                    log=print) -> dict[str, Any]:
    """{label: {"items": {bench: [exact match per item at the training resolution]}, "grid": {bench: {setting:
    exact match}} (claim 2's models), "text": [exact match per text item]}}."""
    from mindvl.eval.resolution_search import parse_grid, search_resolution
    from mindvl.eval.runner import item_exact_matches

    grid_labels = {label for c in claims if CLAIMS[c].grid for label in CLAIMS[c].variants.values()}
    grid_benches = {b: benches[b] for c in claims for b in CLAIMS[c].grid}
    default = [(4 * PX, 64 * PX)]  # DEFAULT_SETTING: the training recipes' own pixel limits
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
    search_resolution(dict(models), benches, default, out, eval_settings(), device="cpu", log=quiet)
    for label in models:
        scores[label]["items"] = {b: item_exact_matches(out / label / b / f"{DEFAULT_SETTING}.jsonl")
                                  for b in benches}
    for label, folder in models.items():
        scores[label]["text"] = evaluate_text(folder, out / label / "text" / f"{TEXT_TASK}.jsonl", sc.bench_items)
        ocr = sum(scores[label]["items"]["ocrbench"]) / len(scores[label]["items"]["ocrbench"])
        log(f"{label:>16}: OCR exact match {ocr:.1%}, text exact match "
            f"{sum(scores[label]['text']) / len(scores[label]['text']):.1%}")
    return scores

