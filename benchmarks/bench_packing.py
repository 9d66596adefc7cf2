"""Packing efficiency at 2K/4K/8K on a realistic length mix: mindvl's online packer vs naive padding and vs
greedy in-order concatenation.

    python benchmarks/bench_packing.py [--samples 20000] [--buffer 256]

Efficiency = real tokens / token slots. The length mix imitates an SFT/multitask corpus: half short text chats,
40% single-image QA (image tokens from native-resolution grids under max_pixels), 10% long documents or
multi-image samples. Patch cap: 4*seq_len patch rows per pack (= at most seq_len merged image tokens' worth).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mindvl.data.packing import Packer
from mindvl.data.schema import Sample


def length_mix(n: int, seed: int, seq_len: int) -> list[tuple[int, int]]:
    """(tokens, patches) per sample."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kind = rng.choice(3, p=[0.5, 0.4, 0.1])
        if kind == 0:
            tokens, patches = int(rng.integers(20, 400)), 0
        elif kind == 1:
            patches = int(4 * rng.integers(16, 1280))  # a native-resolution image, up to 1280 merged tokens
            tokens = patches // 4 + int(rng.lognormal(4.5, 0.8)) + 30
        else:
            n_img = int(rng.integers(0, 4))
            patches = int(sum(4 * rng.integers(64, 800) for _ in range(n_img)))
            tokens = patches // 4 + int(rng.integers(1000, 5000))
        out.append((min(tokens, seq_len), patches if tokens <= seq_len else 0))
    return out


def fake(i: int, tokens: int, patches: int) -> Sample:
    z = np.zeros(tokens, np.int64)
    return Sample(z, z, np.zeros((3, tokens), np.int64), np.zeros((patches, 0), np.uint8),
                  np.zeros((0, 3), np.int64), where=str(i))


def ours(samples: list[Sample], seq_len: int, buffer: int, max_patches: int) -> tuple[int, float]:
    packer = Packer(seq_len, max_patches, buffer)
    packs = 0
    t = time.perf_counter()
    for s in samples:
        packer.add(s)
        if packer.full:
            packer.select()
            packs += 1
    while packer.buffer:
        packer.select()
        packs += 1
    return packs, time.perf_counter() - t


def greedy_in_order(lengths: list[tuple[int, int]], seq_len: int, max_patches: int) -> int:
    """Concatenate in arrival order, start a new row when the next sample does not fit (no look-ahead)."""
    packs, used, pat = 0, seq_len + 1, 0
    for tokens, patches in lengths:
        if used + tokens > seq_len or pat + patches > max_patches:
            packs, used, pat = packs + 1, 0, 0
        used += tokens
        pat += patches
    return packs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--buffer", type=int, default=256)
    args = ap.parse_args()
    print(f"{args.samples} samples, buffer {args.buffer}; efficiency = real tokens / token slots\n")
    header = (f"{'seq_len':>7} | {'naive pad':>9} | {'greedy':>7} | {'mindvl':>7} | {'vs pad':>7} | "
              f"{'vs greedy':>9} | {'rows':>6} | {'pack µs/sample':>14}")
    print(header)
    print("-" * len(header))
    for seq_len in (2048, 4096, 8192):
        lengths = length_mix(args.samples, seed=seq_len, seq_len=seq_len)
        real = sum(t for t, _ in lengths)
        cap = 4 * seq_len
        naive = real / (len(lengths) * seq_len)
        greedy = real / (greedy_in_order(lengths, seq_len, cap) * seq_len)
        packs, secs = ours([fake(i, t, p) for i, (t, p) in enumerate(lengths)], seq_len, args.buffer, cap)
        eff = real / (packs * seq_len)
        print(f"{seq_len:>7} | {naive:>9.2%} | {greedy:>7.2%} | {eff:>7.2%} | {eff / naive:>6.2f}x | "
              f"{eff / greedy:>8.3f}x | {packs:>6} | {1e6 * secs / len(lengths):>14.1f}")


if __name__ == "__main__":
    main()
