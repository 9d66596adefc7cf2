"""MLA KV cache (latents + rope keys) for DeepSeek-V3 language models: prefill/decode logits equal full forwards,
cached greedy equals recomputation (with images), and equals transformers' DeepseekV3 `generate` (text)."""

from __future__ import annotations

import json

import hf_tiny as H
import pytest
import torch
from test_generation import (
    check_greedy_equals_recomputation,
    check_greedy_matches_transformers,
    check_prefill_and_decode_equal_full_forward,
    full_and_last_only_prefill,
    text_prompts,
    vl_prompts,
)

from mindvl.checkpoint import compose, convert_from_hf, load_model
from mindvl.infer.generate import pack_prompts
from mindvl.models import MindVL, MindVLConfig, TextConfig
from mindvl.models.kv_cache import KVCache
from mindvl.models.mla_cache import MLACache


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """'ds': a tiny DeepSeek-V3 (MLA with q-LoRA, interleaved rope, 8 experts); 'dsvl': Qwen2.5-VL's vision tower +
    a DeepSeek-V3 decoder with M-RoPE (mindvl compose), the MindVL-671B layout in miniature."""
    root = tmp_path_factory.mktemp("mla")
    hf_ds = H.deepseek_v3(root / "hf_ds", seed=11)
    H.qwen25vl(root / "hf_vl", seed=3)
    H.deepseek_v3(root / "hf_ds2", seed=4, hidden_size=40)
    (root / "hf_ds2" / "tokenizer.json").write_text(json.dumps({"added_tokens": [  # the vision token ids
        {"id": 151, "content": "<|image_pad|>"}, {"id": 152, "content": "<|video_pad|>"},
        {"id": 150, "content": "<|vision_start|>"}, {"id": 153, "content": "<|vision_end|>"}]}))
    ds = load_model(convert_from_hf(root / "hf_ds", root / "ds"))
    dsvl = load_model(compose(root / "hf_vl", root / "hf_ds2", root / "dsvl", seed=1))
    return {"ds": (hf_ds, ds), "dsvl": (None, dsvl)}


PROMPTS = {"ds": text_prompts, "dsvl": vl_prompts}


def test_cache_holds_latents_and_rope_keys(models):
    """Per layer the cache holds [B, capacity, kv_lora_rank + rope]: the normalised latent, then the rope key, of
    each token (one buffer, so a decode step's keys are a view). The first layer's latents equal its attention's
    own latent projection of the prompt tokens."""
    model = models["ds"][1]
    cfg = model.config.text
    prompts = text_prompts()[:2]
    cache = model.new_kv_cache(2, 16)
    assert isinstance(cache, MLACache)
    packed = pack_prompts(prompts, torch.device("cpu"))
    with torch.inference_mode():
        model.prefill(packed["input_ids"], packed["cu_seqlens"], cache)
        layer = model.language_model.layers[0]
        for row, prompt in enumerate(prompts):
            h = layer.input_layernorm(model.language_model.embed_tokens(prompt.input_ids))
            attn = layer.self_attn
            latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(h)[:, :cfg.kv_lora_rank])
            torch.testing.assert_close(cache.keys[0][row, :len(h), :cfg.kv_lora_rank], latent)
            assert cache.keys[0][row, :len(h), cfg.kv_lora_rank:].abs().amin(-1).gt(0).all()  # the rope keys
            assert cache.keys[0][row, len(h):].abs().sum() == 0  # nothing beyond the prompt yet
    assert cache.keys[0].shape == (2, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim) and cache.values[0] is None
    assert cache.lengths == [len(p.input_ids) for p in prompts]


@pytest.mark.parametrize("name", ["ds", "dsvl"])
def test_prefill_and_decode_logits_equal_full_forward(models, name):
    check_prefill_and_decode_equal_full_forward(models[name][1], PROMPTS[name]())  # decode: absorbed attention


@pytest.mark.parametrize("name", ["ds", "dsvl"])
def test_cached_greedy_equals_argmax_of_full_recomputation(models, name):
    check_greedy_equals_recomputation(models[name][1], PROMPTS[name]())


def test_greedy_generate_matches_transformers_deepseek_v3(models):
    check_greedy_matches_transformers(*models["ds"], text_prompts())


def test_deepseek_v3_model_folder_chats_evaluates_and_searches(tmp_path, capsys):
    """The commands that refused DeepSeek-V3 models before the MLA cache: chat, eval, search-resolution."""
    from tiny_mindvl import tiny_model_folder

    from mindvl.cli import main as cli_main
    from mindvl.eval.benchmarks import BENCHMARKS
    from mindvl.eval.runner import EvalSettings, evaluate_benchmark, read_predictions
    from mindvl.eval.synth_bench import write_synthetic_benchmarks
    from mindvl.infer import chat, load_for_chat

    px = 28 * 28
    folder = tiny_model_folder(tmp_path / "ds", moe=True)
    benches = write_synthetic_benchmarks(tmp_path / "bench", n=3, seed=1, ocr_task="digits")
    model, tok = load_for_chat(folder, device="cpu")
    assert model.config.text.is_moe
    assert cli_main(["chat", str(folder), "--prompt", "Hello", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip() == chat(model, tok, "Hello", [], max_new_tokens=4).strip()

    settings = EvalSettings(min_pixels=4 * px, max_pixels=16 * px, system=None, batch_size=2, max_new_tokens=5)
    evaluate_benchmark(model, tok, "chartqa", benches["chartqa"], settings, tmp_path / "p.jsonl")
    items = list(BENCHMARKS["chartqa"].load(benches["chartqa"]))
    for row, item in zip(read_predictions(tmp_path / "p.jsonl"), items, strict=True):  # batched == one by one
        assert row["prediction"] == chat(model, tok, item.prompt, item.images, system=None, min_pixels=4 * px,
                                         max_pixels=16 * px, max_new_tokens=5).strip()

    out = tmp_path / "search"
    assert cli_main(["search-resolution", f"ds={folder}", "--bench", f"ocrbench={benches['ocrbench']}", "--grid",
                     "4:16", "--out", str(out), "--no-system", "--limit", "2", "--max-new-tokens", "3",
                     "--device", "cpu"]) == 0
    assert set(json.loads((out / "results.json").read_text())["scores"]["ds"]["ocrbench"]) == {"min4_max16"}


def _dense_mla_model() -> MindVL:
    """A DeepSeek-V3-shaped decoder whose layers are all dense (first_k_dense_replace = num_hidden_layers)."""
    kw = {k: v for k, v in H.DEEPSEEK_KW.items() if k != "num_key_value_heads"}
    model = MindVL(MindVLConfig(text=TextConfig(family="deepseek_v3", **{**kw, "first_k_dense_replace": 3}),
                                vision=None))
    model.init_weights(seed=2)
    return model.eval()


@pytest.mark.parametrize("name", ["ds", "dsvl", "dense_mla"])
def test_prefill_last_only_keeps_the_last_rows(models, name):
    """`last_only` (the prefill's form) returns each prompt's last hidden state with the cache of a full prefill. A
    MoE last layer runs whole, so its rows are the same bits as the full forward's (grouped GEMMs round differently
    on fewer rows); a dense MLA last layer runs o_proj and its MLP for those rows alone (equal to float rounding)."""
    model = _dense_mla_model() if name == "dense_mla" else models[name][1]
    prompts = (text_prompts if name != "dsvl" else vl_prompts)()
    mlp_rows, n_tokens, rows, last = full_and_last_only_prefill(model, prompts)
    if name == "dense_mla":
        assert mlp_rows == [n_tokens, len(prompts)]
        torch.testing.assert_close(last, rows, rtol=1e-5, atol=1e-5)
    else:
        assert mlp_rows == [n_tokens, n_tokens]
        assert torch.equal(last, rows)


def test_a_cache_of_the_wrong_kind_is_refused(models):
    model = models["ds"][1]
    gqa_cache = KVCache(len(model.language_model.layers), 1, 8)
    with pytest.raises(ValueError, match="needs a MLACache of 3 layers .* got a KVCache"):
        model.prefill(torch.tensor([5, 6, 7]), torch.tensor([0, 3], dtype=torch.int32), gqa_cache)
