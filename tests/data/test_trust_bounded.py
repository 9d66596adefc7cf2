"""Threat model, items 3 and 5 for data: every reader of a received file is bounded and stays inside its folder.
A 10 KiB tar holding a sparse 8 GiB `.jpg` member, records and benchmark rows whose image is `/dev/zero`, a FIFO
or `../` outside the data folder, and a trace `.npz` that is a compression bomb or declares 2^45 elements: each is
a counted skip (or, for a trace, a ValueError naming the file), read without waiting or allocating."""

from __future__ import annotations

import io
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from data_helpers import png_bytes, qa, write_jsonl

from mindvl.data import DataConfig, build_loader
from mindvl.data.plan import plan_recipe
from mindvl.untrusted import UntrustedInputError, check_npz, read_regular

GIB = 1 << 30


def sparse_tar(folder: Path, good: int = 3) -> Path:
    """`s.tar`: keys k0..k{good-1} (a PNG and a question each) and `kbig`, whose .jpg member is a sparse 8 GiB file
    (GNU tar -S: the shard itself is a few KiB)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(good):
        (folder / f"k{i}.png").write_bytes(png_bytes(28, 28, seed=i))
        (folder / f"k{i}.json").write_text(json.dumps(qa("<image>What?", f"Noise {i}.")))
        names += [f"k{i}.png", f"k{i}.json"]
    with open(folder / "kbig.jpg", "wb") as f:
        f.truncate(8 * GIB)
    (folder / "kbig.json").write_text(json.dumps(qa("<image>What?", "Big.")))
    names[2:2] = ["kbig.jpg", "kbig.json"]
    subprocess.run(["tar", "-S", "-cf", "s.tar", *names], cwd=folder, check=True, timeout=60)
    (folder / "kbig.jpg").unlink()
    return folder / "s.tar"


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write a sparse member")
def test_a_sparse_image_member_is_skipped_unread_in_bounded_memory(tmp_path):
    """The loader in a child under a 3 GiB address-space limit (reading the member would need 8 GiB): the sparse
    member is an `image_too_large` skip and the other keys train."""
    shard = sparse_tar(tmp_path / "d")
    assert shard.stat().st_size < 64 << 10
    code = ("import json, sys; from mindvl.data import DataConfig, build_loader; "
            "from mindvl.data.tokenizer import load_tokenizer; "
            "cfg = DataConfig.from_dict({'sources': [sys.argv[1]], 'seq_len': 512, 'pack_buffer': 2, "
            "'min_pixels': 784, 'max_pixels': 784}); "
            "loader = build_loader(cfg, load_tokenizer(), max_epochs=1); "
            "n = sum(p.num_samples for p in loader); print(json.dumps([n, loader.report()['skipped']]))")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 * GIB, 3 * GIB))

    proc = subprocess.run([sys.executable, "-c", code, str(shard)], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n, skipped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert n == 3 and skipped == {"image_too_large": 1}


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write a sparse member")
def test_data_plan_skips_the_sparse_member(tmp_path, tok):
    shard = sparse_tar(tmp_path / "d")
    raw = {"phase": {"name": "custom"}, "budget": {"max_tokens": 1000},
           "data": {"sources": [{"name": "s", "path": str(shard), "ratio": 1}], "min_pixels": 784,
                    "max_pixels": 784}}
    (src,) = plan_recipe(raw, "local", tokenizer=tok)["sources"]
    assert src["skipped"] == {"image_too_large": 1} and src["tokens_per_sample"] > 0


def special_images(folder: Path) -> dict[str, str]:
    """Image names a received record may give: a device, a FIFO, a file outside the data folder, a symlink."""
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "fifo.png")
    (folder.parent / "secret.txt").write_text("password")
    return {"device": "/dev/zero", "fifo": "fifo.png", "outside": "../secret.txt"}


@pytest.mark.parametrize("kind", ["device", "fifo", "outside"])
def test_a_record_naming_a_device_fifo_or_outside_file_is_a_counted_skip(tmp_path, tok, kind):
    d = tmp_path / "data"
    name = special_images(d)[kind]
    (d / "ok.png").write_bytes(png_bytes(28, 28))
    recs = [qa("<image>What?", f"A{i}.", images=["ok.png"]) for i in range(4)]
    recs[1] = qa("<image>What?", "Bad.", images=[name])
    path = write_jsonl(d / "c.jsonl", recs)
    cfg = DataConfig.from_dict({"sources": [str(path)], "seq_len": 512, "pack_buffer": 2, "min_pixels": 784,
                                "max_pixels": 784})
    loader = build_loader(cfg, tok, max_epochs=1)
    assert sum(p.num_samples for p in loader) == 3
    expected = {"outside": "image_outside", "device": "image_absolute"}.get(kind, "missing_image")
    assert loader.report()["skipped"] == {expected: 1}
    if kind == "device":  # a source that trusts absolute paths still reads only regular files
        cfg.sources[0].absolute_paths = True
        loader = build_loader(cfg, tok, max_epochs=1)
        assert sum(p.num_samples for p in loader) == 3
        assert loader.report()["skipped"] == {"missing_image": 1}


def test_a_symlink_out_of_the_records_folder_is_a_counted_skip(tmp_path, tok, caplog):
    """`img.png -> ../elsewhere/img.png` inside a received records folder is refused as `image_outside` (counted and
    logged with its file:line), as curate refuses it; `in.png -> sub/real.png`, which stays inside, is read; a
    source with `absolute_paths: true` is trusted to link out."""
    d, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    (d / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "img.png").write_bytes(png_bytes(28, 28, seed=1))
    (d / "sub" / "real.png").write_bytes(png_bytes(28, 28, seed=2))
    (d / "img.png").symlink_to(elsewhere / "img.png")
    (d / "in.png").symlink_to(Path("sub") / "real.png")
    recs = [qa("<image>What?", f"A{i}.", images=["in.png"]) for i in range(4)]
    recs[2] = qa("<image>What?", "Out.", images=["img.png"])
    path = write_jsonl(d / "c.jsonl", recs)
    cfg = DataConfig.from_dict({"sources": [str(path)], "seq_len": 512, "pack_buffer": 2, "min_pixels": 784,
                                "max_pixels": 784})
    with caplog.at_level(logging.WARNING, logger="mindvl.data"):
        loader = build_loader(cfg, tok, max_epochs=1)
        assert sum(p.num_samples for p in loader) == 3
    assert loader.report()["skipped"] == {"image_outside": 1}
    assert any("image_outside" in r.getMessage() and f"{path}:3" in r.getMessage() and "'img.png'" in r.getMessage()
               for r in caplog.records)
    cfg.sources[0].absolute_paths = True
    loader = build_loader(cfg, tok, max_epochs=1)
    assert sum(p.num_samples for p in loader) == 4
    assert loader.report()["skipped"] == {}


def test_the_image_byte_limit_is_a_setting(tmp_path, tok):
    (tmp_path / "big.png").write_bytes(png_bytes(64, 64, seed=3))  # ~12 kB of noise
    (tmp_path / "small.png").write_bytes(png_bytes(16, 16, seed=3))  # under 1 kB
    assert (tmp_path / "small.png").stat().st_size < 2000 < (tmp_path / "big.png").stat().st_size
    path = write_jsonl(tmp_path / "c.jsonl", [qa("<image>What?", "A.", images=[n]) for n in ("big.png", "small.png")])
    base = {"sources": [str(path)], "seq_len": 512, "pack_buffer": 2, "min_pixels": 784, "max_pixels": 784}
    loader = build_loader(DataConfig.from_dict({**base, "max_image_bytes": 2000}), tok, max_epochs=1)
    assert sum(p.num_samples for p in loader) == 1 and loader.report()["skipped"] == {"image_too_large": 1}
    loader = build_loader(DataConfig.from_dict(base), tok, max_epochs=1)
    assert sum(p.num_samples for p in loader) == 2
    with pytest.raises(ValueError, match="data.max_image_bytes"):
        DataConfig.from_dict({**base, "max_image_bytes": 0})


def test_read_regular_refuses_fifos_devices_and_oversized_files(tmp_path):
    os.mkfifo(tmp_path / "f")
    with pytest.raises(UntrustedInputError, match="a FIFO"):
        read_regular(tmp_path / "f", 100)  # returns at once: opened non-blocking, refused by fstat
    with pytest.raises(UntrustedInputError, match="a character device"):
        read_regular("/dev/zero", 100)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(UntrustedInputError, match="101 bytes, over the limit of 100"):
        read_regular(tmp_path / "big", 100)
    assert read_regular(tmp_path / "big", 101) == b"x" * 101


def _npy(shape, dtype="<f4", data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


def test_npz_bombs_and_lying_headers_are_refused_before_numpy_allocates(tmp_path):
    from mindvl.moe_analysis.trace_io import load_trace

    bomb = tmp_path / "bomb.npz"  # a bzip2 member: 64 MiB of zeros in a few hundred bytes (6 GiB in the issue)
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_BZIP2) as zf:
        zf.writestr("topk_ids.npy", _npy((16 << 20,), "<i4", bytes(64 << 20)))
    assert bomb.stat().st_size < 10_000
    with pytest.raises(ValueError, match=f"{bomb}: .*compression method 12"):
        load_trace(bomb)
    liar = tmp_path / "liar.npz"  # a header declaring 2^45 elements, holding none
    with zipfile.ZipFile(liar, "w") as zf:
        zf.writestr("topk_ids.npy", _npy((2**45,), "<i2"))
    with pytest.raises(ValueError, match=f"{liar}: member topk_ids.npy declares shape \\(35184372088832,\\)"):
        load_trace(liar)
    ok = tmp_path / "ok.npz"
    np.savez_compressed(ok, a=np.arange(10), b=np.zeros((3, 4)))
    check_npz(ok)
    with pytest.raises(UntrustedInputError, match="over the limit of 100"):
        check_npz(ok, max_bytes=100)
