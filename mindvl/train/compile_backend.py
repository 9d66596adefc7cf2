"""The backend of regional torch.compile (`parallel.compile`): inductor, and where inductor cannot compile a graph,
that graph run eagerly.

Why: inductor can fail on a machine where eager PyTorch trains fine (a triton/driver mismatch, an op it cannot lower,
a broken C compiler). Under `parallel.compile: auto` that must not end the run: the graph it could not compile runs
eagerly, one warning says so for the whole process, and `Prepared.compile_fallbacks` lists it. Under `on` (asked for
explicitly) it stays an error, in one line naming the key and the block (`CompileError`, a ValueError: the CLI prints
it in one line, exit 2), the inductor error chained under it.

How: torch.compile calls the backend once per graph dynamo captures (a block's graphs, split where the attention
call is left eager, are shared by every block of its class). Inductor's `compile_fx` runs AOTAutograd there
(decomposition, the split into a forward and a backward aten graph) and hands each aten graph to its `inner_compile`
(`compile_fx_inner`: post-grad passes, lowering, code generation, the C++/triton compile: where machines differ).
torch 2.13 compiles the backward graph lazily, in the first backward (at once only when it saves symbolic sizes), so
a failure can surface in the first forward or in the first backward. The backend passes `compile_fx` its own
`inner_compile`, which calls inductor's and, when that raises, returns torch's `aot_eager` runner (`boxed_nop`) of a
copy of the same aten graph taken before inductor's passes changed it. The step in flight simply goes on: nothing
re-runs, no data is re-read; the graph computes what eager does (eager kernels on inductor's decomposition of the
block: equal to eager up to the rounding of the decomposed ops), and the graphs inductor did compile keep its code.
Under `on` the returned runner raises the error instead (raised from the compiler, dynamo would wrap it in its own
BackendCompilerFailed).

One backend object per (block class, mode) for the process: dynamo's cache checks the backend of a compiled graph,
so a stable object lets every block of a class, and every model prepared in the process, share one compilation.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

KEY = "parallel.compile"


class CompileError(ValueError):
    """`parallel.compile: on` and inductor could not compile a block's graph (the inductor error is the cause)."""


class CompileFallbackWarning(UserWarning):
    """`parallel.compile: auto`: a block graph inductor could not compile runs eagerly."""


_warned: list[str] = []  # the process's one warning (cleared by torch._dynamo.reset(), with the compiled graphs)


def first_line(exc: BaseException) -> str:
    """'Type: first line of the message' of the error under torch's wrappers (InductorError, BackendCompilerFailed:
    their `inner_exception`)."""
    inner = exc
    while isinstance(getattr(inner, "inner_exception", None), BaseException):
        inner = inner.inner_exception  # type: ignore[attr-defined]
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}".rstrip(": ")


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    for name, child in list(copied.named_children()):
        if isinstance(child, fx.GraphModule):
            setattr(copied, name, _copy_graph_module(child))
    return copied


def _spare_copy(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A runnable copy of a graph module that inductor's in-place passes cannot reach: a new graph (node meta copied
    shallowly, so no fake tensor is copied) and, recursively, new copies of its subgraph modules (attribute tensors
    are shared: nothing mutates them). None if it cannot be copied: then that graph has no fallback, and inductor's
    result or error stands as it is (the fallback must never be what stops a compilation)."""
    try:
        return _copy_graph_module(gm)
    except Exception:  # noqa: BLE001
        return None


def _raising(message: str, cause: Exception, boxed: bool) -> Callable[..., Any]:
    """A graph runner that raises CompileError(message) from cause (`boxed`: AOTAutograd's convention, one list of
    inputs that the runner owns; else dynamo's, positional inputs)."""
    def run(*args: Any) -> Any:
        if boxed:
            args[0].clear()
        raise CompileError(message) from cause  # the whole inductor traceback, under ours

    if boxed:
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _control_flow() -> tuple[type[BaseException], ...]:
    """Exceptions dynamo uses to restart or skip a frame's compilation: passed on, never a failure."""
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    return RestartAnalysis, SkipFrame


class InductorOrEager:
    """torch.compile backend for the blocks of one class: inductor, each graph it cannot compile run eagerly
    (`strict=False`, `auto`) or raising CompileError when it first runs (`strict=True`, `on`). `failures`: the graphs
    that fell back ("DecoderLayer backward: RuntimeError: ..."), for as long as dynamo keeps them."""

    def __init__(self, block: str, strict: bool) -> None:
        self.block, self.strict = block, strict
        self.failures: list[str] = []
        self.__name__ = f"inductor_or_eager_{block}"  # dynamo names the backend in its logs

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Dynamo's graph of (part of) a block. A failure before the aten graphs (inductor's pre-grad passes,
        AOTAutograd's tracing, the partitioner) falls back to dynamo's graph itself: eager, autograd's own
        backward."""
        from torch._inductor import compile_fx as inductor

        spare = _spare_copy(gm)  # compile_fx may change the graph it is given
        try:
            return inductor.compile_fx(gm, example_inputs, inner_compile=self.inner_compile)
        except _control_flow():
            raise
        except Exception as exc:  # noqa: BLE001 - whatever inductor raised: the graph can still run eagerly
            if spare is None and not self.strict:
                raise
            return self.fall_back(exc, "forward and backward", lambda: spare.forward, boxed=False)

    def inner_compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """Inductor's `compile_fx_inner` on one aten graph (forward, backward or inference); on failure, that graph
        run eagerly by torch's aot_eager runner (`boxed_nop`)."""
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._inductor import compile_fx as inductor

        spare = _spare_copy(gm)  # inductor's post-grad passes change the graph in place before lowering it
        try:
            return inductor.compile_fx_inner(gm, example_inputs, **kwargs)
        except _control_flow():
            raise
        except Exception as exc:  # noqa: BLE001 - whatever inductor raised: the graph can still run eagerly
            if spare is None and not self.strict:
                raise
            graph = "backward" if kwargs.get("is_backward") else "forward"
            return self.fall_back(exc, graph, lambda: boxed_nop(spare, list(example_inputs)), boxed=True)

    def fall_back(self, exc: Exception, graph: str, eager: Callable[[], Callable[..., Any]],
                  boxed: bool) -> Callable[..., Any]:
        """`eager()` (the graph's eager runner) after one warning for the process; under `on`, a runner raising
        CompileError."""
        if self.strict:
            return _raising(f"{KEY}: on, but inductor could not compile the {graph} graph of {self.block} "
                            f"({first_line(exc)}); set {KEY}: auto (such graphs then run eagerly) or off", exc, boxed)
        what = f"{self.block} {graph}: {first_line(exc)}"
        self.failures.append(what)
        if not _warned:
            _warned.append(what)
            # one line: no source line under it (a frame of torch's compiler would be noise)
            warnings.warn_explicit(f"{KEY}: inductor could not compile {what}; that graph runs eagerly (set {KEY}: "
                                   f"off to not compile, or on to make this an error)", CompileFallbackWarning,
                                   filename="mindvl", lineno=0, module=__name__)
        return eager()

    def reset(self) -> None:
        """torch._dynamo.reset() forgets the compiled graphs, their fallbacks with them."""
        self.failures.clear()
        _warned.clear()


_BACKENDS: dict[tuple[type, bool], InductorOrEager] = {}


def backend_for(block: type, strict: bool) -> InductorOrEager:
    """The process's backend for blocks of this class (`strict`: `parallel.compile: on`)."""
    key = (block, strict)
    if key not in _BACKENDS:
        _BACKENDS[key] = InductorOrEager(block.__name__, strict)
    return _BACKENDS[key]


def compile_failures(backends: Sequence[Any]) -> list[str]:
    """The distinct fallbacks of these backends, in order ("VisionBlock forward: RuntimeError: ...")."""
    return list(dict.fromkeys(f for b in backends if isinstance(b, InductorOrEager) for f in b.failures))
