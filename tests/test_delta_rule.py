"""Qwen3.5's linear attention on packed rows: the chunked gated delta rule and the short conv against plain per-token
references, and a whole Qwen3.5 model on a packed row against each sample run alone (outputs and gradients).

transformers' torch fallbacks ignore `cu_seqlens` (they carry state across samples), so the packed references here
are per-sample runs; transformers' recurrent fallback is used per sample as a second reference for the rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig
from mindvl.models.delta_rule import (
    causal_conv1d,
    causal_conv1d_step,
    conv_states,
    gated_delta_rule,
    gated_delta_step,
)

LENGTHS = [5, 70, 1, 33, 130]  # a one-token sample, samples shorter than, equal to and longer than several chunks


def _cu(lengths):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def _inputs(seed=0, hk=2, hv=4, dk=8, dv=6):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -0.3 * torch.rand(t, hv, generator=gen)  # slow decay: a state leaking across samples would show
    beta = torch.rand(t, hv, generator=gen)
    return q, k, v, g, beta


def _reference(q, k, v, g, beta, state=None):
    """The recurrence token by token, float64, for ONE sample (written from its definition, no chunks)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    q = q / q.norm(dim=-1, keepdim=True).pow(2).add(1e-6).sqrt() * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).pow(2).add(1e-6).sqrt()
    s = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float64) if state is None else state.double()
    out = []
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + torch.einsum("hk,hv->hkv", k[t], u)
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("form", ["tensor", "host"])
def test_packed_chunked_rule_equals_each_sample_token_by_token(chunk, form):
    """Offsets as a tensor (read once) or as host ints (a `PackLayout`'s: the chunk plan is made on the host)."""
    q, k, v, g, beta = _inputs()
    cu = _cu(LENGTHS)
    o, states = gated_delta_rule(q, k, v, g, beta, cu if form == "tensor" else tuple(cu.tolist()), chunk_size=chunk)
    assert o.shape == v.shape and states.shape == (len(LENGTHS), 4, 8, 6)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        want, final = _reference(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b])
        assert (o[a:b].double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert (states[i].double() - final).abs().max() <= 1e-5 * final.abs().max()


def test_packed_rule_matches_transformers_recurrent_fallback_per_sample():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _inputs(1)
    cu = _cu(LENGTHS)
    o, states = gated_delta_rule(q, k, v, g, beta, cu, chunk_size=16)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ref, final = torch_recurrent_gated_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                                                      beta[None, a:b], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
        assert (o[a:b] - ref[0]).abs().max() <= 1e-5 * ref.abs().max()
        assert (states[i] - final[0]).abs().max() <= 1e-5 * final.abs().max()


def test_the_state_does_restart_at_boundaries():
    """Run as one sample, the later samples' outputs change: the reset is what the packed test checks."""
    q, k, v, g, beta = _inputs()
    total = sum(LENGTHS)
    packed, _ = gated_delta_rule(q, k, v, g, beta, _cu(LENGTHS), chunk_size=16)
    joined, _ = gated_delta_rule(q, k, v, g, beta, _cu([total]), chunk_size=16)
    start = LENGTHS[0]
    assert (packed[start:start + 4] - joined[start:start + 4]).abs().max() > 1e-2


def test_initial_state_and_steps_continue_a_prefix():
    """A prefill's final states, then one token at a time (decoding), equal the whole sequences."""
    q, k, v, g, beta = _inputs(2)
    cut = [n // 2 for n in LENGTHS]
    cu = _cu(LENGTHS)
    whole, final = gated_delta_rule(q, k, v, g, beta, cu, chunk_size=16)
    starts = cu[:-1].long()
    head = torch.cat([torch.arange(a, a + c) for a, c in zip(starts.tolist(), cut, strict=True)])
    _, states = gated_delta_rule(q[head], k[head], v[head], g[head], beta[head], _cu(cut), chunk_size=16)
    steps = max(n - c for n, c in zip(LENGTHS, cut, strict=True))
    for j in range(steps):  # sequences that already ended repeat their last token; their result is discarded
        idx = torch.tensor([min(a + c + j, a + n - 1) for a, c, n in zip(starts.tolist(), cut, LENGTHS,
                                                                          strict=True)])
        live = torch.tensor([c + j < n for c, n in zip(cut, LENGTHS, strict=True)])
        o, new = gated_delta_step(q[idx], k[idx], v[idx], g[idx], beta[idx], states)
        assert (o[live] - whole[idx[live]]).abs().max() <= 1e-5 * whole.abs().max()
        states = torch.where(live[:, None, None, None], new, states)
    assert (states - final).abs().max() <= 1e-5 * final.abs().max()


def test_conv_resets_per_sample_and_steps_continue_it():
    gen = torch.Generator().manual_seed(3)
    cu = _cu(LENGTHS)
    x, w = torch.randn(sum(LENGTHS), 10, generator=gen), torch.randn(10, 4, generator=gen)
    y = causal_conv1d(x, w, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):  # F.conv1d on each sample alone
        want = F.silu(F.conv1d(x[a:b].T[None], w[:, None], padding=3, groups=10)[0, :, : b - a].T)
        assert torch.allclose(y[a:b], want, atol=1e-6)
    # the window a prefill leaves, advanced one token at a time, gives the rest of each sample
    cut = [n // 2 for n in LENGTHS]
    head = torch.cat([x[a:a + c] for a, c in zip(cu[:-1].tolist(), cut, strict=True)])
    state = conv_states(head, _cu(cut), 3)
    for i, (a, c, n) in enumerate(zip(cu[:-1].tolist(), cut, LENGTHS, strict=True)):
        s = state[i:i + 1]
        for t in range(a + c, a + n):
            out, s = causal_conv1d_step(x[t:t + 1], w, s)
            assert torch.allclose(out[0], y[t], atol=1e-6)


# ------------------------------------------------------------------------------------- whole model, packed row


def _tiny_qwen35() -> MindVL:
    text = TextConfig(family="qwen3_5", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, mrope_section=[1, 1, 0],
                      mrope_interleaved=True, partial_rotary_factor=0.5,
                      layer_types=["linear_attention", "full_attention", "linear_attention"],
                      linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=4)
    vision = VisionConfig(family="qwen3_vl", depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                          patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[],
                          hidden_act="gelu_pytorch_tanh")
    cfg = MindVLConfig(text=text, vision=vision, image_token_id=90, video_token_id=91, vision_start_token_id=92,
                       vision_end_token_id=93)
    torch.manual_seed(0)
    model = MindVL(cfg)
    model.init_weights(seed=0, std=0.2)
    with torch.no_grad():  # non-trivial norms, decays and conv taps
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
            if name.endswith("A_log"):
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape))
    for layer in model.language_model.layers:
        if layer.token_mixer == "linear_attn":
            layer.linear_attn.chunk_size = 8  # several chunks per sample
    return model.train()


def test_packed_row_equals_each_sample_alone_outputs_and_gradients():
    model = _tiny_qwen35()
    gen = torch.Generator().manual_seed(7)
    grid = torch.tensor([[1, 4, 4]])  # 4 image tokens
    samples = []
    for n in (13, 29, 1, 20):
        ids = torch.randint(0, 88, (n,), generator=gen)
        samples.append((ids, torch.randint(0, 88, (n,), generator=gen)))
    image_ids = torch.cat([torch.tensor([92]), torch.full((4,), 90), torch.tensor([93]),
                           torch.randint(0, 88, (9,), generator=gen)])  # an image sample
    samples.insert(1, (image_ids, torch.randint(0, 88, (15,), generator=gen)))
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=gen)

    def run(chosen):
        ids = torch.cat([s[0] for s in chosen])
        labels = torch.cat([s[1] for s in chosen])
        cu = _cu([len(s[0]) for s in chosen])
        has_image = any(s[0] is image_ids for s in chosen)
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, cu_seqlens=cu, pixel_values=pixels if has_image else None,
                    image_grid_thw=grid if has_image else None)
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            logits = model(input_ids=ids, cu_seqlens=cu, pixel_values=pixels if has_image else None,
                           image_grid_thw=grid if has_image else None).logits
        return out.loss_sum.detach(), grads, logits

    loss, grads, logits = run(samples)
    alone = [run([s]) for s in samples]
    want_logits = torch.cat([a[2] for a in alone])
    assert (logits - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
    assert abs(float(loss - sum(a[0] for a in alone))) <= 1e-5 * float(loss)
    for name, g in grads.items():
        want = sum(a[1].get(name, torch.zeros_like(g)) for a in alone)
        assert (g - want).abs().max() <= 1e-5 * max(float(want.abs().max()), 1e-6), name
    linear = [n for n in grads if "linear_attn" in n]
    assert linear and all(grads[n].abs().max() > 0 for n in linear)


def test_tensor_and_context_parallelism_are_refused_in_one_line():
    from mindvl.train.parallel import refuse_split_recurrence

    model = _tiny_qwen35()
    refuse_split_recurrence(model, "parallel.tensor_parallel", 1)  # no split: fine
    for key in ("parallel.tensor_parallel", "parallel.context_parallel"):
        with pytest.raises(ValueError, match=f"^{key}: 2 is not supported for qwen3_5's linear-attention") as err:
            refuse_split_recurrence(model, key, 2)
        assert "\n" not in str(err.value)
