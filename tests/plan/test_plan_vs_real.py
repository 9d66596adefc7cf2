"""The planner's prediction against the same step on real tensors (one process, bf16, checkpointing, 2 micro-batches),
measured by the same tracker: within 15% (benchmarks/bench_plan_vs_real.py does 1, 2 and 4 processes)."""

from __future__ import annotations

import pytest
from test_plan import reduced_recipe

from mindvl.plan import get_device, plan
from mindvl.plan.validate import measure_real_step


@pytest.mark.slow
def test_planned_peak_matches_the_real_step(tmp_path):
    recipe = reduced_recipe(tmp_path, 2, mixed_precision="bf16", activation_checkpointing=True)
    real = measure_real_step(recipe)
    planned = plan(recipe, 1, get_device("h100-80g"), sample_data=True)
    assert planned.peak_bytes_per_rank == pytest.approx(real["peak_bytes"], rel=0.15)
    # and part by part where the two must agree exactly: the optimizer state and the data window
    assert planned.breakdown["optimizer_state"] == real["breakdown"]["optimizer_state"]
    assert planned.breakdown["data_buffers"] == real["breakdown"]["data_buffers"]
