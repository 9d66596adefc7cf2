"""`mindvl merge CKPT... --out DIR`: average model folders (the paper's model merging), streaming tensor by tensor."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("merge", help="average model folders, or an MLLM's language model with a base LLM's")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="mindvl model folders of one architecture")
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--weights", type=_weights, default=None,
                   help="comma-separated relative weights, one per CKPT (with --language-model-from: MLLM,BASE); "
                        "normalised to sum to 1; default: uniform")
    p.add_argument("--language-model-from", metavar="BASE", default=None,
                   help="average only the language model of the one CKPT with this base LLM (a mindvl folder or a "
                        "Qwen3/Qwen2 transformers folder); vision tower and projector are copied")
    p.add_argument("--dtype", choices=("keep", "bf16", "fp16", "fp32"), default="keep",
                   help="dtype of the written floating-point tensors (default: the inputs')")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run)


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated numbers like 0.5,0.3,0.2") from None


def run(args) -> int:
    from mindvl.checkpoint.merge import merge_checkpoints

    result = merge_checkpoints(args.checkpoints, args.out, weights=args.weights, overwrite=args.overwrite,
                               dtype=args.dtype, language_model_from=args.language_model_from)
    print(result.describe())
    return 0
