"""The run report: `OUT/report.json`, `OUT/report.md` and PNGs beside them.

Counts in and out per stage and per drop reason (summed over shards), throughput per stage (records in / seconds
spent in the stage, summed over workers), score histograms, the global plans (duplicate groups; clusters with size,
variance and quota), OCR agreement, and a few example images per cluster taken from the output shards.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from .io import write_json_atomic
from .stages import Stage


def summarize(result) -> dict[str, Any]:
    """Per stage label: in, out, dropped {reason: n}, seconds, records_per_s (summed over every segment/shard)."""
    stages: dict[str, dict[str, Any]] = {}
    hist: dict[str, dict[str, list[int]]] = {}
    extra: dict[str, dict[str, Any]] = {}
    written = 0
    for seg_done in result.done:
        for d in seg_done:
            for label, s in d["stages"].items():
                if label == "read" and d["segment"] > 0:
                    continue  # re-reading an intermediate shard is not input
                acc = stages.setdefault(label, {"in": 0, "out": 0, "dropped": {}, "seconds": 0.0, "cpu_seconds": 0.0})
                acc["in"] += s["in"]
                acc["out"] += s["out"]
                acc["seconds"] += s["seconds"]
                acc["cpu_seconds"] += s.get("cpu_seconds", 0.0)
                for r, n in s["dropped"].items():
                    acc["dropped"][r] = acc["dropped"].get(r, 0) + n
            for label, hs in d.get("histograms", {}).items():
                for name, counts in hs.items():
                    cur = hist.setdefault(label, {}).setdefault(name, [0] * len(counts))
                    cur, counts = _same_bins(cur, counts)
                    hist[label][name] = [a + b for a, b in zip(cur, counts, strict=True)]
            for label, ex in d.get("extra", {}).items():
                cur = extra.setdefault(label, {})
                for k, v in ex.items():
                    if isinstance(v, dict):  # counters (e.g. OCR character counts): summed key by key
                        acc = cur.setdefault(k, {})
                        for kk, vv in v.items():
                            acc[kk] = acc.get(kk, 0) + vv
                    elif isinstance(v, (int, float)):
                        cur[k] = cur.get(k, 0) + v
                    else:
                        cur[k] = v
    for d in result.done[-1]:
        written += d["written"]
    for ex in extra.values():
        if "char_counts" in ex:
            from .stages.ocr import coverage

            ex["coverage"] = coverage(ex)
    for s in stages.values():
        s["records_per_s"] = s["in"] / s["seconds"] if s["seconds"] > 0 else None
    return {"stages": stages, "histograms": hist, "extra": extra, "written": written}


def _same_bins(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    """Two histograms of one score on the same bins: a shard counted by an older version (fewer, coarser bins over
    the same range) has the finer one summed down to its bins."""
    if len(a) == len(b):
        return a, b
    fine, coarse = (a, b) if len(a) > len(b) else (b, a)
    if len(fine) % len(coarse):
        raise ValueError(f"histograms with {len(a)} and {len(b)} bins cannot be added; rerun the curation into a "
                         "fresh output folder")
    k = len(fine) // len(coarse)
    fine = [sum(fine[i:i + k]) for i in range(0, len(fine), k)]
    return (fine, coarse) if len(a) > len(b) else (coarse, fine)


def _sorted_labels(labels) -> list[str]:
    def key(label: str):
        head = label.split(":", 1)[0]
        return (-1, 0, label) if head == "read" else (int(head), not label.endswith(":annotate"), label)

    return sorted(labels, key=key)


def write_report(cfg, stages: list[Stage], result) -> dict[str, Any]:
    summary = summarize(result)
    report = {"pipeline": cfg.to_dict(), "fingerprint": cfg.fingerprint(), "output": result.out,
              "written": summary["written"], "seconds": result.seconds, "segment_seconds": result.segment_seconds,
              "stages": summary["stages"], "histograms": summary["histograms"], "extra": summary["extra"],
              "plans": result.plans}
    hist_specs = {}
    for i, st in enumerate(stages):
        for name, h in st.histograms.items():
            hist_specs[f"{i}:{st.name}/{name}"] = (h.lo, h.hi, h.bins)  # bins: bars to draw (counts are finer)
    write_json_atomic(os.path.join(result.out, "report.json"), report)
    pngs = _plots(result.out, summary, result.plans, hist_specs)
    with open(os.path.join(result.out, "report.md.tmp"), "w") as f:
        f.write(_markdown(report, pngs))
    os.replace(os.path.join(result.out, "report.md.tmp"), os.path.join(result.out, "report.md"))
    return report


def _markdown(report: dict, pngs: dict[str, str]) -> str:
    lines = ["# Curation report", "", f"Output: `{report['output']}` — {report['written']} records written in "
             f"{report['seconds']:.1f} s (pipeline fingerprint `{report['fingerprint']}`).", "",
             "## Records per stage", "", "| stage | in | out | dropped (reason: n) | records/s |",
             "|---|---|---|---|---|"]
    for label in _sorted_labels(report["stages"]):
        s = report["stages"][label]
        drops = ", ".join(f"{r}: {n}" for r, n in sorted(s["dropped"].items())) or "-"
        rate = f"{s['records_per_s']:.0f}" if s["records_per_s"] else "-"
        lines.append(f"| {label} | {s['in']} | {s['out']} | {drops} | {rate} |")
    lines += ["", "records/s: records entering the stage / seconds spent in it, summed over workers.", ""]
    if "funnel" in pngs:
        lines += [f"![records per stage]({pngs['funnel']})", ""]
    if "hist" in pngs:
        lines += ["## Score histograms", "", f"![histograms]({pngs['hist']})", ""]
    for label, plan in report["plans"].items():
        lines += [f"## Plan of {label}", ""]
        clusters = plan.get("clusters")
        if clusters:
            lines += [f"{plan['records']} records, {plan['top_level']} top-level clusters, re-clustered: "
                      f"{plan['reclustered'] or 'none'}; target {plan['target']}, floor {plan['floor']}.", "",
                      "| cluster | size | semantic dups | variance | quota |", "|---|---|---|---|---|"]
            for c in clusters:
                lines.append(f"| {c['cluster']} | {c['size']} | {c['semantic_duplicates']} | {c['variance']:.4g} | "
                             f"{c['quota']} |")
            lines.append("")
            if "clusters" in pngs:
                lines += [f"![clusters]({pngs['clusters']})", ""]
            if "examples" in pngs:
                lines += [f"![examples per cluster]({pngs['examples']})", ""]
        else:
            lines += ["```", *(f"{k}: {v}" for k, v in sorted(plan.items())), "```", ""]
    for label, ex in report["extra"].items():
        if "ocr_images" in ex:
            n = max(ex["ocr_images"], 1)
            agreed = ex.get("images_with_agreement", 0)
            lines += [f"## OCR ({label})", "",
                      f"{ex['ocr_images']} images; lines read by engine A {ex.get('lines_a', 0)}, by engine B "
                      f"{ex.get('lines_b', 0)}, in agreement {ex.get('lines_kept', 0)}; images with at least one "
                      f"agreed line: {agreed} ({agreed / n:.1%}).", ""]
            cov = ex.get("coverage")
            if isinstance(cov, dict):
                lines += ["Coverage of the kept text: " + ", ".join(f"{k}: {v}" for k, v in cov.items()), ""]
    return "\n".join(lines) + "\n"


def _plots(out: str, summary: dict, plans: dict, hist_specs: dict) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs: dict[str, str] = {}

    def save(fig, name: str, key: str) -> None:
        fig.savefig(os.path.join(out, name), dpi=80)
        plt.close(fig)
        pngs[key] = name

    if summary["stages"]:
        save(funnel_figure(summary), "report_funnel.png", "funnel")
    if any(summary["histograms"].values()):
        save(histograms_figure(summary, hist_specs), "report_histograms.png", "hist")
    for plan in plans.values():
        clusters = plan.get("clusters")
        if not clusters:
            continue
        save(clusters_figure(clusters), "report_clusters.png", "clusters")
        grid = _example_grid(out, clusters)
        if grid:
            pngs["examples"] = grid
    return pngs


def funnel_figure(summary: dict):
    """Records in (grey) and out (green) per stage, each bar labelled `out / in`."""
    import matplotlib.pyplot as plt

    labels = _sorted_labels(summary["stages"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.4))
    ins = [summary["stages"][lab]["in"] for lab in labels]
    outs = [summary["stages"][lab]["out"] for lab in labels]
    y = np.arange(len(labels))
    bars = ax.barh(y, ins, color="#ccc", label="in")
    ax.barh(y, outs, color="#4a7", label="out")
    ax.bar_label(bars, labels=[f"{o} / {i}" for o, i in zip(outs, ins, strict=True)], padding=3, fontsize=8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(ins, default=0), 1) * 1.2)  # room for the labels right of the longest bar
    ax.set_xlabel("records")
    ax.set_title("Records per stage (out / in)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def histogram_bars(counts: list[int], lo: float, hi: float, bars: int) -> tuple[np.ndarray, np.ndarray]:
    """(edges, counts) of at most `bars` equal bars over the bins the data occupies (whole fine bins grouped), so
    the plot spans the data's range rather than the score's whole range."""
    counts_a = np.asarray(counts)
    edges = np.linspace(lo, hi, len(counts_a) + 1)
    occupied = np.flatnonzero(counts_a)
    if occupied.size == 0:
        return edges[:2], np.zeros(1, dtype=np.int64)
    first, last = int(occupied[0]), int(occupied[-1])
    group = -(-(last - first + 1) // max(1, bars))  # fine bins per bar
    n_bars = -(-(last - first + 1) // group)
    stop = min(first + n_bars * group, len(counts_a))
    grouped = np.add.reduceat(counts_a[first:stop], np.arange(0, stop - first, group))
    bar_edges = np.append(edges[first:stop:group], edges[stop])
    return bar_edges, grouped


def histograms_figure(summary: dict, hist_specs: dict):
    """One panel per score: bars over the range its records span, axes labelled (score, records); a last bin that
    also counts values beyond the score's range says so in the label."""
    import matplotlib.pyplot as plt

    hists = [(f"{label}/{name}", counts) for label, hs in summary["histograms"].items() for name, counts in hs.items()]
    fig, axes = plt.subplots(1, len(hists), figsize=(3.4 * len(hists), 2.9), squeeze=False)
    for ax, (name, counts) in zip(axes[0], hists, strict=True):
        lo, hi, bins = hist_specs.get(name, (0, len(counts), len(counts)))
        edges, grouped = histogram_bars(counts, lo, hi, bins)
        ax.bar(edges[:-1], grouped, width=np.diff(edges), align="edge", color="#47a", edgecolor="white",
               linewidth=0.5)
        ax.set_xlim(edges[0], edges[-1])
        ax.text(0.98, 0.95, f"n = {int(sum(counts))}", transform=ax.transAxes, ha="right", va="top", fontsize=7)
        score = name.rsplit("/", 1)[-1]
        clipped = f"\n(the last bar also counts values > {hi:g})" if counts and counts[-1] else ""
        ax.set_xlabel(score + clipped, fontsize=8)
        ax.set_ylabel("records", fontsize=8)
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def clusters_figure(clusters: list[dict]):
    """Per cluster its size and quota (bars, labelled when there are few; legend above the axes, off the data) and,
    in a panel below on the same clusters, its embedding variance."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(max(6, 0.35 * len(clusters)), 4.4),
                                   gridspec_kw={"height_ratios": [2, 1]})
    x = np.arange(len(clusters))
    sizes = ax1.bar(x - 0.2, [c["size"] for c in clusters], 0.4, label="size", color="#bbb")
    quotas = ax1.bar(x + 0.2, [c["quota"] for c in clusters], 0.4, label="quota (kept)", color="#4a7")
    if len(clusters) <= 30:
        for bars in (sizes, quotas):
            ax1.bar_label(bars, padding=1, fontsize=6)
    ax1.margins(y=0.12)
    ax1.set_ylabel("records")
    ax2.plot(x, [c["variance"] for c in clusters], "o-", color="#c43")
    ax2.set_ylabel("variance")
    ax2.margins(y=0.15)
    ax2.set_xticks(x, [c["cluster"] for c in clusters], rotation=90, fontsize=7)
    ax2.set_xlabel("cluster")
    fig.legend([sizes, quotas], ["size", "quota (kept)"], loc="upper center", ncol=2, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _example_grid(out: str, clusters: list[dict], max_clusters: int = 12, thumb: int = 64) -> str | None:
    """One row per cluster (the largest ones), its example records' first images."""
    from PIL import Image

    from .io import iter_output

    wanted = {k: c["cluster"] for c in sorted(clusters, key=lambda c: -c["quota"])[:max_clusters]
              for k in c["examples"]}
    if not wanted:
        return None
    images: dict[str, list] = {}
    for item in iter_output(out):
        if item.key in wanted and item.images:
            try:
                im = Image.open(io.BytesIO(item.images[0])).convert("RGB")
            except Exception:
                continue
            im.thumbnail((thumb, thumb))
            images.setdefault(wanted[item.key], []).append(im)
    if not images:
        return None
    from PIL import ImageDraw

    rows = sorted(images)
    cols = max(len(v) for v in images.values())
    label_w = 48
    canvas = Image.new("RGB", (label_w + cols * (thumb + 4), len(rows) * (thumb + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r, name in enumerate(rows):
        draw.text((4, r * (thumb + 4) + thumb // 2 - 6), name, fill=(0, 0, 0))  # the cluster, left of its row
        for c, im in enumerate(images[name]):
            canvas.paste(im, (label_w + c * (thumb + 4), r * (thumb + 4)))
    canvas.save(os.path.join(out, "report_examples.png"))
    return "report_examples.png"
