"""One decode step of a model over its static cache, run eagerly or replayed from a captured graph.

    step = DecodeStep(model, cache, graphs, compiled=False)
    logits = step(tokens [B], positions [B])   # -> [B, V]; advances the cache by one token per row

With `graphs` on a CUDA device the step (`model.decode_step`: embedding, every layer's cache write and attention
over the padded cache, the logits) is captured once per batch size and replayed: the host launches one graph instead
of a few hundred small kernels per token. Capture needs what the static cache provides (kv_cache.py): fixed buffer
addresses, state updated in place, no device read, one shape for every step (`cache.full_width`: attention over
the whole capacity, masked). Tokens and positions are copied into the graph's own input buffers before each replay.
A step that cannot be captured (a kernel that reads the device, e.g. fp32 MoE experts without grouped_mm) falls back
to eager with a warning; the cache is restored to its state before the capture attempt either way.

What captures and replays is a `GraphBackend` (`BACKEND`: CUDA graphs). A replay runs the kernels the capture
recorded, on the buffers it recorded, with every host value (a Python int, a shape, a branch taken) frozen at its
captured value; tests/graph_replay.py emulates exactly that on the CPU, so the replayed step's tokens are checked
in CI without a GPU.

Sampling stays outside the graph (generate.py): its generator and filters are a handful of kernels.

With `compiled` the decoder layers run compiled (decode_compile.py: fused kernels, fewer per step), captured or not.
A model's first compiled step at each batch size (a recompilation) is a trial whose effect on the cache is undone:
a compilation that fails turns it off, warned.

Captured steps are kept across `generate` calls (`lease`): per model, the last POOL_SIZE (batch, capacity) pairs
(one by default) keep their cache and captured step, the capacity rounded up to CAPACITY_STEP slots. A call at a
kept pair resets the cache in place (every buffer stays where the graph reads it) and replays at once: a capture
costs a warm-up step and a recording, which a short answer would otherwise pay every call. The pool is dropped when
the model's weights move (a `.to()`, a reload: the graph reads them by address) and dies with the model;
`release(model)` frees it.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from . import decode_compile


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def usable(self, device: torch.device) -> bool:
        """Whether steps on this device can be captured at all."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """Run `fn` (after any warm-up the backend needs) while recording it -> (graph, fn's output tensor, which
        every replay rewrites in place)."""


class CudaGraphs:
    """torch.cuda's graphs: one warm-up run on a side stream (lazy initialisation: cuBLAS handles, workspaces),
    then the capture."""

    def usable(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out


BACKEND: GraphBackend = CudaGraphs()


class DecodeStep:
    """The model is held weakly: a step kept in the pool must not keep its model alive."""

    def __init__(self, model, cache, graphs: bool = False, backend: GraphBackend | None = None,
                 compiled: bool = False) -> None:
        self._model, self.cache = weakref.ref(model), cache
        self.backend = BACKEND if backend is None else backend
        self.graphs = bool(graphs)
        self._graph: Graph | None = None
        self._batch = -1
        self._tokens = self._positions = self._logits = None
        self.captures = 0
        # the compiled layer call (decode_compile), None when the layers run eagerly (also once a trial failed)
        self.layer_call = (decode_compile.layer_call() if compiled and not decode_compile.failed_trial(model)
                           else None)

    @property
    def model(self):
        return self._model()

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decode_step(tokens, positions, self.cache, layer_call=self.layer_call)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.layer_call is not None and not decode_compile.passed_trial(self.model, tokens.shape[0]):
            self._try_compiled(tokens, positions)
        if self.graphs and self._graph is None and not self.backend.usable(tokens.device):
            self.graphs = False
        if not self.graphs:
            return self._run(tokens, positions)
        if self._graph is None or self._batch != tokens.shape[0]:
            self._capture(tokens, positions)
            if not self.graphs:
                return self._run(tokens, positions)
        self._tokens.copy_(tokens)
        self._positions.copy_(positions)
        self._graph.replay()
        # The host half of the cache's commit, which a replay does not run.
        self.cache.bound = min(self.cache.capacity, self.cache.bound + 1)
        return self._logits

    def _try_compiled(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Run the compiled step once (compiling it), its effect on the cache undone: a compilation that fails
        turns compilation off instead of failing the generation."""
        with _undone(self.cache):
            try:
                self._run(tokens, positions)
                decode_compile.note_trial(self.model, tokens.shape[0], True)
            except Exception as error:  # noqa: BLE001 - any compile failure means: run the layers eagerly
                warnings.warn(f"decode step not compiled ({decode_compile.why(error)}); running its layers "
                              "eagerly from now on", stacklevel=3)
                decode_compile.note_trial(self.model, tokens.shape[0], False)
                self.layer_call = None

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Capture the step at this batch size. The warm-up and the captured run each advance the cache, so its
        state is saved first and restored after: the first replay then takes the step these tokens ask for."""
        cache = self.cache
        cache.full_width = True
        self._tokens, self._positions = tokens.clone(), positions.clone()
        with _undone(cache):
            try:
                self._graph, self._logits = self.backend.capture(lambda: self._run(self._tokens, self._positions))
                self._batch = tokens.shape[0]
                self.captures += 1
            except Exception as error:  # noqa: BLE001 - any capture failure means: run this model eagerly
                warnings.warn(f"decode step not captured in a graph ({error}); running it eagerly", stacklevel=3)
                self.graphs, self._graph = False, None
                cache.full_width = False


@contextlib.contextmanager
def _undone(cache) -> Iterator[None]:
    """Steps run inside leave the cache as it was: its in-place state (lengths, recurrent states) and host bound
    restored, a forward that raised forgotten. (K/V slot writes are rewritten by the next step.)"""
    saved = [t.clone() for t in cache.step_state()]
    bound = cache.bound
    try:
        yield
    finally:
        cache.abandon()
        for t, s in zip(cache.step_state(), saved, strict=True):
            t.copy_(s)
        cache.bound = bound


# ------------------------------------------------------------------------------------- kept across generate calls

# (batch, capacity) pairs kept per model. Each holds a whole KV cache (a large model's can fill most of a GPU), and a
# new pair is allocated only after the least recently used ones are dropped, so with 1 a generation never holds more
# cache memory than it did before steps were kept: the kept one persists between calls only.
POOL_SIZE = 1
CAPACITY_STEP = 256  # a kept cache's capacity is a multiple of this, so prompts of nearby lengths share it


def bucket(needed: int) -> int:
    """`needed` slots rounded up to CAPACITY_STEP: the capacity of a kept cache, and of a compiled step's cache
    (whose buffers' shapes its graphs see: calls of nearby lengths then compile nothing new)."""
    return -(-needed // CAPACITY_STEP) * CAPACITY_STEP


class _Pool:
    def __init__(self, weights: tuple, backend: GraphBackend) -> None:
        self.weights, self.backend = weights, backend
        self.entries: OrderedDict[tuple[int, int, bool], tuple] = OrderedDict()  # least recently used first


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model) -> tuple:
    """Where the model's parameters and buffers live: a captured step reads them at these addresses."""
    return tuple((t.data_ptr(), t.dtype) for t in (*model.parameters(), *model.buffers()))


def lease(model, batch: int, needed: int, compiled: bool = False) -> tuple:
    """(cache, step) for a generation of `batch` sequences needing `needed` slots each: the kept pair for this batch,
    capacity and `compiled`, reset, or a new one (module docstring). The step replays from a graph where BACKEND
    can capture."""
    capacity = bucket(needed)
    weights = _weights_key(model)
    pool = _POOLS.get(model)
    if pool is None or pool.weights != weights or pool.backend is not BACKEND:
        pool = _POOLS[model] = _Pool(weights, BACKEND)
    key = (batch, capacity, bool(compiled))
    entry = pool.entries.pop(key, None)
    if entry is not None and entry[0].compacted:  # compacted during its last call: its buffers moved
        entry = None
    if entry is None:
        while pool.entries and len(pool.entries) >= POOL_SIZE:  # freed before the new cache is allocated
            pool.entries.popitem(last=False)
        cache = model.new_kv_cache(batch, capacity)
        entry = (cache, DecodeStep(model, cache, True, backend=BACKEND, compiled=compiled))
    else:
        entry[0].reset()
    pool.entries[key] = entry
    return entry


def release(model) -> None:
    """Free the caches and captured steps kept for this model."""
    _POOLS.pop(model, None)
