"""What the planner estimates rather than traces: FLOPs, collective traffic and a roofline step time.

FLOPs per pack come from `train.metrics` (the same count the trainer logs MFU with). Communication is FSDP2's:
per micro-batch every sharded block (and an untied input embedding, its own group) is all-gathered in bf16 for the
forward and again for the backward (they reshard after forward; the root keeps its parameters after the forward, so
it is gathered once), and the gradients of trainable parameters are reduce-scattered in fp32, once per micro-batch
(`sharded` accumulation) or once per step (`unsharded`). A ring moves (N-1)/N of the buffer per rank. Under expert
parallelism (N = EP size) a rank gathers and reduces only its EP slice of the routed experts (1/N of them), over the
W/N ranks holding the same slice, and everything else over all W ranks. Under context parallelism FSDP shards over
data shards x context, and each decoder layer adds Ulysses' all-to-alls (`context_all_to_all_bytes`).

Step time comes from a measured efficiency or not at all (`measured_step_time`): the rank's FLOPs at the model FLOPs
utilisation measured on that device kind for that model family (mindvl.plan.margin: margin.json's `efficiency`),
collectives at the interconnect bandwidth (intra-node when the world fits one node, else the inter-node NIC
bandwidth), assumed hidden behind compute unless they take longer, tensor-parallel collectives on top. `step_time` is
the old roofline (compute at the datasheet's peak): a lower bound nobody measured (it planned 94% MFU where the H200
ran 3.2%); the planner no longer prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindvl.models import MindVLConfig

from .devices import Device
from .packs import PackShape

_BF16, _FP32 = 2, 4


@dataclass
class Counts:
    total_params: int
    trainable_params: int
    root_params: int  # parameters FSDP gathers once per micro-batch (the root: head, projector, final norm)
    expert_params: int = 0  # routed experts ([E, ...] tensors; sharded by expert parallelism, inside blocks)
    trainable_expert_params: int = 0
    tp_params: int = 0  # split over the tensor-parallel ranks (global count; a rank holds 1/tp of them)
    tp_root_params: int = 0  # of which in the root group (the vocabulary-split head)
    tp_trainable_params: int = 0


def param_counts(model, trainable_names: set[str] | None = None) -> Counts:
    from mindvl.models.moe import RoutedExperts
    from mindvl.train.parallel import blocks, own_embedding_group

    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # gathered for the forward and again for the backward: the blocks, and the embedding when it is its own group
    groups = [*blocks(model), *filter(None, [own_embedding_group(model)])]
    in_blocks = sum(p.numel() for b in groups for p in b.parameters())
    experts = [p for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()]
    split = [p for p in model.parameters() if _tp_split(p)]
    in_block_ids = {id(p) for b in groups for p in b.parameters()}
    return Counts(total, trainable, total - in_blocks, sum(p.numel() for p in experts),
                  sum(p.numel() for p in experts if p.requires_grad), sum(p.numel() for p in split),
                  sum(p.numel() for p in split if id(p) not in in_block_ids),
                  sum(p.numel() for p in split if p.requires_grad))


def _tp_split(p) -> bool:
    """Is this parameter split (not replicated) over a "tp" mesh dimension (mindvl.train.tensor_parallel)?"""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" in names and p.placements[names.index("tp")].is_shard()


def labelled(config: MindVLConfig, shape: PackShape) -> int:
    """Labelled targets of a pack shape as `pack_flops` counts them: every text token but each sample's last."""
    merge = config.vision.merge_unit if config.vision else 4
    return shape.tokens - sum(t * h * w // merge for t, h, w in shape.images) - len(shape.sample_tokens)


def pack_flops(config: MindVLConfig, shape: PackShape, trainable) -> tuple[float, float]:
    """(training FLOPs of the pack, of which the vision tower's forward+backward) as train.metrics counts them."""
    from mindvl.train.metrics import flops_by_module, training_flops

    merge = config.vision.merge_unit if config.vision else 4
    image_tokens = sum(t * h * w // merge for t, h, w in shape.images)
    labelled = shape.tokens - image_tokens - len(shape.sample_tokens)
    grids = [list(g) for g in shape.images] or None
    total = training_flops(config, shape.sample_tokens, labelled, grids, trainable)
    vit = 0.0
    if grids and config.vision is not None:
        w, a = flops_by_module(config, shape.sample_tokens, labelled, grids)["visual"]
        vit = (w + a) * (3.0 if "visual" in trainable else 1.0)  # a frozen tower runs its forward only
    return total, vit


def comm_bytes(counts: Counts, layout, micro: int, accumulation: str) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective, under `layout` (train.parallel.ParallelLayout): FSDP
    gathers and reduces over the data-parallel ranks (data shards x context: FSDP's group), an EP slice over its
    expert replicas, a tensor-parallel shard (1/tp of each split weight) over the data-parallel ranks of its TP
    index."""
    world, ep, tp = layout.fsdp_size, layout.ep, layout.tp
    if world <= 1:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    ring = (world - 1) / world
    replicas = layout.expert_replicas
    expert_ring = (replicas - 1) / replicas  # an EP slice is gathered/reduced over its W/N replicas only
    experts = counts.expert_params if ep > 1 else 0
    trainable_experts = counts.trainable_expert_params if ep > 1 else 0
    unsplit = 1 - 1 / tp  # what a TP rank does not hold of a split weight
    root = counts.root_params - counts.tp_root_params * unsplit
    block = counts.total_params - counts.root_params - experts - (counts.tp_params - counts.tp_root_params) * unsplit
    gathers = micro * ((2 * block + root) * ring + 2 * experts / ep * expert_ring) * _BF16
    reduced = ((counts.trainable_params - trainable_experts - counts.tp_trainable_params * unsplit) * ring
               + trainable_experts / ep * expert_ring)
    reductions = (micro if accumulation == "sharded" else 1) * reduced * _FP32
    return {"all_gather": gathers, "reduce_scatter": reductions, "all_reduce": 8 * 3 * 2.0}


def tensor_parallel_bytes(config: MindVLConfig, mean_tokens: float, mean_labelled: float, tp: int, micro: int,
                          recompute: bool, activation_bytes: int = _BF16) -> dict[str, float]:
    """Bytes each rank sends per step inside its tensor-parallel group (mindvl.train.tensor_parallel), ring
    collectives moving (tp-1)/tp of the buffer (an all-reduce twice that):
    - per decoder layer and micro-batch: the forward all-gathers the [T, H] bf16 sequence before attention and
      before the MLP and reduce-scatters their outputs; the backward runs the transposes (2 reduce-scatters, 2
      all-gathers); full activation checkpointing runs the forward again; bf16 under the accelerators' policy;
    - the language model's input and output: the output is all-gathered for the loss, and the gradient of the
      input (split along the sequence with no exchange) is all-gathered in the backward: 2 more all-gathers;
    - the vocabulary-parallel loss: all-reduces of [N_labelled] (max, then sum and target logit) in fp32 and of the
      hidden-state gradient [N_labelled, H] fp32;
    - the replicated norm weights' gradients (partial on each rank): one fp32 all-reduce per micro-batch."""
    if tp <= 1:
        return {}
    t = config.text
    ring = (tp - 1) / tp
    row = mean_tokens * t.hidden_size * activation_bytes * ring
    per_layer = 4 + (2 if recompute else 0)  # collectives of each kind per layer and micro-batch
    gathers = micro * (t.num_hidden_layers * per_layer + 2) * row
    scatters = micro * t.num_hidden_layers * per_layer * row
    norms = (2 * t.num_hidden_layers + 1) * t.hidden_size + (2 * t.num_hidden_layers * t.head_dim if t.qk_norm else 0)
    loss = 3 * mean_labelled + mean_labelled * t.hidden_size
    reduces = micro * 2 * ring * (loss + norms) * _FP32
    return {"tp_all_gather": gathers, "tp_reduce_scatter": scatters, "tp_all_reduce": reduces}


def expert_all_to_all_bytes(config: MindVLConfig, mean_tokens: float, ep: int, micro: int,
                            recompute: bool) -> float:
    """Bytes each rank sends per step through expert parallelism's all-to-all, assuming balanced routing: per MoE
    layer and micro-batch, the T*k routed rows of which (ep-1)/ep leave the rank, in bf16, twice in the forward
    (dispatch, combine) and twice in the backward, plus the forward again under activation checkpointing."""
    t = config.text
    if ep <= 1 or not t.has_experts:  # DeepSeek-V3's or Qwen3-MoE's routed experts
        return 0.0
    moe_layers = t.num_hidden_layers - t.first_k_dense_replace
    rows = mean_tokens * t.num_experts_per_tok * (ep - 1) / ep
    return micro * moe_layers * (6 if recompute else 4) * rows * t.hidden_size * _BF16


def context_all_to_all_bytes(config: MindVLConfig, mean_tokens: float, cp: int, micro: int,
                             recompute: bool, element_bytes: int = _BF16) -> float:
    """Bytes each rank sends per step through context parallelism's all-to-alls (train.context_parallel): per
    decoder layer and micro-batch, q, k, v ([T/N, heads, D], KV heads replicated up to lcm(KV heads, N)) to the
    head-split layout and the attention output back, (N-1)/N of each leaving the rank, in bf16; the backward sends
    the same gradients the other way, and activation checkpointing runs the forward's four again. `element_bytes`:
    2 (bf16 compute on accelerators), 4 for a float32 run."""
    t = config.text
    if cp <= 1:
        return 0.0
    from mindvl.train.context_parallel import kv_replication

    heads = t.num_attention_heads
    if t.is_moe:  # MLA: every head has its own key (nope + rope) and value
        qk, v_dim, kv_heads = t.qk_nope_head_dim + t.qk_rope_head_dim, t.v_head_dim, heads
    else:
        qk, v_dim, kv_heads = t.head_dim, t.head_dim, t.num_key_value_heads
    kv_heads *= kv_replication(heads, kv_heads, cp)
    per_token = heads * qk + kv_heads * qk + kv_heads * v_dim + heads * v_dim  # q, k, v, output
    rows = mean_tokens / cp * (cp - 1) / cp
    return micro * t.num_hidden_layers * (3 if recompute else 2) * rows * per_token * element_bytes


def model_family(config: MindVLConfig) -> str:
    """The family a measured efficiency is recorded for: ViT + dense / MoE language model, or the LLM alone."""
    llm = "moe-llm" if config.text.has_experts else "dense-llm"
    return f"vit+{llm}" if config.vision is not None else llm


def measured_step_time(device: Device, world: int, flops_per_rank: float, comm: dict[str, float],
                       efficiency) -> dict[str, float]:
    """Seconds per step at a measured efficiency (mindvl.plan.margin.Efficiency: mfu, low, high): the rank's FLOPs at
    mfu x the device's peak (the measured steps include their forward, backward and optimizer), or the collectives
    at bandwidth when they take longer, plus the tensor-parallel collectives; `step_s_low` / `step_s_high` at the
    measured range's best / worst step."""
    bw = device.intra_bytes_s if world <= device.per_node else device.inter_bytes_s
    tensor = sum(v for k, v in comm.items() if k.startswith("tp_")) / device.intra_bytes_s
    communication = sum(v for k, v in comm.items() if not k.startswith("tp_")) / bw

    def step(mfu: float) -> float:
        return max(flops_per_rank / (mfu * device.peak_flops), communication) + tensor

    return {"compute_s": flops_per_rank / (efficiency.mfu * device.peak_flops), "communication_s": communication,
            "tensor_parallel_s": tensor, "step_s": step(efficiency.mfu), "step_s_low": step(efficiency.high),
            "step_s_high": step(efficiency.low)}


def step_time(device: Device, world: int, flops_per_rank: float, comm: dict[str, float],
              trainable_local: float) -> dict[str, float]:
    compute = flops_per_rank / device.peak_flops
    bw = device.intra_bytes_s if world <= device.per_node else device.inter_bytes_s
    # Tensor-parallel collectives (tp_*) run inside a node and sit on the critical path (each layer waits for its
    # gather); the others (FSDP, expert all-to-all) are assumed to overlap compute.
    tensor = sum(v for k, v in comm.items() if k.startswith("tp_")) / device.intra_bytes_s
    communication = sum(v for k, v in comm.items() if not k.startswith("tp_")) / bw
    # AdamW reads/writes params, grads, exp_avg, exp_avg_sq (fp32): ~ 7 x 4 bytes per local parameter
    optimizer = 28 * trainable_local / device.hbm_bytes_s
    return {"compute_s": compute, "communication_s": communication, "tensor_parallel_s": tensor,
            "optimizer_s": optimizer, "step_s": max(compute, communication) + tensor + optimizer}


def vision_load(config: MindVLConfig, packs: list[PackShape], world: int, accum: int, trainable,
                steps: int = 8) -> dict[str, float]:
    """ViT FLOPs per rank per step over `steps` steps of the given pack sequence (packs dealt round-robin as the
    trainer's data shards deal them): max and mean over ranks and steps, and max/mean."""
    per_pack = [pack_flops(config, p, trainable)[1] for p in packs]
    loads = []
    i = 0
    for _ in range(steps):
        ranks = [0.0] * world
        for _ in range(accum):
            for r in range(world):
                ranks[r] += per_pack[i % len(per_pack)]
                i += 1
        loads.append(ranks)
    flat = [x for s in loads for x in s]
    mean = sum(flat) / len(flat)
    per_step_ratio = max((max(s) / (sum(s) / len(s)) if sum(s) else 1.0) for s in loads)
    return {"vit_flops_max": max(flat), "vit_flops_mean": mean,
            "max_over_mean": max(flat) / mean if mean else 1.0, "worst_step_max_over_mean": per_step_ratio}
