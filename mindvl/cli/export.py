"""`mindvl export CHECKPOINT --out DIR`: a training checkpoint -> a mindvl model folder (safetensors)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a training checkpoint as a model folder (load_model, chat, eval)")
    p.add_argument("checkpoint", help="a checkpoint folder (step_N), a checkpoints/ folder or a run's output_dir")
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.checkpoint.training import export_checkpoint

    print(f"exported {export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)}")
    return 0
