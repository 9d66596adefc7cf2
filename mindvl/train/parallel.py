"""Devices, process groups, the parallel layout, and `prepare_model`: parallelism applied to the model from outside.

- `ParallelEnv` is this process (rank, world size, device, backend); its `layout` (`ParallelLayout`) says how the
  world's ranks split into parallel dimensions and owns their device meshes: the data-parallel size and rank (loss
  normalisation, data shards, evaluation, the planner's communication estimate) come from it, never from the world
  size.
- `prepare_model(model, recipe, env)`: the ONE place that turns a built (meta-device) model into a trainable one:
  freeze (the phase) -> LoRA adapters (train.lora) -> tensor parallelism -> activation checkpointing -> compile ->
  expert parallelism -> context parallelism -> FSDP2 -> autocast (`TRANSFORMS`, in that order). The trainer, the
  planner's simulation, its real-step validation and the planner's counts all run it, so a transform added to
  `TRANSFORMS` is seen by the planner with no other edit.
- device/backend: cuda+nccl, npu+hccl (torch_npu imported only when present), cpu+gloo.
- expert parallelism (`parallel.expert_parallel`, mindvl.train.expert_parallel) before FSDP.
- FSDP2: `fully_shard` on every transformer block of both towers, then on the root (embeddings, projector, norm,
  head), with a bf16 MixedPrecisionPolicy on accelerators (fp32 reductions) and full fp32 on CPU; when there is
  more than one process (or `parallel.fsdp: on`).
- ONE process runs plain tensors (no FSDP, no DTensor: on one GPU FSDP's per-parameter DTensor dispatch and its
  one-rank all-gather copies were a measured host cost of every step). bf16 mixed precision there is autocast
  around the model's forward (as torchtitan does without FSDP): fp32 master weights and optimizer state, matmuls in
  bf16, each weight cast once per use and its gradient cast back to fp32 before it accumulates -- FSDP's numerics
  for weights and gradients, never a silent fp32 run. (Unlike FSDP's policy, element-wise ops that get fp32 inputs,
  the residual stream, stay fp32.) bf16 parameters with fp32 master copies in the optimizer were not chosen: the
  model's state_dict, the training checkpoints, the planner's memory model and the optimizer would all change
  for one layout, and gradient accumulation over micro-batches would need fp32 gradient buffers beside bf16
  parameters.
- activation checkpointing (`full`: whole blocks of both towers recomputed; `selective`: matmul/attention outputs
  kept and the element-wise ops recomputed).
- torch.compile per block (regional, as torchtitan): every block of both towers compiled on its own, the model
  around them eager; `parallel.compile: auto` turns it on on CUDA where triton (inductor's GPU code generator) is
  installed. The compile sits inside the checkpoint wrapper (a block's graph breaks at `attend` would make dynamo
  run a compiled checkpointed region eagerly). `selective` checkpointing trains the same under compile (tested
  against eager with inductor on CPU: gradients to 2e-6), but its per-op policy cannot see inside inductor's code:
  on the tiny model it kept 30 outputs eagerly (matmuls and attention) and only the 6 attention outputs compiled,
  so compiled `selective` recomputes the matmuls too, close to `full`. The backend
  (mindvl.train.compile_backend) is inductor, and under `auto` a forward or backward graph inductor fails to
  compile runs eagerly instead (one warning per run, `Prepared.compile_fallbacks`); under `on` the failure is a
  one-line CompileError naming the key.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mindvl.compile_limit import make_room_for_graphs
from mindvl.config import ParallelSection

from .compile_backend import backend_for, compile_failures
from .expert_parallel import EP_KEY
from .lora import apply_lora, lora_config
from .tensor_parallel import check_tensor_parallel_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from mindvl.config import Recipe
    from mindvl.models.lora import LoRAConfig



@dataclass
class Meshes:
    """The device meshes of a layout (built once per process group)."""

    dp: DeviceMesh  # every data shard: FSDP of everything but EP-sharded experts (1-D, "dp")
    expert: DeviceMesh | None = None  # ("efsdp", "ep") under expert parallelism: mesh["ep"] splits the experts,
    #                                   mesh["efsdp"] are the ranks holding the same experts (FSDP of their slices)
    cp: DeviceMesh | None = None  # context parallelism: this rank's CP group (dp then holds data shards x context)
    tp: DeviceMesh | None = None  # the ranks of one tensor-parallel group (the inner dim of a ("dp", "tp") mesh)


@dataclass
class ParallelLayout:
    """How the ranks of the world split into parallel dimensions (torchtitan's ParallelDims is the model).

    Dimensions, outermost first: data shards (FSDP; each reads its own data) x context x tensor, whose product is
    the world size. Expert parallelism borrows its ranks from the data shards: an EP group of N ranks holds E/N of
    each MoE layer's experts but still reads N different data shards, so N must divide `dp_shard` and the
    data-parallel size is `dp_shard` with or without EP. Context parallelism (mindvl.train.context_parallel): the
    `cp` consecutive ranks of a group read the same data and split its rows; FSDP shards over data shards x
    context (`fsdp_size`). Tensor parallelism (mindvl.train.tensor_parallel) is the innermost dimension: the `tp`
    consecutive ranks of one data shard read the same packs. Context and tensor parallelism together are refused
    for now (neither is tested with the other; a 3-D mesh is the next step).
    """

    world_size: int
    rank: int = 0
    dp_shard: int = 0  # 0: what the other dimensions leave (world / (context x tensor))
    ep: int = 1
    tp: int = 1
    cp: int = 1
    _meshes: tuple[Any, str, Meshes] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dp_shard == 0:
            self.dp_shard = self.world_size // (self.tp * self.cp)
        from .context_parallel import check_context_parallel

        if self.cp < 1:
            raise ValueError(f"parallel.context_parallel: must be >= 1, got {self.cp}")
        if self.cp > 1 and self.tp > 1:
            raise ValueError(f"parallel: context parallelism ({self.cp}) and tensor parallelism ({self.tp}) together "
                             "are not supported yet; set parallel.context_parallel or parallel.tensor_parallel to 1")
        check_context_parallel(self.cp, self.world_size, ep=self.ep)
        check_tensor_parallel_layout(self.tp, self.world_size, self.ep)
        if self.dp_shard * self.cp * self.tp != self.world_size:
            raise ValueError(f"parallel: data shards {self.dp_shard} x context {self.cp} x tensor {self.tp} must "
                             f"equal the world size {self.world_size}")
        if self.ep > 1 and self.world_size == 1:
            raise ValueError(f"{EP_KEY}: expert parallelism needs more than one process")
        if self.ep < 1:
            raise ValueError(f"{EP_KEY}: must be >= 1, got {self.ep}")
        if self.dp_shard % self.ep:
            raise ValueError(f"{EP_KEY}: {self.ep} must divide the world size {self.world_size}")

    @classmethod
    def from_config(cls, cfg: ParallelSection, world_size: int, rank: int = 0) -> ParallelLayout:
        return cls(world_size, rank, ep=cfg.expert_parallel, cp=cfg.context_parallel, tp=cfg.tensor_parallel)

    @property
    def dp_size(self) -> int:
        """Ranks that read different data (FSDP averages gradients over them; the loader deals shards to them)."""
        return self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (context and tensor ranks of one index share data)."""
        return self.rank // (self.cp * self.tp)

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group (which chunk of each row it holds)."""
        return (self.rank // self.tp) % self.cp

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards over and averages gradients over: data shards x context (CP ranks hold different
        tokens of the same batch, so their gradients sum like data-parallel ones)."""
        return self.dp_shard * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts under expert parallelism (over which FSDP shards an expert slice)."""
        return self.dp_shard // self.ep

    def meshes(self, device_type: str) -> Meshes:
        """The layout's device meshes (collective: every rank builds them); built once per process group and
        forgotten by `destroy` (a mesh keeps its process groups alive)."""
        key = (dist.group.WORLD, device_type)
        if self._meshes is None or self._meshes[:2] != key:
            from torch.distributed.device_mesh import init_device_mesh

            if self.ep > 1:
                expert = init_device_mesh(device_type, (self.expert_replicas, self.ep),
                                          mesh_dim_names=("efsdp", "ep"))
                built = Meshes(expert._flatten("dp"), expert)  # the rest of the model: over both dimensions
            elif self.cp > 1:
                grid = init_device_mesh(device_type, (self.dp_shard, self.cp), mesh_dim_names=("dp", "cp"))
                built = Meshes(grid._flatten("dp_cp"), cp=grid["cp"])
            elif self.tp > 1:  # FSDP over "dp", tensor parallelism over "tp" (one parent: FSDP2's 2-D sharding)
                both = init_device_mesh(device_type, (self.dp_shard, self.tp), mesh_dim_names=("dp", "tp"))
                built = Meshes(both["dp"], tp=both["tp"])
            else:
                built = Meshes(init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp",)))
            self._meshes = (*key, built)
        return self._meshes[2]

    def forget_meshes(self) -> None:
        self._meshes = None


@dataclass
class ParallelEnv:
    """This process: its rank in the world, its device and process-group backend, and the parallel layout (pure
    data parallelism over the world unless given, e.g. by `init_distributed` from the recipe's section)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    layout: ParallelLayout | None = None

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = ParallelLayout(self.world_size, self.rank)

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


def init_distributed(preference: str = "auto", parallel: ParallelSection | None = None) -> ParallelEnv:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK; start the process group when there is more than one process.
    The layout is built (and validated) from `parallel` before any process group exists."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    layout = ParallelLayout.from_config(parallel or ParallelSection(), world, rank)
    device, backend = detect_device(preference, local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if device.type != "cpu" else None)
    return ParallelEnv(rank, world, local, device, backend, layout)


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
    """FSDP when asked (`parallel.fsdp: on`), else when there is more than one process (with `fsdp: off`, still for
    bf16 mixed precision, whose policy it carries). One process runs plain tensors (autocast for bf16)."""
    if cfg.fsdp == "on":
        return True
    return env.distributed and (cfg.fsdp == "auto" or param_dtype(cfg, env.device) != torch.float32)


@dataclass
class Prepared:
    """What `prepare_model` did: the trainer logs it, the planner reports it."""

    trainable: dict[str, int] = field(default_factory=dict)  # trainable parameters per top-level module (the phase)
    checkpointing: str = "off"  # off | full | selective
    fsdp: bool = False
    compiled: bool = False  # every block torch.compiled (regional)
    # the inductor backends of the compiled blocks (mindvl.train.compile_backend); `compile_fallbacks` reads them
    compile_backends: list[Any] = field(default_factory=list, repr=False, compare=False)
    autocast: torch.dtype | None = None  # one process, mixed precision: the forward's autocast dtype
    steps: list[str] = field(default_factory=list)  # the transforms that ran, in order
    lora_layers: int = 0  # linear layers that carry a LoRA adapter (train.lora)
    lora_base_params: int = 0  # their frozen base weights' elements (what QLoRA stores in 4 bits)
    qlora_bytes: int = 0  # QLoRA: those weights' NF4 bytes, whole on every rank outside FSDP (train.qlora)
    qlora_traced_bytes: int = 0  # QLoRA: the same weights in the compute dtype, as the planner's trace holds them
    qlora_dequant_bytes: int = 0  # QLoRA: the transient of dequantizing the largest of them in a forward/backward

    @property
    def compile_fallbacks(self) -> list[str]:
        """The block graphs inductor could not compile, run eagerly instead (`parallel.compile: auto`), e.g.
        "DecoderLayer backward: RuntimeError: ...". Compilation happens in the first step (the backward's in its
        backward), so read this after it."""
        return compile_failures(self.compile_backends)


@dataclass
class PrepareContext:
    """What a transform may read: the phase's trainable modules (None: leave requires_grad alone), the parallel
    section, this process, its layout; `done` is where it records what it did."""

    trainable: list[str] | None
    parallel: ParallelSection
    env: ParallelEnv
    layout: ParallelLayout
    done: Prepared
    lora: LoRAConfig | None = None  # model.lora, checked (train.lora): the `lora` step adapts the model

    @property
    def compute_dtype(self) -> torch.dtype:
        return param_dtype(self.parallel, self.env.device)

    def mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=param_dtype(self.parallel, self.env.device), reduce_dtype=torch.float32)


Transform = Callable[[nn.Module, PrepareContext], nn.Module]


def _freeze(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    if ctx.trainable is not None:
        from .phases import apply_phase

        ctx.done.trainable = apply_phase(model, ctx.trainable)
    return model


def _lora(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    if ctx.lora is not None:  # adapters on the chosen linear layers; only they train in lora.modules (train.lora)
        trainable, ctx.done.lora_layers, ctx.done.lora_base_params = apply_lora(model, ctx.lora, ctx.compute_dtype)
        ctx.done.trainable.update(trainable)
        if ctx.lora.quantize is not None:
            from .qlora import resident_and_transient

            done = ctx.done
            done.qlora_bytes, done.qlora_traced_bytes, done.qlora_dequant_bytes = resident_and_transient(
                model, ctx.compute_dtype)
    return model


def _checkpointing(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    ctx.done.checkpointing = checkpointing_mode(ctx.parallel)
    apply_activation_checkpointing(model, ctx.done.checkpointing)
    return model


# torch.compile's backend for the blocks: "inductor" is inductor with the eager fallback of
# mindvl.train.compile_backend (tests on a slow CPU use "aot_eager", passed as it is)
COMPILE_BACKEND = "inductor"


def _triton_installed() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def compile_enabled(cfg: ParallelSection, device: torch.device) -> bool:
    """`parallel.compile`: on | off | auto (on CUDA with triton installed); a bool from code counts as on/off."""
    mode = cfg.compile
    if isinstance(mode, bool):
        return mode
    if mode == "auto":
        return device.type == "cuda" and _triton_installed()
    return mode == "on"


def _compile(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    """Regional compilation: each block compiled in place (inside its checkpoint wrapper), so parameter names and
    the FSDP/checkpointing units stay as they are and a recompilation costs one block's graph."""
    if not compile_enabled(ctx.parallel, ctx.env.device):
        return model
    strict = ctx.parallel.compile in ("on", True)  # asked for: a graph inductor cannot compile is an error
    make_room_for_graphs()  # the blocks' methods are shared by every model of the process (compile_limit)
    for b in blocks(model):
        # Inside the checkpoint wrapper, not around it: a block has graph breaks (`attend`, the delta rule: compile
        # boundaries, see models.host.Segments), and dynamo cannot trace a checkpointed region with a break in it,
        # so a compiled wrapper ran the whole block eagerly, silently. The wrapper recomputes by calling the
        # compiled block again.
        inner = getattr(b, "_checkpoint_wrapped_module", b)
        backend = COMPILE_BACKEND
        if backend == "inductor":  # one backend per block class
            backend = backend_for(type(inner), strict)
            if backend not in ctx.done.compile_backends:
                ctx.done.compile_backends.append(backend)
        inner.compile(backend=backend)
    ctx.done.compiled = True
    return model


def refuse_split_recurrence(model: nn.Module, key: str, size: int) -> None:
    """Qwen3.5's linear-attention layers (`linear_attn`) have no tensor-parallel plan, and context parallelism would
    cut their recurrence at every rank boundary: refused in one line until they do."""
    text = getattr(getattr(model, "config", None), "text", None)
    if size > 1 and text is not None and text.is_hybrid:
        raise ValueError(f"{key}: {size} is not supported for {text.family}'s linear-attention layers yet (no split "
                         "plan; the recurrent state would have to pass between ranks); set it to 1: data "
                         "parallelism with FSDP (and expert parallelism for the MoE) works")


def _tensor_parallel(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    """Tensor + sequence parallelism of the language model over the layout's "tp" mesh (before activation
    checkpointing and compile wrap the blocks, before FSDP shards the TP shards over "dp")."""
    from .tensor_parallel import apply_tensor_parallel, check_tensor_parallel

    refuse_split_recurrence(model, "parallel.tensor_parallel", ctx.layout.tp)
    check_tensor_parallel(ctx.layout.tp, model)
    if ctx.layout.tp > 1 and ctx.lora is not None:  # TP's plans name nn.Linear layers; LoRA wraps them
        raise ValueError(f"parallel.tensor_parallel: {ctx.layout.tp} with model.lora is not supported yet (the "
                         "adapted layers are not split); set parallel.tensor_parallel to 1 for a LoRA run")
    if ctx.layout.tp > 1:
        apply_tensor_parallel(model, ctx.layout.meshes(ctx.env.device.type).tp)
    return model


def _expert_parallel(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    """Experts first (EP over their own mesh dimension, each slice FSDP-sharded over its replicas); FSDP then
    shards the rest over every data shard. Under FSDP only (EP needs more than one process, so FSDP is on unless
    `parallel.fsdp: off`)."""
    if not uses_fsdp(ctx.parallel, ctx.env):
        return model
    from .expert_parallel import check_expert_parallel, shard_experts

    check_expert_parallel(ctx.layout.ep, ctx.layout.dp_shard, model)
    if ctx.layout.ep > 1:
        shard_experts(model, ctx.layout.meshes(ctx.env.device.type).expert, ctx.mp_policy())
    return model


def _context_parallel(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    """Split each packed row of the language model over the layout's CP group (all-to-all over heads around the
    varlen attention); FSDP then shards over data shards x context. Needs FSDP (it sums the CP ranks' gradients)."""
    if ctx.layout.cp == 1:
        return model
    from .context_parallel import CP_KEY, apply_context_parallel, check_context_parallel

    refuse_split_recurrence(model, CP_KEY, ctx.layout.cp)
    if not uses_fsdp(ctx.parallel, ctx.env):
        raise ValueError(f"{CP_KEY}: {ctx.layout.cp} needs FSDP to sum the context ranks' gradients; set "
                         "parallel.fsdp to auto or on")
    check_context_parallel(ctx.layout.cp, ctx.layout.world_size, model, ctx.layout.ep)
    mesh = ctx.layout.meshes(ctx.env.device.type).cp
    apply_context_parallel(model, mesh.get_group(), ctx.layout.cp, ctx.layout.cp_rank)
    return model


def _fsdp(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    if not uses_fsdp(ctx.parallel, ctx.env):
        return model
    if not ctx.env.distributed:
        _single_process_group(ctx.env)
    from torch.distributed.fsdp import fully_shard

    from .qlora import fsdp_ignored

    # QLoRA's NF4 base weights stay whole on every rank, outside FSDP (why: train.qlora)
    kw = {"mesh": ctx.layout.meshes(ctx.env.device.type).dp, "mp_policy": ctx.mp_policy(),
          "ignored_params": fsdp_ignored(model, ctx.lora) or None}
    for b in blocks(model):
        fully_shard(b, **kw)
    embedding = own_embedding_group(model)
    if embedding is not None:
        fully_shard(embedding, **kw)
    fully_shard(model, **kw)
    ctx.done.fsdp = True
    return model


class _AutocastHooks:
    """Forward pre-hook / hook pair holding `torch.autocast(device_type, dtype)` open for the module's forward
    (the hook runs also when the forward raises, so no autocast state leaks). The hooks hold no reference to the
    module (a deep copy of the model shares them harmlessly)."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type, self.dtype = device_type, dtype
        self.open: list[torch.autocast] = []

    def enter(self, module: nn.Module, args: tuple) -> None:
        # No cast cache: it would hold a bf16 copy of every weight for the whole forward (2 bytes a parameter beyond
        # FSDP's one block at a time); each weight is used once per forward, so the casts are as many without it.
        cm = torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)
        cm.__enter__()
        self.open.append(cm)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.open.pop().__exit__(None, None, None)


def _autocast(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    """Mixed precision without FSDP (one process): the model's forward runs under autocast in the compute dtype;
    parameters, gradients and optimizer state stay fp32. (Activation checkpointing's recompute restores the
    autocast state of the forward.)"""
    dtype = ctx.compute_dtype
    if ctx.done.fsdp or dtype == torch.float32:
        return model
    hooks = _AutocastHooks(ctx.env.device.type, dtype)
    model.register_forward_pre_hook(hooks.enter)
    model.register_forward_hook(hooks.exit, always_call=True)
    ctx.done.autocast = dtype
    return model


# The preparation, in order (tensor parallelism on the plain blocks; activation checkpointing inside compile inside
# FSDP; experts sharded before FSDP wraps the blocks that hold them; autocast only where FSDP did not take the
# mixed precision). Add a transform here and the trainer, the planner and its validation all run it.
TRANSFORMS: list[tuple[str, Transform]] = [
    ("freeze", _freeze),
    ("lora", _lora),
    ("tensor_parallel", _tensor_parallel),
    ("activation_checkpointing", _checkpointing),
    ("compile", _compile),
    ("expert_parallel", _expert_parallel),
    ("context_parallel", _context_parallel),
    ("fsdp", _fsdp),
    ("autocast", _autocast),
]


def layout_for(env: ParallelEnv, cfg: ParallelSection) -> ParallelLayout:
    """The env's layout (built once by `init_distributed` from the recipe's section); a section that asks for
    another layout than the env carries (an env made by hand: tools, tests) gets its own."""
    if (env.layout.ep, env.layout.cp, env.layout.tp) == (cfg.expert_parallel, cfg.context_parallel,
                                                         cfg.tensor_parallel):
        return env.layout
    return ParallelLayout.from_config(cfg, env.world_size, env.rank)


def _run_transforms(model: nn.Module, ctx: PrepareContext) -> nn.Module:
    for name, transform in TRANSFORMS:
        model = transform(model, ctx)
        ctx.done.steps.append(name)
    return model


def prepare_model(model: nn.Module, recipe: Recipe, env: ParallelEnv, report: Prepared | None = None) -> nn.Module:
    """The built (meta-device) model made trainable for `recipe` on `env`: every step of `TRANSFORMS`, in order.
    `report` (optional) receives what was done (trainable counts, checkpointing mode, the steps)."""
    ctx = PrepareContext(list(recipe.trainable_modules), recipe.parallel, env, layout_for(env, recipe.parallel),
                         report if report is not None else Prepared(), lora_config(recipe))
    return _run_transforms(model, ctx)


def parallelize(model: nn.Module, env: ParallelEnv, cfg: ParallelSection, report: Prepared | None = None
                ) -> nn.Module:
    """`prepare_model` without a phase (every parameter keeps its requires_grad): activation checkpointing,
    compile, expert parallelism, FSDP2 and autocast, in that order, for tools and tests that hold a section, not a
    recipe; `report` (optional) receives what was done."""
    return _run_transforms(model, PrepareContext(None, cfg, env, layout_for(env, cfg),
                                                 report if report is not None else Prepared()))


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
    env.layout.forget_meshes()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
