"""`mindvl ablate merge|resolution|phases|lm-merge|all --seeds N --out DIR [--scale tiny|small] [key=value ...]`:
re-check the paper's claims at toy scale with seeds, spreads, confidence intervals and verdicts."""

from __future__ import annotations

from .overrides import add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser("ablate", help="re-check the paper's claims at toy scale, with seeds and verdicts")
    p.add_argument("ablation", help="merge, resolution, phases, lm-merge, a comma-separated list of them, or all")
    p.add_argument("--seeds", type=int, default=4, help="seeds per variant (>= 2 for a verdict; default 4: at tiny "
                   "with the pretrained tower they put claim 1's intervals at ±3.0 / ±0.9 points against the 1024 / "
                   "2048 SFT models, benchmarks/RESULTS.md, Testbed)")
    p.add_argument("--out", default="runs/ablate", help="output folder; a rerun reuses finished runs (default "
                   "runs/ablate)")
    p.add_argument("--scale", default="tiny", help="step budget: tiny (the tiny recipes' own step counts, 300 items "
                   "per benchmark) or small (twice the steps, 500 items); benchmarks/RESULTS.md has the timings")
    p.add_argument("--jobs", type=int, default=1, help="seeds trained at once, each in its own process with "
                   "cores/jobs threads (default 1; 2 on a 2-core machine uses both cores best)")
    p.add_argument("--recipes", default=None, help="folder with text/warmup/pretrain/multitask/sft.yaml (default: "
                   "the tiny ones)")
    p.add_argument("--vision-tower", default="trained", help="where every seed's vision tower starts: trained (a "
                   "pretrained tower, as the paper's: one whole chain trained once under OUT/tower at --tower-seed "
                   "and the small budget, about 13 min on 2 idle cores, reused by reruns), random (each seed's seeded "
                   "init), or a mindvl model folder whose vision tower to take (default trained)")
    p.add_argument("--tower-seed", type=int, default=None, help="seed of the pretrained tower's chain (default "
                   "1000, apart from the ablation's seeds)")
    p.add_argument("--no-verdict", action="store_true", help="allow one seed: means and differences, no verdicts")
    p.add_argument("--report-only", action="store_true", help="train nothing: report the claims the seeds under "
                   "--out have finished so far (e.g. while the ablation runs in another process)")
    add_overrides(p, "applied to every training run of the seeds (e.g. optim.lr=5e-4; the pretrained tower's chain "
                     "keeps its own recipes and budget); they are part of each run's recipe, so a rerun with other "
                     "ones needs a new --out")
    p.set_defaults(func=run)


def run(args) -> int:
    import shlex
    import sys

    from mindvl.ablate import parse_ablations, run_ablation
    from mindvl.train.preempt import rerun_command

    claims = parse_ablations(args.ablation)
    # A stopped training run advises this very command: a rerun reuses finished runs and resumes the stopped one.
    with rerun_command(shlex.join(["mindvl", *sys.argv[1:]])):
        run_ablation(claims, args.seeds, args.out, args.scale, args.recipes, args.overrides,
                     verdicts=not args.no_verdict, report_only=args.report_only, jobs=args.jobs,
                     vision=args.vision_tower, tower_seed=args.tower_seed)
    return 0
