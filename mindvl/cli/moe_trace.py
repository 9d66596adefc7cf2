"""`mindvl moe-trace MODEL --corpus FILE --out TRACE.npz`: record every MoE layer's top-k expert ids over a corpus
(prefill only, sequence boundaries kept), for `mindvl moe-analyze`."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("moe-trace", help="record the router top-k of an MoE model over a corpus")
    p.add_argument("model", help="a mindvl MoE model folder or a transformers MoE causal LM folder (DeepSeek-V3, "
                                 "Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE)")
    p.add_argument("--corpus", required=True, help='.jsonl of {"text": ...} or {"input_ids": [...]} records')
    p.add_argument("--out", required=True, help="trace file to write (.npz)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder or tokenizer.json (default: the model's)")
    p.add_argument("--text-key", default="text", help="the JSONL field holding the text (default: text)")
    p.add_argument("--max-sequences", type=int, help="trace only the first N records")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, ... (default cpu)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.moe_analysis.trace import trace_folder

    path = trace_folder(args.model, args.corpus, args.tokenizer, args.out, text_key=args.text_key,
                        max_sequences=args.max_sequences, device=args.device)
    print(f"wrote {path}")
    return 0
