"""Context parallelism (CP) for the language model on packed rows: one pack split over `parallel.context_parallel`
ranks, attention exact across the split (DeepSpeed-Ulysses-style all-to-all over heads). Applied from outside the
model by `prepare_model` (the `context_parallel` transform, before FSDP).

Layout. The world is data shards x context (x tensor): the N ranks of a CP group are consecutive, read the SAME
pack (the layout's `dp_rank` is shared by them) and rank c of the group owns the contiguous token chunk
[c*T//N, (c+1)*T//N) of the T-token row. FSDP shards every weight over data shards x context (the flattened
"dp_cp" mesh, as torchtitan does): CP ranks hold different activations of the same weights, so their gradients are
summed like data-parallel ones.

Why all-to-all over heads (Ulysses) rather than ring attention, for varlen packed rows with M-RoPE:
- The row is positions-first: M-RoPE positions ([3, T]: time/height/width restarting in every sample) depend on
  the whole sample (an image's grid moves the text after it), so they are computed on the FULL row (the model's
  own `default_position_ids`, or the loader's) before any split, then sliced with the tokens: each rank rotates
  its own queries/keys, nothing about positions is re-derived per shard.
- Attention then runs on the full sequence with Hq/N heads per rank: every rank calls the unchanged varlen
  attention (sdpa buckets, flex, flash-attn varlen, the NPU TND kernel) with the row's own cu_seqlens. Sample
  boundaries never need translating into per-chunk Q/KV offsets, as a ring over a varlen row would (a sample may
  span chunks, a chunk holds several samples, and a causal ring needs zig-zag chunks to balance its triangle);
  Ulysses is balanced by construction (every rank attends every token for its heads).
- Cost: 4 all-to-alls per layer forward (q, k, v in; the output back) and 4 in the backward, each moving
  (N-1)/N of a [T/N, heads, D] tensor; ring attention moves K/V N-1 times per layer. The limit is N <= heads:
  `num_attention_heads` must be a multiple of N. KV heads fewer than N (or not a multiple of it) are replicated
  up to lcm(KV heads, N) before the exchange (exact: each query head keeps its own KV head, and the replica
  gradients sum back in repeat_interleave's backward).

What runs where:
- Vision tower and projector: every CP rank of a group runs them on all the pack's images (the data-parallel
  layout the paper gives the ViT). Why: exact with no collective and no change to how features fill the pad slots
  (an image's pads may straddle two chunks); the cost is the tower's compute and activations replicated N times
  within a group, which the planner counts (its activations are not divided by N). Splitting the images over the
  group (features all-gathered) is the follow-up when the tower's share grows (long video at many frames).
- Embedding: full row; the language model's forward pre-hook slices embeddings and positions to this rank's chunk.
- Decoder layers: norms, projections and MLPs are token-wise, so they run on the chunk unchanged; each attention
  module's `attend` (a per-instance hook the model exposes: `GQAttention.attend`, `MLAttention.attend`) becomes
  `UlyssesAttention`: q/k/v [T/N, H, D] -> all-to-all -> [T, H/N, D] -> varlen attention with the full cu_seqlens
  -> all-to-all back -> [T/N, H, D].
- Loss: the language model's forward post-hook places the chunk's final hidden states back at their rows of a
  [T, H] tensor (zeros elsewhere: no communication); `shard_labels` (called by the step and the evaluation before
  the forward) keeps only the labels whose next-token target lies in this rank's chunk, so the loss head reads
  only its own rows and every labelled token is counted by exactly one rank of the group. The step then sums loss
  and counts over the world and divides by the labelled tokens of the dp x cp group: the same normalisation as
  one process. Gradient scale: FSDP averages over dp x cp ranks, so the step multiplies by `fsdp_size`.

Activation checkpointing recomputes a block in the backward, after the forward returned: the attention therefore
reads the row's length from its `cu_seqlens` argument (each chunk's size follows from it), not from the hooks'
state, and the recomputation repeats the same all-to-alls on every rank. The planner traces all of it on fake
tensors over a fake process group (`mindvl plan`), and counts the all-to-all bytes (`plan.estimate`).

Checkpoints: parameters are FSDP DTensors over dp x cp with their global shapes; DCP reshards them to any other
layout (a run written at CP=2 resumes at CP=1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mindvl.conventions import IGNORE_INDEX
from mindvl.models.attention import attend

CP_KEY = "parallel.context_parallel"  # the recipe key named in every context-parallel error


def chunk_bounds(total: int, size: int, index: int) -> tuple[int, int]:
    """Rows [a, b) of a `total`-token row that CP rank `index` of `size` owns (contiguous, sizes differ by <= 1)."""
    return index * total // size, (index + 1) * total // size


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The language model's attention modules: those exposing the `attend` hook (inside checkpoint wrappers too)."""
    return [m for m in model.language_model.modules() if hasattr(m, "attend") and hasattr(m, "num_heads")]


def check_context_parallel(size: int, world_size: int, model: nn.Module | None = None, ep: int = 1) -> None:
    """One-line errors naming the key: a size that does not divide the world or the heads, or an unsupported mix."""
    if size == 1:
        return
    if world_size % size:
        raise ValueError(f"{CP_KEY}: {size} must divide the world size {world_size}")
    if ep > 1:
        raise ValueError(f"{CP_KEY}: {size} with parallel.expert_parallel {ep} is not supported yet; set one of "
                         "them to 1")
    if model is None:
        return
    heads = model.config.text.num_attention_heads
    if heads % size:
        raise ValueError(f"{CP_KEY}: {size} must divide the language model's num_attention_heads ({heads}): "
                         "each rank attends heads/N heads over the whole row")


def kv_replication(heads: int, kv_heads: int, size: int) -> int:
    """How many times each KV head is repeated so that the KV heads split evenly over `size` ranks (1 when they
    already do): lcm(kv_heads, size) / kv_heads. It divides heads/kv_heads because `size` divides heads."""
    return math.lcm(kv_heads, size) // kv_heads


@dataclass
class _RowState:
    """Whether the language model's latest forward is a context-parallel one (a training/evaluation row, not a
    generation call with a cache): set by its forward pre-hook and kept until the next forward, so that the
    recomputation of activation checkpointing (in the backward, after the forward returned) sees the same."""

    active: bool = False


class UlyssesAttention:
    """`attend` over a CP group: local chunk [n_c, H, D] -> full row, H/N heads -> varlen attention -> back.

    Not an nn.Module (no parameters, no state_dict entry): an attention module's `attend` attribute."""

    def __init__(self, group, size: int, index: int, state: _RowState) -> None:
        self.group, self.size, self.index, self.state = group, size, index, state

    def _sizes(self, total: int) -> list[int]:
        return [chunk_bounds(total, self.size, i)[1] - chunk_bounds(total, self.size, i)[0] for i in range(self.size)]

    def _to_heads(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[n_c, H, D] (this rank's tokens, all heads) -> [T, H/N, D] (all tokens, this rank's heads)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        n, (rows, heads, dim) = self.size, x.shape
        send = x.reshape(rows, n, heads // n, dim).transpose(0, 1).reshape(n * rows, heads // n, dim)
        return all_to_all_single_autograd(send.contiguous(), sizes, [rows] * n, self.group)

    def _to_tokens(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[T, H/N, D] -> [n_c, H, D] (the inverse of `_to_heads`)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        n, rows = self.size, sizes[self.index]
        got = all_to_all_single_autograd(x.contiguous(), [rows] * n, sizes, self.group)  # [N * n_c, H/N, D]
        return got.reshape(n, rows, x.shape[1], x.shape[2]).transpose(0, 1).reshape(rows, n * x.shape[1], x.shape[2])

    # A compile boundary like `attend` itself: the row's host offsets (models.host.Segments) and the chunk sizes
    # made from them never enter a compiled block's graph.
    @torch.compiler.disable
    def __call__(self, q, k, v, cu_seqlens, max_seqlen, causal, window=None, scale=None, backend="auto"):
        if not self.state.active:  # outside a context-parallel forward of the language model (never in training)
            return attend(q, k, v, cu_seqlens, max_seqlen, causal, window, scale, backend)
        reps = kv_replication(q.shape[1], k.shape[1], self.size)
        if reps > 1:
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
        sizes = self._sizes(int(cu_seqlens[-1]))  # the whole row's length: every chunk's size follows from it
        q, k, v = (self._to_heads(t, sizes) for t in (q, k, v))
        out = attend(q, k, v, cu_seqlens, max_seqlen, causal, window, scale, backend)
        return self._to_tokens(out, sizes)


def apply_context_parallel(model: nn.Module, group, size: int, index: int) -> None:
    """Install the hooks (see the module docstring) on a built model: the language model's forward pre/post-hooks
    and every decoder attention's `attend`. Works on the meta device; idempotent per model."""
    lm = model.language_model
    state = _RowState()

    def before(module, args, kwargs):
        state.active = kwargs.get("cache") is None and len(args) >= 4  # generation (a cache): unchanged
        if not state.active:
            return None
        embeds, positions, cu_seqlens, max_seqlen = args[:4]
        a, b = chunk_bounds(embeds.shape[0], size, index)
        return (embeds[a:b], positions[..., a:b], cu_seqlens, max_seqlen, *args[4:]), kwargs

    def after(module, args, kwargs, hidden):
        if not state.active:
            return None
        total = int(args[2][-1])  # cu_seqlens: the whole row
        a, b = chunk_bounds(total, size, index)
        # This chunk's rows at their places in the row; the loss reads only these (see shard_labels).
        return F.pad(hidden, (0, 0, a, total - b))

    lm.register_forward_pre_hook(before, with_kwargs=True)
    lm.register_forward_hook(after, with_kwargs=True)
    for attn in attention_modules(model):
        attn.attend = UlyssesAttention(group, size, index, state)


def shard_labels(batch: dict, size: int, index: int) -> dict:
    """The pack's model inputs for CP rank `index` of `size`: the same tensors, with labels kept only where their
    next-token target is predicted inside this rank's chunk [a, b) (token t predicts labels[t + 1], so labels
    [a+1, b+1) stay). Identity at size 1."""
    if size == 1 or batch.get("labels") is None:
        return batch
    labels = batch["labels"]
    a, b = chunk_bounds(labels.shape[0], size, index)
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[a + 1 : b + 1] = True
    return {**batch, "labels": torch.where(keep, labels, IGNORE_INDEX)}
