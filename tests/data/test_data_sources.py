"""Sources: JSONL and ShareGPT records, WebDataset tar shards, rank/worker assignment, bad input handling."""

from __future__ import annotations

import json
import logging
import os
import tarfile

import numpy as np
import pytest
from data_helpers import png_bytes, qa, write_jsonl, write_tar

from mindvl.data.config import DataConfig, SourceConfig
from mindvl.data.schema import BadSample, SampleRef
from mindvl.data.sources import (
    SourceReader,
    item_to_conversation,
    resolve_files,
    slot_units,
)
from mindvl.data.stream import PackStream


def read_all(paths, n_slots=1, slot=0, seed=0, epochs=1, fmt="auto", absolute_paths=False):
    """Every item (RawItem or BadSample) a slot reads in `epochs` epochs."""
    cfg = SourceConfig(name="s", paths=[str(p) for p in paths], format=fmt, absolute_paths=absolute_paths)
    files = resolve_files(cfg.paths, fmt, "test")
    reader = SourceReader(cfg, 0, files, slot, n_slots, seed, max_epochs=epochs)
    out = []
    while (item := reader.next()) is not None:
        out.append(item)
    return out


def stream_for(paths, tmp_path=None, **kw) -> PackStream:
    from mindvl.data.tokenizer import load_tokenizer

    cfg = DataConfig(sources=[SourceConfig(name="s", paths=[str(p) for p in paths])], **kw)
    cfg.validate()
    files = [resolve_files(cfg.sources[0].paths, "auto", "test")]
    return PackStream(cfg, load_tokenizer(), files, 0, 1, max_epochs=1)


def test_messages_sharegpt_and_list_content_parse_alike(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(40, 60))
    recs = [
        {"messages": [{"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": "A"}],
         "images": ["a.png"], "system": "S"},
        {"conversations": [{"from": "human", "value": "<image>Q"}, {"from": "gpt", "value": "A"}],
         "image": "a.png", "system": "S"},
        {"messages": [{"role": "system", "content": "S"},
                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "A"}]}],
         "images": [str(tmp_path / "a.png")]},  # absolute paths work too, in a source that trusts them
    ]
    items = read_all([write_jsonl(tmp_path / "d.jsonl", recs)], absolute_paths=True)
    convs = [item_to_conversation(i) for i in items]
    for c in convs:
        assert [(m.role, m.content) for m in c.messages] == [("system", "S"), ("user", "<image>Q"), ("assistant", "A")]
        assert os.path.samefile(c.images[0].name, tmp_path / "a.png")
    assert [c.where for c in convs] == [f"{tmp_path / 'd.jsonl'}:{i}" for i in (1, 2, 3)]


def test_text_only_records_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(qa("hi", "there")) + "\n\n" + json.dumps(qa("a", "b")) + "\n")
    items = read_all([path])
    assert [i.ref.line for i in items] == [1, 3]
    assert all(not item_to_conversation(i).images for i in items)


BAD_CASES = [
    ("bad_json", '{"messages": [ this is not json'),
    ("empty_conversation", {"messages": []}),
    ("unknown_role", {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    ("no_assistant_turn", {"messages": [{"role": "user", "content": "x"}]}),
    ("image_count_mismatch", qa("<image><image>two", "one", images=["ok.png"])),
    ("missing_image", qa("<image>where", "gone", images=["missing.png"])),
    ("corrupt_image", qa("<image>bad", "bytes", images=["corrupt.png"])),
    ("bad_record", {"prompt": "no conversation"}),  # {"text": ...} is a document (test_data_documents.py)
]


def test_bad_records_skipped_counted_and_logged(tmp_path, caplog):
    (tmp_path / "ok.png").write_bytes(png_bytes(30, 30))
    (tmp_path / "corrupt.png").write_bytes(png_bytes(64, 64)[:100])
    records = []
    for _, rec in BAD_CASES:
        records.append(qa("fine", "yes"))
        records.append(rec)
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="mindvl.data"):
        stream = stream_for([path], seq_len=4096)
        packs = list(stream)
    assert sum(p.num_samples for p in packs) == len(BAD_CASES)  # every good record made it
    assert stream.skips.counts == {reason: 1 for reason, _ in BAD_CASES}
    for k, (reason, _) in enumerate(BAD_CASES):
        line = 2 * k + 2
        assert any(f"{path}:{line}" in r.message and reason in r.message for r in caplog.records), reason


def test_strict_mode_fails_fast_with_location(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [qa(), "{broken", qa()])
    stream = stream_for([path], seq_len=4096, strict=True)
    with pytest.raises(ValueError, match=rf"{path}:2: malformed JSON.*strict"):
        list(stream)


def test_too_long_dropped_or_truncated_safely(tmp_path, tok):
    (tmp_path / "big.png").write_bytes(png_bytes(280, 280))  # 10x10 merged = 100 pads
    long_q = "word " * 300
    recs = [qa(f"{long_q}<image>", "answer", images=["big.png"]), qa("<image>short", "ok", images=["big.png"])]
    path = write_jsonl(tmp_path / "long.jsonl", recs)
    drop = stream_for([path], seq_len=256, truncation="drop", pack_buffer=4)
    packs = list(drop)
    assert drop.skips.counts == {"too_long": 1} and sum(p.num_samples for p in packs) == 1
    # Truncation: the 300-word prompt leaves no assistant token before seq_len -> nothing trainable -> dropped.
    trunc = stream_for([path], seq_len=256, truncation="truncate", pack_buffer=4)
    assert sum(p.num_samples for p in trunc) == 1 and trunc.skips.counts == {"too_long": 1}
    # An answer-first record truncated in the middle of its image: cut before <|vision_start|>, image dropped.
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes " * 40},
                        {"role": "user", "content": "<image>more"}, {"role": "assistant", "content": "ok"}],
           "images": ["big.png"]}
    path2 = write_jsonl(tmp_path / "cut.jsonl", [rec])
    s = stream_for([path2], seq_len=120, truncation="truncate", pack_buffer=1)
    (pack,) = list(s)
    assert s.truncated == 1 and pack.num_tokens <= 120
    assert len(pack.image_grid_thw) == 0 and pack.num_patches == 0
    ids = np.asarray(pack.input_ids)
    assert tok.special.vision_start not in ids and tok.special.image_pad not in ids


def test_unreadable_and_empty_sources_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches"):
        resolve_files([str(tmp_path / "*.jsonl")], "auto", "data.sources[0]")
    with pytest.raises(FileNotFoundError, match="file not found"):
        resolve_files([str(tmp_path / "x.jsonl")], "auto", "data.sources[0]")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="every file is empty"):
        resolve_files([str(tmp_path / "empty.jsonl")], "auto", "data.sources[0]")
    # Only bad records: a clear error instead of silently zero data.
    path = write_jsonl(tmp_path / "allbad.jsonl", ["{x", "{y"])
    with pytest.raises(ValueError, match="no usable sample"):
        list(stream_for([path], seq_len=512))


def _tar_keys(n: int, bad: set[int] = frozenset()) -> list:
    keys = []
    for i in range(n):
        rec = qa(f"<image>key {i}", f"answer {i}")
        members = {"json": json.dumps(rec).encode(), "png": png_bytes(28 + i, 40, seed=i)}
        if i in bad:
            members["json"] = b"{oops"
        keys.append((f"sample{i:04d}", members))
    return keys


def test_tar_shards_read_in_order_with_images(tmp_path):
    shard = write_tar(tmp_path / "shard-000.tar", _tar_keys(5))
    items = read_all([shard])
    assert [i.key for i in items] == [f"sample{i:04d}" for i in range(5)]
    conv = item_to_conversation(items[3])
    assert conv.messages[1].content == "answer 3" and conv.images[0].data == png_bytes(31, 40, seed=3)
    assert conv.where == f"{shard}:sample0003"
    # Named images (record lists them) and multi-image keys in natural order.
    rec = qa("<image><image>two", "ok", images=["1.png", "0.png"])
    shard2 = write_tar(tmp_path / "named.tar", [("k", {"json": json.dumps(rec).encode(), "0.png": b"A",
                                                       "1.png": b"B"})])
    (item,) = read_all([shard2])
    assert [im.data for im in item_to_conversation(item).images] == [b"B", b"A"]


def test_tar_bad_member_and_truncated_shard(tmp_path, caplog):
    shard = write_tar(tmp_path / "bad.tar", _tar_keys(4, bad={1}))
    stream = stream_for([shard], seq_len=4096)
    with caplog.at_level(logging.WARNING, logger="mindvl.data"):
        n = sum(p.num_samples for p in stream)
    assert n == 3 and stream.skips.counts == {"bad_json": 1}
    assert any(f"{shard}:sample0001" in r.message for r in caplog.records)
    # Truncate the shard in the middle of the third key's image: keys 0, 1 survive, key 2 is unreadable.
    data = shard.read_bytes()
    with tarfile.open(shard) as tf:
        cut = next(m for m in tf.getmembers() if m.name == "sample0002.png").offset_data + 10
    trunc = tmp_path / "trunc.tar"
    trunc.write_bytes(data[:cut])
    items = read_all([trunc])
    assert [type(i).__name__ for i in items] == ["RawItem", "RawItem", "BadSample"]
    assert items[2].reason == "tar_member_unreadable" and items[2].where == f"{trunc}:sample0002"


def _all_refs(paths, n_slots, epoch_count=1):
    per_slot = []
    for slot in range(n_slots):
        items = read_all(paths, n_slots=n_slots, slot=slot, epochs=epoch_count)
        per_slot.append([(i.ref.file, i.ref.offset) for i in items])
    return per_slot


@pytest.mark.parametrize("n_files,n_slots", [(1, 1), (1, 3), (2, 5), (7, 3), (4, 4)])
def test_slots_partition_every_epoch_exactly(tmp_path, n_files, n_slots):
    paths = []
    for f in range(n_files):
        paths.append(write_jsonl(tmp_path / f"f{f}.jsonl", [qa(f"q{f}-{i}", "a") for i in range(11 + f)]))
    per_slot = _all_refs(paths, n_slots)
    flat = [r for s in per_slot for r in s]
    assert len(flat) == len(set(flat)) == sum(11 + f for f in range(n_files))  # no record twice, none skipped
    assert all(per_slot)  # every slot has work
    # Records are named exactly: file:line in a file's first part; file@byteN where a part starts mid-file (its
    # start is found by reading forward to the next line, not by counting lines from byte 0).
    for slot in range(n_slots):
        for item in read_all(paths, n_slots=n_slots, slot=slot):
            conv = item_to_conversation(item)
            f, i = conv.messages[0].content.removeprefix("q").split("-")
            path = tmp_path / f"f{f}.jsonl"
            if item.ref.line:
                assert item.ref.line == int(i) + 1 and item.where == f"{path}:{int(i) + 1}"
            else:
                assert item.where == f"{path}@byte{item.ref.offset}"
                assert path.read_bytes().split(b"\n").index(item.line.rstrip(b"\n")) == int(i)
            assert path.read_bytes()[item.ref.offset:].split(b"\n", 1)[0] == item.line.rstrip(b"\n")


def test_a_source_smaller_than_the_slots_is_read_once_per_epoch(tmp_path):
    """20 records at 32 reading slots (8 GPUs x 4 workers): slots whose share is empty move on; across the slots,
    every record is read exactly once per epoch, for several epochs."""
    path = write_jsonl(tmp_path / "small.jsonl", [qa(f"q{i}", "a") for i in range(20)])
    files = resolve_files([str(path)], "auto", "test")
    for epochs in (1, 3):
        seen = []
        for slot in range(32):
            reader = SourceReader(SourceConfig(name="s", paths=[str(path)]), 0, files, slot, 32, seed=3,
                                  max_epochs=epochs)
            while (item := reader.next()) is not None:
                seen.append((reader.state.epoch, item.ref.offset))
        assert len(seen) == 20 * epochs and len(set(seen)) == 20 * epochs
        assert sorted({e for e, _ in seen}) == list(range(epochs))


def test_tar_parts_partition_keys(tmp_path):
    shard = write_tar(tmp_path / "s.tar", _tar_keys(9))
    keys = [[i.key for i in read_all([shard], n_slots=4, slot=s)] for s in range(4)]
    assert sorted(k for ks in keys for k in ks) == [f"sample{i:04d}" for i in range(9)]
    assert all(keys)


def test_epoch_deal_is_deterministic_changes_per_epoch_and_covers_every_byte_once():
    weights = [97 * 3 + f for f in range(50)]
    a0 = [slot_units(weights, 4, s, seed=7, source=0, epoch=0) for s in range(4)]
    assert a0 == [slot_units(weights, 4, s, seed=7, source=0, epoch=0) for s in range(4)]
    assert a0 != [slot_units(weights, 4, s, seed=7, source=0, epoch=1) for s in range(4)]
    assert a0 != [slot_units(weights, 4, s, seed=8, source=0, epoch=0) for s in range(4)]
    covered = sorted((u.file, u.lo, u.hi) for units in a0 for u in units)
    for f in range(50):  # every file's bytes, each once, in ranges that meet end to end
        mine = [(lo, hi) for g, lo, hi in covered if g == f]
        assert mine[0][0] == 0 and mine[-1][1] == weights[f]
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
    shares = [sum(u.hi - u.lo for u in units) for units in a0]
    assert max(shares) - min(shares) <= 1 and sum(shares) == sum(weights)


def test_the_rotation_gives_a_one_record_file_to_every_slot():
    """A stretch's bytes go to each slot in turn across epochs (the first byte of a file is not always slot 0's)."""
    holders = {next(s for s in range(3) if any(u.lo == 0 for u in slot_units([10], 3, s, 0, 0, e)))
               for e in range(40)}
    assert holders == {0, 1, 2}


def test_two_epochs_each_record_once_per_epoch(tmp_path):
    paths = [write_jsonl(tmp_path / f"f{f}.jsonl", [qa(f"q{f}-{i}", "a") for i in range(5)]) for f in range(6)]
    items = read_all(paths, n_slots=2, slot=1, epochs=2)
    refs = [(i.ref.file, i.ref.offset) for i in items]
    one_epoch = read_all(paths, n_slots=2, slot=1, epochs=1)
    n = len(one_epoch)
    assert len(set(refs[:n])) == n and len(refs) > n  # the second epoch reads a different set of files for slot 1
    both_slots = set(refs[:n]) | {(i.ref.file, i.ref.offset) for i in read_all(paths, n_slots=2, slot=0)}
    assert len(both_slots) == 30


def test_read_ref_returns_the_same_record(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [qa(f"q{i}", "a") for i in range(4)])
    cfg = SourceConfig(name="s", paths=[str(path)])
    reader = SourceReader(cfg, 0, resolve_files(cfg.paths, "auto", "t"), 0, 1, 0, max_epochs=1)
    items = [reader.next() for _ in range(4)]
    again = reader.read_ref(SampleRef.from_list(items[2].ref.to_list()))
    assert again.line == items[2].line and again.where == items[2].where
    assert not isinstance(again, BadSample)


def test_an_absolute_image_path_is_read_only_where_the_source_trusts_it(tmp_path):
    """A received corpus names `/home/user/.netrc`: without `absolute_paths` it is a counted skip naming the
    setting (issue 41 item 5); with it, the same record reads the image."""
    (tmp_path / "a.png").write_bytes(png_bytes(40, 60))
    rec = {"messages": [{"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": "A"}],
           "images": [str(tmp_path / "a.png")]}
    path = write_jsonl(tmp_path / "d.jsonl", [rec])
    (untrusted,) = read_all([path])
    with pytest.raises(BadSample) as err:
        item_to_conversation(untrusted)
    assert err.value.reason == "image_absolute" and "absolute_paths: true" in str(err.value)
    (trusted,) = read_all([path], absolute_paths=True)
    assert os.path.samefile(item_to_conversation(trusted).images[0].name, tmp_path / "a.png")
