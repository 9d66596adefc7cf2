"""Device-specific code lives in the device layer: outside a short allow-list, no module of mindvl names a device
kind in a string ("cuda", "npu", their process-group backends), calls `.cuda()`/`.npu()` or reaches into
`torch.cuda`/`torch.npu`. Everything else takes a `torch.device` it is given (the trainer detects it once, in
`mindvl.train.parallel`). A new use must be added here with its reason, so it is a decision, not an accident."""

from __future__ import annotations

import io
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_STRINGS = {"cuda", "npu", "nccl", "hccl"}
DEVICE_MODULES = {"cuda", "npu"}

# file -> (uses allowed, why). Counts are exact: a new use (or a removed one) updates this table.
ALLOWED = {
    "mindvl/train/parallel.py": (14, "the device layer: detect_device, process-group backends, torch_npu import, "
                                     "compile: auto (on for CUDA with triton)"),
    "mindvl/train/metrics.py": (8, "datasheet peak FLOP/s by device name; synchronising the measured-peak timer"),
    "mindvl/train/plan_headline.py": (4, "the device name the planner headline plans for"),
    "mindvl/models/attention.py": (8, "kernel choice per device: flash-attn on CUDA, fused attention on Ascend"),
    "mindvl/models/moe.py": (3, "where grouped_mm kernels exist (CUDA from sm80 in bf16; none on NPU)"),
    "mindvl/checkpoint/training.py": (8, "the CUDA RNG state saved in and restored from training checkpoints"),
    "mindvl/config.py": (2, "the parallel.device choices a recipe may name"),
    "mindvl/infer/decode_graph.py": (8, "CUDA-graph capture and replay of the decode step (CUDA only: graphs, "
                                        "streams, the device check)"),
    "mindvl/models/host.py": (2, "host-built tables reach CUDA through pinned memory (a non-blocking copy; a pageable "
                                 "one synchronises the stream)"),
    "mindvl/infer/device.py": (5, "the device a user names for chat/eval/search/moe-trace: checked before loading, "
                                  "with the default (cuda when available)"),
}


def device_uses(source: str) -> int:
    """Device-kind string literals, `.cuda(` / `.npu(` calls and `torch.cuda` / `torch.npu` attribute uses, in code
    (tokens: comments and docstrings that merely mention a device do not count; a docstring is one string token
    whose value is not exactly a device name)."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
    uses = 0
    for i, t in enumerate(toks):
        if t.type == tokenize.STRING and t.string.strip("\"'") in DEVICE_STRINGS and len(t.string) <= 7:
            uses += 1
        elif t.type == tokenize.NAME and t.string in DEVICE_MODULES and i > 0 and toks[i - 1].string == ".":
            before = toks[i - 2].string if i > 1 else ""
            after = toks[i + 1].string if i + 1 < len(toks) else ""
            if before in ("torch", ")") or after == "(":  # torch.cuda.*, x.cuda(), f().cuda
                uses += 1
    return uses


def test_device_specific_code_stays_in_the_device_layer():
    found = Counter()
    for path in sorted((ROOT / "mindvl").rglob("*.py")):
        n = device_uses(path.read_text())
        if n:
            found[path.relative_to(ROOT).as_posix()] = n
    unexpected = {f: n for f, n in found.items() if f not in ALLOWED}
    assert not unexpected, (f"device-specific code outside the device layer: {unexpected}; take a torch.device "
                            "from the caller (mindvl.train.parallel detects it), or add the file to ALLOWED with why")
    changed = {f: (found.get(f, 0), n) for f, (n, _) in ALLOWED.items() if found.get(f, 0) != n}
    assert not changed, f"(found, allowed) device uses changed: {changed}; update ALLOWED with the reason"


def test_the_scanner_sees_each_kind_of_use():
    code = ('import torch\nx = torch.zeros(1).cuda()\ntorch.cuda.synchronize()\ndev = torch.device("cuda")\n'
            'backend = "nccl"\n# "cuda" in a comment\n"""A docstring about cuda."""\ny = x.to("cpu")\n')
    assert device_uses(code) == 4
