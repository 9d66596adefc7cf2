"""Helpers for the curation tests: run a pipeline from a dict, read what it kept."""

from __future__ import annotations

import json
import os

import pytest

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


def assert_kept_exactly(report: dict, items: list, direct: dict[str, float], kept: set[str], n_records: int,
                        stage: str, reason: str, **tol) -> None:
    """A score filter (the first stage of its pipeline) kept exactly the ids in `kept` (some, not all), wrote each kept
    record's score as `direct` computed it (within `tol`, pytest.approx's rel/abs), counted every other record under
    `reason` and put every record's score into the report's histogram."""
    assert 0 < len(kept) < n_records
    assert {it.record["id"] for it in items} == kept
    for it in items:
        assert it.meta[stage] == pytest.approx(direct[it.record["id"]], **tol)
    assert dropped(report, f"0:{stage}") == {reason: n_records - len(kept)}
    assert sum(report["histograms"][f"0:{stage}"][stage]) == n_records
