"""The decoding cache of a hybrid model (Qwen3.5): K/V for the full-attention layers, a fixed-size state for the
linear-attention layers.

A linear-attention layer keeps, per sequence, its convolution window (the last K-1 inputs of the short conv,
[B, C, K-1]) and its recurrent state ([B, Hv, dk, dv], float32): memory that does not grow with the sequence.
Full-attention layers use the KVCache part unchanged (their `keys`/`values` entries stay None for linear layers).
`keep` drops finished sequences from both.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache


class HybridCache(KVCache):
    def __init__(self, num_layers: int, batch: int, capacity: int) -> None:
        super().__init__(num_layers, batch, capacity)
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers

    @property
    def is_prefill(self) -> bool:
        """True while the forward in progress fills an empty cache (lengths change only at `commit`)."""
        return max(self.lengths) == 0

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        for store in (self.conv_states, self.recurrent_states):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t[torch.tensor(rows, device=t.device)]
