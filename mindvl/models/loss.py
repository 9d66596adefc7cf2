"""Cross-entropy over labelled tokens, computed in chunks so the [tokens, vocab] logits never exist at once.

Returns (sum, count): the trainer divides by the number of labelled tokens of the whole global batch, across
micro-batches and ranks, so every labelled token weighs the same however the batch was packed.

`ChunkedLinearCrossEntropy` walks the vocabulary in slices `W[v0:v1]` (as many rows as keep one [tokens, slice]
float32 logits block the size of a [chunk_size, vocab] one):
- forward: an online logsumexp over the slices (and the target logits); it saves only `lse` [N] besides its inputs.
- backward: recomputes each slice's logits, and writes that slice's weight gradient `dW[v0:v1] = dlogits^T @ h`
  straight into a gradient of the weight's own dtype (bf16 under mixed precision: the size FSDP's unsharded
  gradient has anyway), with the matmul in the activation dtype like any other linear layer's backward. No float32
  [vocab, hidden] buffer exists at any time; the hidden-state gradient [N, H] accumulates over slices in float32.
The price is one extra logits matmul (4 instead of 3 per labelled token) on the head alone.

At GEMM speed (measured on an H200: the loss spent 191 ms on pre-Hopper `sm75` cutlass kernels for ~20 ms of GEMMs):
- slices are whole multiples of `SLICE_ALIGN` (256) vocabulary rows, so every logits block's row stride is 16-byte
  aligned and the GEMM shapes are those the fast (TMA / tensor-core) kernels take; only the last slice is ragged;
- both operands reach the matmuls contiguous and in ONE compute dtype (the autocast dtype when autocast is on, else
  the hidden states' own), cast once per call outside the slice loop, not per slice; the loss's autograd Function
  runs with autocast off, so no op inside it casts again;
- no host syncs inside the walk: the target logit is gathered and the softmax gradient's `-1` scattered with
  device-side masks (no boolean indexing); the labelled rows are gathered with a host-known count when the caller
  has one (`n_labelled`), else with a boolean mask (one sync).
"""

from __future__ import annotations

import torch
from torch import nn

from mindvl.conventions import IGNORE_INDEX

from .host import next_token_targets  # noqa: F401  (re-exported: the loss's callers name the rule here)
from .layers import autocast_dtype, autocast_off

SLICE_ALIGN = 256  # vocabulary rows per slice: a multiple of this (16-byte aligned strides, whole GEMM tiles)


def _vocab_slices(n_rows: int, vocab: int, chunk_size: int) -> range:
    """Slice starts over the vocabulary: [n_rows, step] logits hold about as many values as [chunk_size, vocab],
    `step` rounded up to a multiple of SLICE_ALIGN (the whole vocabulary when it is smaller)."""
    step = max(1, -(-chunk_size * vocab // max(1, n_rows)))
    step = -(-step // SLICE_ALIGN) * SLICE_ALIGN
    return range(0, vocab, min(vocab, step))


def online_logsumexp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's walk over `weight`'s vocabulary rows: (running max, sum of exp(logit - max), target logit),
    each [N] float32. A target outside [0, V) adds 0 to its target logit (the vocabulary-parallel loss passes the
    other ranks' targets that way)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    starts = _vocab_slices(n, vocab, chunk_size)
    running_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
    running_sum = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    target_logit = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for v0 in starts:
        w = weight[v0 : v0 + starts.step]
        logits = torch.mm(hidden, w.t()).float()  # [N, s]; the matmul in the activation dtype, as transformers
        inside = (targets >= v0) & (targets < v0 + w.shape[0])
        local = (targets - v0).clamp(0, w.shape[0] - 1)
        target_logit += torch.where(inside, logits.gather(1, local[:, None]).squeeze(1), 0.0)
        new_max = torch.maximum(running_max, logits.amax(dim=1))
        block_sum = logits.sub_(new_max[:, None]).exp_().sum(1)  # in place: one logits block at a time
        running_sum = running_sum * torch.exp(running_max - new_max) + block_sum
        running_max = new_max
    return running_max, running_sum, target_logit


def slice_gradients(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    grad_loss: torch.Tensor, chunk_size: int, need_h: bool,
                    need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward's walk over `weight`'s vocabulary rows: (dL/dhidden float32 [N, H] or None, dL/dweight in the
    weight's dtype or None), recomputing each slice's softmax from `lse`."""
    starts = _vocab_slices(hidden.shape[0], weight.shape[0], chunk_size)
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    for v0 in starts:
        w = weight[v0 : v0 + starts.step]
        grad_logits = torch.mm(hidden, w.t()).float().sub_(lse[:, None]).exp_()  # softmax slice, in place
        inside = (targets >= v0) & (targets < v0 + w.shape[0])
        local = (targets - v0).clamp(0, w.shape[0] - 1)
        grad_logits.scatter_add_(1, local[:, None], inside.to(grad_logits.dtype).neg()[:, None])  # -1 at targets
        grad_logits = grad_logits.mul_(grad_loss).to(hidden.dtype)
        if need_h:
            grad_h += torch.mm(grad_logits, w.to(hidden.dtype))
        if need_w:
            block = grad_w[v0 : v0 + w.shape[0]]  # contiguous rows of the gradient: the GEMM writes them in place
            if weight.dtype == hidden.dtype:
                torch.mm(grad_logits.t(), hidden, out=block)
            else:
                block.copy_(torch.mm(grad_logits.t(), hidden))
    return grad_h, grad_w


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):  # hidden [N, H], weight [V, H], targets [N]
        running_max, running_sum, target_logit = online_logsumexp(hidden, weight, targets, chunk_size)
        lse = running_max + torch.log(running_sum)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        return (lse - target_logit).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h, grad_w = slice_gradients(hidden, weight, targets, lse, grad_loss, ctx.chunk_size, need_h, need_w)
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the loss's GEMMs run in: autocast's where it is on for the hidden states' device, else theirs."""
    dtype = autocast_dtype(hidden.device.type)  # None on devices without autocast (meta: the planner, the tests)
    return dtype if dtype is not None and hidden.is_floating_point() else hidden.dtype


def chunked_cross_entropy(
    hidden: torch.Tensor, lm_head: nn.Module | torch.Tensor, targets: torch.Tensor, chunk_size: int = 2048,
    n_labelled: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], lm_head weight [V, H], targets [T] (IGNORE_INDEX = not trained) -> (loss_sum fp32, count).

    `n_labelled` (optional): the number of labelled targets, known on the host (the packer counts them): the rows
    are then gathered without reading the mask back to the host."""
    weight = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
    keep = targets != IGNORE_INDEX
    count = keep.sum()
    # Only labelled rows reach the vocabulary projection; in SFT most tokens (prompts, images) are not labelled.
    if n_labelled is None:
        rows = keep.nonzero().squeeze(1)  # one host sync: the number of labelled rows
    else:
        rows = torch.nonzero_static(keep, size=n_labelled).squeeze(1)
    dtype = compute_dtype(hidden)
    # One cast and one gather per call (their backward casts the gradients back once), not one per vocabulary slice.
    h = hidden.index_select(0, rows).to(dtype)
    w = weight.to(dtype).contiguous()
    kind = hidden.device.type
    with autocast_off(kind):
        loss_sum = ChunkedLinearCrossEntropy.apply(h, w, targets.index_select(0, rows), chunk_size)
    return loss_sum, count
