"""DeepSeek-V3-style (MLA + MoE) greedy decoding: tokens/s with the MLA KV cache vs recomputing the whole sequence
every step, and cache bytes per token against caching expanded per-head keys and values.

    OMP_NUM_THREADS=1 python benchmarks/bench_mla_decode.py [--prompt 256] [--new 32] [--reps 3]

A random model (hidden 256, 4 layers, 8 heads, kv_lora_rank 64, 16 experts top-2), fp32 on CPU. Arms run
interleaved; medians and min..max are printed with the ratio; both arms must produce the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mindvl.infer import Prompt, generate
from mindvl.models import MindVL, MindVLConfig, TextConfig


def recompute_greedy(model: MindVL, ids: torch.Tensor, n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            full = torch.cat([ids, torch.tensor(out, dtype=torch.long)])
            out.append(int(model(input_ids=full).logits[-1].argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    text = TextConfig(family="deepseek_v3", vocab_size=4096, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=128,
                      n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                      first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32)
    model = MindVL(MindVLConfig(text=text, vision=None, image_token_id=4000, video_token_id=4001,
                                vision_start_token_id=4002, vision_end_token_id=4003))
    model.init_weights(seed=0, std=0.05)
    model.eval()
    ids = torch.randint(0, 3900, (args.prompt,), generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); load average {os.getloadavg()} on "
          f"{os.cpu_count()} CPUs; prompt {args.prompt}, {args.new} new tokens, batch 1, fp32")
    times: dict[str, list[float]] = {"mla-cache": [], "recompute": []}
    outs: dict[str, list[int]] = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for arm in times:
            t = time.perf_counter()
            if arm == "mla-cache":
                outs[arm] = generate(model, [Prompt(ids)], max_new_tokens=args.new)[0]
            else:
                outs[arm] = recompute_greedy(model, ids, args.new)
            if rep:
                times[arm].append(time.perf_counter() - t)
    assert outs["mla-cache"] == outs["recompute"], "cached greedy differs from recomputation"
    for arm, ts in times.items():
        rate = [args.new / t for t in ts]
        print(f"{arm:10s} {statistics.median(rate):8.1f} tokens/s ({min(rate):.1f}..{max(rate):.1f})")
    print(f"speed-up {statistics.median(times['recompute']) / statistics.median(times['mla-cache']):.1f}x "
          "(prefill included in both)")
    per_token = text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim) * 4
    expanded = text.num_hidden_layers * text.num_attention_heads * (
        text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim) * 4
    print(f"cache per token: {per_token} B (latent + rope key) vs {expanded} B expanded K/V "
          f"({expanded / per_token:.1f}x); DeepSeek-V3 (61 layers, bf16): {61 * 576 * 2 / 1024:.1f} KiB vs "
          f"{61 * 128 * 320 * 2 / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
