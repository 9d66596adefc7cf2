"""`mindvl export CHECKPOINT --out DIR`: a training checkpoint -> a mindvl model folder (safetensors); a LoRA run's
checkpoint -> its merged weights + DIR/adapter (PEFT layout). `mindvl export ADAPTER --merge-adapters --out DIR`:
an adapter folder folded into its base model."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a training checkpoint as a model folder (load_model, chat, eval), "
                                             "or fold an adapter folder into its base (--merge-adapters)")
    p.add_argument("checkpoint", help="a checkpoint folder (step_N), a checkpoints/ folder or a run's output_dir; with "
                                      "--merge-adapters an adapter folder (adapter_config.json)")
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--merge-adapters", action="store_true",
                   help="fold a LoRA adapter folder into its base model's weights")
    p.add_argument("--base", default=None, help="with --merge-adapters: the base model folder (default: the "
                                               "adapter config's base_model_name_or_path)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from mindvl.checkpoint.adapters import fold_adapter, is_adapter_folder

    adapter = is_adapter_folder(args.checkpoint) and not (Path(args.checkpoint) / "config.json").is_file()
    if args.merge_adapters or adapter:
        if not adapter:
            raise ValueError(f"--merge-adapters: {args.checkpoint} is not an adapter folder (no adapter_config.json); "
                             "a LoRA run's checkpoint exports merged without the flag")
        if not args.merge_adapters:
            raise ValueError(f"{args.checkpoint} is an adapter folder; add --merge-adapters to fold it into its base")
        print(f"exported {fold_adapter(args.checkpoint, args.out, base=args.base, overwrite=args.overwrite)}")
        return 0
    from mindvl.checkpoint.training import export_checkpoint
    from mindvl.train.qlora import quantize_like_run

    out = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite, quantizer=quantize_like_run)
    print(f"exported {out}")
    return 0
