"""Mixing sources by ratio, deterministically from the seed.

Draw k of a stream picks a source with probability ratio / sum(ratios of the sources still active). The uniform
number of draw k is a hash of (seed, slot, k), so the whole RNG state is the draw counter: resuming is exact and
costs one integer in the checkpoint. Per-source consumption (samples, tokens, images, patches) is tracked here too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def uniform(*key: object) -> float:
    """A uniform float in [0, 1) that is a pure function of `key` (53 bits of SHA-256)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 11) / float(1 << 53)


class Mixture:
    def __init__(self, ratios: Sequence[float], seed: int, slot: int):
        if not ratios or any(r <= 0 for r in ratios):
            raise ValueError("mixture ratios must be positive")
        self.ratios = [float(r) for r in ratios]
        self.seed, self.slot = seed, slot
        self.draws = 0

    def choose(self, active: Sequence[bool]) -> int | None:
        """The next source among the active ones (None when none is active). Advances the counter."""
        weights = [r if a else 0.0 for r, a in zip(self.ratios, active, strict=True)]
        total = sum(weights)
        if total == 0:
            return None
        if len(self.ratios) == 1:
            self.draws += 1
            return 0
        u = uniform("mix", self.seed, self.slot, self.draws) * total
        self.draws += 1
        acc = 0.0
        last = 0
        for i, w in enumerate(weights):
            if w == 0:
                continue
            acc += w
            last = i
            if u < acc:
                return i
        return last  # rounding at the top end

    def state_dict(self) -> dict:
        return {"draws": self.draws}

    def load_state_dict(self, d: dict) -> None:
        self.draws = int(d["draws"])


class Consumption:
    """What each source contributed to emitted packs."""

    FIELDS = ("samples", "tokens", "trained_tokens", "images", "patches")

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.table = {n: dict.fromkeys(self.FIELDS, 0) for n in self.names}

    def add(self, source: int, tokens: int, trained: int, images: int, patches: int) -> None:
        row = self.table[self.names[source]]
        row["samples"] += 1
        row["tokens"] += tokens
        row["trained_tokens"] += trained
        row["images"] += images
        row["patches"] += patches

    def state_dict(self) -> dict:
        return {n: dict(r) for n, r in self.table.items()}

    def load_state_dict(self, d: dict) -> None:
        for n in self.names:
            if n in d:
                self.table[n] = {f: int(d[n].get(f, 0)) for f in self.FIELDS}

    @staticmethod
    def merge(tables: Sequence[dict]) -> dict:
        out: dict = {}
        for t in tables:
            for n, row in t.items():
                acc = out.setdefault(n, {})
                for f, v in row.items():
                    acc[f] = acc.get(f, 0) + v
        return out
