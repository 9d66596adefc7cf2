"""Kernels launched per decode step, the decoder layers eager against compiled (mindvl.infer.decode_compile), and
compiled with q/k/v and gate/up as one matmul each (mindvl.infer.fused_projections: what a compiled generation
runs), counted on the CPU; and the kernels that pick and record a greedy step's tokens, eager and compiled.

    PYTHONPATH=$PWD python benchmarks/decode_kernels.py [--dtype bfloat16] [--families qwen2,qwen3] [--check-bits]

Why on the CPU: at small batch an accelerator's decode step costs its weight reads plus a few microseconds per
kernel, even replayed from a CUDA graph, so the kernel count per layer is what compilation changes. It does not
depend on the device: inductor fuses the same elementwise chains for the CPU (C++ loops) as for CUDA (triton
kernels), and the matmuls and the attention are library calls either way.

How: torch.profiler records one decode step (`MindVL.decode_step` over a prefilled static cache) after two warm-up
steps. A kernel is an outermost op of the profile that computes: an inductor kernel (`cpp_fused_*`, recorded with
`inductor.config.cpp.enable_kernel_profile`) or an aten op other than those that only make views or metadata or
allocate (`NOT_KERNELS`, `to` among them: its `_to_copy` counts when it copies), not inside another one (`linear`
counts once, not again for its `addmm`). The per-layer figure is the difference
between a 4-layer and a 2-layer model, halved; `fixed` is the rest (embedding, rotary tables, decode mask, final
norm, logits). On an accelerator the proof's generate section counts the real CUDA kernels (`kernels_per_step`).

`--pieces` runs the accelerator proof's decode_bits diagnosis here instead: each piece of the compiled step (norm,
residual add + norm, SwiGLU product, SiLU by eager's formula, rotation) compiled alone under each option set.

`--check-bits` also compares the logits of 8 decode steps (4 rows, the same teacher-forced tokens on both sides) of
a wider model (hidden 1024, head_dim 128) eager against compiled, fused or not: with decode_compile.INDUCTOR_OPTIONS
they are equal bit for bit on the CPU; without them (inductor's defaults) they are not (`--check-bits
--default-options`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json

import torch
from torch.profiler import ProfilerActivity, profile

from mindvl.infer import decode_compile
from mindvl.infer.fused_projections import fused_projections
from mindvl.infer.generate import greedy_tokens
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

NOT_KERNELS = {"aten::" + n for n in (
    "as_strided", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "alias", "select", "slice",
    "transpose", "permute", "t", "numpy_T", "detach", "empty", "empty_strided", "empty_like", "resolve_conj",
    "resolve_neg", "to", "lift_fresh", "split", "split_with_sizes", "chunk", "narrow", "unflatten", "flatten",
    "result_type", "unbind", "set_", "view_as", "_reshape_alias", "contiguous", "clone_", "scalar_tensor", "expand_as",
)}


# The fields a family adds to the narrow sizes: DeepSeek-V3's MLA latents and routed experts (the first layer dense,
# so a layer the 4-layer model adds is a MoE layer), Qwen3.5's linear attention (gated delta rule) and gated heads.
FAMILY_FIELDS = {
    "deepseek_v3": dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_key_value_heads=4),
    "qwen3_5": dict(mrope_interleaved=True, partial_rotary_factor=0.5,
                    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                    linear_num_key_heads=2, linear_num_value_heads=4),
}


def build(family: str, layers: int, dtype: torch.dtype, wide: bool = False) -> MindVL:
    """A narrow model of the family's layer structure (the kernel count does not depend on the widths); `wide`:
    hidden 1024, 8 query heads of 128 over 4 KV heads (for the bit comparison)."""
    sizes = (dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=128) if wide else
             dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    extra = dict(FAMILY_FIELDS.get(family, {}))
    if family == "qwen3_5":  # linear and full attention alternate, so (4 layers - 2) / 2 is one of each, averaged
        extra["layer_types"] = ["linear_attention", "full_attention"] * (layers // 2)
    rotary = {"deepseek_v3": extra.get("qk_rope_head_dim"),
              "qwen3_5": int(sizes["head_dim"] * extra.get("partial_rotary_factor", 1))}.get(family, sizes["head_dim"])
    half, part = rotary // 2, 3 * (rotary // 2) // 8
    extra["mrope_section"] = [half - 2 * part, part, part]  # Qwen2.5-VL's 16/24/24 split of 64, at any width
    text = TextConfig(family=family, vocab_size=1001, num_hidden_layers=layers, **{**sizes, **extra})
    vision = VisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[0])
    model = MindVL(MindVLConfig(text=text, vision=vision, image_token_id=1000, video_token_id=999,
                                vision_start_token_id=998, vision_end_token_id=997))
    model.init_weights(seed=0)
    return model.eval().to(dtype)


def _computes(event) -> bool:
    return "cpp_fused" in event.name or (event.name.startswith("aten::") and event.name not in NOT_KERNELS)


def kernels(prof) -> collections.Counter:
    """The kernels of a profile, by name: the outermost computing ops (see the module docstring)."""
    out: collections.Counter = collections.Counter()
    for e in prof.events():
        if not _computes(e):
            continue
        parent = e.cpu_parent
        while parent is not None and not _computes(parent):
            parent = parent.cpu_parent
        if parent is not None:  # inside a counted op (linear -> addmm, _to_copy -> copy_): one launch
            continue
        out["inductor:" + e.name.split("cpp_fused_", 1)[1].rsplit("_", 1)[0] if "cpp_fused" in e.name else e.name] += 1
    return out


def prefilled(model: MindVL, offsets: list[int]) -> tuple:
    """(cache, each row's first token [B], next positions [B]) after prefilling random prompts split at `offsets`."""
    cache = model.new_kv_cache(len(offsets) - 1, 256)
    ids = torch.randint(0, 900, (offsets[-1],), generator=torch.Generator().manual_seed(0))
    logits, positions = model.prefill(ids, torch.tensor(offsets, dtype=torch.int32), cache)
    return cache, logits.argmax(-1), positions


# name -> (layers compiled, projections fused)
ARMS = {"eager": (False, False), "compiled": (True, False), "compiled_fused": (True, True)}


@torch.inference_mode()
def step_kernels(family: str, layers: int, dtype: torch.dtype, arm: str) -> collections.Counter:
    compiled, fused = ARMS[arm]
    model = build(family, layers, dtype)
    with fused_projections(model) if fused else contextlib.nullcontext():
        cache, tokens, positions = prefilled(model, [0, 12, 20])
        cache.full_width = True  # the captured step's shapes
        call = decode_compile.layer_call() if compiled else None
        for _ in range(2):  # warm-up: compiles
            model.decode_step(tokens, positions, cache, layer_call=call)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.decode_step(tokens, positions, cache, layer_call=call)
    return kernels(prof)


@torch.inference_mode()
def step_logits(family: str, dtype: torch.dtype, arm: str) -> torch.Tensor:
    """[8, 4, V] float32: 8 decode steps' logits of a wide 2-layer model, each step fed the same fixed tokens."""
    compiled, fused = ARMS[arm]
    model = build(family, 2, dtype, wide=True)
    with fused_projections(model) if fused else contextlib.nullcontext():
        cache, tokens, positions = prefilled(model, [0, 12, 20, 31, 40])
        call = decode_compile.layer_call() if compiled else None
        out = []
        for s in range(8):
            out.append(model.decode_step(tokens, positions + s, cache, layer_call=call).float())
            tokens = torch.randint(0, 900, (4,), generator=torch.Generator().manual_seed(s))
    return torch.stack(out)


@torch.inference_mode()
def token_kernels(compiled: bool) -> collections.Counter:
    """The kernels that pick and record a greedy step's tokens and set the cache's advance flags
    (generate.greedy_tokens: 4 rows, 1001 logits), eager or compiled whole (what a compiled generation runs between
    its decode steps)."""
    rows, width = 4, 16
    args = (torch.randn(rows, 1001, dtype=torch.bfloat16), torch.zeros(rows, width, dtype=torch.long),
            torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.bool), torch.tensor([4, 2, 6, 9]),
            torch.tensor([3, 5]), torch.arange(rows), torch.ones(rows, dtype=torch.long),
            torch.zeros((), dtype=torch.long))
    fn = decode_compile.whole(greedy_tokens) if compiled else greedy_tokens
    for _ in range(2):
        fn(*args)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return kernels(prof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--families", default="qwen2,qwen3")
    parser.add_argument("--check-bits", action="store_true", help="compare eager and compiled logits bit for bit")
    parser.add_argument("--default-options", action="store_true", help="inductor's defaults, not INDUCTOR_OPTIONS")
    parser.add_argument("--pieces", action="store_true",
                        help="only the proof's decode_bits pieces (proof_generate.piece_bits) of the wide qwen2 model, "
                             "compiled by inductor on this CPU, under each option set")
    args = parser.parse_args()
    if args.pieces:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from proof_generate import decode_bits_summary, piece_bits

        pieces = piece_bits(build("qwen2", 2, getattr(torch, args.dtype), wide=True), (1, 32), "inductor")
        print(json.dumps(pieces))
        print(decode_bits_summary({"pieces": pieces}))
        return
    if args.default_options:
        decode_compile.INDUCTOR_OPTIONS = {}
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True
    dtype = getattr(torch, args.dtype)
    rows = []
    for family in args.families.split(","):
        counts = {}
        for arm in ARMS:
            two, four = (step_kernels(family, n, dtype, arm) for n in (2, 4))
            per_layer = {k: (four[k] - two[k]) / 2 for k in set(four) | set(two) if four[k] != two[k]}
            total_per_layer = (sum(four.values()) - sum(two.values())) / 2
            counts[arm] = total_per_layer
            rows.append({"family": family, "dtype": args.dtype, "layers": arm,
                         "kernels_per_layer": total_per_layer,
                         "fixed": sum(two.values()) - 2 * total_per_layer,
                         "per_layer_by_op": dict(sorted(per_layer.items(), key=lambda kv: -kv[1]))})
        rows.append({"family": family, **{f"eager_over_{arm}_per_layer": counts["eager"] / counts[arm]
                                          for arm in ARMS if arm != "eager"}})
        if args.check_bits:
            eager = step_logits(family, dtype, "eager")
            for arm in ("compiled", "compiled_fused"):
                diff = (eager - step_logits(family, dtype, arm)).abs()
                rows.append({"family": family, "dtype": args.dtype, "arm": arm,
                             "inductor_options": decode_compile.INDUCTOR_OPTIONS,
                             "logits_equal_bitwise": bool((diff == 0).all()), "max_abs_diff": diff.max().item(),
                             "fraction_differing": (diff > 0).float().mean().item()})
    for compiled in (False, True):
        picked = token_kernels(compiled)
        rows.append({"greedy_tokens": "compiled" if compiled else "eager", "kernels": sum(picked.values()),
                     "by_op": dict(picked)})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
