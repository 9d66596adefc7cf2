"""Regional compile when inductor fails (mindvl.train.compile_backend): `parallel.compile: auto` runs the graph
inductor could not compile eagerly (forward or backward: torch 2.13 compiles the backward in the first backward),
with one warning for the process and the fallback listed in `Prepared.compile_fallbacks`; `on` makes it a one-line
CompileError naming the key.

No code is generated here: inductor's per-graph entry (`compile_fx_inner`) is replaced by torch's aot_eager runner
(`boxed_nop`), failing on purpose for the forward or the backward graphs; everything else (dynamo, AOTAutograd with
inductor's decompositions and partitioner, the backend) is the real path. The model is `tiny_model()` with
`parallel.compile` forced on for the CPU. A real inductor compile through this backend is the slow
test_compiled_blocks_equal_eager_forward_and_backward (tests/test_accelerator_standins.py).
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor import compile_fx as inductor
from torch._inductor.exc import InductorError
from torch.nn import functional

import mindvl.train.parallel as parallel
from mindvl.cli import _is_bug, _is_expected
from mindvl.config import ParallelSection
from mindvl.train.compile_backend import CompileError, CompileFallbackWarning, backend_for, compile_failures
from mindvl.train.parallel import ParallelEnv, Prepared, blocks, parallelize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_mindvl import tiny_model, tiny_pack  # noqa: E402

ENV = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")
FAILURE = "RuntimeError: forced for the test"  # the first line the backend reports


@pytest.fixture
def inductor_failing(monkeypatch):
    """`fail(graph)`: from now on inductor fails on every `graph` ("forward" | "backward") graph, after wrecking it
    in place (its multiplications made additions: the fallback must run the graph as it was given), and runs the
    others eagerly (no code generation). Compile counts as enabled on the CPU; dynamo's caches are fresh."""
    monkeypatch.setattr(parallel, "compile_enabled", lambda cfg, device: cfg.compile != "off")
    # No cache hits: a graph that inductor compiled earlier in this process or machine (the slow real-inductor test
    # compiles the same tiny model) would come from inductor's FX graph cache or AOTAutograd's cache without
    # reaching `compile_fx_inner`, so the forced failure would never happen.
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    compiled: list[str] = []

    def fail(graph: str) -> list[str]:
        def inner(gm, example_inputs, **kwargs):
            kind = "backward" if kwargs.get("is_backward") else "forward"
            compiled.append(kind)
            if kind == graph:
                for node in gm.graph.nodes:  # change the graph in place first, as inductor's post-grad passes do
                    if node.target == torch.ops.aten.mul.Tensor:
                        node.target = torch.ops.aten.add.Tensor
                gm.recompile()
                raise InductorError(RuntimeError("forced for the test\nsecond line of the message"), None)
            return boxed_nop(gm, example_inputs)

        monkeypatch.setattr(inductor, "compile_fx_inner", inner)
        return compiled

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield fail
    torch._dynamo.reset()


def step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training step's forward and backward (the compiled part): loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss_sum, _ = model(**batch)
    loss_sum.backward()
    return loss_sum.detach(), {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()}


def prepared_pair(mode: str) -> tuple[torch.nn.Module, torch.nn.Module, Prepared]:
    eager = tiny_model(seed=3, std=0.1)
    done = Prepared()
    compiled = parallelize(copy.deepcopy(eager), ENV, ParallelSection(compile=mode, mixed_precision="fp32"), done)
    assert done.compiled and all(b._compiled_call_impl is not None for b in blocks(compiled))
    return eager, compiled, done


def test_auto_runs_the_graphs_inductor_cannot_compile_eagerly_with_one_warning(inductor_failing):
    """The tiny MindVL, every forward graph of both block classes failing: without the fallback the forced error
    ends the step; with it the step equals eager (loss to 1e-6 relative, every gradient to 1e-5 of its largest
    element), one warning for the run, both blocks listed in Prepared. Not bit-equal: what runs is inductor's
    decomposition of the block (e.g. silu as x*sigmoid(x)) on eager kernels, a few float32 ulps from the fused eager
    kernels (measured: 8e-8 on the loss, 1.6e-6 of the largest gradient element; the toy backward test below shows
    it bit-equal to the same graph compiled without a failure); a wrong graph or input order would be far off."""
    compiled_graphs = inductor_failing("forward")
    eager, compiled, done = prepared_pair("auto")
    batch = tiny_pack(eager.config, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_loss, got = step(compiled, batch)
        got_loss2, _ = step(compiled, tiny_pack(eager.config, 2))  # the next step: compiled already, no new warning
    want_loss, want = step(eager, batch)
    assert {"forward", "backward"} <= set(compiled_graphs)  # both kinds went through the backend
    lines = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(lines) == 1, lines  # one for the run, though every forward graph of both block classes failed
    assert f"forward: {FAILURE};" in lines[0] and "second line" not in lines[0]
    assert "parallel.compile: off" in lines[0] and "on to make this an error" in lines[0]
    assert done.compile_fallbacks == [f"VisionBlock forward: {FAILURE}", f"DecoderLayer forward: {FAILURE}"]
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert got.keys() == want.keys() and any("visual.blocks.1" in n for n in got)
    for name, g in want.items():
        scale = g.abs().max().clamp_min(1e-12)
        assert float((got[name] - g).abs().max() / scale) < 1e-5, name
    assert torch.isfinite(got_loss2)
    torch._dynamo.reset()  # dynamo forgets the graphs, and their fallbacks with them
    assert done.compile_fallbacks == []


class Block(nn.Module):
    """A pre-norm MLP block (layer norm and SiLU, which inductor decomposes): the compile unit of the toy tests,
    which compile in a fraction of a second."""

    def __init__(self, width: int = 24, hidden: int = 40) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(functional.silu(self.up(self.norm(x))))


def toy_step(strict: bool | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of two blocks, compiled regionally through the backend (`strict`) or eager (None)."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    if strict is not None:
        for b in model:
            b.compile(backend=backend_for(Block, strict))
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_a_backward_graph_falls_back_in_the_first_backward_to_the_same_aten_graph(inductor_failing):
    """torch 2.13 compiles the backward graph in the first backward, after the forward ran compiled: the graph
    inductor failed on runs eagerly there and then, and the step is bit-equal to the same graphs compiled without a
    failure (and equal to eager within the decompositions' rounding). (The forward's fallback is the same code,
    run at the first forward: the tiny MindVL test above.)"""
    inductor_failing("backward")
    with pytest.warns(CompileFallbackWarning, match=f"Block backward: {FAILURE}"):
        got_loss, got = toy_step(strict=False)
    assert compile_failures([backend_for(Block, False)]) == [f"Block backward: {FAILURE}"]
    torch._dynamo.reset()
    inductor_failing("neither")
    want_loss, want = toy_step(strict=False)
    eager_loss, eager = toy_step(strict=None)
    assert torch.equal(got_loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    torch.testing.assert_close(got_loss, eager_loss, rtol=1e-6, atol=0)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_failure_before_the_aten_graphs_runs_dynamos_graph(inductor_failing, monkeypatch):
    """A failure in compile_fx itself (pre-grad passes, AOTAutograd's trace, the partitioner): dynamo's own graph
    runs, eager ops and autograd's backward, so the step is bit-equal to eager."""
    inductor_failing("neither")

    def broken(*args, **kwargs):
        raise RuntimeError("partitioner failed")

    monkeypatch.setattr(inductor, "compile_fx", broken)
    with pytest.warns(CompileFallbackWarning, match="Block forward and backward: RuntimeError: partitioner failed"):
        got_loss, got = toy_step(strict=False)
    want_loss, want = toy_step(strict=None)
    assert torch.equal(got_loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_on_makes_a_compile_failure_one_line_naming_the_key(inductor_failing, graph):
    """`parallel.compile: on` (asked for): the step raises CompileError, a ValueError raised in mindvl that the CLI
    prints in one line (exit 2), naming the key, the block and the error; inductor's error chained under it."""
    inductor_failing(graph)
    with pytest.raises(CompileError) as info:
        toy_step(strict=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith("parallel.compile: on, but inductor could not compile")
    assert f"the {graph} graph of Block ({FAILURE})" in message
    assert "set parallel.compile: auto" in message and message.endswith("or off")
    assert isinstance(info.value.__cause__, InductorError)  # the full inductor traceback
    assert _is_expected(info.value) and not _is_bug(info.value)  # the CLI's one-line path
    assert compile_failures([backend_for(Block, True)]) == []


def test_on_is_strict_and_auto_is_not(inductor_failing):
    """`_compile` gives `on` the strict backend, `auto` the falling-back one, one per block class."""
    inductor_failing("neither")
    for mode, strict in (("on", True), ("auto", False)):
        done = Prepared()
        parallelize(tiny_model(), ENV, ParallelSection(compile=mode, mixed_precision="fp32"), done)
        assert [(b.block, b.strict) for b in done.compile_backends] == [("VisionBlock", strict),
                                                                         ("DecoderLayer", strict)]
