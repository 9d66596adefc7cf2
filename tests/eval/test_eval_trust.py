"""Threat model, items 3 and 5 for benchmarks: an image cell naming a path (an HF Image stored by path) is read
only when it is a regular file inside the benchmark's folder and under the image byte limit; `/dev/zero`, a FIFO,
`../secret` or a symlink out of the folder is a counted `missing_image` skip, read without waiting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mindvl.data.schema import BadSample
from mindvl.eval.benchmarks import _struct_bytes


@pytest.mark.parametrize("name", ["/dev/zero", "fifo.png", "../secret.txt", "link.png"])
def test_image_paths_outside_or_not_regular_are_skipped(tmp_path, name):
    folder = tmp_path / "bench"
    folder.mkdir()
    (tmp_path / "secret.txt").write_text("SECRET")
    os.mkfifo(folder / "fifo.png")
    os.symlink(tmp_path / "secret.txt", folder / "link.png")
    with pytest.raises(BadSample) as exc:
        _struct_bytes({"bytes": None, "path": name}, folder, "b.parquet:row 3")
    assert exc.value.reason == "missing_image" and exc.value.where == "b.parquet:row 3"


def test_an_image_path_inside_the_folder_is_read(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG not really")
    assert _struct_bytes({"bytes": None, "path": "a.png"}, Path(tmp_path), "w") == b"\x89PNG not really"
