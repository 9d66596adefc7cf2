"""Batched autoregressive generation with a static KV cache.

    generate(model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop_token_ids=(),
             sync_every=8, graphs=None, compile=None) -> one list of generated ids per prompt

All prompts are prefilled together as one packed row (varlen attention, no padding: each prompt's numerics are
those of its own full forward), then every decode step feeds one token per cache row. A sequence stops at its first
stop token (kept in its output, as transformers does) or after its max_new_tokens.

The decode loop reads nothing from the device inside a step: the tokens go into a device buffer, each row's
finished flag and output length are updated on the device, and a finished row is masked (it keeps computing, its
cache length stops advancing, its tokens are not kept) rather than copied out. The host reads the finished flags
once every `sync_every` steps (to stop, and to compact the cache when more than half of the rows are done), and the
outputs once at the end. With `graphs` on a CUDA device the step (the model's decode_step) is captured once per
batch size and replayed, and the cache and captured step are kept for the next call at the same batch size and
capacity bucket (decode_graph.lease); None means GRAPHS_BY_DEFAULT, or MINDVL_DECODE_GRAPHS=on|off. With `compile`
the step's decoder layers run compiled (decode_compile.py: fewer, fused kernels per step; with graphs or without),
and q/k/v and gate/up run as one matmul each (fused_projections.py; MINDVL_DECODE_FUSE=off keeps them apart), and
a greedy step's tokens are picked and recorded by one compiled function (greedy_tokens: 3 kernels, not 19);
None means decode_compile.COMPILE_BY_DEFAULT, or MINDVL_DECODE_COMPILE=on|off.

`temperature == 0` is greedy (argmax). Otherwise tokens are sampled after temperature, top-k and top-p filtering
(in that order, like transformers' logits warpers) by the exponential race: token = argmax(p / E) with E ~ Exp(1)
drawn for every (prompt, vocabulary entry) from a generator seeded by `seed`, which picks token i with probability
p_i. The noise of step s is drawn for all prompts whether or not they are still running, so a seeded run's tokens do
not depend on `sync_every`, compaction or graph replay.

`engine="eager"` keeps the loop this module had before the static cache (read every step's tokens, drop finished
rows from the cache at once, torch.multinomial): the benchmark's baseline and the tests' second opinion.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mindvl.models import MindVL

from . import decode_compile, decode_graph, fused_projections

# What `graphs=None` means: replay the decode step from a CUDA graph on CUDA devices. Off until a GPU run of the
# proof's generate section (benchmarks/proof_generate.py) and `pytest -m accelerator` confirm tokens and speed;
# `MINDVL_DECODE_GRAPHS=on` turns it on for every caller that does not choose (mindvl eval, chat, the resolution
# search, the lmms-eval adapter, evaluation during training). A step that cannot be captured runs eagerly, warned.
GRAPHS_BY_DEFAULT = False
GRAPHS_ENV = "MINDVL_DECODE_GRAPHS"


def _switch(env: str, default: bool, what: str) -> bool:
    """An on/off environment switch: its value when set, else `default`."""
    value = os.environ.get(env, "").strip().lower()
    if not value:
        return default
    if value not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{env}={value!r}: set it to on or off ({what}), or unset it for the default "
                         f"({'on' if default else 'off'})")
    return value in ("on", "1", "true")


def default_graphs() -> bool:
    """`graphs=None`: MINDVL_DECODE_GRAPHS (on/off) when set, else GRAPHS_BY_DEFAULT."""
    return _switch(GRAPHS_ENV, GRAPHS_BY_DEFAULT, "replay the decode step from a CUDA graph")


def default_compile() -> bool:
    """`compile=None`: MINDVL_DECODE_COMPILE (on/off) when set, else decode_compile.COMPILE_BY_DEFAULT."""
    return _switch(decode_compile.COMPILE_ENV, decode_compile.COMPILE_BY_DEFAULT,
                   "run the decode step's layers compiled")


@dataclass
class Prompt:
    """One prompt: input_ids [L] (image/video pads already expanded) and its vision items' pixel rows [P, 1176] +
    grids [N, 3] (images and videos in order of appearance, one stream); second_per_grid_ts [n_videos] float32."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None


def pack_prompts(prompts: Sequence[Prompt], device: torch.device) -> dict[str, torch.Tensor | None]:
    """Concatenate prompts into one packed row: input_ids [T], cu_seqlens [B+1] int32, pixel rows and grids."""
    ids = [torch.as_tensor(p.input_ids, dtype=torch.long).reshape(-1) for p in prompts]
    lengths = torch.tensor([len(x) for x in ids])
    cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    with_images = [p for p in prompts if p.pixel_values is not None and p.pixel_values.numel()]
    for p in with_images:
        if p.image_grid_thw is None:
            raise ValueError("a prompt has pixel_values but no image_grid_thw")
    pixels = torch.cat([p.pixel_values for p in with_images]).to(device) if with_images else None
    grids = torch.cat([torch.as_tensor(p.image_grid_thw).reshape(-1, 3) for p in with_images]) if with_images else None
    seconds = [torch.as_tensor(p.second_per_grid_ts, dtype=torch.float32).reshape(-1) for p in with_images
               if p.second_per_grid_ts is not None]
    return {"input_ids": torch.cat(ids).to(device), "cu_seqlens": cu.to(device), "pixel_values": pixels,
            "image_grid_thw": grids.to(device) if grids is not None else None,
            "second_per_grid_ts": torch.cat(seconds) if seconds else None}


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """logits [B, V] -> float32 scores / temperature with tokens outside the top-k and the top-p nucleus at -inf."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax when temperature == 0, else a sample from the filtered scores."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_p, top_k).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


@torch.inference_mode()
def generate(
    model: MindVL,
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    sync_every: int = 8,
    graphs: bool | None = None,
    engine: str = "static",
    compile: bool | None = None,
) -> list[list[int]]:
    """Generate up to max_new_tokens (one int, or one per prompt) for each prompt; see the module docstring."""
    if not prompts:
        return []
    check_sampling(temperature, top_p, top_k)
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    if engine not in ("static", "eager"):
        raise ValueError(f"engine must be 'static' or 'eager', got {engine!r}")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or min(budgets) < 1:
        raise ValueError("max_new_tokens must be >= 1, given once or once per prompt")
    device = model.language_model.embed_tokens.weight.device
    packed = pack_prompts(prompts, device)
    lengths = [int(torch.as_tensor(p.input_ids).numel()) for p in prompts]
    # The last generated token is never fed back, so a sequence needs prompt + budget - 1 slots.
    needed = max(n + b - 1 for n, b in zip(lengths, budgets, strict=True))
    graphs = engine == "static" and (default_graphs() if graphs is None else graphs)
    compiled = engine == "static" and (default_compile() if compile is None else compile)
    # Compiled steps also run q/k/v and gate/up as one matmul each (fused_projections; MINDVL_DECODE_FUSE=off
    # keeps them apart). Before the lease: the first fusion moves the parameters, and a kept step reads them.
    fuse = compiled and _switch(fused_projections.FUSE_ENV, True, "fuse a compiled decode step's projections")
    with fused_projections.fused_projections(model) if fuse else contextlib.nullcontext():
        if graphs and decode_graph.BACKEND.usable(device):  # a cache and captured step kept across calls
            cache, step = decode_graph.lease(model, len(prompts), needed, compiled)
        else:  # a compiled step's graphs see the cache's shape: bucketed, calls of nearby lengths share them
            cache = model.new_kv_cache(len(prompts), decode_graph.bucket(needed) if compiled else needed)
            step = decode_graph.DecodeStep(model, cache, graphs=False, compiled=compiled)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=device)
            if seed is None:
                generator.seed()  # non-deterministic, without touching torch's global RNG
            else:
                generator.manual_seed(seed)
        logits, positions = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache, packed["pixel_values"],
                                          packed["image_grid_thw"], packed["second_per_grid_ts"])
        sampling = (temperature, top_p, top_k, generator)
        if engine == "eager":
            return _eager_loop(model, cache, logits, positions, budgets, set(stop_token_ids), sampling)
        return _static_loop(step, logits, positions, budgets, stop_token_ids, sampling, sync_every)


def race_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, noise: torch.Tensor
                ) -> torch.Tensor:
    """logits [B, V], noise [B, V] ~ Exp(1) -> token ids [B] distributed as the filtered softmax (argmax p / E)."""
    probs = filter_logits(logits, temperature, top_p, top_k).softmax(-1)
    return (probs / noise).argmax(-1)


def _static_loop(step, logits: torch.Tensor, positions: torch.Tensor, budgets: list[int],
                 stop_token_ids: Sequence[int], sampling: tuple, sync_every: int) -> list[list[int]]:
    """The decode loop over a static cache (module docstring): device-side bookkeeping, one read per `sync_every`
    steps. Buffers are indexed by prompt; `rows` [B] maps each cache row to its prompt (compaction reorders).
    `step`: the decode_graph.DecodeStep over the prefilled cache."""
    cache = step.cache
    temperature, top_p, top_k, generator = sampling
    device, n, width = logits.device, len(budgets), max(budgets)
    out = torch.zeros(n, width, dtype=torch.long, device=device)  # generated ids; a prompt keeps its first `made`
    made = torch.zeros(n, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    budget = torch.tensor(budgets, device=device)
    stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)
    if cache.advance is None or cache.advance.shape != (n,):
        cache.advance = torch.ones(n, dtype=torch.long, device=device)
    else:  # a kept cache: in place, where its captured step reads it
        cache.advance.fill_(1)
    counter = torch.zeros((), dtype=torch.long, device=device)  # the step index on the device (greedy_tokens)
    for s in range(width):
        books = (out, made, done, budget, stops, rows, cache.advance)
        if temperature == 0:
            tokens = _greedy_step(step, logits, books, counter)
        else:
            noise = torch.empty(n, logits.shape[-1], device=device).exponential_(generator=generator)
            tokens = race_tokens(logits, temperature, top_p, top_k, noise[rows].clamp_(min=torch.finfo().tiny))
            record_tokens(tokens, *books, s)
        if s + 1 == width:
            break
        if (s + 1) % sync_every == 0:
            flags = done[rows].tolist()  # the loop's one device read every sync_every steps
            if all(flags):
                break
            keep = [r for r, f in enumerate(flags) if not f]
            if 2 * len(keep) < len(flags):  # more than half done: compaction pays for itself
                index = torch.tensor(keep, device=device)
                cache.keep(keep)
                tokens, positions, rows = tokens[index], positions[index], rows[index]
        logits = step(tokens, positions)
        positions = positions + 1
    return [ids[:k] for ids, k in zip(out.tolist(), made.tolist(), strict=True)]


def record_tokens(tokens: torch.Tensor, out: torch.Tensor, made: torch.Tensor, done: torch.Tensor,
                  budget: torch.Tensor, stops: torch.Tensor, rows: torch.Tensor, advance: torch.Tensor,
                  s: int | torch.Tensor) -> None:
    """Step s's tokens [B] (cache row order) into the per-prompt buffers, in place: out [N, width] (a finished
    prompt's extra tokens land past its `made`), made [N], done [N] (a stop token or the budget reached), and the
    cache's `advance` [B] (1 for a row still running; in place: a captured step reads it at a fixed address). `s`:
    an int, or a 0-d device tensor."""
    running = ~done[rows]
    # A 0-d tensor index would be read as an int by compiled code (a data-dependent guard): index with [B] instead.
    out[rows, s.expand_as(rows) if isinstance(s, torch.Tensor) else s] = tokens
    made.index_add_(0, rows, running.long())
    finished = torch.isin(tokens, stops) | (budget[rows] <= s + 1)
    done[rows] = ~running | finished
    advance.copy_((running & ~finished).long())


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor, made: torch.Tensor, done: torch.Tensor,
                  budget: torch.Tensor, stops: torch.Tensor, rows: torch.Tensor, advance: torch.Tensor,
                  counter: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the greedy tokens [B], recorded (record_tokens) as step `counter` (a 0-d device tensor,
    advanced in place: compiled code would otherwise be specialised to each step's int, one graph per step)."""
    tokens = logits.argmax(-1)
    record_tokens(tokens, out, made, done, budget, stops, rows, advance, counter)
    counter.add_(1)
    return tokens


def _greedy_step(step, logits: torch.Tensor, books: tuple, counter: torch.Tensor) -> torch.Tensor:
    """greedy_tokens, compiled whole when the decode step's layers are (3 kernels per step in place of 19); a
    compilation that fails raises before running anything (dynamo's errors), so it runs eagerly instead. An error
    while the compiled code runs may have updated some of the buffers, so it is raised as it is."""
    compiled = decode_compile.whole(greedy_tokens) if step.layer_call is not None else None
    if compiled is not None:
        from torch._dynamo.exc import TorchDynamoException  # loaded by torch.compile already

        try:
            return compiled(logits, *books, counter)
        except TorchDynamoException as error:  # tracing or the backend failed: nothing ran
            decode_compile.whole_failed(greedy_tokens, error)
    return greedy_tokens(logits, *books, counter)


def _eager_loop(model: MindVL, cache, logits: torch.Tensor, positions: torch.Tensor, budgets: list[int],
                stops: set[int], sampling: tuple) -> list[list[int]]:
    """The loop before the static cache: each step's tokens are read back, finished rows leave the cache at once."""
    temperature, top_p, top_k, generator = sampling
    device = logits.device
    outputs: list[list[int]] = [[] for _ in budgets]
    active = list(range(len(budgets)))  # prompt index of each cache row
    while True:
        tokens = next_tokens(logits, temperature, top_p, top_k, generator)
        keep = []
        for row, token in enumerate(tokens.tolist()):
            out = outputs[active[row]]
            out.append(token)
            if token not in stops and len(out) < budgets[active[row]]:
                keep.append(row)
        if not keep:
            return outputs
        if len(keep) < len(active):
            cache.keep(keep)
            index = torch.tensor(keep, device=device)
            tokens, positions = tokens[index], positions[index]
            active = [active[r] for r in keep]
        logits = model.decode_step(tokens, positions, cache)
        positions = positions + 1
