"""Fixtures shared by the training tests' modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import schedule, two_rank_recipe


@pytest.fixture(scope="session")
def two_rank_reference(tmp_path_factory) -> Path:
    """`two_rank_recipe` (2 ranks, 6 steps, no checkpoints) trained once, never interrupted, through the requeue
    tests' scheduler loop (torchrun, one attempt): the output folder the preempted runs of test_requeue.py and
    test_longrun_processes.py must reproduce bit for bit. One run serves both modules (~20 s of CPU each)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = schedule(tmp, two_rank_recipe(tmp, "ref"), tmp / "ref")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "attempt 1: exit 0", out
    return tmp / "ref"
