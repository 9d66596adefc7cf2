"""One canonical form for every routing input the metrics accept.

The public functions take top-k ids in any of these forms and turn them into a `Routing` (ids `[L, N, k]` with the
tokens of all sequences concatenated, plus `seq_offsets`), exactly the layout of a `RouterTrace`:

| input | meaning |
| --- | --- |
| `RouterTrace` | all its layers and sequences |
| array `[S, T, k]` | one layer, S sequences of T tokens |
| array `[L, S, T, k]` | L layers (model-level figures pool them), S sequences of T tokens |
| list of arrays `[T_i, k]` | one layer, ragged sequences |
| list of arrays `[L, T_i, k]` | L layers, ragged sequences |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mindvl.moe_analysis.trace_io import RouterTrace


@dataclass(frozen=True)
class Routing:
    """Validated top-k ids `[L, N, k]` (score order) of S sequences delimited by `offsets` `[S+1]`."""

    ids: np.ndarray
    offsets: np.ndarray
    num_experts: int

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def seq_of_token(self) -> np.ndarray:
        """Sequence index of every token, shape [N]."""
        return np.repeat(np.arange(self.lengths.shape[0]), self.lengths)

    def every(self, stride: int) -> Routing:
        """Every `stride`-th sequence, starting with the first (the repo computes SCH on `topk[::16]`)."""
        if stride < 1:
            raise ValueError(f"sequence stride must be >= 1, got {stride}")
        if stride == 1:
            return self
        starts, ends = self.offsets[:-1][::stride], self.offsets[1:][::stride]
        take = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
        return Routing(self.ids[:, take], np.concatenate([[0], np.cumsum(ends - starts)]), self.num_experts)


def as_routing(topk, num_experts: int | None = None) -> Routing:
    """Normalise any accepted input (module docstring) into a validated `Routing`.

    `num_experts` may be omitted only for a RouterTrace; when both are given they must agree.
    """
    if isinstance(topk, RouterTrace):
        if num_experts is not None and int(num_experts) != topk.num_experts:
            raise ValueError(f"num_experts={num_experts} contradicts the trace's num_experts={topk.num_experts}")
        return _checked(topk.topk_ids, topk.seq_offsets, topk.num_experts, check_values=False)
    if num_experts is None:
        raise ValueError("num_experts is required unless the input is a RouterTrace")
    num_experts = int(num_experts)
    if isinstance(topk, Sequence) and not isinstance(topk, np.ndarray):
        return _from_list(list(topk), num_experts)
    arr = np.asarray(topk)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(f"top-k ids must have shape [S, T, k] or [L, S, T, k], got shape {arr.shape}")
    num_layers, num_seqs, seq_len, k = arr.shape
    if num_seqs < 1 or seq_len < 1:
        raise ValueError(f"top-k ids need at least one sequence of at least one token, got shape {arr.shape}")
    offsets = np.arange(num_seqs + 1, dtype=np.int64) * seq_len
    return _checked(arr.reshape(num_layers, num_seqs * seq_len, k), offsets, num_experts)


def _from_list(seqs: list, num_experts: int) -> Routing:
    if not seqs:
        raise ValueError("the list of sequences is empty")
    arrs = [np.asarray(s) for s in seqs]
    ndims = {a.ndim for a in arrs}
    if ndims == {2}:
        arrs = [a[None] for a in arrs]
    elif ndims != {3}:
        raise ValueError(f"ragged input must be a list of [T_i, k] or of [L, T_i, k] arrays, got ndims {sorted(ndims)}")
    shapes = {(a.shape[0], a.shape[2]) for a in arrs}
    if len(shapes) != 1:
        raise ValueError(f"all sequences need the same number of layers and k, got (layers, k) in {sorted(shapes)}")
    lengths = np.array([a.shape[1] for a in arrs], np.int64)
    if np.any(lengths < 1):
        raise ValueError("every sequence needs at least one token")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return _checked(np.concatenate(arrs, axis=1), offsets, num_experts)


def _checked(ids: np.ndarray, offsets: np.ndarray, num_experts: int, check_values: bool = True) -> Routing:
    """Validate ids (integer, in range, distinct per token) unless they come from an already validated trace."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if check_values:
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"top-k ids must be integers, got dtype {ids.dtype}")
        k = ids.shape[2]
        if k < 1 or k > num_experts:
            raise ValueError(f"k={k} experts per token must lie in [1, num_experts={num_experts}]")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert ids must lie in [0, {num_experts}), found range [{lo}, {hi}]")
        if k > 1:
            srt = np.sort(ids.reshape(-1, k), axis=1)
            if np.any(srt[:, 1:] == srt[:, :-1]):
                raise ValueError("an expert appears twice in one token's top-k; top-k ids must be distinct")
    dtype = np.int8 if num_experts <= 127 else np.int16 if num_experts <= 32767 else np.int32
    return Routing(np.ascontiguousarray(ids, dtype=dtype), np.asarray(offsets, np.int64), num_experts)


def parse_cache_slots(ratios: Sequence[float] | float, base: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Cache ratios ρ -> integer slot counts `round(ρ·base)` (base = k per layer, L·k pooled).

    Rounding half away from zero keeps ρ·base exact whenever it is an integer, which is the normal case
    (ρ in {0.5, 1, 2, 4} and even k). A ratio that gives zero slots is an error rather than a silent 1.
    """
    if np.isscalar(ratios):
        ratios = (float(ratios),)
    out_r, out_c = [], []
    for r in ratios:
        r = float(r)
        if not np.isfinite(r) or r <= 0:
            raise ValueError(f"cache ratios must be positive finite numbers, got {r}")
        slots = int(np.floor(r * base + 0.5))
        if slots < 1:
            raise ValueError(f"cache ratio {r} gives {r * base:g} < 1 slot for {base} active experts; "
                             f"use ratios >= {0.5 / base:g}")
        out_r.append(r)
        out_c.append(slots)
    if not out_r:
        raise ValueError("no cache ratios given")
    return tuple(out_r), tuple(out_c)
