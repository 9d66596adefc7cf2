"""The data pipeline computes video positions with `data.video.tokens_per_second`; a run whose model uses another
time scale stops at start (it would train on positions generation never produces)."""

from __future__ import annotations

import pytest
from train_helpers import raw_recipe

from mindvl.config import load_recipe
from mindvl.train.trainer import train


def test_video_time_scale_must_match_the_model(tmp_path):
    recipe = load_recipe(raw=raw_recipe(tmp_path / "o", tmp_path / "cache", data={"video": {"tokens_per_second": 3}}))
    with pytest.raises(ValueError, match=r"data\.video\.tokens_per_second is 3 but the model's tokens_per_second is 2"):
        train(recipe)
