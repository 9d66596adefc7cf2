"""The quickstart's whole pipeline wired end to end at the smallest scale (2 steps per phase, a few benchmark
items): every phase, the merge, the search and the report come out, and the merged model is the SFT average."""

from __future__ import annotations

import json

import torch

from mindvl.checkpoint.safetensors_io import TensorFolder
from mindvl.quickstart import SFT_VARIANTS, quickstart


def test_quickstart_pipeline_smoke(tmp_path):
    out = tmp_path / "qs"
    tiny_data = "data.sources=[{name: d, synth: {tasks: [digits, chart], n: 24, seed: 0}}]"
    summary = quickstart(out, overrides=["max_steps=2", "logging.progress=false", "logging.tensorboard=false",
                                         tiny_data], bench_items=3, grid="4:16,64", log=lambda line: None)
    assert list(summary["phases"]) == ["warmup", "multitask", *SFT_VARIANTS]
    assert set(summary["evaluation"]) == {"untrained", *SFT_VARIANTS, "merged"}
    assert set(summary["evaluation"]["merged"]) == {"ocrbench", "chartqa", "docvqa"}
    # Each SFT variant trained at its own sequence length, from the multitask model.
    for name, (seq_len, _) in SFT_VARIANTS.items():
        recipe = json.loads((out / name / "recipe.json").read_text())
        assert recipe["data"]["seq_len"] == seq_len
        assert recipe["model"]["init_from"] == summary["phases"]["multitask"]["final"]
    # The merged model is the plain average of the three SFT models.
    finals = [dict(TensorFolder(out / name / "final").iter_tensors()) for name in SFT_VARIANTS]
    merged = dict(TensorFolder(out / "merged").iter_tensors())
    for key, value in merged.items():
        torch.testing.assert_close(value, sum(f[key] for f in finals) / 3, rtol=1e-6, atol=1e-7, msg=key)
    report = (out / "report.md").read_text()
    for heading in ("## Training", "## Evaluation", "## Merged vs the three SFT models",
                    "## Best test-time resolution"):
        assert heading in report
    for png in ("loss_curves.png", "scores.png", "search/boxplot_ocrbench.png", "search/boxplot_docvqa.png"):
        assert (out / png).stat().st_size > 0, png
    assert json.loads((out / "quickstart.json").read_text())["best"] == summary["best"]
