"""`mindvl ablate`: re-check the paper's claims at toy scale, with seeds, spreads, intervals and verdicts.

    from mindvl.ablate import run_ablation
    analysis = run_ablation(["merge", "resolution", "phases", "lm-merge"], seeds=4, out="runs/ablate")

Modules: `plan` (stages, merges, claims, scales), `runner` (train / merge / evaluate per seed, resumable),
`text_eval` (the text-ability probe), `stats` (intervals and verdicts), `analysis`, `report`.
"""

from .plan import ABLATIONS, CLAIMS, SCALES, parse_ablations
from .runner import run_ablation

__all__ = ["ABLATIONS", "CLAIMS", "SCALES", "parse_ablations", "run_ablation"]
