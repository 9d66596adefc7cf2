"""data.processor is filled in from the model the run trains (the init_from folder's processor configs, else the
vision tower's family) and a recipe's own processor must cut the patches that tower takes."""

from __future__ import annotations

import pytest

from mindvl.config import load_recipe
from mindvl.data import DataConfig
from mindvl.data.processors import QWEN2_VL, QWEN3_VL
from mindvl.models import MindVLConfig, TextConfig, VisionConfig
from mindvl.quickstart import recipe_dir
from mindvl.train.preflight import fill_processor

QWEN3_TOWER = VisionConfig(family="qwen3_vl", depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
TEXT = TextConfig(vocab_size=686, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, mrope_section=[4, 2, 2])


IDS = dict(image_token_id=684, video_token_id=685, vision_start_token_id=681, vision_end_token_id=682)


def _recipe(*overrides):
    return load_recipe(recipe_dir().parent / "tiny-qwen3-vl" / "warmup.yaml", list(overrides))


def test_a_qwen3_vl_tower_gets_qwen3_vl_processing():
    recipe = _recipe()
    data = DataConfig.from_dict(recipe.data)
    fill_processor(data, recipe, MindVLConfig(text=TEXT, vision=QWEN3_TOWER, **IDS))
    assert data.vision_processing() == QWEN3_VL
    data = DataConfig.from_dict(recipe.data)
    fill_processor(data, recipe, MindVLConfig(text=TEXT, vision=VisionConfig(depth=1, hidden_size=32,
                                                                            intermediate_size=48, num_heads=2,
                                                                            fullatt_block_indexes=[0]), **IDS))
    assert data.vision_processing() == QWEN2_VL


def test_a_recipe_processor_that_does_not_fit_the_tower_is_refused():
    recipe = _recipe("data.processor=qwen2_vl")
    data = DataConfig.from_dict(recipe.data)
    with pytest.raises(ValueError, match=r"data.processor: the processor does not fit the model's qwen3_vl vision "
                                         r"tower \(patch_size 14 vs 16\)"):
        fill_processor(data, recipe, MindVLConfig(text=TEXT, vision=QWEN3_TOWER, **IDS))


def test_the_init_from_folder_names_the_processor(tmp_path):
    from mindvl.checkpoint import save_pretrained
    from mindvl.models import MindVL

    folder = save_pretrained(MindVL(MindVLConfig(text=TEXT, vision=QWEN3_TOWER, **IDS)), tmp_path / "m",
                             pixels=(4096, 32 * 32 * 100))
    recipe = _recipe(f"init_from={folder}")
    data = DataConfig.from_dict(recipe.data)
    fill_processor(data, recipe, MindVLConfig(text=TEXT, vision=QWEN3_TOWER, **IDS))
    p = data.vision_processing()
    assert (p.family, p.patch_size, p.min_pixels, p.max_pixels) == ("qwen3_vl", 16, 4096, 32 * 32 * 100)
