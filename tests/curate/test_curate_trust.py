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
