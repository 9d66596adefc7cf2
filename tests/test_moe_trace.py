"""Router tracing: transformers MoE families via router hooks, mindvl's DeepSeek-V3 via its routers' record flag."""

from __future__ import annotations

import json

import hf_tiny as H
import numpy as np
import pytest
import torch

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.moe_analysis.trace import trace_corpus, trace_folder
from mindvl.moe_analysis.trace_io import load_trace

LENGTHS = (7, 12, 1, 5)


def corpus(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, H.VOCAB, (n,), generator=gen) for n in LENGTHS]


def expected_topk(model, family: str, seqs) -> tuple[np.ndarray, np.ndarray]:
    """Top-k computed from the router logits transformers reports (output_router_logits), not from the hooks."""
    ids_all, w_all = [], []
    cfg = model.config
    for s in seqs:
        with torch.no_grad():
            logits = model(input_ids=s[None], output_router_logits=True).router_logits  # L x [T, E]
        ids_l, w_l = [], []
        gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
        for lg, gate in zip(logits, gates, strict=True):
            lg = lg.float()
            if family == "deepseek_v3":  # sigmoid, bias-corrected group-limited choice, weights from unbiased scores
                scores = lg.sigmoid()
                choice = scores + gate.e_score_correction_bias
                g = choice.view(len(s), cfg.n_group, -1)
                top_groups = g.topk(2, -1).values.sum(-1).topk(cfg.topk_group, -1).indices
                allowed = torch.zeros(len(s), cfg.n_group, dtype=torch.bool).scatter_(1, top_groups, True)
                choice = g.masked_fill(~allowed[..., None], -1e9).view(len(s), -1)
                ids = choice.topk(cfg.num_experts_per_tok, -1).indices
                w = scores.gather(1, ids)
                w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
                w, order = w.sort(-1, descending=True)
                ids = ids.gather(1, order)
            else:
                w, ids = lg.softmax(-1).topk(cfg.num_experts_per_tok, -1)
                if getattr(cfg, "norm_topk_prob", family == "mixtral"):
                    w = w / w.sum(-1, keepdim=True)
            ids_l.append(ids.numpy())
            w_l.append(w.numpy())
        ids_all.append(np.stack(ids_l))
        w_all.append(np.stack(w_l))
    return np.concatenate(ids_all, axis=1), np.concatenate(w_all, axis=1)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
def test_hf_trace_equals_topk_of_router_logits(family):
    model = H.moe_lm(family, seed=3)
    seqs = corpus(1)
    trace = trace_corpus(model, seqs)
    ids, weights = expected_topk(model, family, seqs)
    moe_layers = {"qwen2_moe": 2, "deepseek_v3": 2}.get(family, 3)  # mlp_only / first dense layers have no router
    assert trace.topk_ids.shape == (moe_layers, sum(LENGTHS), model.config.num_experts_per_tok)
    assert trace.topk_ids.dtype == np.int8 and trace.seq_offsets.tolist() == [0, 7, 19, 20, 25]
    assert np.array_equal(trace.topk_ids, ids), family
    np.testing.assert_allclose(trace.topk_scores.astype(np.float32), weights, rtol=2e-3, atol=1e-3)
    assert trace.layer_names[0].startswith("layers.") and trace.meta["family"] == family


def test_mindvl_trace_equals_transformers_trace_packed_or_not(tmp_path):
    hf = H.deepseek_v3(tmp_path / "hf", seed=7)
    ours = load_model(convert_from_hf(tmp_path / "hf", tmp_path / "mindvl"))
    seqs = corpus(2)
    ref = trace_corpus(hf, seqs)
    packed = trace_corpus(ours, seqs)  # all four sequences in one packed row
    one_by_one = trace_corpus(ours, seqs, max_tokens_per_forward=1)
    for got in (packed, one_by_one):
        assert np.array_equal(got.topk_ids, ref.topk_ids)
        assert got.layer_names == ref.layer_names == ["layers.1.mlp.gate", "layers.2.mlp.gate"]
        np.testing.assert_allclose(got.topk_scores.astype(np.float32), ref.topk_scores.astype(np.float32),
                                   atol=1e-3)
        assert np.array_equal(got.seq_offsets, ref.seq_offsets) and got.num_experts == 8
    bare = trace_corpus(ours.language_model, seqs)  # the TextModel alone traces the same
    assert np.array_equal(bare.topk_ids, ref.topk_ids)


def _word_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *"the cat sat on a mat and dog ran far".split()])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def test_trace_folder_for_transformers_and_mindvl_folders(tmp_path):
    hf = H.deepseek_v3(tmp_path / "hf", seed=8)
    _word_tokenizer(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "mindvl")
    lines = [{"text": "the cat sat on a mat"}, {"text": ""}, {"input_ids": [5, 6, 7]}, {"text": "dog ran far"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    a = load_trace(trace_folder(tmp_path / "hf", tmp_path / "c.jsonl", None, tmp_path / "a.npz"))
    b = load_trace(trace_folder(tmp_path / "mindvl", tmp_path / "c.jsonl", tmp_path / "hf", tmp_path / "b"))
    assert a.seq_offsets.tolist() == [0, 6, 9, 12] and a.meta["skipped_empty"] == 1
    assert np.array_equal(a.topk_ids, b.topk_ids) and b.meta["source"] == "mindvl"
    direct = trace_corpus(hf, [[1, 2, 3, 4, 5, 6], [5, 6, 7], [8, 9, 10]])
    assert np.array_equal(a.topk_ids, direct.topk_ids)


def test_trace_errors_are_clear():
    with pytest.raises(ValueError, match=r"sequences \[1\] are empty"):
        trace_corpus(H.moe_lm("mixtral"), [[1, 2], []])
    with pytest.raises(ValueError, match="has no MoE routers"):
        trace_corpus(H.qwen3(), [[1, 2]])


def test_trace_then_analyze_from_the_command_line(tmp_path):
    from mindvl.cli import main

    H.deepseek_v3(tmp_path / "hf", seed=8)
    _word_tokenizer(tmp_path / "hf")
    lines = [{"text": "the cat sat on a mat and the dog ran far"}, {"text": "a mat on the cat"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["moe-trace", str(tmp_path / "hf"), "--corpus", str(tmp_path / "c.jsonl"),
                 "--out", str(tmp_path / "t.npz")]) == 0
    trace = load_trace(tmp_path / "t.npz")
    assert trace.seq_offsets.tolist() == [0, 11, 16]
    assert main(["moe-analyze", str(tmp_path / "t.npz"), "--segments", "2,4", "--cache-ratios", "1,2",
                 "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "moe_analysis.json").is_file()
