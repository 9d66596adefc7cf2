"""The whole pipeline: exact resume (ranks x workers), mixtures, synthetic sources, config validation."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from data_helpers import qa, write_jsonl

from mindvl.data import DataConfig, build_loader
from mindvl.data.loader import PackLoader
from mindvl.data.mixture import Mixture


def config(synth_dir, **kw) -> DataConfig:
    d = {"sources": [{"path": str(synth_dir / "data.jsonl")}], "seq_len": 1024, "pack_buffer": 8}
    d.update(kw)
    return DataConfig.from_dict(d)


def take(loader, n):
    return [p.arrays() for p in itertools.islice(loader, n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers,world,rank,stop", [(0, 1, 0, 5), (0, 3, 2, 4), (2, 2, 1, 3), (3, 1, 0, 7)])
def test_resume_is_bit_exact(synth_dir, tok, workers, world, rank, stop):
    """Stop after `stop` packs, save the state as JSON, resume in a new loader: the packs equal an uninterrupted
    run's (runs past an epoch boundary, so the reshuffle and the packer buffer are both restored)."""
    cfg = config(synth_dir, num_workers=workers)
    total = stop + 14
    reference = take(build_loader(cfg, tok, rank, world), total)
    first = build_loader(cfg, tok, rank, world)
    head = take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    assert len(json.dumps(state)) < 20_000  # small: refs, not samples
    resumed = build_loader(cfg, tok, rank, world)
    resumed.load_state_dict(state)
    tail = take(resumed, total - stop)
    assert same(reference, head + tail)
    assert not same(reference[stop:], reference[:total - stop])  # the check can fail: packs differ


def test_one_epoch_no_sample_twice_across_ranks_and_workers(tmp_path, tok):
    """World 2 x 2 workers, one epoch over 3 unequal files: every record exactly once in the union of all packs."""
    expected = []
    for f, n in enumerate((23, 5, 41)):
        expected += [f"rec{f}-{i}" for i in range(n)]
        write_jsonl(tmp_path / f"part{f}.jsonl", [qa(f"rec{f}-{i}", "x") for i in range(n)])
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "part*.jsonl")}], "seq_len": 256,
                                "pack_buffer": 4, "num_workers": 2})
    seen = []
    for rank in range(2):
        for pack in build_loader(cfg, tok, rank, 2, max_epochs=1):
            text = tok.decode(np.asarray(pack.input_ids).tolist())
            seen += [part.split("<|im_end|>")[0] for part in text.split("<|im_start|>user\n")[1:]]
    assert sorted(seen) == sorted(expected)


def test_pack_contract(synth_dir, tok):
    pack = next(iter(build_loader(config(synth_dir), tok)))
    a = pack.arrays()
    t = a["input_ids"].shape[0]
    assert a["cu_seqlens"][0] == 0 and a["cu_seqlens"][-1] == t and a["cu_seqlens"].dtype == np.int32
    assert a["position_ids"].shape == (3, t)
    assert a["pixel_values"].shape[0] == int(a["image_grid_thw"].prod(-1).sum())
    assert (a["input_ids"] == tok.special.image_pad).sum() == int(a["image_grid_thw"].prod(-1).sum()) // 4
    for j in range(len(a["cu_seqlens"]) - 1):
        s = a["cu_seqlens"][j]
        assert a["position_ids"][:, s].tolist() == [0, 0, 0]  # restart per sample
        assert a["input_ids"][s] == tok.special.im_start and a["labels"][s] == -100


def test_mixture_ratios_and_consumption(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [qa(f"a{i}", "x") for i in range(200)])
    b = write_jsonl(tmp_path / "b.jsonl", [qa(f"b{i}", "y") for i in range(200)])
    cfg = DataConfig.from_dict({"sources": [{"path": str(a), "ratio": 3}, {"path": str(b), "ratio": 1}],
                                "seq_len": 512, "pack_buffer": 16})
    loader = build_loader(cfg, tok)
    counts = [0, 0]
    for pack in itertools.islice(loader, 60):
        for s in pack.sample_sources:
            counts[s] += 1
    report = loader.report()
    assert report["consumed"]["a"]["samples"] == counts[0] and report["consumed"]["b"]["samples"] == counts[1]
    assert report["consumed"]["a"]["tokens"] > 0 and report["skipped"] == {}
    assert 0.68 < counts[0] / sum(counts) < 0.82
    m = Mixture([3, 1], seed=0, slot=0)
    picks = [m.choose([True, True]) for _ in range(20000)]
    assert abs(picks.count(0) / len(picks) - 0.75) < 0.01
    m2 = Mixture([3, 1], seed=0, slot=0)
    m2.load_state_dict({"draws": 100})
    assert [m2.choose([True, True]) for _ in range(50)] == picks[100:150]
    assert Mixture([3, 1], seed=1, slot=0).choose([True, True]) is not None
    assert m.choose([False, True]) == 1 and m.choose([False, False]) is None


def test_synth_source_in_config_is_generated_once(tmp_path, tok):
    cfg = DataConfig.from_dict({"sources": [{"synth": {"tasks": ["ocr", "chart"], "n": 12, "seed": 5}}],
                                "seq_len": 2048, "pack_buffer": 4, "synth_cache": str(tmp_path / "cache")})
    packs = list(build_loader(cfg, tok, max_epochs=1))
    assert sum(p.num_samples for p in packs) == 12
    (made,) = list((tmp_path / "cache").iterdir())
    stamp = (made / "data.jsonl").stat().st_mtime_ns
    list(build_loader(cfg, tok, max_epochs=1))
    assert (made / "data.jsonl").stat().st_mtime_ns == stamp  # cached, not regenerated


def test_state_mismatch_is_a_clear_error(synth_dir, tok):
    loader = build_loader(config(synth_dir), tok, 0, 2)
    take(loader, 1)
    other = build_loader(config(synth_dir), tok, 1, 2)
    with pytest.raises(ValueError, match="rank=0 but this loader has rank=1"):
        other.load_state_dict(loader.state_dict())
    with_workers = build_loader(config(synth_dir, num_workers=2), tok, 0, 2)
    with pytest.raises(ValueError, match="num_streams"):
        with_workers.load_state_dict(loader.state_dict())


@pytest.mark.parametrize("bad,message", [
    ({"sources": []}, "data.sources: must be a non-empty list"),
    ({"sources": ["x.jsonl"], "seq_lenn": 5}, "data.seq_lenn: unknown key"),
    ({"sources": [{"path": "x.jsonl", "ratio": 0}]}, r"data.sources\[0\].ratio: must be > 0"),
    ({"sources": [{"path": "x.jsonl", "colour": 1}]}, r"data.sources\[0\].colour: unknown key"),
    ({"sources": [{"synth": {"tasks": ["maps"]}}]}, r"data.sources\[0\].synth.tasks: unknown task 'maps'"),
    ({"sources": ["x.jsonl"], "seq_len": "long"}, "data.seq_len: expected an integer"),
    ({"sources": ["x.jsonl"], "truncation": "cut"}, "data.truncation: must be truncate or drop"),
    ({"sources": [{"path": "x.jsonl", "min_pixels": 10**7}]}, r"data.sources\[0\]: min_pixels"),
    ({"sources": [{"path": "x.jsonl", "synth": {"n": 3}}]}, "exactly one of"),
])
def test_config_errors_name_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict(bad)


def test_per_source_pixels(tmp_path, synth_dir, tok):
    cfg = DataConfig.from_dict({"sources": [{"path": str(synth_dir / "data.jsonl"), "max_pixels": 28 * 28 * 16}],
                                "seq_len": 2048, "pack_buffer": 4})
    assert cfg.pixels_for(0) == (56 * 56, 28 * 28 * 16)
    for pack in itertools.islice(build_loader(cfg, tok), 3):
        assert (np.asarray(pack.image_grid_thw).prod(-1) <= 64).all()


def test_pack_pixels_bit_exact_through_worker_processes(tmp_path, tok):
    """End to end through a DataLoader worker (shared-memory pixel rows): the pack's pixel_values and grids equal
    transformers' PIL processor run on the same images in order of appearance (the `pil` resize, the bit-exact
    reference; the default `torch` resize is checked in test_data_image_fast.py)."""
    hf_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from data_helpers import png_bytes
    from PIL import Image

    sizes = [(100, 60), (33, 290), (400, 500)]
    for i, (h, w) in enumerate(sizes):
        (tmp_path / f"{i}.png").write_bytes(png_bytes(h, w, seed=i))
    recs = [qa("<image>a", "x", images=["0.png"]), qa("two <image> and <image>", "y", images=["1.png", "2.png"])]
    cfg = DataConfig.from_dict({"sources": [str(write_jsonl(tmp_path / "d.jsonl", recs))], "seq_len": 4096,
                                "pack_buffer": 2, "num_workers": 1, "image_resize": "pil"})
    (pack,) = list(build_loader(cfg, tok, max_epochs=1))
    proc = hf_module.Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    ref = proc(images=[Image.open(tmp_path / f"{i}.png") for i in range(3)], return_tensors="np")
    assert np.array_equal(np.asarray(pack.pixel_values), ref["pixel_values"])
    assert np.array_equal(np.asarray(pack.image_grid_thw), ref["image_grid_thw"])
    n_pads = int((np.asarray(pack.input_ids) == tok.special.image_pad).sum())
    assert n_pads == int(ref["image_grid_thw"].prod(-1).sum()) // 4


# ------------------------------------------------------------------------------------------------- elastic resume


def _id_corpus(tmp_path, tok):
    """Two sources (one of two files) whose every record carries a unique id in its answer."""
    from data_helpers import qa, write_jsonl

    a1 = write_jsonl(tmp_path / "a1.jsonl", [qa(f"question {i}", f"id a{i} end") for i in range(23)])
    a2 = write_jsonl(tmp_path / "a2.jsonl", [qa(f"question {i}", f"id a{i} end") for i in range(23, 40)])
    b = write_jsonl(tmp_path / "b.jsonl", [qa(f"question {i}", f"id b{i} end") for i in range(29)])
    ids = {f"a{i}" for i in range(40)} | {f"b{i}" for i in range(29)}
    cfg = DataConfig.from_dict({"sources": [{"paths": [str(a1), str(a2)], "ratio": 0.6}, {"paths": [str(b)]}],
                                "seq_len": 96, "pack_buffer": 4, "default_system": None, "seed": 3})
    return cfg, ids


def _pack_ids(tok, pack) -> list[str]:
    import re

    return re.findall(r"id ([ab]\d+) end", tok.decode(np.asarray(pack.input_ids).tolist()))


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (2, 3)])
def test_elastic_resume_reads_every_record_once_per_epoch(tmp_path, tok, old_world, new_world):
    """Stop part-way with one number of data shards, continue with another: over the epoch, every record is
    consumed exactly once (packs decoded; the ids are in the text)."""
    import collections
    import itertools

    from mindvl.data.elastic import reshard_loader_states

    cfg, ids = _id_corpus(tmp_path, tok)
    seen = []
    old = [PackLoader(cfg, tok, r, old_world, max_epochs=1) for r in range(old_world)]
    for r, ld in enumerate(old):
        for pack in itertools.islice(ld, 2 + r):  # shards stop at different points
            seen += _pack_ids(tok, pack)
    states = reshard_loader_states([ld.state_dict() for ld in old], cfg, old[0].files, new_world, max_epochs=1)
    new = []
    for r, state in enumerate(states):
        ld = PackLoader(cfg, tok, r, new_world, max_epochs=1)
        ld.load_state_dict(state)
        for pack in ld:
            seen += _pack_ids(tok, pack)
        new.append(ld)
    counts = collections.Counter(seen)
    assert set(counts) == ids and set(counts.values()) == {1}
    # The data report (consumed samples, carried over from the old shards) counts the same: none lost or repeated.
    assert sum(row["samples"] for ld in new for row in ld.report()["consumed"].values()) == len(ids)


def _even_corpus(tmp_path, tok, n=275, kind="jsonl", pack_buffer=1):
    """One file of `n` records of equal size, one record per pack (pack_buffer 1: packs come in reading order;
    larger: in the same order too, ties go to the first arrival)."""
    from data_helpers import qa, write_jsonl, write_tar

    recs = [qa(f"question {i:03d}", f"id r{i:03d} end") for i in range(n)]
    if kind == "tar":
        path = write_tar(tmp_path / "c.tar", [(f"k{i:03d}", {"json": json.dumps(r).encode()})
                                              for i, r in enumerate(recs)])
    else:
        path = write_jsonl(tmp_path / "c.jsonl", recs)
    cfg = DataConfig.from_dict({"sources": [str(path)], "seq_len": 40, "pack_buffer": pack_buffer,
                                "default_system": None})
    return cfg, {f"r{i:03d}" for i in range(n)}


def _record_ids(tok, pack) -> list[str]:
    import re

    return re.findall(r"id (r\d+) end", tok.decode(np.asarray(pack.input_ids).tolist()))


def _lockstep(iters, steps, tok) -> list[str]:
    """`steps` training steps: one pack from every rank per step."""
    out = []
    for _ in range(steps):
        for it in iters:
            out += _record_ids(tok, next(it))
    return out


def _elastic(cfg, tok, layouts, max_epochs=None):
    """Read `steps` lockstep steps on each (world, steps) layout in turn, resharding between them; the ids read and
    the last layout's loaders."""
    from mindvl.data.elastic import reshard_loader_states

    seen, loaders, states = [], None, None
    for world, steps in layouts:
        new = [PackLoader(cfg, tok, r, world, max_epochs=max_epochs) for r in range(world)]
        if loaders is not None:
            states = reshard_loader_states([ld.state_dict() for ld in loaders], cfg, loaders[0].files, world,
                                           max_epochs=max_epochs)
            for ld, state in zip(new, states, strict=True):
                ld.load_state_dict(state)
        loaders = new
        seen += _lockstep([iter(ld) for ld in loaders], steps, tok)
    return seen, loaders


@pytest.mark.parametrize("kind,old_world,new_world,stop", [("jsonl", 1, 2, 60), ("jsonl", 2, 3, 37),
                                                           ("jsonl", 3, 2, 20), ("tar", 1, 2, 60)])
def test_elastic_resume_trains_every_record_in_the_epochs_steps(tmp_path, tok, kind, old_world, new_world, stop):
    """The issue's case (275 records, one file): stop mid-epoch on one number of data shards, continue on another.
    At the fewest steps in which the new layout can finish the epoch (the rest over the new ranks), every record
    has been trained, as in an uninterrupted run on as many records (before: on 1 -> 2 rank 1 began the next epoch
    at once while rank 0 read the whole rest: 161 of 275 distinct)."""
    import math

    cfg, ids = _even_corpus(tmp_path, tok, kind=kind)
    rest = len(ids) - stop * old_world
    steps = math.ceil(rest / new_world)
    seen, _ = _elastic(cfg, tok, [(old_world, stop), (new_world, steps)])
    assert len(seen) == stop * old_world + steps * new_world < len(ids) + new_world
    reference = _lockstep([iter(PackLoader(cfg, tok, r, new_world)) for r in range(new_world)],
                          math.ceil(len(ids) / new_world), tok)  # uninterrupted, the same records' worth
    assert set(reference) == ids
    assert set(seen) == ids


@pytest.mark.parametrize("layouts", [[(1, 60), (2, 0)], [(2, 37), (3, 0)], [(1, 30), (2, 40), (3, 0)]])
def test_elastic_one_epoch_budget_each_record_once_dealt_evenly(tmp_path, tok, layouts):
    """With a one-epoch budget the new ranks read the rest of the epoch once between them, in shares that differ by
    at most one record (equal records; the last layout follows an earlier elastic resume in the 1 -> 2 -> 3 case,
    so pieces already cut into byte ranges are cut again)."""
    import collections

    cfg, ids = _even_corpus(tmp_path, tok)
    seen, loaders = _elastic(cfg, tok, layouts, max_epochs=1)
    shares = []
    for ld in loaders:
        share = [i for pack in ld for i in _record_ids(tok, pack)]
        shares.append(len(share))
        seen += share
    counts = collections.Counter(seen)
    assert set(counts) == ids and set(counts.values()) == {1}
    assert max(shares) - min(shares) <= 1, shares


@pytest.mark.parametrize("kind,pack_buffer", [("jsonl", 1), ("jsonl", 8), ("tar", 8)])
def test_two_elastic_resumes_in_one_epoch_train_every_record_once(tmp_path, tok, kind, pack_buffer):
    """1 -> 2 -> 3 ranks inside one epoch, 275 records in 60 + 40 + 45 steps (275 packs): every record once. After
    the first resume the slots already count the next epoch, so the second one carries the rest of this epoch and the
    whole next one: every new slot must read its share of the old epoch first (and buffered records are dealt too)."""
    import collections

    cfg, ids = _even_corpus(tmp_path, tok, kind=kind, pack_buffer=pack_buffer)
    seen, _ = _elastic(cfg, tok, [(1, 60), (2, 40), (3, 45)])
    counts = collections.Counter(seen)
    assert len(seen) == len(ids) and set(counts) == ids and set(counts.values()) == {1}


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_elastic_resume_onto_more_loader_workers_reads_every_record_once(tmp_path, tok):
    """1 rank, no workers -> 1 rank, 2 worker processes (the carried byte ranges travel to the workers in the state):
    with a one-epoch budget every record is read once, and the two streams' shares differ by at most one record
    (each stream's consumed count; stream 0's also holds the 75 carried over from the old stream)."""
    import collections
    import dataclasses

    from mindvl.data.elastic import reshard_loader_states

    cfg, ids = _even_corpus(tmp_path, tok)
    old = PackLoader(cfg, tok, 0, 1, max_epochs=1)
    seen = [i for pack in itertools.islice(old, 75) for i in _record_ids(tok, pack)]
    cfg2 = dataclasses.replace(cfg, num_workers=2)
    (state,) = reshard_loader_states([old.state_dict()], cfg2, old.files, 1, max_epochs=1)
    new = PackLoader(cfg2, tok, 0, 1, max_epochs=1)
    new.load_state_dict(state)
    seen += [i for pack in new for i in _record_ids(tok, pack)]
    counts = collections.Counter(seen)
    assert set(counts) == ids and set(counts.values()) == {1}
    (name,) = [s.name for s in cfg.sources]
    s0, s1 = (stream["consumed"][name]["samples"] for stream in new.state_dict()["streams"])
    assert s0 - 75 + s1 == len(ids) - 75 and abs((s0 - 75) - s1) <= 1, (s0, s1)


# ---------------------------------------------------------------------------------------------- a fresh N-rank start


def _three_unequal_files(tmp_path, kind="jsonl", counts=(97, 143, 66), pack_buffer=1):
    """Three files of 97 / 143 / 66 equal-size records (ids r000..r305; one record per pack at seq_len 40)."""
    from data_helpers import qa, write_jsonl, write_tar

    paths, n = [], 0
    for f, count in enumerate(counts):
        recs = [qa(f"question {n + i:03d}", f"id r{n + i:03d} end") for i in range(count)]
        if kind == "tar":
            paths.append(str(write_tar(tmp_path / f"p{f}.tar", [(f"k{n + i:03d}", {"json": json.dumps(r).encode()})
                                                                 for i, r in enumerate(recs)])))
        else:
            paths.append(str(write_jsonl(tmp_path / f"p{f}.jsonl", recs)))
        n += count
    cfg = DataConfig.from_dict({"sources": [{"paths": paths}], "seq_len": 40, "pack_buffer": pack_buffer,
                                "default_system": None})
    return cfg, {f"r{i:03d}" for i in range(n)}


@pytest.mark.parametrize("kind,world", [("jsonl", 2), ("jsonl", 3), ("tar", 2), ("tar", 3)])
def test_fresh_run_of_one_epochs_steps_trains_every_record_once(tmp_path, tok, kind, world):
    """A fresh run on `world` ranks (each rank's loader, as the trainer builds it), in the steps of one epoch
    (306 records, one per pack, so 306 / world steps): every record exactly once (the ids decoded from the packs).
    Before the byte-stretch deal, whole files went to ranks: 2 ranks trained 250 distinct records (56 twice)."""
    import collections
    import math

    cfg, ids = _three_unequal_files(tmp_path, kind)
    steps = math.ceil(len(ids) / world)
    seen = _lockstep([iter(PackLoader(cfg, tok, r, world)) for r in range(world)], steps, tok)
    counts = collections.Counter(seen)
    assert len(seen) == len(ids) and set(counts) == ids and set(counts.values()) == {1}


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_fresh_run_with_loader_workers_reads_even_shares_once(tmp_path, tok):
    """2 ranks x 2 worker processes, a one-epoch budget, packs of several records (pack_buffer 8): every record once,
    and the four reading slots' shares (records of equal size) differ by at most one."""
    import collections
    import dataclasses

    cfg, ids = _three_unequal_files(tmp_path, pack_buffer=8)
    cfg = dataclasses.replace(cfg, num_workers=2)
    seen, shares = [], []
    for rank in range(2):
        ld = PackLoader(cfg, tok, rank, 2, max_epochs=1)
        seen += [i for pack in ld for i in _record_ids(tok, pack)]
        (name,) = [s.name for s in cfg.sources]
        shares += [stream["consumed"][name]["samples"] for stream in ld.state_dict()["streams"]]
    counts = collections.Counter(seen)
    assert set(counts) == ids and set(counts.values()) == {1}
    assert sum(shares) == len(ids) and max(shares) - min(shares) <= 1, shares


def test_a_state_of_the_whole_file_deal_continues_through_the_elastic_path(tmp_path, tok):
    """A checkpoint written before the byte-stretch deal (stream state version 1, whole files dealt round-robin) is
    refused as is, and continues exactly through reshard_loader_states on the same layout: the whole epoch once."""
    import collections
    import re

    from mindvl.data.elastic import reshard_loader_states
    from mindvl.data.sources import legacy_slot_units

    cfg, ids = _three_unequal_files(tmp_path)
    files = PackLoader(cfg, tok, 0, 2).files
    # What a version-1 run read in 30 steps on 2 ranks: its first 30 records of its first legacy unit(s).
    old_states, seen = [], []
    for rank in range(2):
        (unit, *_) = legacy_slot_units(3, 2, rank, cfg.seed, 0, 0)
        path = files[0][unit.file][0]
        lines = open(path, "rb").read().splitlines(keepends=True)
        offset = sum(len(x) for x in lines[:30])
        seen += [i for x in lines[:30] for i in re.findall(r"id (r\d+) end", x.decode())]
        state = PackLoader(cfg, tok, rank, 2).state_dict()
        state["streams"] = [{"version": 1, "slot": [rank, 2],
                             "readers": [{"epoch": 0, "unit": 0, "offset": offset, "line": 31}],
                             "mixture": {"draws": 30}, "packer": {"packs_made": 30, "order": 30, "buffer": []},
                             "skipped": {}, "consumed": {}, "truncated": 0, "exhausted": [False],
                             "epoch_valid": [[0, 30, 0, 0]]}]
        old_states.append(state)
    as_is = PackLoader(cfg, tok, 0, 2)
    as_is.load_state_dict(old_states[0])
    with pytest.raises(ValueError, match="version 1 deals whole files"):
        next(iter(as_is))
    new = reshard_loader_states(old_states, cfg, files, 2, max_epochs=1)
    for rank, state in enumerate(new):
        ld = PackLoader(cfg, tok, rank, 2, max_epochs=1)
        ld.load_state_dict(state)
        seen += [i for pack in ld for i in _record_ids(tok, pack)]
    counts = collections.Counter(seen)
    assert set(counts) == ids and set(counts.values()) == {1}
