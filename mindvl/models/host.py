"""Host-side values that shape a packed row, and the one way they reach the device.

A packed row's sample offsets, its images' grids and its vision-pad count decide shapes, masks and index tables;
the loader knows them when it builds the pack. `PackLayout` carries them as Python ints beside the batch, so a
training step reads nothing back from the device (every `.tolist()`, `.item()` or data-dependent shape on an
accelerator stalls the host until the device catches up). Callers that hold only tensors (tests, evaluation,
transformers-style calls) get the same layout from `PackLayout.read`, which reads those tensors once.

`next_token_targets` is the one next-token rule (the loss's targets), for host offsets and offset tensors alike.

`to_device` is how a host-built tensor (an index table, positions, a block mask) reaches an accelerator: through
pinned memory with a non-blocking copy; a plain `.to("cuda")` of pageable memory synchronises the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mindvl.conventions import IGNORE_INDEX

Grid = tuple[int, int, int]


def longest_segment(offsets: Sequence[int]) -> int:
    """The longest segment of host offsets [n+1] (0 for none): the `max_seqlen` varlen kernels take."""
    return max((b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)), default=0)


class Segments:
    """A packed row's sample offsets as host ints (and its longest segment), handed through compiled blocks as ONE
    opaque object.

    Under regional compile a block that took the offsets as a tuple of ints would be guarded on them: on every
    int's value until they turn dynamic, and on the tuple's length forever, so each new number of samples in a
    pack compiled the block again, and after dynamo's recompile limit (8) the block ran eagerly for every new
    count. An object that compiled code only passes along is guarded on its type alone. So the model wraps the
    offsets once per forward (text rows, vision windows, vision frames) and only compile boundaries open it:
    `attend`, the delta rule, `offsets_tensor`. Indexing and len() behave like the tuple's, for eager callers."""

    __slots__ = ("offsets", "max_seqlen")

    def __init__(self, offsets: Sequence[int]) -> None:
        self.offsets = tuple(int(x) for x in offsets)
        self.max_seqlen = longest_segment(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index):
        return self.offsets[index]

    def __iter__(self):
        return iter(self.offsets)

    def __repr__(self) -> str:
        return f"Segments({self.offsets})"


def host_offsets(cu_seqlens: torch.Tensor | Sequence[int] | Segments) -> tuple[int, ...]:
    """Sample offsets [n+1] as host ints: a tuple/list/`Segments` passes through; a tensor is read (on an
    accelerator, a device read: only callers without a `PackLayout` pay it)."""
    if isinstance(cu_seqlens, Segments):
        return cu_seqlens.offsets
    if isinstance(cu_seqlens, torch.Tensor):
        return tuple(cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def as_segments(cu_seqlens: torch.Tensor | Sequence[int] | Segments | None) -> Segments | None:
    """The offsets wrapped for compiled blocks (a tensor is read once here, not once per layer)."""
    if cu_seqlens is None or isinstance(cu_seqlens, Segments):
        return cu_seqlens
    return Segments(host_offsets(cu_seqlens))


@torch.compiler.disable
def offsets_tensor(cu_seqlens: torch.Tensor | Sequence[int] | Segments, device: torch.device) -> torch.Tensor:
    """The offsets as an int32 [n+1] tensor on `device` (a tensor passes through): a compile boundary, so host
    offsets never enter a compiled graph (see `Segments`)."""
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    return to_device(torch.tensor(host_offsets(cu_seqlens), dtype=torch.int32), device)


def host_grids(grid_thw: torch.Tensor | Sequence[Sequence[int]] | None) -> tuple[Grid, ...]:
    """[N, 3] (t, h, w) grids as host ints (a tensor is read, as in `host_offsets`)."""
    if grid_thw is None:
        return ()
    rows = grid_thw.reshape(-1, 3).tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return tuple((int(t), int(h), int(w)) for t, h, w in rows)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device` without stalling the host (pinned memory + non-blocking copy on CUDA)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """labels [T] aligned with input_ids -> targets [T]: token t is trained to predict labels[t + 1] of its OWN sample;
    every sample's last token gets IGNORE_INDEX, so nothing is predicted across a packing boundary.

    The one rule for both forms of the sample offsets `cu_seqlens` [n+1]: host ints (a `PackLayout`'s, copied to
    the labels' device without a sync) or a tensor (on any device; FakeTensors and meta too). Neither form reads the
    device: the sample ends are marked with `index_fill` on a [T+1] flag row (offset b marks token b-1; a 0 marks
    flag 0, which no token reads, so empty samples need no filter), never with a boolean mask's data-dependent shape.
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    if isinstance(cu_seqlens, torch.Tensor):
        offsets = cu_seqlens
        if offsets.device != labels.device:  # a host tensor goes up without a sync; a device one moves as it is
            offsets = to_device(offsets, labels.device) if offsets.device.type == "cpu" else offsets.to(labels.device)
    else:
        offsets = to_device(torch.tensor([int(b) for b in cu_seqlens], dtype=torch.long), labels.device)
    ends = torch.zeros(labels.shape[0] + 1, dtype=torch.bool, device=labels.device)
    ends.index_fill_(0, offsets[1:].long(), True)
    return targets.masked_fill(ends[1:], IGNORE_INDEX)


@dataclass(frozen=True)
class PackLayout:
    """Where the samples and vision items of one packed row sit, as host ints (see the module docstring).

    - `cu_seqlens` (n+1): sample offsets in the row, from 0 to T;
    - `grid_thw`: every image's and video's (t, h, w) in patches, in order of appearance (mindvl's one stream);
    - `vision_pads`: how many image/video pad tokens the row holds (None: not counted, the model counts them);
    - `num_targets`: how many tokens have a next-token label (what the loss counts; None: not counted).
    """

    cu_seqlens: tuple[int, ...]
    grid_thw: tuple[Grid, ...] = ()
    vision_pads: int | None = None
    num_targets: int | None = None

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
            raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {list(cu)[:8]}...")

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def max_seqlen(self) -> int:
        return longest_segment(self.cu_seqlens)

    @classmethod
    def read(cls, cu_seqlens: torch.Tensor | Sequence[int], image_grid_thw=None, input_ids: torch.Tensor | None = None,
             vision_token_ids: Sequence[int] = (), labels: torch.Tensor | None = None) -> PackLayout:
        """The layout of a row given as tensors (host or device: device tensors are read here, once). With
        `input_ids` and `vision_token_ids` the vision pads are counted, with `labels` the loss targets."""
        offsets = host_offsets(cu_seqlens)
        pads = targets = None
        vision_token_ids = [i for i in vision_token_ids if i is not None]
        if input_ids is not None and vision_token_ids:
            ids = torch.as_tensor(input_ids)
            pads = int(torch.isin(ids, torch.tensor(vision_token_ids, device=ids.device)).sum())
        if labels is not None:
            targets = int((next_token_targets(labels, offsets) != IGNORE_INDEX).sum())
        return cls(offsets, host_grids(image_grid_thw), pads, targets)
