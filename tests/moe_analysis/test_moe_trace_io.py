"""RouterTrace container and .npz format: round trip, dtypes, validation and error messages that name the file."""

from __future__ import annotations

import numpy as np
import pytest

from mindvl.moe_analysis import RouterTrace, load_trace, save_trace
from mindvl.moe_analysis.synthetic import synthetic_trace


def test_round_trip_keeps_everything(tmp_path):
    trace = synthetic_trace(3, 20, 4, [7, 1, 12], seed=2)
    trace.topk_scores = np.random.default_rng(0).random(trace.topk_ids.shape).astype(np.float16)
    trace.meta = {"model": "tiny", "family": "deepseek_v3", "corpus": ["a", "b"]}
    path = save_trace(trace, tmp_path / "sub" / "run")  # suffix added, folders created
    assert path.name == "run.npz" and sorted(p.name for p in path.parent.iterdir()) == ["run.npz"]
    back = load_trace(path)
    np.testing.assert_array_equal(back.topk_ids, trace.topk_ids)
    np.testing.assert_array_equal(back.seq_offsets, [0, 7, 8, 20])
    np.testing.assert_array_equal(back.topk_scores, trace.topk_scores)
    assert (back.num_experts, back.layer_names, back.meta) == (20, trace.layer_names, trace.meta)
    assert (back.k, back.num_layers, back.num_sequences, back.num_tokens) == (4, 3, 3, 20)
    assert back.sequence(2).shape == (3, 12, 4) and back.sequence(-2).shape == (3, 1, 4)


@pytest.mark.parametrize("num_experts, dtype", [(127, np.int8), (128, np.int16), (256, np.int16)])
def test_id_dtype_follows_expert_count(num_experts, dtype, tmp_path):
    ids = np.array([[[num_experts - 1, 0]]], np.int64)
    trace = RouterTrace(ids, [0, 1], num_experts, ["l0"])
    assert trace.topk_ids.dtype == dtype
    assert load_trace(save_trace(trace, tmp_path / "t.npz")).topk_ids.dtype == dtype


@pytest.mark.parametrize("kwargs, message", [
    (dict(topk_ids=np.zeros((1, 3, 2), int)), "twice|repeats"),
    (dict(topk_ids=np.full((1, 3, 2), 9)), "lie in"),
    (dict(seq_offsets=[0, 2]), "end at the token count 3"),
    (dict(seq_offsets=[0, 0, 3]), "strictly increasing"),
    (dict(layer_names=["a", "b"]), "layer_names"),
    (dict(topk_scores=np.zeros((1, 3, 3))), "topk_scores"),
    (dict(meta={"x": object()}), "JSON"),
    (dict(num_experts=1), "exceeds"),
])
def test_validation_errors(kwargs, message):
    base = dict(topk_ids=np.array([[[0, 1], [1, 2], [2, 0]]]), seq_offsets=[0, 1, 3], num_experts=4,
                layer_names=["l0"])
    with pytest.raises(ValueError, match=message):
        RouterTrace(**{**base, **kwargs})


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_trace(tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz"):
        load_trace(junk)
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    with pytest.raises(ValueError, match="other.npz.*missing arrays"):
        load_trace(other)
    bad = tmp_path / "bad.npz"
    np.savez(bad, format=np.array(1), topk_ids=np.full((1, 2, 1), 5, np.int8), seq_offsets=np.array([0, 2]),
             num_experts=np.array(4), layer_names=np.array(["l0"]))
    with pytest.raises(ValueError, match="bad.npz.*lie in"):
        load_trace(bad)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    trace = synthetic_trace(1, 4, 1, [3], seed=0)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", boom)
    with pytest.raises(OSError, match="disk full"):
        save_trace(trace, tmp_path / "t.npz")
    assert list(tmp_path.iterdir()) == []
