"""The static KV cache and the decode loop (mindvl.infer.generate, kv_cache.py, decode_graph.py).

For every family the cache supports (dense GQA, MoE/MLA latents, Qwen3-VL's interleaved M-RoPE + DeepStack,
Qwen3.5's hybrid conv/recurrent state): greedy tokens equal the pre-static loop's (`engine="eager"`: reads every
step, drops finished rows at once) with per-prompt budgets and stop tokens, so masking and compaction both happen;
seeded sampled tokens equal an independent reference (full forwards, no cache, the same noise); a decode step reads
nothing from the device and updates the cache in place (what CUDA-graph replay needs). The comparisons against
transformers' `generate` are in test_generation.py, test_mla_cache.py, test_qwen3_vl.py and test_qwen3_5.py.
"""

from __future__ import annotations

import pytest
import torch
from family_models import END, IMAGE, START, TEXT, VOCAB, build
from graph_replay import read_or_data_shaped
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mindvl.infer import Prompt, generate
from mindvl.infer.generate import filter_logits, pack_prompts
from mindvl.models import MindVL


@pytest.fixture(scope="module", params=list(TEXT))
def family(request):
    return request.param, build(request.param)


def prompts_for(model: MindVL, n: int = 5) -> list[Prompt]:
    """n prompts of different lengths, every other one with an image (grid [1, 4, 8]: 8 pads)."""
    patch = 16 if model.config.vision.family == "qwen3_vl" else 14
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(n):
        words = torch.randint(0, 190, (3 + 2 * i,), generator=gen)
        if i % 2:
            prompts.append(Prompt(words))
            continue
        pads = torch.tensor([START] + [IMAGE] * 8 + [END])
        pixels = torch.randn(32, 3 * 2 * patch * patch, generator=gen)
        prompts.append(Prompt(torch.cat([words[:2], pads, words[2:]]), pixels, torch.tensor([[1, 4, 8]])))
    return prompts


# ---------------------------------------------------------------------------------------------- greedy tokens


def budgets_and_stops(model: MindVL, prompts: list[Prompt] | None = None):
    """Five prompts (prompts_for's, unless given) with budgets of 2..14 and two stop tokens taken from the free run
    (so some rows stop early): (prompts, budgets, stops, the eager loop's tokens without stops, and with them)."""
    prompts = prompts or prompts_for(model)
    budgets = [14, 3, 9, 2, 12]
    free = generate(model, prompts, budgets, engine="eager")
    stops = sorted({free[0][6], free[2][4]})
    return prompts, budgets, stops, free, generate(model, prompts, budgets, stop_token_ids=stops, engine="eager")


@pytest.mark.parametrize("sync_every", [1, 3])
def test_greedy_tokens_equal_the_eager_loop_with_budgets_and_stops(family, sync_every):
    """Budgets of 2..14 and two stop tokens: rows finish at different steps, are masked, and (with more than half
    done at a sync point) compacted; every prompt's tokens equal the eager loop's."""
    _, model = family
    prompts, budgets, stops, free, want = budgets_and_stops(model)
    got = generate(model, prompts, budgets, stop_token_ids=stops, sync_every=sync_every)
    assert got == want
    assert [len(t) for t in want] != budgets  # the stops did cut some sequences short
    assert generate(model, prompts, budgets, sync_every=sync_every) == free


def test_static_loop_compacts_when_more_than_half_is_done(monkeypatch):
    """Compaction is a real code path: with budgets 1, 1, 1, 9 it runs once (3 of 4 rows done at the first sync
    point), and the surviving row's tokens are those of its generation alone."""
    from mindvl.models.kv_cache import KVCache

    model = build("dense")
    prompts = prompts_for(model, 4)
    calls = []
    keep = KVCache.keep
    monkeypatch.setattr(KVCache, "keep", lambda self, rows: (calls.append(list(rows)), keep(self, rows)))
    got = generate(model, prompts, [1, 1, 1, 9], sync_every=2)
    assert calls == [[3]]
    assert got[3] == generate(model, prompts[3:], 9, engine="eager")[0]


# -------------------------------------------------------------------------------------------- sampled tokens


def reference_sampling(model: MindVL, prompts: list[Prompt], n: int, seed: int, temperature: float, top_p: float,
                       top_k: int) -> list[list[int]]:
    """Sampling by full recomputation: at step s, each prompt's next-token logits from a forward over prompt +
    tokens so far (no cache), filtered, and the exponential race with step s's noise (one [B, V] draw per step)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        noise = torch.empty(len(prompts), VOCAB).exponential_(generator=gen).clamp_(min=torch.finfo().tiny)
        for b, p in enumerate(prompts):
            ids = torch.cat([p.input_ids, torch.tensor(out[b], dtype=torch.long)])
            with torch.no_grad():
                logits = model(input_ids=ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw).logits
            probs = filter_logits(logits[-1:], temperature, top_p, top_k).softmax(-1)[0]
            out[b].append(int((probs / noise[b]).argmax()))
    return out


@pytest.mark.parametrize("name", ["dense", "qwen3_5"])
def test_seeded_sampling_equals_recomputation_and_ignores_sync_and_compaction(name):
    model = build(name)
    prompts = prompts_for(model, 3)
    kw = dict(temperature=1.3, top_p=0.9, top_k=40, seed=11)
    want = reference_sampling(model, prompts, 8, **kw)
    assert generate(model, prompts, 8, **kw) == want
    assert generate(model, prompts, 8, sync_every=1, **kw) == want
    # A row that finishes early (budget 2) frees nothing from the others' noise: their tokens are unchanged.
    short = generate(model, prompts, [2, 8, 8], sync_every=1, **kw)
    assert short == [want[0][:2], want[1], want[2]]
    assert generate(model, prompts, 8, **{**kw, "seed": 12}) != want


# -------------------------------------------------------------------------------------- no reads inside a step


class DeviceReads(TorchDispatchMode):
    """Counts the ops that read device memory back to the host, or whose output shape depends on the data (a read on
    an accelerator; the rule is graph_replay's, which a capture enforces): item/int/bool, equal, allclose, nonzero,
    masked_select, unique, repeat_interleave by a tensor of counts without output_size, boolean-mask indexing.
    `Tensor.tolist` does not dispatch, so it is counted by wrapping it (`count_tolist`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = read_or_data_shaped(func, args, kwargs)
        if why is not None:
            self.reads.append(why)
        return func(*args, **kwargs)


@pytest.fixture
def count_tolist(monkeypatch):
    calls: list[str] = []
    original = torch.Tensor.tolist

    def tolist(self):
        calls.append("tolist")
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return calls


def prefilled(model: MindVL, prompts: list[Prompt], capacity: int = 40):
    packed = pack_prompts(prompts, torch.device("cpu"))
    cache = model.new_kv_cache(len(prompts), capacity)
    logits, positions = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache, packed["pixel_values"],
                                      packed["image_grid_thw"])
    return cache, logits, positions


@pytest.mark.parametrize("name", list(TEXT))
def test_a_decode_step_reads_nothing_and_updates_the_cache_in_place(name, count_tolist):
    """model.decode_step over the static cache (masked rows included): zero reads, and every tensor the step
    changes keeps its address (a replayed CUDA graph writes where it was captured)."""
    from mindvl.infer.decode_graph import DecodeStep

    model = build(name)
    with torch.inference_mode():
        cache, logits, positions = prefilled(model, prompts_for(model, 3))
        cache.advance = torch.tensor([1, 0, 1])  # row 1 finished: masked
        step = DecodeStep(model, cache, graphs=True)  # graphs: CUDA only, so eager here
        before = cache.lengths
        buffers = [t for t in cache.keys + cache.values + cache.step_state() if t is not None]
        addresses = [t.data_ptr() for t in buffers]
        tokens = logits.argmax(-1)
        count_tolist.clear()
        with DeviceReads() as reads:
            for _ in range(3):
                tokens = step(tokens, positions).argmax(-1)
                positions = positions + 1
        assert reads.reads == [] and count_tolist == []
        assert [t.data_ptr() for t in cache.keys + cache.values + cache.step_state() if t is not None] == addresses
        assert cache.lengths == [before[0] + 3, before[1], before[2] + 3]


def test_the_static_loop_reads_once_per_sync_interval_and_the_eager_loop_every_step(count_tolist, monkeypatch):
    """Reads in the decode phase of a 12-token generation (after the prefill): the static loop reads the finished
    flags once every sync_every = 4 steps (2 times) plus the outputs at the end (2); the eager loop reads every
    step's tokens (12): the count is > 0 on the old path, so the counter sees what it is meant to."""
    model = build("qwen3_vl")
    prompts = prompts_for(model, 3)
    reads = DeviceReads()
    prefill = MindVL.prefill

    def counted_prefill(*args, **kwargs):  # the count starts after the prefill
        out = prefill(*args, **kwargs)
        count_tolist.clear()
        reads.reads.clear()
        return out

    monkeypatch.setattr(MindVL, "prefill", counted_prefill)
    counts = {}
    for engine in ("static", "eager"):
        with reads:
            generate(model, prompts, 12, sync_every=4, engine=engine)
        counts[engine] = len(reads.reads) + len(count_tolist)
    assert counts == {"static": 2 + 2, "eager": 12}


class AttentionShapes(TorchFunctionMode):
    """The (query, key) shapes of every sdpa call made while `on`: on Hopper a bf16 call goes to cuDNN, which builds
    an execution plan per new shape, so the decode loop's shapes must repeat (kv_cache.WINDOW_STEP)."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.shapes = False, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.on and getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.shapes.add((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window_step", [1, 8, 128])
def test_decode_attention_shapes_repeat(family, window_step, monkeypatch):
    """12 greedy tokens for 5 prompts (no stops, so no compaction): the decode steps' attention spans the longest
    row rounded up to WINDOW_STEP slots, at most the capacity, so the distinct key widths are those of the hand
    computation: 11 with no rounding (step 1, the loop before), 2 with 8, 1 with the default 128."""
    from mindvl.models import kv_cache

    name, model = family
    monkeypatch.setattr(kv_cache, "WINDOW_STEP", window_step)
    prompts = prompts_for(model)
    longest = max(len(p.input_ids) for p in prompts)
    capacity = longest + 12 - 1
    want = {min(capacity, -(-n // window_step) * window_step) for n in range(longest + 1, longest + 12)}
    shapes = AttentionShapes()
    decode_step = type(model).decode_step

    def recorded(self, *args, **kwargs):
        shapes.on = True
        try:
            return decode_step(self, *args, **kwargs)
        finally:
            shapes.on = False

    monkeypatch.setattr(type(model), "decode_step", recorded)
    with shapes:
        generate(model, prompts, 12)
    widths = {k[-2] for _, k in shapes.shapes}
    assert widths == want
    assert len(want) == {1: 11, 8: 2, 128: 1}[window_step]
    assert len(shapes.shapes) == len(want)  # one (query, key) shape per width: every layer's call is alike


class AttentionMasks(TorchFunctionMode):
    """(query dtype, mask) of every sdpa call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.calls.append((args[0].dtype, kwargs.get("attn_mask")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_makes_its_attention_mask_once_in_the_querys_dtype(family, dtype):
    """Every full-attention layer of a decode step gets the same additive mask (0 where a row sees the slot, -inf
    elsewhere, exactly what sdpa would make of the boolean one), in the query's dtype: given a boolean mask, sdpa
    converts it in every call, a kernel per layer on a GPU."""
    name, model = family
    model = build(name).to(dtype) if dtype != torch.float32 else model
    with torch.inference_mode():
        cache, logits, positions = prefilled(model, prompts_for(model))
        with AttentionMasks() as rec:
            model.decode_step(logits.argmax(-1), positions, cache)
    full = sum(kind != "linear_attention" for kind in (model.config.text.layer_kind(i) for i in
                                                       range(model.config.text.num_hidden_layers)))
    assert len(rec.calls) == full >= 2
    masks = {id(mask) for _, mask in rec.calls}
    assert len(masks) == 1
    q_dtype, mask = rec.calls[0]
    assert mask.dtype == q_dtype == dtype
    lengths = torch.tensor(cache.lengths)  # after the step: each row's slots, the new token's included
    seen = torch.arange(mask.shape[-1])[None, :] < lengths[:, None]
    want = torch.where(seen, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    assert torch.equal(mask, want)


@pytest.mark.parametrize("inference", [False, True])
def test_the_read_counter_sees_reads_and_data_shaped_ops(inference):
    """The counter itself: each of these is one read (or a data-shaped op), and shape-static ops are none; under
    inference mode (generation's) too, where int/bool/item dispatch under other names."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    cases = [lambda: int(x[0]), lambda: float(x[1]), lambda: x[2].item(), lambda: bool(x.any()),
             lambda: torch.equal(x, x), lambda: x[mask], lambda: x.nonzero(),
             lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1, 1, 1])),
             lambda: x.clone().__setitem__(mask, 0)]
    for i, case in enumerate(cases):
        with torch.inference_mode(inference), DeviceReads() as reads:
            case()
        assert len(reads.reads) >= 1, i
    with DeviceReads() as reads:
        torch.where(mask, x, 0).argmax(-1)
        x.repeat_interleave(2)
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)
    assert reads.reads == []


# ------------------------------------------------------------------- the replayed step (graphs, emulated on CPU)


@pytest.mark.filterwarnings("error")  # a capture that failed would fall back to eager with a warning: a failure here
def test_the_replayed_step_gives_the_eager_loops_tokens(family, emulated):
    """Every family, greedy, per-prompt budgets and stop tokens: the step captured once and replayed (rows masked as
    they finish; compaction to fewer rows captures again at the new batch size) gives the eager loop's tokens."""
    _, model = family
    prompts, budgets, stops, _, want = budgets_and_stops(model)
    got = generate(model, prompts, budgets, stop_token_ids=stops, sync_every=3, graphs=True)
    assert got == want
    batches = [g.batch for g in emulated.graphs]
    assert batches[0] == 5 and batches[-1] < 5  # captured, and captured again after a compaction
    assert sum(g.replays for g in emulated.graphs) == decode_steps(budgets, want, 3)  # every decode step replayed


def decode_steps(budgets: list[int], answers: list[list[int]], sync_every: int) -> int:
    """Decode steps the static loop takes: it stops at the first sync point after the longest answer is done, or at
    the largest budget; the prefill made each answer's first token."""
    return min(max(budgets), -(-max(len(t) for t in answers) // sync_every) * sync_every) - 1


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", ["moe_mla", "qwen3_5"])
def test_seeded_sampling_is_the_same_replayed(name, emulated):
    """Sampling stays outside the graph: a seeded run's tokens with the step replayed equal the run without."""
    model = build(name)
    prompts = prompts_for(model, 3)
    kw = dict(temperature=1.3, top_p=0.9, top_k=40, seed=11)
    want = generate(model, prompts, [9, 4, 9], sync_every=2, graphs=False, **kw)
    assert generate(model, prompts, [9, 4, 9], sync_every=2, graphs=True, **kw) == want
    assert emulated.graphs and all(g.replays for g in emulated.graphs)


@pytest.mark.filterwarnings("error")
def test_a_kept_step_replays_for_the_next_call_without_capturing(family, emulated):
    """Three calls at the same batch and capacity bucket (other prompts, budgets, stops): each later one resets the
    kept cache in place and replays the first call's graph (one capture in all), and every call gives the eager
    loop's tokens; a call at another batch size drops the kept pair first, then captures its own."""
    from mindvl.infer import decode_graph

    _, model = family
    decode_graph.release(model)
    prompts, budgets, stops, _, _ = budgets_and_stops(model)
    assert generate(model, prompts, [14] * 5, sync_every=20, graphs=True) == generate(model, prompts, 14,
                                                                                        engine="eager")
    others = prompts_for(model, 7)[2:]  # five other prompts, longer
    for ps in (others, prompts):
        want = generate(model, ps, budgets, stop_token_ids=stops, engine="eager")
        assert generate(model, ps, budgets, stop_token_ids=stops, sync_every=20, graphs=True) == want
    assert len(emulated.graphs) == 1  # no compaction (sync_every > budgets): every call replayed the first graph
    want = generate(model, prompts[:2], 6, engine="eager")
    kept_at_allocation = []
    new_kv_cache = type(model).new_kv_cache

    def counted(self, *args):
        kept_at_allocation.append(len(decode_graph._POOLS[model].entries))
        return new_kv_cache(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model), "new_kv_cache", counted)
        assert generate(model, prompts[:2], 6, graphs=True) == want
    assert [g.batch for g in emulated.graphs] == [5, 2]
    # the batch-5 cache was dropped before the batch-2 one was allocated: one cache per model at any time
    assert kept_at_allocation == [0] and list(decode_graph._POOLS[model].entries) == [(2, 256, False)]


@pytest.mark.filterwarnings("error")
def test_a_kept_step_is_dropped_when_compacted_or_when_the_weights_move(emulated):
    """A compaction replaces the cache's buffers, so the next call captures afresh; new weight tensors (a reload, a
    `.to()`) drop the model's kept steps, which would otherwise replay the old weights' kernels."""
    from mindvl.infer import decode_graph

    model = build("dense")
    prompts = prompts_for(model, 4)
    budgets = [1, 1, 1, 9]  # 3 of 4 rows done at the first sync point: compacted
    want = generate(model, prompts, budgets, engine="eager")
    assert generate(model, prompts, budgets, sync_every=2, graphs=True) == want
    assert [g.batch for g in emulated.graphs] == [4, 1]
    assert generate(model, prompts, budgets, sync_every=2, graphs=True) == want
    assert [g.batch for g in emulated.graphs] == [4, 1, 4, 1]  # not replayed over the compacted buffers
    head = model.language_model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().flip(0))  # a new tensor, other values
    want = generate(model, prompts, 9, engine="eager")
    assert generate(model, prompts, 9, graphs=True) == want
    assert len(emulated.graphs) == 5
    decode_graph.release(model)
    assert decode_graph._POOLS.get(model) is None


def test_the_environment_turns_replay_on_for_callers_that_do_not_choose(emulated, monkeypatch):
    """MINDVL_DECODE_GRAPHS=on: `graphs=None` (every CLI path) replays; off or unset does not; a bad value is a
    one-line error naming the variable."""
    model = build("dense")
    prompts = prompts_for(model, 2)
    want = generate(model, prompts, 5, engine="eager")
    assert generate(model, prompts, 5) == want and emulated.graphs == []
    monkeypatch.setenv("MINDVL_DECODE_GRAPHS", "on")
    assert generate(model, prompts, 5) == want and len(emulated.graphs) == 1
    monkeypatch.setenv("MINDVL_DECODE_GRAPHS", "off")
    assert generate(model, prompts, 5) == want and len(emulated.graphs) == 1
    monkeypatch.setenv("MINDVL_DECODE_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="MINDVL_DECODE_GRAPHS='sometimes': set it to on or off"):
        generate(model, prompts, 5)


def test_the_emulation_freezes_host_values_as_a_graph_does(emulated, monkeypatch):
    """The emulated replay can fail: with the attention window sized on the host to exactly the longest row
    (`full_width` ignored, no rounding), the captured step keeps the width it had at capture, so later tokens never
    see the newest slots and differ from the eager loop's, as on a GPU."""
    from mindvl.infer import decode_graph
    from mindvl.models import kv_cache
    from mindvl.models.kv_cache import KVCache

    model = build("dense")
    prompts = prompts_for(model, 3)
    want = generate(model, prompts, 14, engine="eager")
    assert generate(model, prompts, 14, graphs=True) == want
    monkeypatch.setattr(kv_cache, "WINDOW_STEP", 1)
    monkeypatch.setattr(KVCache, "full_width", property(lambda self: False, lambda self, value: None), raising=False)
    decode_graph.release(model)  # capture again, under the patches
    assert generate(model, prompts, 14, graphs=True) != want


def test_a_step_that_reads_the_device_is_not_captured_and_runs_eagerly(emulated, monkeypatch):
    """A read inside the step fails the capture (as on a GPU); the step then runs eagerly with one warning and the
    tokens are still right."""
    model = build("dense")
    prompts = prompts_for(model, 3)
    want = generate(model, prompts, 6, engine="eager")
    step = MindVL.decode_step

    def reading_step(self, input_ids, positions, cache, **kw):
        int(input_ids[0])  # a device read
        return step(self, input_ids, positions, cache, **kw)

    monkeypatch.setattr(MindVL, "decode_step", reading_step)
    with pytest.warns(UserWarning, match="not captured in a graph.*aten.item"):
        assert generate(model, prompts, 6, graphs=True) == want
    assert emulated.graphs == []


# ------------------------------------------------------------------------------------------ sorted batching


def test_plan_batches_by_hand():
    from mindvl.infer.batching import plan_batches

    # most expensive first (ties in index order); a batch closes before 10 cost units or 3 prompts are exceeded;
    # 12 is over the budget and goes alone; 5 + 4 + 3 > 10; 3 + 2 + 1 then a fourth prompt
    assert plan_batches([3, 12, 5, 4, 1, 1, 1, 2], token_budget=10, max_batch=3) == [[1], [2, 3], [0, 7, 4], [5, 6]]
    assert plan_batches([], 10, 3) == []
    with pytest.raises(ValueError, match="token_budget"):
        plan_batches([1], 0, 3)


def test_sorted_generation_returns_each_prompts_own_answer_in_order(monkeypatch):
    """Seven prompts in length-sorted batches under a budget: the batches hold prompts of falling cost, and the
    answers (greedy, per-prompt budgets) equal one generate call over all prompts in their own order."""
    import importlib

    from mindvl.infer.batching import generate_sorted, prompt_cost

    module = importlib.import_module("mindvl.infer.generate")
    model = build("dense")
    prompts = prompts_for(model, 7)
    budgets = [5, 3, 7, 2, 6, 4, 5]
    want = generate(model, prompts, budgets)
    calls = []
    real = module.generate

    def spy(model, batch, max_new_tokens, **kw):
        calls.append([prompt_cost(p, b) for p, b in zip(batch, max_new_tokens, strict=True)])
        return real(model, batch, max_new_tokens, **kw)

    monkeypatch.setattr(module, "generate", spy)
    got = generate_sorted(model, prompts, budgets, token_budget=60, max_batch=3)
    assert got == want
    flat = [c for batch in calls for c in batch]
    assert flat == sorted(flat, reverse=True) and len(calls) > 2
    assert all(len(b) <= 3 and (sum(b) <= 60 or len(b) == 1) for b in calls)


def test_cache_capacity_is_checked_on_the_host_and_masked_rows_stay_in_bounds():
    """A prompt longer than the capacity, or a plain decode step past it, is refused (host bound, no read); a masked
    row at capacity rewrites its last slot instead of writing out of bounds, and compaction re-reads the bound."""
    model = build("dense")
    prompts = [Prompt(torch.arange(5)), Prompt(torch.arange(3))]
    with torch.inference_mode():
        with pytest.raises(ValueError, match="holds 4 tokens.*needs 5"):
            prefilled(model, prompts, capacity=4)
        cache, logits, positions = prefilled(model, prompts, capacity=6)
        model.decode_step(logits.argmax(-1), positions, cache)  # lengths 6, 4
        with pytest.raises(ValueError, match="holds 6 tokens.*needs 7"):
            model.decode_step(logits.argmax(-1), positions + 1, cache)
        cache.advance = torch.tensor([0, 1])  # row 0 (full) masked: its write lands on slot 5, row 1 advances
        model.decode_step(logits.argmax(-1), positions + 1, cache)
        assert cache.lengths == [6, 5] and cache.bound == 6
        cache.keep([1])
        assert cache.lengths == [5] and cache.bound == 5 and cache.batch == 1
