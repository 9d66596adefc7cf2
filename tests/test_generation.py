"""KV-cache generation and chat: against full recomputation without a cache, and against transformers' generate."""

from __future__ import annotations

import hf_tiny as H
import numpy as np
import pytest
import torch
from PIL import Image
from tiny_mindvl import tiny_model_folder

from mindvl.checkpoint import convert_from_hf, load_model, save_pretrained
from mindvl.cli import main as cli_main
from mindvl.data.image import preprocess
from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, QWEN2_VL_CHAT_TEMPLATE, load_tokenizer
from mindvl.infer import Prompt, generate
from mindvl.infer.generate import filter_logits, pack_prompts
from mindvl.models import MindVL

TOL = 1e-4  # relative error vs transformers, as in test_model_alignment (measured ~3e-7)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    hf_vl = H.qwen25vl(root / "hf_vl", seed=7)
    hf_q3 = H.qwen3(root / "hf_q3", seed=8)
    convert_from_hf(root / "hf_vl", root / "vl")
    convert_from_hf(root / "hf_q3", root / "q3")
    return {"vl": (hf_vl, load_model(root / "vl")), "q3": (hf_q3, load_model(root / "q3"))}


def vl_prompts() -> list[Prompt]:
    """Three prompts of different lengths: one image, text only, two images (one of them non-square)."""
    specs = [([3, [1, 8, 8], 6], [[1, 8, 8]]), ([9], []), ([2, [1, 4, 8], 1, [1, 12, 4], 5], [[1, 4, 8], [1, 12, 4]])]
    prompts = []
    for i, (pieces, grids) in enumerate(specs):
        pixels, grid = H.random_pixels(grids, seed=30 + i) if grids else (None, None)
        prompts.append(Prompt(H.multimodal_ids(pieces, seed=20 + i), pixels, grid))
    return prompts


def text_prompts() -> list[Prompt]:
    return [Prompt(H.multimodal_ids([n], seed=40 + n)) for n in (5, 11, 8)]


PROMPTS = {"vl": vl_prompts, "q3": text_prompts}


def full_logits(model: MindVL, prompt: Prompt, generated: list[int]) -> torch.Tensor:
    """Next-token logits [V] from a full forward over prompt + generated (no cache)."""
    ids = torch.cat([prompt.input_ids, torch.tensor(generated, dtype=torch.long)])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw).logits[-1]


# ------------------------------------------------------------------------------------- cache vs recomputation


@pytest.mark.parametrize("name", ["vl", "q3"])
def test_cached_greedy_equals_argmax_of_full_recomputation(models, name):
    check_greedy_equals_recomputation(models[name][1], PROMPTS[name]())


def check_greedy_equals_recomputation(model: MindVL, prompts: list[Prompt]) -> None:
    out = generate(model, prompts, max_new_tokens=8)
    for prompt, tokens in zip(prompts, out, strict=True):
        assert len(tokens) == 8
        # A generated image-pad id would be text for the cache but an image slot for the full forward.
        assert model.config.image_token_id not in tokens
        for step in range(8):
            assert int(full_logits(model, prompt, tokens[:step]).argmax()) == tokens[step]


@pytest.mark.parametrize("name", ["vl", "q3"])
def test_prefill_and_decode_logits_equal_full_forward(models, name):
    check_prefill_and_decode_equal_full_forward(models[name][1], PROMPTS[name]())


def check_prefill_and_decode_equal_full_forward(model: MindVL, prompts: list[Prompt]) -> None:
    feed = [[5, 17, 101], [9, 2, 33], [140, 7, 64]]  # tokens fed back, per prompt
    packed = pack_prompts(prompts, torch.device("cpu"))
    with torch.inference_mode():
        cache = model.new_kv_cache(len(prompts), 64)
        logits, positions = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache,
                                          packed["pixel_values"], packed["image_grid_thw"])
        steps = [logits]
        for k in range(3):
            steps.append(model.decode_step(torch.tensor([f[k] for f in feed]), positions + k, cache))
    assert cache.lengths == [len(p.input_ids) + 3 for p in prompts]
    for b, prompt in enumerate(prompts):
        for k, got in enumerate(steps):
            torch.testing.assert_close(got[b], full_logits(model, prompt, feed[b][:k]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["vl", "q3"])
def test_prefill_runs_the_last_layer_for_the_last_tokens_only(models, name):
    """The prefill's last layer computes queries and MLP for each prompt's last token alone: its cache is the same
    bits as a full prefill's and its logits are the full forward's last rows (to float rounding)."""
    prompts = PROMPTS[name]()
    mlp_rows, n_tokens, rows, last = full_and_last_only_prefill(models[name][1], prompts)
    assert mlp_rows == [n_tokens, len(prompts)]
    assert last.shape == rows.shape == (len(prompts), rows.shape[1])
    torch.testing.assert_close(last, rows, rtol=1e-5, atol=1e-5)


def full_and_last_only_prefill(model: MindVL, prompts: list[Prompt]) -> tuple[list[int], int, torch.Tensor,
                                                                              torch.Tensor]:
    """Prefills `prompts` into two empty caches through the language model, once whole and once `last_only`; checks
    that both caches are the same bits and that `last_only` refuses a filled cache. Returns the rows the last layer's
    MLP saw per call, the packed token count, the full forward's last row per prompt and the `last_only` output."""
    lm = model.language_model
    packed = pack_prompts(prompts, torch.device("cpu"))
    embeds = model.embed(packed["input_ids"], packed["pixel_values"], packed["image_grid_thw"])
    positions = model.default_position_ids(packed["input_ids"], packed["cu_seqlens"], packed["image_grid_thw"])
    cu, width = packed["cu_seqlens"], int((packed["cu_seqlens"][1:] - packed["cu_seqlens"][:-1]).max())
    mlp_rows = []
    hook = lm.layers[-1].mlp.register_forward_hook(lambda m, args, out: mlp_rows.append(args[0].shape[0]))
    with torch.inference_mode():
        full_cache, last_cache = model.new_kv_cache(len(prompts), 64), model.new_kv_cache(len(prompts), 64)
        full = lm(embeds, positions, cu, width, cache=full_cache)
        last = lm(embeds, positions, cu, width, cache=last_cache, last_only=True)
    hook.remove()
    for a, b in zip(full_cache.keys + full_cache.values, last_cache.keys + last_cache.values, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)  # an MLA cache keeps no values
    assert full_cache.lengths == last_cache.lengths
    with pytest.raises(ValueError, match="last_only"):
        lm(embeds, positions, cu, width, cache=last_cache, last_only=True)  # not an empty cache
    return mlp_rows, int(cu[-1]), full[cu[1:].long() - 1], last


# --------------------------------------------------------------------------------------------- transformers


def hf_greedy(hf, prompt: Prompt, n: int) -> tuple[list[int], torch.Tensor]:
    ids = prompt.input_ids[None]
    kwargs = {}
    if prompt.pixel_values is not None:
        kwargs = {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
    if hasattr(hf.config, "vision_config"):
        kwargs.update(H.mm_kwargs(hf, ids))
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True, **kwargs)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits)[:, 0]


@pytest.mark.parametrize("name", ["vl", "q3"])
def test_greedy_generate_matches_transformers(models, name):
    check_greedy_matches_transformers(*models[name], PROMPTS[name]())


def check_greedy_matches_transformers(hf, model: MindVL, prompts: list[Prompt]) -> None:
    ours = generate(model, prompts, max_new_tokens=10)  # batched; transformers runs each prompt alone
    for prompt, tokens in zip(prompts, ours, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 10)
        assert tokens == ref_tokens
        # Tokens of a tiny random model barely depend on positions; the step logits do (a decode position off by
        # one gives ~1e-2), so they pin the cache and the M-RoPE continuation to transformers' rope_deltas.
        packed = pack_prompts([prompt], torch.device("cpu"))
        with torch.inference_mode():
            cache = model.new_kv_cache(1, len(prompt.input_ids) + 10)
            logits, pos = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache,
                                        packed["pixel_values"], packed["image_grid_thw"])
            steps = [logits[0]]
            for k, token in enumerate(ref_tokens[:-1]):
                steps.append(model.decode_step(torch.tensor([token]), pos + k, cache)[0])
        for got, ref in zip(steps, ref_logits, strict=True):
            assert H.rel_err(got, ref) <= TOL


# ------------------------------------------------------------------------------------ stopping and sampling


def test_stop_tokens_and_budgets_are_per_sequence(models):
    model = models["vl"][1]
    prompts = vl_prompts()
    free = generate(model, prompts, max_new_tokens=10)
    stops = {free[0][3], free[2][1]}  # the third sequence finishes first, then the first: rows leave the cache
    stopped = generate(model, prompts, max_new_tokens=10, stop_token_ids=sorted(stops))
    for full, got in zip(free, stopped, strict=True):
        first = next((i for i, t in enumerate(full) if t in stops), len(full) - 1)
        assert got == full[: first + 1]  # the stop token is kept, as transformers does
    assert len(stopped[2]) <= 2 and len(stopped[0]) <= 4 and len(stopped[1]) > 4
    budgets = generate(model, prompts, max_new_tokens=[2, 5, 1])
    assert budgets == [free[0][:2], free[1][:5], free[2][:1]]


def test_seeded_sampling_is_reproducible(models):
    model = models["vl"][1]
    prompts = vl_prompts()
    kw = dict(max_new_tokens=12, temperature=1.5, top_p=0.95, top_k=50)
    a = generate(model, prompts, seed=0, **kw)
    assert a == generate(model, prompts, seed=0, **kw)
    assert a != generate(model, prompts, seed=1, **kw)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompts, max_new_tokens=2, temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6)])
def test_filtering_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 160, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    ref = warpers(None, logits.clone())
    got = filter_logits(logits, temperature, top_p, top_k)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got.softmax(-1), ref.softmax(-1))


# ------------------------------------------------------------------------------------------------------ chat


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A tiny random MindVL on mindvl's default tokenizer, saved with it as `mindvl export` does, and a PNG."""
    root = tmp_path_factory.mktemp("chat")
    tiny_model_folder(root / "model")
    pixels = np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "image.png")
    return root


def test_chat_cli_end_to_end(chat_folder, capsys):
    from transformers import PreTrainedTokenizerFast

    folder, png = chat_folder / "model", chat_folder / "image.png"
    argv = ["chat", str(folder), "--image", str(png), "--prompt", "What does the sign say?", "--max-new-tokens", "6",
            "--min-pixels", "3136", "--max-pixels", "50176"]
    assert cli_main(argv) == 0
    answer = capsys.readouterr().out

    # Reference: the prompt rendered by transformers' chat template (generation prompt included), the image pad
    # expanded as Qwen's processor does, and greedy decoding by full recomputation.
    model, tok = load_model(folder), load_tokenizer(folder)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What does the sign say?"}]}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     chat_template=QWEN2_VL_CHAT_TEMPLATE)["input_ids"]
    pixels, (t, h, w) = preprocess(Image.open(png), 3136, 50176)
    pad = tok.special.image_pad
    k = ids.index(pad)
    prompt = Prompt(torch.tensor(ids[:k] + [pad] * (t * h * w // 4) + ids[k + 1:]), torch.from_numpy(pixels),
                    torch.tensor([[t, h, w]]))
    tokens: list[int] = []
    while len(tokens) < 6 and (not tokens or tokens[-1] not in (tok.special.im_end, tok.special.endoftext)):
        tokens.append(int(full_logits(model, prompt, tokens).argmax()))
    if tokens[-1] in (tok.special.im_end, tok.special.endoftext):
        tokens = tokens[:-1]
    assert answer == tok.decode(tokens, skip_special_tokens=True) + "\n"


def test_chat_cli_needs_a_tokenizer(chat_folder, tmp_path, capsys):
    model = load_model(chat_folder / "model")
    save_pretrained(model, tmp_path / "bare")  # no tokenizer files beside the weights
    argv = ["chat", str(tmp_path / "bare"), "--prompt", "hi", "--max-new-tokens", "2"]
    assert cli_main(argv) == 2
    assert "has no tokenizer.json; pass the tokenizer folder" in capsys.readouterr().err
    assert cli_main([*argv, "--tokenizer", str(DEFAULT_TOKENIZER_PATH.parent)]) == 0
