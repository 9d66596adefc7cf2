"""MindVL-8B at full size on simulated clusters: does every phase fit, the smallest world size per device, and the
old training step against the new one.

    python benchmarks/bench_plan_8b.py [--phases sft-8k multitask ...] [--worlds 8 16] [--before]

Each (phase, world size) is one `mindvl.plan.plan` trace (the real model, prepare_model and step on fake tensors);
verdicts for every device come from that trace (devices differ in capacity and reserve, not in what is resident).
The smallest fitting world size is extrapolated from the trace (sharded parts scale as 1/N; see
`planner.extrapolate_peak`) and marked as such unless it was traced.

`--before` traces the step as it was before issue 10: every micro-batch of the step resident (the old loop loaded
them all before the first forward), unsharded gradient accumulation, and the old loss head (fp32 [V, H] weight
gradient built in the forward), kept below verbatim for this comparison only.
"""

from __future__ import annotations

import argparse
import subprocess

import torch

from mindvl.config import load_recipe
from mindvl.models import loss as loss_module
from mindvl.plan import DEVICES, plan
from mindvl.plan.devices import GIB
from mindvl.plan.planner import extrapolate_peak, reserve_bytes

PHASES = ("warmup", "multitask", "sft-2k", "sft-4k", "sft-8k")
SHOW = ("h100-80g", "910b2-64g", "a100-80g", "h200")


class OldChunkedLinearCrossEntropy(torch.autograd.Function):
    """mindvl's loss head at dd5a944 (before issue 10)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            t = targets[start : start + chunk_size]
            logits = (h @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if need_h or need_w:
                grad_logits = torch.softmax(logits, dim=-1)
                grad_logits[torch.arange(len(t), device=t.device), t] -= 1.0
                if need_h:
                    grad_h[start : start + chunk_size] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_w += grad_logits.T @ h.float()
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def smallest_world(result, device, gb: int) -> tuple[int | None, bool]:
    """(smallest world size dividing the global batch whose extrapolated peak fits, was it the traced one)."""
    for w in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        if gb % w:
            continue
        peak = result.peak_bytes_per_rank if w == result.world_size else extrapolate_peak(result, w)
        if peak + reserve_bytes(device, peak) <= device.memory_bytes:
            return w, w == result.world_size
    return None, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--phases", nargs="+", default=list(PHASES))
    ap.add_argument("--worlds", type=int, nargs="+", default=[8])
    ap.add_argument("--before", action="store_true")
    args = ap.parse_args()
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    step = "old step (before issue 10)" if args.before else "new step"
    print(f"| phase | ranks | step | peak GiB | params | grads | optim | activations | loss head | data | "
          f"{' | '.join(f'{d} fits (headroom)' for d in SHOW)} | smallest world per device | trace s |")
    print("| --- " * (11 + len(SHOW)) + "|")
    if args.before:
        new = loss_module.ChunkedLinearCrossEntropy.forward, loss_module.ChunkedLinearCrossEntropy.backward
        loss_module.ChunkedLinearCrossEntropy.forward = OldChunkedLinearCrossEntropy.forward
        loss_module.ChunkedLinearCrossEntropy.backward = OldChunkedLinearCrossEntropy.backward
    for phase in args.phases:
        overrides = ["parallel.grad_accumulation=unsharded"] if args.before else []
        recipe = load_recipe(f"recipes/mindvl-8b/{phase}.yaml", overrides)
        for world in args.worlds:
            r = plan(recipe, world, DEVICES["h100-80g"], recipe_name=phase)
            b = dict(r.breakdown)
            for part in ("parameters", "gradients"):  # this table's columns: owned shards + FSDP's unsharded copies
                b[part] += b.pop(f"unsharded_{part}", 0)
            if args.before:  # the old loop held all of the step's packs (fp32 pixel rows); the trace, its window
                per_pack = r.packs[0]["patches"] * 1176 * 4
                extra = int(per_pack * r.accumulation - b["data_buffers"])
                b["data_buffers"] += extra
                r.peak_bytes_per_rank += extra
            cells = []
            for name in SHOW:
                dev = DEVICES[name]
                total = r.peak_bytes_per_rank + reserve_bytes(dev, r.peak_bytes_per_rank)
                cells.append(f"{'yes' if total <= dev.memory_bytes else 'NO'} ({1 - total / dev.memory_bytes:.0%})")
            smallest = []
            for name in ("h100-80g", "910b2-64g"):
                w, traced = smallest_world(r, DEVICES[name], recipe.batch.global_batch_size)
                smallest.append(f"{name}: {w}{'' if traced or w is None else ' (extrapolated)'}")
            g = GIB
            print(f"| {phase} | {world} | {step} | {r.peak_bytes_per_rank / g:.1f} | {b['parameters'] / g:.1f} | "
                  f"{b['gradients'] / g:.1f} | {b['optimizer_state'] / g:.1f} | {b['activations'] / g:.1f} | "
                  f"{b['loss_temporaries'] / g:.1f} | {b['data_buffers'] / g:.2f} | {' | '.join(cells)} | "
                  f"{'; '.join(smallest)} | {r.trace_s:.0f} |", flush=True)
    if args.before:
        loss_module.ChunkedLinearCrossEntropy.forward, loss_module.ChunkedLinearCrossEntropy.backward = new


if __name__ == "__main__":
    main()
