"""Online packing: samples from a bounded buffer are packed into rows of at most `seq_len` tokens and at most
`max_patches` vision patch rows (images' and videos' alike), no sample split.

Policy (per pack, when the buffer is full): open the pack with the largest buffered sample (first-fit decreasing
for one bin), or with the oldest one if it has waited `max_wait` packs (so no sample starves); then keep adding the
largest sample that still fits both budgets (best fit). With a buffer of a few hundred samples there is almost
always a small one left to fill the gap, which is what gets >98% of token slots used at 8K. Ties go to the sample
that arrived first, so the result is a pure function of the arrival order.

How long a sample can wait (the bound `test_data_packing` checks): a sample that enters the buffer while it holds
`k` older samples (k <= buffer_size - 1) is in one of the next `max_wait + k` packs. Once it has waited `max_wait`
packs, so has every older sample, and each pack then opens with the oldest one; after at most k such packs it is the
oldest. With the default `max_wait = 2 x buffer_size` a small record can so trail larger ones by up to
`3 x buffer_size - 1` packs of its reading slot (a slot makes one in every `num_workers` of its rank's packs), and at
the last step of a one-epoch budget up to `buffer_size` of the epoch's records per slot may still be buffered: they
are trained first thing in the next epoch's steps (a finite `max_epochs` flushes them at the end instead).

`Packer.state_dict()` holds only the buffered samples' refs and arrival ticks; the stream re-reads them on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .processors import QWEN2_VL, VisionProcessing, expand_image_rows, expand_video_rows
from .schema import IGNORE_INDEX, Pack, Sample


@dataclass
class _Entry:
    sample: Sample
    arrival: int  # pack count when it entered the buffer
    order: int  # global arrival order (tie-break)


class Packer:
    def __init__(self, seq_len: int, max_patches: int | None = None, buffer_size: int = 256,
                 pad_to_seq_len: bool = False, pad_id: int = 0, max_wait: int | None = None,
                 processing: VisionProcessing = QWEN2_VL):
        self.seq_len, self.max_patches, self.buffer_size = seq_len, max_patches, buffer_size
        self.pad_to_seq_len, self.pad_id, self.processing = pad_to_seq_len, pad_id, processing
        self.max_wait = max_wait if max_wait is not None else 2 * buffer_size
        self.buffer: list[_Entry] = []
        self.packs_made = 0
        self._order = 0

    def add(self, sample: Sample, arrival: int | None = None, order: int | None = None) -> None:
        if sample.num_tokens > self.seq_len:
            raise ValueError(f"{sample.where}: sample of {sample.num_tokens} tokens cannot fit seq_len {self.seq_len}")
        if self.max_patches is not None and sample.num_patches > self.max_patches:
            raise ValueError(f"{sample.where}: {sample.num_patches} patches exceed the pack cap {self.max_patches}")
        self.buffer.append(_Entry(sample, self.packs_made if arrival is None else arrival,
                                  self._order if order is None else order))
        self._order = max(self._order, self.buffer[-1].order) + 1

    @property
    def full(self) -> bool:
        return len(self.buffer) >= self.buffer_size

    def select(self) -> list[Sample]:
        """Remove and return the samples of the next pack (non-empty buffer)."""
        buf = self.buffer
        oldest = min(range(len(buf)), key=lambda i: buf[i].order)
        if self.packs_made - buf[oldest].arrival >= self.max_wait:
            first = oldest
        else:
            first = min(range(len(buf)), key=lambda i: (-buf[i].sample.num_tokens, buf[i].order))
        chosen = [first]
        tokens = buf[first].sample.num_tokens
        patches = buf[first].sample.num_patches
        # Candidates by decreasing length, then arrival: the first that fits is the best fit.
        ranked = sorted((i for i in range(len(buf)) if i != first),
                        key=lambda i: (-buf[i].sample.num_tokens, buf[i].order))
        for i in ranked:
            s = buf[i].sample
            if tokens + s.num_tokens > self.seq_len:
                continue
            if self.max_patches is not None and patches + s.num_patches > self.max_patches:
                continue
            chosen.append(i)
            tokens += s.num_tokens
            patches += s.num_patches
            if tokens == self.seq_len:
                break
        chosen_set = set(chosen)
        # Samples go into the pack in arrival order (deterministic, and independent of the selection order).
        samples = [buf[i].sample for i in sorted(chosen, key=lambda i: buf[i].order)]
        self.buffer = [e for i, e in enumerate(buf) if i not in chosen_set]
        self.packs_made += 1
        return samples

    def make_pack(self) -> Pack:
        return build_pack(self.select(), self.seq_len if self.pad_to_seq_len else None, self.pad_id,
                          processing=self.processing)

    def state_dict(self) -> dict:
        return {
            "packs_made": self.packs_made,
            "order": self._order,
            "buffer": [[e.sample.ref.to_list() if e.sample.ref else None, e.arrival, e.order] for e in self.buffer],
        }


def build_pack(samples: list[Sample], pad_to: int | None = None, pad_id: int = 0,
               alloc_pixels: Callable[[int], np.ndarray] | None = None,
               processing: VisionProcessing = QWEN2_VL) -> Pack:
    """Concatenate samples into one Pack (see Pack for shapes); optional padding as its own final segment.

    The float32 patch rows are written once, straight into `alloc_pixels(P)` ([P, patch_dim] float32, 1176 for
    Qwen2-VL's processor, 1536 for Qwen3-VL's; e.g. a shared-memory buffer in a loader worker) or a new array,
    normalised with `processing`'s mean/std (the processor the samples were cut with).
    """
    lengths = [s.num_tokens for s in samples]
    input_ids = [s.input_ids for s in samples]
    labels = [s.labels for s in samples]
    positions = [s.position_ids for s in samples]
    total = sum(lengths)
    num_pad = 0
    if pad_to is not None and total < pad_to:
        num_pad = pad_to - total
        input_ids.append(np.full(num_pad, pad_id, np.int64))
        labels.append(np.full(num_pad, IGNORE_INDEX, np.int64))
        positions.append(np.broadcast_to(np.arange(num_pad, dtype=np.int64), (3, num_pad)))
        lengths.append(num_pad)
    cu = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    n_patches = sum(s.num_patches for s in samples)
    pixel_values = alloc_pixels(n_patches) if alloc_pixels is not None else \
        np.empty((n_patches, processing.patch_dim), np.float32)
    row = 0
    for s in samples:
        if s.video_patches is None:
            expand_image_rows(s.patches, processing, out=pixel_values[row:row + s.num_patches])
            row += s.num_patches
            continue
        # Images and videos interleaved in order of appearance (one stream, like the grids).
        image_row = video_row = 0
        for grid, is_video in zip(s.image_grid_thw, s.is_video, strict=True):
            n = int(np.prod(grid))
            if is_video:
                expand_video_rows(s.video_patches[video_row:video_row + n], processing, out=pixel_values[row:row + n])
                video_row += n
            else:
                expand_image_rows(s.patches[image_row:image_row + n], processing, out=pixel_values[row:row + n])
                image_row += n
            row += n
    grids = [s.image_grid_thw for s in samples if len(s.image_grid_thw)]
    return Pack(
        input_ids=np.concatenate(input_ids) if input_ids else np.zeros(0, np.int64),
        labels=np.concatenate(labels) if labels else np.zeros(0, np.int64),
        position_ids=np.concatenate(positions, axis=1) if positions else np.zeros((3, 0), np.int64),
        cu_seqlens=cu,
        pixel_values=pixel_values,
        image_grid_thw=np.concatenate(grids) if grids else np.zeros((0, 3), np.int64),
        sample_sources=[s.source for s in samples],
        sample_refs=[s.ref.to_list() if s.ref is not None else None for s in samples],
        num_pad=num_pad,
    )
