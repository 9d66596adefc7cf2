"""`mindvl data stats`: one pass over sources with the real pipeline, reporting counts, histograms, packing efficiency
and skipped samples by reason."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import DataConfig, SourceConfig
from .image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from .sources import resolve_files
from .stream import PackStream
from .tokenizer import TextTokenizer, load_tokenizer


def _histogram(values: Sequence[int]) -> dict[str, int]:
    """Counts per power-of-two bucket, keyed '<=N' (0 gets its own bucket)."""
    out: dict[str, int] = {}
    for v in sorted(values):
        key = "0" if v == 0 else f"<={1 << max(0, int(v - 1).bit_length())}"
        out[key] = out.get(key, 0) + 1
    return out


def dataset_stats(paths: Sequence[str], seq_len: int, tokenizer: str | TextTokenizer | None = None,
                  min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS,
                  pack_buffer: int = 256, max_patches_per_pack: int | None = None,
                  truncation: str = "truncate", processor=None) -> dict:
    """Stats for one epoch of the given files/globs (each argument one source); `processor`: a data.processor
    spec (`qwen2_vl`, `qwen3_vl`, a VisionProcessing; default Qwen2-VL's) that cuts the patches."""
    cfg = DataConfig(
        sources=[SourceConfig(name=f"{i}:{p}", paths=[p]) for i, p in enumerate(paths)],
        seq_len=seq_len, min_pixels=min_pixels, max_pixels=max_pixels, pack_buffer=pack_buffer,
        max_patches_per_pack=max_patches_per_pack, truncation=truncation, processor=processor,
    )
    cfg.validate("stats")
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)
    files = [resolve_files(s.paths, s.format, f"source {s.name}") for s in cfg.sources]
    stream = PackStream(cfg, tok, files, slot=0, n_slots=1, max_epochs=1, context="stats")
    tokens: list[int] = []
    patches: list[int] = []
    n_packs = real = images = 0
    vs = tok.special.vision_start
    for pack in stream:
        n_packs += 1
        real += pack.num_real_tokens
        images += len(pack.image_grid_thw)
        per_image = np.asarray(pack.image_grid_thw).prod(-1) if len(pack.image_grid_thw) else np.zeros(0, np.int64)
        cu = np.asarray(pack.cu_seqlens)
        ids = np.asarray(pack.input_ids)
        k = 0
        for j in range(pack.num_samples):
            seg = ids[cu[j]:cu[j + 1]]
            n_img = int((seg == vs).sum())
            tokens.append(len(seg))
            patches.append(int(per_image[k:k + n_img].sum()))
            k += n_img
    state = stream.state_dict()
    return {
        "samples": len(tokens),
        "images": images,
        "tokens": int(sum(tokens)),
        "patches": int(sum(patches)),
        "packs": n_packs,
        "seq_len": seq_len,
        "packing_efficiency": real / (n_packs * seq_len) if n_packs else 0.0,
        "skipped": state["skipped"],
        "truncated": state["truncated"],
        "token_histogram": _histogram(tokens),
        "patch_histogram": _histogram(patches),
        "sources": state["consumed"],
        "tokenizer": tok.name,
    }


def format_stats(s: dict) -> str:
    """Human-readable report."""
    lines = [
        f"samples            {s['samples']}",
        f"images             {s['images']}",
        f"tokens             {s['tokens']}  (mean {s['tokens'] / max(1, s['samples']):.1f} per sample)",
        f"trained tokens     {_trained_total(s)}",
        f"vision patches     {s['patches']}",
        f"packs @ {s['seq_len']:<10} {s['packs']}",
        f"packing efficiency {100 * s['packing_efficiency']:.2f}% (real tokens / token slots)",
        f"truncated          {s['truncated']}",
        f"skipped            {sum(s['skipped'].values())}" + "".join(
            f"\n  {reason:<22} {n}" for reason, n in s["skipped"].items()),
        "tokens per sample:",
        *[f"  {k:>8}  {v}" for k, v in s["token_histogram"].items()],
        "patches per sample:",
        *[f"  {k:>8}  {v}" for k, v in s["patch_histogram"].items()],
        "per source:",
        *[f"  {name}: {row['samples']} samples, {row['tokens']} tokens ({_trained(row)}), {row['images']} images"
          for name, row in s["sources"].items()],
    ]
    return "\n".join(lines)


def _trained(row: dict) -> str:
    """The labelled share of a source's tokens: what the loss sees (assistant turns, document text)."""
    if "trained_tokens" not in row:
        return "trained tokens not counted"
    return f"{row['trained_tokens']} trained, {100 * row['trained_tokens'] / max(1, row['tokens']):.1f}%"


def _trained_total(s: dict) -> str:
    rows = list(s["sources"].values())
    if not rows or any("trained_tokens" not in r for r in rows):
        return "not counted"
    trained = sum(r["trained_tokens"] for r in rows)
    return f"{trained}  ({100 * trained / max(1, s['tokens']):.1f}% of tokens: the labelled ones the loss sees)"
