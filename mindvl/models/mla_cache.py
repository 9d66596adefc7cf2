"""KV cache for Multi-head Latent Attention: caches what MLA compresses, not per-head keys and values.

Per layer and sequence, a cached token is its normalised latent c_kv = rms(kv_a(x)[:kv_lora_rank]) [r] and its
rotated rope key [rope] (ONE shared by all heads): r + rope numbers per token and layer (576 for DeepSeek-V3 against
128 heads x (192 + 128) = 40,960 for expanded K/V, 71x less).

- Prefill (the packed prompts): the latents are stored, then expanded through kv_b_proj and attended with the
  training path's varlen attention, so a prompt's numerics are those of its full forward.
- Decode (one token per sequence): kv_b_proj is absorbed into the query and the output (DeepSeek-V2 §2.1.3). With
  kv_b's weight viewed as [heads, nope + v, r] = [W_uk | W_uv], a head's score against cached token j is
  (q_nope W_uk) . c_j + q_rope . k_rope_j, and its output is (sum_j p_j c_j) W_uv^T. Cached tokens are never
  expanded; the heads of one sequence share one key/value "head" of width r + rope, so it is one sdpa call with the
  heads standing in for query positions (as KVCache does for GQA).

Storage reuses KVCache's bookkeeping (begin/commit/keep and the decode mask): `keys[layer]` holds each cached
token's latent and rope key side by side, [B, capacity, r + rope] (`values` stays empty). A decode step's keys are
then a view of the cache (the latent half is also its values), not a concatenated copy of the whole window per layer
and step, which at long contexts moved more bytes than the attention reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import attend
from .kv_cache import KVCache


class MLACache(KVCache):
    """A KVCache whose per-layer entries are MLA latents and rope keys (see the module docstring)."""

    def attend_latent(self, layer: int, kv_b_weight: torch.Tensor, q_pass: torch.Tensor, q_rot: torch.Tensor,
                      latent: torch.Tensor, k_rot: torch.Tensor, v_dim: int, scale: float, cu_seqlens, max_seqlen,
                      backend: str) -> torch.Tensor:
        """q_pass [T, nh, nope], q_rot [T, nh, rope], latent [T, r] (normalised), k_rot [T, rope] (rotated) of this
        forward's tokens; kv_b_weight [nh * (nope + v), r] -> attention output [T, nh, v]. Stores latent/k_rot."""
        step = self._step
        n, nh, nope = q_pass.shape
        r, rope = latent.shape[-1], q_rot.shape[-1]
        if self.keys[layer] is None:
            self.keys[layer] = latent.new_zeros(self.batch, self.capacity, r + rope)
        cached = self.keys[layer]  # [B, capacity, r + rope]: latent | rope key
        cached[step.rows, step.slots] = torch.cat([latent, k_rot.to(latent.dtype)], dim=-1)
        if step.mask is None:  # prefill: expand the new tokens' keys/values, the training path's attention
            kv = F.linear(latent, kv_b_weight).view(n, nh, nope + v_dim)
            k_pass, v = kv.split([nope, v_dim], dim=-1)
            q = torch.cat([q_pass, q_rot], dim=-1)
            k = torch.cat([k_pass, k_rot[:, None, :].expand(n, nh, rope)], dim=-1)
            return attend(q, k, v, cu_seqlens, max_seqlen, causal=True, scale=scale, backend=backend)
        w = kv_b_weight.view(nh, nope + v_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [nh, nope, r], [nh, v, r]
        q_latent = torch.einsum("bhn,hnr->bhr", q_pass, w_uk)  # [B, nh, r]
        q = torch.cat([q_latent, q_rot], dim=-1)[:, None]  # [B, 1, nh, r + rope]: heads as query positions
        k = cached[:, None, :step.width]  # [B, 1, width, r + rope], a view
        out_latent = F.scaled_dot_product_attention(q, k, k[..., :r], attn_mask=step.bias(q.dtype),
                                                    scale=scale)  # [B, 1, nh, r]
        return torch.einsum("bhr,hvr->bhv", out_latent[:, 0], w_uv)  # [B, nh, v]

