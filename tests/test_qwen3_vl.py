"""Qwen3-VL (dense and MoE) against transformers 5.23 on tiny random models (fp32, eager attention there).

Vision features and DeepStack features, interleaved M-RoPE positions (get_rope_index), logits with two images and a
video (transformers' call form and mindvl's packed one-stream form), conversion both ways (bit-exact round trip, and
transformers loading the export), composition of the Qwen3-VL tower with a Qwen3 LLM.
"""

from __future__ import annotations

import dataclasses
import json

import hf_tiny as H
import pytest
import qwen3vl_tiny as Q
import torch

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.checkpoint.hf_export import export_to_hf
from mindvl.checkpoint.safetensors_io import TensorFolder

IMAGES = torch.tensor([[1, 6, 10], [1, 4, 4]])  # 6 x 10 patches: the 4 x 4 position table is stretched unevenly
VIDEOS = torch.tensor([[2, 4, 6]])  # two frames, each its own vision item in Qwen3-VL's prompt
ITEMS = [("image", [1, 6, 10]), ("video", [2, 4, 6]), ("image", [1, 4, 4])]
TOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    moe = request.param == "moe"
    root = tmp_path_factory.mktemp(f"qwen3vl_{request.param}")
    hf = Q.qwen3vl(root / "hf", moe=moe)
    convert_from_hf(root / "hf", root / "mv")
    ours = load_model(root / "mv")
    ours.set_attention_backend("sdpa")
    return hf, ours, root


def _inputs():
    ids, kinds = Q.prompt(ITEMS)
    return ids, kinds, Q.patch_rows(IMAGES, 1), Q.patch_rows(VIDEOS, 2)


@torch.no_grad()
def test_vision_and_deepstack_features_match(pair):
    hf, ours, _ = pair
    grid = torch.tensor([[1, 6, 10], [1, 4, 4], [2, 2, 6], [1, 8, 2], [1, 4, 8]])  # grids below and above 4 x 4
    px = Q.patch_rows(grid, 3)
    ref = hf.model.visual(px, grid_thw=grid)
    features, stack = ours.vision_features(px, grid)
    assert rel(features, ref.pooler_output) <= TOL
    assert len(stack) == len(ref.deepstack_features) == 2
    for got, want in zip(stack, ref.deepstack_features, strict=True):
        assert rel(got, want) <= TOL
    hidden, _ = ours.visual(px, grid)
    assert rel(hidden, ref.last_hidden_state) <= TOL


@torch.no_grad()
def test_positions_match_get_rope_index(pair):
    hf, ours, _ = pair
    ids, kinds, _, _ = _inputs()
    pos, _ = hf.model.get_rope_index(ids, kinds, IMAGES, VIDEOS)
    cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
    assert torch.equal(ours.default_position_ids(ids[0], cu, IMAGES, VIDEOS), pos[:, 0])
    # mindvl's one-stream form (images and videos in order of appearance) gives the same positions
    stream = torch.cat([IMAGES[:1], VIDEOS, IMAGES[1:]])
    assert torch.equal(ours.default_position_ids(ids[0], cu, stream), pos[:, 0])


@torch.no_grad()
def test_logits_with_images_and_a_video_match(pair):
    hf, ours, _ = pair
    ids, kinds, px, pv = _inputs()
    ref = hf(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS,
             mm_token_type_ids=kinds).logits
    got = ours(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv,
               video_grid_thw=VIDEOS).logits
    assert rel(got, ref) <= TOL
    # packed one-stream form: pixel rows of image 1, the video, image 2 in prompt order
    n1 = int(IMAGES[0].prod())
    stream_px = torch.cat([px[:n1], pv, px[n1:]])
    stream = torch.cat([IMAGES[:1], VIDEOS, IMAGES[1:]])
    packed = ours(input_ids=ids[0], pixel_values=stream_px, image_grid_thw=stream).logits
    assert rel(packed, ref[0]) <= TOL
    # DeepStack is exercised: without it the logits move far beyond the tolerance
    mergers, ours.projector.deepstack = ours.projector.deepstack, None
    try:
        assert rel(ours(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv,
                        video_grid_thw=VIDEOS).logits, ref) > 100 * TOL
    finally:
        ours.projector.deepstack = mergers


@torch.no_grad()
def test_text_only_prompt_matches(pair):
    hf, ours, _ = pair
    ids = torch.randint(2, 140, (1, 9), generator=torch.Generator().manual_seed(5))
    ref = hf(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
    assert rel(ours(input_ids=ids).logits, ref) <= TOL


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(pair):
    hf, ours, root = pair
    export_to_hf(root / "mv", root / "back")
    convert_from_hf(root / "back", root / "mv2")
    a, b = TensorFolder(root / "mv"), TensorFolder(root / "mv2")
    first = dict(a.iter_tensors())
    second = dict(b.iter_tensors())
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    import transformers

    arch = "Qwen3VLMoeForConditionalGeneration" if ours.config.text.family == "qwen3_moe" else \
        "Qwen3VLForConditionalGeneration"
    again = getattr(transformers, arch).from_pretrained(root / "back", attn_implementation="eager").eval()
    ids, kinds, px, pv = _inputs()
    with torch.no_grad():
        kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv,
                  video_grid_thw=VIDEOS, mm_token_type_ids=kinds)
        assert torch.equal(again(**kw).logits, hf(**kw).logits)


def test_hub_expert_layout_imports_the_same(tmp_path):
    """The hub stores experts as gate_up [E, H, 2I] / down [E, I, H]; transformers 5 saves their transposes."""
    from safetensors.torch import load_file, save_file

    hf = Q.qwen3vl(tmp_path / "hf", moe=True)
    del hf
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    hub = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in tensors.items()}
    (tmp_path / "hub").mkdir()
    for f in (tmp_path / "hf").iterdir():
        if f.suffix == ".json":
            (tmp_path / "hub" / f.name).write_text(f.read_text())
    save_file(hub, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    convert_from_hf(tmp_path / "hf", tmp_path / "a")
    convert_from_hf(tmp_path / "hub", tmp_path / "b")
    a, b = dict(TensorFolder(tmp_path / "a").iter_tensors()), dict(TensorFolder(tmp_path / "b").iter_tensors())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@torch.no_grad()
def test_bf16_is_as_accurate_as_transformers_bf16(pair):
    """In bf16 both implementations round; ours must be no further from the fp32 reference than transformers'."""
    hf, ours, root = pair
    ids, kinds, px, pv = _inputs()
    kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS)
    ref = hf(**kw, mm_token_type_ids=kinds).logits
    hf16 = type(hf).from_pretrained(root / "hf", dtype=torch.bfloat16, attn_implementation="eager",
                                    experts_implementation="eager").eval()  # its grouped_mm needs 16-byte rows
    ours16 = load_model(root / "mv", dtype=torch.bfloat16)
    err_hf = rel(hf16(**kw, mm_token_type_ids=kinds).logits.float(), ref)
    err_ours = rel(ours16(**kw).logits.float(), ref)
    assert err_ours <= 1.5 * err_hf + 1e-3, (err_ours, err_hf)


def test_composition_with_a_qwen3_llm(tmp_path):
    """MindVL-style: the Qwen3-VL tower + fresh projector and DeepStack mergers + a Qwen3 LLM, from config alone."""
    from mindvl.checkpoint import compose

    Q.qwen3vl(tmp_path / "vl")
    H.qwen3(tmp_path / "llm", hidden=32)
    (tmp_path / "llm" / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": H.IMAGE_TOKEN, "content": "<|image_pad|>"}, {"id": H.VIDEO_TOKEN, "content": "<|video_pad|>"},
        {"id": H.VISION_START, "content": "<|vision_start|>"}, {"id": H.VISION_END, "content": "<|vision_end|>"}]}))
    compose(tmp_path / "vl", tmp_path / "llm", tmp_path / "out", seed=3)
    model = load_model(tmp_path / "out")
    assert model.config.vision.family == "qwen3_vl" and model.config.text.family == "qwen3"
    assert model.config.text.mrope_interleaved
    vl = TensorFolder(tmp_path / "vl")
    tower = {k: v for k, v in vl.iter_tensors() if k.startswith("model.visual.blocks.0.")}
    ours = dict(model.named_parameters())
    for k, v in tower.items():  # the tower's weights are kept exactly
        assert torch.equal(ours[k.replace("model.visual.", "visual.")], v)
    assert model.projector.fc2.weight.shape == (32, 4 * 32) and len(model.projector.deepstack) == 2
    ids, _ = Q.prompt([("image", [1, 4, 4])])
    loss = model(input_ids=ids[0], labels=ids[0], pixel_values=Q.patch_rows(IMAGES[1:]), image_grid_thw=IMAGES[1:])
    loss.loss_sum.backward()
    assert float(model.projector.deepstack[0].fc1.weight.grad.abs().sum()) > 0  # trains with the projector


def test_greedy_generation_with_kv_cache_equals_transformers_generate(pair):
    """Three prompts batched in mindvl (images, a video, text only); transformers generates each alone."""
    from mindvl.infer import Prompt, generate

    hf, ours, _ = pair
    specs = [[("image", [1, 6, 10])], [("video", [2, 4, 6]), ("image", [1, 4, 4])], []]
    prompts, hf_inputs = [], []
    for i, items in enumerate(specs):
        ids, kinds = Q.prompt(items, seed=10 + i)
        images = [g for k, g in items if k == "image"]
        videos = [g for k, g in items if k == "video"]
        kw = {"input_ids": ids, "mm_token_type_ids": kinds, "attention_mask": torch.ones_like(ids)}
        rows, grids = [], []
        for _, g in items:  # mindvl's one stream, in prompt order
            rows.append(Q.patch_rows(torch.tensor([g]), seed=20 + i + len(rows)))
            grids.append(g)
        if images:
            kw["image_grid_thw"] = torch.tensor(images)
            kw["pixel_values"] = torch.cat([r for r, (k, _) in zip(rows, items, strict=True) if k == "image"])
        if videos:
            kw["video_grid_thw"] = torch.tensor(videos)
            kw["pixel_values_videos"] = torch.cat([r for r, (k, _) in zip(rows, items, strict=True) if k == "video"])
        prompts.append(Prompt(ids[0], torch.cat(rows) if rows else None, torch.tensor(grids) if grids else None))
        hf_inputs.append(kw)
    got = generate(ours, prompts, max_new_tokens=8)
    for tokens, kw, prompt in zip(got, hf_inputs, prompts, strict=True):
        with torch.no_grad():
            out = hf.generate(**kw, do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, kw["input_ids"].shape[1]:].tolist()
        assert tokens == ref
        # Step logits pin the cache, DeepStack in the prefill and the M-RoPE continuation (rope_deltas).
        cu = torch.tensor([0, len(prompt.input_ids)], dtype=torch.int32)
        with torch.inference_mode():
            cache = ours.new_kv_cache(1, len(prompt.input_ids) + 8)
            logits, pos = ours.prefill(prompt.input_ids, cu, cache, prompt.pixel_values, prompt.image_grid_thw)
            steps = [logits[0]]
            for k, token in enumerate(ref[:-1]):
                steps.append(ours.decode_step(torch.tensor([token]), pos + k, cache)[0])
        for step, want in zip(steps, out.logits, strict=True):
            assert rel(step, want[0]) <= TOL


def test_train_two_steps_export_and_transformers_generates_the_same(pair, tmp_path):
    """convert -> 2 AdamW steps (every module trains, packed two-sample row) -> save -> `convert --to-hf` ->
    transformers' greedy generate equals mindvl's, token for token, and its logits equal ours."""
    import transformers

    from mindvl.checkpoint import save_pretrained
    from mindvl.cli import main as cli_main
    from mindvl.infer import Prompt, generate

    _, _, root = pair
    model = load_model(root / "mv")
    model.train()
    ids, kinds, px, pv = _inputs()
    short, _ = Q.prompt([("image", [1, 4, 4])], seed=4)
    stream_px = torch.cat([px[: int(IMAGES[0].prod())], pv, px[int(IMAGES[0].prod()):], Q.patch_rows(IMAGES[1:], 9)])
    stream = torch.cat([IMAGES[:1], VIDEOS, IMAGES[1:], IMAGES[1:]])
    row = torch.cat([ids[0], short[0]])
    cu = torch.tensor([0, ids.shape[1], len(row)], dtype=torch.int32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        out = model(input_ids=row, labels=row, cu_seqlens=cu, pixel_values=stream_px, image_grid_thw=stream)
        (out.loss_sum / out.num_tokens).backward()
        opt.step()
        opt.zero_grad()
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("projector.deepstack.") for k in moved) and any(k.startswith("visual.") for k in moved)
    model.eval()
    save_pretrained(model, tmp_path / "trained")
    assert cli_main(["convert", "--to-hf", str(tmp_path / "trained"), "--out", str(tmp_path / "hf")]) == 0
    arch = "Qwen3VLMoeForConditionalGeneration" if model.config.text.family == "qwen3_moe" else \
        "Qwen3VLForConditionalGeneration"
    hf = getattr(transformers, arch).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS,
              mm_token_type_ids=kinds)
    with torch.no_grad():
        ref = hf.generate(**kw, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          min_new_tokens=6, eos_token_id=None, pad_token_id=0)
        assert rel(model(**{k: v for k, v in kw.items() if k != "mm_token_type_ids"}).logits,
                   hf(**kw).logits) <= TOL
    stream1 = torch.cat([IMAGES[:1], VIDEOS, IMAGES[1:]])
    got = generate(model, [Prompt(ids[0], stream_px[: int(stream1.prod(-1).sum())], stream1)], max_new_tokens=6)
    assert got[0] == ref[0, ids.shape[1]:].tolist()


def test_qwen3_vl_tower_with_a_deepseek_v3_llm_from_config():
    """MindVL-style composition from a config alone: Qwen3-VL ViT + DeepStack + MLA/MoE LLM, forward and backward."""
    from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

    vision = VisionConfig(family="qwen3_vl", depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                          patch_size=16, hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                          deepstack_visual_indexes=[0])
    text = TextConfig(family="deepseek_v3", vocab_size=H.VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=2, moe_intermediate_size=16, n_routed_experts=4,
                      num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=8, mrope_section=[2, 1, 1], mrope_interleaved=True)
    cfg = MindVLConfig(text=text, vision=vision, image_token_id=H.IMAGE_TOKEN, video_token_id=H.VIDEO_TOKEN,
                       vision_start_token_id=H.VISION_START, vision_end_token_id=H.VISION_END)
    assert MindVLConfig.from_dict(cfg.to_dict()) == cfg  # config.json round trip
    model = MindVL(cfg)
    model.init_weights(seed=0)
    ids, _ = Q.prompt([("image", [1, 4, 4])])
    grid = torch.tensor([[1, 4, 4]])
    out = model(input_ids=ids[0], labels=ids[0], pixel_values=Q.patch_rows(grid), image_grid_thw=grid)
    out.loss_sum.backward()
    assert float(model.projector.deepstack[0].fc1.weight.grad.abs().sum()) > 0
    assert float(model.visual.pos_embed.weight.grad.abs().sum()) > 0


def test_chat_session_feeds_a_qwen3_vl_model_16px_rows(tmp_path):
    """mindvl's chat preprocesses images for the model's tower: Qwen3-VL's 16-px rows (mean/std 0.5); its answer
    equals greedy decoding by full recomputation on those rows."""
    import numpy as np
    from PIL import Image

    from mindvl.data.processors import QWEN3_VL, preprocess_image
    from mindvl.data.tokenizer import load_tokenizer
    from mindvl.infer.chat import ChatSession, conversation_prompt, user_message
    from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

    tok = load_tokenizer(None)
    sp = tok.special
    cfg = MindVLConfig(
        text=TextConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mrope_section=[4, 2, 2],
                        mrope_interleaved=True),
        vision=VisionConfig(family="qwen3_vl", depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                            patch_size=16, hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                            deepstack_visual_indexes=[0]),
        image_token_id=sp.image_pad, video_token_id=sp.video_pad, vision_start_token_id=sp.vision_start,
        vision_end_token_id=sp.vision_end)
    model = MindVL(cfg)
    model.init_weights(seed=1, std=0.1)
    model.eval()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8))
    session = ChatSession(model, tok, [image], min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, max_new_tokens=4)
    rows, grid = preprocess_image(image, dataclasses.replace(QWEN3_VL, min_pixels=4096, max_pixels=16384))
    assert session.pixel_values.shape[1] == 1536 and torch.equal(session.pixel_values, torch.from_numpy(rows))
    assert session.grids == [grid]
    answer = session.ask("What is it?")
    prompt = conversation_prompt(tok, [user_message("What is it?", 1)], session.pixel_values, session.grids)
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < 4 and (not tokens or tokens[-1] not in (sp.im_end, sp.endoftext)):
            ids = torch.cat([prompt.input_ids, torch.tensor(tokens, dtype=torch.long)])
            logits = model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
            tokens.append(int(logits.logits[-1].argmax()))
    if tokens[-1] in (sp.im_end, sp.endoftext):
        tokens = tokens[:-1]
    assert answer == tok.decode(tokens, skip_special_tokens=True)


def test_flops_count_the_qwen3_vl_tower_and_activated_experts():
    """metrics' FLOPs for the Qwen3-VL family against a count by hand: ungated ViT MLP, every block attending over
    its frame, DeepStack mergers, and a Qwen3-MoE LLM's router + top-k experts."""
    from mindvl.models import MindVLConfig, TextConfig, VisionConfig
    from mindvl.train.metrics import flops_by_module

    v = VisionConfig(family="qwen3_vl", depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16,
                     num_position_embeddings=16, deepstack_visual_indexes=[0])
    t = TextConfig(family="qwen3_moe", vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=12,
                   n_routed_experts=4, num_experts_per_tok=2, mrope_section=[2, 1, 1], mrope_interleaved=True)
    parts = flops_by_module(MindVLConfig(text=t, vision=v, image_token_id=1, video_token_id=2,
                                         vision_start_token_id=3, vision_end_token_id=4), [10], 0, [[1, 4, 6]])
    p = 24
    assert parts["visual"] == (2 * p * 1536 * 32 + 2 * p * 2 * (4 * 32 * 32 + 2 * 32 * 48), 2 * 2 * 2 * 32 * p * p)
    assert parts["projector"][0] == 2 * 2 * (p // 4) * (128 * 128 + 128 * 16)
    per_token = 2 * (16 * (16 + 2 * 8) + 16 * 16 + 16 * 4 + 2 * 3 * 16 * 12)
    assert parts["language_model"][0] == 10 * 2 * per_token
