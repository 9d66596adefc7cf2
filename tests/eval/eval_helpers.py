"""Shared pieces of the evaluation tests: synthetic benchmarks beside two tiny random model folders."""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny_mindvl import tiny_model_folder

from mindvl.eval.synth_bench import write_synthetic_benchmarks

PX = 28 * 28  # one merged 2x2 patch of 14-pixel patches: the unit of --grid's min/max pixels
# The module (mindvl.infer re-exports a function of the same name); the runner looks `generate` up at call time, so
# tests monkeypatch it here.
generate_module = importlib.import_module("mindvl.infer.generate")


def eval_setup(root: Path, n: int) -> tuple[Path, Path, Path, dict[str, Path]]:
    """Every synthetic benchmark with `n` items (digit OCR) under root/bench, and two tiny model folders of different
    seeds (root/a: seed 1, root/b: seed 2). Returns (root, a, b, benchmark files by name)."""
    benches = write_synthetic_benchmarks(root / "bench", n=n, seed=1, ocr_task="digits")
    return root, tiny_model_folder(root / "a", 1), tiny_model_folder(root / "b", 2), benches
