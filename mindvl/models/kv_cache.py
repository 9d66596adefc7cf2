"""KV cache of B independent sequences for incremental decoding (the GQA layout: per-head keys and values).

`KVCache` owns the bookkeeping every cache shares (where a forward's tokens land, the lengths, the decode mask,
masking or dropping finished sequences); `MLACache` (mla_cache.py) reuses it for MLA's latents and `HybridCache`
(hybrid_cache.py) adds Qwen3.5's conv/recurrent state. An attention layer receives a `LayerKV`: its own layer's view
of the cache.

The cache is static: its buffers are allocated once (by the prefill) for the batch and the capacity, and a decode
step reads and updates only device tensors at fixed addresses, so it needs no device read and can be replayed from a
CUDA graph:
- `lengths_dev` [B] int64 lives on the device; a decode step writes row b's token at slot lengths_dev[b] and adds
  `advance[b]` (1, or 0 for a finished row when the generation loop masks it) in place;
- the host keeps only an upper bound of every row's length (`bound`: the longest prompt plus the steps taken), which
  sizes the attention window without reading the lengths (rounded up to WINDOW_STEP slots, so that a window shape
  serves many steps); `full_width` makes the window the whole capacity instead (one shape for every step, what a
  captured graph needs);
- a finished sequence is masked (its row keeps computing, its length stops advancing, its output is ignored) rather
  than copied out; `keep` compacts the rows when that is worth it (the generation loop does it when more than half
  of the batch is done).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .attention import attend, resolve_backend

# Decode attention spans a multiple of this many slots (capped at the capacity) rather than exactly the longest
# row, so that its shapes repeat. On Hopper and Blackwell, recent torch gives a bf16/fp16 sdpa call to cuDNN first
# (sdp_utils.cpp, check_prefer_cudnn_attention), and cuDNN builds an execution plan for every new shape (cached per
# shape; tens of ms of host per build). The H200 run (shared/measurements/2026-11-28-h200: torch 2.11, cuDNN chosen,
# its profile shows aten::_scaled_dot_product_cudnn_attention) decoded at about 50 ms per token in bf16 against 8 ms
# in fp32, which cuDNN does not take, and transformers' growing cache the same: a window that grows by one slot per
# step asks for a new plan every token. Rounded, one plan serves 128 steps; the masked extra slots cost at most 127
# key reads per row. (What the build costs on the device is for the proof's generate section to measure.)
WINDOW_STEP = 128


class KVCache:
    """Keys and values of B independent sequences for incremental decoding.

    Per layer K and V are [B, Hkv, capacity, D], allocated on the first write in the keys' dtype and device;
    `lengths_dev[b]` counts the tokens cached for sequence b. Rows never see each other: the prefill writes the
    packed prompts (segment b of cu_seqlens -> row b, slots 0..len_b-1), a decode step writes one token per row at
    slot lengths_dev[b], and decode attention masks every slot at or beyond a row's new length. No padding ever
    enters the attention of a valid token, so batching prompts of different lengths does not change their numerics.
    """

    def __init__(self, num_layers: int, batch: int, capacity: int) -> None:
        if batch < 1 or capacity < 1:
            raise ValueError(f"a KV cache needs batch >= 1 and capacity >= 1, got batch={batch} capacity={capacity}")
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._batch = batch
        self.lengths_dev: torch.Tensor | None = None  # [B] int64 on the device, set by the prefill
        self.bound = 0  # host: no row is longer than this (no device read needed to size the window)
        self.filled = False  # host: the prefill has run
        # [B] int64 on the device: what a decode step adds to each row's length (1 running, 0 finished); None: 1.
        self.advance: torch.Tensor | None = None
        self.full_width = False  # decode attends over the whole capacity (fixed shapes, for graph capture)
        self._rows: torch.Tensor | None = None  # arange(B) on the device, made once
        self._slots_range: torch.Tensor | None = None  # arange(capacity) on the device, made once
        self._step: _Step | None = None
        self.compacted = False  # `keep` replaced the buffers: a captured decode step no longer matches them

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def is_prefill(self) -> bool:
        """True while the forward in progress fills an empty cache (`filled` changes only at `commit`)."""
        return not self.filled

    @property
    def lengths(self) -> list[int]:
        """Each row's cached token count, read back to the host (a device read: for checks and tests, never inside
        a decode step)."""
        return [0] * self.batch if self.lengths_dev is None else self.lengths_dev.tolist()

    def begin(self, num_tokens: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> None:
        """Plan where this forward's tokens go (once per forward, shared by every layer)."""
        b = self.batch
        if not self.filled:  # prefill: segment i of the packed row is sequence i
            if cu_seqlens is None or len(cu_seqlens) != b + 1:
                raise ValueError(f"a prefill into a cache of {b} sequences needs cu_seqlens with {b + 1} entries")
            seg = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(device)
            rows = torch.repeat_interleave(torch.arange(b, device=device), seg, output_size=num_tokens)  # [T]
            slots = torch.arange(num_tokens, device=device) - cu_seqlens[:-1].long().to(device)[rows]
            host = seg.tolist()  # the prefill may read: it sizes the window and checks the prompts
            if min(host) < 1:
                raise ValueError("every prompt needs at least one token")
            if max(host) > self.capacity:
                raise ValueError(f"the KV cache holds {self.capacity} tokens per sequence; this prompt needs "
                                 f"{max(host)} (allocate a larger cache)")
            if self._rows is None:  # kept across a reset: a decode step captured in a graph reads them
                self._rows = torch.arange(b, device=device)
                self._slots_range = torch.arange(self.capacity, device=device)
            self._step = _Step(rows, slots, seg, max(host), None, host, self.window(max(host)))
            return
        if num_tokens != b:
            raise ValueError(f"a decode step takes one token per sequence ({b}), got {num_tokens}")
        if self.advance is None and self.bound + 1 > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens per sequence; this step needs "
                             f"{self.bound + 1} (allocate a larger cache)")
        # A masked (finished) row stops advancing; once at capacity it rewrites its last slot, which nothing reads.
        slots = self.lengths_dev if self.advance is None else self.lengths_dev.clamp(max=self.capacity - 1)
        width = self.capacity if self.full_width else self.window(self.bound + 1)
        # [B, 1, 1, width]: a row's query sees its own cached slots (the new token included), none beyond.
        mask = (self._slots_range[None, :width] <= slots[:, None])[:, None, None, :]
        self._step = _Step(self._rows, slots, None, min(self.capacity, self.bound + 1), mask, None, width)

    def window(self, needed: int) -> int:
        """How many slots a step's attention spans to see `needed` of them: `needed` rounded up to WINDOW_STEP,
        at most the capacity. Slots past a row's length are masked, so the width changes no result; rounding it
        makes the attention shapes repeat (see WINDOW_STEP)."""
        return min(self.capacity, -(-needed // WINDOW_STEP) * WINDOW_STEP)

    def commit(self) -> None:
        step, self._step = self._step, None
        if step.new_lengths is not None:  # prefill
            if self.lengths_dev is None:
                self.lengths_dev = step.new_lengths
            else:  # a reset cache: in place, where a captured decode step reads the lengths
                self.lengths_dev.copy_(step.new_lengths)
            self.filled = True
        else:
            self.lengths_dev.add_(1 if self.advance is None else self.advance)  # in place: a fixed address
        self.bound = step.bound

    def reset(self) -> None:
        """Empty the cache for a new prefill of as many sequences, keeping every buffer where it is (so that a decode
        step captured over it replays on the new prompts). Slots the new prompts do not fill keep stale values,
        which the decode mask never lets a query see."""
        if self.compacted:
            raise RuntimeError("a compacted KV cache cannot be reset for reuse (its buffers were replaced)")
        self.filled, self.bound, self._step = False, 0, None

    def abandon(self) -> None:
        """Forget a forward that raised midway (its slot writes are rewritten by the next forward; the caller
        restores `step_state`)."""
        self._step = None

    def keep(self, rows: list[int] | torch.Tensor) -> None:
        """Keep only these sequences, in this order (compaction: the dropped rows' memory and compute are freed)."""
        if self._step is not None:
            raise RuntimeError("cannot reorder a KV cache in the middle of a forward")
        self.compacted = True
        index = None
        for store in self._row_stores():
            for i, t in enumerate(store):
                if t is not None:
                    if index is None or index.device != t.device:
                        index = torch.as_tensor(rows, device=t.device, dtype=torch.long)
                    store[i] = t.index_select(0, index)
        if index is None:
            index = torch.as_tensor(rows, dtype=torch.long)
        if self.lengths_dev is not None:
            index = index.to(self.lengths_dev.device)
            self.lengths_dev = self.lengths_dev.index_select(0, index)
            self._rows = torch.arange(len(index), device=index.device)
            # a compaction point may read: the dropped rows may have been the longest
            self.bound = max(self.lengths_dev.tolist(), default=0)
        if self.advance is not None:
            self.advance = self.advance.index_select(0, index)
        self._batch = len(index)

    def _row_stores(self) -> list[list[torch.Tensor | None]]:
        """Every per-layer list whose tensors have one row per sequence (subclasses add theirs)."""
        return [self.keys, self.values]

    def step_state(self) -> list[torch.Tensor]:
        """The tensors a decode step updates in place besides K/V slots (whose writes are idempotent): what a graph
        capture must save and restore around its warm-up runs."""
        return [self.lengths_dev]

    def decode_target(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """In a decode step: (keys, values [B, Hkv, capacity, D], rows [B], slots [B]), where the caller stores its
        token's k/v (`store`) before `attend(..., stored=True)`; else (a prefill) None. A compiled layer then
        writes the cache inside its graph, in the kernel that rotates the keys (decode_compile: two kernels fewer
        per layer) rather than in two of their own at the compile boundary."""
        step = self._step
        if step is None or step.mask is None or self.keys[layer] is None:
            return None
        return self.keys[layer], self.values[layer], step.rows, step.slots

    def attend(self, layer: int, q, k, v, cu_seqlens, max_seqlen, backend: str, last_only: bool = False,
               stored: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this forward's tokens -> [T, Hq, D]; stores k/v first (unless
        `stored`: the caller did, into `decode_target`).

        `last_only` (a prefill): q [B, Hq, D] holds each sequence's last query only, which sees all of its
        sequence's keys, so it attends over the just-written cache like a decode step -> [B, Hq, D]."""
        step = self._step
        if self.keys[layer] is None:
            shape = (self.batch, k.shape[1], self.capacity)
            self.keys[layer] = k.new_zeros(*shape, k.shape[2])
            self.values[layer] = v.new_zeros(*shape, v.shape[2])
        keys, values = self.keys[layer], self.values[layer]
        if not stored:
            store((keys, values, step.rows, step.slots), k, v)
        mask = step.mask
        if mask is None and not last_only:
            # The prefill attends within the new tokens only: the training path's varlen attention.
            return attend(q, k, v, cu_seqlens, max_seqlen, causal=True, backend=backend)
        if resolve_backend(backend, q, packed=False) == "flash":
            return _flash_over_cache(q, keys, values, step.seen)
        bias = step.bias(q.dtype)
        # One query per sequence, so the query heads sharing a KV head can stand in for query positions:
        # [B, Hkv, group, D] against [B, Hkv, width, D] is GQA without expanding K/V, and is a plain sdpa call.
        b, hq, d = q.shape
        hkv, width = k.shape[1], bias.shape[-1]
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, hq // hkv, d), keys[:, :, :width], values[:, :, :width], attn_mask=bias
        )
        return out.reshape(b, hq, values.shape[-1])


def store(target: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the cache at target = (keys, values, rows [T], slots [T]) (decode_target), in
    place."""
    keys, values, rows, slots = target
    keys[rows, :, slots] = k  # advanced indices around a slice: the indexed view is [T, Hkv, D]
    values[rows, :, slots] = v


class _Step:
    """Where one forward's tokens land in the cache: row and slot per token, the lengths after a prefill (device,
    and `host`), the host bound after it, the decode mask (None for a prefill) and the attention width (slots)."""

    def __init__(self, rows, slots, new_lengths, bound: int, mask: torch.Tensor | None,
                 host: list[int] | None, width: int) -> None:
        self.rows, self.slots, self.new_lengths, self.bound, self.mask, self.host, self.width = (
            rows, slots, new_lengths, bound, mask, host, width)
        self._bias: dict[torch.dtype, torch.Tensor] = {}

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1, width] in `dtype`: 0 where a row's query sees the slot, -inf elsewhere: the decode mask (a
        prefill's: its last queries' mask) as sdpa's additive mask, made once per forward and dtype. Given the
        boolean mask, sdpa makes exactly this tensor itself, in every layer's call: a kernel per layer."""
        bias = self._bias.get(dtype)
        if bias is None:
            mask = self.mask if self.mask is not None else self.last_mask()
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._bias[dtype] = bias
        return bias

    def last_mask(self) -> torch.Tensor:
        """[B, 1, 1, width]: each row's last token sees every slot of its sequence (a prefill's last query)."""
        device = self.rows.device
        return (torch.arange(self.width, device=device)[None, :] < self.new_lengths[:, None])[:, None, None]

    @functools.cached_property
    def seen(self) -> torch.Tensor:
        """[B] int32: how many slots each row's query sees (its cached tokens, the new one included), the lengths
        flash-attn's cache kernel takes in place of a mask; computed once per forward, shared by every layer."""
        return (self.new_lengths if self.mask is None else self.slots + 1).to(torch.int32)


def _flash_over_cache(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor
                      ) -> torch.Tensor:
    """q [B, Hq, D] (one query per row) over the whole cache, keys/values [B, Hkv, capacity, D], each row reading
    its first seen[b] slots -> [B, Hq, D]: flash-attn's KV-cache kernel (split along the keys for long caches, GQA
    without expanding K/V). The cache is handed over whole, as a [B, capacity, Hkv, D] view, so the call has one
    shape for every step and needs no mask."""
    from flash_attn import flash_attn_with_kvcache  # optional dependency, checked by resolve_backend

    out = flash_attn_with_kvcache(q[:, None], keys.transpose(1, 2), values.transpose(1, 2), cache_seqlens=seen)
    return out[:, 0]


class LayerKV:
    """One layer's view of a cache, handed down to its attention: a GQA layer calls `attend`, an MLA layer
    `attend_latent` (an MLACache's), a linear-attention layer of a decode step `states` (a HybridCache's), each with
    this layer's index filled in.

    They are compile boundaries (run eagerly inside a compiled layer, mindvl.infer.decode_compile): the cache's
    host state (the step's plan, the bound, this layer's index) never enters a compiled graph, so one compiled layer
    serves every layer and every step. Traced, `self.layer` would index the cache's lists and dynamo would guard on
    it: a recompilation per layer. `decode_target` hands out tensors only (this layer's buffers and the step's
    slots), so a decode step's K/V writes (`store`) can be traced with the layer without its host state."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    @torch.compiler.disable
    def decode_target(self) -> tuple[torch.Tensor, ...] | None:
        """Where a decode step's k/v go (KVCache.decode_target), None in a prefill: the attention asks first and
        stores with kv_cache.store, traced, so that a compiled layer writes them in its own kernels."""
        return self.cache.decode_target(self.layer)

    @torch.compiler.disable
    def attend(self, q, k, v, cu_seqlens, max_seqlen, backend: str, last_only: bool = False,
               stored: bool = False) -> torch.Tensor:
        return self.cache.attend(self.layer, q, k, v, cu_seqlens, max_seqlen, backend, last_only, stored)

    @torch.compiler.disable
    def attend_latent(self, *args, **kwargs) -> torch.Tensor:
        return self.cache.attend_latent(self.layer, *args, **kwargs)

    @torch.compiler.disable
    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window [B, C, K-1], recurrent state [B, Hv, dk, dv] float32) of this linear-attention layer, as the
        prefill left them: a decode step updates them in place."""
        return self.cache.conv_states[self.layer], self.cache.recurrent_states[self.layer]
