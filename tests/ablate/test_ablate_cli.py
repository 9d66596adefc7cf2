"""`mindvl ablate` input errors are one line, before any work; the plan trains each shared stage once."""

from __future__ import annotations

import pytest

from mindvl.ablate.plan import ABLATIONS, MERGES, RUN_ORDER, STAGES, TOWER, labels_for, parse_ablations, stages_for
from mindvl.cli import main


def test_unknown_ablation_is_one_line(tmp_path, capsys):
    assert main(["ablate", "merg", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown ablation merg" in err and "lm-merge" in err
    assert not (tmp_path / "a").exists()


def test_one_seed_needs_no_verdict(tmp_path, capsys):
    assert main(["ablate", "all", "--seeds", "1", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "at least 2 seeds" in err and "--no-verdict" in err
    assert not (tmp_path / "a").exists()
    assert main(["ablate", "merge", "--scale", "huge", "--out", str(tmp_path / "a")]) == 2
    assert "--scale 'huge'" in capsys.readouterr().err


def test_parse_and_plan():
    assert parse_ablations("all") == list(ABLATIONS) == parse_ablations("lm-merge,merge,resolution,phases")
    assert parse_ablations("phases, merge") == ["merge", "phases"]
    with pytest.raises(ValueError, match="unknown ablation"):
        parse_ablations("")
    assert sorted(RUN_ORDER) == sorted(ABLATIONS)
    # The merge claim needs the main chain only; every stage's parent comes before it.
    assert stages_for(labels_for(["merge"])) == ["text", "warmup", "multitask", "sft-512", "sft-1024", "sft-2048"]
    order = stages_for(labels_for(list(ABLATIONS)))
    assert sorted(order) == sorted(STAGES)
    for name in order:
        parent = STAGES[name].parent
        # A parent is trained before its child; a parent that is a merge (`start`) has its trained inputs before.
        if parent is None:
            continue
        before = [i for i in MERGES[parent][1] if i != TOWER] if parent in MERGES else [parent]
        assert before and all(order.index(p) < order.index(name) for p in before), name
    assert stages_for(labels_for(["lm-merge"])) == ["text", "warmup", "multitask", "sft-1024"]
