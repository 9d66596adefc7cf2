"""The three input formats (JSONL + images, WebDataset tar, parquet with image bytes) give the same curation."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest
from curate_helpers import run

from mindvl.curate.synth import pairs_corpus

pytest.importorskip("imagehash")


def _as_tar(records: list[dict], base: str, path: str) -> None:
    with tarfile.open(path, "w") as tf:
        for i, r in enumerate(records):
            img = open(os.path.join(base, r["images"][0]), "rb").read()
            rec = {k: v for k, v in r.items() if k != "images"}
            for name, data in ((f"k{i:05d}.json", json.dumps(rec).encode()),
                               (f"k{i:05d}.{r['images'][0].rsplit('.', 1)[1]}", img)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def _as_parquet(records: list[dict], base: str, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "messages": [json.dumps(r["messages"]) for r in records],
        "images": [[{"bytes": open(os.path.join(base, r["images"][0]), "rb").read(), "path": r["images"][0]}]
                   for r in records],
        "id": [r["id"] for r in records],
    })
    pq.write_table(table, path, row_group_size=max(1, len(records) // 3))


def test_jsonl_tar_and_parquet_inputs_curate_alike(tmp_path):
    truth = pairs_corpus(str(tmp_path / "in"), 24, dup_fraction=0.5, n_files=1, seed=8)
    records = [json.loads(line) for line in open(truth.files[0])]
    _as_tar(records, str(tmp_path / "in"), str(tmp_path / "pairs.tar"))
    _as_parquet(records, str(tmp_path / "in"), str(tmp_path / "pairs.parquet"))
    stages = [{"image_filter": {"min_side": 16}}, {"phash_dedup": {"max_distance": 8}}]
    kept = {}
    for name, path in (("jsonl", truth.files[0]), ("tar", str(tmp_path / "pairs.tar")),
                       ("parquet", str(tmp_path / "pairs.parquet"))):
        report, items = run([path], str(tmp_path / f"out-{name}"), stages)  # split=1: the same corpus order
        assert report["stages"]["read"]["dropped"] == {}
        ids = [it.record.get("id") for it in items]
        if name == "parquet":  # the parquet record is rebuilt from its columns: the id column is not part of it
            ids = [records[[r["messages"] for r in records].index(it.record["messages"])]["id"] for it in items]
        kept[name] = sorted(zip(ids, (it.images[0] for it in items), strict=True))
    assert kept["jsonl"] == kept["tar"] == kept["parquet"]
    assert 0 < len(kept["jsonl"]) < len(records)


def test_caption_records_and_txt_shards_are_filtered_on_their_caption(tmp_path):
    from mindvl.data.sources import Unit, item_to_conversation, iter_tar

    truth = pairs_corpus(str(tmp_path / "in"), 6, dup_fraction=0.0, n_files=1, seed=10)
    records = [json.loads(line) for line in open(truth.files[0])]
    captions = ["A short one.", "tiny", "A long enough caption here.", "", "Another good caption.", "ok ok"]
    with open(tmp_path / "caps.jsonl", "w") as f:  # mindvl's caption layout: one image and its caption
        for r, c in zip(records[:3], captions[:3], strict=True):
            f.write(json.dumps({"image": os.path.join(tmp_path, "in", r["images"][0]), "caption": c}) + "\n")
    with tarfile.open(tmp_path / "caps.tar", "w") as tf:  # WebDataset captions: image + txt, no json
        for i, (r, c) in enumerate(zip(records[3:], captions[3:], strict=True)):
            for name, data in ((f"c{i}.png", open(tmp_path / "in" / r["images"][0], "rb").read()),
                               (f"c{i}.txt", c.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    report, items = run([str(tmp_path / "caps.jsonl"), str(tmp_path / "caps.tar")], str(tmp_path / "out"),
                        [{"text_filter": {"min_words": 2}}, {"phash_dedup": {}}])
    assert sorted(it.texts() for it in items) == ["A long enough caption here.", "A short one.",
                                                  "Another good caption.", "ok ok"]
    assert report["stages"]["read"]["dropped"] == {"empty_caption": 1}
    assert report["stages"]["0:text_filter"]["dropped"] == {"too_few_words": 1}
    # the written shards read back through mindvl.data as caption records with the same captions
    got = []
    for shard in sorted(os.listdir(tmp_path / "out" / "shards")):
        for raw, _, _ in iter_tar(str(tmp_path / "out" / "shards" / shard), 0, 0, Unit(0, 0, 1), None, 0):
            conv = item_to_conversation(raw)
            assert conv.kind == "caption" and len(conv.images) == 1
            got.append(conv.text)
    assert sorted(got) == sorted(it.texts() for it in items)
