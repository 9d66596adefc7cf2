"""Helpers for the curation tests: run a pipeline from a dict, read what it kept."""

from __future__ import annotations

import json
import os

from mindvl.curate import PipelineConfig, iter_output, run_pipeline

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "mindvl", "assets", "tokenizer", "tokenizer.json")


def run(inputs: list[str], out: str, stages: list[dict], **top) -> tuple[dict, list]:
    """Run a pipeline; returns (report.json, output Items)."""
    cfg = PipelineConfig.from_dict({"inputs": inputs, "output": out, "stages": stages, **top})
    run_pipeline(cfg)
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    return report, list(iter_output(out))


def dropped(report: dict, label: str) -> dict[str, int]:
    return report["stages"][label]["dropped"]


def shard_bytes(out: str) -> dict[str, bytes]:
    d = os.path.join(out, "shards")
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}
