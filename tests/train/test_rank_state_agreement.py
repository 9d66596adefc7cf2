"""A damaged rank_*.json that only its own rank reads: every rank stops with the same one-line error (resume=PATH)
or falls back to the same older checkpoint (resume=auto); two gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

from train_helpers import run_ranks

WORKER = Path(__file__).with_name("rank_state_worker.py")


def test_one_ranks_damaged_state_is_agreed(tmp_path):
    # 2 ranks with torchrun's environment, forked from the tests' fork server (train_helpers.run_ranks: no launcher)
    r = run_ranks(tmp_path, 2, [str(tmp_path / "ckpts")], timeout=240, script=WORKER)
    assert r.returncode == 0, r.stderr[-3000:]
    out = [json.loads((tmp_path / f"out_{rank}.json").read_text()) for rank in (0, 1)]
    # resume=PATH: the same one-line error on both ranks, naming the file and the rank that found it
    errors = [o["by_path"].get("error") for o in out]
    assert errors[0] is not None and errors[0] == errors[1] and "\n" not in errors[0]
    assert "step_00000002/rank_00001.json is damaged" in errors[0] and "[rank 1]" in errors[0]
    # resume=auto: both ranks fall back to step 1, each with its own state from there
    assert [o["auto"].get("got") for o in out] == [["step_00000001", {"data": {"rank": rank, "step": 1}}]
                                                   for rank in (0, 1)]
    assert "is unreadable, resuming from step_00000001" in r.stderr
