"""Routing skew: what the memory trace cannot see when expert parallelism meets an unbalanced router.

The trace routes fake scores, so every EP rank receives the balanced share of routed rows (T x k per micro-batch:
its ep ranks send each other equal parts). A real router sends some ranks more. The most-loaded rank's received
rows are `factor` x the balanced share (a capacity factor; a run's logged MaxVio, max expert load / mean - 1, bounds
it from above: factor <= 1 + MaxVio, since a rank's load is a sum over its experts), and everything its routed
experts hold per row grows with them.

Bytes alive per routed row at the peak of one MoE layer's forward + backward (the layer in flight under full
activation checkpointing; every MoE layer's saved rows otherwise), measured with torch's MemTracker on
`RoutedExperts` in bf16 (top-4 of 16 experts; the slope of the peak over the row count at three (hidden, inner)
widths, solved for the three terms): 5.8 bf16 copies of the hidden width (the gathered rows, their fp32 weighted
outputs and the gradients), 4 of the expert's inner width (gate, up, their product and its gradient) and 392 bytes
of per-row index and weight tensors. For DeepSeek-V3 (7168 / 2048) that is 98 KiB per row: 3.05 GiB for the
4096 x 8 rows of a 4K pack, so each +0.1 of factor costs 0.3 GiB on the hot rank.

Without expert parallelism every expert is local: skew moves rows between experts, not between ranks, and the
grouped GEMM's memory depends on the row total alone (no term).
"""

from __future__ import annotations

from dataclasses import dataclass

from mindvl.models.config import MindVLConfig

ROW_COPIES_HIDDEN = 5.8  # bf16 copies of the hidden width per routed row at the peak (measured, module docstring)
ROW_COPIES_INNER = 4.0  # bf16 copies of the expert's inner width per routed row
ROW_FIXED_BYTES = 392  # per-row index and routing-weight tensors
SENSITIVITY = (1.25, 1.5, 2.0, 3.0)  # factors the planner's report prints the headroom at
_BF16 = 2


def routed_row_bytes(config: MindVLConfig) -> float:
    t = config.text
    return ROW_FIXED_BYTES + _BF16 * (ROW_COPIES_HIDDEN * t.hidden_size + ROW_COPIES_INNER * t.moe_intermediate_size)


@dataclass
class Skew:
    """The skew term of a plan: extra bytes on the hot EP rank per +1.0 of factor, and at the factor asked for."""

    factor: float
    bytes_per_unit: int  # extra bytes at the peak per +1.0 of factor over balanced
    rows_balanced: int  # routed rows per MoE layer in flight per micro-batch, balanced
    layers_in_flight: int

    @property
    def extra_bytes(self) -> int:
        return int(max(0.0, self.factor - 1.0) * self.bytes_per_unit)

    def headroom_at(self, factor: float, peak: int, reserve: int, capacity: int, growth: float = 1.0) -> float:
        """Headroom at `factor` given the balanced peak and its reserve; `growth`: the reserve's bytes per planned
        byte (mindvl.plan.margin), so the skew term costs growth x its bytes."""
        return 1.0 - (peak + reserve + growth * max(0.0, factor - 1.0) * self.bytes_per_unit) / capacity

    def break_even(self, peak: int, reserve: int, capacity: int, growth: float = 1.0) -> float | None:
        """The largest factor that still fits (None: no skew term)."""
        if not self.bytes_per_unit:
            return None
        return 1.0 + (capacity - peak - reserve) / (growth * self.bytes_per_unit)


def routing_skew(config: MindVLConfig, tokens_per_micro_batch: int, expert_parallel: int, checkpointing: str,
                 factor: float = 1.0) -> Skew:
    """The skew term for one rank: `tokens_per_micro_batch` (the largest pack), `checkpointing` off/full/selective."""
    if factor < 1.0:
        raise ValueError(f"routing skew factor must be >= 1 (1 = balanced), got {factor}")
    t = config.text
    if expert_parallel <= 1 or not t.has_experts:  # DeepSeek-V3's or Qwen3-MoE's routed experts
        return Skew(factor, 0, 0, 0)
    rows = tokens_per_micro_batch * t.num_experts_per_tok
    layers = 1 if checkpointing == "full" else t.num_hidden_layers - t.first_k_dense_replace
    return Skew(factor, int(rows * routed_row_bytes(config) * layers), rows, layers)


def rank_factor(expert_load, expert_parallel: int) -> float:
    """The capacity factor a routing produced at `expert_parallel` ranks: per MoE layer, the most-loaded rank's
    routed rows over the mean (ranks hold consecutive slices of E / ep experts, as mindvl's EP shards them), the
    maximum over layers. `expert_load`: [layers, experts] counts (the routers' `expert_load`). 1.0 = balanced."""
    import torch

    loads = torch.as_tensor(expert_load, dtype=torch.float64)
    layers, experts = loads.shape
    if expert_parallel < 1 or experts % expert_parallel:
        raise ValueError(f"expert_parallel {expert_parallel} must divide the {experts} experts")
    ranks = loads.reshape(layers, expert_parallel, experts // expert_parallel).sum(-1)
    mean = ranks.mean(-1)
    busy = mean > 0
    if not bool(busy.any()):
        return 1.0
    return float((ranks.amax(-1)[busy] / mean[busy]).max())
