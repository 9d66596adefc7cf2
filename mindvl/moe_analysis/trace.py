"""Router tracing: the top-k experts every token of a corpus is routed to, in every MoE layer (prefill only).

    trace = trace_corpus(model, [ids_0, ids_1, ...])          # -> RouterTrace (mindvl.moe_analysis.trace_io)
    trace_folder(model_dir, "corpus.jsonl", tokenizer_dir, "trace.npz")

Two kinds of model are traced:

- a mindvl model with a DeepSeek-V3-style language model (`MindVL`, or its bare `TextModel`): its routers record
  their choices when asked (`mindvl.models.moe.record_routing`), no hooks. Several sequences are packed into one
  row per forward (`max_tokens_per_forward`) with `cu_seqlens`, so nothing attends across sequences and the result
  equals one forward per sequence.
- a transformers MoE causal LM (DeepSeek-V3, Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...): forward hooks on the
  routers (modules named `*.gate` whose weight has one row per routed expert; Qwen2-MoE's `shared_expert_gate` and
  dense MLPs' `gate_proj` are not routers). transformers 5.x routers return `(logits, weights [T, k], ids [T, k])`
  (DeepSeek-V3's top-k is unsorted); 4.51 DeepSeek-V3 returns `(ids, weights)`; 4.x softmax gates are plain
  Linear layers returning logits, whose softmax top-k is taken. One forward per sequence (batch 1, no padding).

Ids are stored in descending order of the routing weight, the gate value that scales each expert's output (for
softmax routers the top-k probability order; for DeepSeek-V3 the unbiased sigmoid affinity, which may differ from
the bias-corrected order that selected the experts). Scores (optional, float16) are those weights as the model
uses them (after top-k normalisation and DeepSeek's routed_scaling_factor). Layer names are the router modules'
names from `layers.` on (e.g. `layers.3.mlp.gate`), the same for a transformers model and its mindvl conversion.
Only routed experts are traced: shared experts see every token.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .trace_io import RouterTrace, save_trace

_LAYERS_PREFIX = re.compile(r"^.*?(?=layers\.\d+\.)")


def _layer_name(module_name: str) -> str:
    return _LAYERS_PREFIX.sub("", module_name, count=1)


def _sorted_by_weight(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, order = weights.float().sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), w


def _as_sequences(sequences: Sequence) -> list[torch.Tensor]:
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs:
        raise ValueError("trace_corpus: no sequences given")
    empty = [i for i, s in enumerate(seqs) if s.numel() == 0]
    if empty:
        raise ValueError(f"trace_corpus: sequences {empty[:10]} are empty; every traced sequence needs a token")
    return seqs


def _mindvl_routers(model: nn.Module) -> list:
    from mindvl.models.moe import routers  # imported here: tracing transformers models needs no mindvl model code

    return routers(model)


# ---------------------------------------------------------------------------------------------------- mindvl


def _mindvl_hidden(model: nn.Module, ids: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> None:
    """Run the language model over one packed row (no logits: the routers are all we need)."""
    if hasattr(model, "language_model"):  # MindVL
        embeds = model.embed(ids)
        positions = model.default_position_ids(ids, cu, None)
        model.language_model(embeds, positions, cu, max_seqlen)
        return
    lengths = (cu[1:] - cu[:-1]).long()
    positions = torch.arange(ids.shape[0], device=ids.device) - torch.repeat_interleave(cu[:-1].long(), lengths)
    model(model.embed_tokens(ids), positions, cu, max_seqlen)


def _trace_mindvl(model: nn.Module, seqs: list[torch.Tensor], max_tokens: int, device: torch.device):
    from mindvl.models.moe import record_routing

    rs = _mindvl_routers(model)
    names = {id(m): _layer_name(n) for n, m in model.named_modules()}
    ids_out: list[list[torch.Tensor]] = [[] for _ in rs]
    w_out: list[list[torch.Tensor]] = [[] for _ in rs]
    batches: list[list[torch.Tensor]] = [[]]
    for s in seqs:  # greedy packing, in order; a sequence longer than the budget gets a forward of its own
        if batches[-1] and sum(len(x) for x in batches[-1]) + len(s) > max_tokens:
            batches.append([])
        batches[-1].append(s)
    with record_routing(model), torch.inference_mode():
        for batch in batches:
            lengths = torch.tensor([len(s) for s in batch])
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
            _mindvl_hidden(model, torch.cat(batch).to(device), cu, int(lengths.max()))
            for i, r in enumerate(rs):
                (ids, w), = r.records  # one forward -> one record per router
                r.records.clear()
                ids_out[i].append(ids.cpu())
                w_out[i].append(w.cpu())
    layers = [names[id(r)] for r in rs]
    config = getattr(model, "config", None) or getattr(model, "cfg", None)  # MindVL / TextModel
    meta = {"source": "mindvl", "family": getattr(getattr(config, "text", config), "family", None)}
    return ids_out, w_out, layers, rs[0].num_experts, meta


# ---------------------------------------------------------------------------------------------- transformers


def _hf_num_experts(config) -> int | None:
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _hf_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    experts = _hf_num_experts(config)
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not name.endswith(".gate") or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if experts is None or weight.shape[0] == experts:
            found.append((name, module))
    return found


def _topk_of_router_output(output, top_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k]) in descending weight order from whatever the router returned."""
    if isinstance(output, torch.Tensor):  # transformers 4.x softmax gates (nn.Linear): logits [T, E]
        if top_k is None:
            raise ValueError("the router returns logits but the config has no num_experts_per_tok")
        weights, ids = output.reshape(-1, output.shape[-1]).float().softmax(-1).topk(top_k, dim=-1)
        return ids, weights
    tensors = [t for t in output if isinstance(t, torch.Tensor)]
    ids = next(t for t in tensors if not t.is_floating_point())
    # (logits, weights, ids) in 5.x; (ids, weights) for 4.x DeepSeek-V3: the LAST float tensor shaped like ids.
    weights = [t for t in tensors if t.is_floating_point() and t.shape == ids.shape][-1]
    return _sorted_by_weight(ids.reshape(-1, ids.shape[-1]), weights.reshape(-1, ids.shape[-1]))


def _trace_hf(model: nn.Module, seqs: list[torch.Tensor], device: torch.device):
    gates = _hf_routers(model)
    if not gates:
        raise ValueError(f"{type(model).__name__} has no MoE routers (modules named *.gate with one row per expert)")
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    top_k = getattr(config, "num_experts_per_tok", None)
    ids_out: list[list[torch.Tensor]] = [[] for _ in gates]
    w_out: list[list[torch.Tensor]] = [[] for _ in gates]

    def hook_for(i: int):
        def hook(module, args, output):
            ids, w = _topk_of_router_output(output, top_k)
            ids_out[i].append(ids.cpu())
            w_out[i].append(w.cpu())

        return hook

    handles = [m.register_forward_hook(hook_for(i)) for i, (_, m) in enumerate(gates)]
    body = getattr(model, "model", model)  # the decoder without the LM head: no [T, V] logits needed
    try:
        with torch.inference_mode():
            for s in seqs:
                before = len(ids_out[0])
                body(input_ids=s[None].to(device), use_cache=False)
                if any(len(x) != before + 1 for x in ids_out):
                    raise RuntimeError("a router did not run exactly once per forward; cannot attribute its tokens")
    finally:
        for h in handles:
            h.remove()
    meta = {"source": "transformers", "family": getattr(config, "model_type", None),
            "architecture": type(model).__name__}
    return ids_out, w_out, [_layer_name(n) for n, _ in gates], int(gates[0][1].weight.shape[0]), meta


# ---------------------------------------------------------------------------------------------------- public


def trace_corpus(model: nn.Module, sequences: Sequence, *, max_tokens_per_forward: int = 8192,
                 scores: bool = True, meta: dict | None = None) -> RouterTrace:
    """Prefill `sequences` (token-id tensors or lists, each >= 1 token) through `model`, recording every MoE
    layer's top-k routed experts per token. Returns a RouterTrace with the sequences concatenated in order and
    `seq_offsets` marking them. The model should be in eval mode (a mindvl model in training mode would also count
    expert load). `max_tokens_per_forward` bounds a packed mindvl forward; transformers models run one sequence
    per forward."""
    seqs = _as_sequences(sequences)
    device = next(model.parameters()).device
    if _mindvl_routers(model):
        ids_out, w_out, layers, num_experts, info = _trace_mindvl(model, seqs, max_tokens_per_forward, device)
    else:
        ids_out, w_out, layers, num_experts, info = _trace_hf(model, seqs, device)
    topk_ids = np.stack([torch.cat(chunks).numpy() for chunks in ids_out])  # [L, N, k]
    topk_scores = np.stack([torch.cat(chunks).numpy() for chunks in w_out]).astype(np.float16) if scores else None
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if topk_ids.shape[1] != offsets[-1]:
        raise RuntimeError(f"traced {topk_ids.shape[1]} tokens for {offsets[-1]} input tokens")
    info = {k: v for k, v in info.items() if v is not None}
    info.update({"top_k": int(topk_ids.shape[2]), "score": "routing weight"}, **(meta or {}))
    return RouterTrace(topk_ids=topk_ids, seq_offsets=offsets, num_experts=num_experts, layer_names=layers,
                       topk_scores=topk_scores, meta=info)


def _read_corpus(texts_or_jsonl, text_key: str) -> list:
    """A list of strings / token-id lists, or a .jsonl file of {"text": ...} or {"input_ids": [...]} records."""
    if isinstance(texts_or_jsonl, (str, os.PathLike)):
        path = Path(texts_or_jsonl)
        if not path.is_file():
            raise FileNotFoundError(f"corpus {path} not found (give a .jsonl file or a list of texts)")
        items = []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None
            if isinstance(record, dict) and "input_ids" in record:
                items.append(list(record["input_ids"]))
            elif isinstance(record, dict) and isinstance(record.get(text_key), str):
                items.append(record[text_key])
            else:
                raise ValueError(f"{path}:{line_no}: expected an object with {text_key!r} (a string) or 'input_ids'")
        return items
    return list(texts_or_jsonl)


def load_moe_model(model_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> nn.Module:
    """A mindvl model folder (model_type mindvl) or a transformers causal-LM folder, in eval mode."""
    from mindvl.checkpoint.hf import read_config

    model_dir = Path(model_dir)
    device = torch.device(device)  # the CLI checks a user's --device (mindvl.infer.device) before calling
    config = read_config(model_dir)  # errors name the file
    if config.get("model_type") == "mindvl":
        from mindvl.checkpoint import load_model

        return load_model(model_dir, dtype=dtype, device=device)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ImportError(f"{model_dir} is a transformers checkpoint ({config.get('model_type')!r}); tracing it "
                          "needs `pip install transformers`, or convert it with `mindvl convert --from-hf`") from None
    from mindvl.checkpoint.safetensors_io import TensorFolder

    TensorFolder(model_dir)  # safetensors only (one line naming pickled .bin files): nothing is unpickled
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto", use_safetensors=True)
    return model.to(device).eval()


def trace_folder(model_dir: str | os.PathLike, texts_or_jsonl, tokenizer_dir: str | os.PathLike | None,
                 out_path: str | os.PathLike, *, text_key: str = "text", add_special_tokens: bool = True,
                 max_sequences: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", max_tokens_per_forward: int = 8192) -> Path:
    """Trace a model folder over a corpus and save the trace (.npz, mindvl.moe_analysis.trace_io); returns the path.

    `texts_or_jsonl`: a list of texts (or token-id lists), or a .jsonl file of `{"text": ...}` / `{"input_ids":
    [...]}` records. Texts are tokenized with `tokenizer_dir`'s tokenizer.json (default: the model folder) using
    the `tokenizers` library; texts that give no tokens are skipped (counted in meta). The model folder is a mindvl
    folder or a transformers MoE causal LM (see `trace_corpus`).
    """
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    items = _read_corpus(texts_or_jsonl, text_key)[:max_sequences]
    tokenizer = None
    if any(isinstance(x, str) for x in items):
        from tokenizers import Tokenizer

        tok_path = Path(tokenizer_dir or model_dir)
        tok_file = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok_path}; pass tokenizer_dir or token ids")
        tokenizer = Tokenizer.from_file(str(tok_file))
    seqs = [tokenizer.encode(x, add_special_tokens=add_special_tokens).ids if isinstance(x, str) else list(x)
            for x in items]
    kept = [s for s in seqs if len(s) > 0]
    model = load_moe_model(model_dir, dtype=dtype, device=device)
    trace = trace_corpus(model, kept, max_tokens_per_forward=max_tokens_per_forward, meta={
        "model": str(model_dir), "corpus": str(texts_or_jsonl) if isinstance(texts_or_jsonl, (str, os.PathLike))
        else f"{len(items)} in-memory items", "skipped_empty": len(seqs) - len(kept)})
    return save_trace(trace, out_path)
