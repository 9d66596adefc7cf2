"""One reading slot's pipeline: readers -> mixture -> parse -> process -> packer -> Packs, with exact state.

A `PackStream` runs in one loader worker (or in the main process with `num_workers: 0`). Its state after each pack
is a small JSON-able dict: every reader's position, the mixture's draw counter, the packer buffer as record refs,
and the counters. `load_state_dict` re-reads the buffered records and processes them again (deterministically),
so the packs that follow are exactly those an uninterrupted run would have produced.
"""

from __future__ import annotations

from collections.abc import Iterator

from .config import DataConfig
from .mixture import Consumption, Mixture
from .packing import Packer, build_pack
from .process import ProcessConfig, process_conversation
from .schema import BadSample, Pack, Sample, SampleRef
from .skips import SkipLog
from .sources import RawItem, ReaderState, SourceReader, derived_seed, empty_epoch_limit, item_to_conversation
from .tokenizer import TextTokenizer
from .video import video_settings

STATE_VERSION = 2  # 2: readers deal byte stretches (sources.slot_units)
LEGACY_STATE_VERSION = 1  # whole files dealt round-robin: continued through mindvl.data.elastic, never as is


def held_out(ref: SampleRef, fraction: float) -> bool:
    """Is this record in the held-out split? A hash of where it lives (source, file, byte offset), so the split is
    the same in every run, resume and slot layout."""
    return derived_seed("eval", ref.source, ref.file, ref.offset) / 2**64 < fraction


class PackStream:
    def __init__(self, cfg: DataConfig, tok: TextTokenizer, files: list[list[tuple[str, str]]], slot: int,
                 n_slots: int, max_epochs: int | None = None, context: str = ""):
        self.cfg, self.tok, self.files = cfg, tok, files
        self.slot, self.n_slots, self.context = slot, n_slots, context
        self.readers = [
            SourceReader(s, i, files[i], slot, n_slots, cfg.seed, max_epochs,
                         max_record_bytes=cfg.record_byte_limit(),
                         max_media_bytes=cfg.max_image_bytes) for i, s in enumerate(cfg.sources)
        ]
        self.mixture = Mixture([s.ratio for s in cfg.sources], cfg.seed, slot)
        self.packer = Packer(cfg.seq_len, cfg.max_patches_per_pack, cfg.pack_buffer, cfg.pad_to_seq_len,
                             pad_id=tok.special.endoftext)
        self.skips = SkipLog(cfg.strict, context)
        self.consumed = Consumption([s.name for s in cfg.sources])
        self.truncated = 0
        self.exhausted = [False] * len(cfg.sources)
        # per source: [epoch, usable records so far in it, epochs in a row without one, bad records since the last
        # usable one]
        self.epoch_valid = [[0, 0, 0, 0] for _ in cfg.sources]
        self.alloc_pixels = None  # optional [P] -> float32 [P, patch_dim] allocator for pack pixel rows (shared memory)
        self._process_cfgs = [
            ProcessConfig(seq_len=cfg.seq_len, min_pixels=cfg.pixels_for(i)[0], max_pixels=cfg.pixels_for(i)[1],
                          max_image_pixels=cfg.max_image_pixels, max_image_bytes=cfg.max_image_bytes,
                          truncation=cfg.truncation,
                          max_patches=cfg.max_patches_per_pack, default_system=cfg.default_system,
                          train_on_prompt=cfg.train_on_prompt, caption_prompts=cfg.sources[i].caption_prompts,
                          seed=cfg.seed, video=video_settings(cfg.video),
                          tokens_per_second=cfg.video.tokens_per_second or 2,  # 2: Qwen2.5-VL, when no model says
                          box_format=cfg.box_format, image_resize=cfg.image_resize,
                          processing=cfg.vision_processing())
            for i in range(len(cfg.sources))
        ]

    # ------------------------------------------------------------------------------------------------- records

    def _process(self, item: RawItem) -> tuple[Sample, bool]:
        conv = item_to_conversation(item)
        return process_conversation(conv, self.tok, self._process_cfgs[item.ref.source], item.ref.source, item.ref)

    def _next_sample(self) -> Sample | None:
        """The next usable sample from the mixture, or None when every source is exhausted (finite epochs)."""
        while True:
            src = self.mixture.choose([not e for e in self.exhausted])
            if src is None:
                return None
            reader = self.readers[src]
            item = reader.next()
            self._check_epoch(src)
            if item is None:
                self.exhausted[src] = True
                self._check_last_epoch(src)
                continue
            if isinstance(item, BadSample):
                self.skips.record(item)
                self.epoch_valid[src][3] += 1
                continue
            if self.cfg.eval_fraction and held_out(item.ref, self.cfg.eval_fraction) != (self.cfg.split == "eval"):
                continue  # the other split's record (not a skip: every record is in exactly one split)
            try:
                sample, truncated = self._process(item)
            except BadSample as bad:
                self.skips.record(bad)
                self.epoch_valid[src][3] += 1
                continue
            self.truncated += truncated
            ev = self.epoch_valid[src]
            ev[1], ev[2], ev[3] = ev[1] + 1, 0, 0
            return sample

    # A slot may see no usable sample of a small source in an epoch (its share was empty or held only bad records);
    # a source is declared unusable only after two such epochs in a row with this many bad records and no good one.
    BAD_IN_A_ROW = 64

    def _check_last_epoch(self, src: int) -> None:
        """Finite epochs (`max_epochs`): a source that gave bad records and not one usable sample here."""
        _, valid, dry, bad = self.epoch_valid[src]
        if valid == 0 and bad > 0 and dry >= self.readers[src].state.epoch:
            raise ValueError(
                f"source {self.cfg.sources[src].name!r} gave no usable sample on {self.context or 'this slot'} "
                f"({bad} bad records; skipped: {self.skips.state_dict()}); fix the data (see the warnings above)")

    def _check_epoch(self, src: int) -> None:
        epoch = self.readers[src].state.epoch
        seen_epoch, valid, dry, bad = self.epoch_valid[src]
        if epoch != seen_epoch:
            dry = dry + (epoch - seen_epoch) if valid == 0 else 0
            if self.cfg.split == "eval" and self.cfg.eval_fraction and dry > empty_epoch_limit(self.n_slots):
                raise ValueError(f"data.eval_fraction: {self.cfg.eval_fraction} holds out no record of source "
                                 f"{self.cfg.sources[src].name!r} on {self.context or 'this slot'}; raise it")
            if dry >= 2 and bad >= self.BAD_IN_A_ROW:
                name = self.cfg.sources[src].name
                raise ValueError(
                    f"source {name!r} gave no usable sample in epochs {seen_epoch - dry + 1}..{seen_epoch} on "
                    f"{self.context or 'this slot'} ({bad} bad records in a row; skipped so far: "
                    f"{self.skips.state_dict()}); fix the data (see the warnings above)"
                )
            self.epoch_valid[src] = [epoch, 0, dry, bad]

    # --------------------------------------------------------------------------------------------------- packs

    def _emit(self) -> Pack:
        samples = self.packer.select()
        for s in samples:
            self.consumed.add(s.source, s.num_tokens, s.num_trained, len(s.image_grid_thw), s.num_patches)
        return build_pack(samples, self.cfg.seq_len if self.cfg.pad_to_seq_len else None, self.packer.pad_id,
                          self.alloc_pixels, self.cfg.vision_processing())

    def __iter__(self) -> Iterator[Pack]:
        """Packs until every source is exhausted (never, unless max_epochs is set). After each yield,
        `state_dict()` is the state that resumes right after that pack."""
        while True:
            if self.packer.full:
                yield self._emit()
                continue
            sample = self._next_sample()
            if sample is None:
                while self.packer.buffer:
                    yield self._emit()
                return
            self.packer.add(sample)

    # --------------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "slot": [self.slot, self.n_slots],
            "readers": [r.state.to_dict() for r in self.readers],
            "mixture": self.mixture.state_dict(),
            "packer": self.packer.state_dict(),
            "skipped": self.skips.state_dict(),
            "consumed": self.consumed.state_dict(),
            "truncated": self.truncated,
            "exhausted": list(self.exhausted),
            "epoch_valid": [list(v) for v in self.epoch_valid],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") == LEGACY_STATE_VERSION:
            raise ValueError(f"data state version {LEGACY_STATE_VERSION} deals whole files to reading slots, this "
                             "version deals byte stretches; continue it with mindvl.data.elastic."
                             "reshard_loader_states (a trainer resume does)")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')} is not {STATE_VERSION}")
        if list(state["slot"]) != [self.slot, self.n_slots]:
            raise ValueError(
                f"data state is for reading slot {state['slot'][0]} of {state['slot'][1]}, this is slot {self.slot} of "
                f"{self.n_slots}; resume with the same number of ranks and loader workers"
            )
        if len(state["readers"]) != len(self.readers):
            raise ValueError(f"data state has {len(state['readers'])} sources, the config has {len(self.readers)}")
        for reader, rs in zip(self.readers, state["readers"], strict=True):
            reader.state = ReaderState.from_dict(rs)
            reader._it = None
        self.mixture.load_state_dict(state["mixture"])
        self.skips.load_state_dict(state["skipped"])
        self.consumed.load_state_dict(state["consumed"])
        self.truncated = int(state["truncated"])
        self.exhausted = [bool(x) for x in state["exhausted"]]
        self.epoch_valid = [[int(x) for x in (list(v) + [0, 0])[:4]] for v in state["epoch_valid"]]
        ps = state["packer"]
        self.packer.buffer = []
        for ref_list, arrival, order in ps["buffer"]:
            ref = SampleRef.from_list(ref_list)
            item = self.readers[ref.source].read_ref(ref)
            if isinstance(item, BadSample):
                raise ValueError(f"cannot restore the packing buffer: {item}")
            try:
                sample, _ = self._process(item)
            except BadSample as bad:
                raise ValueError(f"cannot restore the packing buffer (did the data change?): {bad}") from bad
            self.packer.add(sample, arrival=int(arrival), order=int(order))
        self.packer.packs_made = int(ps["packs_made"])
        self.packer._order = int(ps["order"])
