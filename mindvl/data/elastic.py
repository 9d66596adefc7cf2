"""Elastic resume of the data: continue a stream saved with one slot layout (data shards x loader workers) on
another, with no record lost or read twice within an epoch, and the unread rest of the epoch dealt evenly. The
exact order is not kept (it cannot be: the deal of records to slots depends on the number of slots).

    new_states = reshard_loader_states(old_loader_states, cfg, files, new_world_size)   # one per new data shard

For every source, each old slot's unread work up to the furthest epoch any old slot reached (`E`) is collected as
byte ranges of files: the rest of its current unit from its byte offset, its remaining units of that epoch, its
whole share of every later epoch up to `E` (slots read at their own pace, so some are behind), and what is left of
pieces an earlier elastic resume handed it. Those ranges, laid end to end, are cut into as many stretches of equal
size as there are new slots (a JSONL range is cut at any byte: a line belongs to the range holding its first byte;
a tar range at any byte too: a key belongs to the range holding its first member's header, the reader walking the
headers from the last known one), and new slot i reads stretch i first (`ReaderState.carry`); then every new slot
starts epoch `E + 1` with the new layout. So after a resume from 1 slot to 2 both read half of the epoch's rest,
instead of one reading the whole leftover file while the other starts the next epoch. Records that were read into a
packing buffer but not packed yet are dealt to the new slots' buffers (re-read by reference, as a same-size resume
does). Counters (consumed, skipped, truncated, packs) are summed into the first new slot so that the data report
keeps its totals.
"""

from __future__ import annotations

import os

from .config import DataConfig
from .sources import ReaderState, next_line_start, slot_units
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


class _Files:
    """One source's files: sizes, kinds, and JSONL line starts near cuts."""

    def __init__(self, files: list):
        self.path = [path for path, _ in files]
        self.size = [os.path.getsize(path) for path, _ in files]
        self.tar = [kind == "tar" for _, kind in files]

    def line_start(self, file: int, pos: int) -> tuple[int, int]:
        """(first JSONL line start at or after pos, its line number or 0 when unknown)."""
        if pos >= self.size[file]:
            return self.size[file], 0
        return next_line_start(self.path[file], pos)

    def range_piece(self, piece: list) -> list:
        """A carry piece in its byte-range form [epoch, file, part, parts, offset, line, lo, hi] with lo moved up to
        where its unread records start; a JSONL range is moved to line starts (the same lines: a line belongs to
        the range holding its first byte), so its bytes are exactly its records'."""
        epoch, file, part, parts, offset, line, *span = piece
        size = self.size[file]
        if span:
            lo, hi = int(span[0]), int(span[1])
        elif self.tar[file]:
            lo, hi = 0, size  # a tar unit is every parts-th key of the whole shard
        else:
            lo, hi = size * part // parts, size * (part + 1) // parts
        hi = min(hi, size)
        if offset is not None:
            lo = max(lo, offset)  # JSONL: offset is the next line's start; tar: the next key's header
        elif not self.tar[file]:
            offset, line = self.line_start(file, lo)
            lo = offset
        if not self.tar[file]:
            hi = self.line_start(file, hi)[0]
        return [epoch, file, part, parts, offset, line, lo, hi]

    def weight(self, piece: list) -> float:
        """Bytes of the piece's own records (a tar piece reads one key in `parts`)."""
        _, file, _, parts, _, _, lo, hi = piece
        return max(0, hi - lo) / (parts if self.tar[file] else 1)

    def split(self, piece: list, weight: float) -> tuple[list, list]:
        """The piece cut after about `weight` of its records' bytes: (first, rest). A JSONL piece is cut at the
        next line start; a tar piece at that byte (the rest walks the headers from the piece's last known key)."""
        epoch, file, part, parts, offset, line, lo, hi = piece
        cut = min(hi, max(lo, lo + round(weight * (parts if self.tar[file] else 1))))
        if self.tar[file]:
            return [epoch, file, part, parts, offset, line, lo, cut], [epoch, file, part, parts, offset, line, cut, hi]
        if cut > lo:
            cut, cut_line = self.line_start(file, cut)
            cut = min(cut, hi)
        else:
            cut_line = line
        first = [epoch, file, part, parts, offset, line, lo, cut]
        return first, [epoch, file, part, parts, cut, cut_line if cut < hi else 0, cut, hi]


def _pieces(reader: ReaderState, n_files: int, n_slots: int, slot: int, seed: int, source: int, last_epoch: int,
            max_epochs: int | None) -> list[list]:
    """The unread work of one old slot for one source, through `last_epoch`, as carry pieces."""
    pieces = [list(p) for p in reader.carry]
    stop = last_epoch + 1 if max_epochs is None else min(last_epoch + 1, max_epochs)
    for epoch in range(reader.epoch, stop):
        units = slot_units(n_files, n_slots, slot, seed, source, epoch)
        first = reader.unit if epoch == reader.epoch else 0
        for k, unit in enumerate(units[first:]):
            at_position = epoch == reader.epoch and k == 0
            pieces.append([epoch, unit.file, unit.part, unit.parts, reader.offset if at_position else None,
                           reader.line if at_position else 0])
    return pieces


def deal_evenly(pieces: list[list], files: _Files, n_new: int) -> list[list[list]]:
    """Lay the pieces' unread bytes end to end and cut them into `n_new` stretches of equal size: stretch i (a list
    of byte-range pieces, in order) is new slot i's. The cuts are at fixed fractions of the total (JSONL: moved to
    the next line start), so with records of equal size the slots' record counts differ by at most one."""
    ranged = [p for p in (files.range_piece(p) for p in pieces) if p[7] > p[6]]
    total = sum(files.weight(p) for p in ranged)
    bounds = [total * j / n_new for j in range(1, n_new)]
    out: list[list[list]] = [[] for _ in range(n_new)]
    slot, done = 0, 0.0  # bytes laid before `piece`
    for piece in ranged:
        while slot < n_new - 1 and done + files.weight(piece) > bounds[slot]:
            first, piece = files.split(piece, bounds[slot] - done)
            if first[7] > first[6]:
                out[slot].append(first)
                done += files.weight(first)
            slot += 1
        if piece[7] > piece[6]:
            out[slot].append(piece)
            done += files.weight(piece)
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

    new_carry: list[list[list[list]]] = [[[] for _ in range(n_src)] for _ in range(n_new)]
    for src in range(n_src):
        pieces = []
        for slot, r in enumerate(readers):
            pieces += _pieces(r[src], len(files[src]), n_old, slot, cfg.seed, src, last_epoch[src], max_epochs)
        for slot, stretch in enumerate(deal_evenly(pieces, _Files(files[src]), n_new)):
            new_carry[slot][src] = stretch

    buffered = [entry[0] for s in old_streams if s for entry in s["packer"]["buffer"]]
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
            "packer": {"packs_made": 0, "order": len(buffered[slot::n_new]),
                       "buffer": [[ref, 0, k] for k, ref in enumerate(buffered[slot::n_new])]},
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
