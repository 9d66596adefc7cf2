"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, natively multimodal; dense and MoE) against transformers 5.23
on a tiny random model: logits (text, images + a video), positions, vision features, greedy generation with the
hybrid cache, and conversion both ways (bit-exact round trip, transformers loads the export, `mtp.*` dropped)."""

from __future__ import annotations

import json
import re

import pytest
import qwen3vl_tiny as V
import torch
import vl_alignment as A
from qwen35_tiny import qwen35
from vl_alignment import IMAGES, TOL, rel

from mindvl.checkpoint import convert_from_hf, load_model


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    return A.convert_pair(qwen35, tmp_path_factory.mktemp(f"qwen35_{request.param}"), request.param == "moe")


def _chunk(model, size: int) -> None:
    for layer in model.language_model.layers:
        if layer.token_mixer == "linear_attn":
            layer.linear_attn.chunk_size = size


def test_config_is_read(pair):
    _, ours, root = pair
    t, v = ours.config.text, ours.config.vision
    hf_text = json.loads((root / "hf" / "config.json").read_text())["text_config"]
    assert t.family == hf_text["model_type"].removesuffix("_text") and t.layer_types == hf_text["layer_types"]
    assert (t.rotary_dim, t.mrope_section, t.mrope_interleaved) == (8, [2, 1, 1], True)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim) == \
        (2, 4, 8, 12)
    assert v.family == "qwen3_vl" and v.deepstack_visual_indexes == [] and ours.projector.deepstack is None


@torch.no_grad()
def test_text_only_logits_match(pair):
    hf, ours, _ = pair
    ids = torch.randint(2, 140, (1, 150), generator=torch.Generator().manual_seed(5))  # > 2 chunks of 64
    ref = hf(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
    assert rel(ours(input_ids=ids).logits, ref) <= TOL
    _chunk(ours, 16)  # the chunked recurrence does not depend on the chunk size
    try:
        assert rel(ours(input_ids=ids).logits, ref) <= TOL
    finally:
        _chunk(ours, 64)


@torch.no_grad()
def test_logits_with_images_and_a_video_match(pair):
    A.assert_logits_match(*pair[:2])


@torch.no_grad()
def test_positions_and_vision_features_match(pair):
    hf, ours, _ = pair
    A.assert_positions_match(hf, ours)
    _, _, px, _ = A.inputs()
    ref = hf.model.visual(px, grid_thw=IMAGES).pooler_output
    features, stack = ours.vision_features(px, IMAGES)
    assert rel(features, ref) <= TOL and stack == []


@torch.no_grad()
def test_bf16_is_as_accurate_as_transformers_bf16(pair):
    """In bf16 both implementations round (the delta rule itself runs in fp32 in both); ours must be no further from
    the fp32 reference than transformers'."""
    hf, _, root = pair
    A.assert_bf16_as_accurate_as_transformers(hf, root)


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(pair):
    hf, _, root = pair
    A.assert_round_trip(hf, root, type(hf).__name__)  # the MoE's experts go back per expert, as on the hub


def test_mtp_tensors_are_dropped_on_import(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, root = pair
    src = tmp_path / "hf"
    src.mkdir()
    for f in (root / "hf").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, shard, metadata={"format": "pt"})
    convert_from_hf(src, tmp_path / "mv")
    A.assert_same_tensors(tmp_path / "mv", root / "mv")


def test_greedy_generation_with_the_hybrid_cache_equals_transformers_generate(pair):
    """Three prompts batched in mindvl (images, a video, text only): the prefill stores each prompt's conv window
    and recurrent state, decode steps advance them; transformers generates each prompt alone; step logits pin the
    conv window and recurrent state across decode steps."""
    A.assert_greedy_generation_matches(*pair[:2])


def test_flops_count_linear_layers_per_token_and_attention_pairs_only_in_full_layers():
    """The planner's/MFU count for a Qwen3.5 LLM: a linear-attention layer's matmuls as the chunked rule runs them
    (measured with FlopCounterMode; the triangular solves and the conv, which it does not see, added by hand), and
    query-key pairs only for the full-attention layers."""
    from torch.utils.flop_counter import FlopCounterMode

    from mindvl.models import TextConfig
    from mindvl.models.linear_attention import GatedDeltaNet
    from mindvl.train.metrics import _text_layer_flops

    kw = dict(family="qwen3_5", vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, mrope_section=[2, 1, 1],
              mrope_interleaved=True, partial_rotary_factor=1.0, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4)
    all_linear = TextConfig(**kw, layer_types=["linear_attention"] * 4)
    layer = GatedDeltaNet(all_linear)
    c = layer.chunk_size
    lengths = [c, 2 * c]  # whole chunks: no padding, which the count leaves out
    x = torch.randn(sum(lengths), 32)
    with FlopCounterMode(display=False) as counter:
        layer(x, None, None, torch.tensor([0, c, 3 * c], dtype=torch.int32), 2 * c)
    hv, dk, dv, conv_dim = 4, 8, 12, 2 * 2 * 8 + 4 * 12
    unseen = hv * c * (dk + dv) + 2 * conv_dim * 4  # triangular solves, depthwise conv
    mlp = 2 * 3 * 32 * 40
    per_token, per_pair = _text_layer_flops(all_linear)
    assert per_pair == 0
    assert per_token == 4 * (counter.get_total_flops() / sum(lengths) + unseen + mlp)
    mixed = TextConfig(**kw, layer_types=["linear_attention", "full_attention"] * 2)
    assert _text_layer_flops(mixed)[1] == 2 * 2 * 2 * 4 * 8  # two full layers: QK^T and AV over 4 x 8 query dims


def test_train_two_packed_steps_export_and_transformers_generates_the_same(pair, tmp_path):
    """convert -> 2 AdamW steps on a packed row (two samples; every module trains) -> `convert --to-hf` ->
    transformers' `generate` equals mindvl's, and its logits equal ours."""
    import copy

    _, loaded, _ = pair
    model = copy.deepcopy(loaded).train()
    assert type(model.config).from_dict(model.config.to_dict()) == model.config  # config.json round trip
    moved = A.train_two_packed_steps(model, prompt_seed=3, rows_seed=4)
    assert any(".linear_attn.A_log" in k for k in moved) and any(".linear_attn.conv1d." in k for k in moved)
    assert any(k.startswith("visual.") for k in moved)
    A.assert_export_generates_like_transformers(model, tmp_path)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_text_only_qwen3_5_causal_lm_imports_and_exports(tmp_path, moe):
    """Qwen3_5(Moe)ForCausalLM (the language model alone, tied embeddings): logits, and a bit-exact round trip
    that transformers loads (its tensors bit for bit; its logits to float reordering)."""
    import transformers
    from qwen35_tiny import qwen35_text

    from mindvl.checkpoint.hf_export import export_to_hf

    hf = qwen35_text(tmp_path / "hf", moe=moe)
    convert_from_hf(tmp_path / "hf", tmp_path / "mv")
    ours = load_model(tmp_path / "mv")
    assert ours.visual is None and ours.config.text.family == ("qwen3_5_moe" if moe else "qwen3_5")
    ids = torch.randint(2, 140, (1, 70), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert rel(ours(input_ids=ids).logits, ref) <= TOL
    export_to_hf(tmp_path / "mv", tmp_path / "back")
    convert_from_hf(tmp_path / "back", tmp_path / "mv2")
    A.assert_same_tensors(tmp_path / "mv", tmp_path / "mv2")
    again = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path / "back",
                                                                     attn_implementation="eager").eval()
    A.assert_reload_is_exact(again, hf, input_ids=ids)


def test_config_errors_name_the_key():
    from mindvl.models import TextConfig

    base = dict(family="qwen3_5", vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.5,
                mrope_section=[1, 1, 0], mrope_interleaved=True)
    TextConfig(**base)
    cases = [
        (dict(layer_types=["linear_attention"]), "layer_types has 1 entries for 2 layers"),
        (dict(layer_types=["linear_attention", "sliding_attention"]), "layer_types ['sliding_attention'] are not"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads must be a multiple of linear_num_key_heads"),
        (dict(linear_conv_kernel_dim=None), "family 'qwen3_5' requires linear_conv_kernel_dim"),
        (dict(mrope_section=[2, 1, 1]), "must have 3 parts summing to the rotary dim / 2 = 2"),
        (dict(moe_intermediate_size=8), "moe_intermediate_size is not used by family 'qwen3_5'"),
        (dict(family="qwen3_5_moe", moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2),
         "family 'qwen3_5_moe' requires shared_expert_intermediate_size"),
        (dict(family="qwen3", layer_types=None, mrope_section=None), "linear_conv_kernel_dim is only used by family"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            TextConfig(**{**base, **change})


def test_batched_generation_drops_finished_sequences_from_the_hybrid_cache(pair):
    """Budgets of 2, 8 and 5 tokens: finished rows leave the cache (conv windows and recurrent states with them, in
    the right order); every sequence equals its own generation alone."""
    from mindvl.infer import Prompt, generate

    _, ours, _ = pair
    prompts = []
    for i, items in enumerate([[], [("image", [1, 4, 4])], []]):
        ids, _ = V.prompt(items, text=4 + 3 * i, seed=30 + i)
        grids = torch.tensor([g for _, g in items]) if items else None
        prompts.append(Prompt(ids[0], V.patch_rows(grids, 40 + i) if items else None, grids))
    batched = generate(ours, prompts, max_new_tokens=[2, 8, 5])
    for prompt, budget, got in zip(prompts, [2, 8, 5], batched, strict=True):
        assert got == generate(ours, [prompt], max_new_tokens=8)[0][:budget]


def test_chat_session_answers_with_a_qwen3_5_model_over_two_turns(tmp_path):
    """`mindvl chat`'s session on a Qwen3.5 model (16-px rows, hybrid cache): each turn's answer equals greedy decoding
    by full recomputation over the whole conversation."""
    from mindvl.infer.chat import conversation_prompt, user_message

    model, tok = A.chat_model(dict(family="qwen3_5", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.5,
                                   layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                                   linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1,
                                   linear_num_value_heads=2), depth=1, deepstack=[])
    session = A.chat_session(model, tok, A.chat_image())
    produced = []
    for question in ("What is it?", "And then?"):
        first = not session.messages
        message = user_message(question, len(session.grids) if first else 0)
        prompt = conversation_prompt(tok, [*session.messages, message], session.pixel_values, session.grids,
                                     session.system)
        tokens = A.greedy_by_recomputation(model, tok, prompt)
        assert session.ask(question) == tok.decode(tokens, skip_special_tokens=True)
        produced.append(len(tokens))
    assert max(produced) > 0
