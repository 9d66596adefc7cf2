"""mindvl side by side with its peers on the same weights, samples and images; ratios with their spread.

    python benchmarks/bench_peers.py [--train 32000:6:3,151936:4:2] [--vocab 151936] [--rounds 3]
                                     [--tv-python /work/venv-tv/bin/python]
                                     [--sections train,optim,image,resize-loss,generate]

Sections (each arm alternated with the others, `--rounds` times; medians and min..max over rounds):
- train: a Qwen2.5-VL-shaped model (4-block ViT, 4-layer LLM) built once per vocabulary in transformers and
  converted to mindvl, for each `VOCAB:STEPS:ROUNDS` of `--train` (the 151,936-wide configuration runs fewer steps
  and rounds: transformers' padded arm computes several GB of logits per step there and takes minutes per round).
  `--samples` samples (70% with one native-resolution image); the first STEPS first-fit rows of <= 2048 tokens
  are the steps (the output states how many samples and tokens they hold); every arm trains on the same sample
  groups: mindvl's packed rows; transformers with padded sdpa batches; transformers
  padding-free (one packed row, `position_ids` [4, 1, T] whose text row restarts per sample, `use_cache=False`:
  with the cache on, transformers builds a DynamicCache and drops the packed mask, so samples would attend to each
  other). The step-0 losses of the three arms must agree (checked). Each arm round runs in its own process: the
  peak RSS is that arm's own. The optimizer is mindvl's `build_optimizer` + `clip_grad_norm` against torch's fused
  AdamW + `clip_grad_norm_` (what transformers' Trainer runs).
- optim: optimizer + clip seconds per step alone on the same model's parameters (random gradients).
- image: `--images` JPEGs of 224..1792 px sides, file bytes -> float32 patch rows; mindvl's loader path
  (`load_image` + `preprocess_uint8(resize=...)` + `expand_patches`) against transformers' PIL Qwen2-VL processor
  and, run by `--tv-python` (a venv with torchvision; never installed beside mindvl), its torchvision processor.
- resize-loss: the torch resize's tolerance against Pillow's bit-exact resize, in pixels and in the training loss
  (the same model trained 4 steps on either version of 8 images).
- generate: greedy generation of a 281-token prompt with an image (and a batch of 4 such prompts): prefill
  (time to the first token) and decode tokens/s, mindvl's `generate` against transformers' `generate`, both from
  the time stamps of each generated token in one run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QWEN_IDS = (151655, 151656, 151652, 151653)  # Qwen2.5-VL's image, video, vision-start and vision-end ids
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = QWEN_IDS


def set_vocab(vocab: int) -> None:
    """Qwen's special ids, or below Qwen's vocabulary the top of the given one."""
    global IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END
    IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = QWEN_IDS
    if vocab <= VIDEO_TOKEN:
        IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = vocab - 5, vocab - 4, vocab - 3, vocab - 2


def vl_config(vocab: int) -> dict:
    """The issue's Qwen2.5-VL shape: 4-block ViT (window attention, full attention in block 3), 4-layer LLM."""
    return dict(
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[3], in_channels=3),
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=vocab, rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        max_position_embeddings=8192, rms_norm_eps=1e-6, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}..{max(values):.3g})"


def ratio(ours: list[float], theirs: list[float], higher_is_better: bool = True) -> str:
    """Median ratio (ours/theirs, or theirs/ours for times) with the range over paired rounds."""
    pairs = [(a / b if higher_is_better else b / a) for a, b in zip(ours, theirs, strict=False)]
    return f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}..{max(pairs):.2f})"


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} (1 / 5 min) on {os.cpu_count()} CPUs"


# ---- train ----------------------------------------------------------------------------------------------------------
def make_samples(n: int, seed: int) -> list[dict]:
    """Text lengths and image grids: 30% text-only (log-normal, median ~300 tokens), 70% one native-resolution image
    (224..1792 px sides under max_pixels 256*28*28 after smart_resize) plus a short text."""
    import math

    from mindvl.data.image import smart_resize

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.7:
            h, w = smart_resize(rng.randint(224, 1792), rng.randint(224, 1792), max_pixels=256 * 28 * 28)
            out.append({"text": max(8, int(rng.lognormvariate(math.log(120), 0.8))), "grid": [1, h // 14, w // 14]})
        else:
            out.append({"text": max(8, int(rng.lognormvariate(math.log(300), 0.9))), "grid": None})
    return out


def sample_tensors(s: dict, vocab: int, gen) -> dict:
    import torch

    text = torch.randint(2, min(vocab - 10, 151000), (s["text"],), generator=gen)
    if s["grid"] is None:
        return {"ids": text, "grid": None}
    pads = s["grid"][1] * s["grid"][2] // 4
    ids = torch.cat([text[: s["text"] // 2], torch.tensor([VISION_START]), torch.full((pads,), IMAGE_TOKEN),
                     torch.tensor([VISION_END]), text[s["text"] // 2:]])
    return {"ids": ids, "grid": s["grid"], "pixels": torch.randn(pads * 4, 1176, generator=gen)}


def length(s: dict) -> int:
    return s["text"] + (s["grid"][1] * s["grid"][2] // 4 + 2 if s["grid"] else 0)


def step_groups(samples: list[dict], steps: int, row_tokens: int) -> list[list[int]]:
    """Sample indices per step: first-fit-decreasing rows of <= row_tokens, the first `steps` rows."""
    rows, room = [], []
    for i in sorted(range(len(samples)), key=lambda i: -length(samples[i])):
        n = length(samples[i])
        if n > row_tokens:
            continue
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(row_tokens - n)
    return rows[:steps]


def build_batches(arm: str, samples: list[dict], groups: list[list[int]], vocab: int, seed: int, image_token: int,
                  merge: int) -> list[dict]:
    import torch

    from mindvl.models import mrope_position_ids

    gen = torch.Generator().manual_seed(seed)
    tensors = [sample_tensors(s, vocab, gen) for s in samples]
    batches = []
    for group in groups:
        items = [tensors[i] for i in group]
        grids = [t["grid"] for t in items if t["grid"] is not None]
        pixels = torch.cat([t["pixels"] for t in items if t["grid"] is not None]) if grids else None
        grid = torch.tensor(grids, dtype=torch.long) if grids else None
        labels = [t["ids"].masked_fill((t["ids"] == IMAGE_TOKEN) | (t["ids"] == VISION_START), -100) for t in items]
        if arm == "mindvl":
            lengths = torch.tensor([len(t["ids"]) for t in items])
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
            batches.append({"input_ids": torch.cat([t["ids"] for t in items]), "labels": torch.cat(labels),
                            "cu_seqlens": cu, "pixel_values": pixels, "image_grid_thw": grid})
        elif arm == "hf_packed":
            ids = torch.cat([t["ids"] for t in items])
            lengths = torch.tensor([len(t["ids"]) for t in items])
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
            mrope = mrope_position_ids(ids, cu, grid, image_token, merge)  # [3, T], restarting per sample
            text = torch.cat([torch.arange(n) for n in lengths.tolist()])
            lab = [x.clone() for x in labels]
            for x in lab:
                x[0] = -100  # transformers shifts inside the row: the previous sample's last token must not predict it
            batches.append({"input_ids": ids[None], "labels": torch.cat(lab)[None],
                            "position_ids": torch.cat([text[None], mrope])[:, None, :], "pixel_values": pixels,
                            "image_grid_thw": grid, "mm_token_type_ids": (ids == IMAGE_TOKEN).long()[None],
                            "use_cache": False})
        else:  # hf_padded: right-padded [B, L_max] with an attention mask
            width = max(len(t["ids"]) for t in items)
            ids = torch.zeros(len(items), width, dtype=torch.long)
            lab = torch.full((len(items), width), -100, dtype=torch.long)
            mask = torch.zeros(len(items), width, dtype=torch.long)
            for b, (t, x) in enumerate(zip(items, labels, strict=True)):
                ids[b, : len(x)], lab[b, : len(x)], mask[b, : len(x)] = t["ids"], x, 1
            batches.append({"input_ids": ids, "labels": lab, "attention_mask": mask, "pixel_values": pixels,
                            "image_grid_thw": grid, "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
                            "use_cache": False})
    return batches


def train_worker(args) -> None:
    """One arm, one round: build the model from the saved folder, time `steps` full training steps."""
    import resource

    import torch

    torch.manual_seed(0)
    folder = Path(args.folder)
    samples = make_samples(args.samples, args.seed)
    groups = step_groups(samples, args.steps, args.row_tokens)
    if args.arm == "mindvl":
        from mindvl.checkpoint import load_model
        from mindvl.config import OptimSection
        from mindvl.train.optim import build_optimizer, clip_grad_norm

        model = load_model(folder / "mindvl")
        model.train()
        opt = build_optimizer(model, OptimSection(lr=1e-5, weight_decay=0.1))

        def clip():
            return clip_grad_norm([p for p in model.parameters() if p.requires_grad], 1.0)

        def loss_of(batch):
            loss_sum, count = model(**batch)
            return loss_sum / count.clamp(min=1)
        image_token, merge = model.config.image_token_id, model.config.vision.spatial_merge_size
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "hf", attn_implementation="sdpa",
                                                                   dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=True)  # Trainer's default

        def clip():
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        def loss_of(batch):
            return model(**batch).loss
        image_token, merge = IMAGE_TOKEN, 2
    batches = build_batches(args.arm, samples, groups, args.vocab, args.seed, image_token, merge)
    real = [sum(length(samples[i]) for i in g) for g in groups]
    steps, opt_s, losses = [], [], []
    for batch in batches:
        t0 = time.perf_counter()
        loss = loss_of(batch)
        loss.backward()
        t1 = time.perf_counter()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        steps.append(t2 - t0)
        opt_s.append(t2 - t1)
        losses.append(float(loss))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # GB (Linux reports KiB)
    # Step 0 warms allocators and kernels: throughput over the remaining steps.
    print(json.dumps({"tokens_per_s": sum(real[1:]) / sum(steps[1:]), "optimizer_s": statistics.median(opt_s[1:]),
                      "loss0": losses[0], "rss_gb": rss, "tokens": sum(real), "steps": len(steps),
                      "samples": sum(len(g) for g in groups), "timed_tokens": sum(real[1:]),
                      "step_s": [round(x, 3) for x in steps]}))


def run_worker(python: str, argv: list[str], env_extra: dict | None = None) -> dict:
    env = dict(os.environ, **(env_extra or {}))
    out = subprocess.run([python, str(Path(__file__).resolve()), *argv], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"worker {argv[:3]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def save_models(folder: Path, vocab: int) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mindvl.checkpoint import convert_from_hf

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(**vl_config(vocab))
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: randomise so nothing hides
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder / "hf")
    convert_from_hf(folder / "hf", folder / "mindvl")


def parse_train_configs(spec: str, rounds: int, steps: int) -> list[tuple[int, int, int]]:
    """`VOCAB[:STEPS[:ROUNDS]]`, comma-separated -> [(vocab, steps, rounds)] (missing parts: --steps / --rounds)."""
    configs = []
    for item in filter(None, spec.split(",")):
        parts = [int(x) for x in item.split(":")]
        if not 1 <= len(parts) <= 3 or min(parts) < 1 or (len(parts) > 1 and parts[1] < 2):
            raise SystemExit(f"--train {item!r}: expected VOCAB[:STEPS[:ROUNDS]] with STEPS >= 2 (step 0 is warm-up)")
        configs.append((parts[0], parts[1] if len(parts) > 1 else steps, parts[2] if len(parts) > 2 else rounds))
    return configs


def section_train(args, folder: Path) -> list[str]:
    import shutil

    lines = []
    for vocab, steps, rounds in parse_train_configs(args.train, args.rounds, args.steps):
        sub = folder / f"train-{vocab}"
        set_vocab(vocab)
        save_models(sub, vocab)
        set_vocab(args.vocab)
        lines += train_table(args, sub, vocab, steps, rounds)
        shutil.rmtree(sub)  # two copies of a 151,936-wide model: free the disk before the next configuration
    return lines


def train_table(args, folder: Path, vocab: int, steps: int, rounds: int) -> list[str]:
    arms = ["mindvl", "hf_padded", "hf_packed"]
    results: dict[str, list[dict]] = {a: [] for a in arms}
    base = ["--worker", "train", "--folder", str(folder), "--vocab", str(vocab), "--steps", str(steps),
            "--samples", str(args.samples), "--seed", str(args.seed), "--row-tokens", str(args.row_tokens),
            "--threads", str(args.threads)]
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            t0 = time.perf_counter()
            results[arm].append(run_worker(sys.executable, [*base, "--arm", arm]))
            print(f"  train vocab {vocab} round {r} {arm} ({time.perf_counter() - t0:.0f} s wall): "
                  f"{results[arm][-1]}", flush=True)
    loss0 = {a: results[a][0]["loss0"] for a in arms}
    agree = max(abs(loss0[a] - loss0["mindvl"]) for a in arms) / abs(loss0["mindvl"])
    if agree > 1e-5:  # float32 losses over thousands of tokens: a leak across samples moves them far more
        raise SystemExit(f"step-0 losses disagree ({loss0}): the arms do not train the same thing")
    tps = {a: [x["tokens_per_s"] for x in results[a]] for a in arms}
    opt = {a: [x["optimizer_s"] for x in results[a]] for a in arms}
    rss = {a: [x["rss_gb"] for x in results[a]] for a in arms}
    first = results["mindvl"][0]
    return [f"train, vocab {vocab}: {first['samples']} samples, {first['tokens']} real tokens in {steps} steps of "
            f"<= {args.row_tokens} (tokens/s over steps 2..{steps}: {first['timed_tokens']} tokens), {rounds} "
            f"rounds; step-0 losses {', '.join(f'{a} {v:.6f}' for a, v in loss0.items())} "
            f"(max relative difference {agree:.1e})",
            "| measure | mindvl packed | transformers padded (sdpa) | transformers padding-free "
            "| mindvl vs padded / padding-free (>1: mindvl better) |",
            "|---|---|---|---|---|",
            f"| train tokens/s | {spread(tps['mindvl'])} | {spread(tps['hf_padded'])} | {spread(tps['hf_packed'])} | "
            f"{ratio(tps['mindvl'], tps['hf_padded'])} / {ratio(tps['mindvl'], tps['hf_packed'])} |",
            f"| optimizer + clip s/step | {spread(opt['mindvl'])} | {spread(opt['hf_padded'])} | "
            f"{spread(opt['hf_packed'])} | {ratio(opt['mindvl'], opt['hf_padded'], False)} / "
            f"{ratio(opt['mindvl'], opt['hf_packed'], False)} |",
            f"| peak RSS GB | {spread(rss['mindvl'])} | {spread(rss['hf_padded'])} | {spread(rss['hf_packed'])} | "
            f"{ratio(rss['mindvl'], rss['hf_padded'], False)} / {ratio(rss['mindvl'], rss['hf_packed'], False)} |",
            ""]


# ---- optimizer alone ------------------------------------------------------------------------------------------------
def section_optim(args, folder: Path) -> list[str]:
    import torch

    from mindvl.checkpoint import load_model
    from mindvl.config import OptimSection
    from mindvl.train.optim import build_optimizer, clip_grad_norm

    def fresh():
        model = load_model(folder / "mindvl")
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        return model

    ours_model, ref_model, old_model = fresh(), fresh(), fresh()
    ours = build_optimizer(ours_model, OptimSection(lr=1e-5, weight_decay=0.1))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-5, weight_decay=0.1, fused=True)
    old = torch.optim.AdamW(old_model.parameters(), lr=1e-5, weight_decay=0.1)  # torch's CPU default: per parameter
    arms = {
        "mindvl": lambda: (clip_grad_norm(list(ours_model.parameters()), 1.0), ours.step()),
        "fused": lambda: (torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), 1.0), ref.step()),
        "per-parameter": lambda: (torch.nn.utils.clip_grad_norm_(list(old_model.parameters()), 1.0), old.step()),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds * 3 + 1):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            if r:  # round 0 allocates the optimizer state
                times[name].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in ours_model.parameters())
    return [f"optimizer + clip alone, {n / 1e6:.1f}M parameters, seconds per step:",
            "| mindvl | torch fused AdamW + clip_grad_norm_ | torch per-parameter AdamW (mindvl before) | "
            "ratio fused / mindvl |", "|---|---|---|---|",
            f"| {spread(times['mindvl'])} | {spread(times['fused'])} | {spread(times['per-parameter'])} | "
            f"{ratio(times['mindvl'], times['fused'], False)} |"]


# ---- images ---------------------------------------------------------------------------------------------------------
def make_images(folder: Path, n: int, seed: int) -> list[Path]:
    import numpy as np
    from PIL import Image

    rng, r = np.random.default_rng(seed), random.Random(seed)
    paths = []
    for i in range(n):
        w, h = r.randint(224, 1792), r.randint(224, 1792)
        small = rng.integers(0, 256, (max(2, h // 24), max(2, w // 24), 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC)).astype(np.int16)
        img = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)  # photo-like: smooth + noise
        paths.append(folder / f"{i:03d}.jpg")
        Image.fromarray(img).save(paths[-1], quality=90)
    return paths


def hf_image_rate(paths: list[str], kind: str) -> float:
    """Images/s of transformers' Qwen2-VL processor (`pil` or `torchvision`) from file bytes to pixel rows."""
    from PIL import Image

    if kind == "pil":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Proc
    else:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Proc
    proc = Proc(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    blobs = [Path(p).read_bytes() for p in paths]
    import io

    def one(b):
        img = Image.open(io.BytesIO(b))
        img.load()
        proc(images=[img], return_tensors="np" if kind == "pil" else "pt")

    one(blobs[0])  # warm-up, untimed in every arm (lazy imports, kernels compiled or loaded from their cache)
    t0 = time.perf_counter()
    for b in blobs:
        one(b)
    return len(blobs) / (time.perf_counter() - t0)


def mindvl_image_rate(paths: list[str], resize: str) -> float:
    from mindvl.data.image import expand_patches, load_image, preprocess_uint8

    blobs = [Path(p).read_bytes() for p in paths]
    expand_patches(preprocess_uint8(load_image(blobs[0]), resize=resize)[0])  # warm-up, as in hf_image_rate
    t0 = time.perf_counter()
    for b in blobs:
        patches, _ = preprocess_uint8(load_image(b), resize=resize)
        expand_patches(patches)
    return len(blobs) / (time.perf_counter() - t0)


def image_worker(args) -> None:
    import torch

    torch.set_num_threads(1)  # as in a loader worker (torch's DataLoader sets one thread per worker)
    paths = json.loads(Path(args.folder).read_text())
    if args.arm.startswith("mindvl-"):
        rate = mindvl_image_rate(paths, args.arm.split("-", 1)[1])
    else:
        rate = hf_image_rate(paths, args.arm)
    print(json.dumps({"images_per_s": rate}))


def section_image(args, folder: Path) -> list[str]:
    import transformers

    paths = make_images(folder, args.images, args.seed)
    listing = folder / "images.json"
    listing.write_text(json.dumps([str(p) for p in paths]))
    arms = {"mindvl-torch": sys.executable, "mindvl-pil": sys.executable, "pil": sys.executable}
    skip = ""
    tv = args.tv_python
    if tv and Path(tv).exists():
        probe = subprocess.run([tv, "-c", "import torchvision, transformers; print(transformers.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            arms["torchvision"] = tv
            if probe.stdout.strip() != transformers.__version__:
                skip = f" (torchvision arm runs transformers {probe.stdout.strip()})"
        else:
            skip = f"torchvision arm skipped: {tv} cannot import torchvision/transformers"
    else:
        skip = "torchvision arm skipped: no --tv-python (a venv with torch + torchvision + transformers)"
    rates: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm, python in (arms.items() if r % 2 == 0 else list(arms.items())[::-1]):
            rates[arm].append(run_worker(python, ["--worker", "image", "--arm", arm, "--folder", str(listing)],
                                         {"OMP_NUM_THREADS": "1"})["images_per_s"])
    lines = [f"image preprocessing, {len(paths)} JPEGs 224..1792 px, file bytes -> float32 rows, one thread, "
             f"images/s{skip}:",
             "| arm | images/s | mindvl (torch resize) / arm |", "|---|---|---|"]
    for arm in arms:
        lines.append(f"| {arm} | {spread(rates[arm])} | {ratio(rates['mindvl-torch'], rates[arm])} |")
    return lines


def section_resize_loss(args, folder: Path) -> list[str]:
    """The effect of the torch resize's tolerance on the training loss: the same model, text and images, once with
    Pillow-resized (bit-exact) and once with torch-resized pixels; the loss at step 0 and after 3 AdamW steps."""
    import torch

    from mindvl.checkpoint import load_model
    from mindvl.config import OptimSection
    from mindvl.data.image import expand_patches, load_image, preprocess_uint8
    from mindvl.train.optim import build_optimizer

    images = sorted(folder.glob("*.jpg"))[:8] or make_images(folder, 8, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {}
    for method in ("pil", "torch"):
        ids, pixels, grids, lengths = [], [], [], []
        for path in images:
            patches, grid = preprocess_uint8(load_image(path.read_bytes()), max_pixels=256 * 28 * 28, resize=method)
            pixels.append(torch.from_numpy(expand_patches(patches)))
            grids.append(list(grid))
            pads = grid[1] * grid[2] // 4
            gen.manual_seed(len(ids))  # the same text for both resize methods
            text = torch.randint(2, min(args.vocab - 10, 151000), (64,), generator=gen)
            ids.append(torch.cat([torch.tensor([VISION_START]), torch.full((pads,), IMAGE_TOKEN),
                                  torch.tensor([VISION_END]), text]))
            lengths.append(len(ids[-1]))
        input_ids = torch.cat(ids)
        labels = input_ids.masked_fill((input_ids == IMAGE_TOKEN) | (input_ids == VISION_START), -100)
        rows[method] = {"input_ids": input_ids, "labels": labels, "pixel_values": torch.cat(pixels),
                        "image_grid_thw": torch.tensor(grids),
                        "cu_seqlens": torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()}
    diff = (rows["pil"]["pixel_values"] - rows["torch"]["pixel_values"]).abs()
    curves = {}
    for method, row in rows.items():
        model = load_model(folder / "mindvl")
        opt = build_optimizer(model, OptimSection(lr=1e-4))
        losses = []
        for _ in range(4):
            loss_sum, count = model(**row)
            loss = loss_sum / count
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        curves[method] = losses
    rel = [abs(a - b) / abs(b) for a, b in zip(curves["torch"], curves["pil"], strict=True)]
    return [f"resize tolerance vs training loss: {len(images)} JPEGs at max_pixels 256*28*28, pixel rows "
            f"max |torch - pil| {float(diff.max()):.4f} (normalised units; 2 levels = {2 / 255 / 0.2613:.4f}), "
            f"mean {float(diff.mean()):.2e}",
            f"loss per step, pil {', '.join(f'{x:.5f}' for x in curves['pil'])}; torch "
            f"{', '.join(f'{x:.5f}' for x in curves['torch'])}; max relative difference {max(rel):.1e}"]


# ---- generate -------------------------------------------------------------------------------------------------------
def section_generate(args, folder: Path) -> list[str]:
    """Each arm's run stamps the time at which every generated token is chosen (mindvl: when its token selection
    returns; transformers: its stopping criteria, called right after each token): prefill = time to the first token,
    decode = the further tokens over the time from the first token to the last, both from one run (no difference of
    two noisy timings)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, StoppingCriteria, StoppingCriteriaList

    from mindvl.checkpoint import load_model
    from mindvl.infer import Prompt, generate

    mindvl_generate = importlib.import_module("mindvl.infer.generate")  # the module (the package exports the function)

    ours = load_model(folder / "mindvl").eval()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "hf", attn_implementation="sdpa",
                                                            dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(args.seed)
    grid = [1, 16, 20]  # 224 x 280 px: 80 image tokens
    prompts = []
    for _ in range(4):
        text = torch.randint(2, min(args.vocab - 10, 151000), (199,), generator=gen)
        ids = torch.cat([text[:20], torch.tensor([VISION_START]), torch.full((80,), IMAGE_TOKEN),
                         torch.tensor([VISION_END]), text[20:]])  # 281 tokens
        prompts.append(Prompt(ids, torch.randn(320, 1176, generator=gen), torch.tensor([grid])))
    stamps: list[float] = []
    choose = mindvl_generate.next_tokens

    def stamped_choice(*a, **kw):
        out = choose(*a, **kw)
        stamps.append(time.perf_counter())
        return out

    mindvl_generate.next_tokens = stamped_choice  # generate() looks the function up in its module at each step

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def ours_run(batch, n):
        return generate(ours, prompts[:batch], n)

    @torch.inference_mode()
    def hf_run(batch, n):
        ids = torch.stack([p.input_ids for p in prompts[:batch]])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          pixel_values=torch.cat([p.pixel_values for p in prompts[:batch]]),
                          image_grid_thw=torch.cat([p.image_grid_thw for p in prompts[:batch]]),
                          mm_token_type_ids=(ids == IMAGE_TOKEN).long(), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, stopping_criteria=StoppingCriteriaList([Stamp()]))
        return out[:, ids.shape[1]:].tolist()

    new = args.new_tokens
    same = ours_run(1, 8)[0] == hf_run(1, 8)[0]  # also warms both arms up
    ours_run(4, 2), hf_run(4, 2)
    prefill: dict[str, list[float]] = {}
    decode: dict[str, list[float]] = {}
    for r in range(args.rounds * 2):
        arms = (("mindvl", ours_run), ("hf", hf_run))
        for name, fn in (arms if r % 2 == 0 else arms[::-1]):
            for batch in (1, 4):
                stamps.clear()
                t0 = time.perf_counter()
                fn(batch, new)
                if len(stamps) != new:
                    raise SystemExit(f"{name}: {len(stamps)} token stamps for {new} tokens")
                prefill.setdefault(f"{name}-{batch}", []).append(stamps[0] - t0)
                decode.setdefault(f"{name}-{batch}", []).append(batch * (new - 1) / (stamps[-1] - stamps[0]))
    mindvl_generate.next_tokens = choose
    lines = [f"greedy generation, prompts of 281 tokens with one 224x280 image (80 image tokens), {new} new tokens, "
             f"{args.rounds * 2} rounds; prefill = time to the first token, decode = the further tokens over their "
             f"time; greedy tokens {'equal' if same else 'DIFFER (random weights: near-ties in fp32)'}:",
             "| measure | mindvl | transformers | mindvl vs transformers (>1: mindvl faster) |", "|---|---|---|---|"]
    for batch in (1, 4):
        pre_o, pre_h = prefill[f"mindvl-{batch}"], prefill[f"hf-{batch}"]
        dec_o, dec_h = decode[f"mindvl-{batch}"], decode[f"hf-{batch}"]
        lines.append(f"| prefill ms, batch {batch} | {spread([1e3 * x for x in pre_o])} | "
                     f"{spread([1e3 * x for x in pre_h])} | {ratio(pre_o, pre_h, False)} |")
        lines.append(f"| decode tokens/s, batch {batch} | {spread(dec_o)} | {spread(dec_h)} | {ratio(dec_o, dec_h)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="train,optim,image,resize-loss,generate")
    ap.add_argument("--train", default="32000:6:3,151936:4:2",
                    help="train configurations VOCAB[:STEPS[:ROUNDS]], comma-separated")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of the optim/resize-loss/generate models")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samples", type=int, default=28)
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads of the train, optim, resize-loss and generate arms (image arms use one)")
    ap.add_argument("--tv-python", default=None, help="python of a venv with torchvision + transformers")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    set_vocab(args.vocab)
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "train":
        return train_worker(args)
    if args.worker == "image":
        return image_worker(args)
    print(f"bench_peers: torch {torch.__version__}, {torch.get_num_threads()} threads; {load_average()}", flush=True)
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if {"optim", "generate", "resize-loss"} & set(sections):
            save_models(folder, args.vocab)
        for name in sections:
            fn = {"train": section_train, "optim": section_optim, "image": section_image,
                  "resize-loss": section_resize_loss, "generate": section_generate}[name]
            print("\n".join(fn(args, folder)), flush=True)
            print(f"({load_average()})\n", flush=True)


if __name__ == "__main__":
    main()
