"""Print the "bad input -> message -> exit code" rows of `benchmarks/RESULTS.md` ("Checkpoint trust (a1)") by
running each case through the CLI in this process (tiny recipe of tests/train, a few minutes on a laptop CPU).

    python benchmarks/checkpoint_trust_messages.py
"""

from __future__ import annotations

import contextlib
import errno
import io
import pickle
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))
from train_helpers import raw_recipe, write_recipe  # noqa: E402

from mindvl.checkpoint.training import read_latest  # noqa: E402
from mindvl.cli import main as cli  # noqa: E402


class RunsCode:
    def __init__(self, marker: Path):
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self):
        return (exec, (self.code,))


def call(*argv: str) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = cli(list(argv))
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return rc, " / ".join(lines)


def row(case: str, rc: int, message: str, tmp: Path) -> None:
    print(f"| {case} | `{message.replace(str(tmp), '…')}` | {rc} |")


def main() -> None:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        cache = tmp / "cache"

        def recipe(name: str, **sections) -> Path:
            return write_recipe(tmp / f"{name}.yaml", raw_recipe(tmp / name, cache, **sections))

        base = {"budget": {"max_steps": 2}, "checkpoint": {"every": 1, "keep": 5}}
        r = recipe("evil", **base)
        assert call("train", str(r))[0] == 0
        ckpt = read_latest(tmp / "evil" / "checkpoints")
        marker = tmp / "marker"
        (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
        row("`.metadata` whose pickle calls `exec`: `train resume=auto`", *call("train", str(r), "resume=auto"), tmp)
        row("the same: `mindvl export RUN`", *call("export", str(tmp / "evil"), "--out", str(tmp / "x")), tmp)
        row("the same: `mindvl merge RUN RUN`", *call("merge", str(tmp / "evil"), str(tmp / "evil"), "--out",
                                                      str(tmp / "m")), tmp)
        assert not marker.exists()

        r = recipe("trunc", **{**base, "budget": {"max_steps": 3}})
        assert call("train", str(r))[0] == 0
        newest = read_latest(tmp / "trunc" / "checkpoints")
        shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[:1000])
        row("truncated shard of the newest checkpoint: `mindvl export step_N`",
            *call("export", str(newest), "--out", str(tmp / "y")), tmp)
        row("the same: `train resume=auto` (falls back, trains on)", *call("train", str(r), "resume=auto"), tmp)
        (tmp / "trunc" / "checkpoints" / "latest").write_text("{oops")
        row("damaged `checkpoints/latest`", *call("export", str(tmp / "trunc"), "--out", str(tmp / "z")), tmp)

        from torch.distributed.checkpoint.filesystem import FileSystem

        real = FileSystem.create_stream

        def full(self, path, mode):
            if "step_00000002" in str(path) and "w" in mode:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(self, path, mode)

        FileSystem.create_stream = full
        try:
            row("disk full while writing a checkpoint (ENOSPC from the DCP writer)",
                *call("train", str(recipe("full", **base))), tmp)
        finally:
            FileSystem.create_stream = real

        r = recipe("wild", **{**base, "budget": {"max_steps": 6}, "optim": {"lr": 1e30, "max_bad_steps": 2}})
        row("`lr=1e30`: too many bad steps, no verified checkpoint", *call("train", str(r)), tmp)
        row("then `resume=auto`", *call("train", str(r), "resume=auto"), tmp)
        r = recipe("sane", **{**base, "optim": {"max_bad_steps": 2}})
        assert call("train", str(r))[0] == 0
        row("`resume=auto lr=1e30` (another LR than the checkpoint's)", *call("train", str(r), "resume=auto",
                                                                             "lr=1e30"), tmp)
        row("`resume=auto lr=1e30 schedule.allow_change=true max_steps=6`: the streak's stop",
            *call("train", str(r), "resume=auto", "lr=1e30", "schedule.allow_change=true", "max_steps=6"), tmp)
        row("`optim.loss_spike_factor=0.5`", *call("train", str(r), "optim.loss_spike_factor=0.5"), tmp)


if __name__ == "__main__":
    main()
