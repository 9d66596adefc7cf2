"""The decode step with its decoder layers compiled (mindvl.infer.decode_compile), for every family.

On the CPU the layers compile with a backend that traces them and runs the traced aten ops (aot_eager, wrapped to
count graphs and their runs), so the tokens must equal the eager loop's exactly; what is tested is the compiled
path's mechanics: the cache as a compile boundary (nothing recompiles per layer or per step: the graph count does
not grow with the layer count), a second batch size after a compaction, compiled steps kept with a captured graph
(decode_graph.lease), and a failed compilation falling back to eager with the cache's state undone.
Inductor's own kernels (fused, fewer per step) are counted by benchmarks/decode_kernels.py and timed on a device by
the accelerator proof's generate section.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from family_models import TEXT, build
from test_static_decode import budgets_and_stops, decode_steps, prompts_for

from mindvl.infer import Prompt, decode_compile, decode_graph, generate
from mindvl.infer.fused_projections import fused_projections


class CountingBackend:
    """aot_eager (the layers' own aten ops, traced), counting the graphs dynamo hands it and their runs (`runs`: the
    layers' graphs; `token_runs`: the graph that picks greedy tokens, generate.greedy_tokens, the only one with an
    argmax), and keeping the names of the functions each graph calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.runs = 0
        self.token_runs = 0
        self.calls: list[set[str]] = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        calls = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                 if n.op in ("call_function", "call_method")}
        self.calls.append(calls)
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        picks = "argmax" in calls

        def run(*args):
            if picks:
                self.token_runs += 1
            else:
                self.runs += 1
            return compiled(*args)

        return run


@pytest.fixture
def counting(use_backend):
    """decode_compile's backend replaced by a fresh CountingBackend."""
    backend = CountingBackend()
    use_backend(backend)
    return backend


def warns_once_then_compiles_no_more(model, prompts, n: int, match: str) -> None:
    """The first compiled call warns (match) and still gives the eager loop's tokens; the second gives them without a
    warning (the failed compilation is not tried again)."""
    want = generate(model, prompts, n, engine="eager")
    with pytest.warns(UserWarning, match=match):
        assert generate(model, prompts, n, compile=True) == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate(model, prompts, n, compile=True) == want


@pytest.mark.filterwarnings("error")  # a failed compilation would fall back to eager with a warning
@pytest.mark.parametrize("name", list(TEXT))
def test_compiled_layers_give_the_eager_loops_tokens(name, counting):
    """Greedy, per-prompt budgets and stop tokens, a compaction to fewer rows (a second batch size: a recompilation
    with a dynamic batch): the compiled layers give the eager loop's tokens, and every layer of every decode step
    ran compiled code: per step at least 4 graphs per layer (dynamo splits a layer at the attention and at its
    submodules' frames; dense: exactly 4) and the rotary tables' and the final norm's, so a layer that fell back to
    eager would be missed. Each batch size's first step is a trial (undone); a second call skips them."""
    model = build(name)
    prompts, budgets, stops, _, want = budgets_and_stops(model)
    got = generate(model, prompts, budgets, stop_token_ids=stops, sync_every=3, compile=True)
    assert got == want
    steps = decode_steps(budgets, want, 3)
    first = counting.runs
    trials = len(decode_compile._TRIALS[model])  # one per batch size: 5 rows, then the compacted sizes
    assert trials >= 2
    assert first >= (steps + trials) * (4 * model.config.text.num_hidden_layers + 2)
    # The tokens of every step were picked by compiled code (the loop picks once more than it steps: the last).
    assert counting.token_runs == steps + 1
    # A second call runs no trial (the model passed them at these sizes): the same graphs per step, no extra steps.
    assert generate(model, prompts, budgets, stop_token_ids=stops, sync_every=3, compile=True) == want
    assert (counting.runs - first) * (steps + trials) == first * steps
    assert counting.token_runs == 2 * (steps + 1)


@pytest.mark.filterwarnings("error")
def test_compiled_layers_inside_a_kept_captured_step(counting, emulated):
    """graphs and compile together: the tokens are the eager loop's; the trial and the capture's warm-up ran the
    compiled layers; the next call at the same batch and capacity replays the kept step (no new capture), and a call
    without compile there takes a step of its own (`compiled` is part of the kept pair's key).

    What the emulated replay runs is the eager layers' ops: its recording is a dispatch mode, under which dynamo
    does not run compiled code. Compiled kernels in a real CUDA graph are checked on a GPU
    (test_accelerator_device.test_compiled_decode_layers_replay_and_keep_the_tokens)."""
    model = build("dense")
    decode_graph.release(model)
    prompts = prompts_for(model, 4)
    want = generate(model, prompts, 9, engine="eager")
    assert generate(model, prompts, 9, sync_every=16, graphs=True, compile=True) == want
    assert counting.runs >= 2 * (4 * model.config.text.num_hidden_layers + 2)  # the trial and the warm-up
    assert len(emulated.graphs) == 1
    assert generate(model, prompts, 9, sync_every=16, graphs=True, compile=True) == want
    assert len(emulated.graphs) == 1 and emulated.graphs[0].replays == 2 * 8
    assert generate(model, prompts, 9, sync_every=16, graphs=True) == want
    assert len(emulated.graphs) == 2
    (key, _), = decode_graph._POOLS[model].entries.items()
    assert key[-1] is False  # the uncompiled pair replaced the compiled one (one pair kept)
    decode_graph.release(model)


@pytest.mark.parametrize("name", ["dense", "qwen3_5"])
def test_the_compiled_graphs_do_not_grow_with_the_layers_or_the_steps(name, counting):
    """The cache is a compile boundary, so a layer's index never reaches a graph: the model with twice the layers
    compiles exactly as many graphs, and a second call (other prompts, as long) compiles none."""
    def graphs_for(layers: int) -> int:
        torch._dynamo.reset()
        counting.graphs = 0
        text = dict(TEXT[name], num_hidden_layers=layers)
        if "layer_types" in text:
            text["layer_types"] = TEXT[name]["layer_types"] * (layers // len(TEXT[name]["layer_types"]))
        model = build(name, text=text)
        prompts = prompts_for(model, 3)
        assert generate(model, prompts, 6, compile=True) == generate(model, prompts, 6, engine="eager")
        compiled = counting.graphs
        generate(model, prompts_for(model, 4)[1:], 6, compile=True)
        assert counting.graphs == compiled, "a second call recompiled"
        return compiled

    base = TEXT[name]["num_hidden_layers"]
    first = graphs_for(base)
    assert first >= 2  # at least one layer's graphs before and after the attention
    assert graphs_for(2 * base) == first


def test_models_decoded_one_after_another_keep_every_layer_compiled(counting):
    """Dynamo keeps at most `recompile_limit` graphs per function and then runs it eagerly, with a log line only.
    The layers' own methods (DecoderLayer.decode_forward, each attention's forward: split at the cache's calls,
    they are frames of their own) are shared by every model, so a process that decodes one model after another
    needs many: after the four families in fp32, a fifth model ran 8 of its 72 graph calls compiled under dynamo's
    default limit of 8 (RESULTS.md, session 18; 25 s, so not repeated here). Here the limit starts at 2, which one
    model fills: compiling raises it (mindvl.compile_limit), and a second model's compiled generation then runs
    exactly as many compiled graphs as in a fresh process, with the eager loop's tokens. (Left at 2, it ran 8 of
    40.)"""
    from torch._dynamo import config

    def graph_runs(model) -> int:
        before = counting.runs
        prompts = prompts_for(model, 2)
        assert generate(model, prompts, 4, compile=True) == generate(model, prompts, 4, engine="eager")
        return counting.runs - before

    fresh = graph_runs(build("dense").to(torch.bfloat16))
    torch._dynamo.reset()
    with config.patch(recompile_limit=2):  # torch's own patch: pytest's monkeypatch would delete the key on undo
        graph_runs(build("dense"))
        assert graph_runs(build("dense").to(torch.bfloat16)) == fresh


@pytest.mark.filterwarnings("error")
def test_calls_of_other_lengths_compile_nothing_new(counting):
    """The compiled graphs see the cache's buffers (the K/V writes are traced), so a compiled generation's cache is
    bucketed (decode_graph.bucket): prompts of other lengths in the same bucket reuse every graph. (Sized to each
    call's need, the second call recompiles.)"""
    model = build("dense")

    def prompts(length: int) -> list[Prompt]:
        return [Prompt(torch.arange(3, 3 + length)), Prompt(torch.arange(40, 40 + length - 2))]

    for length in (5, 9, 14):
        want = generate(model, prompts(length), 6, engine="eager")
        assert generate(model, prompts(length), 6, compile=True) == want
        if length == 5:
            compiled = counting.graphs
    assert counting.graphs == compiled


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", ["dense", "qwen3_vl", "qwen3_5"])
def test_a_decode_steps_cache_writes_are_traced_with_its_projections_and_rotation(name, counting):
    """A decode step's K/V writes (kv_cache.store) are in the graph that projects and rotates q/k/v, one matmul
    for the three (fused_projections), so the compiled code writes the cache in the rotation's kernel rather than
    in two of its own at the compile boundary: benchmarks/decode_kernels.py counts the kernels (a layer 9). Not
    in any other graph; and the tokens are the eager loop's."""
    model = build(name)
    prompts = prompts_for(model, 3)
    assert generate(model, prompts, 6, compile=True) == generate(model, prompts, 6, engine="eager")
    writing = [calls for calls in counting.calls if "setitem" in calls and "argmax" not in calls]  # not the tokens
    assert writing, "no compiled graph writes the cache"
    for calls in writing:
        assert {"linear", "split", "cat", "neg"} <= calls, calls  # the fused projection, the rotation


def test_a_failed_compilation_runs_the_layers_eagerly_with_the_cache_as_it_was(use_backend):
    """A backend that fails on the first graph after one that updates a state in place: one warning, and the tokens
    are the eager loop's. The trial step's first linear-attention layer ran compiled and updated Qwen3.5's conv state
    before the failure; undone, or every later token would differ. The next call does not try again."""
    updated = []

    def failing(gm, example_inputs):
        if updated:
            raise RuntimeError("no compiler here")
        updated.extend(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    use_backend(failing)
    model = build("qwen3_5")
    warns_once_then_compiles_no_more(model, prompts_for(model, 3), 8, "decode step not compiled.*no compiler here")
    assert updated  # the failure came after an in-place update


def test_greedy_tokens_that_fail_to_compile_are_picked_eagerly(use_backend):
    """A backend that refuses the graph picking the tokens (generate.greedy_tokens, compiled whole): one warning
    naming it and the backend's error, the eager loop's tokens, the layers still compiled; the next call does not
    try again (no warning)."""
    layers = []

    def backend(gm, example_inputs):
        if any(n.target == "argmax" for n in gm.graph.nodes):  # a method call: its name
            raise RuntimeError("no argmax here")
        layers.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    use_backend(backend)
    model = build("dense")
    warns_once_then_compiles_no_more(model, prompts_for(model, 3), 7, r"^greedy_tokens not compiled \(RuntimeError: "
                                     r"no argmax here\); running it eagerly from now on$")
    assert layers and decode_compile.passed_trial(model, 3)


def test_a_recompilation_that_fails_at_a_new_batch_size_runs_eagerly(use_backend):
    """The trial passes at 3 rows; a later call at 2 rows needs a recompilation (a dynamic batch), which this
    backend refuses: a warning, that call runs eagerly with the eager loop's tokens (Qwen3.5's states undone), and
    the first size still runs compiled."""
    refuse = []

    def backend(gm, example_inputs):
        if refuse:
            raise RuntimeError("no dynamic shapes here")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    use_backend(backend)
    model = build("qwen3_5")
    prompts = prompts_for(model, 3)
    assert generate(model, prompts, 6, compile=True) == generate(model, prompts, 6, engine="eager")
    refuse.append(True)
    with pytest.warns(UserWarning, match="decode step not compiled.*no dynamic shapes here"):
        assert generate(model, prompts[1:], 6, compile=True) == generate(model, prompts[1:], 6, engine="eager")
    assert decode_compile.passed_trial(model, 3) and not decode_compile.passed_trial(model, 2)


def test_the_environment_turns_compilation_on_for_callers_that_do_not_choose(counting, monkeypatch):
    """MINDVL_DECODE_COMPILE=on: `compile=None` compiles; off or unset does not; a bad value is a one-line error."""
    model = build("dense")
    prompts = prompts_for(model, 2)
    want = generate(model, prompts, 5, engine="eager")
    assert generate(model, prompts, 5) == want and counting.graphs == 0
    monkeypatch.setenv("MINDVL_DECODE_COMPILE", "off")
    assert generate(model, prompts, 5) == want and counting.graphs == 0
    monkeypatch.setenv("MINDVL_DECODE_COMPILE", "on")
    assert generate(model, prompts, 5) == want and counting.graphs > 0
    monkeypatch.setenv("MINDVL_DECODE_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="MINDVL_DECODE_COMPILE='sometimes': set it to on or off"):
        generate(model, prompts, 5)


def test_inductor_options_are_passed_under_the_names_this_torch_has(monkeypatch):
    """decode_compile.INDUCTOR_OPTIONS as inductor knows them: every option of this torch kept (sub-config ones by
    their dotted name), an option under a name this torch lacks passed under its older name (OPTION_ALIASES), an
    unknown one left out (torch.compile would fail on it: the device's torch is older than this machine's)."""
    from torch._inductor import config

    wanted = dict(decode_compile.INDUCTOR_OPTIONS)
    assert decode_compile.inductor_options(wanted) == wanted  # this torch (2.13) has every one
    assert config.eager_numerics.division_rounding is False  # a real sub-config option, off unless asked
    monkeypatch.setitem(decode_compile.OPTION_ALIASES, "renamed.in_a_later_torch", ("emulate_precision_casts",))
    got = decode_compile.inductor_options({"renamed.in_a_later_torch": True, "pattern_matcher": False,
                                           "no_such_option": 1, "eager_numerics.no_such_option": 2})
    assert got == {"emulate_precision_casts": True, "pattern_matcher": False}
    compiled = torch.compile(lambda x: x / (x.sum() + 1), backend="inductor", options=decode_compile._options())
    x = torch.randn(7)
    torch.testing.assert_close(compiled(x), x / (x.sum() + 1))


@pytest.mark.slow
def test_inductor_keeps_eager_bf16_logits_bit_for_bit_on_the_cpu(use_backend):
    """The real backend (inductor, C++ kernels on the CPU) with decode_compile.INDUCTOR_OPTIONS and the fused
    projections (a compiled generation's step): six bf16 decode steps of the dense (Qwen2: q/k/v biases) model,
    rows of different lengths, the same teacher-forced tokens on both sides, give the eager step's logits bit for
    bit: the fused norms, rotations and SwiGLU round as eager does, and no residual add is folded into a matmul.
    (Inductor's defaults change most of them, and Qwen3's q/k norms keep the bits too:
    benchmarks/decode_kernels.py --check-bits [--default-options].)"""
    use_backend("inductor")
    model = build("dense").to(torch.bfloat16)

    @torch.inference_mode()
    def logits(call) -> torch.Tensor:
        cache = model.new_kv_cache(3, 64)
        ids = torch.randint(0, 190, (21,), generator=torch.Generator().manual_seed(0))
        out, positions = model.prefill(ids, torch.tensor([0, 9, 13, 21], dtype=torch.int32), cache)
        tokens, steps = out.argmax(-1), []
        for s in range(6):
            steps.append(model.decode_step(tokens, positions + s, cache, layer_call=call))
            tokens = torch.randint(0, 190, (3,), generator=torch.Generator().manual_seed(s))
        return torch.stack(steps)

    eager = logits(None)
    with fused_projections(model):  # what a compiled generation runs
        compiled = logits(decode_compile.layer_call())
    assert torch.equal(eager, compiled), (eager - compiled).abs().max()
