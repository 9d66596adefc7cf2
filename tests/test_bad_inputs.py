"""Every bad input of tests/bad_inputs.py, given to the real `mindvl` command: exit 2, exactly one line on stderr,
naming the file (and key or tensor). The CLI handler's judgement of wrapped checkpoint errors and bugs is checked
in-process below."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bad_inputs import CASES, run_case
from tiny_mindvl import tiny_model_folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("model") / "m")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, model_folder):
    if case.needs_cpu_only_torch and torch.cuda.is_available():
        pytest.skip("needs a torch without CUDA")
    proc, names = run_case(case, tmp_path, model_folder)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("mindvl ") and ": error: " in lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert not (tmp_path / "PWNED").exists()  # the override's tag was refused, not run


def test_checkpoint_exceptions_are_judged_by_the_rank_error_they_wrap(capsys, monkeypatch):
    """CheckpointException is a BaseException: a wrapped bad-input error is one line, a wrapped bug keeps its
    traceback (the exception propagates), as unwrapped errors do."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    import mindvl.cli.export as export_cli
    from mindvl.cli import main

    def failing(exc: BaseException):
        def run(args):
            try:
                raise exc
            except BaseException as e:  # noqa: BLE001 (wrapped as DCP wraps each rank's error)
                raise CheckpointException("load failed", {1: _wrap_exception(e)}) from None
        return run

    monkeypatch.setattr(export_cli, "run", failing(FileNotFoundError(2, "No such file", "/ck/step_1/.metadata")))
    assert main(["export", "ck", "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 1" in err and "/ck/step_1/.metadata" in err
    monkeypatch.setattr(export_cli, "run", failing(KeyError("model.weight")))  # not bad input: a bug
    with pytest.raises(CheckpointException):
        main(["export", "ck", "--out", "o"])


def test_a_full_disk_is_one_line_naming_the_path(capsys, monkeypatch):
    import errno

    import mindvl.cli.export as export_cli
    from mindvl.cli import main

    def run(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/a/final/model.safetensors")

    monkeypatch.setattr(export_cli, "run", run)
    assert main(["export", "ck", "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device: /runs/a/final/model.safetensors" in err
