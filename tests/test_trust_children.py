"""Threat model, item 1: a Python child mindvl starts never imports from the working directory. Each test plants,
in the folder the parent runs from, a package the child would import first if the folder were on its path (the
package writes a marker file), starts the kind of child mindvl starts, and asserts the child worked and no marker
exists."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from mindvl.children import PACKAGE_PARENT, child_env, safe_pythonpath, spawn_context


def plant(folder: Path, package: str, marker: Path) -> None:
    """`folder/package/__init__.py` (and each parent package's `__init__.py`) writes `marker` when imported."""
    code = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    parts = package.split(".")
    for i in range(1, len(parts) + 1):
        d = folder.joinpath(*parts[:i])
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text(code)
    (folder.joinpath(*parts) / "__main__.py").write_text(code)


def test_spawned_pool_workers_do_not_import_multiprocessing_from_the_working_directory(tmp_path, monkeypatch):
    """curate's `engine: {name: local, workers: 2}` pool (the ablation's seed pool is the same context)."""
    from mindvl.curate.executors import LocalPool

    marker = tmp_path / "PWNED"
    plant(tmp_path, "multiprocessing", marker)
    monkeypatch.chdir(tmp_path)
    pool = LocalPool(2, len)
    try:
        assert pool([{}, {"a": 1}, {"a": 1, "b": 2}]) == [0, 1, 2]
    finally:
        pool.close()
    assert not marker.exists(), marker.read_text()


def test_a_bare_spawn_child_would_import_the_planted_package(tmp_path):
    """The attack is real: the same spawn without the safe path imports the planted package (so the test above
    can fail)."""
    marker = tmp_path / "PWNED"
    plant(tmp_path, "multiprocessing", marker)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    subprocess.run([sys.executable, "-c", "import multiprocessing"], cwd=tmp_path, env=env, timeout=60)
    assert marker.exists()


def test_spawn_context_pool_in_a_planted_folder(tmp_path, monkeypatch):
    """A pool on `spawn_context()` directly (what `ablate --jobs N` uses)."""
    marker = tmp_path / "PWNED"
    plant(tmp_path, "multiprocessing", marker)
    monkeypatch.chdir(tmp_path)
    before = {k: os.environ.get(k) for k in ("PYTHONSAFEPATH", "PYTHONPATH")}
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn_context()) as pool:
        assert pool.submit(os.getcwd).result(timeout=120) == str(tmp_path)
        assert pool.submit(os.getenv, "PYTHONSAFEPATH").result(timeout=120) == "1"
    assert not marker.exists()
    assert {k: os.environ.get(k) for k in before} == before  # the parent's environment is left as it was


def test_the_planner_child_does_not_run_a_planted_mindvl_plan(tmp_path):
    """`python -m mindvl.plan` started by the trainer on an accelerator: a planted `mindvl/plan/__main__.py` in
    the working directory would run instead of the planner."""
    from mindvl.train.plan_headline import planner_command

    marker = tmp_path / "PWNED"
    plant(tmp_path, "mindvl.plan", marker)
    cmd, env = planner_command(tmp_path / "recipe.yaml", 1, "NVIDIA H100")
    cmd = [*cmd[: cmd.index("mindvl.plan") + 1], "--help"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()
    assert not marker.exists()
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTHONSAFEPATH"] == "1"


def test_a_c_child_with_child_env_does_not_import_from_the_working_directory(tmp_path):
    """`python -c` children (multiprocessing's spawn main and resource tracker are `-c` children)."""
    marker = tmp_path / "PWNED"
    plant(tmp_path, "json", marker)
    proc = subprocess.run([sys.executable, "-c", "import json, mindvl; print(mindvl.__file__)"], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(PACKAGE_PARENT)
    assert not marker.exists()


def test_ray_workers_get_the_safe_path_and_an_absolute_pythonpath(monkeypatch):
    """Ray is an optional extra (not installed in CI): the environment its local workers get is checked."""
    from mindvl.curate.executors import ray_worker_env

    monkeypatch.setenv("PYTHONPATH", "::relative/dir")  # empty entries mean the working directory
    env = ray_worker_env()
    assert env["PYTHONSAFEPATH"] == "1" and env["OMP_NUM_THREADS"] == "1"
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == PACKAGE_PARENT and "" not in parts and all(os.path.isabs(p) for p in parts)
    assert safe_pythonpath(None) == PACKAGE_PARENT
