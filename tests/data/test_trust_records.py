"""Threat model, item 4: one poisoned record among good ones is a counted skip naming its file:line, never the end
of a run: a line of 50,000 nested `[` (RecursionError in the JSON parser), a 5,000-digit integer (a ValueError in
int()), and JSON nested past the depth limit. The trainer's loader and `data plan` are checked here, curate in
tests/curate/test_curate_trust.py."""

from __future__ import annotations

import json

import pytest
from data_helpers import qa, write_jsonl, write_tar

from mindvl.data import DataConfig, build_loader
from mindvl.data.plan import plan_recipe
from mindvl.data.schema import BadSample
from mindvl.data.sources import RawItem, item_to_conversation
from mindvl.untrusted import MAX_INT_DIGITS, MAX_JSON_DEPTH, UntrustedInputError, loads_json

DEEP = "[" * 50_000 + "]" * 50_000
HUGE_INT = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "n": ' \
    + "9" * 5000 + "}"
JUST_TOO_DEEP = '{"messages": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"  # depth MAX + 1


def poisoned_corpus(path, n_good: int = 12):
    lines = [json.dumps(qa(f"q{i}", f"a{i}")) for i in range(n_good)]
    lines[2:2] = [DEEP]
    lines[5:5] = [HUGE_INT]
    lines[8:8] = [JUST_TOO_DEEP]
    path.write_text("\n".join(lines) + "\n")
    return path, {3, 6, 9}  # the poisoned lines' numbers (1-based)


def test_loads_json_limits():
    assert loads_json('{"a": [[1, 2], {"b": -' + "9" * MAX_INT_DIGITS + "}]}")["a"][1]["b"] == -int("9" * 64)
    assert loads_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) == eval("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    for bad, what in [(DEEP, "nested deeper"), (JUST_TOO_DEEP, "nested deeper"), (HUGE_INT, "5000 digits"),
                      ("[" + "1" * (MAX_INT_DIGITS + 1) + "]", f"{MAX_INT_DIGITS + 1} digits")]:
        with pytest.raises(UntrustedInputError, match=what):
            loads_json(bad)
    assert loads_json("1e999999") == float("inf")  # floats have no digit limit in Python: accepted as JSON says


@pytest.mark.parametrize("line", [DEEP, HUGE_INT, JUST_TOO_DEEP], ids=["deep", "huge_int", "just_too_deep"])
def test_a_poisoned_line_or_tar_member_is_a_bad_sample_naming_its_place(line):
    for item in (RawItem(None, "c.jsonl:7", "jsonl", line=line.encode()),
                 RawItem(None, "s.tar:k7", "tar", members={"json": line.encode()}, key="k7")):
        with pytest.raises(BadSample) as exc:
            item_to_conversation(item)
        assert exc.value.reason == "bad_json" and exc.value.where == item.where


def test_the_loader_skips_and_counts_poisoned_records(tmp_path, tok, caplog):
    path, bad_lines = poisoned_corpus(tmp_path / "c.jsonl")
    cfg = DataConfig.from_dict({"sources": [str(path)], "seq_len": 256, "pack_buffer": 4})
    loader = build_loader(cfg, tok, max_epochs=1)
    packs = list(loader)
    assert loader.report()["skipped"] == {"bad_json": 3}
    assert sum(p.num_samples for p in packs) == 12
    logged = " ".join(r.getMessage() for r in caplog.records)
    for n in bad_lines:
        assert f"{path}:{n}" in logged


def test_a_tar_shard_with_poisoned_members_trains_the_rest(tmp_path, tok):
    keys = [(f"k{i}", {"json": json.dumps(qa(f"q{i}", f"a{i}")).encode()}) for i in range(6)]
    keys[1] = ("k1", {"json": DEEP.encode()})
    keys[4] = ("k4", {"json": HUGE_INT.encode()})
    path = write_tar(tmp_path / "s.tar", keys)
    loader = build_loader(DataConfig.from_dict({"sources": [str(path)], "seq_len": 256, "pack_buffer": 4}), tok,
                          max_epochs=1)
    assert sum(p.num_samples for p in loader) == 4
    assert loader.report()["skipped"] == {"bad_json": 2}


def test_data_plan_counts_poisoned_records(tmp_path, tok):
    path, _ = poisoned_corpus(tmp_path / "c.jsonl")
    write_jsonl(tmp_path / "unused.jsonl", [])
    raw = {"phase": {"name": "custom"}, "budget": {"max_tokens": 1000},
           "data": {"sources": [{"name": "c", "path": str(path), "ratio": 1}]}}
    (src,) = plan_recipe(raw, "local", tokenizer=tok)["sources"]
    assert src["skipped"] == {"bad_json": 3} and src["tokens_per_sample"] > 0
