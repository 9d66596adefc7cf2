"""Cost of the aesthetic, NSFW and watermark score stages at the real models' shapes, and what sharing one CLIP image
embedding per image saves.

Models have the shapes LAION scored LAION-5B with and random weights (hubs are unreachable here; cost depends on
shapes, not weights): a CLIP with OpenAI ViT-L/14's vision tower (224 px, 24 layers, width 1024, 768-d projection)
and CLIP-L's text tower; LAION's improved aesthetic predictor (768-1024-128-64-16-1); the CLIP NSFW detector's
PyTorch port (normalisation + 768-64-512-256-1); an EfficientNet-B3-shaped watermark classifier at 256 px (LAION's
detector is a timm EfficientNet-B3 with a 2-class head) as a transformers image-classification folder.

Pipeline (in-process, one thread, as one curation worker): aesthetic_score -> nsfw_score -> watermark_score
(classifier) -> clip_score -> embed. Arms, alternating round by round: `shared` (as shipped: the CLIP image
embedding is computed once per image, by the first stage needing it) and `unshared` (every stage embeds again, as
separate scorers would). Per stage: records per CPU-second (process time spent in the stage); per arm: wall seconds
of the whole run, median and range over rounds, and the ratio unshared / shared.

    python benchmarks/bench_curate_scores.py --n 8 --rounds 2 --tmp /tmp/bs --build-only   # models, untimed
    python benchmarks/bench_curate_scores.py --n 8 --rounds 2 --tmp /tmp/bs
    python benchmarks/bench_curate_scores.py --small      # tiny shapes: checks the script in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from mindvl.curate import PipelineConfig, run_pipeline
from mindvl.curate.synth import pairs_corpus

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "mindvl", "assets", "tokenizer", "tokenizer.json")


def build_models(d: str, small: bool) -> dict[str, str]:
    from safetensors.torch import save_file
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        EfficientNetConfig,
        EfficientNetForImageClassification,
        EfficientNetImageProcessor,
        PreTrainedTokenizerFast,
    )

    paths = {"clip": os.path.join(d, "clip"), "wm": os.path.join(d, "watermark"),
             "aesthetic": os.path.join(d, "aesthetic.pth"), "nsfw": os.path.join(d, "nsfw.safetensors")}
    if all(os.path.exists(p) for p in paths.values()):  # built by an earlier --build-only call
        return paths
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tok.pad_token = tok.convert_ids_to_tokens(0)
    if small:
        text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": 32, "patch_size": 8}
        dim, side = 16, 32
    else:  # OpenAI CLIP ViT-L/14 (224 px)
        text = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
        vision = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "image_size": 224, "patch_size": 14}
        dim, side = 768, 224
    cfg = CLIPConfig(text_config={**text, "vocab_size": len(tok), "max_position_embeddings": 77, "eos_token_id": 2},
                     vision_config=vision, projection_dim=dim)
    CLIPModel(cfg).eval().save_pretrained(paths["clip"])
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(
        paths["clip"])
    tok.save_pretrained(paths["clip"])

    aesthetic = torch.nn.Sequential(torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    torch.save({f"layers.{k}": v for k, v in aesthetic.state_dict().items()}, paths["aesthetic"])
    sizes = [dim, 64, 512, 256, 1]
    nsfw = {"norm.mean": torch.zeros(dim), "norm.variance": torch.ones(dim)}
    for i in range(4):
        layer = torch.nn.Linear(sizes[i], sizes[i + 1])
        nsfw[f"linear_{i + 1}.weight"], nsfw[f"linear_{i + 1}.bias"] = layer.weight.data, layer.bias.data
    save_file(nsfw, paths["nsfw"])

    wm = EfficientNetConfig(width_coefficient=1.2, depth_coefficient=1.4, image_size=256, hidden_dim=1536,
                            num_labels=2, id2label={0: "watermark", 1: "clear"}, label2id={"watermark": 0, "clear": 1})
    if small:
        wm = EfficientNetConfig(width_coefficient=0.1, depth_coefficient=0.1, image_size=32, hidden_dim=128,
                                num_labels=2, id2label={0: "watermark", 1: "clear"},
                                label2id={"watermark": 0, "clear": 1})
    EfficientNetForImageClassification(wm).eval().save_pretrained(paths["wm"])
    EfficientNetImageProcessor(size={"height": wm.image_size, "width": wm.image_size}).save_pretrained(paths["wm"])
    return paths


def stages(paths: dict[str, str]) -> list[dict]:
    return [{"aesthetic_score": {"model": paths["clip"], "head": paths["aesthetic"], "min_score": -1e9}},
            {"nsfw_score": {"model": paths["clip"], "head": paths["nsfw"], "max_score": 2.0}},
            {"watermark_score": {"classifier": paths["wm"], "label": "watermark", "max_score": 2.0}},
            {"clip_score": {"model": paths["clip"]}},
            {"embed": {"model": paths["clip"]}}]


def unshared(enabled: bool):
    """Make every stage embed again (the `unshared` arm) by forgetting an item's embedding before each use."""
    from mindvl.curate.stages import embed, scores

    original = getattr(embed, "_original_clip_image_features", embed.clip_image_features)
    embed._original_clip_image_features = original

    def forgetting(path, pairs, batch_size, device="cpu"):
        for item, _ in pairs:
            item.features.pop(path, None)
        return original(path, pairs, batch_size, device)

    fn = forgetting if enabled else original
    embed.clip_image_features = scores.clip_image_features = fn


def one_run(files: list[str], out: str, paths: dict[str, str], batch_size: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cfg = PipelineConfig.from_dict({"inputs": files, "output": out, "stages": stages(paths),
                                    "batch_size": batch_size})
    t0 = time.perf_counter()
    run_pipeline(cfg)
    wall = time.perf_counter() - t0
    report = json.load(open(os.path.join(out, "report.json")))
    return {"wall": wall, "written": report["written"],
            "stages": {k: (v["in"], v["cpu_seconds"]) for k, v in report["stages"].items() if k != "read"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="images")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny model shapes (a check of the script)")
    ap.add_argument("--tmp", default=None, help="work folder (kept); models already built there are reused")
    ap.add_argument("--build-only", action="store_true", help="build the corpus and models in --tmp and exit "
                    "(so a timed run under the machine's lock does not spend its time writing 1.7 GB of weights)")
    args = ap.parse_args()
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_scores_")
    files = pairs_corpus(os.path.join(tmp, "in"), args.n, dup_fraction=0.0, n_files=1, seed=0).files
    t0 = time.perf_counter()
    paths = build_models(os.path.join(tmp, "models"), args.small)
    if args.build_only:
        print(f"built in {tmp}")
        return
    print(f"models built in {time.perf_counter() - t0:.1f} s; {args.n} images, {args.rounds} rounds, "
          f"batch {args.batch_size}, torch threads {torch.get_num_threads()} -> 1 in the stages")
    unshared(False)
    one_run(files, os.path.join(tmp, "warm"), paths, args.batch_size)  # loads every model once (not timed)
    runs: dict[str, list[dict]] = {"shared": [], "unshared": []}
    for r in range(args.rounds):
        for arm in (("shared", "unshared") if r % 2 == 0 else ("unshared", "shared")):
            unshared(arm == "unshared")
            runs[arm].append(one_run(files, os.path.join(tmp, arm), paths, args.batch_size))
            print(f"round {r} {arm}: {runs[arm][-1]['wall']:.1f} s")
    unshared(False)
    print("\n| stage | shared: records per CPU-s | unshared: records per CPU-s |\n|---|---|---|")
    for label in runs["shared"][0]["stages"]:
        cells = []
        for arm in ("shared", "unshared"):
            rates = [run["stages"][label][0] / run["stages"][label][1] for run in runs[arm]]
            cells.append(f"{statistics.median(rates):.3g} ({min(rates):.3g}..{max(rates):.3g})")
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    walls = {arm: [run["wall"] for run in v] for arm, v in runs.items()}
    ratios = [u / s for u, s in zip(walls["unshared"], walls["shared"], strict=True)]
    print("\n| arm | wall s, median (min..max) | images/s |\n|---|---|---|")
    for arm, w in walls.items():
        print(f"| {arm} | {statistics.median(w):.1f} ({min(w):.1f}..{max(w):.1f}) | "
              f"{args.n / statistics.median(w):.3g} |")
    print(f"\nunshared / shared wall: {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}), "
          f"per round {[round(x, 2) for x in ratios]}")
    if not args.tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
