"""`mindvl convert`: import a HF checkpoint, or compose a MindVL model from two."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="import a local HF checkpoint or compose a MindVL model",
        description="Import a local transformers checkpoint (--from-hf): Qwen2.5-VL, Qwen3-VL (dense and MoE), "
        "Qwen3.5 (dense and MoE, with or without its vision tower), Qwen3, Qwen2 or DeepSeek-V3; export a model back "
        "to transformers' layout (--to-hf: Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3, Qwen2, DeepSeek-V3; a MindVL "
        "composition has no transformers class); or compose a MindVL model from the vision tower of one checkpoint "
        "(Qwen2.5-VL or Qwen3-VL) and the language model of another (Qwen3, Qwen2, DeepSeek-V3) with a new projector.",
    )
    p.add_argument("--from-hf", metavar="DIR", help="a local HF model folder (config.json + safetensors)")
    p.add_argument("--tokenizer", metavar="DIR", help="with --from-hf: the model's tokenizer folder, for a source "
                   "without tokenizer.json (default: the source's)")
    p.add_argument("--to-hf", metavar="DIR", help="a mindvl model folder to export back to transformers' layout")
    p.add_argument("--vision-from", metavar="DIR", help="Qwen2.5-VL folder whose vision tower to use")
    p.add_argument("--language-from", metavar="DIR", help="Qwen3/Qwen2 causal-LM folder to use as the LLM")
    p.add_argument("--out", required=True, metavar="OUT", help="output folder (must not exist unless --overwrite)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new projector (composition only)")
    p.add_argument("--position-encoding", choices=("mrope", "rope"), default="mrope",
                   help="composition only: M-RoPE (3-D image positions) or plain 1-D RoPE")
    p.add_argument("--max-shard-gb", type=float, default=4.0, help="largest safetensors shard, in GiB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: every `mindvl` command (even --version) would otherwise import torch.
    from mindvl.checkpoint import compose, convert_from_hf
    from mindvl.checkpoint.hf_export import export_to_hf

    shard = int(args.max_shard_gb * 1024**3)
    modes = [bool(args.from_hf), bool(args.to_hf), bool(args.vision_from or args.language_from)]
    if args.tokenizer is not None and not args.from_hf:
        raise ValueError("--tokenizer goes with --from-hf (compose takes the language model's tokenizer)")
    if sum(modes) > 1:
        raise ValueError("use one of --from-hf DIR, --to-hf DIR, or --vision-from DIR --language-from DIR")
    if args.to_hf:
        out = export_to_hf(args.to_hf, args.out, overwrite=args.overwrite, max_shard_bytes=shard)
    elif args.from_hf:
        out = convert_from_hf(args.from_hf, args.out, overwrite=args.overwrite, max_shard_bytes=shard,
                              tokenizer_from=args.tokenizer)
        if not (Path(out) / "tokenizer.json").is_file():
            # A warning, not a refusal: the weights converted correctly, and the tokenizer can come later.
            print(f"mindvl convert: warning: {args.from_hf} has no tokenizer.json, so {out} has none: chat and eval "
                  "need --tokenizer DIR, training data.tokenizer=DIR; or convert again with --tokenizer DIR (the "
                  "model's own tokenizer) to copy it in", file=sys.stderr)
    elif args.vision_from and args.language_from:
        out = compose(args.vision_from, args.language_from, args.out, seed=args.seed,
                      position_encoding=args.position_encoding, overwrite=args.overwrite, max_shard_bytes=shard)
    else:
        raise ValueError("give --from-hf DIR, --to-hf DIR, or both --vision-from DIR and --language-from DIR")
    print(f"wrote {out}")
    return 0
