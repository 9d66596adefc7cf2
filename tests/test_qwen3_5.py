"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, natively multimodal; dense and MoE) against transformers 5.23
on a tiny random model: logits (text, images + a video), positions, vision features, greedy generation with the
hybrid cache, and conversion both ways (bit-exact round trip, transformers loads the export, `mtp.*` dropped)."""

from __future__ import annotations

import json
import re

import pytest
import qwen3vl_tiny as V
import torch
from qwen35_tiny import qwen35

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.checkpoint.hf_export import export_to_hf
from mindvl.checkpoint.safetensors_io import TensorFolder

IMAGES = torch.tensor([[1, 6, 10], [1, 4, 4]])
VIDEOS = torch.tensor([[2, 4, 6]])
ITEMS = [("image", [1, 6, 10]), ("video", [2, 4, 6]), ("image", [1, 4, 4])]
TOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"qwen35_{request.param}")
    hf = qwen35(root / "hf", moe=request.param == "moe")
    convert_from_hf(root / "hf", root / "mv")
    ours = load_model(root / "mv")
    ours.set_attention_backend("sdpa")
    return hf, ours, root


def _inputs():
    ids, kinds = V.prompt(ITEMS)
    return ids, kinds, V.patch_rows(IMAGES, 1), V.patch_rows(VIDEOS, 2)


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
    hf, ours, _ = pair
    ids, kinds, px, pv = _inputs()
    ref = hf(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS,
             mm_token_type_ids=kinds).logits
    got = ours(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv,
               video_grid_thw=VIDEOS).logits
    assert rel(got, ref) <= TOL
    n1 = int(IMAGES[0].prod())  # mindvl's packed one-stream form
    stream_px = torch.cat([px[:n1], pv, px[n1:]])
    stream = torch.cat([IMAGES[:1], VIDEOS, IMAGES[1:]])
    assert rel(ours(input_ids=ids[0], pixel_values=stream_px, image_grid_thw=stream).logits, ref[0]) <= TOL


@torch.no_grad()
def test_positions_and_vision_features_match(pair):
    hf, ours, _ = pair
    ids, kinds, px, _ = _inputs()
    pos, _ = hf.model.get_rope_index(ids, kinds, IMAGES, VIDEOS)
    cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
    assert torch.equal(ours.default_position_ids(ids[0], cu, IMAGES, VIDEOS), pos[:, 0])
    ref = hf.model.visual(px, grid_thw=IMAGES).pooler_output
    features, stack = ours.vision_features(px, IMAGES)
    assert rel(features, ref) <= TOL and stack == []


@torch.no_grad()
def test_bf16_is_as_accurate_as_transformers_bf16(pair):
    """In bf16 both implementations round (the delta rule itself runs in fp32 in both); ours must be no further from
    the fp32 reference than transformers'."""
    hf, _, root = pair
    ids, kinds, px, pv = _inputs()
    kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS)
    ref = hf(**kw, mm_token_type_ids=kinds).logits
    hf16 = type(hf).from_pretrained(root / "hf", dtype=torch.bfloat16, attn_implementation="eager",
                                    experts_implementation="eager").eval()
    ours16 = load_model(root / "mv", dtype=torch.bfloat16)
    err_hf = rel(hf16(**kw, mm_token_type_ids=kinds).logits.float(), ref)
    err_ours = rel(ours16(**kw).logits.float(), ref)
    assert err_ours <= 1.5 * err_hf + 1e-3, (err_ours, err_hf)


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(pair):
    hf, _, root = pair
    export_to_hf(root / "mv", root / "back")
    convert_from_hf(root / "back", root / "mv2")
    first, second = dict(TensorFolder(root / "mv").iter_tensors()), dict(TensorFolder(root / "mv2").iter_tensors())
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    import transformers

    arch = type(hf).__name__  # the MoE's experts go back per expert, as on the hub; transformers fuses them
    again = getattr(transformers, arch).from_pretrained(root / "back", attn_implementation="eager").eval()
    assert set(again.state_dict()) == set(hf.state_dict())
    ids, kinds, px, pv = _inputs()
    kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS,
              mm_token_type_ids=kinds)
    with torch.no_grad():
        assert torch.equal(again(**kw).logits, hf(**kw).logits)


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
    got = dict(TensorFolder(tmp_path / "mv").iter_tensors())
    want = dict(TensorFolder(root / "mv").iter_tensors())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_greedy_generation_with_the_hybrid_cache_equals_transformers_generate(pair):
    """Three prompts batched in mindvl (images, a video, text only): the prefill stores each prompt's conv window
    and recurrent state, decode steps advance them; transformers generates each prompt alone."""
    from mindvl.infer import Prompt, generate

    hf, ours, _ = pair
    specs = [[("image", [1, 6, 10])], [("video", [2, 4, 6]), ("image", [1, 4, 4])], []]
    prompts, hf_inputs = [], []
    for i, items in enumerate(specs):
        ids, kinds = V.prompt(items, seed=10 + i)
        kw = {"input_ids": ids, "mm_token_type_ids": kinds, "attention_mask": torch.ones_like(ids)}
        rows = [V.patch_rows(torch.tensor([g]), seed=20 + i + j) for j, (_, g) in enumerate(items)]
        for kind, key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                    ("video", "pixel_values_videos", "video_grid_thw")):
            picked = [(r, g) for r, (k, g) in zip(rows, items, strict=True) if k == kind]
            if picked:
                kw[key] = torch.cat([r for r, _ in picked])
                kw[grid_key] = torch.tensor([g for _, g in picked])
        grids = torch.tensor([g for _, g in items]) if items else None
        prompts.append(Prompt(ids[0], torch.cat(rows) if rows else None, grids))
        hf_inputs.append(kw)
    got = generate(ours, prompts, max_new_tokens=8)
    for tokens, kw, prompt in zip(got, hf_inputs, prompts, strict=True):
        with torch.no_grad():
            out = hf.generate(**kw, do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, kw["input_ids"].shape[1]:].tolist()
        assert tokens == ref
        cu = torch.tensor([0, len(prompt.input_ids)], dtype=torch.int32)
        with torch.inference_mode():  # step logits pin the conv window and recurrent state across decode steps
            cache = ours.new_kv_cache(1, len(prompt.input_ids) + 8)
            logits, pos = ours.prefill(prompt.input_ids, cu, cache, prompt.pixel_values, prompt.image_grid_thw)
            steps = [logits[0]]
            for k, token in enumerate(ref[:-1]):
                steps.append(ours.decode_step(torch.tensor([token]), pos + k, cache)[0])
        for step, want in zip(steps, out.logits, strict=True):
            assert rel(step, want[0]) <= TOL


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

    import transformers

    from mindvl.checkpoint import save_pretrained
    from mindvl.cli import main as cli_main
    from mindvl.infer import Prompt, generate

    _, loaded, _ = pair
    model = copy.deepcopy(loaded).train()
    assert type(model.config).from_dict(model.config.to_dict()) == model.config  # config.json round trip
    ids, kinds, px, pv = _inputs()
    short, _ = V.prompt([("image", [1, 4, 4])], seed=3)
    n1 = int(IMAGES[0].prod())
    stream_px = torch.cat([px[:n1], pv, px[n1:], V.patch_rows(IMAGES[1:], 4)])
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
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert any(".linear_attn.A_log" in k for k in moved) and any(".linear_attn.conv1d." in k for k in moved)
    assert any(k.startswith("visual.") for k in moved)
    model.eval()
    save_pretrained(model, tmp_path / "trained")
    assert cli_main(["convert", "--to-hf", str(tmp_path / "trained"), "--out", str(tmp_path / "hf")]) == 0
    hf = getattr(transformers, json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]) \
        .from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
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


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_text_only_qwen3_5_causal_lm_imports_and_exports(tmp_path, moe):
    """Qwen3_5(Moe)ForCausalLM (the language model alone, tied embeddings): logits, and a bit-exact round trip
    that transformers loads."""
    import transformers
    from qwen35_tiny import qwen35_text

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
    first = dict(TensorFolder(tmp_path / "mv").iter_tensors())
    second = dict(TensorFolder(tmp_path / "mv2").iter_tensors())
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    again = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path / "back",
                                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, ref)


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
    import numpy as np
    from PIL import Image

    from mindvl.data.tokenizer import load_tokenizer
    from mindvl.infer.chat import ChatSession, conversation_prompt, user_message
    from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

    tok = load_tokenizer(None)
    sp = tok.special
    cfg = MindVLConfig(
        text=TextConfig(family="qwen3_5", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.5,
                        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1,
                        linear_num_value_heads=2),
        vision=VisionConfig(family="qwen3_vl", depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                            patch_size=16, hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                            deepstack_visual_indexes=[]),
        image_token_id=sp.image_pad, video_token_id=sp.video_pad, vision_start_token_id=sp.vision_start,
        vision_end_token_id=sp.vision_end)
    model = MindVL(cfg)
    model.init_weights(seed=1, std=0.1)
    model.eval()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8))
    session = ChatSession(model, tok, [image], min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, max_new_tokens=4)
    produced = []
    for question in ("What is it?", "And then?"):
        first = not session.messages
        message = user_message(question, len(session.grids) if first else 0)
        prompt = conversation_prompt(tok, [*session.messages, message], session.pixel_values, session.grids,
                                     session.system)
        tokens: list[int] = []
        with torch.no_grad():
            while len(tokens) < 4 and (not tokens or tokens[-1] not in (sp.im_end, sp.endoftext)):
                ids = torch.cat([prompt.input_ids, torch.tensor(tokens, dtype=torch.long)])
                logits = model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
                tokens.append(int(logits.logits[-1].argmax()))
        if tokens[-1] in (sp.im_end, sp.endoftext):
            tokens = tokens[:-1]
        assert session.ask(question) == tok.decode(tokens, skip_special_tokens=True)
        produced.append(len(tokens))
    assert max(produced) > 0
