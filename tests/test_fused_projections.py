"""q/k/v and gate/up as one matmul each in a decode step (mindvl.infer.fused_projections).

The reference is the same model with its projections apart: the tokens (every family, greedy, budgets and stops),
a bf16 step's logits bit for bit, the parameters (the same objects, values and checkpoint), and a training step
after a fused generation (an untouched copy's gradients). The matmul count of one decode step proves the fused path
ran: it drops by exactly 2 per fused attention and 1 per fused MLP."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from family_models import TEXT, build
from test_static_decode import budgets_and_stops, prefilled, prompts_for
from torch.overrides import TorchFunctionMode

from mindvl.checkpoint import load_model, save_pretrained
from mindvl.infer import generate
from mindvl.infer.fused_projections import FUSE_ENV, fused_projections
from mindvl.models.gated_attention import GatedAttention
from mindvl.models.layers import GatedMLP
from mindvl.models.lora import LoRAConfig, inject_lora
from mindvl.models.text import GQAttention


class CountLinear(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def step_linears(model, fused: bool) -> tuple[int, torch.Tensor]:
    """(F.linear calls, logits) of one decode step over a fresh prefill of prompts_for's prompts."""
    with torch.inference_mode(), fused_projections(model) if fused else contextlib.nullcontext():
        cache, logits, positions = prefilled(model, prompts_for(model))
        with CountLinear() as count:
            logits = model.decode_step(logits.argmax(-1), positions, cache)
    return count.calls, logits


def groups(model) -> tuple[int, int]:
    """(attentions, MLPs) whose projections can fuse: every GQA/gated attention, every dense MLP (shared experts
    included)."""
    mods = list(model.language_model.modules())
    return (sum(type(m) in (GQAttention, GatedAttention) for m in mods), sum(type(m) is GatedMLP for m in mods))


def adjacent(*params) -> bool:
    """Whether the parameters lie one after another in one storage."""
    offset = params[0].storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() != params[0].untyped_storage().data_ptr() or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


@pytest.mark.parametrize("name", list(TEXT))
def test_fused_projections_keep_the_tokens_and_save_one_matmul_per_extra_projection(name):
    model = build(name)
    prompts, budgets, stops, _, want = budgets_and_stops(model)
    attentions, mlps = groups(model)
    assert mlps >= 2 and (attentions >= 2 or name == "moe_mla")  # MLA's projections are not fused
    apart, apart_logits = step_linears(model, fused=False)
    with fused_projections(model) as fused:
        assert fused == attentions + mlps
        assert generate(model, prompts, budgets, stop_token_ids=stops, sync_every=3) == want
    together, together_logits = step_linears(model, fused=True)
    assert apart - together == 2 * attentions + mlps
    # fp32 matmuls of another width may take another kernel of the library (MKL's narrow-output path for the
    # dense model's 8-wide k/v here), so the last bits may differ: the tolerance is fp32's for a 40-long dot.
    torch.testing.assert_close(apart_logits, together_logits, rtol=1e-5, atol=1e-5)
    # Outside the context every module is back to its projections one by one.
    assert all(m.fused_qkv is None for m in model.modules() if type(m) in (GQAttention, GatedAttention))
    assert all(m.fused_gate_up is None for m in model.modules() if type(m) is GatedMLP)


@pytest.mark.parametrize("name", ["dense", "qwen3_5"])
def test_a_bf16_decode_step_is_bit_identical_fused(name):
    """The fused matmul rounds each output as the separate ones do (on the CPU: checked here in bf16, where a
    different blocking of the reduction would show)."""
    model = build(name).to(torch.bfloat16)
    _, apart = step_linears(model, fused=False)
    _, together = step_linears(model, fused=True)
    assert torch.equal(apart, together)


def test_the_parameters_stay_the_same_objects_values_and_checkpoint(tmp_path):
    model = build("dense")
    ids = {n: id(p) for n, p in model.named_parameters()}
    before = {n: t.clone() for n, t in model.state_dict().items()}
    prompts = prompts_for(model)
    with fused_projections(model):
        generate(model, prompts, 4)
    attn, mlp = model.language_model.layers[0].self_attn, model.language_model.layers[0].mlp
    assert adjacent(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    assert adjacent(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)  # qwen2: qkv bias
    assert adjacent(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert {n: id(p) for n, p in model.named_parameters()} == ids
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # A second fusion finds them laid out: no copy (the storage stays where it is).
    where = attn.q_proj.weight.data_ptr()
    with fused_projections(model):
        pass
    assert attn.q_proj.weight.data_ptr() == where
    save_pretrained(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)


@pytest.fixture
def aot_eager(use_backend):
    """Compiled decode steps with the traced aten ops (conftest's use_backend)."""
    use_backend("aot_eager")


def test_training_after_a_fused_generation_matches_an_untouched_copy(aot_eager):
    """Parameters moved into the fused buffer (by a compiled generation, under inference mode: evaluation during
    training) stay ordinary leaves: the loss, every gradient and an optimizer step equal an untouched copy's, bit
    for bit."""
    model = build("qwen3_vl")
    twin = copy.deepcopy(model)
    generate(model, prompts_for(model), 3, compile=True)
    attn = model.language_model.layers[0].self_attn
    assert adjacent(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    ids = torch.randint(0, 190, (23,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 10, 23], dtype=torch.int32)
    results = []
    for m in (model, twin):
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss = m(ids, cu_seqlens=cu, labels=ids).loss_sum
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        opt.step()
        results.append((loss.detach(), grads, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (loss_a, grads_a, after_a), (loss_b, grads_b, after_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)
    assert model.language_model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_lora_and_hooked_projections_stay_apart():
    """A LoRA projection (the fused matmul would skip its adapter) and a hooked one (its hook would not run) are not
    fused; the rest are, and the tokens are the unfused model's."""
    model = build("qwen3_vl")
    inject_lora(model, LoRAConfig(r=2, targets=["v_proj"]))
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_B"):
            torch.nn.init.normal_(layer.lora_B, std=0.5)  # an adapter that changes the tokens
    seen = []
    model.language_model.layers[0].mlp.up_proj.register_forward_hook(lambda *_: seen.append(1))
    prompts = prompts_for(model)
    want = generate(model, prompts, 6, engine="eager")
    calls = len(seen)
    with fused_projections(model) as fused:
        assert fused == groups(model)[1] - 1  # the MLPs but the hooked one; no attention
        assert generate(model, prompts, 6) == want
    assert len(seen) - calls == calls  # the hook ran at every step


def test_a_model_made_under_inference_mode_fuses_there():
    """Its parameters are inference tensors: moved and viewed under inference mode (outside it, a view of them
    fails), and the tokens are the unfused model's."""
    with torch.inference_mode():
        model = build("qwen3_5")
    prompts = prompts_for(model)
    want = generate(model, prompts, 6, engine="eager")
    with fused_projections(model) as fused:
        assert fused == sum(groups(model))
        assert generate(model, prompts, 6) == want


def test_moved_parameters_are_gathered_again():
    model = build("dense")
    prompts = prompts_for(model)
    with fused_projections(model):
        generate(model, prompts, 3)
    model.to(torch.float64)  # new storage for every parameter
    attn = model.language_model.layers[1].self_attn
    assert not adjacent(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    want = generate(model, prompts, 8, engine="eager")
    with fused_projections(model):
        assert generate(model, prompts, 8) == want
    assert adjacent(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("fuse", ["", "off"])
def test_a_compiled_generation_fuses_unless_switched_off(fuse, aot_eager, monkeypatch):
    monkeypatch.setenv(FUSE_ENV, fuse)
    model = build("dense")
    prompts = prompts_for(model)
    want = generate(model, prompts, 6, engine="eager")
    assert generate(model, prompts, 6, compile=True) == want
    mlp = model.language_model.layers[1].mlp
    assert adjacent(mlp.gate_proj.weight, mlp.up_proj.weight) == (fuse != "off")


def test_a_nested_fusion_leaves_the_outer_ones_attachments():
    """generate(compile=True) inside a caller's own fused_projections: the inner context fuses nothing more and
    detaches nothing; the outer one detaches everything."""
    model = build("dense")
    mlp = model.language_model.layers[0].mlp
    with fused_projections(model) as outer:
        attached = mlp.fused_gate_up
        with fused_projections(model) as inner:
            assert inner == 0 and mlp.fused_gate_up is attached
        assert outer == 4 and mlp.fused_gate_up is attached
    assert mlp.fused_gate_up is None
