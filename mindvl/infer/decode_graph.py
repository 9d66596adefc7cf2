"""One decode step of a model over its static cache, run eagerly or replayed from a captured graph.

    step = DecodeStep(model, cache, graphs)
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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def usable(self, cache) -> bool:
        """Whether steps over this cache (its device) can be captured at all."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """Run `fn` (after any warm-up the backend needs) while recording it -> (graph, fn's output tensor, which
        every replay rewrites in place)."""


class CudaGraphs:
    """torch.cuda's graphs: one warm-up run on a side stream (lazy initialisation: cuBLAS handles, workspaces),
    then the capture."""

    def usable(self, cache) -> bool:
        lengths = cache.lengths_dev
        return torch.cuda.is_available() and lengths is not None and lengths.device.type == "cuda"

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
    def __init__(self, model, cache, graphs: bool = False, backend: GraphBackend | None = None) -> None:
        self.model, self.cache = model, cache
        self.backend = BACKEND if backend is None else backend
        self.graphs = bool(graphs) and self.backend.usable(cache)
        self._graph: Graph | None = None
        self._batch = -1
        self._tokens = self._positions = self._logits = None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.graphs:
            return self.model.decode_step(tokens, positions, self.cache)
        if self._graph is None or self._batch != tokens.shape[0]:
            self._capture(tokens, positions)
            if not self.graphs:
                return self.model.decode_step(tokens, positions, self.cache)
        self._tokens.copy_(tokens)
        self._positions.copy_(positions)
        self._graph.replay()
        # The host half of the cache's commit, which a replay does not run.
        self.cache.bound = min(self.cache.capacity, self.cache.bound + 1)
        return self._logits

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Capture the step at this batch size. The warm-up and the captured run each advance the cache, so its
        state is saved first and restored after: the first replay then takes the step these tokens ask for."""
        cache = self.cache
        cache.full_width = True
        self._tokens, self._positions = tokens.clone(), positions.clone()
        saved = [t.clone() for t in cache.step_state()]
        bound = cache.bound
        try:
            self._graph, self._logits = self.backend.capture(
                lambda: self.model.decode_step(self._tokens, self._positions, cache))
            self._batch = tokens.shape[0]
        except Exception as error:  # noqa: BLE001 - any capture failure means: run this model eagerly
            warnings.warn(f"decode step not captured in a graph ({error}); running it eagerly", stacklevel=3)
            self.graphs, self._graph = False, None
            cache.full_width = False
        finally:
            for t, s in zip(cache.step_state(), saved, strict=True):
                t.copy_(s)
            cache.bound = bound
