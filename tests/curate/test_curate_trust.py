"""Threat model, item 4 in curation: poisoned records (50,000 nested `[`, a 5,000-digit integer) among good ones,
in JSONL, tar and parquet inputs, are counted as `bad_json` and the good records are kept."""

from __future__ import annotations

import json

import pytest
from curate_helpers import dropped, run
from test_curate_record_limit import _record, _write

DEEP = "[" * 50_000 + "]" * 50_000
HUGE_INT = json.dumps(_record(9))[:-1] + ', "n": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("kind", ["jsonl", "tar", "parquet"])
def test_poisoned_records_are_counted_skips(tmp_path, kind):
    if kind == "parquet":
        pytest.importorskip("pyarrow")
    lines = [json.dumps(_record(0)), DEEP, json.dumps(_record(2)), HUGE_INT, json.dumps(_record(4))]
    path = tmp_path / f"in.{kind}"
    _write(kind, path, lines)
    report, items = run([str(path)], str(tmp_path / "out"), [{"text_filter": {"min_words": 1}}])
    assert sorted(it.record["id"] for it in items) == [0, 2, 4]
    assert dropped(report, "read") == {"bad_json": 2}


def test_images_outside_the_data_folder_devices_and_fifos_are_not_copied(tmp_path):
    """Items 3 and 5: a record naming `../secret`, a symlink to it, `/dev/zero` or a FIFO is a counted skip; the
    secret never reaches the output shards and nothing blocks."""
    import os

    from PIL import Image

    d = tmp_path / "data"
    d.mkdir()
    (tmp_path / "secret.txt").write_text("SECRET-TOKEN")
    os.symlink(tmp_path / "secret.txt", d / "link.png")
    os.mkfifo(d / "fifo.png")
    Image.new("RGB", (32, 32), (200, 10, 10)).save(d / "ok.png")
    names = ["ok.png", "../secret.txt", "link.png", "/dev/zero", "fifo.png", "ok.png"]
    lines = [json.dumps({**_record(i), "images": [n],
                         "messages": [{"role": "user", "content": "<image>Say something."},
                                      {"role": "assistant", "content": f"Answer number {i} is fine."}]})
             for i, n in enumerate(names)]
    (d / "in.jsonl").write_text("\n".join(lines) + "\n")
    report, items = run([str(d / "in.jsonl")], str(tmp_path / "out"), [{"text_filter": {"min_words": 1}}])
    assert sorted(it.record["id"] for it in items) == [0, 5]
    assert dropped(report, "read") == {"image_outside": 1, "missing_image": 3}
    for shard in (tmp_path / "out" / "shards").iterdir():
        assert b"SECRET-TOKEN" not in shard.read_bytes()
