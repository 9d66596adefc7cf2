"""KV cache of B independent sequences for incremental decoding (the GQA layout: per-head keys and values).

`KVCache` owns the bookkeeping every cache shares (where a forward's tokens land, the lengths, the decode mask,
dropping finished sequences); `MLACache` (mla_cache.py) reuses it for MLA's latents. An attention layer receives a
`LayerKV`: its own layer's view of the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import attend


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
    """One layer's view of a cache, handed down to its attention: a GQA layer calls `attend`, an MLA layer
    `attend_latent` (an MLACache's), each with this layer's index filled in."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def attend(self, q, k, v, cu_seqlens, max_seqlen, backend: str, last_only: bool = False) -> torch.Tensor:
        return self.cache.attend(self.layer, q, k, v, cu_seqlens, max_seqlen, backend, last_only)

    def attend_latent(self, *args, **kwargs) -> torch.Tensor:
        return self.cache.attend_latent(self.layer, *args, **kwargs)
