"""Qwen3.5's gated delta rule on one packed row: mindvl's chunked varlen rule (one call for the whole row) against
transformers 5.23's torch fallbacks run sample by sample (they ignore `cu_seqlens`, so a packed row must be split):
its chunked rule, and its token-by-token recurrence (forward only: what it uses to decode).

    OMP_NUM_THREADS=2 python benchmarks/bench_delta_rule.py [--heads 8] [--dim 64] [--reps 3]

fp32 on CPU, forward + backward through q, k, v, g, beta (the recurrence: forward). Arms run interleaved; medians and
min..max are printed with the ratio to mindvl's, and the outputs are checked against each other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mindvl.models.delta_rule import gated_delta_rule

LENGTHS = [700, 300, 1500, 100, 600, 37, 763]  # 4000 tokens, 7 samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(0)
    t, h, d = sum(LENGTHS), args.heads, args.dim
    cu = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    leaves = [torch.randn(t, h, d, generator=gen), torch.randn(t, h, d, generator=gen),
              torch.randn(t, h, d, generator=gen), -0.3 * torch.rand(t, h, generator=gen),
              torch.rand(t, h, generator=gen)]
    for x in leaves:
        x.requires_grad_(True)

    def ours():
        o, _ = gated_delta_rule(*leaves, cu)
        o.square().sum().backward()
        return o.detach()

    def theirs_chunked():
        outs = [torch_chunk_gated_delta_rule(*(x[None, a:b] for x in leaves), use_qk_l2norm_in_kernel=True)[0][0]
                for a, b in bounds]
        o = torch.cat(outs)
        o.square().sum().backward()
        return o.detach()

    def theirs_recurrent():
        with torch.no_grad():
            return torch.cat([torch_recurrent_gated_delta_rule(*(x[None, a:b] for x in leaves),
                                                               use_qk_l2norm_in_kernel=True)[0][0]
                              for a, b in bounds])

    arms = {"mindvl chunked, packed (fwd+bwd)": ours,
            "transformers chunked, per sample (fwd+bwd)": theirs_chunked,
            "transformers recurrent, per sample (fwd)": theirs_recurrent}
    times: dict[str, list[float]] = {k: [] for k in arms}
    outputs = {}
    for _ in range(args.reps):
        for name, fn in arms.items():
            for x in leaves:
                x.grad = None
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    ref = outputs["mindvl chunked, packed (fwd+bwd)"]
    base = statistics.median(times["mindvl chunked, packed (fwd+bwd)"])
    print(f"{len(LENGTHS)} samples, {t} tokens, {h} heads, dk = dv = {d}, fp32, "
          f"torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        err = float((outputs[name] - ref).abs().max() / ref.abs().max())
        print(f"{name:46s} median {statistics.median(ts):7.3f} s  ({min(ts):.3f}..{max(ts):.3f})  "
              f"x{statistics.median(ts) / base:5.2f}  max rel diff {err:.1e}")


if __name__ == "__main__":
    main()
