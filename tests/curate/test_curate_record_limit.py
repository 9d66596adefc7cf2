"""Curation reads its inputs with the trainer's bounded readers: a record over `max_record_bytes` (a JSONL line, a
tar key's text members, a parquet row's record cells) is skipped before it is parsed, counted as
`record_too_large` and named in the log with the pipeline's key."""

from __future__ import annotations

import io
import json
import logging
import tarfile

import pytest
from curate_helpers import dropped, run

from mindvl.curate import PipelineConfig

LIMIT = 2048


def _record(i: int) -> dict:
    return {"id": i, "messages": [{"role": "user", "content": "Say something."},
                                  {"role": "assistant", "content": f"Answer number {i} is fine."}]}


# Over the limit AND not valid JSON: were it parsed, it would be counted as bad_json instead.
HUGE = '{"messages": "' + "x" * (LIMIT + 1000)


def _write(kind: str, path, lines: list[str]) -> None:
    if kind == "jsonl":
        path.write_text("\n".join(lines) + "\n")
    elif kind == "tar":
        with tarfile.open(path, "w") as tf:
            for i, line in enumerate(lines):
                data = line.encode()
                info = tarfile.TarInfo(f"k{i:05d}.json")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"json": lines}), path)


@pytest.mark.parametrize("kind", ["jsonl", "tar", "parquet"])
def test_a_record_over_the_limit_is_skipped_unparsed_and_counted(tmp_path, kind, caplog):
    if kind == "parquet":
        pytest.importorskip("pyarrow")
    lines = [json.dumps(_record(0)), HUGE, json.dumps(_record(2)), "{not json", json.dumps(_record(4))]
    path = tmp_path / f"in.{kind}"
    _write(kind, path, lines)
    with caplog.at_level(logging.INFO):
        report, items = run([str(path)], str(tmp_path / "out"), [{"text_filter": {"min_words": 1}}],
                            max_record_bytes=LIMIT)
    assert sorted(it.record["id"] for it in items) == [0, 2, 4]
    assert dropped(report, "read") == {"record_too_large": 1, "bad_json": 1}
    logged = [r.getMessage() for r in caplog.records if "record_too_large" in r.getMessage() or
              "over max_record_bytes" in r.getMessage()]
    assert any(f"over max_record_bytes = {LIMIT}" in m for m in logged), logged
    # without the setting the default (8 MiB) holds this record, so it is parsed (and found malformed)
    report, _ = run([str(path)], str(tmp_path / "out-default"), [{"text_filter": {"min_words": 1}}])
    assert dropped(report, "read") == {"bad_json": 2}


def test_max_record_bytes_is_validated_and_keeps_old_fingerprints(tmp_path):
    base = {"inputs": ["x.jsonl"], "output": str(tmp_path / "o"), "stages": [{"text_filter": {}}]}
    with pytest.raises(ValueError, match="max_record_bytes: expected an integer >= 1"):
        PipelineConfig.from_dict({**base, "max_record_bytes": 0})
    default = PipelineConfig.from_dict(base)
    assert default.max_record_bytes == 256 * 32768 and "max_record_bytes" not in default.to_dict()
    assert PipelineConfig.from_dict({**base, "max_record_bytes": 4096}).fingerprint() != default.fingerprint()
