"""`plan(recipe, world_size, device)`: will this recipe's step fit on N devices of this kind, and how fast is it?

    result = plan(load_recipe("recipes/mindvl-8b/sft-8k.yaml"), 8, get_device("h100-80g"))
    result.fits, result.peak_bytes_per_rank, result.to_dict()

Memory is traced (mindvl.plan.simulate: the real model, parallelize and training step on a fake cluster); FLOPs,
communication and time are estimated (mindvl.plan.estimate). `reserve_bytes` covers what the trace cannot see,
from measurement (mindvl.plan.margin, margin.json): the runtime context and communication buffers (fixed), and the
allocator's growth over the planned bytes (workspaces, alignment, fragmentation: a measured ratio of the peak).
A plan fits when peak + the routing-skew term (below) + reserve <= capacity.

Routing skew (mindvl.plan.skew): under expert parallelism the trace routes balanced; `routing_skew_factor` (a capacity
factor, >= 1; a run's logged MaxVio bounds it: factor <= 1 + MaxVio; default margin.json's) adds what the
most-loaded EP rank's extra routed rows hold at the peak. The report prints the headroom at several factors and the
largest factor that fits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mindvl.config import Recipe
from mindvl.data import DataConfig
from mindvl.models import MindVLConfig
from mindvl.train.lora import lora_config
from mindvl.train.parallel import ParallelLayout

from . import estimate
from .devices import GIB, Device
from .packs import PackShape, sampled_packs, worst_case_packs
from .presets import known_presets, preset_config
from .simulate import PARTS, trace_step
from .skew import SENSITIVITY, Skew, routing_skew

# The torch versions the planner's memory accounting is known for: 2.13 traced here; 2.10-2.12 let DTensor's sharding
# propagation reach FSDP2's memory tracker (torch 2.11 planned 24 B/parameter of AdamW state on the H200 proof),
# which simulate.device_optimizer_memory keeps out. Outside the range the report says so.
TESTED_TORCH = ((2, 10), (2, 13))


def torch_note() -> str | None:
    """A note when this torch is outside TESTED_TORCH (None inside it)."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    low, high = TESTED_TORCH
    if low <= version <= high:
        return None
    return (f"torch {torch.__version__} is outside the planner's known range ({low[0]}.{low[1]}-{high[0]}.{high[1]}): "
            "its memory tracker and fake kernels may count differently")


def reserve_bytes(device: Device, planned_bytes: int, margin=None, world_size: int = 2) -> int:
    """What a rank needs beyond `planned_bytes` (traced peak + routing-skew term) on `device`: margin.json's reserve
    for that device kind (mindvl.plan.margin.Margin: measured, borrowed from a measured kind, or CPU stand-ins);
    communication buffers only where the rank has peers (`world_size` > 1)."""
    from .margin import load_margin  # lazily: `python -m mindvl.plan.margin` runs that module as __main__

    return (margin or load_margin(device=device.name)).reserve_bytes(planned_bytes, peers=world_size > 1)


def model_config(recipe: Recipe, preset: str | None = None) -> tuple[MindVLConfig, str]:
    """The recipe's architecture at its real size, and where it came from: `preset` if given; else `model.arch`;
    else the `init_from` / `compose` folders' config.json when present; else the recipe's `model.preset`."""
    m = recipe.model
    if preset:
        return preset_config(preset), f"preset {preset}"
    if m.arch is not None:
        from mindvl.data import load_tokenizer
        from mindvl.train.materialize import model_source
        from mindvl.train.parallel import ParallelEnv
        from mindvl.train.preflight import tokenizer_source

        tok = load_tokenizer(tokenizer_source(recipe))  # the trainer's choice (train.preflight)
        config, _ = model_source(recipe, tok, ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo"))
        return config, "model.arch"
    from mindvl.checkpoint import hf

    if m.init_from and (Path(m.init_from) / "config.json").is_file():
        return MindVLConfig.from_dict(hf.read_config(m.init_from)), f"{m.init_from}/config.json"
    if m.compose and all((Path(p) / "config.json").is_file() for p in m.compose.values()):
        vraw, lraw = hf.read_config(m.compose["vision"]), hf.read_config(m.compose["language"])
        text = hf.text_config_from_hf(lraw, hf.detect_family(lraw, m.compose["language"]))
        text.mrope_section = hf.default_mrope_section(text.head_dim)  # as `compose` sets it up
        return MindVLConfig(text=text, vision=hf.vision_config_from_hf(vraw)), "model.compose folders' config.json"
    if m.preset:
        return preset_config(m.preset), f"model.preset {m.preset}"
    where = m.init_from or (m.compose or {}).get("language") or "model"
    raise ValueError(f"model: {where} has no config.json here; name a shape preset with --preset or model.preset "
                     f"(known: {known_presets()})")


@dataclass
class PlanResult:
    recipe: str
    model_source: str
    device: Device
    world_size: int
    accumulation: int  # micro-batches per rank per step
    grad_accumulation: str
    activation_checkpointing: str
    peak_bytes_per_rank: int
    breakdown: dict[str, int]
    capacity_bytes: int
    reserve_bytes: int
    flops_per_step: float
    flops_by_part: dict[str, float]
    comm_bytes_per_step: dict[str, float]
    timing: dict[str, float] | None  # None: no efficiency was measured for this device kind and model family
    tokens_per_step: int
    params: dict[str, int]
    packs: list[dict]
    trace_s: float
    sharded_bytes: int = 0
    vision_load: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    skew: Skew | None = None  # routing skew under expert parallelism (None / no bytes: no term)
    reserve_growth: float = 1.0  # reserve bytes per planned byte beyond its fixed part (mindvl.plan.margin)
    reserve_source: str = ""
    context_parallel: int = 1  # ranks splitting each pack (parallel.context_parallel)
    attention_heads: int = 0  # the language model's query heads (context parallelism must divide them)
    tensor_parallel: int = 1  # the layout's tp: ranks splitting each LLM layer (the data-parallel size is W / tp)
    time_source: str = ""  # the measured efficiency the time comes from, or why there is no time
    reserve_measured_on: str = ""  # the device kind whose measurement the reserve is ("": none, CPU stand-ins)
    torch_version: str = ""  # the torch the step was traced with

    @property
    def skew_bytes(self) -> int:
        return self.skew.extra_bytes if self.skew is not None else 0

    @property
    def fits(self) -> bool:
        return self.peak_bytes_per_rank + self.skew_bytes + self.reserve_bytes <= self.capacity_bytes

    @property
    def headroom(self) -> float:
        return 1.0 - (self.peak_bytes_per_rank + self.skew_bytes + self.reserve_bytes) / self.capacity_bytes

    def skew_summary(self) -> dict | None:
        """The skew term and the headroom's sensitivity to it (None without expert parallelism of a MoE)."""
        if self.skew is None or not self.skew.bytes_per_unit:
            return None
        k = self.skew
        # the reserve of the balanced peak: the reserve grows with the skew term as with any planned byte
        balanced_reserve = self.reserve_bytes - int((self.reserve_growth - 1.0) * k.extra_bytes)
        args = (self.peak_bytes_per_rank, balanced_reserve, self.capacity_bytes, self.reserve_growth)
        return {"factor": k.factor, "extra_bytes": k.extra_bytes, "bytes_per_unit": k.bytes_per_unit,
                "rows_balanced": k.rows_balanced, "layers_in_flight": k.layers_in_flight,
                "headroom_at": {str(f): k.headroom_at(f, *args) for f in (1.0, *SENSITIVITY)},
                "break_even_factor": k.break_even(*args)}

    @property
    def est_mfu(self) -> float | None:
        if self.timing is None:
            return None
        return self.flops_per_step / (self.timing["step_s"] * self.device.peak_flops * self.world_size)

    @property
    def est_tokens_per_s(self) -> float | None:
        return None if self.timing is None else self.tokens_per_step / self.timing["step_s"]

    def to_dict(self) -> dict:
        return {
            "fits": self.fits, "headroom": self.headroom, "recipe": self.recipe, "model_source": self.model_source,
            "world_size": self.world_size, "tensor_parallel": self.tensor_parallel,
            "data_parallel": self.world_size // self.tensor_parallel, "device": self.device.to_dict(),
            "peak_bytes_per_rank": self.peak_bytes_per_rank, "capacity_bytes": self.capacity_bytes,
            "reserve_bytes": self.reserve_bytes, "reserve_source": self.reserve_source,
            "reserve_measured_on": self.reserve_measured_on or None, "breakdown": self.breakdown,
            "micro_batches_per_rank": self.accumulation, "grad_accumulation": self.grad_accumulation,
            "activation_checkpointing": self.activation_checkpointing,
            "flops_per_step": self.flops_per_step, "flops_by_part": self.flops_by_part,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "est_step_time_s": None if self.timing is None else self.timing["step_s"],
            "est_timing": self.timing, "est_tokens_per_s": self.est_tokens_per_s, "est_mfu": self.est_mfu,
            "time_source": self.time_source, "torch": self.torch_version, "context_parallel": self.context_parallel,
            "params": self.params, "packs": self.packs, "vision_load": self.vision_load,
            "sharded_bytes_at_peak": self.sharded_bytes, "trace_s": self.trace_s, "notes": self.notes, "estimated": [
                "flops_per_step", "comm_bytes_per_step", "est_step_time_s", "est_mfu", "reserve_bytes",
                "routing_skew"], "routing_skew": self.skew_summary(),
        }


def plan(recipe: Recipe, world_size: int, device: Device, preset: str | None = None, sample_data: bool = False,
         recipe_name: str = "", routing_skew_factor: float | None = None) -> PlanResult:
    """`routing_skew_factor`: None takes margin.json's measured default."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    recipe = copy.deepcopy(recipe)
    layout = ParallelLayout.from_config(recipe.parallel, world_size)  # the trainer's, for --world-size ranks
    config, source = model_config(recipe, preset)
    data_cfg = DataConfig.from_dict(recipe.data)
    gb = recipe.batch.global_batch_size
    if gb % layout.dp_size:
        raise ValueError(f"batch.global_batch_size ({gb}) must be a multiple of the data-parallel size "
                         f"({layout.dp_size} of --world-size {world_size})")
    accum = gb // layout.dp_size
    trainable = recipe.trainable_modules
    notes = []
    if layout.cp > 1:
        notes.append(f"layout: {layout.dp_size} data shards x context {layout.cp} (each pack split over {layout.cp} "
                     "ranks; FSDP over both)")
    if sample_data:
        from mindvl.data import load_tokenizer
        from mindvl.train.preflight import fill_processor, tokenizer_source

        fill_processor(data_cfg, recipe, config)  # the trainer's processor: the packs' patch rows and token counts
        shards = recipe.batch.data_shards or layout.dp_size
        packs: list[PackShape] = sampled_packs(data_cfg, load_tokenizer(tokenizer_source(recipe)), shards=shards)
        notes.append(f"pack shapes: the first {len(packs)} packs of the recipe's sources")
    else:
        packs = worst_case_packs(data_cfg, config)
        notes.append("pack shapes: worst case of data.seq_len / data.max_pixels (every slot used, max-size images)")
    # The trace: peak over one step of 1 micro-batch and one of 2 (whatever the real accumulation: the resident
    # set of a micro-batch loop does not grow with its length once the window is full).
    traced = trace_step(recipe, config, world_size, packs, micro_batches=(1, 2) if accum > 1 else (1, 1))
    counts = traced.counts  # of the model prepare_model made (its phase, its checkpointing)
    per_pack = [estimate.pack_flops(config, p, trainable) for p in packs]
    mean_flops = sum(f for f, _ in per_pack) / len(per_pack)
    mean_vit = sum(v for _, v in per_pack) / len(per_pack)
    flops_step = mean_flops * gb
    grad_acc = recipe.parallel.grad_accumulation
    comm = estimate.comm_bytes(counts, layout, accum, grad_acc)
    if layout.ep > 1:  # token dispatch/combine of expert parallelism
        comm["all_to_all"] = estimate.expert_all_to_all_bytes(
            config, sum(p.tokens for p in packs) / len(packs), layout.ep, accum,
            traced.prepared.checkpointing != "off")
    if layout.cp > 1:  # Ulysses all-to-alls of context parallelism
        comm["context_all_to_all"] = estimate.context_all_to_all_bytes(
            config, sum(p.tokens for p in packs) / len(packs), layout.cp, accum,
            traced.prepared.checkpointing != "off")
    if layout.tp > 1:  # sequence gathers/scatters and the vocabulary-parallel loss inside each TP group
        comm.update(estimate.tensor_parallel_bytes(
            config, sum(p.tokens for p in packs) / len(packs), sum(estimate.labelled(config, p) for p in packs)
            / len(packs), layout.tp, accum, traced.prepared.checkpointing == "full"))
    # per rank: the LLM's FLOPs split over the world; the vision tower runs whole on every rank of a CP group (all of
    # its packs' images) and of a TP group (replicated), so it splits over the data shards only
    flops_rank = ((mean_flops - mean_vit) * gb + mean_vit * gb * layout.cp * layout.tp) / world_size
    from .margin import efficiency_for, load_efficiencies

    family = estimate.model_family(config)
    efficiency = efficiency_for(device.name, family)
    if efficiency is not None:
        timing = estimate.measured_step_time(device, world_size, flops_rank, comm, efficiency)
        time_source = efficiency.describe()
    else:
        timing = None
        known = "; ".join(f"{e.device} / {e.family}" for e in load_efficiencies()) or "none"
        time_source = (f"no time: no efficiency measured on {device.name} for {family} (measured: {known}; "
                       "mindvl/plan/margin.json)")
    tokens = int(sum(p.tokens for p in packs) / len(packs) * gb)
    vload = estimate.vision_load(config, packs, layout.dp_size, accum, trainable) if config.vision else None

    from .margin import load_margin

    margin = load_margin(device=device.name)
    factor = margin.skew_factor if routing_skew_factor is None else routing_skew_factor
    skew = routing_skew(config, max(p.tokens for p in packs), layout.ep, traced.prepared.checkpointing, factor)
    peak, breakdown = traced.peak_bytes, dict(traced.breakdown)
    notes += traced.notes
    if torch_note():
        notes.append(torch_note())
    lora = lora_config(recipe)
    if lora is not None:
        notes.append(f"LoRA r={lora.r} on {traced.prepared.lora_layers} linear layers of {', '.join(lora.modules)}"
                     f" (frozen weights stored in the compute dtype)")
    if lora is not None and lora.quantize is not None:
        # QLoRA: the adapted base weights are outside FSDP, whole on every rank; the trace holds them in the compute
        # dtype (simulate.PlanTracker.track_plain_params), the run in NF4: their bytes are swapped here, and the
        # transient of dequantizing the largest one is added to the activations at the peak (an upper bound: the
        # peak may fall elsewhere)
        prep = traced.prepared
        nf4, dequant = prep.qlora_bytes, prep.qlora_dequant_bytes
        peak += nf4 - prep.qlora_traced_bytes + dequant
        breakdown["parameters"] += nf4 - prep.qlora_traced_bytes
        breakdown["activations"] += dequant
        notes.append(f"QLoRA ({lora.quantize}): {traced.prepared.lora_base_params / 1e9:.2f}B adapted base weights "
                     f"in NF4, whole on every rank ({_gib(nf4)}), + {_gib(dequant)} to dequantize the largest")
    return PlanResult(
        recipe=recipe_name, model_source=source, device=device, world_size=world_size, accumulation=accum,
        grad_accumulation=grad_acc, activation_checkpointing=traced.prepared.checkpointing,
        peak_bytes_per_rank=peak, breakdown=breakdown, capacity_bytes=device.memory_bytes,
        reserve_bytes=reserve_bytes(device, peak + skew.extra_bytes, margin, world_size), flops_per_step=flops_step,
        flops_by_part={"vit": mean_vit * gb, "projector_and_llm": (mean_flops - mean_vit) * gb},
        comm_bytes_per_step=comm, timing=timing, tokens_per_step=tokens,
        params={"total": counts.total_params, "trainable": counts.trainable_params},
        packs=[{"tokens": p.tokens, "samples": len(p.sample_tokens), "images": len(p.images),
                "patches": p.patches} for p in packs[:4]],
        trace_s=traced.wall_s, sharded_bytes=traced.sharded_bytes, vision_load=vload, notes=notes, skew=skew,
        reserve_growth=margin.growth, reserve_source=margin.describe(peers=world_size > 1),
        context_parallel=layout.cp, attention_heads=config.text.num_attention_heads, tensor_parallel=layout.tp,
        time_source=time_source, torch_version=torch.__version__, reserve_measured_on=margin.measured_on)


# ------------------------------------------------------------------------------------------------------ text


def _gib(n: float) -> str:
    """Bytes in GiB, or in MiB / KiB below a tenth of the unit above (a tiny recipe's parts are not "0.0 GiB")."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if abs(n) >= 0.1 * size or n == 0:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _count(n: float) -> str:
    """A parameter count: 8.29B, 1.25M, 77,352 (a tiny recipe's is not "0.00B")."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,.0f}"


def skew_lines(r: PlanResult) -> list[str]:
    """The routing-skew term and the headroom's sensitivity to it (nothing without expert parallelism)."""
    k = r.skew_summary()
    if k is None:
        return []
    at = ", ".join(f"{f} {h:.0%}" for f, h in k["headroom_at"].items())
    return [f"  routing skew: the trace routes balanced ({k['rows_balanced']:,} rows per micro-batch per EP rank, "
            f"{k['layers_in_flight']} MoE layer(s) in flight); each +0.1 of capacity factor on the hot rank adds "
            f"{_gib(k['bytes_per_unit'] / 10)}; headroom at factor {at}; "
            + (f"fits up to factor {k['break_even_factor']:.2f}" if k["break_even_factor"] >= 1
               else "does not fit even balanced")
            + (f"; planned at {k['factor']}: +{_gib(k['extra_bytes'])}" if k["factor"] > 1 else "")]


def time_line(r: PlanResult) -> str:
    """The step time at a measured efficiency with its range and source, or why there is none."""
    t = r.timing
    if t is None:
        return f"time: {r.time_source}"
    return (f"time (estimate from a measured efficiency): step {t['step_s']:.2f} s ({t['step_s_low']:.2f}-"
            f"{t['step_s_high']:.2f}; compute {t['compute_s']:.2f} s, collectives {t['communication_s']:.2f} s"
            + (f", tensor-parallel collectives {t['tensor_parallel_s']:.2f} s" if r.tensor_parallel > 1 else "")
            + f"), {r.est_tokens_per_s:,.0f} tokens/s, MFU {r.est_mfu:.1%}; efficiency: {r.time_source}")


def reserve_note(r: PlanResult) -> str:
    """Where the verdict's reserve comes from, when it was not measured on this device kind ("" when it was)."""
    if not r.reserve_measured_on:
        return f"; reserve not measured on {r.device.name} (CPU stand-ins)"
    if r.reserve_measured_on != r.device.name:
        return f"; reserve measured on {r.reserve_measured_on}, not on {r.device.name}"
    return ""


def verdict(r: PlanResult) -> str:
    """One line: fits (with headroom) or not, naming the largest part and the knobs that would help, and where the
    reserve comes from when this device kind has no measurement of its own."""
    skew = f" + {_gib(r.skew_bytes)} routing skew (factor {r.skew.factor})" if r.skew_bytes else ""
    total = r.peak_bytes_per_rank + r.skew_bytes + r.reserve_bytes
    if r.fits:
        return (f"fits: {_gib(r.peak_bytes_per_rank)} peak{skew} + {_gib(r.reserve_bytes)} reserve of "
                f"{_gib(r.capacity_bytes)} per {r.device.name} ({r.headroom:.0%} headroom){reserve_note(r)}")
    part = max(r.breakdown, key=r.breakdown.get)
    knobs = [f"--world-size {2 * r.world_size}"]
    cp = 2 * r.context_parallel  # activations of one pack split over twice the ranks
    if part == "activations" and r.attention_heads % cp == 0 and r.world_size % cp == 0:
        knobs.insert(0, f"parallel.context_parallel={cp}")
    if r.activation_checkpointing != "full":
        knobs.append("parallel.activation_checkpointing=full")
    if r.grad_accumulation != "sharded":
        knobs.append("parallel.grad_accumulation=sharded")
    if part in ("activations", "loss_temporaries", "unsharded_parameters") and r.tensor_parallel < 8:
        knobs.append("parallel.tensor_parallel (splits activations and gathered layers; inside a node)")
    knobs += ["data.seq_len (lower)", "data.max_pixels (lower)"]
    return (f"does not fit: {_gib(r.peak_bytes_per_rank)} peak{skew} + {_gib(r.reserve_bytes)} reserve = "
            f"{_gib(total)} > "
            f"{_gib(r.capacity_bytes)} per {r.device.name}; largest part: {part} ({_gib(r.breakdown[part])}); "
            f"try {', '.join(knobs)}{reserve_note(r)}")


def format_report(r: PlanResult) -> str:
    tp = r.tensor_parallel
    layout = f", {r.world_size // tp} data shards x TP {tp}" if tp > 1 else ""
    lines = [f"plan: {r.recipe or 'recipe'} on {r.world_size} x {r.device.name}{layout} "
             f"({r.accumulation} micro-batch(es) per rank per step, grad accumulation {r.grad_accumulation}, "
             f"activation checkpointing {r.activation_checkpointing})",
             f"model: {_count(r.params['total'])} parameters ({_count(r.params['trainable'])} trainable), "
             f"from {r.model_source}; {'; '.join(r.notes)}",
             f"memory per rank (traced with torch {r.torch_version or torch.__version__}):"]
    for part in PARTS:
        lines.append(f"  {part:<21} {_gib(r.breakdown[part]):>10}")
    lines.append(f"  {'peak':<21} {_gib(r.peak_bytes_per_rank):>10}   capacity {_gib(r.capacity_bytes)}, reserve "
                 f"{_gib(r.reserve_bytes)} (not traced: {r.reserve_source or 'runtime, comm buffers, allocator'})")
    lines += skew_lines(r)
    c = r.comm_bytes_per_step
    lines += [
        f"FLOPs per step: {r.flops_per_step:.3e} (ViT {r.flops_by_part['vit']:.3e}, projector + LLM "
        f"{r.flops_by_part['projector_and_llm']:.3e})",
        f"collectives per rank per step: all-gather {_gib(c['all_gather'])}, reduce-scatter "
        f"{_gib(c['reduce_scatter'])}" + (f", expert all-to-all {_gib(c['all_to_all'])}" if "all_to_all" in c else "")
        + (f", context all-to-all {_gib(c['context_all_to_all'])}" if "context_all_to_all" in c else "")
        + (f"; tensor parallel (inside each group of {r.tensor_parallel}): all-gather {_gib(c['tp_all_gather'])}, "
           f"reduce-scatter {_gib(c['tp_reduce_scatter'])}, all-reduce {_gib(c['tp_all_reduce'])}"
           if "tp_all_gather" in c else ""),
    ]
    lines.append(time_line(r))
    if r.vision_load:
        v = r.vision_load
        lines.append(f"vision load per rank per step: max {v['vit_flops_max']:.3e} / mean {v['vit_flops_mean']:.3e} "
                     f"FLOPs (max/mean {v['max_over_mean']:.2f})")
    lines.append(verdict(r))
    return "\n".join(lines)


def extrapolate_peak(r: PlanResult, world_size: int) -> int:
    """Peak at another world size from this trace: the sharded parts (parameters, gradients, optimizer state) scale
    as 1/N, the rest (unsharded parameters of the active block, activations, loss head, data) stays. An estimate:
    trace the world size to confirm it."""
    return int(r.peak_bytes_per_rank - r.sharded_bytes + r.sharded_bytes * r.world_size / world_size)


def headline(r: PlanResult) -> str:
    return (f"planner: estimated peak {_gib(r.peak_bytes_per_rank)} + {_gib(r.reserve_bytes)} reserve per rank of "
            f"{_gib(r.capacity_bytes)} ({'fits' if r.fits else 'DOES NOT FIT'})")
