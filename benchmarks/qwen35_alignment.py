"""Qwen3.5 (dense and MoE) against transformers 5.23 on the tiny random models of tests/qwen35_tiny.py: the max
relative errors that tests/test_qwen3_5.py bounds by 1e-4, printed as one table row per model.

    PYTHONPATH=.:tests python benchmarks/qwen35_alignment.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import qwen3vl_tiny as V
import torch
from qwen35_tiny import qwen35

from mindvl.checkpoint import convert_from_hf, load_model

IMAGES = torch.tensor([[1, 6, 10], [1, 4, 4]])
VIDEOS = torch.tensor([[2, 4, 6]])
ITEMS = [("image", [1, 6, 10]), ("video", [2, 4, 6]), ("image", [1, 4, 4])]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).abs().max() / b.abs().max())


@torch.no_grad()
def row(moe: bool, root: Path) -> str:
    hf = qwen35(root / "hf", moe=moe)
    convert_from_hf(root / "hf", root / "mv")
    ours = load_model(root / "mv")
    ours.set_attention_backend("sdpa")
    text = torch.randint(2, 140, (1, 150), generator=torch.Generator().manual_seed(5))
    e_text = rel(ours(input_ids=text).logits, hf(input_ids=text, mm_token_type_ids=torch.zeros_like(text)).logits)
    ids, kinds = V.prompt(ITEMS)
    px, pv = V.patch_rows(IMAGES, 1), V.patch_rows(VIDEOS, 2)
    kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=IMAGES, pixel_values_videos=pv, video_grid_thw=VIDEOS)
    ref = hf(**kw, mm_token_type_ids=kinds).logits
    e_mm = rel(ours(**kw).logits, ref)
    e_vis = rel(ours.vision_features(px, IMAGES)[0], hf.model.visual(px, grid_thw=IMAGES).pooler_output)
    hf16 = type(hf).from_pretrained(root / "hf", dtype=torch.bfloat16, attn_implementation="eager",
                                    experts_implementation="eager").eval()
    ours16 = load_model(root / "mv", dtype=torch.bfloat16)
    e16 = rel(ours16(**kw).logits, ref), rel(hf16(**kw, mm_token_type_ids=kinds).logits, ref)
    name = "MoE (6 experts top-2 + gated shared expert)" if moe else "dense"
    return f"| {name} | {e_vis:.1e} | {e_text:.1e} | {e_mm:.1e} | {e16[0]:.1e} / {e16[1]:.1e} |"


def main() -> None:
    print("| model | vision features | logits, 150 text tokens | logits, 2 images + 1 video "
          "| bf16: ours / transformers |")
    print("|---|---|---|---|---|")
    for moe in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            print(row(moe, Path(tmp)))


if __name__ == "__main__":
    main()
