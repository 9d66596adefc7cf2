"""`mindvl chat --video`: a video prompt's greedy answer equals a full-forward greedy loop whose positions come from
the data side's M-RoPE (time axis scaled by second_per_grid_t), and the CLI names the missing decoder extra."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from tiny_mindvl import tiny_model_folder

from mindvl.cli import main
from mindvl.data.template import mrope_positions
from mindvl.data.video import VideoSettings, video_processor_config, write_test_video
from mindvl.infer.chat import (
    ChatSession,
    conversation_prompt,
    load_for_chat,
    process_videos,
    user_message,
    video_settings,
)
from mindvl.infer.generate import generate, pack_prompts

SETTINGS = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 84)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatvideo")
    folder = tiny_model_folder(root / "model")
    rng = np.random.default_rng(0)
    write_test_video(root / "v.mp4", rng.integers(0, 256, (8, 56, 84, 3), dtype=np.uint8), fps=8)
    return folder, root / "v.mp4"


def test_video_prompt_logits_equal_a_full_forward_on_data_side_positions(setup):
    folder, video = setup
    model, tok = load_for_chat(folder)
    rows, grids, seconds = process_videos([video], SETTINGS)
    # 1 s at 8 fps: 2 frames at 2 fps, raised to min_frames 4 -> frames 0, 2, 4, 6, sampled at 4 fps, so a temporal
    # patch of 2 frames lasts 0.5 s (the default of 1 s would give other positions).
    assert grids == [(2, 4, 6)] and seconds == [0.5]
    prompt = conversation_prompt(tok, [user_message("What happens?", 0, 1)], None, [], video_rows=rows,
                                 video_grids=grids, video_seconds=seconds)
    packed = pack_prompts([prompt], torch.device("cpu"))
    with torch.no_grad():
        logits, next_pos = model.prefill(packed["input_ids"], packed["cu_seqlens"],
                                         model.new_kv_cache(1, len(prompt.input_ids)), packed["pixel_values"],
                                         packed["image_grid_thw"], packed["second_per_grid_ts"])
        # Reference: the packed training forward, positions from the data side's M-RoPE.
        ids = prompt.input_ids
        pads = torch.nonzero(ids == tok.special.video_pad).flatten()
        span = (int(pads[0]), int(pads[-1]) + 1)
        interval = float(np.float32(model.config.tokens_per_second) * np.float32(seconds[0]))
        pos = torch.from_numpy(mrope_positions(len(ids), [span], grids, [interval]))
        ref = model(input_ids=ids, pixel_values=rows[0], image_grid_thw=torch.tensor(grids), position_ids=pos).logits
    # Time index 0 and 0.5 s x 2 tokens/s for the two temporal patches.
    assert pos[0, span[0]:span[1]].unique().tolist() == [span[0], span[0] + 1]
    torch.testing.assert_close(logits[0], ref[-1], rtol=1e-5, atol=1e-5)
    assert int(next_pos) == int(pos.max()) + 1
    assert len(generate(model, [prompt], 3)[0]) == 3


def test_chat_cli_with_a_video(setup, capsys):
    folder, video = setup
    session = ChatSession(*load_for_chat(folder), videos=[video], video_settings=VideoSettings(), max_new_tokens=4)
    expected = session.ask("Describe.")
    assert main(["chat", str(folder), "--video", str(video), "--prompt", "Describe.", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    # The folder's video_preprocessor_config.json (transformers' layout) sets the sampling and sizes.
    (folder / "video_preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 3136, "longest_edge": 4704}, "fps": 4.0, "max_frames": 16}')
    try:
        s = video_settings(folder)
        assert (s.min_pixels, s.max_pixels, s.fps, s.max_frames, s.min_frames) == (3136, 4704, 4.0, 16, 4)
        assert video_settings(folder, fps=1.0).fps == 1.0
        # What mindvl writes for a folder reads back as the same settings.
        custom = VideoSettings(fps=1.5, min_frames=2, max_frames=64, min_pixels=3136, max_pixels=12544,
                               cap_pixels_per_frame=False, max_video_tokens=4096)
        (folder / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(custom)))
        assert video_settings(folder) == custom
    finally:
        (folder / "video_preprocessor_config.json").unlink()


def test_chat_cli_names_the_missing_video_extra(setup, capsys, monkeypatch):
    folder, video = setup
    monkeypatch.setitem(sys.modules, "av", None)
    assert main(["chat", str(folder), "--video", str(video), "--prompt", "x"]) == 2
    assert "mindvl[video]" in capsys.readouterr().err
