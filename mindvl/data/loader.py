"""The loader a trainer iterates: one per data-parallel rank, with optional worker processes, exact resume.

    loader = build_loader(recipe.data, rank=r, world_size=w)     # a DataConfig (or its dict form)
    for pack in loader:                 # infinite stream of Packs (max_epochs=None)
        batch = pack.to_torch()         # input_ids, labels, position_ids, cu_seqlens, pixel_values, image_grid_thw
        ...
        state = loader.state_dict()     # small JSON-able dict: save it per rank with the checkpoint
    loader.load_state_dict(state)       # then iter(loader) continues exactly after the last consumed pack

Each rank runs `max(1, num_workers)` logical streams (reading slots rank*W + w of world_size*W). torch's
DataLoader hands out worker outputs strictly round-robin, so the consumed order is stream 0, 1, ..., W-1, 0, ...
Every pack arrives with its stream's state *after* that pack; the loader keeps the last one per stream, which is
exact no matter how far the workers have prefetched. On resume, DataLoader worker w runs logical stream
(w + next_stream) mod W, so the first pack delivered is the one the interrupted run would have consumed next.

With `MINDVL_DATA_TRACE=DIR` in the environment, every consumed pack's records are appended to
`DIR/<split>_shard_<rank>.txt` (split: train or eval) as "source file byte-offset" lines: which records a run
trained (the elastic-resume tests compare them with an uninterrupted run's).

This is the only module of mindvl.data that imports torch at import time (for the DataLoader workers); video.py
imports it lazily to resize video frames exactly as transformers' video processor does.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import torch.utils.data as tud

from .config import DataConfig
from .mixture import Consumption
from .schema import Pack
from .sources import resolve_files
from .stream import PackStream
from .tokenizer import TextTokenizer, load_tokenizer
from .video import require_decoder_for

LOADER_STATE_VERSION = 1
TRACE_ENV = "MINDVL_DATA_TRACE"


def default_synth_cache() -> Path:
    return Path(os.environ.get("MINDVL_CACHE", Path.home() / ".cache" / "mindvl")) / "synth"


def resolve_sources(cfg: DataConfig) -> list[list[tuple[str, str]]]:
    """[(path, format)] per source; synthetic sources are generated into the cache first (once)."""
    from mindvl.progress import Progress

    from .synth import ensure_synth, synth_path  # Pillow drawing code, only needed for synthetic sources

    out = []
    for i, s in enumerate(cfg.sources):
        where = f"data.sources[{i}] ({s.name})"
        if s.synth is not None:
            cache = Path(cfg.synth_cache) if cfg.synth_cache else default_synth_cache()
            # Generating a large set takes a while (20,000 digit images: about a minute): show it.
            fresh = not synth_path(cache, s.synth.tasks, s.synth.n, s.synth.seed).is_file()
            with Progress(f"generating synthetic set {s.name}", total=s.synth.n, unit="samples",
                          enabled=fresh and os.environ.get("RANK", "0") == "0") as bar:
                jsonl = ensure_synth(cache, s.synth.tasks, s.synth.n, s.synth.seed, progress=bar.update)
            out.append(resolve_files([str(jsonl)], "jsonl", where))
        else:
            out.append(resolve_files(s.paths, s.format, where))
    return out


class _WorkerStreams(tud.IterableDataset):
    """What each DataLoader worker runs: logical stream (worker id + offset) mod W, yielding
    (stream index, pack, stream state after the pack)."""

    def __init__(self, cfg: DataConfig, tok: TextTokenizer, files: list, rank: int, world_size: int,
                 n_streams: int, offset: int, states: list[dict | None], max_epochs: int | None):
        self.cfg, self.tok, self.files = cfg, tok, files
        self.rank, self.world_size, self.n_streams = rank, world_size, n_streams
        self.offset, self.states, self.max_epochs = offset, states, max_epochs

    def __iter__(self):
        info = tud.get_worker_info()
        worker = info.id if info is not None else 0
        stream_index = (worker + self.offset) % self.n_streams
        stream = make_stream(self.cfg, self.tok, self.files, self.rank, self.world_size, self.n_streams,
                             stream_index, self.states[stream_index], self.max_epochs)
        shared = _SharedPixels(self.cfg.vision_processing().patch_dim)
        stream.alloc_pixels = shared
        for pack in stream:
            # torch tensors travel between processes as shared-memory handles, not as pickled bytes; the pixel rows
            # were written straight into shared memory, so they are never copied on the way.
            for key, value in pack.to_torch().items():
                setattr(pack, key, value)
            pack.pixel_values = shared.take()
            yield stream_index, pack, stream.state_dict()


class _SharedPixels:
    """Allocates a pack's [P, patch_dim] float32 rows in torch shared memory and hands the tensor over afterwards."""

    def __init__(self, patch_dim: int):
        self._tensor, self.patch_dim = None, patch_dim

    def __call__(self, rows: int):
        import torch

        self._tensor = torch.empty((rows, self.patch_dim), dtype=torch.float32)
        if rows:
            self._tensor.share_memory_()
        return self._tensor.numpy()

    def take(self):
        tensor, self._tensor = self._tensor, None
        return tensor


def make_stream(cfg: DataConfig, tok: TextTokenizer, files: list, rank: int, world_size: int, n_streams: int,
                stream_index: int, state: dict | None, max_epochs: int | None) -> PackStream:
    slot = rank * n_streams + stream_index
    ctx = f"rank {rank} worker {stream_index}"
    stream = PackStream(cfg, tok, files, slot, world_size * n_streams, max_epochs, ctx)
    if state is not None:
        stream.load_state_dict(state)
    return stream


class PackLoader:
    """Iterable over Packs for one rank; `state_dict()` / `load_state_dict()` give exact resume."""

    def __init__(self, cfg: DataConfig, tokenizer: TextTokenizer | None = None, rank: int = 0, world_size: int = 1,
                 max_epochs: int | None = None, files: list | None = None):
        cfg.validate()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.cfg = cfg
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
        self.rank, self.world_size, self.max_epochs = rank, world_size, max_epochs
        self.files = files if files is not None else resolve_sources(cfg)
        require_decoder_for([(s.name, f) for s, f in zip(cfg.sources, self.files, strict=True)])
        self.n_streams = max(1, cfg.num_workers)
        self._states: list[dict | None] = [None] * self.n_streams
        self._next = 0
        self.packs_consumed = 0

    def __iter__(self) -> Iterator[Pack]:
        trace = _Trace(os.environ[TRACE_ENV], f"{self.cfg.split}_shard_{self.rank:05d}.txt") \
            if os.environ.get(TRACE_ENV) else None
        if self.cfg.num_workers == 0:
            stream = make_stream(self.cfg, self.tok, self.files, self.rank, self.world_size, 1, 0, self._states[0],
                                 self.max_epochs)
            for pack in stream:
                self._states[0] = stream.state_dict()
                self.packs_consumed += 1
                if trace:
                    trace.write(pack)
                yield pack
            return
        inner = _WorkerStreams(self.cfg, self.tok, self.files, self.rank, self.world_size, self.n_streams,
                               self._next, list(self._states), self.max_epochs)
        dl = tud.DataLoader(inner, batch_size=None, num_workers=self.cfg.num_workers, collate_fn=_identity,
                            prefetch_factor=2, worker_init_fn=_ignore_stop_signals)
        for stream_index, pack, state in dl:
            self._states[stream_index] = state
            self._next = (stream_index + 1) % self.n_streams
            self.packs_consumed += 1
            if trace:
                trace.write(pack)
            yield pack

    # ------------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {
            "version": LOADER_STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_streams": self.n_streams,
            "next_stream": self._next,
            "packs_consumed": self.packs_consumed,
            "streams": list(self._states),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')} is not {LOADER_STATE_VERSION}")
        for key, mine in (("rank", self.rank), ("world_size", self.world_size), ("num_streams", self.n_streams)):
            if state[key] != mine:
                raise ValueError(
                    f"data loader state has {key}={state[key]} but this loader has {key}={mine}; resume with the "
                    "same ranks and num_workers"
                )
        self._states = list(state["streams"])
        self._next = int(state["next_stream"])
        self.packs_consumed = int(state["packs_consumed"])

    def report(self) -> dict:
        """Consumed samples/tokens/images per source, skipped by reason, truncated count (this rank, so far)."""
        live = [s for s in self._states if s is not None]
        skipped: dict[str, int] = {}
        for s in live:
            for k, v in s["skipped"].items():
                skipped[k] = skipped.get(k, 0) + v
        return {
            "packs": self.packs_consumed,
            "consumed": Consumption.merge([s["consumed"] for s in live]),
            "skipped": dict(sorted(skipped.items())),
            "truncated": sum(s["truncated"] for s in live),
        }


class _Trace:
    """Appends each consumed pack's records to one file of the trace folder (see the module docstring)."""

    def __init__(self, folder: str, name: str):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, name)

    def write(self, pack: Pack) -> None:
        with open(self.path, "a") as f:
            f.writelines(f"{r[0]} {r[1]} {r[2]}\n" for r in pack.sample_refs if r is not None)


def _identity(x):
    return x


def _ignore_stop_signals(_worker_id: int) -> None:
    """Stop signals are the main process's to handle (it finishes the step and checkpoints). Ctrl-C reaches the whole
    process group and SLURM signals every process of a step; a worker that died on them would make the main process
    raise before its checkpoint. Workers still exit when the main process goes away (torch's worker watchdog)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def build_loader(cfg: DataConfig | dict, tokenizer: TextTokenizer | str | None = None, rank: int = 0,
                 world_size: int = 1, max_epochs: int | None = None) -> PackLoader:
    """A rank's loader from a DataConfig (or its dict form, validated); `tokenizer` may be a folder path."""
    if isinstance(cfg, dict):
        cfg = DataConfig.from_dict(cfg)
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer or cfg.tokenizer)
    return PackLoader(cfg, tok, rank, world_size, max_epochs)
