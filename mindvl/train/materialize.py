"""Build the training model without a full unsharded copy on any rank (what makes 8B+ start on ordinary nodes).

    config, source = model_source(recipe, tok, env)      # architecture + where the weights come from
    model = build_model(recipe, tok, env, prepare)        # meta device -> prepare (phase, FSDP) -> fill shards

The model is constructed on the meta device (no memory), `prepare` freezes modules and applies activation
checkpointing / compile / FSDP2 to it, `to_empty` allocates only this rank's shards, and the weights then stream in
one full tensor at a time (from safetensors, or drawn from the seeded generator) and every rank keeps its slice
(`distribute_tensor(..., src_data_rank=None)` slices locally, no communication). Peak memory per rank is its shards
plus one full tensor. Master weights are float32; FSDP's mixed-precision policy casts to bf16 for compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mindvl.checkpoint.frozen_base import FrozenBase, base_tensors
from mindvl.config import Recipe
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig
from mindvl.models.lora import initial_adapter, lora_layers

from .parallel import ParallelEnv, barrier

# Wrappers that activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class WeightSource:
    """Seeded random weights (`folder` None) or a mindvl model folder (sharded safetensors + config.json)."""

    folder: Path | None
    seed: int = 0

    def tensors(self, config: MindVLConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every entry of the model's state dict, one tensor in memory at a time."""
        return base_tensors(self.folder, self.seed, config)


def init_seed(recipe: Recipe) -> int:
    """The seed of random weights: `model.init_seed` when given, else the recipe's `seed`."""
    return recipe.model.init_seed if recipe.model.init_seed is not None else recipe.seed


def model_source(recipe: Recipe, tok, env: ParallelEnv) -> tuple[MindVLConfig, WeightSource]:
    """The architecture and the weights of `recipe.model`: `arch` (seeded random; vocabulary and vision token ids
    from the tokenizer), `init_from` (a mindvl folder) or `compose` (HF towers, composed once by rank 0)."""
    m = recipe.model
    if m.arch is not None:
        sp = tok.special
        text = TextConfig(**{"vocab_size": tok.vocab_size, **m.arch.get("text", {})})
        vision = VisionConfig(**m.arch["vision"]) if m.arch.get("vision") else None
        config = MindVLConfig(text=text, vision=vision, image_token_id=sp.image_pad, video_token_id=sp.video_pad,
                              vision_start_token_id=sp.vision_start, vision_end_token_id=sp.vision_end)
        return config, WeightSource(None, init_seed(recipe))
    folder = Path(m.init_from) if m.init_from else Path(recipe.output_dir) / "composed"
    if m.compose is not None:
        from mindvl.checkpoint import compose

        if env.is_main and not (folder / "config.json").is_file():
            compose(m.compose["vision"], m.compose["language"], folder, seed=init_seed(recipe))
        barrier(env)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.init_from: {folder} is not a mindvl model folder (no config.json)")
    from mindvl.checkpoint.hf import read_config

    return MindVLConfig.from_dict(read_config(folder), str(folder / "config.json")), WeightSource(folder)


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model (without checkpoint/compile wrapper prefixes)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def fill_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """Copy full tensors into a (possibly FSDP-sharded) model allocated with `to_empty`; each rank keeps its slice.

    Every entry of the state dict must be given: a name the model lacks, or a tensor never given, is an error (an
    uninitialised `to_empty` tensor would otherwise train silently on garbage). Non-persistent buffers (runtime
    statistics such as expert-load counters) are not saved anywhere and start at zero."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = {canonical_name(n): t for n, t in (*model.named_parameters(), *model.named_buffers())}
    persistent = {canonical_name(n) for n in model.state_dict()}
    for name in set(targets) - persistent:
        targets[name].zero_()
    unfilled = set(persistent)
    for name, full in tensors:
        if name not in targets:
            raise ValueError(f"weights: {name} is not a tensor of this model")
        target = targets[name]
        value = full.to(device=device, dtype=target.dtype)
        if isinstance(target, DTensor):
            value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
        target.copy_(value)
        unfilled.discard(name)
    if unfilled:
        raise ValueError(f"weights: no value for {sorted(unfilled)[:5]} ({len(unfilled)} tensors)")


def adapter_init_tensors(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, full float32 tensor) of every adapter's starting value, drawn in layer order from one
    generator of its own (so the starting adapters do not depend on the parallel layout, like the base weights)."""
    gen = torch.Generator().manual_seed(seed + 7919)  # not the seeded base weights' stream
    for name, layer in lora_layers(model):
        a, b = initial_adapter(tuple(layer.lora_A.shape), tuple(layer.lora_B.shape), gen)
        name = canonical_name(name)
        yield f"{name}.lora_A", a
        yield f"{name}.lora_B", b


def build_model(recipe: Recipe, tok, env: ParallelEnv, prepare: Callable[[nn.Module], nn.Module] | None = None,
                base: FrozenBase | None = None) -> nn.Module:
    """The training model on `env.device`, its weights filled after `prepare` (freezing, parallelism) was applied
    on the meta device. Without `prepare`: a plain float32 model (tests, single-process tools). `base` (a LoRA
    run's) fingerprints the weights as they are read (its checkpoints reference the base instead of copying it)."""
    config, source = model_source(recipe, tok, env)
    if prepare is not None:  # refused before anything is built (QLoRA's backend)
        from .lora import check_lora_recipe

        check_lora_recipe(recipe)
    with torch.device("meta"):
        model: nn.Module = MindVL(config)
    if recipe.model.attention_backend != "auto":
        model.set_attention_backend(recipe.model.attention_backend)
    if prepare is not None:
        model = prepare(model)
    quantize = (recipe.model.lora or {}).get("quantize") if prepare is not None else None
    if quantize:  # QLoRA: the adapted base weights are allocated only in NF4, one at a time as they stream in
        from .qlora import StreamQuantizer

        nf4 = StreamQuantizer(model, quantize, env.device, canonical_name)
    model.to_empty(device=env.device)
    from itertools import chain

    # LoRA adapters (none without model.lora) start from their own seed
    weights = source.tensors(config)
    if base is not None:
        weights = base.observe(source.folder, source.seed, weights)
    if quantize:
        weights = nf4.take(weights)
    fill_weights(model, chain(weights, adapter_init_tensors(model, init_seed(recipe))), env.device)
    if quantize:
        nf4.check_done()
    return model.train()
