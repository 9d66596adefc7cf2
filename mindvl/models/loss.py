"""Cross-entropy over labelled tokens, computed in chunks so the [tokens, vocab] logits never exist at once.

Returns (sum, count): the trainer divides by the number of labelled tokens of the whole global batch, across
micro-batches and ranks, so every labelled token weighs the same however the batch was packed.

The forward pass of `ChunkedLinearCrossEntropy` also computes the gradients chunk by chunk (logits are recomputed
nowhere and saved nowhere); backward only scales them by the incoming gradient. Peak extra memory is one chunk of
logits, [chunk, vocab] in float32.
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE_INDEX = -100


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """labels [T] aligned with input_ids -> targets [T]: token t is trained to predict labels[t + 1] of its OWN sample.

    The last token of every sample gets IGNORE_INDEX, so nothing is ever predicted across a packing boundary.
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    ends = cu_seqlens[1:].long() - 1
    targets[ends[ends >= 0]] = IGNORE_INDEX
    return targets


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):  # hidden [N, H], weight [V, H], targets [N]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            t = targets[start : start + chunk_size]
            logits = (h @ weight.T).float()  # [c, V]; the matmul in the activation dtype, as transformers does
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if need_h or need_w:
                grad_logits = torch.softmax(logits, dim=-1)
                grad_logits[torch.arange(len(t), device=t.device), t] -= 1.0
                if need_h:
                    grad_h[start : start + chunk_size] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_w += grad_logits.T @ h.float()
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        # The weight gradient is accumulated over chunks in float32 and cast once, here.
        gw = (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, lm_head: nn.Module | torch.Tensor, targets: torch.Tensor, chunk_size: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], lm_head weight [V, H], targets [T] (IGNORE_INDEX = not trained) -> (loss_sum fp32, count)."""
    weight = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
    keep = targets != IGNORE_INDEX
    count = keep.sum()
    # Only labelled rows reach the vocabulary projection; in SFT most tokens (prompts, images) are not labelled.
    loss_sum = ChunkedLinearCrossEntropy.apply(hidden[keep], weight, targets[keep], chunk_size)
    return loss_sum, count
