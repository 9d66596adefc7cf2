"""DeepSeek-V3-style MoE language model: alignment with transformers, packing, conversion, training, balancing.

Tolerance: float32 relative error ||a - b|| / ||b|| <= 1e-4 (measured: ~2e-7).
"""

from __future__ import annotations

import json

import hf_tiny as H
import pytest
import torch
from safetensors.torch import load_file, save_file
from vl_alignment import assert_reload_is_exact

from mindvl.checkpoint import compose, convert_from_hf, load_model
from mindvl.checkpoint.hf_export import export_to_hf
from mindvl.models import MindVLConfig, TextConfig
from mindvl.models.mla import MLAttention
from mindvl.models.moe import MoE, TopKRouter, record_routing, routers, update_router_bias

TOL = 1e-4
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=0.707,
            mscale_all_dim=1.0)
VARIANTS = {
    "qlora-groups": {},  # q_lora_rank 24, 4 groups / top-2 groups, 1 dense layer, shared expert, interleaved rope
    "no-qlora-2dense-tied": dict(q_lora_rank=None, first_k_dense_replace=2, num_hidden_layers=4,
                                 tie_word_embeddings=True, n_shared_experts=2, norm_topk_prob=False),
    "plain-rope-1group-bias": dict(rope_interleave=False, n_group=1, topk_group=1, num_experts_per_tok=3,
                                   attention_bias=True),
    "yarn": dict(rope_scaling=YARN, max_position_embeddings=128),  # positions past original_max_position_embeddings
}


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, H.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ds_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    hf = H.deepseek_v3(root / "hf", seed=5)
    convert_from_hf(root / "hf", root / "mindvl")
    return root, hf


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    hf = H.deepseek_v3(tmp_path / "hf", seed=1, **VARIANTS[variant])
    ours = load_model(convert_from_hf(tmp_path / "hf", tmp_path / "mindvl"))
    layers = ours.language_model.layers  # one decoder, MLA + MoE layers from its factory
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    assert isinstance(layers[-1].mlp, MoE)
    ids = ids_of(50, seed=2)[None]
    with torch.no_grad():
        err = H.rel_err(ours(input_ids=ids).logits, hf(input_ids=ids).logits)
    assert err <= TOL, f"{variant}: relative error {err:.2e}"


def test_packed_row_equals_separate_forwards(ds_folder):
    root, _ = ds_folder
    model = load_model(root / "mindvl")
    a, b = ids_of(9, 3), ids_of(14, 4)
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b]), cu_seqlens=cu).logits
        sep = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits])
        # Data pipelines hand [3, T] positions to 1-D RoPE models: the temporal row is used.
        pos = torch.cat([torch.arange(9), torch.arange(14)]).expand(3, -1)
        lm = model.language_model
        from_rows = lm.logits(lm(lm.embed_tokens(torch.cat([a, b])), pos, cu, 14))
    assert H.rel_err(packed, sep) <= 1e-6
    assert H.rel_err(from_rows, sep) <= 1e-6


def test_hf_round_trip_is_exact_and_reloads_in_transformers(ds_folder, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    root, hf = ds_folder
    export_to_hf(root / "mindvl", tmp_path / "back")
    original, back = load_file(root / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in back  # the hub's per-expert form
    reloaded = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert_reload_is_exact(reloaded, hf, input_ids=ids_of(20, 6)[None])


def test_fused_experts_mtp_layers_and_fp8_on_disk(ds_folder, tmp_path):
    """transformers 5's in-memory fused experts read like the hub's per-expert ones; MTP layers are dropped."""
    root, hf = ds_folder
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    state["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer (index == num_hidden_layers)
    save_file(state, fused / "model.safetensors")
    (fused / "config.json").write_text((root / "hf" / "config.json").read_text())
    a = load_model(convert_from_hf(fused, tmp_path / "a")).state_dict()
    b = load_model(root / "mindvl").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state["model.layers.1.self_attn.o_proj.weight_scale_inv"] = torch.ones(1)
    save_file(state, fused / "model.safetensors")
    with pytest.raises(ValueError, match="FP8 checkpoint"):
        convert_from_hf(fused, tmp_path / "b")


def test_router_bias_stays_float32(ds_folder):
    root, _ = ds_folder
    model = load_model(root / "mindvl", dtype=torch.bfloat16)
    bias = model.language_model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and model.language_model.layers[1].mlp.experts.gate_proj.dtype == torch.bfloat16
    assert model.float().to(torch.bfloat16).language_model.layers[2].mlp.gate.e_score_correction_bias.dtype == \
        torch.float32
    assert torch.isfinite(model(input_ids=ids_of(7, 1)).logits).all()


# ------------------------------------------------------------------------------------------ MindVL + training


def test_mindvl_with_moe_llm_keeps_text_logits_and_trains(tmp_path):
    H.qwen25vl(tmp_path / "vl", seed=3)
    hf = H.deepseek_v3(tmp_path / "ds", seed=4, hidden_size=40)
    (tmp_path / "ds" / "tokenizer.json").write_text(json.dumps({"added_tokens": [  # the vision token ids
        {"id": 151, "content": "<|image_pad|>"}, {"id": 152, "content": "<|video_pad|>"},
        {"id": 150, "content": "<|vision_start|>"}, {"id": 153, "content": "<|vision_end|>"}]}))
    model = load_model(compose(tmp_path / "vl", tmp_path / "ds", tmp_path / "c", seed=1))
    assert model.config.text.mrope_section == [1, 1, 2]  # the rotary width (qk_rope_head_dim 8) is split
    text = ids_of(17, 8)[None]
    with torch.no_grad():  # M-RoPE with equal rows is 1-D RoPE: the composed model keeps the LLM's text logits
        assert H.rel_err(model(input_ids=text).logits, hf(input_ids=text).logits) <= TOL

    ids = torch.cat([H.multimodal_ids([3, [1, 8, 8], 5], seed=1), H.multimodal_ids([11], seed=2)])
    cu = torch.tensor([0, 26, 37], dtype=torch.int32)
    pixels, grid = H.random_pixels([[1, 8, 8]], seed=3)
    labels = ids.clone()
    labels[ids == H.IMAGE_TOKEN] = -100
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(4):
        out = model(input_ids=ids, labels=labels, cu_seqlens=cu, pixel_values=pixels, image_grid_thw=grid)
        loss = out.loss_sum / out.num_tokens
        opt.zero_grad()
        loss.backward()
        if step == 0:
            moe = model.language_model.layers[1].mlp
            assert moe.gate.weight.grad.abs().sum() > 0 and moe.experts.down_proj.grad is not None
            assert model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
            assert int(moe.gate.expert_load.sum()) == 37 * 2  # every token counted top-k times
        opt.step()
        update_router_bias(model, rate=1e-3)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] * 0.9, losses
    assert all(int(r.expert_load.sum()) == 0 for r in routers(model))  # counts reset by the update
    assert any(float(r.e_score_correction_bias.abs().sum()) > 0 for r in routers(model))


def test_eval_forwards_do_not_count_load(ds_folder):
    root, _ = ds_folder
    model = load_model(root / "mindvl")  # eval mode
    with torch.no_grad():
        model(input_ids=ids_of(5, 0))
    assert all(int(r.expert_load.sum()) == 0 for r in routers(model))


# ----------------------------------------------------------------------------------------------- balancing


def _routers_with_loads(*loads: list[int]) -> torch.nn.Module:
    cfg = TextConfig(family="deepseek_v3", hidden_size=8, moe_intermediate_size=4, n_routed_experts=4,
                     num_experts_per_tok=1, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)
    holder = torch.nn.ModuleList(TopKRouter(cfg) for _ in loads)
    for router, load in zip(holder, loads, strict=True):
        router.expert_load.copy_(torch.tensor(load))
        router.e_score_correction_bias.copy_(torch.tensor([0.5, 0.0, -0.5, 0.25]))
    return holder


def test_update_router_bias_by_hand():
    holder = _routers_with_loads([6, 2, 0, 4], [3, 3, 3, 3])
    # layer 0: mean 3 -> sign(3 - load) = [-1, +1, +1, -1]; layer 1: balanced, sign(0) = 0 -> unchanged.
    max_vio = update_router_bias(holder, rate=0.01)
    torch.testing.assert_close(holder[0].e_score_correction_bias, torch.tensor([0.49, 0.01, -0.49, 0.24]))
    torch.testing.assert_close(holder[1].e_score_correction_bias, torch.tensor([0.5, 0.0, -0.5, 0.25]))
    assert max_vio == pytest.approx(6 / 3 - 1)
    assert all(int(r.expert_load.sum()) == 0 for r in holder)


def test_update_router_bias_sums_counts_over_ranks():
    holder = _routers_with_loads([6, 2, 0, 4])
    other_rank = torch.tensor([[0, 0, 9, 3]])  # summed: [6, 2, 9, 7], mean 6 -> signs [0, +1, -1, -1]
    calls = []

    def all_reduce(t):  # in place, like torch.distributed.all_reduce
        calls.append(t.shape)
        t += other_rank

    update_router_bias(holder, rate=0.1, all_reduce=all_reduce)
    assert calls == [torch.Size([1, 4])]  # one collective for all layers
    torch.testing.assert_close(holder[0].e_score_correction_bias, torch.tensor([0.5, 0.1, -0.6, 0.15]))


def test_recorded_routing_is_in_descending_weight_order(ds_folder):
    root, _ = ds_folder
    model = load_model(root / "mindvl")
    with record_routing(model) as rs, torch.no_grad():
        model(input_ids=ids_of(12, 9))
    assert len(rs) == 2 and all(len(r.records) == 1 for r in rs)
    ids, weights = rs[0].records[0]
    assert ids.shape == weights.shape == (12, 2)
    assert bool((weights[:, 0] >= weights[:, 1]).all()) and not rs[0].record


# ------------------------------------------------------------------------------------------------- config


def test_config_validation_names_the_key():
    base = dict(family="deepseek_v3", moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
                kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    cfg = TextConfig(**base)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.n_group, cfg.n_shared_experts) == (4, 32, 1, 0)
    with pytest.raises(ValueError, match="requires kv_lora_rank"):
        TextConfig(**{**base, "kv_lora_rank": None})
    with pytest.raises(ValueError, match=r"topk_group \(3\) must be <= n_group \(2\)"):
        TextConfig(**{**base, "n_group": 2, "topk_group": 3})
    with pytest.raises(ValueError, match="n_routed_experts \\(8\\) must be divisible by n_group \\(3\\)"):
        TextConfig(**{**base, "n_group": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok \\(3\\) exceeds"):
        TextConfig(**{**base, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3})
    with pytest.raises(ValueError, match="n_routed_experts is only used by family 'deepseek_v3'"):
        TextConfig(family="qwen3", n_routed_experts=8)
    with pytest.raises(ValueError, match="rope_scaling type 'linear'"):
        TextConfig(**{**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    full = MindVLConfig(text=cfg)
    assert MindVLConfig.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    old = MindVLConfig(text=TextConfig(family="qwen3")).to_dict()  # a config.json written before the MoE keys
    old["text"] = {k: v for k, v in old["text"].items() if v is not None and k != "attention_bias"}
    assert MindVLConfig.from_dict(old).text.n_routed_experts is None
