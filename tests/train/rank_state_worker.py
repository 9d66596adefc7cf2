"""Worker of test_rank_state_agreement (2 gloo processes): save two checkpoints, damage rank 1's RNG state in the
newest, then load it by path and with resume=auto; each rank writes what it got to out_RANK.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mindvl.checkpoint.training import CheckpointReadError, load_checkpoint, load_newest_readable, save_checkpoint


def attempt(load) -> dict:
    try:
        return {"got": load()}
    except CheckpointReadError as exc:
        return {"error": str(exc)}


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        save_checkpoint(root, step, model, opt, {"step": step, "tokens": 0}, {"data": {"rank": rank, "step": step}})
    if rank == 0:  # valid JSON, only rank 1 reads its RNG state: a damage only rank 1 can see
        path = root / "step_00000002" / "rank_00001.json"
        state = json.loads(path.read_text())
        state["rng"]["torch"] = "!!"
        path.write_text(json.dumps(state))
    dist.barrier()
    out = {"by_path": attempt(lambda: load_checkpoint(root / "step_00000002", model, opt)[1]),
           "auto": attempt(lambda: (lambda f: [f[0].name, f[2]])(load_newest_readable(root, model, opt)))}
    dist.barrier()  # a rank that went on alone would wait here for ever (the test's timeout)
    (root.parent / f"out_{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
