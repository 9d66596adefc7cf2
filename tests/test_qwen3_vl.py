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
import vl_alignment as A
from vl_alignment import IMAGES, TOL, VIDEOS, rel

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.checkpoint.safetensors_io import TensorFolder


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    return A.convert_pair(Q.qwen3vl, tmp_path_factory.mktemp(f"qwen3vl_{request.param}"), request.param == "moe")


def _arch(family: str) -> str:
    return "Qwen3VLMoeForConditionalGeneration" if family == "qwen3_moe" else "Qwen3VLForConditionalGeneration"


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
    ids, cu, pos = A.assert_positions_match(*pair[:2])
    # mindvl's one-stream form (images and videos in order of appearance) gives the same positions
    stream = torch.cat([IMAGES[:1], VIDEOS, IMAGES[1:]])
    assert torch.equal(pair[1].default_position_ids(ids, cu, stream), pos)


@torch.no_grad()
def test_logits_with_images_and_a_video_match(pair):
    hf, ours, _ = pair
    kw, ref = A.assert_logits_match(hf, ours)  # transformers' call form and the packed one-stream form
    # DeepStack is exercised: without it the logits move far beyond the tolerance
    mergers, ours.projector.deepstack = ours.projector.deepstack, None
    try:
        assert rel(ours(**kw).logits, ref) > 100 * TOL
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
    A.assert_round_trip(hf, root, _arch(ours.config.text.family))


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
    A.assert_same_tensors(tmp_path / "a", tmp_path / "b")


@torch.no_grad()
def test_bf16_is_as_accurate_as_transformers_bf16(pair):
    """In bf16 both implementations round; ours must be no further from the fp32 reference than transformers'."""
    hf, _, root = pair
    A.assert_bf16_as_accurate_as_transformers(hf, root)


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
    """Three prompts batched in mindvl (images, a video, text only); transformers generates each alone. Step logits
    pin the cache, DeepStack in the prefill and the M-RoPE continuation (rope_deltas)."""
    A.assert_greedy_generation_matches(*pair[:2])


def test_train_two_steps_export_and_transformers_generates_the_same(pair, tmp_path):
    """convert -> 2 AdamW steps (every module trains, packed two-sample row) -> save -> `convert --to-hf` ->
    transformers' greedy generate equals mindvl's, token for token, and its logits equal ours."""
    _, _, root = pair
    model = load_model(root / "mv")
    model.train()
    moved = A.train_two_packed_steps(model, prompt_seed=4, rows_seed=9)
    assert any(k.startswith("projector.deepstack.") for k in moved) and any(k.startswith("visual.") for k in moved)
    A.assert_export_generates_like_transformers(model, tmp_path, _arch(model.config.text.family))


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
    from mindvl.data.processors import QWEN3_VL, preprocess_image
    from mindvl.infer.chat import conversation_prompt, user_message

    model, tok = A.chat_model(dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, mrope_section=[4, 2, 2],
                                   mrope_interleaved=True), depth=2, deepstack=[0])
    image = A.chat_image()
    session = A.chat_session(model, tok, image)
    rows, grid = preprocess_image(image, dataclasses.replace(QWEN3_VL, min_pixels=4096, max_pixels=16384))
    assert session.pixel_values.shape[1] == 1536 and torch.equal(session.pixel_values, torch.from_numpy(rows))
    assert session.grids == [grid]
    answer = session.ask("What is it?")
    prompt = conversation_prompt(tok, [user_message("What is it?", 1)], session.pixel_values, session.grids)
    assert answer == tok.decode(A.greedy_by_recomputation(model, tok, prompt), skip_special_tokens=True)


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
