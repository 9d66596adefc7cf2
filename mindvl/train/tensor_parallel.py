"""Tensor parallelism with sequence parallelism (Megatron-style) for the language model, applied from outside.

`parallel.tensor_parallel: N` splits every dense decoder layer over the N innermost ranks of the layout (the "tp" dim
of a ("dp", "tp") mesh; FSDP2 then shards each TP shard over "dp": 2-D parallelism) with DTensor's
`parallelize_module`; the model stays plain PyTorch (its attention reads head counts from the projections' widths).

Per decoder layer (T tokens of the packed row, H hidden):

    x [T/N, H] (sequence-sharded DTensor) -> input_layernorm (SequenceParallel: the norm on T/N rows)
      -> all-gather the sequence -> q/k/v_proj (ColwiseParallel: heads/N query and KV heads per rank; Qwen3's q/k
         norms run per head on the local heads, their weight replicated) -> varlen attention on the local heads
      -> o_proj (RowwiseParallel) -> reduce-scatter the sequence -> + residual (T/N rows)
      -> post_attention_layernorm (SequenceParallel) -> all-gather -> gate/up_proj (ColwiseParallel: I/N columns)
      -> down_proj (RowwiseParallel) -> reduce-scatter -> + residual

so between the attention and MLP blocks every activation (residual stream, norms, their inputs saved for backward)
is 1/N per rank, and each block costs one all-gather and one reduce-scatter of [T, H] in the forward (their
transposes in the backward). Attention needs no exchange: heads are independent, and cu_seqlens and the M-RoPE
tables (replicated inputs of every rank) apply to each rank's local heads unchanged.

The language model's input (embeddings with the vision features scattered in, identical on every TP rank) is split
along the sequence without communication; its output (after the final norm) is all-gathered once for the loss.

Vocabulary-parallel loss: `lm_head.weight` is split along the vocabulary (V/N rows per rank) and the model's
`cross_entropy` becomes `VocabParallelCrossEntropy`: the chunked loss of mindvl.models.loss over the rank's own
vocabulary rows, its online logsumexp combined over the TP group with one MAX and one SUM all-reduce of [N_labelled]
values, the hidden-state gradient summed with one all-reduce of [N_labelled, H]. No rank ever holds a [tokens, V]
logits tensor or a gathered vocabulary: one [chunk, V/N] block at a time. torch's `loss_parallel` was not used: it
needs the whole [tokens, V/N] logits as a DTensor (no chunking, the memory the chunked loss exists to avoid) and
returns a mean where the step needs a sum. A tied head (the embedding matrix) stays replicated and every TP rank
computes the (identical) loss on the full vocabulary.

What stays replicated over "tp" (identical on its ranks, sharded by FSDP over "dp" only): the token embedding (the
vision features are scattered into its output; a vocabulary-split embedding would need the scatter on a DTensor),
the vision tower and the projector (every TP rank runs them on the same images: the 0.67B ViT is ~2% of the
72B-shaped SFT's FLOPs, so at TP 8 the replicated towers add ~15% compute per rank; splitting images over the TP
ranks is left for later), and the final norm's weight. Their gradients are equal on the TP ranks, so FSDP's average
over "dp" is the global one.

Gradients: the loss is the same value on every TP rank, and the step backpropagates it once per rank; a sharded
weight's gradient is then exactly its slice of the one-process gradient; replicated weights used on sequence shards
(the norms) get partial gradients that DTensor sums over "tp". The step divides its token counts and loss sum,
summed over the world, by N (the ranks of a TP group hold the same packs).

Not covered: MoE / MLA (deepseek_v3) language models (expert parallelism splits those), TP of the vision tower, and
generation on a TP-split model (the trainer's validation loss runs the training forward, which works).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mindvl.conventions import IGNORE_INDEX
from mindvl.models.loss import online_logsumexp, slice_gradients

TP_KEY = "parallel.tensor_parallel"  # the recipe key named in every tensor-parallel error


def check_tensor_parallel_layout(size: int, world_size: int, ep: int) -> None:
    """One-line errors naming the key: a size that is not a positive divisor of the world, or TP with EP."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{TP_KEY}: must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    if world_size % size:
        raise ValueError(f"{TP_KEY}: {size} must divide the world size {world_size}")
    if ep > 1:
        raise ValueError(f"{TP_KEY}: {size} with parallel.expert_parallel {ep}: expert parallelism serves MoE "
                         "(deepseek_v3) models, which tensor parallelism does not split; set one of them to 1")


def text_problem(size: int, text) -> str | None:
    """What keeps a language-model config (a TextConfig) from splitting `size` ways, or None."""
    if getattr(text, "is_moe", False):
        return ("asks for tensor parallelism, but the language model is a deepseek_v3 (MoE/MLA) model, which "
                "parallel.expert_parallel splits; set it to 1")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, name)
        if value % size:
            return f"must divide the language model's {name} ({value})"
    return None


def check_tensor_parallel(size: int, model: nn.Module) -> None:
    """The built model against the size (a model given by folder is only known here)."""
    if size == 1:
        return
    problem = text_problem(size, model.config.text)
    if problem is not None:
        raise ValueError(f"{TP_KEY}: {size} {problem}")


# ------------------------------------------------------------------------------------------------- the plan


def apply_tensor_parallel(model: nn.Module, mesh) -> None:
    """Split the language model of a MindVL (meta device or real) over the 1-D `mesh` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    lm = model.language_model
    seq = Shard(0)  # packed rows are [T, H]: the sequence is dim 0
    # (inputs_embeds, position_ids, cu_seqlens, max_seqlen): the embeddings, equal on every rank, split locally
    parallelize_module(lm, mesh, PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                                    desired_input_layouts=(seq, None, None, None)))
    parallelize_module(lm, mesh, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=Replicate(),
                                                     use_local_output=True))  # the loss reads full rows
    parallelize_module(lm, mesh, {"norm": SequenceParallel(sequence_dim=0)})
    attn_args = 7  # (x, cos, sin, cu_seqlens, max_seqlen, kv, rows): DecoderLayer's call
    for layer in lm.layers:
        plan = {
            "input_layernorm": SequenceParallel(sequence_dim=0),
            "self_attn": PrepareModuleInput(input_layouts=(seq, *[None] * (attn_args - 1)),
                                            desired_input_layouts=(Replicate(), *[None] * (attn_args - 1))),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
            "post_attention_layernorm": SequenceParallel(sequence_dim=0),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        }
        if layer.self_attn.q_norm is not None:
            # Qwen3's per-head norms see [T, heads/N, D] local tensors: marked as split on the head dim so that
            # their replicated weight's partial gradients are summed over the group
            plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        parallelize_module(layer, mesh, plan)
    if lm.lm_head is not None:
        w = lm.lm_head.weight
        lm.lm_head.weight = nn.Parameter(distribute_tensor(w.data, mesh, [Shard(0)], src_data_rank=None),
                                         requires_grad=w.requires_grad)
        model.cross_entropy = VocabParallelCrossEntropy(mesh)


# ------------------------------------------------------------------------------------ vocabulary-parallel loss


class VocabParallelCrossEntropy:
    """`MindVL.cross_entropy` under TP: (hidden [T, H] full rows, weight [V, H] split on V over the mesh,
    targets [T], chunk) -> (loss sum over labelled targets, their count), equal on every rank of the group."""

    def __init__(self, mesh) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()

    def __call__(self, hidden: torch.Tensor, weight, targets: torch.Tensor, chunk_size: int = 2048,
                 n_labelled: int | None = None):
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        vocab = weight.shape[0]
        rows = -(-vocab // self.size)  # DTensor's Shard(0) splits as torch.chunk does
        start = min(self.rank * rows, vocab)
        if local.shape[0] != min(rows, vocab - start):
            raise ValueError(f"{TP_KEY}: rank {self.rank} holds {local.shape[0]} vocabulary rows of {vocab}, expected "
                             f"{min(rows, vocab - start)}")
        keep = targets != IGNORE_INDEX
        # with a host count (`n_labelled`, as in chunked_cross_entropy) the rows are gathered without a host read
        rows = keep.nonzero().squeeze(1) if n_labelled is None else torch.nonzero_static(keep, size=n_labelled)[:, 0]
        loss = _VocabParallelCE.apply(hidden.index_select(0, rows), local, targets.index_select(0, rows) - start,
                                      chunk_size, self.group)
        return loss, keep.sum()


class _VocabParallelCE(torch.autograd.Function):
    """ChunkedLinearCrossEntropy (mindvl.models.loss) over this rank's vocabulary rows; `targets` are relative to
    the rank's first row (outside [0, V_local) on the other ranks)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, group):
        running_max, running_sum, target_logit = online_logsumexp(hidden, weight, targets, chunk_size)
        # combine the ranks' partial logsumexps: one MAX, then one SUM of (rescaled sum, target logit)
        global_max = running_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        both = torch.stack([running_sum * torch.exp(running_max - global_max), target_logit])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        lse = global_max + torch.log(both[0])
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.group = chunk_size, group
        return (lse - both[1]).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_h, grad_w = slice_gradients(hidden, weight, targets, lse, grad_loss, ctx.chunk_size, need_h=True,
                                         need_w=ctx.needs_input_grad[1])
        # every rank holds its vocabulary rows' share of dL/dh: the full gradient is their sum (always computed,
        # even when no input needs it here, so that every rank of the group runs the same collectives)
        dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_h.to(hidden.dtype), grad_w, None, None, None
