"""The decoding cache of a hybrid model (Qwen3.5): K/V for the full-attention layers, a fixed-size state for the
linear-attention layers.

A linear-attention layer keeps, per sequence, its convolution window (the last K-1 inputs of the short conv,
[B, C, K-1]) and its recurrent state ([B, Hv, dk, dv], float32): memory that does not grow with the sequence.
Full-attention layers use the KVCache part unchanged (their `keys`/`values` entries stay None for linear layers).
A decode step overwrites both states in place (the buffers `LayerKV.states` hands it), so they keep their
addresses (a captured graph replays into the same buffers); a masked (finished) row's states keep changing, which
nothing reads. `keep` drops finished sequences from both.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache


class HybridCache(KVCache):
    def __init__(self, num_layers: int, batch: int, capacity: int) -> None:
        super().__init__(num_layers, batch, capacity)
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers

    def update_states(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor | None = None) -> None:
        """Store a prefill's conv window (and recurrent state) of a layer: the first prefill sets them; the prefill
        of a reset cache copies into the existing buffers (where a captured decode step reads them)."""
        for store, new in ((self.conv_states, conv), (self.recurrent_states, recurrent)):
            if new is None:
                continue
            if store[layer] is not None and store[layer].shape == new.shape:
                store[layer].copy_(new)
            else:
                store[layer] = new

    def _row_stores(self) -> list[list[torch.Tensor | None]]:
        return [*super()._row_stores(), self.conv_states, self.recurrent_states]

    def step_state(self) -> list[torch.Tensor]:
        return [*super().step_state(), *(t for t in self.conv_states + self.recurrent_states if t is not None)]
