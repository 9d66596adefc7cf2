"""Forward+backward throughput of packed rows vs the same samples padded to the longest in their batch.

Both arms process the SAME samples with the same model and attention kernels; only the layout differs:
- packed: samples are packed first-fit-decreasing into rows of `--row-tokens` (no padding, cu_seqlens);
- padded: samples go in arrival order into batches of as many samples as an average packed row holds, and each
  sample is padded to the longest of its batch (as a padded [B, L_max] batch costs), pad tokens unlabelled.
Reported: real tokens/s of each arm, the ratio, padding waste, and MFU (real-token model FLOPs / peak).

    python benchmarks/bench_packed_vs_padded.py                      # CPU, small model
    python benchmarks/bench_packed_vs_padded.py --preset qwen3-1.7b --device cuda --dtype bf16 --row-tokens 8192

The length mix imitates an SFT corpus: 30% text-only samples (log-normal, median ~300 tokens) and 70% samples with
one image at native resolution (side 224..1344 px within max_pixels) plus a log-normal text part.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn.functional as F

from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig
from mindvl.train.metrics import device_peak_flops, training_flops

PRESETS = {
    # Runs in about a minute on 2 CPU cores.
    "cpu-small": dict(
        vision=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, fullatt_block_indexes=[3]),
        text=dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, mrope_section=[4, 6, 6]),
        max_pixels=256 * 28 * 28,
    ),
    # The realistic size: Qwen2.5-VL vision tower + Qwen3-1.7B shapes (random weights).
    "qwen3-1.7b": dict(
        vision=dict(),  # VisionConfig defaults are the Qwen2.5-VL checkpoints' values
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  mrope_section=[16, 24, 24]),
        max_pixels=1280 * 28 * 28,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_config(preset: str) -> MindVLConfig:
    p = PRESETS[preset]
    text = TextConfig(**p["text"])
    return MindVLConfig(text=text, vision=VisionConfig(**p["vision"]), image_token_id=text.vocab_size - 5,
                        video_token_id=text.vocab_size - 4, vision_start_token_id=text.vocab_size - 3,
                        vision_end_token_id=text.vocab_size - 2)


def sample_corpus(n: int, max_pixels: int, max_tokens: int, seed: int) -> list[dict]:
    """Samples as (text tokens, image grid or None); lengths capped at `max_tokens` like a truncating loader."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = max(8, int(rng.lognormvariate(math.log(300), 0.9)))
        grid = None
        if rng.random() < 0.7:
            h, w = rng.randint(224, 1344), rng.randint(224, 1344)
            scale = min(1.0, math.sqrt(max_pixels / (h * w)))
            gh, gw = max(2, int(h * scale / 28) * 2), max(2, int(w * scale / 28) * 2)
            grid = [1, gh, gw]
            text = max(8, int(rng.lognormvariate(math.log(120), 0.8)))
        image_tokens = grid[1] * grid[2] // 4 + 2 if grid else 0
        text = min(text, max_tokens - image_tokens)
        if text >= 8:
            out.append({"text": text, "grid": grid})
    return out


def sample_length(s: dict) -> int:
    return s["text"] + (s["grid"][1] * s["grid"][2] // 4 + 2 if s["grid"] else 0)


def pack_ffd(samples: list[dict], row_tokens: int) -> list[list[dict]]:
    rows: list[list[dict]] = []
    room: list[int] = []
    for s in sorted(samples, key=sample_length, reverse=True):
        n = sample_length(s)
        for i, free in enumerate(room):
            if n <= free:
                rows[i].append(s)
                room[i] -= n
                break
        else:
            rows.append([s])
            room.append(row_tokens - n)
    return rows


def build_row(samples: list[dict], cfg: MindVLConfig, pad_to: int | None, gen: torch.Generator, device, dtype):
    """One packed row (dict of model inputs) from samples; `pad_to` pads every sample to that length."""
    ids, labels, lengths, grids = [], [], [], []
    for s in samples:
        seq = torch.randint(0, cfg.text.vocab_size - 10, (s["text"],), generator=gen)
        if s["grid"]:
            pads = s["grid"][1] * s["grid"][2] // 4
            seq = torch.cat([seq[: s["text"] // 2], torch.tensor([cfg.vision_start_token_id]),
                             torch.full((pads,), cfg.image_token_id), torch.tensor([cfg.vision_end_token_id]),
                             seq[s["text"] // 2:]])
            grids.append(s["grid"])
        lab = seq.clone()
        lab[seq == cfg.image_token_id] = -100
        n = len(seq)
        if pad_to is not None and pad_to > n:
            seq = torch.cat([seq, torch.zeros(pad_to - n, dtype=torch.long)])
            lab = torch.cat([lab, torch.full((pad_to - n,), -100)])
        ids.append(seq)
        labels.append(lab)
        lengths.append(len(seq))
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim, generator=gen) if grids else None
    row = {
        "input_ids": torch.cat(ids).to(device),
        "labels": torch.cat(labels).to(device),
        "cu_seqlens": F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device=device, dtype=torch.int32),
        "image_grid_thw": grid,
        "pixel_values": pixels.to(device=device, dtype=dtype) if pixels is not None else None,
    }
    real = sum(sample_length(s) for s in samples)
    return row, real, lengths, grids


def run_arm(model, rows, device) -> float:
    """Seconds for forward+backward over all rows (after one warm-up row)."""
    def step(row):
        loss_sum, count = model(**row)
        (loss_sum / count.clamp(min=1)).backward()

    step(rows[0])
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for row in rows:
        step(row)
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=6, help="how many packed rows of samples to time")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds; the best of each arm counts")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    cfg = make_config(args.preset)
    model = MindVL(cfg)
    model.init_weights(args.seed)
    model.to(device=device, dtype=dtype)
    model.set_attention_backend(args.backend)

    corpus = sample_corpus(40 * args.rows, PRESETS[args.preset]["max_pixels"], args.row_tokens, args.seed)
    all_rows = pack_ffd(corpus, args.row_tokens)
    # Rows spread evenly over the packing order: FFD's first rows hold the longest samples, its last the shortest.
    packed_groups = [all_rows[i * len(all_rows) // args.rows] for i in range(args.rows)]
    chosen = [s for g in packed_groups for s in g]
    random.Random(args.seed).shuffle(chosen)  # padded batches see samples in arrival order, not sorted
    per_batch = max(1, round(len(chosen) / len(packed_groups)))
    padded_groups = [chosen[i : i + per_batch] for i in range(0, len(chosen), per_batch)]

    gen = torch.Generator().manual_seed(args.seed)
    packed = [build_row(g, cfg, None, gen, device, dtype) for g in packed_groups]
    padded = [build_row(g, cfg, max(sample_length(s) for s in g), gen, device, dtype) for g in padded_groups]
    real_tokens = sum(r[1] for r in packed)
    padded_slots = sum(int(r[0]["input_ids"].shape[0]) for r in padded)

    flops = sum(training_flops(cfg, [sample_length(s) for s in g], int((r[0]["labels"] != -100).sum()), r[3])
                for g, r in zip(packed_groups, packed, strict=True))
    peak, peak_how = device_peak_flops(device, dtype)

    # Alternate the arms and keep each one's best round, so a busy machine does not decide the comparison.
    t_packed = t_padded = float("inf")
    for _ in range(args.rounds):
        t_packed = min(t_packed, run_arm(model, [r[0] for r in packed], device))
        t_padded = min(t_padded, run_arm(model, [r[0] for r in padded], device))
    print(f"device: {device} ({peak_how}: {peak / 1e12:.2f} TFLOP/s), dtype {args.dtype}, preset {args.preset}, "
          f"attention {args.backend}")
    print(f"samples: {len(chosen)} ({sum(1 for s in chosen if s['grid'])} with an image), real tokens {real_tokens}, "
          f"packed rows {len(packed)} x <= {args.row_tokens}, padded batches {len(padded)} x {per_batch} samples "
          f"({padded_slots} token slots, {100 * (1 - real_tokens / padded_slots):.1f}% padding)")
    print(f"{'arm':<8}{'seconds':>10}{'real tokens/s':>16}{'MFU %':>8}")
    for name, secs in (("packed", t_packed), ("padded", t_padded)):
        print(f"{name:<8}{secs:>10.2f}{real_tokens / secs:>16.0f}{100 * flops / secs / peak:>8.1f}")
    print(f"packed / padded throughput ratio: {t_padded / t_packed:.2f}x")


if __name__ == "__main__":
    main()
