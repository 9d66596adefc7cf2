"""Bounded records: a record is measured before it is parsed (over `max_record_bytes`: skipped as
`record_too_large`, never parsed or held whole), and its text is tokenized only as far as seq_len needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from data_helpers import png_bytes, qa, write_jsonl, write_tar

from mindvl.data import DataConfig, build_loader
from mindvl.data.config import RECORD_BYTES_FLOOR, RECORD_BYTES_PER_TOKEN, SourceConfig
from mindvl.data.process import ProcessConfig, process_conversation
from mindvl.data.schema import BadSample, Conversation, Message
from mindvl.data.sources import SourceReader, resolve_files
from mindvl.data.template import encode_conversation, encode_document, safe_cut

REPO = Path(__file__).resolve().parents[2]


def _huge(n_bytes: int) -> dict:
    """A chat whose answer is `n_bytes` of text (so the JSON line is a little longer)."""
    return qa("Tell me everything.", ("lorem ipsum dolor sit amet " * (n_bytes // 27 + 1))[:n_bytes])


def _read_all(path: Path, limit: int, slot: int = 0, n_slots: int = 1) -> list:
    files = resolve_files([str(path)], "auto", "t")
    reader = SourceReader(SourceConfig(name="s", paths=[str(path)]), 0, files, slot, n_slots, seed=0, max_epochs=1,
                          max_record_bytes=limit)
    out = []
    while (item := reader.next()) is not None:
        out.append(item)
    return out


def test_an_oversized_line_is_skipped_unparsed_and_named_by_file_line(tmp_path, monkeypatch):
    """A 3 MB line among small ones, limit 100 kB: the reader yields it as record_too_large (file:line, its exact
    size) without json-parsing it, and the lines after it keep their numbers."""
    import mindvl.data.sources as sources

    recs = [qa("q0", "a0"), qa("q1", "a1"), _huge(3_000_000), qa("q3", "a3"), qa("q4", "a4")]
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    huge_line = len(json.dumps(recs[2]).encode())
    parsed = []
    real_loads = sources.loads_json
    monkeypatch.setattr(sources, "loads_json", lambda s, *a, **k: parsed.append(len(s)) or real_loads(s, *a, **k))
    items = _read_all(path, 100_000)
    bad = [i for i in items if isinstance(i, BadSample)]
    assert [b.reason for b in bad] == ["record_too_large"]
    assert bad[0].where == f"{path}:3" and f"is {huge_line} bytes" in str(bad[0])
    assert [i.where for i in items if not isinstance(i, BadSample)] == [f"{path}:{n}" for n in (1, 2, 4, 5)]
    for item in items:
        if not isinstance(item, BadSample):
            sources.item_to_conversation(item)
    assert len(parsed) == 4 and max(parsed) < 1000  # the huge line never reached the JSON parser


def test_the_limit_counts_the_line_without_its_newline(tmp_path):
    line = json.dumps(qa("q", "x" * 200))
    path = write_jsonl(tmp_path / "c.jsonl", [line, line])
    n = len(line.encode())
    assert not any(isinstance(i, BadSample) for i in _read_all(path, n))
    assert all(isinstance(i, BadSample) for i in _read_all(path, n - 1))


def test_an_oversized_line_across_a_part_boundary_is_counted_once(tmp_path):
    """Two slots, the file cut in two byte ranges inside the huge line: every small record is read exactly once
    and the huge one is reported by exactly one slot (the one holding its first byte)."""
    recs = [qa(f"q{i}", f"a{i}") for i in range(5)] + [_huge(400_000)] + [qa(f"q{i}", f"a{i}") for i in range(6, 9)]
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    items = _read_all(path, 50_000, 0, 2) + _read_all(path, 50_000, 1, 2)
    assert sum(isinstance(i, BadSample) for i in items) == 1
    offsets = sorted(i.ref.offset for i in items if not isinstance(i, BadSample))
    starts = np.cumsum([0] + [len(json.dumps(r)) + 1 for r in recs])[:-1].tolist()
    assert offsets == starts[:5] + starts[6:]


def test_tar_text_members_over_the_limit_are_skipped_images_do_not_count(tmp_path):
    big_png = png_bytes(256, 256, seed=1)  # ~200 kB of noise: more than the limit, but an image
    assert len(big_png) > 50_000
    keys = [("k0", {"jpg": big_png, "json": json.dumps(qa("<image>q", "a")).encode()}),
            ("k1", {"json": json.dumps(_huge(60_000)).encode()}),
            ("k2", {"txt": b"x" * 30_000, "json": b"{" + b" " * 30_000 + b"}"}),  # together over the limit
            ("k3", {"json": json.dumps(qa("q", "a")).encode()})]
    path = write_tar(tmp_path / "s.tar", keys)
    items = _read_all(path, 50_000)
    assert [getattr(i, "reason", "ok") for i in items] == ["ok", "record_too_large", "record_too_large", "ok"]
    assert items[1].where == f"{path}:k1"


def test_record_byte_limit_config():
    base = {"sources": ["x.jsonl"], "seq_len": 512}
    assert DataConfig.from_dict(base).record_byte_limit() == RECORD_BYTES_FLOOR
    assert DataConfig.from_dict({**base, "seq_len": 8192}).record_byte_limit() == RECORD_BYTES_PER_TOKEN * 8192
    assert DataConfig.from_dict({**base, "max_record_bytes": 4096}).record_byte_limit() == 4096
    for value, message in [(0, "data.max_record_bytes: must be > 0"),
                           ("1MB", "data.max_record_bytes: expected an integer"),
                           (100, "data.max_record_bytes: 100 is below seq_len 512")]:
        with pytest.raises(ValueError, match=message):
            DataConfig.from_dict({**base, "max_record_bytes": value})


def test_the_loader_counts_oversized_records_and_trains_the_rest(tmp_path, tok):
    recs = [qa(f"q{i}", f"a{i}") for i in range(20)]
    recs[7] = _huge(2_000_000)
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    cfg = DataConfig.from_dict({"sources": [str(path)], "seq_len": 256, "pack_buffer": 4})
    loader = build_loader(cfg, tok, max_epochs=1)
    packs = list(loader)
    report = loader.report()
    assert report["skipped"] == {"record_too_large": 1}
    assert sum(p.num_samples for p in packs) == 19


# ------------------------------------------------------------------------------------------- bounded tokenizing

_TEXTS = {
    "words": " ".join(["the", "cat", "sat,", "on", "the", "mat.", "12345", "naïve", "e\u0301té", "\n"][i % 10]
                      for i in range(30_000)),
    "cjk": "我们的数据在这里，测试。中文字符没有空格" * 3000,
    "no_boundary": "a" * 60_000,
    "punctuation": "...!!??--" * 6000 + " end",
    "special_text": "<|im_end|><|image_pad|> x " * 5000,
}


@pytest.mark.parametrize("name", sorted(_TEXTS))
@pytest.mark.parametrize("limit", [1, 64, 700])
def test_bounded_encoding_equals_the_full_one_up_to_the_limit(tok, name, limit):
    """Documents and chats: the first `limit` ids and labels of the bounded encoding are those of the unbounded
    one (the reference: the whole text tokenized), and it is longer than `limit` exactly when that one is."""
    text = _TEXTS[name]
    pairs = [(encode_document(tok, text, []), encode_document(tok, text, [], max_tokens=limit))]
    for cut in (10, len(text) // 3):  # a short prompt (answer cut) and a long one (prompt cut)
        msgs = [Message("user", text[:cut]), Message("assistant", text)]
        pairs.append((encode_conversation(tok, msgs, []), encode_conversation(tok, msgs, [], max_tokens=limit)))
    for full, bounded in pairs:
        assert np.array_equal(full.input_ids[:limit], bounded.input_ids[:limit])
        assert np.array_equal(full.labels[:limit], bounded.labels[:limit])
        assert (len(full.input_ids) > limit) == (len(bounded.input_ids) > limit)
        assert bounded.partial and len(bounded.input_ids) < len(full.input_ids)


def test_bounded_encoding_keeps_whole_vision_blocks_and_the_same_safe_cut(tok):
    """Images before, across and after the limit: the cut (never inside a vision block) and everything before it
    are those of the full encoding."""
    text = "<image> " + "word " * 300 + "<image> more words here " + "<image>" + " tail" * 500
    grids = [(1, 4, 4), (1, 8, 8), (1, 4, 4)]
    full = encode_document(tok, text, grids)
    second = full.image_spans[1]
    for limit in (second[0] - 2, second[0], second[0] + 5, second[1], second[1] + 1, second[1] + 40):
        b = encode_document(tok, text, grids, max_tokens=limit)
        cut = safe_cut(len(full.input_ids), limit, full.image_spans)
        assert safe_cut(len(b.input_ids), limit, b.image_spans) == cut
        assert np.array_equal(full.input_ids[:cut], b.input_ids[:cut])
        assert b.image_spans == full.image_spans[:len(b.image_spans)]


def test_tokenizing_a_huge_record_sees_only_what_seq_len_needs(tok, monkeypatch):
    """A 2 MB answer with seq_len 128: the tokenizer is handed a few kB, and the sample equals the truncation of
    the fully tokenized record."""
    answer = ("lorem ipsum dolor sit amet " * 80_000)[:2_000_000]
    conv = Conversation([Message("user", "Tell me."), Message("assistant", answer)], [], "mem:1")
    cfg = ProcessConfig(seq_len=128, min_pixels=3136, max_pixels=50176, max_image_pixels=10**8)
    seen = []
    real = tok.encode_text
    monkeypatch.setattr(tok, "encode_text", lambda s: seen.append(len(s)) or real(s))
    sample, truncated = process_conversation(conv, tok, cfg)
    monkeypatch.undo()
    assert truncated and max(seen) < 4_000
    full = encode_conversation(tok, conv.messages, [])
    assert np.array_equal(sample.input_ids, full.input_ids[:128])
    assert np.array_equal(sample.labels, full.labels[:128])


def test_truncation_drop_still_drops_a_long_record(tok):
    conv = Conversation([Message("user", "q"), Message("assistant", "word " * 100_000)], [], "mem:1")
    cfg = ProcessConfig(seq_len=64, min_pixels=3136, max_pixels=50176, max_image_pixels=10**8, truncation="drop")
    with pytest.raises(BadSample, match="over .* tokens > seq_len 64") as exc:
        process_conversation(conv, tok, cfg)
    assert exc.value.reason == "too_long"


# ------------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_corpus_with_a_50mb_line_trains(tmp_path):
    """The issue's case through `mindvl train` (tiny text recipe, 3 steps): the 50 MB line is counted as
    record_too_large in the data report, the run finishes normally."""
    recs = [qa(f"Reverse {i:04d}.", f"{i:04d}"[::-1]) for i in range(400)]
    with open(tmp_path / "c.jsonl", "w") as f:
        for i, r in enumerate(recs):
            f.write(json.dumps(r) + "\n")
            if i == 1:
                f.write(json.dumps(_huge(50 * 2**20)) + "\n")
    raw = yaml.safe_load((REPO / "recipes" / "tiny" / "text.yaml").read_text())
    raw["output_dir"] = str(tmp_path / "run")
    raw["data"]["sources"] = [{"path": str(tmp_path / "c.jsonl")}]
    raw["data"]["seq_len"] = 256
    raw["budget"] = {"max_steps": 3}
    raw["checkpoint"] = {"every": None}
    raw["logging"] = {"progress": False, "tensorboard": False, "plot": False}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    cli = "import sys; from mindvl.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", cli, "train", str(tmp_path / "r.yaml")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["skipped"] == {"record_too_large": 1}
    assert f"{tmp_path / 'c.jsonl'}:3" in done.stderr + done.stdout  # the warning names file:line
