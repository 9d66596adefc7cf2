"""Many prompts through `generate` in length-sorted batches, answers back in the prompts' order.

    plan = plan_batches([prompt_cost(p) for p in prompts], token_budget=16384, max_batch=64)
    outputs = generate_sorted(model, prompts, max_new_tokens, token_budget=16384, max_batch=64, **generate_kw)

Evaluation sets mix prompts of very different sizes (a question about a 4K document against a one-line caption
request). Batching them in file order makes every batch as long as its longest prompt: the cache is sized for it
and the short rows are masked while it finishes. Sorted by cost, neighbours are alike, so a batch's prefill (one
packed row, no padding) stays within a token budget and its decode runs as many rows as the budget allows. The cost
of a prompt is its tokens plus its vision patch rows (the tower's work), plus the tokens it may generate (its cache).

Greedy answers do not depend on which prompts share a batch (rows never see each other; see kv_cache.py), so
`generate_sorted` returns what one `generate` call per original batch would, in the original order. Seeded
sampling draws its noise per batch, so sampled answers depend on the batching (as they always have).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from .generate import Prompt

DEFAULT_TOKEN_BUDGET = 16384
DEFAULT_MAX_BATCH = 64


def prompt_cost(prompt: Prompt, max_new_tokens: int = 0) -> int:
    """Tokens the prefill processes (text + vision patch rows) plus the cache slots generation may fill."""
    patches = 0 if prompt.pixel_values is None else int(prompt.pixel_values.shape[0])
    return int(prompt.input_ids.numel()) + patches + max_new_tokens


def plan_batches(costs: Sequence[int], token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_batch: int = DEFAULT_MAX_BATCH) -> list[list[int]]:
    """Indices into `costs`, most expensive first, cut into batches of at most `max_batch` whose costs sum to at
    most `token_budget` (a prompt over the budget goes alone)."""
    if token_budget < 1 or max_batch < 1:
        raise ValueError(f"token_budget and max_batch must be >= 1, got {token_budget} and {max_batch}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))  # stable: equal costs keep their order
    batches: list[list[int]] = []
    total = 0
    for i in order:
        if batches and len(batches[-1]) < max_batch and total + costs[i] <= token_budget:
            batches[-1].append(i)
            total += costs[i]
        else:
            batches.append([i])
            total = costs[i]
    return batches


def generate_sorted(model, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int],
                    token_budget: int = DEFAULT_TOKEN_BUDGET, max_batch: int = DEFAULT_MAX_BATCH,
                    on_batch=None, seed: int | None = None, **generate_kw) -> list[list[int]]:
    """`generate` over length-sorted batches (module docstring); outputs in the order of `prompts`.
    `on_batch(indices, outputs)` is called after each batch (e.g. to write its answers at once). With `seed`, batch
    k samples with seed + k (distinct noise per batch, reproducible)."""
    generate_module = importlib.import_module(__package__ + ".generate")  # per call: tests may wrap `generate`

    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError("max_new_tokens must be given once or once per prompt")
    costs = [prompt_cost(p, b) for p, b in zip(prompts, budgets, strict=True)]
    outputs: list[list[int] | None] = [None] * len(prompts)
    for k, batch in enumerate(plan_batches(costs, token_budget, max_batch)):
        if seed is not None:
            generate_kw["seed"] = seed + k
        got = generate_module.generate(model, [prompts[i] for i in batch], [budgets[i] for i in batch],
                                       **generate_kw)
        for i, ids in zip(batch, got, strict=True):
            outputs[i] = ids
        if on_batch is not None:
            on_batch(batch, got)
    return outputs  # type: ignore[return-value]
