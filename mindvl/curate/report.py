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
            hist_specs[f"{i}:{st.name}/{name}"] = (h.lo, h.hi, h.bins)
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
    labels = _sorted_labels(summary["stages"])
    if labels:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.2))
        ins = [summary["stages"][lab]["in"] for lab in labels]
        outs = [summary["stages"][lab]["out"] for lab in labels]
        y = np.arange(len(labels))
        ax.barh(y, ins, color="#ccc", label="in")
        ax.barh(y, outs, color="#4a7", label="out")
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.legend()
        ax.set_xlabel("records")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "report_funnel.png"), dpi=80)
        plt.close(fig)
        pngs["funnel"] = "report_funnel.png"
    hists = [(f"{label}/{name}", counts) for label, hs in summary["histograms"].items() for name, counts in hs.items()]
    if hists:
        fig, axes = plt.subplots(1, len(hists), figsize=(3.2 * len(hists), 2.6), squeeze=False)
        for ax, (name, counts) in zip(axes[0], hists, strict=True):
            lo, hi, bins = hist_specs.get(name, (0, len(counts), len(counts)))
            edges = np.linspace(lo, hi, bins + 1)
            ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#47a")
            ax.set_title(name, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "report_histograms.png"), dpi=80)
        plt.close(fig)
        pngs["hist"] = "report_histograms.png"
    for plan in plans.values():
        clusters = plan.get("clusters")
        if not clusters:
            continue
        fig, ax1 = plt.subplots(figsize=(max(6, 0.35 * len(clusters)), 3))
        x = np.arange(len(clusters))
        ax1.bar(x - 0.2, [c["size"] for c in clusters], 0.4, label="size", color="#bbb")
        ax1.bar(x + 0.2, [c["quota"] for c in clusters], 0.4, label="quota", color="#4a7")
        ax2 = ax1.twinx()
        ax2.plot(x, [c["variance"] for c in clusters], "o-", color="#c43", label="variance")
        ax1.set_xticks(x, [c["cluster"] for c in clusters], rotation=90, fontsize=7)
        ax1.legend(loc="upper left")
        ax2.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "report_clusters.png"), dpi=80)
        plt.close(fig)
        pngs["clusters"] = "report_clusters.png"
        grid = _example_grid(out, clusters)
        if grid:
            pngs["examples"] = grid
    return pngs


def _example_grid(out: str, clusters: list[dict], max_clusters: int = 12, thumb: int = 64) -> str | None:
    """One row per cluster (the largest ones), its example records' first images."""
    from PIL import Image

    from .runner import iter_output

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
