"""The quickstart: the paper's whole pipeline at toy scale, on this machine, in one call.

    synthetic data -> warm-up (projector) -> multitask (all) -> SFT at three sequence lengths with their max_pixels
    -> merge of the three SFT models -> test-time resolution search -> evaluation on synthetic OCRBench / ChartQA /
    DocVQA files -> OUT/report.md with PNG plots (loss curves, scores per checkpoint, resolution box plots)

Each phase starts from the previous phase's exported weights with a fresh optimizer (paper section 5.2); the three
SFT runs all start from the multitask model, like the paper's 2K/4K/8K variants. The recipes are the tiny ones
shipped in `mindvl/recipes/tiny`; the SFT variants are `sft.yaml` with `data.seq_len` and `data.max_pixels`
overridden. The untrained model (the warm-up's random initial weights) is evaluated too, as the floor.

The building blocks (`run_phase`: one resumable phase; `sft_overrides`, `eval_settings`, `write_benchmarks`) are
also what `mindvl ablate` composes, so the ablation measures this very pipeline.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mindvl.config import load_recipe
from mindvl.eval.runner import EvalSettings
from mindvl.progress import format_duration
from mindvl.quickstart_plan import (
    QUICKSTART_COST,
    Speeds,
    Stage,
    StagePlan,
    busy_threads,
    cpu_share,
    host_probe,
    phase_seconds,
    search_seconds,
    step_probe,
    synth_probe,
)
from mindvl.train.parallel import detect_device
from mindvl.train.trainer import train

PX = 28 * 28
# name -> (data.seq_len, data.max_pixels in 28x28 units): the paper's 2K/4K/8K SFT with 1280/3072/4096 x 28 x 28,
# scaled to the tiny model.
SFT_VARIANTS: dict[str, tuple[int, int]] = {"sft-512": (512, 16), "sft-1024": (1024, 48), "sft-2048": (2048, 64)}
QUICK_GRID = "4,16:16,64"  # min {4,16} x max {16,64} (x 28 x 28): a 2x2 corner of the paper's grid, scaled down
DEFAULT_SETTING = "min4_max64"  # the training recipes' own limits (min_pixels 3136, max_pixels 50176)
BENCH_ITEMS = 100
BENCH_SEED = 1000  # benchmark images come from their own random stream (mindvl.eval.synth_bench), never trained on


def recipe_dir() -> Path:
    """The tiny recipes, shipped inside the package (`recipes/tiny` of a checkout links to them)."""
    return Path(__file__).resolve().parent / "recipes" / "tiny"


PHASE_SUMMARY = "phase.json"  # written into a phase's folder when it finished: what a rerun reuses


def run_phase(name: str, recipe: Path, root: Path, cache: Path, init: Path | None, extra: list[str],
              log=print) -> dict[str, Any]:
    """Train `recipe` into ROOT/NAME from `init` (or its own seeded weights) unless that folder already holds a
    finished run of the same recipe; returns {steps, first_loss, last_loss, seconds, final}.

    Resumable: a finished phase is reused (its `phase.json`), an interrupted one continues from its last checkpoint
    (`resume=auto`). Reusing a phase trained with another recipe would mix results silently, so that is an error."""
    from mindvl.eval.runner import write_json

    out = root / name
    items = [f"output_dir={out}", f"data.synth_cache={cache}", *extra, "resume=auto"]
    if init is not None:
        items.append(f"init_from={init}")
    cfg = load_recipe(recipe, items)
    done = out / PHASE_SUMMARY
    if done.is_file():
        summary = json.loads(done.read_text())
        if summary["recipe"] != cfg.to_dict():
            before, now = summary["recipe"], cfg.to_dict()
            keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            raise ValueError(f"{out} holds a finished {name} run of another recipe (differs in {', '.join(keys)}); "
                             "write to another output folder or delete it")
        log(f"{name:>9}: reused ({summary['steps']} steps, loss {summary['first_loss']:.3f} -> "
            f"{summary['last_loss']:.3f})")
        return summary
    t0 = time.perf_counter()
    result = train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records]  # the whole run's, also when it resumed after an interruption
    summary = {"steps": result.steps, "first_loss": losses[0], "last_loss": losses[-1],
               "seconds": round(time.perf_counter() - t0, 1), "final": str(result.final_dir), "recipe": cfg.to_dict()}
    write_json(done, summary)
    log(f"{name:>9}: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} in {result.steps} steps "
        f"({summary['seconds']} s)")
    return summary


def sft_overrides(seq_len: int, max_px: int, token_px: int = PX) -> list[str]:
    """An SFT variant of `sft.yaml`: its sequence length and max_pixels (`max_px` merged image tokens of `token_px`
    pixels each: 28 x 28 for Qwen2.5-VL's tower, 32 x 32 for Qwen3-VL's)."""
    return [f"data.seq_len={seq_len}", f"data.max_pixels={max_px * token_px}"]


def token_pixels(recipe: Path) -> int:
    """Pixels of one merged image token of `recipe`'s vision tower, so the SFT variants keep 16/48/64 tokens
    whatever the family; a recipe that names a model folder instead of an arch keeps 28 x 28."""
    from mindvl.train.preflight import arch_token_pixels

    return arch_token_pixels(load_recipe(recipe)) or PX


def phase_specs(recipes: Path) -> list[tuple[str, Path, str | None, list[str]]]:
    """(name, recipe, parent phase, extra overrides) in training order: warm-up -> multitask -> three SFT variants,
    all three from the multitask model."""
    specs: list[tuple[str, Path, str | None, list[str]]] = [("warmup", recipes / "warmup.yaml", None, []),
                                                            ("multitask", recipes / "multitask.yaml", "warmup", [])]
    token_px = token_pixels(recipes / "sft.yaml")
    specs += [(name, recipes / "sft.yaml", "multitask", sft_overrides(seq_len, max_px, token_px))
              for name, (seq_len, max_px) in SFT_VARIANTS.items()]
    return specs


def train_phases(out: Path, recipes: Path, overrides: list[str], log=print, plan: StagePlan | None = None,
                 extra_for: Callable[[Path], list[str]] | None = None) -> dict[str, Any]:
    """Warm-up -> multitask -> three SFT variants; returns {phase: summary} with each phase's `final` folder.
    Finished phases under OUT are reused. `extra_for(recipe)`: overrides of that recipe before `overrides`."""
    cache = out / "synth"
    phases: dict[str, Any] = {}
    for name, recipe, parent, extra in phase_specs(recipes):
        init = Path(phases[parent]["final"]) if parent else None
        items = [*(extra_for(recipe) if extra_for else []), *extra, *overrides]
        if plan is not None:
            plan.begin(name)
        phases[name] = run_phase(name, recipe, out, cache, init, items, log)
        if plan is not None:
            plan.end(name)
    return phases


def eval_settings() -> EvalSettings:
    """How the quickstart and the ablation evaluate the tiny models."""
    # The tiny recipes train without a system turn; answers are short, so 16 new tokens bound every generation.
    return EvalSettings(system=None, max_new_tokens=16, batch_size=16)


def write_benchmarks(out: Path, bench_items: int) -> dict[str, Path]:
    """The held-out synthetic OCRBench (digit strips) / ChartQA / DocVQA files under OUT."""
    from mindvl.eval.synth_bench import write_synthetic_benchmarks

    return write_synthetic_benchmarks(out, n=bench_items, seed=BENCH_SEED, ocr_task="digits", chart_task="minichart",
                                      doc_task="minidoc")


def save_untrained(out: Path, recipes: Path) -> Path:
    """The warm-up's initial weights (seeded random) as a model folder: the floor every score is compared with."""
    from mindvl.checkpoint import save_pretrained
    from mindvl.data import load_tokenizer
    from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH
    from mindvl.train.materialize import build_model
    from mindvl.train.parallel import ParallelEnv

    recipe = load_recipe(recipes / "warmup.yaml", [f"output_dir={out / 'untrained'}"])
    data = recipe.data
    tok = load_tokenizer(data.tokenizer)
    model = build_model(recipe, tok, ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    return save_pretrained(model, out / "untrained", overwrite=True,
                           side_files_from=data.tokenizer or DEFAULT_TOKENIZER_PATH.parent,
                           pixels=(data.min_pixels, data.max_pixels))


# A smoke run (`--fast`): a few steps per phase, synthetic sets capped, a few benchmark items, a 1 x 2 grid.
FAST = {"steps": 10, "synth_cap": 200, "bench_items": 10, "grid": "4:16,64"}


def capped_sources(recipe: Path, cap: int) -> list[str]:
    """An override giving `recipe`'s synthetic sources at most `cap` samples each (the same tasks and seeds)."""
    import yaml

    sources = [dict(s) for s in load_recipe(recipe).to_dict()["data"].get("sources") or []]  # as written
    for s in sources:
        if isinstance(s.get("synth"), dict):
            s["synth"] = {**s["synth"], "n": min(int(s["synth"]["n"]), cap)}
    return [f"data.sources={yaml.safe_dump(sources, default_flow_style=True, width=10**9).strip()}"]


def synth_sets(out: Path, recipes: Path, overrides: list[str], extra_for) -> list[tuple[tuple[str, ...], int, int]]:
    """The distinct synthetic sets (tasks, n, seed) every phase will read, in first-use order."""
    from mindvl.data import DataConfig

    sets: list[tuple[tuple[str, ...], int, int]] = []
    for _, recipe, _, extra in phase_specs(recipes):
        cfg = load_recipe(recipe, [*extra_for(recipe), *extra, *overrides])
        for s in DataConfig.from_dict(cfg.data).sources:
            key = (tuple(s.synth.tasks), s.synth.n, s.synth.seed) if s.synth is not None else None
            if key is not None and key not in sets:
                sets.append(key)
    return sets


def build_plan(out: Path, recipes: Path, overrides: list[str], extra_for, bench_items: int, n_settings: int,
               probe_s: float, log, host_s: float | None = None, share: float | None = None) -> StagePlan:
    """The stages with their work and estimated seconds (quickstart_plan: QUICKSTART_COST priced in the step probe
    `probe_s` and the host probe `host_s`, measured now with the CPU `share` when not given); finished phases and
    cached data cost nothing."""
    from mindvl.data import DataConfig
    from mindvl.data.synth import synth_path

    missing = [k for k in synth_sets(out, recipes, overrides, extra_for)
               if not synth_path(out / "synth", *k).is_file()]
    samples = sum(n for _, n, _ in missing)
    share = cpu_share() if share is None else share
    speeds = Speeds(probe_s, host_probe(share=share) if host_s is None else host_s,
                    synth_probe(sorted({t for tasks, _, _ in missing for t in tasks}), share=share),  # s per sample
                    share, torch.get_num_threads())
    stages = [Stage("data", f"{samples:,} synthetic samples in {len(missing)} sets" if missing
                    else "synthetic sets already generated", speeds.data_seconds(missing), "" if missing else "cached")]
    first = True  # the first phase this process trains also measures the trainer's matmul peak
    for name, recipe, _, extra in phase_specs(recipes):
        cfg = load_recipe(recipe, [*extra_for(recipe), *extra, *overrides])
        seq_len = DataConfig.from_dict(cfg.data).seq_len
        steps = cfg.budget.max_steps
        reused = (out / name / PHASE_SUMMARY).is_file()
        detail = f"{steps} steps of {seq_len} tokens, trains {', '.join(cfg.trainable_modules)}" if steps else \
            f"{cfg.budget.max_tokens:,} tokens of {seq_len}"
        seconds = 0.0 if reused else phase_seconds(speeds, name, steps or 0, seq_len, first)
        first = first and reused
        stages.append(Stage(name, detail, seconds, "reused" if reused else ""))
    n_ckpt = 2 + len(SFT_VARIANTS)  # the untrained floor, the SFT models and the merged one
    evals = n_ckpt * 3 * n_settings
    stages.append(Stage("merge", f"average of the {len(SFT_VARIANTS)} SFT models, benchmark files, untrained floor",
                        speeds.seconds(host_units=QUICKSTART_COST["merge"])))
    stages.append(Stage("search", f"{n_ckpt} checkpoints x 3 benchmarks x {n_settings} resolution settings x "
                                  f"{bench_items} items ({evals} evaluations)",
                        search_seconds(speeds, n_ckpt, evals, bench_items, eval_settings().batch_size)))
    return StagePlan(stages, probe_s, log, speeds=speeds)


def generate_data(out: Path, sets, log) -> None:
    """Every synthetic set the phases read, generated once into OUT/synth, with a progress bar."""
    from mindvl.data.synth import ensure_synth, synth_path
    from mindvl.progress import Progress

    missing = [k for k in sets if not synth_path(out / "synth", *k).is_file()]
    if not missing:
        return
    with Progress("synthetic data", total=sum(n for _, n, _ in missing), unit="samples") as bar:
        for tasks, n, seed in missing:
            base = bar.done
            bar.update(base, desc=f"synthetic data ({'-'.join(tasks)}, seed {seed})")
            ensure_synth(out / "synth", list(tasks), n, seed, progress=lambda i, b=base: bar.update(b + i))


def _run_stages(plan: StagePlan, summary: dict[str, Any], out: Path, recipes: Path, items: list[str], extra_for,
                bench_items: int, pairs: list[tuple[int, int]], log) -> dict[str, Any]:
    """Data -> five training phases -> merge -> search; fills `summary` and returns the search's result."""
    from mindvl.checkpoint.merge import merge_checkpoints
    from mindvl.eval.resolution_search import search_resolution

    plan.begin("data")
    generate_data(out, synth_sets(out, recipes, items, extra_for), log)
    plan.end("data")
    summary["phases"] = train_phases(out, recipes, items, log, plan, extra_for)

    plan.begin("merge")
    t0 = time.perf_counter()
    sft = [Path(summary["phases"][name]["final"]) for name in SFT_VARIANTS]
    merged = merge_checkpoints(sft, out / "merged", overwrite=True).out
    summary["merge_seconds"] = round(time.perf_counter() - t0, 1)
    log(f"   merged: {len(sft)} SFT models -> {merged}")
    benches = write_benchmarks(out / "bench", bench_items)
    checkpoints = {"untrained": save_untrained(out, recipes),
                   **{name: Path(summary["phases"][name]["final"]) for name in SFT_VARIANTS}, "merged": merged}
    plan.end("merge")

    plan.begin("search")
    t0 = time.perf_counter()
    search = search_resolution(checkpoints, benches, pairs, out / "search", eval_settings(), device="cpu",
                               log=lambda line: None)
    plan.end("search")
    summary["search_seconds"] = round(time.perf_counter() - t0, 1)
    return search


def pick_threads(log, device: torch.device) -> int:
    """On a busy CPU machine, fewer torch threads (quickstart_plan.busy_threads), unless the user chose them
    (OMP_NUM_THREADS / MKL_NUM_THREADS) or the run is on an accelerator (`device`, where the phases train). Returns
    the count before, to restore."""
    import os

    before = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS") or device.type != "cpu":
        return before
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = busy_threads(before, cores, load)
    if threads < before:
        log(f"this machine is busy (load {load:.1f} on {cores} cores): training on {threads} torch thread"
            f"{'s' if threads > 1 else ''} instead of {before} (set OMP_NUM_THREADS to choose)")
        torch.set_num_threads(threads)
    return before


def stage_timings(out: Path, plan: StagePlan) -> dict[str, Any]:
    """What the estimates are calibrated from (QUICKSTART_COST): the probes, and per stage its estimate and wall
    seconds; for a training phase also the seconds of its steps (metrics.jsonl's step_time_s), the rest being its
    fixed start-up, checkpoint and export."""
    speeds = plan.speeds
    timing: dict[str, Any] = {"probe_s": round(plan.probe_s, 4),
                              "host_s": round(speeds.host_s, 5) if speeds else None,
                              "share": round(speeds.share, 3) if speeds else None,
                              "threads": speeds.threads if speeds else None,
                              "synth_s": {t: round(v, 5) for t, v in speeds.synth_s.items()} if speeds else {},
                              "stages": {}}
    for s in plan.stages:
        row: dict[str, Any] = {"estimate": round(s.seconds, 1), "seconds": plan.seconds.get(s.name)}
        metrics = out / s.name / "metrics.jsonl"
        if s.seconds > 0 and metrics.is_file():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            times = [r["step_time_s"] for r in records if "step_time_s" in r]
            if times:
                row.update(steps_s=round(sum(times), 1), first_step_s=round(times[0], 2),
                           median_step_s=round(statistics.median(times), 3))
        timing["stages"][s.name] = row
    return timing


def quickstart(out: str | Path, recipes: str | Path | None = None, overrides: list[str] | None = None,
               bench_items: int = BENCH_ITEMS, grid: str = QUICK_GRID, log=print, steps: int | None = None,
               fast: bool = False, rerun: str | None = None) -> dict[str, Any]:
    """The whole pipeline into OUT. `steps`: max_steps of every phase; `fast`: a smoke run (FAST); `rerun`: the
    command that continues an interrupted run (printed if a phase is stopped)."""
    from contextlib import nullcontext

    from mindvl.eval.resolution_search import parse_grid
    from mindvl.eval.runner import write_json
    from mindvl.train.preempt import rerun_command
    from mindvl.train.stops import Preempted

    out = Path(out)
    recipes = Path(recipes) if recipes else recipe_dir()
    start = time.perf_counter()
    if fast:
        steps = steps or FAST["steps"]
    items = [*([f"max_steps={steps}"] if steps else []), *(overrides or [])]
    cap = FAST["synth_cap"] if fast else None
    cached_caps: dict[Path, list[str]] = {}

    def extra_for(recipe: Path) -> list[str]:
        if cap is None:
            return []
        if recipe not in cached_caps:
            cached_caps[recipe] = capped_sources(recipe, cap)
        return cached_caps[recipe]

    pairs = parse_grid(grid)
    threads = pick_threads(log, detect_device()[0])  # the device the phases' trainer will pick
    try:
        probe_s = step_probe(load_recipe(recipes / "multitask.yaml",
                                         [*extra_for(recipes / "multitask.yaml"), *items]))
        plan = build_plan(out, recipes, items, extra_for, bench_items, len(pairs), probe_s, log)
        plan.print_plan(f"quickstart into {out}")
        summary: dict[str, Any] = {}
        try:  # Ctrl-C (or a stop signal) anywhere: say how to continue, which is the same command again
            with rerun_command(rerun) if rerun else nullcontext():
                search = _run_stages(plan, summary, out, recipes, items, extra_for, bench_items, pairs, log)
        except (KeyboardInterrupt, Preempted):
            stage = plan.stages[plan.current].name if plan.current >= 0 else "start-up"
            again = rerun or "the same quickstart command"
            raise Preempted(f"quickstart interrupted in stage {stage}; to continue, run it again: {again}   "
                            "(finished stages are reused, a stopped training phase resumes from its checkpoint)"
                            ) from None
    finally:
        torch.set_num_threads(threads)  # an in-process caller (a test, a notebook) keeps its own
    summary["evaluation"] = {label: {bench: {"score": per[DEFAULT_SETTING],
                                             "exact_match": search["exact_match"][label][bench][DEFAULT_SETTING]}
                                     for bench, per in benches_scores.items()}
                             for label, benches_scores in search["scores"].items()}
    summary["best"] = search["best"]
    summary["headlines"] = search["headlines"]
    summary["merge_vs_sft"] = merge_vs_sft(out / "search", list(summary["evaluation"]["merged"]))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    summary["fast"] = fast
    summary["timing"] = stage_timings(out, plan)
    write_json(out / "quickstart.json", summary)
    report = write_report(out, summary)
    ocr = summary["evaluation"]["merged"]["ocrbench"]["exact_match"]
    floor = summary["evaluation"]["untrained"]["ocrbench"]["exact_match"]
    log(f"OCR exact match on {bench_items} held-out images: merged model {ocr:.1%} (untrained {floor:.1%})")
    log(f"quickstart done in {format_duration(summary['seconds'])} (estimated at start: "
        f"{format_duration(plan.total)}); report: {report}")
    log(f"per stage, estimated -> took: {plan.comparison()}")
    return summary


# ------------------------------------------------------------------------------------------------------ report


def merge_vs_sft(search: Path, benches: list[str]) -> dict[str, Any]:
    """Per benchmark, at the training resolution: the merged model's exact match, the three SFT models' (their mean,
    std and range: the spread the merge is to beat), and merged minus each SFT model with a 95% interval over items
    (paired bootstrap on the same held-out items: how much of the gap one test set alone could make)."""
    from mindvl.ablate.stats import bootstrap_ci
    from mindvl.eval.runner import item_exact_matches

    out: dict[str, Any] = {}
    for bench in benches:
        items = {label: item_exact_matches(search / label / bench / f"{DEFAULT_SETTING}.jsonl")
                 for label in [*SFT_VARIANTS, "merged"]}
        sft = [sum(items[n]) / len(items[n]) for n in SFT_VARIANTS]
        out[bench] = {"merged": sum(items["merged"]) / len(items["merged"]),
                      "sft": dict(zip(SFT_VARIANTS, sft, strict=True)),
                      "sft_mean": statistics.mean(sft), "sft_std": statistics.stdev(sft),
                      "sft_range": [min(sft), max(sft)],
                      "diff": {n: bootstrap_ci([items["merged"]], [items[n]]).to_dict() for n in SFT_VARIANTS}}
    return out


def merge_section(rows: dict[str, Any]) -> list[str]:
    names = list(SFT_VARIANTS)
    lines = ["## Merged vs the three SFT models", "",
             "Exact match in % at the training resolution: the merged model against the three SFT models it averages "
             "(their mean ± std and range), and merged minus each with a 95% interval over the held-out items. One "
             "run: seed-to-seed spread is not in these intervals (`mindvl ablate merge --seeds N` measures it).", "",
             "| benchmark | merged | " + " | ".join(names) + " | SFT mean ± std [range] | "
             + " | ".join(f"merged - {n}" for n in names) + " |", "|" + " --- |" * (3 + 2 * len(names))]
    for bench, r in rows.items():
        diffs = [r["diff"][n] for n in names]
        lines.append(f"| {bench} | {100 * r['merged']:.1f} | " + " | ".join(f"{100 * r['sft'][n]:.1f}" for n in names)
                     + f" | {100 * r['sft_mean']:.1f} ± {100 * r['sft_std']:.1f} [{100 * r['sft_range'][0]:.1f}, "
                     f"{100 * r['sft_range'][1]:.1f}] | "
                     + " | ".join(f"{100 * d['mean']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
                                  for d in diffs) + " |")
    return [*lines, ""]


def write_report(out: Path, summary: dict[str, Any]) -> Path:
    """OUT/report.md plus loss_curves.png and scores.png (the resolution box plots come from the search)."""
    plots = [p for p in (plot_losses(out, list(summary["phases"])), plot_scores(out, summary)) if p is not None]
    lines = ["# mindvl quickstart report", "",
             f"Whole pipeline in {summary['seconds']} s on this machine "
             f"(merge {summary['merge_seconds']} s, resolution search + evaluation {summary['search_seconds']} s).",
             "", "## Training", "", "| phase | steps | first loss | last loss | seconds |",
             "| --- | --- | --- | --- | --- |"]
    for name, p in summary["phases"].items():
        lines.append(f"| {name} | {p['steps']} | {p['first_loss']:.3f} | {p['last_loss']:.3f} | {p['seconds']} |")
    lines += ["", "## Evaluation at the training resolution "
              f"({DEFAULT_SETTING.replace('_', ', ')} x 28 x 28 pixels)", ""]
    benches = list(next(iter(summary["evaluation"].values())))
    lines.append("| checkpoint | " + " | ".join(f"{b} {summary['headlines'][b]} | {b} exact match" for b in benches)
                 + " |")
    lines.append("|" + " --- |" * (1 + 2 * len(benches)))
    for label, per in summary["evaluation"].items():
        cells = [f"{per[b]['score']:.4g} | {per[b]['exact_match']:.1%}" for b in benches]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Scores are each toolkit's headline metric as lmms-eval reports it; OCRBench's is hits / 1000 "
              "whatever the item count, so the exact-match column is the accuracy to read.", ""]
    if summary.get("fast"):
        steps = max(p["steps"] for p in summary["phases"].values())
        lines += [f"This is a `--fast` smoke run: {steps} training steps per phase show that every stage runs, not "
                  "what the model learns, so scores at or near 0% are expected here; the full `./quickstart` reads "
                  "about 91% OCR for the merged model.", ""]
    if summary.get("merge_vs_sft"):
        lines += merge_section(summary["merge_vs_sft"])
    lines += ["## Best test-time resolution per benchmark", "", "| benchmark | checkpoint | min_pixels | max_pixels | "
              "score |", "| --- | --- | --- | --- | --- |"]
    for bench, b in summary["best"]["overall"].items():
        if b["setting"] is None:  # every setting scores the same: naming one would mislead
            lines.append(f"| {bench} | {b['checkpoint'] or 'none'} | - | - | {b['score']:.4g} ({b['no_best']}) |")
        else:
            lines.append(f"| {bench} | {b['checkpoint']} | {b['min_pixels']} | {b['max_pixels']} | "
                         f"{b['score']:.4g} |")
    lines += ["", "Full grid: `search/results.md`; per-item predictions: `search/<checkpoint>/<benchmark>/`.", ""]
    lines += [f"![{p.stem}]({p.relative_to(out)})" for p in [*plots, *sorted((out / "search").glob("boxplot_*.png"))]]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional (extra `plots`)
        return None
    return plt


def plot_losses(out: Path, phases: list[str]) -> Path | None:
    """Every phase's loss against the cumulative optimizer step, one colour per phase (SFT variants overlap)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.8))
    offset = 0
    for name in phases:
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        steps = [offset + r["step"] for r in records]
        ax.plot(steps, [r["loss"] for r in records], label=name)
        if not name.startswith("sft"):  # the SFT variants all continue from the multitask model
            offset = steps[-1]
    ax.set_xlabel("optimizer step (cumulative)")
    ax.set_ylabel("loss per labelled token")
    ax.set_title("Training loss per phase (each SFT variant continues from the multitask model)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(title="phase", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)  # beside the curves, never over them
    fig.tight_layout()
    path = out / "loss_curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_scores(out: Path, summary: dict[str, Any]) -> Path | None:
    """Exact match per benchmark and checkpoint at the training resolution (grouped bars), saved as scores.png."""
    plt = pyplot()
    if plt is None:
        return None
    fig = scores_figure(summary)
    path = out / "scores.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _percent(v: float) -> str:
    """0% only for a true 0: a small nonzero score keeps a decimal (0.3%)."""
    return f"{v:.0%}" if v == 0 or v >= 0.01 else f"{v:.1%}"


def scores_figure(summary: dict[str, Any]):
    """The grouped bars as a Figure: each bar labelled with its value (a 0% bar has no height, its label shows it),
    the legend beside the axes, never over a bar."""
    plt = pyplot()
    labels = list(summary["evaluation"])
    benches = list(summary["evaluation"][labels[0]])
    fig, ax = plt.subplots(figsize=(max(7.0, 2.5 + 0.45 * len(labels) * len(benches)), 4.0))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [summary["evaluation"][label][b]["exact_match"] for b in benches]
        bars = ax.bar([j + i * width for j in range(len(benches))], values, width, label=label)
        ax.bar_label(bars, labels=[_percent(v) for v in values], padding=2, fontsize=7, rotation=90)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(benches))], benches)
    ax.set_xlabel("benchmark (synthetic, held out)")
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1.18)  # room above a 100% bar for its label
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0], ["0%", "25%", "50%", "75%", "100%"])
    ax.set_title(f"Exact match at the training resolution ({DEFAULT_SETTING.replace('_', ', ')} x 28 x 28 pixels)",
                 fontsize=10)
    ax.legend(title="checkpoint", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
