"""The planner on the accelerator proof's recipe, on this machine's CPU, beside what the GPU measured.

    PYTHONPATH=. python benchmarks/bench_plan_vs_proof.py [--out plan.json] [--world-size 1] [--layers T,V]

The proof (benchmarks/accelerator_proof.py, sections `plan` and `mindvl`) planned its mid composition (a
Qwen2.5-VL-7B-shaped ViT + a Qwen3-1.7B-shaped LLM, 2.70B parameters, 8K packs, bf16, full activation checkpointing,
fused AdamW, one rank) and ran the same step sequence on an H200. Planning needs only the composition's config.json,
which this script writes from the proof's own shapes (no weights, no `prepare`), so the plan is the proof's plan
section without the GPU. `--layers T,V` keeps T decoder layers and V ViT blocks (a cheaper trace, for the CI check in
tests/plan/test_plan_vs_proof.py). Prints one JSON object: the plan's peak, breakdown, reserve and optimizer bytes
per parameter, the torch it traced with, and the recorded GPU figures (tests/plan/data/proof_h200.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROOF_DATA = HERE.parent / "tests" / "plan" / "data" / "proof_h200.json"


def proof_config_folder(folder: Path, layers: tuple[int, int] | None = None) -> Path:
    """Write the proof's mid composition as mindvl's config.json under `folder` (what `prepare` would convert);
    `layers` = (decoder layers, ViT blocks) instead of the full (28, 32)."""
    sys.path.insert(0, str(HERE))
    import accelerator_proof as proof

    from mindvl.checkpoint.hf import _write_config, mindvl_config_from_hf

    s = proof.shapes(False)
    if layers is not None:
        text_layers, blocks = layers
        s["text"] = {**s["text"], "num_hidden_layers": text_layers}
        full = [i for i in s["vision"]["fullatt_block_indexes"] if i < blocks] or [blocks - 1]
        s["vision"] = {**s["vision"], "depth": blocks, "fullatt_block_indexes": full}
    raw = {"model_type": "qwen2_5_vl", **proof.hf_config(s, proof.peers_module())}
    folder.mkdir(parents=True, exist_ok=True)
    _write_config(folder, mindvl_config_from_hf(raw, folder))
    return folder


def plan_proof(work: Path, world_size: int = 1, layers: tuple[int, int] | None = None, device: str = "h100-80g"):
    """The PlanResult of the proof's recipe (`accelerator_proof.plan_recipe`) on `world_size` x `device`."""
    sys.path.insert(0, str(HERE))
    import accelerator_proof as proof

    from mindvl.config import load_recipe
    from mindvl.plan import get_device, plan

    proof_config_folder(work / "mindvl", layers)
    recipe = load_recipe(raw=proof.plan_recipe(work, proof.shapes(False)))
    return plan(recipe, world_size, get_device(device), recipe_name="proof mid-size SFT 8K")


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--layers", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                   metavar="T,V", help="decoder layers, ViT blocks (default: the proof's 28, 32)")
    p.add_argument("--device", default="h100-80g")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = plan_proof(Path(tmp), args.world_size, args.layers, args.device)
    d = r.to_dict()
    gib = 2**30
    trainable = d["params"]["trainable"] / args.world_size
    out = {"torch": torch.__version__, "world_size": args.world_size, "layers": args.layers,
           "peak_gib": d["peak_bytes_per_rank"] / gib, "reserve_gib": d["reserve_bytes"] / gib,
           "optimizer_bytes_per_param": d["breakdown"]["optimizer_state"] / trainable,
           "breakdown_gib": {k: v / gib for k, v in d["breakdown"].items()}, "plan": d}
    if PROOF_DATA.is_file():
        rec = json.loads(PROOF_DATA.read_text())
        out["measured"] = rec
        out["peak_over_max_allocated"] = d["peak_bytes_per_rank"] / rec["max_allocated_bytes"]
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
