"""The accelerator path against CPU fp32 references: attention backends, a bf16 training step (autocast), the
fused AdamW on device tensors, streamed pinned copies, KV-cache and MLA-cache generation, grouped experts.

Marked `accelerator`: they need a CUDA device and skip cleanly without one (CI has none). The prepared proof run
(benchmarks/accelerator_proof.py) runs `pytest -m accelerator` on the lent GPU. Tolerances follow the operand
precision (fp32 on the device with TF32 off: far under 1e-4; bf16 operands: ~1e-2 relative).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# MINDVL_ACCELERATOR_TEST_DEVICE=cpu runs these checks on the CPU against the same references: a check of the tests
# themselves, not of any accelerator (nothing in CI sets it; run it after changing this file:
# `MINDVL_ACCELERATOR_TEST_DEVICE=cpu python -m pytest tests/test_accelerator_device.py`).
DEVICE = os.environ.get("MINDVL_ACCELERATOR_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
pytestmark = [pytest.mark.accelerator,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                 reason="needs a CUDA device (accelerator test)")]


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 matmuls in full precision on the device (TF32 would put 1e-3 errors into 'fp32' comparisons)."""
    if not ON_CUDA:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device(DEVICE)


def family_on_device(name: str, dtype: torch.dtype, n: int) -> tuple:
    """(a family_models model on the device in `dtype`, n of test_static_decode's prompts with pixels in `dtype`)."""
    from test_static_decode import build, prompts_for

    model = build(name).to(device(), dtype)
    prompts = prompts_for(model, n)
    for p in prompts:
        if p.pixel_values is not None:
            p.pixel_values = p.pixel_values.to(dtype)
    return model, prompts


# ---------------------------------------------------------------------------------------------------- attention

LENGTHS = [140, 140, 150, 9, 300, 5, 257]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 31)])
def test_attention_backends_on_device_match_cpu_sdpa(dtype, causal, window):
    from mindvl.models.attention import attend, available_backends

    gen = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, 64, generator=gen) for h in (8, 2, 2))
    cu = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attend(*leaves, cu, max(LENGTHS), causal=causal, window=window, backend="sdpa")
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    # fp32: flex's Triton kernels may take TF32 dots (~3e-4); a wrong mask or offset is O(1)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    for backend in available_backends("cuda"):
        backward = ON_CUDA or backend != "flex"  # FlexAttention has no CPU backward
        dev = [t.to(device(), dtype).requires_grad_(backward) for t in (q, k, v)]
        out = attend(*dev, cu.to(device()), max(LENGTHS), causal=causal, window=window, backend=backend)
        assert out.dtype == dtype
        assert rel_err(out, ref) < tol, backend
        if not backward:
            continue
        grads = torch.autograd.grad(out.float().square().sum(), dev)
        for g, r in zip(grads, ref_grads, strict=True):
            assert rel_err(g, r) < 2 * tol, backend


# ------------------------------------------------------------------------------------------ training on device


def tiny_batch(model, seed: int = 0) -> dict:
    """One packed row of two samples, one with a 8x8-patch image, through the model's own token ids."""
    from mindvl.models import mrope_position_ids

    c = model.config
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 8, 8]])
    pads = 8 * 8 // c.vision.merge_unit
    a = torch.cat([torch.randint(5, 200, (7,), generator=gen), torch.tensor([c.vision_start_token_id]),
                   torch.full((pads,), c.image_token_id), torch.tensor([c.vision_end_token_id]),
                   torch.randint(5, 200, (30,), generator=gen)])
    b = torch.randint(5, 200, (45,), generator=gen)
    ids = torch.cat([a, b])
    cu = torch.tensor([0, len(a), len(a) + len(b)], dtype=torch.int32)
    labels = ids.masked_fill(ids == c.image_token_id, -100)
    return {"input_ids": ids, "labels": labels, "cu_seqlens": cu,
            "position_ids": mrope_position_ids(ids, cu, grid, c.image_token_id, c.vision.spatial_merge_size),
            "pixel_values": torch.randn(64, c.vision.patch_dim, generator=gen), "image_grid_thw": grid}


def test_bf16_training_step_matches_cpu_fp32_and_uses_fused_adamw():
    """One optimizer step as the trainer runs it on one GPU: plain tensors (no FSDP, no DTensor) under bf16
    autocast, fp32 master weights with fused AdamW, pinned non-blocking copies; loss and updated weights against CPU
    fp32. (Blocks eager here: the proof's mindvl section runs them compiled.)"""
    from tiny_mindvl import tiny_model

    from mindvl.config import OptimSection, ParallelSection
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import ParallelEnv, destroy, parallelize
    from mindvl.train.step import MicroBatchStream, optimizer_step

    batches = [tiny_batch(tiny_model(), s) for s in (0, 1)]
    cpu_env = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")
    ref = tiny_model(std=0.05)
    ref_opt = build_optimizer(ref, OptimSection(lr=1e-3))
    ref_stats = optimizer_step(ref, ref_opt, MicroBatchStream(iter(batches).__next__, 2, cpu_env.device), cpu_env,
                               ref.config, grad_clip=1.0)

    env = ParallelEnv(0, 1, 0, device(), "nccl" if ON_CUDA else "gloo")
    try:
        model = parallelize(tiny_model(std=0.05).to(env.device), env,
                            ParallelSection(mixed_precision="bf16", compile="off"))
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # plain tensors on one device
        opt = build_optimizer(model, OptimSection(lr=1e-3))
        assert all(g.get("fused") for g in opt.param_groups) or not ON_CUDA, "fused AdamW expected on CUDA"
        seen = []
        hook = model.language_model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        stream = MicroBatchStream(iter(batches).__next__, 2, env.device)
        got = optimizer_step(model, opt, stream, env, model.config, grad_clip=1.0)
        hook.remove()
        assert seen == [torch.bfloat16, torch.bfloat16]
        loss, ref_loss = got.loss_sum / float(got.counts[0]), ref_stats.loss_sum / float(ref_stats.counts[0])
        assert loss == pytest.approx(ref_loss, rel=2e-2)
        assert got.grad_norm == pytest.approx(ref_stats.grad_norm, rel=5e-2)
        ref_state, init = ref.state_dict(), tiny_model(std=0.05).state_dict()
        agree = total = 0
        for name, p in model.state_dict().items():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            assert full.dtype == torch.float32, name  # fp32 master weights
            # AdamW's first step moves every weight by ~lr * sign(gradient): the updates must point the same way,
            # except where bf16 flips the sign of a gradient near zero
            moved, want = full.cpu() - init[name], ref_state[name] - init[name]
            assert moved.abs().max() < 2e-3, name
            agree += int((moved.sign() == want.sign()).sum())
            total += moved.numel()
        assert agree / total > 0.97
    finally:
        destroy(env)


def test_streamed_copies_arrive_on_the_device_and_equal():
    """MicroBatchStream copies through pinned host memory with non-blocking copies two packs ahead: every value
    arrives intact."""
    from mindvl.train.step import MicroBatchStream

    batches = [{"input_ids": torch.arange(10 * i, 10 * i + 10), "labels": torch.ones(10)} for i in range(5)]
    got = list(MicroBatchStream(iter(batches).__next__, 5, device(), window=2))
    if ON_CUDA:
        torch.cuda.synchronize()
    for a, b in zip(got, batches, strict=True):
        assert a["input_ids"].device.type == device().type
        assert torch.equal(a["input_ids"].cpu(), b["input_ids"])


def test_fused_adamw_steps_equal_cpu_reference():
    from mindvl.config import OptimSection
    from mindvl.train.optim import build_optimizer

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 8))
    dev = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 8)).to(device())
    dev.load_state_dict(ref.state_dict())
    opts = [build_optimizer(m, OptimSection(lr=1e-2, weight_decay=0.1)) for m in (ref, dev)]
    assert all(g.get("fused") for g in opts[1].param_groups) or not ON_CUDA
    for step in range(5):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        for m, o in zip((ref, dev), opts, strict=True):
            m(x.to(next(m.parameters()).device)).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, a), b in zip(ref.state_dict().items(), dev.state_dict().values(), strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------- generation


def prompts(model):
    from mindvl.infer import Prompt

    c = model.config
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(5, 200, (20,), generator=gen)
    image = torch.cat([text[:4], torch.tensor([c.vision_start_token_id]), torch.full((16,), c.image_token_id),
                       torch.tensor([c.vision_end_token_id]), text[4:]])
    return [Prompt(image, torch.randn(64, c.vision.patch_dim, generator=gen), torch.tensor([[1, 8, 8]])),
            Prompt(torch.randint(5, 200, (13,), generator=gen))]


@pytest.mark.parametrize("moe", [False, True], ids=["gqa-kv-cache", "mla-cache-moe"])
def test_cached_generation_on_device_matches_cpu(moe):
    """Greedy tokens and prefill logits of the cached generation on the GPU (fp32) equal the CPU's; the MoE model
    uses MLA's latent cache and the grouped experts."""
    from tiny_mindvl import tiny_model

    from mindvl.infer import generate
    from mindvl.infer.generate import pack_prompts

    cpu = tiny_model(hidden_size=64, head_dim=16, mrope_section=(2, 3, 3), seed=3, std=0.1, moe=moe).eval()
    gpu = tiny_model(hidden_size=64, head_dim=16, mrope_section=(2, 3, 3), seed=3, std=0.1, moe=moe).eval()
    gpu.to(device())
    ps = prompts(cpu)
    for model in (cpu, gpu):
        dev = next(model.parameters()).device
        packed = pack_prompts(ps, dev)
        with torch.inference_mode():
            cache = model.new_kv_cache(len(ps), 64)
            logits, _ = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache, packed["pixel_values"],
                                      packed["image_grid_thw"])
        if model is cpu:
            want = logits
        else:
            assert rel_err(logits, want) < 1e-4
    assert generate(gpu, ps, 12) == generate(cpu, ps, 12)


@pytest.mark.parametrize("name,dtype", [("dense", torch.float32), ("moe_mla", torch.bfloat16),
                                        ("qwen3_vl", torch.float32), ("qwen3_5", torch.float32)])
def test_decode_replayed_from_a_cuda_graph_gives_the_eager_loops_tokens(name, dtype):
    """Issue 39: the static loop with the step captured in a CUDA graph (per batch size: once, then again after a
    compaction) gives the eager loop's greedy tokens on the same device, with budgets and stop tokens; the capture
    must succeed (no fallback warning). The MoE runs in bf16, where its experts are a grouped_mm (fp32 experts fall
    back to a per-expert loop that reads the counts, which cannot be captured)."""
    import warnings

    from test_static_decode import budgets_and_stops

    from mindvl.infer import generate

    model, ps = family_on_device(name, dtype, 5)
    _, budgets, stops, _, want = budgets_and_stops(model, ps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that falls back to eager warns: fail on it
        got = generate(model, ps, budgets, stop_token_ids=stops, sync_every=2, graphs=ON_CUDA)
    assert got == want


@pytest.mark.parametrize("name,dtype", [("dense", torch.bfloat16), ("moe_mla", torch.bfloat16),
                                        ("qwen3_5", torch.float32)])
def test_a_kept_cuda_graph_replays_the_next_calls_prompts(name, dtype):
    """Session 15: a second and third call at the same batch and capacity bucket (other prompts, then the first
    again) reset the kept cache in place and replay the first call's CUDA graph (one capture in all), and each gives
    the tokens of a graph captured afresh for its own prompts (the same kernels at the same shapes: equal bits; the
    graph itself against the eager loop is the test above). bf16 on sm90 puts the dense model's decode attention on
    cuDNN, whose plans are built per shape: the kept graph must replay with the plan it captured."""
    import warnings

    from mindvl.infer import decode_graph, generate

    if not ON_CUDA:
        pytest.skip("kept CUDA graphs exist on CUDA only (test_static_decode checks kept steps with the emulation)")
    model, everything = family_on_device(name, dtype, 7)
    calls = (everything[:5], everything[2:], everything[:5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = []
        for ps in calls:
            decode_graph.release(model)
            fresh.append(generate(model, ps, 10, sync_every=16, graphs=ON_CUDA))
        decode_graph.release(model)
        kept = [generate(model, ps, 10, sync_every=16, graphs=ON_CUDA) for ps in calls]
    assert kept == fresh and fresh[0] != fresh[1]
    (_, step), = decode_graph._POOLS[model].entries.values()
    assert step.captures == 1


@pytest.mark.parametrize("name,dtype", [("dense", torch.bfloat16), ("moe_mla", torch.bfloat16),
                                        ("qwen3_5", torch.float32)])
def test_compiled_decode_layers_replay_and_keep_the_tokens(name, dtype):
    """Session 16: the decode step's layers compiled by inductor (mindvl.infer.decode_compile: triton kernels).
    Captured in a CUDA graph they give the tokens of the same compiled layers launched step by step (the same
    kernels at the same shapes: equal bits), with budgets, stop tokens and a compaction; in fp32 also the eager
    loop's (inductor's fp32 arithmetic differs from eager's by roundings only, far from these models' margins).
    bf16 against eager is the proof's `graphs_compiled` figure, not asserted (a near tie may flip: decode_compile)."""
    import warnings

    from test_static_decode import budgets_and_stops

    from mindvl.infer import decode_graph, generate

    if not ON_CUDA:
        pytest.skip("inductor's decode kernels are checked on CUDA")
    pytest.importorskip("triton")
    model, ps = family_on_device(name, dtype, 5)
    _, budgets, stops, _, want = budgets_and_stops(model, ps)
    kw = dict(stop_token_ids=stops, sync_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed compilation or capture falls back with a warning: fail on it
        launched = generate(model, ps, budgets, graphs=False, compile=True, **kw)
        decode_graph.release(model)
        replayed = generate(model, ps, budgets, graphs=True, compile=True, **kw)
    assert replayed == launched
    if dtype == torch.float32:
        assert launched == want


# ------------------------------------------------------------------------------------------------ grouped experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_on_device_match_cpu_fp32(dtype):
    from test_moe_grouped import make, per_expert_reference

    from mindvl.models.moe import _grouped_mm_runs

    m, x, ids, w = make(16, 128, 64, tokens=300, k=4, seed=2, idle=(3,))
    ref = per_expert_reference(m, x, ids, w)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad(set_to_none=True)
    dm = m.to(device(), dtype)
    dx = x.detach().to(device(), dtype).requires_grad_()
    # CUDA runs grouped_mm in bf16 (the fast path); fp32 takes the exact unbind fallback
    if ON_CUDA:
        assert _grouped_mm_runs(dx, dm.gate_proj, dm.up_proj, dm.down_proj) == (dtype == torch.bfloat16)
    out = dm(dx, ids.to(device()), w.to(device()))
    out.float().square().sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert rel_err(out, ref) < tol
    for g, r in zip([dx.grad] + [p.grad for p in dm.parameters()], ref_grads, strict=True):
        assert rel_err(g, r) < 2 * tol
