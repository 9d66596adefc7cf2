"""The chunked vocabulary loss, forward + backward: aligned slices (now) against unaligned ones (before issue 38),
and the GEMM time they should take. On a GPU the figure to read is ms per call against `gemm_ms` (4 GEMMs of
[N, H] x [H, V] at the device's measured bf16 matmul rate); on a CPU (--tiny) it only checks that both run.

    python benchmarks/bench_loss_gemm.py              # GPU: N=5,000 labelled rows, H=2,048, V=151,936, bf16
    python benchmarks/bench_loss_gemm.py --tiny       # CPU, small shapes
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mindvl.models.loss as loss_module


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    n, h, v, repeats = (500, 128, 10_007, 2) if args.tiny else (5_000, 2_048, 151_936, 5)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device, generator=gen)

    def step() -> None:
        loss_sum, _ = loss_module.chunked_cross_entropy(hidden, weight, targets, 2048, n_labelled=n)
        loss_sum.backward()

    out = {"device": str(device), "rows": n, "hidden": h, "vocab": v, "dtype": str(dtype)}
    for name, align in (("aligned_256", 256), ("unaligned_before", 1)):
        loss_module.SLICE_ALIGN = align
        out[f"{name}_ms"] = round(timed(step, device, repeats), 2)
    loss_module.SLICE_ALIGN = 256
    a, b = torch.randn(4096, h, device=device, dtype=dtype), torch.randn(h, 8192, device=device, dtype=dtype)
    per_flop = timed(lambda: a @ b, device, repeats) / (2 * 4096 * h * 8192)
    out["gemm_ms"] = round(4 * 2 * n * h * v * per_flop, 2)  # 2 forward-like + 2 backward GEMMs of [N,H]x[H,V]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
