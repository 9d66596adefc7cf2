"""Devices, process groups and parallelism, applied to the model from outside (torchrun's environment).

- device/backend: cuda+nccl, npu+hccl (torch_npu imported only when present), cpu+gloo.
- expert parallelism (`parallel.expert_parallel`, mindvl.train.expert_parallel) before FSDP.
- FSDP2: `fully_shard` on every transformer block of both towers, then on the root (embeddings, projector, norm,
  head), with a bf16 MixedPrecisionPolicy on accelerators (fp32 reductions) and full fp32 on CPU.
- mixed precision on ONE device uses the same policy: a bf16 run of a single process is FSDP over a one-rank group
  (nothing is sharded or communicated), so its numerics are exactly FSDP's (fp32 master weights and optimizer
  state, bf16 compute, gradients cast to fp32 before they accumulate), never a silent fp32 run.
- activation checkpointing (`full`: whole blocks of both towers recomputed; `selective`: matmul/attention outputs
  kept and the element-wise ops recomputed) and torch.compile per block, as options.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mindvl.config import ParallelSection


@dataclass
class ParallelEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers the `npu` device)
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def detect_device(preference: str = "auto", local_rank: int = 0) -> tuple[torch.device, str]:
    """(device, process-group backend) for this process."""
    kind = preference
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "npu" if _npu_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("parallel.device: cuda requested but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if kind == "npu":
        if not _npu_available():
            raise ValueError("parallel.device: npu requested but torch_npu / an Ascend NPU is not available")
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return torch.device("npu", local_rank), "hccl"
    return torch.device("cpu"), "gloo"


def init_distributed(preference: str = "auto") -> ParallelEnv:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK; start the process group when there is more than one process."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device, backend = detect_device(preference, local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type != "cpu" else None)
    return ParallelEnv(rank, world, local, device, backend)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of both towers, in order (the FSDP/checkpointing/compile unit)."""
    out: list[nn.Module] = []
    if getattr(model, "visual", None) is not None:
        out.extend(model.visual.blocks)
    out.extend(model.language_model.layers)
    return out


def param_dtype(cfg: ParallelSection, device: torch.device) -> torch.dtype:
    if cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type != "cpu"):
        return torch.bfloat16
    return torch.float32


def _replace_blocks(model: nn.Module, fn) -> None:
    """Apply fn to every block, writing the result back into its ModuleList."""
    lists = [model.language_model.layers]
    if getattr(model, "visual", None) is not None:
        lists.insert(0, model.visual.blocks)
    for ml in lists:
        for i in range(len(ml)):
            ml[i] = fn(ml[i])


def checkpointing_mode(cfg: ParallelSection) -> str:
    """off | full | selective (a bool from code or an unvalidated section counts as full/off)."""
    ac = cfg.activation_checkpointing
    return ("full" if ac else "off") if isinstance(ac, bool) else ac


def _selective_policy():
    """Keep the outputs of matmuls and attention (expensive to recompute), recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every block of both towers (the vision tower's too: at native resolution its activations rival the
    LLM's)."""
    if mode == "off":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        _replace_blocks(model, lambda b: checkpoint_wrapper(b, preserve_rng_state=False))
        return
    from functools import partial

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context = partial(create_selective_checkpoint_contexts, _selective_policy())
    _replace_blocks(model, lambda b: checkpoint_wrapper(b, preserve_rng_state=False, context_fn=context))


def _single_process_group(env: ParallelEnv) -> None:
    """A one-rank process group (in-memory store), so FSDP's mixed-precision policy can run on a single device."""
    if not dist.is_initialized():
        dist.init_process_group(env.backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=env.device if env.device.type != "cpu" else None)


def uses_fsdp(cfg: ParallelSection, env: ParallelEnv) -> bool:
    """FSDP when asked, when distributed, or when bf16 mixed precision must run on a single device."""
    if cfg.fsdp == "on" or (cfg.fsdp == "auto" and env.distributed):
        return True
    return param_dtype(cfg, env.device) != torch.float32


def parallelize(model: nn.Module, env: ParallelEnv, cfg: ParallelSection) -> nn.Module:
    """Activation checkpointing, compile and FSDP2, in that order (AC inside compile inside FSDP)."""
    apply_activation_checkpointing(model, checkpointing_mode(cfg))
    if cfg.compile:
        for b in blocks(model):
            b.compile()
    if cfg.expert_parallel > 1 and not env.distributed:
        raise ValueError("parallel.expert_parallel: expert parallelism needs more than one process")
    if uses_fsdp(cfg, env):
        if not env.distributed:
            _single_process_group(env)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from .expert_parallel import shard_experts

        mp = MixedPrecisionPolicy(param_dtype=param_dtype(cfg, env.device), reduce_dtype=torch.float32)
        # experts first (EP over their own mesh dimension), then the rest over the whole world
        mesh = shard_experts(model, cfg.expert_parallel, env.world_size, env.device.type, mp)
        mesh = mesh if mesh is not None else init_device_mesh(env.device.type, (env.world_size,))
        for b in blocks(model):
            fully_shard(b, mesh=mesh, mp_policy=mp)
        embedding = own_embedding_group(model)
        if embedding is not None:
            fully_shard(embedding, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def own_embedding_group(model: nn.Module) -> nn.Module | None:
    """The language model's input embedding when it may be its own FSDP group (not tied to the head), else None.

    Why: FSDP2 never reshards the root group between forward and backward (the head is needed at once), so an
    embedding left in the root stays all-gathered in bf16 for the whole pass: 1.9 GB per rank for DeepSeek-V3's
    129280 x 7168 table, at the moment of the peak (the last MoE block's backward). As its own group it is gathered
    for its forward and again for its backward (one more all-gather of the table per micro-batch, ~1% of a 671B
    step's gathers). A tied embedding is also the head's weight, which the chunked loss reads outside any module
    call, so it stays in the root."""
    lm = model.language_model
    if getattr(lm, "lm_head", None) is None:
        return None
    return lm.embed_tokens


def all_reduce_sum(value: torch.Tensor, env: ParallelEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier(env: ParallelEnv) -> None:
    if env.distributed:
        dist.barrier()


def destroy(env: ParallelEnv) -> None:
    """End the process group: torchrun's, or the one-rank group of single-device mixed precision.

    FSDP2's and DTensor's state (module hooks, DeviceMeshes) keeps process groups alive through reference cycles, so
    a finished model may only be freed by the garbage collector at interpreter exit; gloo's worker threads torn down
    that late can abort the process (SIGABRT, "terminate called without an active exception"; pytorch#179291). Collect
    the cycles while the interpreter is fully alive, before and after destroying the groups."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
