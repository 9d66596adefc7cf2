"""Elastic resume of the data: continue a stream saved with one slot layout (data shards x loader workers) on
another, with no record lost or read twice within an epoch, and the unread rest of the epoch dealt evenly. The
exact order is not kept (it cannot be: the deal of records to slots depends on the number of slots).

    new_states = reshard_loader_states(old_loader_states, cfg, files, new_world_size)   # one per new data shard

For every source, each old slot's unread work up to the furthest epoch any old slot reached (`E`) is collected as
byte ranges of files: the rest of its current unit from its byte offset, its remaining units of that epoch, its
whole share of every later epoch up to `E` (slots read at their own pace, so some are behind; a slot still reading
pieces of an earlier resume is already counted in the epoch after them), and what is left of those pieces. Epoch by
epoch, oldest first, the ranges are laid end to end and cut into as many stretches of equal bytes as there are new
slots, each cut moved to the next record start (JSONL: a line belongs to the range holding its first byte; tar: a
key to the range holding its first member's header, listed by walking the headers); new slot i reads its stretch of
each epoch in turn (`ReaderState.carry`), then starts epoch `E + 1` with the new layout. So after a resume from 1
slot to 2 both read half of the epoch's rest, instead of one reading the whole leftover file while the other starts
the next epoch, and at equal steps the new slots have trained as many distinct records as an uninterrupted run.
Records that were read into a packing buffer but not packed yet join the oldest epoch's rest as one-record
ranges (re-read by reference, as a same-size resume re-reads its buffer), so they are dealt evenly too. Counters
(consumed, skipped, truncated, packs) are summed into the first new slot so that the data report keeps its totals.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .config import DataConfig
from .schema import SampleRef
from .sources import ReaderState, Unit, legacy_slot_units, next_line_start, slot_units, tar_data_end, tar_keys
from .stream import LEGACY_STATE_VERSION as LEGACY_STREAM_STATE_VERSION
from .stream import STATE_VERSION as STREAM_STATE_VERSION


def _old_slots(loader_states: list[dict]) -> tuple[int, list[dict | None]]:
    """(number of old slots, the stream state of every old slot in slot order, None for never-started ones)."""
    by_rank = sorted(loader_states, key=lambda s: s["rank"])
    world = by_rank[0]["world_size"]
    n_streams = by_rank[0]["num_streams"]
    if [s["rank"] for s in by_rank] != list(range(world)):
        raise ValueError(f"elastic resume needs the data state of every old data shard (0..{world - 1}), got ranks "
                         f"{[s['rank'] for s in by_rank]}")
    streams: list[dict | None] = []
    for s in by_rank:
        streams.extend(s["streams"])
    return world * n_streams, streams


@dataclass
class _Range:
    """Unread records of one file: those whose first byte (a JSONL line's; a tar key's first header) is in
    [lo, hi) (and, tar, whose key ordinal is `part` modulo `parts`), read from `offset` (line number / key ordinal
    `line`)."""

    epoch: int
    file: int
    part: int
    parts: int
    offset: int | None
    line: int
    lo: int
    hi: int
    tar: bool

    @property
    def weight(self) -> float:
        """Bytes of its records (a tar range's own keys are one in `parts` of its bytes)."""
        return max(0, self.hi - self.lo) / (self.parts if self.tar else 1)

    def as_piece(self) -> list:
        return [self.epoch, self.file, self.part, self.parts, self.offset, self.line, self.lo, self.hi]


class _Files:
    """One source's files: sizes and kinds; finds JSONL line starts and tar key headers at cuts. A resume reads
    two short stretches per JSONL range (its bounds moved to line starts) and one per tar shard (where its data
    ends); a tar range's headers are walked only where it is cut."""

    def __init__(self, files: list):
        self.path = [path for path, _ in files]
        self.size = [os.path.getsize(path) for path, _ in files]
        self.tar = [kind == "tar" for _, kind in files]
        self._data_end: dict[int, int] = {}

    def weights(self) -> list[int]:
        """Bytes of records per file, as the readers' deal weighs them (sources.file_weights)."""
        return [self.data_end(f) if self.tar[f] else self.size[f] for f in range(len(self.size))]

    def data_end(self, file: int) -> int:
        if file not in self._data_end:
            self._data_end[file] = tar_data_end(self.path[file], self.size[file])
        return self._data_end[file]

    def line_start(self, file: int, pos: int) -> tuple[int, int]:
        """(first JSONL line start at or after pos, its line number or 0 when unknown)."""
        if pos >= self.size[file]:
            return self.size[file], 0
        if pos == 0:
            return 0, 1
        return next_line_start(self.path[file], pos)

    def one_record(self, epoch: int, ref: SampleRef) -> list:
        """The piece of exactly one record (a JSONL line; a tar key, its size from its headers)."""
        if self.tar[ref.file]:
            keys = tar_keys(self.path[ref.file], Unit(ref.file, 0, 1), ref.offset, ref.line,
                            (ref.offset, ref.offset + 1))
            end = ref.offset + (keys[0][2] if keys else 1)
        else:
            end = self.line_start(ref.file, ref.offset + 1)[0]
        return [epoch, ref.file, 0, 1, ref.offset, ref.line, ref.offset, end]

    def as_range(self, piece: list) -> _Range:
        """A carry piece (or an unread unit) as a range that starts where its unread records start: JSONL bounds
        moved to line starts (the same lines: a line belongs to the range holding its first byte), a tar range's end
        to where the shard's data ends."""
        epoch, file, part, parts, offset, line, *span = piece
        size = self.size[file]
        if span:
            lo, hi = int(span[0]), min(int(span[1]), size)
        elif self.tar[file]:
            lo, hi = 0, size  # a tar unit is every parts-th key of the whole shard
        else:
            lo, hi = size * part // parts, size * (part + 1) // parts
        if self.tar[file]:
            return _Range(epoch, file, part, parts, offset, line, max(lo, offset or 0), min(hi, self.data_end(file)),
                          True)
        if offset is None:
            offset, line = self.line_start(file, lo)
        return _Range(epoch, file, part, parts, offset, line, max(lo, offset), self.line_start(file, hi)[0], False)

    def split(self, r: _Range, weight: float) -> tuple[_Range, _Range]:
        """`r` cut after about `weight` bytes of its records, at the next record start: (first, rest). The rest
        starts reading right at its first record (JSONL: a line start; tar: its first key's header)."""
        if r.tar:
            keys = tar_keys(self.path[r.file], Unit(r.file, r.part, r.parts), r.offset, r.line, (r.lo, r.hi))
            done, i = 0, 0
            while i < len(keys) and done < weight:  # the first key that starts past `weight` begins the rest
                done, i = done + keys[i][2], i + 1
            if i == len(keys):
                return r, dataclasses.replace(r, lo=r.hi)
            cut, ordinal, _ = keys[i]
            return dataclasses.replace(r, hi=cut), dataclasses.replace(r, offset=cut, line=ordinal, lo=cut)
        cut = r.lo + round(weight)
        if cut <= r.lo:
            return dataclasses.replace(r, hi=r.lo), r
        cut, line = self.line_start(r.file, cut)
        if cut >= r.hi:
            return r, dataclasses.replace(r, lo=r.hi)
        return dataclasses.replace(r, hi=cut), dataclasses.replace(r, offset=cut, line=line, lo=cut)


def _pieces(reader: ReaderState, files: _Files, n_slots: int, slot: int, seed: int, source: int, last_epoch: int,
            max_epochs: int | None, legacy: bool) -> list[list]:
    """The unread work of one old slot for one source, through `last_epoch`, as carry pieces (`legacy`: the slot's
    state was written with the whole-file deal of stream state version 1)."""
    pieces = [list(p) for p in reader.carry]
    stop = last_epoch + 1 if max_epochs is None else min(last_epoch + 1, max_epochs)
    for epoch in range(reader.epoch, stop):
        units = legacy_slot_units(len(files.path), n_slots, slot, seed, source, epoch) if legacy else \
            slot_units(files.weights(), n_slots, slot, seed, source, epoch)
        first = reader.unit if epoch == reader.epoch else 0
        for k, unit in enumerate(units[first:]):
            at_position = epoch == reader.epoch and k == 0
            pieces.append([epoch, unit.file, unit.part, unit.parts, reader.offset if at_position else None,
                           reader.line if at_position else 0, *(unit.span or ())])
    return pieces


def deal_evenly(pieces: list[list], files: _Files, n_new: int) -> list[list[list]]:
    """Lay the pieces' unread records end to end and cut them into `n_new` stretches of equal bytes: stretch i (a
    list of byte-range pieces, in order) is new slot i's. The cuts are at fixed fractions of the total, moved to the
    next record start, so with records of equal size the slots' record counts differ by at most one."""
    ranges = [r for r in map(files.as_range, pieces) if r.weight > 0]
    total = sum(r.weight for r in ranges)
    bounds = [total * j / n_new for j in range(1, n_new)]
    out: list[list[list]] = [[] for _ in range(n_new)]
    slot, done = 0, 0  # bytes laid before `r`
    for r in ranges:
        while slot < n_new - 1 and done + r.weight > bounds[slot]:
            first, r = files.split(r, bounds[slot] - done)
            if first.weight > 0:
                out[slot].append(first.as_piece())
                done += first.weight
            slot += 1
        if r.weight > 0:
            out[slot].append(r.as_piece())
            done += r.weight
    return out


def reshard_loader_states(old: list[dict], cfg: DataConfig, files: list, new_world: int,
                          max_epochs: int | None = None) -> list[dict]:
    """Loader states (PackLoader.state_dict of every old data shard) -> one loader state per new data shard."""
    n_old, old_streams = _old_slots(old)
    new_streams_per_shard = max(1, cfg.num_workers)
    n_new = new_world * new_streams_per_shard
    n_src = len(cfg.sources)
    readers = [[ReaderState.from_dict(s["readers"][i]) if s else ReaderState() for i in range(n_src)]
               for s in old_streams]
    last_epoch = [max(r[i].epoch for r in readers) for i in range(n_src)]
    legacy = [bool(s) and s.get("version") == LEGACY_STREAM_STATE_VERSION for s in old_streams]

    buffered = [SampleRef.from_list(entry[0]) for s in old_streams if s for entry in s["packer"]["buffer"]]
    new_carry: list[list[list[list]]] = [[[] for _ in range(n_src)] for _ in range(n_new)]
    for src in range(n_src):
        source_files = _Files(files[src])
        pieces = []
        for slot, r in enumerate(readers):
            pieces += _pieces(r[src], source_files, n_old, slot, cfg.seed, src, last_epoch[src], max_epochs,
                              legacy[slot])
        # Records read into a packing buffer but not packed: one-record pieces, dealt with the oldest epoch's rest
        # (so they count in the even deal; they were read before every reader's position).
        oldest = min((p[0] for p in pieces), default=0)
        pieces[:0] = [source_files.one_record(oldest, ref) for ref in buffered if ref.source == src]
        for epoch in sorted({p[0] for p in pieces}):  # every slot reads its share of an epoch before the next one's
            stretches = deal_evenly([p for p in pieces if p[0] == epoch], source_files, n_new)
            for slot, stretch in enumerate(stretches):
                new_carry[slot][src] += stretch

    live = [s for s in old_streams if s]
    totals = _summed_counters(live, [s.name for s in cfg.sources])
    new_states = []
    for slot in range(n_new):
        state = {
            "version": STREAM_STATE_VERSION,
            "slot": [slot, n_new],
            "readers": [ReaderState(last_epoch[src] + 1, 0, None, 0, new_carry[slot][src]).to_dict()
                        for src in range(n_src)],
            "mixture": {"draws": 0},
            "packer": {"packs_made": 0, "order": 0, "buffer": []},
            "skipped": totals["skipped"] if slot == 0 else {},
            "consumed": totals["consumed"] if slot == 0 else {},
            "truncated": totals["truncated"] if slot == 0 else 0,
            "exhausted": [False] * n_src,
            "epoch_valid": [[last_epoch[src] + 1, 0, 0, 0] for src in range(n_src)],
        }
        new_states.append(state)

    packs = sum(int(s["packs_consumed"]) for s in old)
    out = []
    for rank in range(new_world):
        streams = new_states[rank * new_streams_per_shard:(rank + 1) * new_streams_per_shard]
        out.append({"version": old[0]["version"], "rank": rank, "world_size": new_world,
                    "num_streams": new_streams_per_shard, "next_stream": 0,
                    "packs_consumed": packs if rank == 0 else 0, "streams": streams})
    return out


def _summed_counters(streams: list[dict], names: list[str]) -> dict:
    skipped: dict[str, int] = {}
    consumed: dict[str, dict[str, int]] = {}
    for s in streams:
        for k, v in s["skipped"].items():
            skipped[k] = skipped.get(k, 0) + int(v)
        for name, row in s["consumed"].items():
            acc = consumed.setdefault(name, {})
            for f, v in row.items():
                acc[f] = acc.get(f, 0) + int(v)
    return {"skipped": skipped, "consumed": consumed, "truncated": sum(int(s["truncated"]) for s in streams)}
