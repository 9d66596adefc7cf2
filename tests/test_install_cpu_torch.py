"""scripts/install-cpu-torch asks pip only for torch's CPU build (issue 43 item 1): on Linux x86_64 PyPI's
`torch==X` is the CUDA build plus several GB of NVIDIA packages, so the script pins the `+cpu` local version, which
only PyTorch's CPU index (or a wheel folder copied from it) has. A stand-in `python` records what pip is asked."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-cpu-torch"
pytestmark = pytest.mark.skipif(f"{platform.system()}-{platform.machine()}" != "Linux-x86_64",
                                reason="the +cpu pin is the Linux x86_64 branch")


def _run(tmp_path: Path, local_wheel: bool) -> list[str]:
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    # Succeeds for every pip call but the offline one when no local wheel exists.
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
if [[ "$*" == *--no-index* ]]; then exit {0 if local_wheel else 1}; fi
exit 0
""")
    fake.chmod(0o755)
    subprocess.run([str(SCRIPT), str(fake)], check=True, timeout=30, env={**os.environ})
    return log.read_text().splitlines()


def test_a_local_cpu_wheel_is_taken_offline_then_its_dependencies(tmp_path):
    calls = _run(tmp_path, local_wheel=True)
    assert len(calls) == 2
    assert "--no-index --no-deps torch==2.13.0+cpu" in calls[0]
    assert calls[1].endswith("install --quiet torch==2.13.0+cpu") and "download.pytorch.org" not in calls[1]


def test_without_a_local_wheel_pytorchs_cpu_index_is_asked_for_the_cpu_build(tmp_path):
    calls = _run(tmp_path, local_wheel=False)
    assert len(calls) == 2
    assert "torch==2.13.0+cpu" in calls[1] and "--extra-index-url https://download.pytorch.org/whl/cpu" in calls[1]
    assert not any(c.split()[-1] == "torch==2.13.0" for c in calls)  # never the bare version PyPI answers with CUDA
