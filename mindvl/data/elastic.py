"""Elastic resume of the data: continue a stream saved with one slot layout (data shards x loader workers) on
another, with no record lost or read twice within an epoch. The exact order is not kept (it cannot be: the deal of
units to slots depends on the number of slots).

    new_states = reshard_loader_states(old_loader_states, cfg, files, new_world_size)   # one per new data shard

For every source, each old slot's unread work up to the furthest epoch any old slot reached (`E`) is collected as
pieces: the rest of its current unit from its byte offset, its remaining units of that epoch, and its whole share
of every later epoch up to `E` (slots read at their own pace, so some are behind). The pieces are dealt
round-robin to the new slots and read first (`ReaderState.carry`); then every new slot starts epoch `E + 1` with the
new layout. Records that were read into a packing buffer but not packed yet are dealt to the new slots' buffers
(re-read by reference, as a same-size resume does). Counters (consumed, skipped, truncated, packs) are summed into
the first new slot so that the data report keeps its totals.
"""

from __future__ import annotations

from .config import DataConfig
from .sources import ReaderState, slot_units
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
        for i, piece in enumerate(pieces):
            new_carry[i % n_new][src].append(piece)

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
