"""The analysis behind `mindvl moe-analyze`: SRP and SCH curves, cache-policy baselines, guidance, tables, files.

`analyze` computes one JSON-serialisable report from a RouterTrace; `print_report` renders it as rich tables;
`write_report` writes `moe_analysis.json` and the plots (matplotlib, Agg backend) into a folder.

**Guidance.** The reference paper's advice is that a cache of about twice the active experts balances hit rate and
memory. Made concrete for a given trace: for every hit-rate curve (each policy and SCH at each segment, per-layer
and pooled caches), the recommended size is the smallest measured cache ratio whose hit rate is within `margin`
(absolute) of the best measured one. It can only pick among the ratios that were measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mindvl.moe_analysis.cache import POLICIES, hit_rate
from mindvl.moe_analysis.metrics import srp_curve
from mindvl.moe_analysis.trace_io import RouterTrace

REPORT_JSON = "moe_analysis.json"
PLOTS = ("srp.png", "layer_srp.png", "hit_rates.png")


def parse_list(text: str, kind: type, name: str) -> tuple:
    """'4,16,64' -> (4, 16, 64); a clear ValueError names the option when an item does not parse."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name} needs at least one value, got {text!r}")
    try:
        return tuple(kind(x) for x in items)
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None


def random_routing_srp(k: int, num_experts: int, segment: int) -> float:
    """SRP of i.i.d. uniform top-k routing (the reference doc's analytic baseline, §10.3).

    Each (window, expert) count is Binomial(m, k/E); F1(θ) uses the expected TP, P and A, and SRP is its maximum.
    """
    p, m = k / num_experts, segment
    pmf = np.array([math.comb(m, v) * p**v * (1 - p) ** (m - v) for v in range(m + 1)])
    v = np.arange(m + 1)
    tp = np.cumsum((v * pmf)[::-1])[::-1]
    pred = m * np.cumsum(pmf[::-1])[::-1]
    return float(np.max(2 * tp / (pred + m * p)))


def recommend(ratios: Sequence[float], rates: Sequence[float], margin: float) -> dict:
    """The smallest ratio whose hit rate is within `margin` of the best measured one (see the module docstring)."""
    rates = np.asarray(rates, float)
    best = int(np.argmax(rates))
    pick = int(np.flatnonzero(rates >= rates[best] - margin)[0])
    return {"best_ratio": float(ratios[best]), "best_hit_rate": float(rates[best]),
            "ratio": float(ratios[pick]), "hit_rate": float(rates[pick])}


def analyze(
    trace: RouterTrace,
    segments: Sequence[int] = (4, 16, 64, 256),
    cache_ratios: Sequence[float] = (0.5, 1, 2, 4),
    policies: Sequence[str] = ("lru", "lfu", "belady", "static"),
    margin: float = 0.01,
    *,
    lookup: str = "pre",
    pin: bool = False,
    warm_start: bool = True,
    sequence_stride: int = 1,
    pooled: bool = True,
) -> dict:
    """SRP per segment, SCH per segment and the policy baselines at each cache ratio, plus guidance (a dict)."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin is an absolute hit-rate difference in [0, 1), got {margin}")
    for policy in policies:
        if policy not in POLICIES or policy == "fsf":
            raise ValueError(f"unknown baseline policy {policy!r}; choose from lru, lfu, belady, static "
                             "(SCH's look-ahead cache is always computed)")
    semantics = {"lookup": lookup, "pin": pin, "warm_start": warm_start, "sequence_stride": sequence_stride,
                 "pooled": pooled}
    srps = srp_curve(trace, segments=segments)
    curves = {f"sch@{m}": hit_rate(trace, policy="fsf", segment=m, cache_sizes=cache_ratios, **semantics)
              for m in segments}
    curves.update({p: hit_rate(trace, policy=p, cache_sizes=cache_ratios, **semantics) for p in policies})
    scopes = ["per_layer"] + (["pooled"] if pooled else [])
    guidance = []
    for name, res in curves.items():
        for scope in scopes:
            rates = res.layer_mean if scope == "per_layer" else res.pooled
            slots = res.layer_slots if scope == "per_layer" else res.pooled_slots
            rec = recommend(res.ratios, rates, margin)
            rec.update(curve=name, scope=scope, slots=int(slots[res.ratios.index(rec["ratio"])]))
            guidance.append(rec)
    return {
        "trace": {"layers": trace.num_layers, "layer_names": trace.layer_names, "num_experts": trace.num_experts,
                  "k": trace.k, "sequences": trace.num_sequences, "tokens": trace.num_tokens, "meta": trace.meta},
        "semantics": semantics,
        "margin": margin,
        "srp": [dict(r.to_dict(), random_srp=random_routing_srp(trace.k, trace.num_experts, r.segment))
                for r in srps],
        "hit_rates": {name: res.to_dict() for name, res in curves.items()},
        "guidance": guidance,
    }


# ---- rendering -----------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.4f}"


def print_report(report: dict, console=None) -> None:
    """Render the report as rich tables (SRP, hit rates per scope, guidance)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = report["trace"]
    console.print(f"[bold]MoE routing consistency[/]: {t['layers']} layers, E={t['num_experts']}, k={t['k']}, "
                  f"{t['sequences']} sequences, {t['tokens']} tokens")
    table = Table(title="SRP (model level: one θ for all layers)")
    for col in ("segment", "SRP", "θ*", "ρ̂ = group/k", "random routing", "layer SRP min..max"):
        table.add_column(col, justify="right")
    for r in report["srp"]:
        layer = [v for v in r["layer_srp"] if v is not None]
        span = f"{min(layer):.3f}..{max(layer):.3f}" if layer else "-"
        table.add_row(str(r["segment"]), _fmt(r["srp"]), str(r["theta"]), _fmt(r["rho"]), _fmt(r["random_srp"]),
                      span)
    console.print(table)
    curves = report["hit_rates"]
    ratios = next(iter(curves.values()))["ratios"]
    for scope, key in (("per-layer caches (all layers pooled)", "layer_mean"), ("one pooled cache", "pooled")):
        if next(iter(curves.values()))[key] is None:
            continue
        table = Table(title=f"Hit rate, {scope}; columns: cache ratio ρ = slots / active experts")
        table.add_column("policy")
        for r in ratios:
            table.add_column(f"ρ={r:g}", justify="right")
        for name, res in curves.items():
            table.add_row(name, *[_fmt(v) for v in res[key]])
        console.print(table)
    table = Table(title=f"Guidance: smallest measured ρ within {report['margin']:g} of the best hit rate")
    for col in ("curve", "scope", "ρ", "slots", "hit rate", "best ρ", "best hit rate"):
        table.add_column(col, justify="right")
    for g in report["guidance"]:
        table.add_row(g["curve"], g["scope"], f"{g['ratio']:g}", str(g["slots"]), _fmt(g["hit_rate"]),
                      f"{g['best_ratio']:g}", _fmt(g["best_hit_rate"]))
    console.print(table)


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    """Write the JSON report and the plots into out_dir; returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_JSON
    path.write_text(json.dumps(report, indent=1))
    return [path, *_plots(report, out)]


def _plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    paths = []
    srps = report["srp"]
    seg = [r["segment"] for r in srps]
    fig, (ax, ax_rho) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(seg, [np.nan if r["srp"] is None else r["srp"] for r in srps], "o-", label="trace")
    ax.plot(seg, [r["random_srp"] for r in srps], "k--", label="i.i.d. random routing")
    ax_rho.plot(seg, [np.nan if r["rho"] is None else r["rho"] for r in srps], "o-")
    for a, label in ((ax, "SRP"), (ax_rho, "best group size / k (ρ̂)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("segment length m (tokens)")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "srp.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in srps:
        ax.plot(range(len(r["layer_srp"])), [np.nan if v is None else v for v in r["layer_srp"]], "o-",
                label=f"m={r['segment']}")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("SRP (θ per layer)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "layer_srp.png", plt))

    curves = report["hit_rates"]
    scopes = [(key, title) for key, title in (("layer_mean", "per-layer caches"), ("pooled", "pooled cache"))
              if next(iter(curves.values()))[key] is not None]
    fig, axes = plt.subplots(1, len(scopes), figsize=(6 * len(scopes), 4.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], scopes, strict=True):
        for name, res in curves.items():
            ax.plot(res["ratios"], res[key], "o--" if name.startswith("sch") else "o-", label=name)
        for g in report["guidance"]:
            if g["curve"].startswith("sch") and g["scope"] == ("per_layer" if key == "layer_mean" else "pooled"):
                ax.plot([g["ratio"]], [g["hit_rate"]], "k*", markersize=11)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache ratio ρ = slots / active experts")
        ax.set_ylabel("hit rate")
        ax.set_title(f"{title} (★: recommended ρ for SCH)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "hit_rates.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
