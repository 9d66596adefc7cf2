"""QLoRA and adapter checkpoints, measured (issue 25).

    PYTHONPATH=.:DEPS python benchmarks/bench_qlora.py [--sections dequant memory checkpoint] [--json OUT]

- dequant: the allocator high-water of one NF4 linear's forward + backward (torchao dequantizes the weight in both),
  in bytes per weight, bf16 and fp32 (c10's CPU allocator total under the profiler: mindvl.plan.validate); what the
  planner adds for the largest adapted weight (mindvl.train.qlora.DEQUANT_BYTES_PER_PARAM).
- memory: the frozen base of a Qwen3-8B-shaped decoder layer's 7 linear layers (hidden 4096, MLP 12288, 8 KV heads of
  128) held as bf16 vs NF4: storage bytes per weight as allocated.
- checkpoint: the packaged `tiny/lora` recipe (its model and adapters; 60 synthetic samples per source instead of
  thousands, 2 steps) checkpointed with the frozen base referenced (now) vs copied (before: the same run with the
  reference left out of the train state, which makes the save write every weight): bytes of the step folder.
The dequant and memory sections need torchao (`pip install 'mindvl[qlora]'`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F


def dequant() -> dict:
    from mindvl.plan.validate import allocator_high_water
    from mindvl.train.qlora import quantized

    out = {}
    for shape in [(1024, 512), (2048, 1024), (4096, 1024)]:
        for dtype in (torch.bfloat16, torch.float32):
            w = quantized(torch.randn(shape, dtype=dtype) * 0.02)
            x = torch.randn(4, shape[1], dtype=dtype, requires_grad=True)
            with torch.profiler.profile(profile_memory=True) as prof:
                F.linear(x, w).sum().backward()
            high = allocator_high_water(prof)
            out[f"{shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')}"] = round(high / w.numel(), 2)
    return {"bytes_per_weight_at_high_water": out}


def memory() -> dict:
    from mindvl.train.qlora import quantized

    h, inter, kv = 4096, 12288, 8 * 128
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    numel = bf16 = nf4 = 0
    for shape in shapes.values():
        w = torch.randn(shape, dtype=torch.bfloat16) * 0.02
        q = quantized(w)
        numel += w.numel()
        bf16 += w.untyped_storage().nbytes()
        nf4 += sum(getattr(q, a).untyped_storage().nbytes() for a in ("quantized_data", "quantized_scalers",
                                                                       "quantization_factor", "scaler_mean"))
        del w, q
    return {"weights": numel, "bf16_bytes_per_weight": bf16 / numel, "nf4_bytes_per_weight": round(nf4 / numel, 4),
            "ratio": round(nf4 / bf16, 4)}


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def checkpoint() -> dict:
    from mindvl.config import load_recipe
    from mindvl.train import trainer as trainer_mod
    from mindvl.train.trainer import train

    out = {}
    root = Path(tempfile.mkdtemp(prefix="bench-qlora-"))
    try:
        for arm in ("referenced", "copied"):
            recipe = load_recipe("tiny/lora", [f"output_dir={root / arm}", "max_steps=2",
                                                             "checkpoint.every=2", "logging.progress=false",
                                                             f"data.synth_cache={root / 'cache'}"])
            for source in recipe.data.sources:  # a small synthetic set: the checkpoint does not depend on it
                source.synth.n = 60
            original = trainer_mod.Trainer.train_state
            if arm == "copied":  # the checkpoint as it was before: no base reference, so every weight is saved
                def without_reference(self, original=original):
                    state = original(self)
                    state.pop("frozen_base", None)
                    return state

                trainer_mod.Trainer.train_state = without_reference
            try:
                result = train(recipe)
            finally:
                trainer_mod.Trainer.train_state = original
            step = result.output_dir / "checkpoints" / "step_00000002"
            out[arm] = {"step_folder_bytes": _folder_bytes(step),
                        "dcp_bytes": sum(p.stat().st_size for p in step.glob("*.distcp"))}
        out["final_dir_bytes"] = _folder_bytes(result.final_dir)
        out["ratio"] = round(out["referenced"]["step_folder_bytes"] / out["copied"]["step_folder_bytes"], 4)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


SECTIONS = {"dequant": dequant, "memory": memory, "checkpoint": checkpoint}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    results = {}
    for name in args.sections:
        results[name] = SECTIONS[name]()
        print(json.dumps({name: results[name]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
