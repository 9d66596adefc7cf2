"""`mindvl chat --video` with a Qwen3-VL model: a tiny random transformers Qwen3VLForConditionalGeneration (on
mindvl's tokenizer) converted to a mindvl folder; a short mp4. The reference side is built independently of mindvl's
video code: frames picked by transformers' `Qwen3VLVideoProcessor.sample_frames`, decoded with PyAV, sized by its
`resize` (the size it asks torchvision for, recorded) and resized with torch's antialiased bicubic (torchvision's
kernel on CPU; torchvision itself is not installed here), laid out by its `patchify`, normalised by its fused formula;
the prompt text from transformers' `Qwen3VLProcessor.replace_video_token` (timestamps per temporal patch) put in place
of the template's `<|vision_start|><|video_pad|><|vision_end|>` block, tokenized by the folder's tokenizer.json; then
transformers' greedy `generate` (get_rope_index from video_grid_thw and mm_token_type_ids). mindvl's answer must be
the same tokens.

transformers 5.23's generic placeholder expansion replaces only the `<|video_pad|>` inside that block, leaving an
outer vision wrapper around the per-frame blocks; Qwen3-VL's own processor (4.57) and the model's get_rope_index
docstring ("<t1> <vision_start> <frame1> <vision_end> <t2> ...") replace the whole block, which mindvl does.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import qwen3vl_tiny as Q
import torch

from mindvl.checkpoint import convert_from_hf
from mindvl.cli import main
from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from mindvl.data.video import write_test_video

pytest.importorskip("av")

FRAMES, HEIGHT, WIDTH, FPS = 9, 64, 96, 4
VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 32 * 32 * 64}  # 64 x 96 frames stay 64 x 96: 2 x 3 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("q3chatvideo")
    tok = load_tokenizer(None)
    sp = tok.special
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {**Q.TEXT_KW, "vocab_size": tok.vocab_size, "bos_token_id": sp.endoftext, "eos_token_id": sp.im_end}
    cfg = Qwen3VLConfig(vision_config=dict(Q.VISION_KW), text_config=text, image_token_id=sp.image_pad,
                        video_token_id=sp.video_pad, vision_start_token_id=sp.vision_start,
                        vision_end_token_id=sp.vision_end, tie_word_embeddings=False)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Q.randomise(Qwen3VLForConditionalGeneration(cfg), 0).eval()
    hf.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (DEFAULT_TOKENIZER_PATH.parent / name).is_file():
            shutil.copy(DEFAULT_TOKENIZER_PATH.parent / name, root / "hf" / name)
    folder = convert_from_hf(root / "hf", root / "mv")
    video_cfg = json.loads((folder / "video_preprocessor_config.json").read_text())
    assert video_cfg["video_processor_type"] == "Qwen3VLVideoProcessor" and video_cfg["patch_size"] == 16
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**video_cfg, "size": VIDEO_SIZE}))
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (FRAMES, HEIGHT, WIDTH, 3), dtype=np.uint8)
    frames[:, :, : WIDTH // 2] //= 2  # some structure, so frames differ in more than noise
    write_test_video(root / "v.mp4", frames, fps=FPS)
    return hf, folder, root / "v.mp4", tok


def _reference_inputs(video, tok, monkeypatch):
    """input_ids, mm_token_type_ids, pixel_values_videos, video_grid_thw as transformers builds them (see the module
    docstring)."""
    import av
    from tokenizers import Tokenizer
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    proc = Qwen3VLVideoProcessor(size=VIDEO_SIZE, fps=2)
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        video_fps = float(stream.average_rate)
    metadata = VideoMetadata(total_num_frames=len(decoded), fps=video_fps)
    indices = proc.sample_frames(metadata).tolist()
    frames = torch.from_numpy(decoded[indices]).permute(0, 3, 1, 2)  # [n, C, H, W] uint8
    asked = []
    monkeypatch.setattr(Qwen3VLVideoProcessor.__bases__[0], "resize",
                        lambda self, image, size, resample: asked.append((size.height, size.width)))
    proc.resize(frames[None], SizeDict(shortest_edge=VIDEO_SIZE["shortest_edge"],
                                       longest_edge=VIDEO_SIZE["longest_edge"]), None, factor=32, temporal_factor=2)
    resized = torch.nn.functional.interpolate(frames, size=list(asked[0]), mode="bicubic", align_corners=False,
                                              antialias=True)
    x = resized.float()
    if len(x) % 2:
        x = torch.cat([x, x[-1:]])
    mean = torch.tensor(proc.image_mean)[None, :, None, None] * 255
    std = torch.tensor(proc.image_std)[None, :, None, None] * 255
    x = (x - mean) / std
    rows, gt, gh, gw = proc.patchify(x[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    grid = torch.tensor([[gt, gh, gw]])
    meta = VideoMetadata(total_num_frames=len(decoded), fps=video_fps, frames_indices=indices)
    fake = type("P", (), {"image_token": "", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
                          "vision_end_token": "<|vision_end|>", "video_processor": proc,
                          "_calculate_timestamps": Qwen3VLProcessor._calculate_timestamps})()
    placeholder = Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            f"{placeholder}What happens?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([Tokenizer.from_file(str(DEFAULT_TOKENIZER_PATH)).encode(text).ids])
    kinds = (ids == tok.special.video_pad).long() * 2
    return ids, kinds, rows[0], grid, indices


def test_chat_video_greedy_answer_equals_transformers_generate(setup, monkeypatch, capsys):
    hf, folder, video, tok = setup
    ids, kinds, rows, grid, indices = _reference_inputs(video, tok, monkeypatch)
    # 9 frames at 4 fps: 2.25 s x 2 fps = 4 frames (min_frames 4) spread over 0..8; 2 temporal patches of 2 x 3 tokens
    assert indices == [0, 3, 5, 8] and grid.tolist() == [[2, 4, 6]]
    with torch.no_grad():
        out = hf.generate(input_ids=ids, mm_token_type_ids=kinds, attention_mask=torch.ones_like(ids),
                          pixel_values_videos=rows, video_grid_thw=grid, do_sample=False, max_new_tokens=6,
                          min_new_tokens=6, eos_token_id=None, pad_token_id=tok.special.endoftext)
    ref = out[0, ids.shape[1]:].tolist()

    from mindvl.data.video import VideoSettings
    from mindvl.infer.chat import ChatSession, folder_processing, load_for_chat

    model, mtok = load_for_chat(folder)
    session = ChatSession(model, mtok, videos=[video], max_new_tokens=6, processing=folder_processing(folder, model),
                          video_settings=VideoSettings(fps=2.0))
    prompt_ids = []
    chat_mod = sys.modules["mindvl.infer.chat"]  # the module (mindvl.infer's `chat` is the function)
    real = chat_mod.generate

    def spy(model, prompts, *a, **kw):
        prompt_ids.append(prompts[0].input_ids.tolist())
        torch.testing.assert_close(prompts[0].pixel_values, rows, rtol=0, atol=0)  # bit-equal rows
        return real(model, prompts, *a, **kw)

    monkeypatch.setattr(chat_mod, "generate", spy)
    answer = session.ask("What happens?")
    assert prompt_ids[0] == ids[0].tolist()  # timestamps, per-frame blocks and pads as transformers' text
    got = [*session.last_ids, *([session.last_stop] if session.last_stop is not None else [])]
    assert got == ref[: len(got)] and len(got) >= 2, (got, ref)
    # The CLI: the folder's processor and video config, the same answer.
    assert main(["chat", str(folder), "--video", str(video), "--prompt", "What happens?", "--max-new-tokens", "6",
                 "--system", "You are a helpful assistant."]) == 0
    assert capsys.readouterr().out == answer + "\n"


def test_a_training_pack_with_the_video_gives_transformers_logits(setup, tmp_path):
    """The data pipeline's pack (the folder's processor as data.processor) through the packed training forward:
    logits equal transformers' forward on the video as one (2, 4, 6) item with its mm_token_type_ids."""
    hf, folder, video, tok = setup
    from mindvl.checkpoint import load_model
    from mindvl.data import DataConfig, build_loader
    from mindvl.data.processors import processing_from_folder

    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "Noise."}],
        "videos": [str(video)]}) + "\n")
    source = {"path": str(tmp_path / "d.jsonl"), "absolute_paths": True}  # the video lives in another folder
    cfg = DataConfig.from_dict({"sources": [source], "seq_len": 256, "pack_buffer": 1,
                                "processor": processing_from_folder(folder)})
    pack = next(iter(build_loader(cfg, tok, max_epochs=1)))
    assert pack.image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 6]]
    batch = {k: torch.as_tensor(v) for k, v in pack.to_torch().items()}
    model = load_model(folder).eval()
    model.set_attention_backend("sdpa")
    ids = batch["input_ids"]
    with torch.no_grad():
        ours = model(input_ids=ids, cu_seqlens=batch["cu_seqlens"], position_ids=batch["position_ids"],
                     pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]).logits
        kinds = 2 * (ids == tok.special.video_pad).long()
        ref = hf(input_ids=ids[None], mm_token_type_ids=kinds[None], pixel_values_videos=batch["pixel_values"],
                 video_grid_thw=torch.tensor([[2, 4, 6]])).logits[0]
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-4
