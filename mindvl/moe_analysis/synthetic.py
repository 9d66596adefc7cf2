"""Synthetic router traces with tunable locality, for tests, benchmarks and trying the CLI without a model.

Each (layer, sequence) is a random walk over top-k sets: slot j of token t keeps slot j's expert of token t-1 with
probability `keep`, otherwise it draws a fresh expert from a Zipf-like popularity (exponent `skew`, a different
expert order per layer); fresh draws that repeat an expert already in the token are redrawn. `keep=0, skew=0` is
i.i.d. uniform routing (the reference's random-routing baseline), larger `keep` gives more local consistency.
"""

from __future__ import annotations

import numpy as np

from mindvl.moe_analysis.trace_io import RouterTrace


def synthetic_trace(
    num_layers: int = 4,
    num_experts: int = 16,
    k: int = 2,
    seq_lengths: list[int] | tuple[int, ...] | int = (64, 64),
    keep: float = 0.6,
    skew: float = 0.5,
    seed: int = 0,
) -> RouterTrace:
    """A RouterTrace of `len(seq_lengths)` sequences (an int means one sequence of that length)."""
    if isinstance(seq_lengths, int):
        seq_lengths = [seq_lengths]
    lengths = np.asarray(seq_lengths, np.int64)
    if num_layers < 1 or num_experts < 1 or not 1 <= k <= num_experts:
        raise ValueError(f"need num_layers >= 1 and 1 <= k <= num_experts, got L={num_layers}, E={num_experts}, k={k}")
    if lengths.ndim != 1 or lengths.size == 0 or np.any(lengths < 1):
        raise ValueError(f"seq_lengths must be positive integers, got {list(seq_lengths)}")
    if not 0.0 <= keep <= 1.0 or skew < 0:
        raise ValueError(f"keep must lie in [0, 1] and skew be >= 0, got keep={keep}, skew={skew}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_experts + 1) ** skew
    cdf = np.cumsum(weights / weights.sum())
    perms = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])  # [L, E]
    num_seqs, t_max = lengths.shape[0], int(lengths.max())
    streams = num_layers * num_seqs
    layer_of = np.repeat(np.arange(num_layers), num_seqs)
    out = np.empty((t_max, streams, k), np.int32)
    used = np.zeros((streams, num_experts), bool)  # experts of the token being built
    rows = np.arange(streams)[:, None]
    cur = np.zeros((streams, k), np.int32)
    for t in range(t_max):
        kept = rng.random((streams, k)) < keep if t else np.zeros((streams, k), bool)
        used[rows, cur] = False
        used[rows, cur] = kept  # only kept experts stay claimed
        for slot in range(k):
            todo = np.flatnonzero(~kept[:, slot])
            while todo.size:
                # Fresh draws that collide with an expert already in the token are redrawn.
                u = rng.random(todo.shape[0])
                cand = perms[layer_of[todo], np.minimum(np.searchsorted(cdf, u), num_experts - 1)]
                ok = ~used[todo, cand]
                done, cand = todo[ok], cand[ok]
                cur[done, slot] = cand
                used[done, cand] = True
                todo = todo[~ok]
        out[t] = cur
    ids = out.transpose(1, 0, 2).reshape(num_layers, num_seqs, t_max, k)
    topk = np.concatenate([ids[:, s, : lengths[s]] for s in range(num_seqs)], axis=1)
    return RouterTrace(
        topk_ids=topk, seq_offsets=np.concatenate([[0], np.cumsum(lengths)]), num_experts=num_experts,
        layer_names=[f"layers.{i}.mlp" for i in range(num_layers)],
        meta={"synthetic": True, "keep": keep, "skew": skew, "seed": seed},
    )

