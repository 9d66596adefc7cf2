import os
import sys
from pathlib import Path

import pytest

# tests/ helpers (hf_tiny) are plain modules next to the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Every training process of the tests (and the subprocesses they start, which inherit this) would otherwise probe the
# CPU's matmul peak for the MFU log line: 12 fp32 2048^3 matmuls, ~2-6 CPU-s per rank. MFU is not what these tests
# check; tests/test_train_metrics.py covers the override and the probe.
os.environ.setdefault("MINDVL_PEAK_TFLOPS", "0.1")

# Under pytest-xdist (README's `-n 2`: a worker per core) each worker and what it starts computes on one thread: two
# workers of two intra-op threads each would oversubscribe the cores. (Set before torch is imported; the training
# subprocesses already run on one thread, train_helpers.env.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

# The files that take longest (benchmarks/RESULTS.md "CI cost after session 13", an idle run, re-ranked after the
# ablate --jobs parity test joined test_ablate_tower.py's module fixture), longest first; then
# every other file with a `slow` test; then the rest. xdist (`--dist loadfile --no-loadscope-reorder`) hands files to
# the workers in this order, so the long multi-process files start first rather than leaving one worker busy alone at
# the end.
HEAVIEST = ("train/test_requeue.py", "test_readme_commands.py", "test_accelerator_proof.py",
            "ablate/test_ablate_tower.py", "ablate/test_ablate_smoke.py", "train/test_longrun_processes.py",
            "train/test_tensor_parallel.py", "train/test_expert_parallel.py", "train/test_context_parallel.py",
            "train/test_checkpoint_trust.py", "plan/test_plan_vs_proof.py", "test_accelerator_standins.py",
            "plan/test_plan_torch_independent.py")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        rel = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        if rel in HEAVIEST:
            return HEAVIEST.index(rel)
        return len(HEAVIEST) + (0 if item.path in slow_files else 1)

    items.sort(key=rank)  # stable: a file's tests stay together and in their order


@pytest.fixture
def emulated(monkeypatch):
    """DecodeStep's graph backend replaced by the CPU emulation of capture and replay (graph_replay.py), for the
    decode tests (test_static_decode.py, test_decode_compile.py)."""
    from graph_replay import EmulatedGraphs

    from mindvl.infer import decode_graph

    backend = EmulatedGraphs()
    monkeypatch.setattr(decode_graph, "BACKEND", backend)
    return backend


@pytest.fixture
def use_backend(monkeypatch):
    """use_backend(backend): mindvl.infer.decode_compile's backend replaced by `backend` (a name or a callable),
    dynamo's caches emptied before (each test compiles its own graphs) and after the test, passed or not."""
    import torch

    from mindvl.infer import decode_compile

    torch._dynamo.reset()
    yield lambda backend: monkeypatch.setattr(decode_compile, "BACKEND", backend)
    torch._dynamo.reset()
