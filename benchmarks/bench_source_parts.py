"""Time to first sample of a large JSONL file cut into many reading slots (issue 12: sources at any scale).

With S reading slots (ranks x loader workers) and fewer files than slots, each file is cut into byte-range parts.
The old part start counted the lines from byte 0 up to the part (so messages could say file:line): slot k of S read
k/S of the file before its first record, in every slot and every epoch. The new start seeks to the part's first
byte and reads forward to the next line start.

    python benchmarks/bench_source_parts.py --gb 10 --slots 256          # generates /tmp/mindvl_bench_10g.jsonl
    python benchmarks/bench_source_parts.py --gb 10 --slots 256 --delete # ... and deletes it afterwards

Arms run interleaved per probed slot; the old arm is the previous algorithm, reproduced here (`old_part_start`).
Reading a file that the page cache holds is far faster than reading it from disk; the script prints how much of
the file fit in memory (first-run numbers are from disk, later runs partly from cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from mindvl.data.config import SourceConfig
from mindvl.data.sources import SourceReader, resolve_files, slot_units

CHUNK = 1 << 20


def generate(path: str, gb: float) -> None:
    """Conversation records of ~1 KB (an image path, a question, a long answer), written in 64 MB blocks."""
    lines = []
    for i in range(64 * 1024):
        rec = {"messages": [{"role": "user", "content": f"<image>Describe picture {i} in detail."},
                            {"role": "assistant", "content": ("A long description of the scene. " * (20 + i % 17))}],
               "images": [f"images/{i:08d}.jpg"]}
        lines.append(json.dumps(rec))
    block = ("\n".join(lines) + "\n").encode()
    target = int(gb * (1 << 30))
    with open(path, "wb") as f:
        written = 0
        while written < target:
            f.write(block)
            written += len(block)


def old_part_start(path: str, part: int, parts: int) -> tuple[int, int]:
    """The previous algorithm: count newlines from byte 0 to the part start (for file:line messages)."""
    size = os.path.getsize(path)
    lo = size * part // parts
    if lo == 0:
        return 0, 1
    with open(path, "rb") as f:
        newlines, pos = 0, 0
        while pos < lo - 1:
            chunk = f.read(min(CHUNK, lo - 1 - pos))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            pos += len(chunk)
        f.seek(lo - 1)
        rest = f.readline()
        return lo - 1 + len(rest), newlines + 1 + (1 if rest.endswith(b"\n") else 0)


def old_first_record(path: str, slot: int, slots: int) -> float:
    t = time.perf_counter()
    unit = slot_units(1, slots, slot, 0, 0, 0)[0]
    offset, _ = old_part_start(path, unit.part, unit.parts)
    with open(path, "rb") as f:
        f.seek(offset)
        f.readline()
    return time.perf_counter() - t


def new_first_record(path: str, slot: int, slots: int) -> float:
    t = time.perf_counter()
    files = resolve_files([path], "jsonl", "bench")
    reader = SourceReader(SourceConfig(name="big", paths=[path]), 0, files, slot, slots, seed=0)
    item = reader.next()
    assert item is not None and item.line.startswith(b"{")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--path", default=None)
    ap.add_argument("--probe", type=int, default=5, help="slots timed with the old algorithm (spread over the file)")
    ap.add_argument("--delete", action="store_true", help="delete the generated file afterwards")
    args = ap.parse_args()
    path = args.path or f"/tmp/mindvl_bench_{args.gb:g}g.jsonl"
    if not os.path.isfile(path):
        t = time.perf_counter()
        generate(path, args.gb)
        print(f"generated {path}: {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s")
    size = os.path.getsize(path)
    print(f"file {size / 2**30:.2f} GiB, {args.slots} slots; load: {subprocess.getoutput('uptime').strip()}")
    # Which slot holds which part is a per-epoch shuffle; probe slots whose part lies at evenly spread offsets.
    part_of = {s: slot_units(1, args.slots, s, 0, 0, 0)[0].part for s in range(args.slots)}
    by_part = sorted(part_of, key=part_of.get)
    probes = [by_part[round(i * (args.slots - 1) / max(1, args.probe - 1))] for i in range(args.probe)]
    rows = []
    try:
        for slot in probes:
            old = old_first_record(path, slot, args.slots)
            new = new_first_record(path, slot, args.slots)
            rows.append((slot, part_of[slot], old, new))
            print(f"slot {slot:4d} (part {part_of[slot]:4d}, byte {size * part_of[slot] // args.slots / 2**30:6.2f}"
                  f" GiB): old {old:8.3f} s  new {new * 1e3:8.3f} ms  ratio {old / new:10.0f}x", flush=True)
        every = [new_first_record(path, s, args.slots) for s in range(args.slots)]
        print(f"new, all {args.slots} slots: median {statistics.median(every) * 1e3:.3f} ms, max "
              f"{max(every) * 1e3:.3f} ms, sum {sum(every):.3f} s")
        # The old cost grows linearly with the part's offset: sum over all slots ~ slots x the mean probe.
        old_mean = statistics.mean(r[2] for r in rows)
        print(f"old, all {args.slots} slots (linear in the offset, estimated from the probes): "
              f"~{old_mean * args.slots:.0f} s of reading per epoch; the last slot waits {rows[-1][2]:.1f} s")
    finally:
        if args.delete:
            os.remove(path)
            print(f"deleted {path}")


if __name__ == "__main__":
    main()
