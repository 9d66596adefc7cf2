"""Qwen3-VL (dense and MoE) against transformers on the tiny random models of tests/qwen3vl_tiny.py: the max
relative errors (max |ours - theirs| / max |theirs|) that benchmarks/RESULTS.md "Qwen3-VL" records.

    python benchmarks/qwen3_vl_alignment.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import qwen3vl_tiny as Q  # noqa: E402

from mindvl.checkpoint import convert_from_hf, load_model  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@torch.no_grad()
def main() -> None:
    images, videos = torch.tensor([[1, 6, 10], [1, 4, 4]]), torch.tensor([[2, 4, 6]])
    ids, kinds = Q.prompt([("image", [1, 6, 10]), ("video", [2, 4, 6]), ("image", [1, 4, 4])])
    px, pv = Q.patch_rows(images, 1), Q.patch_rows(videos, 2)
    kw = dict(input_ids=ids, pixel_values=px, image_grid_thw=images, pixel_values_videos=pv, video_grid_thw=videos)
    grid = torch.tensor([[1, 6, 10], [1, 4, 4], [2, 2, 6], [1, 8, 2], [1, 4, 8]])
    gpx = Q.patch_rows(grid, 3)
    print("| model | vision features | DeepStack features (2) | logits, 2 images + 1 video | positions | "
          "bf16 logits: ours / transformers |")
    print("|---|---|---|---|---|---|")
    for name, moe in (("dense (Qwen3 LLM)", False), ("MoE (Qwen3-MoE LLM)", True)):
        with tempfile.TemporaryDirectory() as tmp:
            hf = Q.qwen3vl(Path(tmp) / "hf", moe=moe)
            convert_from_hf(Path(tmp) / "hf", Path(tmp) / "mv")
            ours = load_model(Path(tmp) / "mv")
            ref_v = hf.model.visual(gpx, grid_thw=grid)
            feats, stack = ours.vision_features(gpx, grid)
            ref = hf(**kw, mm_token_type_ids=kinds).logits
            logits = ours(**kw).logits
            pos, _ = hf.model.get_rope_index(ids, kinds, images, videos)
            mine = ours.default_position_ids(ids[0], torch.tensor([0, ids.shape[1]], dtype=torch.int32), images,
                                             videos)
            hf16 = type(hf).from_pretrained(Path(tmp) / "hf", dtype=torch.bfloat16, attn_implementation="eager",
                                            experts_implementation="eager").eval()
            ours16 = load_model(Path(tmp) / "mv", dtype=torch.bfloat16)
            e16 = (rel(ours16(**kw).logits, ref), rel(hf16(**kw, mm_token_type_ids=kinds).logits, ref))
            ds = max(rel(a, b) for a, b in zip(stack, ref_v.deepstack_features, strict=True))
            print(f"| {name} | {rel(feats, ref_v.pooler_output):.1e} | {ds:.1e} | {rel(logits, ref):.1e} | "
                  f"{'equal' if torch.equal(pos[:, 0], mine) else 'DIFFER'} | {e16[0]:.1e} / {e16[1]:.1e} |")


if __name__ == "__main__":
    main()
