"""Dense decoder LLMs: Qwen3 (q/k RMSNorm, no bias, explicit head_dim) and Qwen2 (qkv bias; Qwen2.5-VL's LLM).

Works on ONE packed row: inputs_embeds [T, H] holding several samples separated by cu_seqlens; attention is causal
within a sample and never crosses samples. Positions come from the caller (restarting per sample): [T] for 1-D RoPE
or [3, T] for M-RoPE.

Generation passes a `KVCache` (B independent sequences): the prefill is the same packed row of B prompts (the same
varlen attention as training, so its numerics are the full forward's) and also stores every token's K/V; each
decode step then takes one token per sequence ([B, H]) and attends over that sequence's cached keys with a key
mask. Without a cache the training path is unchanged.

Generation needs only each prompt's last hidden state, so a prefill may ask for just those (`last_only`): every
layer still computes keys and values for every token (the cache needs them), but the last layer's queries,
attention output, o_proj and MLP run for B tokens instead of T (transformers computes the whole last layer and
keeps only the last logits). That removes almost 1/num_layers of the language model's prefill work; the B kept rows
go through the same ops on fewer rows, so they agree with the full forward to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .config import TextConfig
from .layers import GatedMLP, RMSNorm, apply_rotary, rope_cos_sin


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = "auto"

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV | None = None,
                rows: torch.Tensor | None = None):
        """x [T, H] -> [T, H]; with `rows` [B] (each cached sequence's last token, prefill only) -> [B, H]: keys and
        values for all T tokens go into the cache, queries only for those rows."""
        n = x.shape[0]
        xq, cos_q, sin_q = (x, cos, sin) if rows is None else (x[rows], cos[rows], sin[rows])
        q = self.q_proj(xq).view(xq.shape[0], self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3 normalises per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos, sin)
        if kv is None:
            out = attend(q, k, v, cu_seqlens, max_seqlen, causal=True, backend=self.backend)
        else:
            out = kv.attend(q, k, v, cu_seqlens, max_seqlen, self.backend, last_only=rows is not None)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


class TextDecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False, act=cfg.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV | None = None,
                rows: torch.Tensor | None = None):
        """x [T, H] -> [T, H], or [B, H] for the given `rows` (see TextAttention)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, kv, rows)
        x = (x if rows is None else x[rows]) + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Embedding, decoder layers, final norm and the output projection (absent when tied to the embedding)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TextDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H]: the lm_head weight, or the embedding matrix when the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """inputs_embeds [T, H], position_ids [T] or [3, T] -> final hidden states [T, H] (after the last norm).

        With `cache`: an empty cache takes a prefill (T packed prompt tokens, cu_seqlens [B+1]); a filled one takes
        a decode step (T = B, one token per sequence, cu_seqlens unused). `last_only` (a prefill) returns only each
        prompt's last hidden state [B, H] and skips the rest of the last layer's work (see the module docstring).
        """
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.mrope_section)
        cos, sin = cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)  # transformers rotates text in x.dtype
        x = inputs_embeds
        if cache is None:
            for layer in self.layers:
                x = layer(x, cos, sin, cu_seqlens, max_seqlen)
            return self.norm(x)
        if len(cache.keys) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.keys)} layers but the model has {len(self.layers)}")
        if last_only and (cu_seqlens is None or max(cache.lengths) > 0):
            raise ValueError("last_only applies to a prefill into an empty cache (with cu_seqlens)")
        cache.begin(x.shape[0], cu_seqlens, x.device)
        last = len(self.layers) - 1
        rows = cu_seqlens[1:].long() - 1 if last_only else None  # [B]: each prompt's last token
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cu_seqlens, max_seqlen, LayerKV(cache, i), rows if i == last else None)
        cache.commit()
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.output_weight.T


# ------------------------------------------------------------------------------------------------------ KV cache


class KVCache:
    """Keys and values of B independent sequences for incremental decoding.

    Per layer K and V are [B, Hkv, capacity, D], allocated on the first write in the keys' dtype and device;
    `lengths[b]` counts the tokens cached for sequence b. Rows never see each other: the prefill writes the packed
    prompts (segment b of cu_seqlens -> row b, slots 0..len_b-1), a decode step writes one token per row at slot
    lengths[b], and decode attention masks every slot at or beyond a row's new length. No padding ever enters the
    attention of a valid token, so batching prompts of different lengths does not change their numerics.
    """

    def __init__(self, num_layers: int, batch: int, capacity: int) -> None:
        if batch < 1 or capacity < 1:
            raise ValueError(f"a KV cache needs batch >= 1 and capacity >= 1, got batch={batch} capacity={capacity}")
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = [0] * batch  # host copy: shapes and slicing need Python ints
        self._step: _Step | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def begin(self, num_tokens: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> None:
        """Plan where this forward's tokens go (once per forward, shared by every layer)."""
        b = self.batch
        if max(self.lengths) == 0:  # prefill: segment i of the packed row is sequence i
            if cu_seqlens is None or len(cu_seqlens) != b + 1:
                raise ValueError(f"a prefill into a cache of {b} sequences needs cu_seqlens with {b + 1} entries")
            seg = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(device)
            rows = torch.repeat_interleave(torch.arange(b, device=device), seg)  # [T]
            slots = torch.arange(num_tokens, device=device) - cu_seqlens[:-1].long().to(device)[rows]
            new_lengths = seg.tolist()
            if min(new_lengths) < 1:
                raise ValueError("every prompt needs at least one token")
            mask = None
        else:
            if num_tokens != b:
                raise ValueError(f"a decode step takes one token per sequence ({b}), got {num_tokens}")
            rows = torch.arange(b, device=device)
            slots = torch.tensor(self.lengths, device=device)
            new_lengths = [n + 1 for n in self.lengths]
            width = max(new_lengths)
            # [B, 1, 1, width]: a row's query sees its own cached slots (the new token included), none beyond.
            mask = (torch.arange(width, device=device)[None, :] < (slots + 1)[:, None])[:, None, None, :]
        if max(new_lengths) > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens per sequence; this step needs "
                             f"{max(new_lengths)} (allocate a larger cache)")
        self._step = _Step(rows, slots, new_lengths, mask)

    def commit(self) -> None:
        self.lengths = self._step.new_lengths
        self._step = None

    def keep(self, rows: list[int]) -> None:
        """Keep only these sequences, in this order (finished ones are dropped so decode steps skip them)."""
        if self._step is not None:
            raise RuntimeError("cannot reorder a KV cache in the middle of a forward")
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t[torch.tensor(rows, device=t.device)]
        self.lengths = [self.lengths[r] for r in rows]

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, backend: str, last_only: bool = False
               ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this forward's tokens -> [T, Hq, D]; stores k/v first.

        `last_only` (a prefill): q [B, Hq, D] holds each sequence's last query only, which sees all of its
        sequence's keys, so it attends over the just-written cache like a decode step -> [B, Hq, D]."""
        step = self._step
        if self.keys[layer] is None:
            shape = (self.batch, k.shape[1], self.capacity)
            self.keys[layer] = k.new_zeros(*shape, k.shape[2])
            self.values[layer] = v.new_zeros(*shape, v.shape[2])
        keys, values = self.keys[layer], self.values[layer]
        keys[step.rows, :, step.slots] = k  # advanced indices around a slice: the indexed view is [T, Hkv, D]
        values[step.rows, :, step.slots] = v
        mask = step.mask
        if mask is None:
            if not last_only:
                # The prefill attends within the new tokens only: the training path's varlen attention.
                return attend(q, k, v, cu_seqlens, max_seqlen, causal=True, backend=backend)
            mask = step.last_mask()
        # One query per sequence, so the query heads sharing a KV head can stand in for query positions:
        # [B, Hkv, group, D] against [B, Hkv, width, D] is GQA without expanding K/V, and is a plain sdpa call.
        b, hq, d = q.shape
        hkv, width = k.shape[1], mask.shape[-1]
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, hq // hkv, d), keys[:, :, :width], values[:, :, :width], attn_mask=mask
        )
        return out.reshape(b, hq, values.shape[-1])


class _Step:
    """Where one forward's tokens land in the cache: row and slot per token, the lengths after it, the decode mask."""

    def __init__(self, rows, slots, new_lengths: list[int], mask: torch.Tensor | None) -> None:
        self.rows, self.slots, self.new_lengths, self.mask = rows, slots, new_lengths, mask

    def last_mask(self) -> torch.Tensor:
        """[B, 1, 1, width]: each row's last token sees every slot of its sequence (a prefill's last query)."""
        lengths = torch.tensor(self.new_lengths, device=self.rows.device)
        return (torch.arange(max(self.new_lengths), device=self.rows.device)[None, :] < lengths[:, None])[:, None, None]


class LayerKV:
    """One layer's view of a KVCache, handed down to its attention."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def attend(self, q, k, v, cu_seqlens, max_seqlen, backend: str, last_only: bool = False) -> torch.Tensor:
        return self.cache.attend(self.layer, q, k, v, cu_seqlens, max_seqlen, backend, last_only)
