"""The planner's headline at the start of an accelerator run: estimated peak per rank against the device's capacity.

The planner (`python -m mindvl.plan`: what `mindvl plan --json` prints) runs in a child process (it needs its own
fake process group, and takes a minute or more at full size), started before the model is built; the trainer prints
its one-line headline when it is ready, and a plan that does not fit is printed as a warning. Nothing here stops
or slows training.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from mindvl.children import child_env, python_command
from mindvl.config import Recipe

from .parallel import ParallelEnv


class PlannerHeadline:
    def __init__(self, recipe: Recipe, env: ParallelEnv, out: Path):
        self.proc: subprocess.Popen | None = None
        self.printed = False
        if not env.is_main or env.device.type == "cpu":
            return
        device = _device_name(env)
        if device is None:
            return
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        path = out / "plan_recipe.yaml"
        path.write_text(yaml.safe_dump(recipe.to_dict()))
        cmd, child = planner_command(path, env.world_size, device)
        self.log = (out / "plan.json").open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.DEVNULL, env=child)

    def poll(self) -> str | None:
        """The headline once the planner has finished (once), else None."""
        if self.proc is None or self.printed or self.proc.poll() is None:
            return None
        self.printed = True
        self.log.close()
        if self.proc.returncode != 0:
            return f"planner: could not plan this run (try `mindvl plan {self.out / 'plan_recipe.yaml'} ...`)"
        d = json.loads((self.out / "plan.json").read_text())
        gib = 2**30
        return (f"planner: estimated peak {d['peak_bytes_per_rank'] / gib:.1f} GiB + {d['reserve_bytes'] / gib:.1f} "
                f"GiB reserve per rank of {d['capacity_bytes'] / gib:.1f} GiB on {d['device']['name']}"
                + ("" if d["fits"] else " -- WARNING: the plan does not fit"))


def planner_command(recipe: Path, world_size: int, device: str) -> tuple[list[str], dict[str, str]]:
    """The planner's own entry point (mindvl.plan.__main__, the JSON of `mindvl plan --json`), not the CLI, with
    its environment: no accelerator, and the safe path (`-m` would otherwise import a `mindvl/` package planted in
    the working directory)."""
    cmd = python_command("-m", "mindvl.plan", str(recipe), "--world-size", str(world_size), "--device", device)
    return cmd, child_env(CUDA_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="")


def _device_name(env: ParallelEnv) -> str | None:
    """The runtime's device name; `mindvl plan --device` reads it (and says so if it does not know the device)."""
    import torch

    if env.device.type == "cuda":
        return torch.cuda.get_device_name(env.device)
    if env.device.type == "npu":
        return torch.npu.get_device_name(env.device)  # type: ignore[attr-defined]
    return None
