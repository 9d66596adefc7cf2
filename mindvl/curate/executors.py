"""Engines: the same `work(job)` (the runner's `run_shard`) in this process, in local worker processes, or as a Ray
Data map. The runner hands `work` in, so this module does not import the runner that imports it.

- `inprocess`: shards one after the other in the calling process.
- `local`: a `ProcessPoolExecutor` of `workers` spawned processes (spawn, not fork: model libraries' thread pools
  do not survive a fork); each process builds the pipeline and loads its models once.
- `ray`: Ray Data over the shard list (`ray.data.from_items(jobs).map(run)` on a task pool of `workers`), one shard per
  row, on a local Ray instance with `workers` CPUs or an existing cluster at `address` (the output folder must then be
  on storage every node sees). Ray is the optional extra `mindvl[ray]`.

Outputs do not depend on the engine or the number of workers: every shard is a pure function of its input and the
global plans.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial

from mindvl.children import child_env, spawn_context

from .pipeline import EngineConfig

Work = Callable[[dict], dict]  # one job -> its done record; a module-level function (spawned workers pickle it)


def run_inprocess(jobs: list[dict], work: Work) -> list[dict]:
    return [work(j) for j in jobs]


class LocalPool:
    """`workers` spawned processes kept for the whole run (every segment reuses them: spawning and importing the
    stages' libraries costs about a second a process)."""

    def __init__(self, workers: int, work: Work):
        self.workers = workers
        self.work = work
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, jobs: list[dict]) -> list[dict]:
        if self.workers == 1:
            return run_inprocess(jobs, self.work)
        if self._pool is None:
            # One core per worker (N workers use N cores, not N x cores threads): spawned children inherit the
            # environment, and BLAS/OpenMP read it when they load.
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=spawn_context())
        return list(self._pool.map(self.work, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def run_local(jobs: list[dict], workers: int, work: Work) -> list[dict]:
    pool = LocalPool(workers, work)
    try:
        return pool(jobs)
    finally:
        pool.close()


def _ray_row(work: Work, row: dict) -> dict:
    return {"done": json.dumps(work(json.loads(row["job"])))}


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, with one line, when a Ray address does not answer (Ray itself retries for minutes)."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as exc:
        raise ValueError(f"engine.address: cannot reach the Ray cluster at {address!r} ({exc}); start it "
                         "(`ray start --head`) or remove engine.address to run a local Ray instance") from exc


def ray_worker_env() -> dict[str, str]:
    """Environment of a local Ray instance's workers: one thread each, the safe path (no imports from the working
    directory) and this process's absolute PYTHONPATH."""
    env = child_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, OMP_NUM_THREADS="1")
    return {k: env[k] for k in ("OMP_NUM_THREADS", "PYTHONSAFEPATH", "PYTHONPATH")}


def run_ray(jobs: list[dict], workers: int, address: str | None, work: Work) -> list[dict]:
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise ImportError("engine ray needs Ray Data: pip install 'mindvl[ray]'") from exc
    if not ray.is_initialized():
        if address:
            _check_reachable(address)
        try:
            if address:
                # the cluster's nodes keep their own PYTHONPATH; the safe path still applies to their workers
                ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONSAFEPATH": "1"}})
            else:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": ray_worker_env()})
        except (ConnectionError, RuntimeError, TimeoutError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"engine.address: cannot reach the Ray cluster at {address!r} ({first}); start it "
                             "(`ray start --head`) or remove engine.address to run a local Ray instance") from exc
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.from_items([{"job": json.dumps(j)} for j in jobs], override_num_blocks=len(jobs))
    strategy = getattr(ray.data, "TaskPoolStrategy", None)
    if strategy is not None:  # `concurrency=` is deprecated since Ray 2.51
        rows = ds.map(partial(_ray_row, work), compute=strategy(size=workers), num_cpus=1).take_all()
    else:  # pragma: no cover - older Ray
        rows = ds.map(partial(_ray_row, work), concurrency=workers, num_cpus=1).take_all()
    return [json.loads(r["done"]) for r in rows]


def make_executor(engine: EngineConfig, work: Work) -> Callable[[list[dict]], list[dict]]:
    """The engine's `execute(jobs) -> done records`, running `work` on each job."""
    if engine.name == "inprocess":
        return partial(run_inprocess, work=work)
    if engine.name == "local":
        return LocalPool(engine.workers, work)
    if engine.name == "ray":
        return lambda jobs: run_ray(jobs, engine.workers, engine.address, work)
    raise ValueError(f"engine.name: unknown engine {engine.name!r}")
