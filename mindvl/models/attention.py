"""One variable-length attention interface over several backends.

    attend(q, k, v, cu_seqlens, max_seqlen, causal, window=None, scale=None, backend="auto") -> out

q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] hold several sequences concatenated along T; `cu_seqlens` ([n+1],
starts at 0, ends at T) marks them. Attention never crosses a boundary. Hq must be a multiple of Hkv (GQA).
`window` (causal only) limits each query to itself and the `window` tokens before it. Returns [T, Hq, Dv].

`cu_seqlens` is best given as host ints (a tuple: the trainer's `PackLayout.cu_seqlens`, or the `Segments` the model
hands its compiled blocks, whose `max_seqlen` is then taken when `max_seqlen` is None): every backend then works
from host values and reads nothing back from the device. A tensor is accepted too (tests, generation) and read once
per call.

Backends
- `sdpa`:  torch's scaled_dot_product_attention on any device. Sequences of equal length run as one batch with no
           mask (the vision tower's 64-patch windows; the fused kernel stays available); short sequences share
           power-of-two buckets padded to their longest member with a key mask. Memory is O(T * max_seqlen), never
           a dense T x T mask. Many calls per row: right for CPU and for rows of one sequence.
- `flex`:  FlexAttention (compiled on accelerators; forward-only on CPU, where torch has no FlexAttention
           backward) with a block mask built on the host from the offsets alone (which 128 x 128 blocks are empty,
           partly masked or full) and cached keyed on those host values: no device read, one kernel per call.
- `flash`: flash-attn's varlen kernel (CUDA, fp16/bf16), when the package is installed.
- `npu`:   torch_npu's fused attention in the TND layout with actual sequence lengths (Ascend), when installed.
`auto` picks `npu` on Ascend; on CUDA `flash` when importable and the dtype allows it, else `flex` for a packed row
(more than one sequence, or a window) and `sdpa` for one plain sequence; `sdpa` on CPU. It never takes sdpa's
per-sequence loop for a packed row on an accelerator.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .host import Segments, host_offsets, longest_segment, to_device

BACKENDS = ("auto", "sdpa", "flex", "flash", "npu")
_ENV_OVERRIDE = "MINDVL_ATTN_BACKEND"


def check_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


@functools.cache
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on `device` in this environment (used by tests and benchmarks)."""
    kind = torch.device(device).type
    names = ["sdpa", "flex"]
    if kind == "cuda" and _importable("flash_attn"):
        names.append("flash")
    if kind == "npu" and _importable("torch_npu"):
        names.append("npu")
    return names


def resolve_backend(name: str, q: torch.Tensor, packed: bool = True) -> str:
    """Turn `auto` (or the MINDVL_ATTN_BACKEND environment override) into a concrete backend for this call.

    `packed`: the row holds more than one sequence or attends within a window, so sdpa would loop over pieces."""
    name = os.environ.get(_ENV_OVERRIDE, name) if name == "auto" else name
    check_backend_name(name)
    if name != "auto":
        return name
    if q.device.type == "npu" and _importable("torch_npu"):
        return "npu"
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and _importable("flash_attn"):
            return "flash"
        return "flex" if packed else "sdpa"
    return "sdpa"


# A compile boundary: under a compiled block (train.parallel's per-block compile) the host offsets never enter the
# block's graph, so a new pack's offsets cost no recompile (dynamo would guard on every int); flex is compiled on
# its own (`_compiled_flex`) and flash/npu are opaque kernels anyway.
@torch.compiler.disable
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int] | Segments,
    max_seqlen: int | None,
    causal: bool,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attend expects [T, heads, dim] tensors, got q{tuple(q.shape)} k{tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if window is not None and not causal:
        raise ValueError("a sliding window is only defined for causal attention")
    if q.shape[0] == 0:
        # Zero tokens (a micro-batch without images): stay attached to q/k/v so every weight gets a zero gradient.
        return q.new_zeros(0, q.shape[1], v.shape[2]) + (q.sum() + k.sum() + v.sum()) * 0
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    offsets = host_offsets(cu_seqlens)
    if max_seqlen is None:  # compiled blocks pass Segments and no int (one guard fewer): from the host offsets
        max_seqlen = longest_segment(offsets)
    packed = len(offsets) > 2 or window is not None
    impl = {"sdpa": _sdpa, "flex": _flex, "flash": _flash, "npu": _npu}[resolve_backend(backend, q, packed)]
    return impl(q, k, v, offsets, int(max_seqlen), causal, window, scale)


# ---------------------------------------------------------------------------------------------------------- sdpa


_SHORT = 128
# A bucket of equal-length sequences in at most this many consecutive runs is attended run by run on views of the
# row (ViT windows of one image, a batch of equal prompts); more runs are gathered into one call.
_MAX_RUNS = 8


def _sdpa(q, k, v, offsets, max_seqlen, causal, window, scale):
    total, hq, _ = q.shape
    starts = list(offsets[:-1])
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    if len(lengths) == 1 and window is None:  # one sequence: no gather, no mask
        out = _sdpa_call(q[None], k[None], v[None], None, causal, scale)
        return out[0]

    # Sequences of one exact length batch together with no mask, so sdpa keeps its fused (flash) kernel; only
    # short ones (<= _SHORT) share power-of-two buckets with a padding mask, so many tiny samples stay few calls.
    buckets: dict[tuple[str, int], list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            key = ("pow2", (n - 1).bit_length()) if n <= _SHORT and window is None else ("exact", n)
            buckets.setdefault(key, []).append(i)

    out = None  # [T, Hq, Dv], when some bucket is written in place
    out_rows, out_index = [], []
    for (kind, n), members in buckets.items():
        runs = _consecutive_runs(members, starts, n) if kind == "exact" and window is None else None
        if runs is not None and len(runs) <= _MAX_RUNS:
            # Equal-length sequences that follow each other in the row are a [B, n] view: no gather, no scatter.
            if out is None:
                out = q.new_empty(total, hq, v.shape[-1])
            for first, count in runs:
                a, b = first, first + count * n
                ob = _sdpa_call(q[a:b].unflatten(0, (count, n)), k[a:b].unflatten(0, (count, n)),
                                v[a:b].unflatten(0, (count, n)), None, causal, scale)
                out[a:b] = ob.flatten(0, 1)
            continue
        seg_len = [lengths[i] for i in members]
        width = max(seg_len)
        # The gather plan is built on the host from the lengths, so no shape depends on device data.
        seg_start, seg_n = torch.tensor([starts[i] for i in members]), torch.tensor(seg_len)
        host_offs = torch.arange(width)
        host_valid = host_offs[None, :] < seg_n[:, None]  # [B, L]
        # Padded slots read token 0 of their own sequence: finite values, masked out as keys, discarded as queries.
        host_gather = seg_start[:, None] + torch.where(host_valid, host_offs[None, :], 0)  # [B, L]
        kept = host_valid.flatten().nonzero()[:, 0]  # the real tokens among the B * L slots
        gather, valid = to_device(host_gather, q.device), to_device(host_valid, q.device)
        offs = torch.arange(width, device=q.device)
        qb, kb, vb = q[gather], k[gather], v[gather]  # [B, L, H, D]
        mask = None
        if window is not None or min(seg_len) != width:
            mask = valid[:, None, None, :].expand(-1, 1, width, width)  # key must exist
            if causal:
                mask = mask & (offs[None, :] <= offs[:, None])[None, None]
            if window is not None:
                mask = mask & (offs[:, None] - offs[None, :] <= window)[None, None]
            # A padded query row may be fully masked (with a window); let it see key 0 so softmax stays finite.
            mask = mask | ((~valid)[:, None, :, None] & (offs == 0)[None, None, None, :])
        ob = _sdpa_call(qb, kb, vb, mask, causal and mask is None, scale)  # [B, L, Hq, Dv]
        out_rows.append(ob.flatten(0, 1).index_select(0, to_device(kept, q.device)))
        out_index.append(host_gather.flatten()[kept])
    if not out_rows:
        return out
    rows, index = torch.cat(out_rows), to_device(torch.cat(out_index), q.device)
    if out is None:
        return rows.new_empty(total, hq, rows.shape[-1]).index_copy(0, index, rows)
    return out.index_copy_(0, index, rows)


def _consecutive_runs(members: list[int], starts: list[int], n: int) -> list[tuple[int, int]]:
    """Maximal runs of sequences of length n that follow each other in the row: [(first token, count)]."""
    runs: list[tuple[int, int]] = []
    for i in members:
        if runs and runs[-1][0] + runs[-1][1] * n == starts[i]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((starts[i], 1))
    return runs


def _sdpa_call(q, k, v, mask, is_causal, scale):
    """q [B, L, Hq, D] (and k/v [B, L, Hkv, D]) -> [B, L, Hq, Dv]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------- flex


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


# The layers of a forward share a few offsets (vision windows, vision frames, text samples), so recent block masks
# are reused instead of rebuilt per layer, keyed on the host offsets; the oldest is dropped beyond _FLEX_CACHE_SIZE.
_FLEX_MASK_CACHE: dict = {}
_FLEX_CACHE_SIZE = 8
_FLEX_BLOCK = 128  # FlexAttention's default block size (queries and keys)


def _flex_block_mask(offsets: tuple[int, ...], causal: bool, window: int | None, device: torch.device):
    """The BlockMask of a packed row, from host offsets alone (cached on them): nothing is read from the device."""
    key = (offsets, causal, window, str(device))
    if key not in _FLEX_MASK_CACHE:
        if len(_FLEX_MASK_CACHE) >= _FLEX_CACHE_SIZE:
            _FLEX_MASK_CACHE.pop(next(iter(_FLEX_MASK_CACHE)))
        _FLEX_MASK_CACHE[key] = _document_block_mask(offsets, causal, window, device)
    return _FLEX_MASK_CACHE[key]


def document_block_tables(offsets: Sequence[int], causal: bool, window: int | None = None, block: int = _FLEX_BLOCK
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) pairs of a packed row hold some allowed pair (`partial`, bool [nq, nk]) and
    which hold only allowed pairs (`full`), computed on the host from the offsets (what `create_block_mask` finds
    by evaluating the mask on the device). Blocks that run past T are never full (their padding is masked)."""
    total = offsets[-1]
    n = -(-total // block)
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
    start = torch.arange(n) * block  # first token of each block
    end = torch.clamp(start + block, max=total) - 1  # last real token
    first, last = seq_id[start], seq_id[end]  # each block covers the samples first..last, all of them non-empty
    # Two blocks share a sample exactly when their sample ranges overlap.
    partial = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    one = (first == last) & (end - start + 1 == block)  # complete blocks inside one sample
    full = one[:, None] & one[None, :] & (first[:, None] == first[None, :])
    if causal:
        partial &= start[None, :] <= end[:, None]  # some key at or before some query
        full &= end[None, :] <= start[:, None]  # every key at or before every query
    if window is not None:
        partial &= end[None, :] >= start[:, None] - window  # some key within the window of some query
        full &= end[:, None] - start[None, :] <= window  # every key within every query's window
    return partial, full


def _kv_tables(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [nq, nk] -> (kv_num_blocks [1, 1, nq], kv_indices [1, 1, nq, nk]) int32: each row's blocks first."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def _document_block_mask(offsets: tuple[int, ...], causal: bool, window: int | None, device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = document_block_tables(offsets, causal, window)
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    seq_id = to_device(torch.repeat_interleave(torch.arange(len(lengths)), lengths), device)  # [T]

    def mask_mod(b, h, qi, ki):
        keep = seq_id[qi] == seq_id[ki]
        if causal:
            keep = keep & (qi >= ki)
        if window is not None:
            keep = keep & (qi - ki <= window)
        return keep

    tables = (*_kv_tables(partial & ~full), *_kv_tables(full))
    tables = [to_device(t, device) for t in tables]
    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(offsets[-1], offsets[-1]))


def _flex(q, k, v, offsets, max_seqlen, causal, window, scale):
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _flex_block_mask(offsets, causal, window, q.device)
    fn = flex_attention if q.device.type == "cpu" else _compiled_flex()
    out = fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


# --------------------------------------------------------------------------------------------------------- flash

_DEVICE_OFFSETS: dict = {}


def _device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [n+1] offsets on the device, copied once per distinct row (the layers of a forward share them)."""
    key = (offsets, str(device))
    if key not in _DEVICE_OFFSETS:
        if len(_DEVICE_OFFSETS) >= _FLEX_CACHE_SIZE:
            _DEVICE_OFFSETS.pop(next(iter(_DEVICE_OFFSETS)))
        _DEVICE_OFFSETS[key] = to_device(torch.tensor(offsets, dtype=torch.int32), device)
    return _DEVICE_OFFSETS[key]


def _flash(q, k, v, offsets, max_seqlen, causal, window, scale):
    from flash_attn import flash_attn_varlen_func  # optional dependency, checked by resolve_backend/auto

    dv = v.shape[-1]
    if dv != q.shape[-1]:  # e.g. MLA: the kernel wants one head size, so pad V and slice the output
        v = F.pad(v, (0, q.shape[-1] - dv))
    cu = _device_offsets(offsets, q.device)
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, max_seqlen, max_seqlen,
        softmax_scale=scale, causal=causal, window_size=(window, 0) if window is not None else (-1, -1),
    )
    return out[..., :dv]


# ----------------------------------------------------------------------------------------------------------- npu

_NPU_CAUSAL_MASK: dict[torch.device, torch.Tensor] = {}


def _npu(q, k, v, offsets, max_seqlen, causal, window, scale):
    import torch_npu  # optional dependency (Ascend), checked by resolve_backend/auto

    dv = v.shape[-1]
    if dv != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    ends = list(offsets[1:])  # TND layout wants cumulative end offsets as host ints
    kwargs = {}
    if causal:
        # The fused kernel takes a compressed 2048 x 2048 upper-triangular mask (the paper's "mask compression"):
        # sparse_mode 3 = causal, 4 = causal band of `window` tokens.
        if q.device not in _NPU_CAUSAL_MASK:
            _NPU_CAUSAL_MASK[q.device] = torch.ones(2048, 2048, dtype=torch.bool, device=q.device).triu(1)
        kwargs["atten_mask"] = _NPU_CAUSAL_MASK[q.device]
        kwargs["sparse_mode"] = 3 if window is None else 4
        if window is not None:
            kwargs["pre_tockens"], kwargs["next_tockens"] = window, 0
    out = torch_npu.npu_fusion_attention(
        q, k, v, q.shape[1], "TND", scale=scale, actual_seq_qlen=ends, actual_seq_kvlen=ends, **kwargs
    )[0]
    return out[..., :dv]
