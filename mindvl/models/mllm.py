"""The composed model: vision tower -> projector -> language model.

Two call forms share one forward:

- transformers' form, for alignment and evaluation: `model(input_ids=[1, T], pixel_values=[P, 1176],
  image_grid_thw=[N, 3])` returns `MindVLOutput(logits=[1, T, V])`.
- the packed training form: `model(input_ids=[T], labels=[T], cu_seqlens=[n+1], position_ids=[3, T] | [T],
  pixel_values=[P, 1176], image_grid_thw=[N, 3], layout=PackLayout)` returns `LossOutput(loss_sum, num_tokens)`;
  without labels it returns `MindVLOutput(logits=[T, V])`.

Host values: whatever shapes the computation (sample offsets, longest sample, image grids, the vision-pad count)
is taken from `layout` (mindvl.models.host.PackLayout, host ints that the trainer builds from the pack before it
moves to the device), so forward and backward read nothing back from the device. Without `layout` (tests,
evaluation, transformers-style calls) it is read from the tensors once, at the top of the forward; given
`position_ids` (the pack's), no token id is read either.

Generation (mindvl.infer) uses `new_kv_cache`, `prefill` (B packed prompts -> last-token logits and next positions)
and `decode_step` (one token per sequence).

Image features replace the image-pad token embeddings in order. A micro-batch without images still runs the
vision tower and projector on zero patches (and ties them into the graph with a zero), so that under FSDP every
rank runs the same collectives every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .attention import check_backend_name
from .config import MindVLConfig
from .host import PackLayout, host_grids, host_offsets, next_token_targets, to_device
from .kv_cache import KVCache
from .loss import chunked_cross_entropy
from .projector import Projector
from .random_init import seeded_init_tensors
from .text import TextModel
from .vision import VisionTransformer
from .vision_qwen3 import LayerNormMerger, Qwen3VisionTransformer


@dataclass
class MindVLOutput:
    logits: torch.Tensor


class LossOutput(NamedTuple):
    loss_sum: torch.Tensor  # float32 scalar: summed cross-entropy over labelled tokens
    num_tokens: torch.Tensor  # int64 scalar: how many tokens were labelled


def mrope_position_ids(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    image_token_id: int,
    spatial_merge_size: int,
    video_token_id: int | None = None,
    video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
    tokens_per_second: int = 2,
    video_frames_apart: bool = False,
) -> torch.Tensor:
    """3-D M-RoPE positions [3, T] for a packed row, restarting at 0 in every sample (transformers' get_rope_index).

    Text tokens advance all three rows together; a vision item's pad tokens get (time, row, col) offsets from the
    running position and the text after it resumes at the running position + max(h, w) / merge. The time index of
    frame group k is `int(k * tokens_per_second * second_per_grid_t)` for a video (Qwen2.5-VL's absolute-time
    alignment, computed in float32 as transformers does) and k for an image (0 for the t = 1 of a processed image).

    Grids are consumed in order of appearance: with `video_grid_thw` the videos' grids come from it (transformers'
    form); without it every vision item, image or video, takes the next row of `image_grid_thw` (mindvl's packed
    form, where pixel rows and grids of images and videos share one stream). `second_per_grid_ts` [n_videos]
    (default 1.0 each, as in transformers) holds each video's seconds per temporal patch.

    `video_frames_apart` (Qwen3-VL, whose prompt writes a timestamp before every video frame): each temporal patch of
    a video is a vision item of its own (t = 1), its grid row read one frame per pad run; an image stays one item
    with time offsets 0..t-1 whatever its t, as transformers' get_rope_index places it.
    """
    ids = input_ids.tolist()  # the token ids decide the positions: packers compute these on the host
    image_grids = host_grids(image_grid_thw)
    video_grids = host_grids(video_grid_thw) if video_grid_thw is not None else None
    seconds = torch.as_tensor(second_per_grid_ts if second_per_grid_ts is not None else [], dtype=torch.float32)
    pos = torch.empty(3, len(ids), dtype=torch.long)
    bounds = host_offsets(cu_seqlens)
    image = video = frames_left = 0
    t = h = w = 0
    vision = {image_token_id} | ({video_token_id} if video_token_id is not None else set())
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        cur, i = 0, start
        while i < end:
            if ids[i] not in vision:
                j = i
                while j < end and ids[j] not in vision:
                    j += 1
                pos[:, i:j] = torch.arange(cur, cur + j - i)
                cur += j - i
                i = j
                continue
            is_video = ids[i] != image_token_id
            if is_video and frames_left:  # the next frame of a video whose frames are items of their own
                frames_left -= 1
            elif is_video and video_grids is not None:
                if video >= len(video_grids):
                    raise ValueError("more video-pad runs than videos in video_grid_thw")
                t, h, w = video_grids[video]
            else:
                if image >= len(image_grids):
                    raise ValueError("more vision-pad runs than grids in image_grid_thw")
                t, h, w = image_grids[image]
                image += 1
            if is_video and video_frames_apart:
                if not frames_left:  # a new video: its other frames follow in the next pad runs
                    frames_left = t - 1
                    video += 1
                t = 1
            lh, lw = h // spatial_merge_size, w // spatial_merge_size
            n = t * lh * lw
            if i + n > end:
                raise ValueError(f"a vision item needs {n} pad tokens but its sample ends after {end - i}")
            frames = torch.arange(t)
            if is_video and not video_frames_apart:
                seconds_per_t = seconds[video] if video < len(seconds) else torch.tensor(1.0)
                frames = (frames * (tokens_per_second * seconds_per_t)).long()  # float32, truncated
                video += 1
            pos[0, i : i + n] = frames.repeat_interleave(lh * lw) + cur
            pos[1, i : i + n] = torch.arange(lh).repeat_interleave(lw).repeat(t) + cur
            pos[2, i : i + n] = torch.arange(lw).repeat(t * lh) + cur
            cur += max(lh, lw)
            i += n
    return to_device(pos, input_ids.device)


def pack_layout(config: MindVLConfig, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int],
                image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
                labels: torch.Tensor | None = None) -> PackLayout:
    """The `PackLayout` of a packed row given as tensors: offsets, grids, this model's vision-pad count and (with
    `labels`) its loss-target count. Reads the tensors (a device read when they live on an accelerator): the
    trainer calls it on the host copy of each pack, before the copy to the device."""
    pad_ids = (config.image_token_id, config.video_token_id) if config.vision is not None else ()
    return PackLayout.read(cu_seqlens, image_grid_thw, input_ids if pad_ids else None, pad_ids, labels)


def _deepstack_kw(deepstack) -> dict:
    """The language model takes `deepstack` only when there is some (wrappers of it need not know the argument)."""
    return {} if deepstack is None else {"deepstack": deepstack}


class MindVL(nn.Module):
    def __init__(self, config: MindVLConfig) -> None:
        super().__init__()
        self.config = config
        v = config.vision
        if v is not None and v.family == "qwen3_vl":  # the projector holds the DeepStack mergers too
            self.visual = Qwen3VisionTransformer(v)
            self.projector = LayerNormMerger(v.hidden_size, config.text.hidden_size, v.merge_unit,
                                             deepstack=len(v.deepstack_visual_indexes or []))
        elif v is not None:
            self.visual = VisionTransformer(v)
            self.projector = Projector(v.hidden_size, config.text.hidden_size, v.merge_unit)
        else:
            self.visual, self.projector = None, None
        self.language_model = TextModel(config.text)  # dense or MoE layers, GQA or MLA: text.py's factory
        # (hidden [N, H], output weight [V, H], targets [N], chunk) -> (loss sum, count): where a vocabulary-parallel
        # loss plugs in from outside (mindvl.train.tensor_parallel), as a dispatcher does for expert parallelism
        self.cross_entropy = chunked_cross_entropy

    # ------------------------------------------------------------------------------------------------ set-up

    def set_attention_backend(self, name: str) -> None:
        """`auto`, `sdpa`, `flex`, `flash` or `npu`, for every attention layer of both towers."""
        check_backend_name(name)
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = name

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Seeded random weights: normal linear/embedding weights, zero biases, unit norms (the tiny default)."""
        params = dict(self.named_parameters())
        for name, value in seeded_init_tensors(((n, p.shape) for n, p in params.items()), seed, std):
            params[name].copy_(value)

    # ---------------------------------------------------------------------------------------------- pieces

    def image_features(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """[P, 1176] patch rows + [N, 3] grids (images t=1, videos t>1) -> [P/4, hidden] LLM-width features, in
        order."""
        cfg = self.config.vision
        device = self.language_model.embed_tokens.weight.device
        if pixel_values is None:
            pixel_values = torch.zeros(0, cfg.patch_dim, device=device)
            image_grid_thw = ()
        if image_grid_thw is None:
            raise ValueError("pixel_values given without image_grid_thw")
        return self.vision_features(pixel_values, image_grid_thw)[0]

    def vision_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(features [P/4, hidden], DeepStack features: one [P/4, hidden] per DeepStack block, [] without)."""
        out = self.visual(pixel_values, grid_thw)
        if self.config.vision.family != "qwen3_vl":
            return self.projector(out), []
        hidden, stack = out
        mergers = self.projector.deepstack
        if mergers is None:  # DeepStack off (no indexes, or an ablation)
            return self.projector(hidden), []
        # `stack` is in block order; block b's states go through merger indexes.index(b) (transformers' order,
        # whatever order the indexes are listed in).
        indexes = self.config.vision.deepstack_visual_indexes
        return self.projector(hidden), [mergers[indexes.index(b)](h)
                                        for b, h in zip(sorted(indexes), stack, strict=True)]

    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None) -> torch.Tensor:
        """input_ids [T] -> inputs_embeds [T, hidden] with vision features scattered into the pad slots.

        mindvl's packed form has one stream: `pixel_values`/`image_grid_thw` hold images and videos in order of
        appearance, filling image-pad and video-pad slots in that order. transformers' form passes videos apart
        (`pixel_values_videos` [Pv, 1176], `video_grid_thw` [Nv, 3]); both run through the tower in one call.
        """
        return self.embed_with_deepstack(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                         video_grid_thw)[0]

    def embed_with_deepstack(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None,
                             pixel_values_videos=None, video_grid_thw=None, vision_pads: int | None = None
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]] | None]:
        """`embed`, plus Qwen3-VL's DeepStack input for the language model: (the visual positions [n] int64, one
        [n, hidden] feature per DeepStack block, in those positions' order), or None for a model without it.

        `vision_pads` (host int: the row's image- and video-pad tokens, mindvl's one-stream form) spares counting
        them on the device; `image_grid_thw` may be host ints too."""
        embeds = self.language_model.embed_tokens(input_ids)
        has_videos = pixel_values_videos is not None and pixel_values_videos.numel() > 0
        if self.visual is None:
            if (pixel_values is not None and pixel_values.numel()) or has_videos:
                raise ValueError("this is a text-only model (no vision tower) but pixel_values were given")
            return embeds, None
        is_image = input_ids == self.config.image_token_id
        is_video = input_ids == self.config.video_token_id
        if has_videos:
            if video_grid_thw is None:
                raise ValueError("pixel_values_videos given without video_grid_thw")
            rows = [p for p in (pixel_values, pixel_values_videos) if p is not None and p.numel()]
            grids = [g for g, p in ((image_grid_thw, pixel_values), (video_grid_thw, pixel_values_videos))
                     if p is not None and p.numel()]
            features, stack = self._features(torch.cat(rows), torch.cat([g.reshape(-1, 3) for g in grids]))
            n_video = int(pixel_values_videos.shape[0]) // self.config.vision.merge_unit
            slots = [(is_image, features[: features.shape[0] - n_video], "image"),
                     (is_video, features[features.shape[0] - n_video :], "video")]
        else:
            features, stack = self._features(pixel_values, image_grid_thw)
            slots = [(is_image | is_video, features, "image/video")]
        features = features.to(embeds.dtype)
        counted = vision_pads is not None and not has_videos
        total_pads = 0
        for mask, feats, kind in slots:
            n_pads = vision_pads if counted else int(mask.sum())
            total_pads += n_pads
            if n_pads != feats.shape[0]:
                if kind == "image/video" and not bool(is_video.any()):  # the error path may read the device
                    kind = "image"
                raise ValueError(
                    f"the text has {n_pads} {kind}-pad tokens (ids {self.config.image_token_id}/"
                    f"{self.config.video_token_id}) but the pixels give {feats.shape[0]} features; each image or "
                    "video needs t*h*w/4 pads for its grid_thw"
                )
            if n_pads:
                embeds = embeds.masked_scatter(mask[:, None], feats.to(embeds.dtype))
        deepstack = None
        if stack:
            # Features run in slot order (images, then videos in transformers' form); positions in text order.
            # nonzero_static: the count is known (checked above), so the device need not report it back.
            index = torch.cat([torch.nonzero_static(mask, size=feats.shape[0])[:, 0] for mask, feats, _ in slots])
            order = index.argsort()
            deepstack = (index[order], [f.to(embeds.dtype)[order] for f in stack])
        if total_pads == 0:
            # Keeps the (empty) vision graph attached so every parameter receives a (zero) gradient on every rank.
            return embeds + (features.sum() + sum(f.sum() for f in stack)) * 0.0, None
        return embeds, deepstack

    def _features(self, pixel_values, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if pixel_values is None:
            device = self.language_model.embed_tokens.weight.device
            pixel_values = torch.zeros(0, self.config.vision.patch_dim, device=device)
            grid_thw = ()
        if grid_thw is None:
            raise ValueError("pixel_values given without image_grid_thw")
        return self.vision_features(pixel_values, grid_thw)

    def default_position_ids(self, input_ids, cu_seqlens, image_grid_thw, video_grid_thw=None,
                             second_per_grid_ts=None) -> torch.Tensor:
        """[3, T] M-RoPE positions (see `mrope_position_ids`), or [T] 1-D positions numbering every token of each
        sample, vision pads included: what generation feeds a 1-D RoPE model, so training must use the same."""
        if self.config.uses_mrope:
            merge = self.config.vision.spatial_merge_size if self.config.vision else 2
            # Qwen3-VL writes a timestamp before every video frame, so each frame is its own vision item (t = 1):
            # no temporal offsets, and the text between frames advances the position (an image keeps its t).
            frames_apart = self.config.vision is not None and self.config.vision.family == "qwen3_vl"
            return mrope_position_ids(input_ids, cu_seqlens, image_grid_thw, self.config.image_token_id, merge,
                                      self.config.video_token_id, video_grid_thw, second_per_grid_ts,
                                      self.config.tokens_per_second, frames_apart)
        bounds = host_offsets(cu_seqlens)
        pieces = [torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return to_device(torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long), input_ids.device)

    # --------------------------------------------------------------------------------------------- forward

    def read_layout(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int],
                    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None) -> PackLayout:
        """The `PackLayout` of a packed row given as tensors (see `pack_layout`); reads them."""
        return pack_layout(self.config, input_ids, cu_seqlens, image_grid_thw)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        loss_chunk_size: int = 2048,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        layout: PackLayout | None = None,
    ) -> MindVLOutput | LossOutput:
        """See the module docstring; `layout` (host ints) describes `cu_seqlens` and `image_grid_thw` so that nothing
        is read back from the device (`read_layout` builds one from tensors)."""
        batched = input_ids.dim() == 2
        if batched:
            if input_ids.shape[0] != 1:
                raise ValueError("the [B, T] form takes one sample (B=1); pack several samples with cu_seqlens instead")
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("padding is not supported: pass unpadded samples packed with cu_seqlens")
            input_ids = input_ids[0]
            labels = labels[0] if labels is not None else None
            if position_ids is not None:
                position_ids = position_ids[..., 0, :]  # [3, 1, T] -> [3, T]; [1, T] -> [T]
        total = input_ids.shape[0]
        if layout is None:  # tensors only: read their host values here, once
            layout = self.read_layout(input_ids, cu_seqlens if cu_seqlens is not None else (0, total),
                                      image_grid_thw if pixel_values_videos is None else None)
        if layout.num_tokens != total:
            raise ValueError(f"cu_seqlens ends at {layout.num_tokens} but the row has {total} tokens")
        cu_seqlens = layout.cu_seqlens  # host ints from here on: every layer takes them as they are
        grids = layout.grid_thw if pixel_values_videos is None else image_grid_thw
        # Checks the pad counts against the features first.
        embeds, deepstack = self.embed_with_deepstack(input_ids, pixel_values, grids, pixel_values_videos,
                                                      video_grid_thw, layout.vision_pads)
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids, cu_seqlens, grids, video_grid_thw,
                                                     second_per_grid_ts)
        elif not self.config.uses_mrope and position_ids.dim() == 2:
            # Data pipelines emit M-RoPE rows [3, T]; their row 0 gives every pad of an image one position and
            # compresses the text after it, while generation numbers every token. A 1-D RoPE model trains on the
            # positions it will be served with: each sample's tokens numbered 0, 1, 2, ...
            position_ids = self.default_position_ids(input_ids, cu_seqlens, None)
        hidden = self.language_model(embeds, position_ids, cu_seqlens, layout.max_seqlen, **_deepstack_kw(deepstack))
        if labels is not None:
            targets = next_token_targets(labels, cu_seqlens)
            # the layout's host count of targets lets the loss gather its rows without reading the mask back
            loss_sum, count = self.cross_entropy(hidden, self.language_model.output_weight, targets, loss_chunk_size,
                                                 n_labelled=layout.num_targets)
            return LossOutput(loss_sum, count)
        logits = self.language_model.logits(hidden)
        return MindVLOutput(logits=logits[None] if batched else logits)

    # ------------------------------------------------------------------------------------------- generation

    def new_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `capacity` tokens each (prompt + generated): per-head K/V
        for GQA, latents + rope keys for MLA (TextModel.new_kv_cache)."""
        return self.language_model.new_kv_cache(batch, capacity)

    def prefill(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cache: KVCache,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """B prompts packed in one row: input_ids [T], cu_seqlens [B+1] (images and videos in prompt order, one
        stream; `second_per_grid_ts` [n_videos]) ->
        (logits of each prompt's last token [B, V], each prompt's next text position [B] int64).

        The next position is the prompt's largest position + 1 on every M-RoPE axis: text after an image resumes
        at max + 1 (transformers' rope_deltas), and generated text only ever advances all three axes together.
        """
        embeds, deepstack = self.embed_with_deepstack(input_ids, pixel_values, image_grid_thw)
        position_ids = self.default_position_ids(input_ids, cu_seqlens, image_grid_thw, None, second_per_grid_ts)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        # Only the last token's logits are needed: the last layer runs (most of) its work for those alone.
        hidden = self.language_model(embeds, position_ids, cu_seqlens, int(lengths.max()), cache=cache,
                                     last_only=True, **_deepstack_kw(deepstack))  # [B, H]
        logits = self.language_model.logits(hidden)  # [B, V]
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=input_ids.device), lengths)
        top = position_ids.reshape(-1, position_ids.shape[-1]).amax(0)  # [T]: max over the M-RoPE axes
        next_pos = torch.full_like(lengths, -1).scatter_reduce(0, seq, top, "amax") + 1
        return logits, next_pos

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    layer_call: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """One new token per cached sequence: input_ids [B], positions [B] -> next-token logits [B, V].
        `layer_call`: see TextModel.forward (how the step's layers, rotary tables and final norm run compiled)."""
        embeds = self.language_model.embed_tokens(input_ids)  # generated ids are text, even an image-pad id
        position_ids = positions.expand(3, -1) if self.config.uses_mrope else positions
        hidden = self.language_model(embeds, position_ids, None, 1, cache=cache, layer_call=layer_call)
        return self.language_model.logits(hidden)
