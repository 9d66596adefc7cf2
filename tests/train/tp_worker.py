"""torchrun worker for test_tensor_parallel: one forward/backward of the tiny recipe's model (packed multi-sample
rows with images and M-RoPE) under `parallel.tensor_parallel` (x FSDP over the rest of the world) equals the same
packs through a plain one-process copy of the model: the loss sum, and every parameter's gradient (TP and FSDP
shards gathered back). `python tp_worker.py TMP TP [FAMILY [CHECKPOINTING]]`; prints OK on rank 0."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from train_helpers import ODD_VOCAB, recipe_and_packs

from mindvl.config import ParallelSection
from mindvl.train.materialize import build_model, canonical_name
from mindvl.train.parallel import ParallelEnv, ParallelLayout, parallelize


def main() -> None:
    tmp, tp = Path(sys.argv[1]), int(sys.argv[2])
    family = sys.argv[3] if len(sys.argv) > 3 else "qwen3"
    checkpointing = sys.argv[4] if len(sys.argv) > 4 else "off"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ParallelSection(tensor_parallel=tp, activation_checkpointing=checkpointing)
    layout = ParallelLayout.from_config(cfg, world, rank)
    env = ParallelEnv(rank, world, 0, torch.device("cpu"), "gloo", layout)
    recipe, tok, packs = recipe_and_packs(tmp / f"r{rank}", n=2 * layout.dp_size)
    recipe.model.arch["text"]["vocab_size"] = ODD_VOCAB  # 701 rows: a vocabulary split that floors V / N fails
    if family == "qwen2":  # Qwen2.5-VL's LLM: qkv bias, no q/k norm
        recipe.model.arch["text"]["family"] = "qwen2"
    assert all(len(p["cu_seqlens"]) > 2 and p["pixel_values"].shape[0] > 0 for p in packs), "want packed rows"

    reference = build_model(recipe, tok, env)  # plain fp32, the same seeded weights
    model = build_model(recipe, tok, env, lambda meta: parallelize(meta, env, cfg))
    mine = packs[layout.dp_rank::layout.dp_size]  # this data shard's packs (its TP ranks share them)

    total = torch.zeros((), dtype=torch.float64)
    for batch in mine:
        loss, _ = model(**batch)
        (loss * layout.dp_size).backward()  # what the step does: FSDP averages over the data-parallel ranks
        total += loss.detach().double()
    dist.all_reduce(total)
    total /= tp
    ref_total = torch.zeros((), dtype=torch.float64)
    for batch in packs:
        loss, _ = reference(**batch)
        loss.backward()
        ref_total += loss.detach().double()
    assert abs(float(total) - float(ref_total)) <= 1e-5 * abs(float(ref_total)), (float(total), float(ref_total))

    ref_grads = {canonical_name(n): p.grad for n, p in reference.named_parameters()}
    split = 0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref_grads[canonical_name(name)]
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=name)
        split += any(mesh_dim == "tp" for mesh_dim in (p.device_mesh.mesh_dim_names or ()))
    assert split > 0, "no parameter is split over the tensor-parallel mesh"
    if rank == 0:
        print(f"OK loss {float(total):.6f} vs {float(ref_total):.6f}; {split} parameters on the tp mesh")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
