"""Pack shapes for the planner: the worst case the recipe's data settings allow, or packs read from its sources.

A `PackShape` is the metadata of one packed row (sample lengths, image grids, labelled positions); `fake_pack`
turns it into the model's input dict with real integer metadata and a fake float32 pixel tensor, so nothing large
is allocated.

Worst case (`worst_case_packs`): every token slot used; as many images of `data.max_pixels` (square, after
smart_resize) as fit in 90% of the slots, capped by `data.max_patches_per_pack`; one sample per image plus a text
sample filling the rest; every text token labelled (the largest loss head).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from mindvl.models.config import MindVLConfig
from mindvl.models.loss import IGNORE_INDEX


@dataclass
class PackShape:
    sample_tokens: list[int]  # tokens per sample (sum = seq_len slots used)
    images: list[tuple[int, int, int]] = field(default_factory=list)  # grid (t, h, w) in patches, one per sample

    @property
    def tokens(self) -> int:
        return sum(self.sample_tokens)

    @property
    def patches(self) -> int:
        return sum(t * h * w for t, h, w in self.images)


def square_grid(max_pixels: int, patch: int = 14, merge: int = 2) -> tuple[int, int, int]:
    """The largest square image under max_pixels after smart_resize: (1, side, side) patches."""
    unit = patch * merge
    side = max(1, math.isqrt(max_pixels) // unit) * merge
    return (1, side, side)


def worst_case_packs(data_cfg, config: MindVLConfig) -> list[PackShape]:
    seq = data_cfg.seq_len
    if config.vision is None:
        return [PackShape([seq])]
    v = config.vision
    grid = square_grid(data_cfg.max_pixels, v.patch_size, v.spatial_merge_size)
    image_tokens = grid[0] * grid[1] * grid[2] // v.merge_unit
    n = max(1, int(0.9 * seq) // (image_tokens + 16))
    if data_cfg.max_patches_per_pack:
        n = max(1, min(n, data_cfg.max_patches_per_pack // (grid[0] * grid[1] * grid[2])))
    per_image = min(seq // n, image_tokens + 16)
    samples = [per_image] * n
    if seq - sum(samples) > 0:
        samples.append(seq - sum(samples))
    return [PackShape(samples, [grid] * n)]


def sampled_packs(data_cfg, tok, count: int = 64, shards: int = 1) -> list[PackShape]:
    """The shapes of the first `count` packs that rank 0 reads (data shard 0 of `shards`, as the trainer deals
    them) from the recipe's own data pipeline (its sources must exist)."""
    from mindvl.data import build_loader

    shapes = []
    for pack in itertools.islice(build_loader(data_cfg, tok, rank=0, world_size=shards), count):
        cu = pack.cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        grids = [tuple(int(x) for x in g) for g in pack.image_grid_thw.tolist()]
        meta = {k: v for k, v in pack.to_torch().items() if k != "pixel_values"}  # pixels: only their count
        shapes.append(_Sampled(lengths, grids, meta=meta))
    if not shapes:
        raise ValueError("--sample-data: the recipe's sources gave no pack")
    return shapes


@dataclass
class _Sampled(PackShape):
    meta: dict | None = None  # the real pack's token ids, labels, positions, cu_seqlens and grids


def fake_pack(shape: PackShape, config: MindVLConfig, fake_floats) -> dict:
    """The model's input dict for `shape`: real int64/int32 metadata, pixel rows from `fake_floats(shape)`."""
    from mindvl.models.mllm import mrope_position_ids

    if isinstance(shape, _Sampled):
        dim = config.vision.patch_dim if config.vision else 1176
        return {**shape.meta, "pixel_values": fake_floats((shape.patches, dim))}
    ids, labels = [], []
    merge = config.vision.merge_unit if config.vision else 4
    for i, n in enumerate(shape.sample_tokens):
        sample = torch.full((n,), 100, dtype=torch.long)
        lab = sample.clone()
        lab[0] = IGNORE_INDEX
        if i < len(shape.images):
            t, h, w = shape.images[i]
            k = t * h * w // merge
            sample[2 : 2 + k] = config.image_token_id
            lab[: 2 + k] = IGNORE_INDEX
        ids.append(sample)
        labels.append(lab)
    input_ids = torch.cat(ids)
    cu = torch.tensor([0, *itertools.accumulate(shape.sample_tokens)], dtype=torch.int32)
    grid = torch.tensor(shape.images, dtype=torch.long).reshape(-1, 3)
    spatial = config.vision.spatial_merge_size if config.vision else 2
    position_ids = mrope_position_ids(input_ids, cu, grid, config.image_token_id, spatial)
    dim = config.vision.patch_dim if config.vision else 1176
    return {"input_ids": input_ids, "labels": torch.cat(labels), "position_ids": position_ids, "cu_seqlens": cu,
            "pixel_values": fake_floats((shape.patches, dim)), "image_grid_thw": grid}
