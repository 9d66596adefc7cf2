"""The text-ability probe of claim 4: held-out items of the synthetic text task, greedy answers, exact match.

Items come from their own random stream (`mindvl-bench:sort:SEED:i`), independent of the training set's
(`mindvl-synth:SEED:i`), like the synthetic benchmarks of `mindvl.eval.synth_bench`. Predictions go to one JSON line
per item, so a rerun reuses a finished file instead of generating again.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from mindvl.data.synth import TEXT_GENERATORS

TEXT_TASK = "sort"  # learnt by the base LLM only: the VL phases' text data is `reverse`
TEXT_BENCH_SEED = 1000


def text_items(n: int, seed: int = TEXT_BENCH_SEED, task: str = TEXT_TASK) -> list[tuple[str, str]]:
    """n held-out (question, answer) pairs of a text-only synth task."""
    return [TEXT_GENERATORS[task](random.Random(f"mindvl-bench:{task}:{seed}:{i}")) for i in range(n)]


def evaluate_text(model_dir: str | os.PathLike, out: str | os.PathLike, n: int, batch_size: int = 32,
                  max_new_tokens: int = 16) -> list[float]:
    """Per-item exact match (1.0 / 0.0) of the model at `model_dir` on n text items; rows written to OUT (JSONL)."""
    out = Path(out)
    if out.is_file():
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        if len(rows) == n:
            return [r["exact_match"] for r in rows]
    from mindvl.infer.chat import conversation_prompt, load_for_chat, stop_ids, user_message
    from mindvl.infer.generate import generate

    model, tok = load_for_chat(model_dir, None, "cpu")
    stops = stop_ids(tok)
    items = text_items(n)
    rows = []
    for start in range(0, n, batch_size):
        batch = items[start:start + batch_size]
        # No system turn: the tiny recipes train without one (data.default_system: null).
        prompts = [conversation_prompt(tok, [user_message(q, 0)], None, [], None) for q, _ in batch]
        outputs = generate(model, prompts, max_new_tokens, stop_token_ids=stops)
        for (question, answer), ids in zip(batch, outputs, strict=True):
            text = tok.decode([i for i in ids if i not in stops], skip_special_tokens=True).strip()
            rows.append({"id": len(rows), "question": question, "answer": answer, "prediction": text,
                         "exact_match": float(text == answer)})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, out)  # whole file or nothing: a partial file never passes for a finished one
    return [r["exact_match"] for r in rows]
