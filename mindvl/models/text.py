"""The decoder LLM: one `TextModel` whose layers come from a per-layer factory (attention kind x MLP kind).

Families: Qwen3 (GQA with q/k RMSNorm, no bias, explicit head_dim) and Qwen2 (GQA with qkv bias; Qwen2.5-VL's LLM),
dense MLPs; DeepSeek-V3 (Multi-head Latent Attention, mla.py; DeepSeek-MoE MLPs after the first
`first_k_dense_replace` dense layers, moe.py); Qwen3.5 (hybrid: Gated DeltaNet linear attention,
linear_attention.py, in the layers `layer_types` names, gated full attention, gated_attention.py, in the others).
Every layer is `input_layernorm -> self_attn -> residual -> post_attention_layernorm -> mlp -> residual` (Qwen3.5's
linear layers name their mixer `linear_attn`) under the same module names in every family, so state_dict keys
(`layers.{i}.self_attn.*`, `layers.{i}.mlp.*`) follow the HF checkpoints' module names (checkpoint/hf_keys.py maps
them) and FSDP/EP code sees one layer type. A new
family adds an attention class (the interface: `rotary`, `cache_class`, `forward(x, cos, sin, cu_seqlens,
max_seqlen, kv, rows)`) or an MLP to `attention_class` / `mlp_for`; prefill, caches and the loop are written once.

Works on ONE packed row: inputs_embeds [T, H] holding several samples separated by cu_seqlens; attention is causal
within a sample and never crosses samples. Positions come from the caller (restarting per sample): [T] for 1-D RoPE
or [3, T] for M-RoPE (a 1-D model given [3, T] uses row 0).

Generation passes the cache made by `new_kv_cache` (B independent sequences; kv_cache.py for GQA's per-head K/V,
mla_cache.py for MLA's latents): the prefill is the same packed row of B prompts (the same varlen attention as
training, so its numerics are the full forward's) and also stores every token's K/V; each decode step then takes
one token per sequence ([B, H]) and attends over that sequence's cached keys with a key mask. Without a cache the
training path is unchanged.

Generation needs only each prompt's last hidden state, so a prefill may ask for just those (`last_only`): every
layer still computes keys and values for every token (the cache needs them), but a dense last layer runs the rest
for B rows instead of T: GQA its queries, attention output, o_proj and MLP; MLA (which still attends every query,
see MLAttention) its o_proj and MLP. transformers computes the whole last layer and keeps only the last logits;
skipping it removes almost 1/num_layers of the language model's prefill work, and the B kept rows go through the
same ops on fewer rows. A MoE last layer runs whole (see DecoderLayer: grouped GEMMs on fewer rows round
differently), so the rows are taken at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .attention import attend
from .config import TextConfig
from .gated_attention import GatedAttention
from .host import as_segments
from .kv_cache import KVCache, LayerKV, store
from .layers import GatedMLP, OffsetRMSNorm, RMSNorm, apply_rotary, rope_cos_sin, split_linear
from .linear_attention import GatedDeltaNet
from .mla import MLAttention
from .moe import MoE


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE (Qwen3: q/k RMSNorm; Qwen2: qkv bias): x [T, H] -> [T, H]."""

    @staticmethod
    def rotary(position_ids: torch.Tensor, cfg: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    cache_class = KVCache  # per-head keys and values
    # q/k/v as one matmul in a cached forward without `rows` (a decode step): None unless
    # mindvl.infer.fused_projections attached it for a generation (layers.split_linear).
    fused_qkv: tuple | None = None
    # The varlen attention core; parallelism applied from outside may replace it per instance (context parallelism:
    # mindvl.train.context_parallel swaps in an all-to-all over heads around it).
    attend = staticmethod(attend)

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = "auto"

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV | None = None,
                rows: torch.Tensor | None = None):
        """x [T, H] -> [T, H]; with `rows` [B] (each cached sequence's last token, prefill only) -> [B, H]: keys and
        values for all T tokens go into the cache, queries only for those rows."""
        # A decode step's K/V slots, asked for first (a compile boundary: a compiled layer's graph resumes after it,
        # so the writes below fuse with the rotation; kv_cache.LayerKV).
        target = kv.decode_target() if kv is not None and rows is None else None
        xq, cos_q, sin_q = (x, cos, sin) if rows is None else (x[rows], cos[rows], sin[rows])
        # Head counts come from the projections' widths, not the config: a tensor-parallel rank (applied from
        # outside, mindvl.train.tensor_parallel) holds num_heads / tp query heads and num_kv_heads / tp KV heads.
        if self.fused_qkv is not None and kv is not None and rows is None:
            q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in split_linear(x, self.fused_qkv))
        else:
            q = self.q_proj(xq).unflatten(-1, (-1, self.head_dim))
            k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
            v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:  # Qwen3 normalises per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos, sin)
        if kv is None:
            out = self.attend(q, k, v, cu_seqlens, max_seqlen, causal=True, backend=self.backend)
        else:
            if target is not None:
                store(target, k, v)
            out = kv.attend(q, k, v, cu_seqlens, max_seqlen, self.backend, last_only=rows is not None,
                            stored=target is not None)
        return self.o_proj(out.flatten(1))


# --------------------------------------------------------------------------------------------- layer factory


def attention_class(cfg: TextConfig) -> type[GQAttention] | type[MLAttention] | type[GatedAttention]:
    """The (full) attention of this family: MLA for DeepSeek-V3, gated GQA for Qwen3.5 (whose other layers are
    linear attention, see DecoderLayer), GQA (RoPE) for the other Qwen families. Its `rotary` and `cache_class`
    serve the whole model."""
    if cfg.is_moe:
        return MLAttention
    return GatedAttention if cfg.is_hybrid else GQAttention


def norm_class(cfg: TextConfig) -> type[RMSNorm] | type[OffsetRMSNorm]:
    """Qwen3.5's norms store their weight as the offset from 1 (and multiply in float32)."""
    return OffsetRMSNorm if cfg.is_hybrid else RMSNorm


def mlp_for(cfg: TextConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: DeepSeek-MoE from layer `first_k_dense_replace` on, else a dense SwiGLU."""
    if cfg.has_experts and layer_idx >= cfg.first_k_dense_replace:
        return MoE(cfg)  # DeepSeek-MoE, or Qwen3-MoE's softmax routing (moe.py picks the router)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False, act=cfg.hidden_act)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); attention and MLP come from the factory.

    The token mixer is `self_attn`, or `linear_attn` (Gated DeltaNet, same call signature) for Qwen3.5's
    linear-attention layers: transformers' module names, so checkpoint keys map by renaming alone."""

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        norm = norm_class(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.layer_kind(layer_idx) == "linear_attention":
            self.token_mixer = "linear_attn"
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.token_mixer = "self_attn"
            self.self_attn = attention_class(cfg)(cfg)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_for(cfg, layer_idx)
        # Where `rows` narrows the work: inside the attention, unless the MLP is a MoE, whose grouped GEMMs round
        # differently when each expert gets fewer rows; a MoE layer runs whole and keeps the rows at its end, so a
        # MoE model's prefill logits stay bit-equal to its full forward's.
        self.narrow_in_attention = not isinstance(self.mlp, MoE)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV | None = None,
                rows: torch.Tensor | None = None):
        """x [T, H] -> [T, H], or [B, H] for the given `rows` (see the attention classes)."""
        early = rows if self.narrow_in_attention else None
        mixer = getattr(self, self.token_mixer)
        attn = mixer(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, kv, early)
        x = (x if early is None else x[early]) + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x if rows is None or early is not None else x[rows]

    def decode_forward(self, x, pending, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV):
        """A decode step's layer with its last residual add left to the next one: x [B, H] and `pending` (the
        previous layer's MLP output [B, H], or None for the first layer) -> (h, mlp_out), this layer's output being
        h + mlp_out. The same ops as `forward`, in the same order; compiled (mindvl.infer.decode_compile), each add
        then shares the kernel of the norm that reads it: one kernel per layer fewer."""
        if pending is not None:
            x = x + pending
        mixer = getattr(self, self.token_mixer)
        h = x + mixer(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, kv, None)
        return h, self.mlp(self.post_attention_layernorm(h))


# ------------------------------------------------------------------------------------------------------- model


class TextModel(nn.Module):
    """Embedding, decoder layers, final norm and the output projection (absent when tied to the embedding)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = norm_class(cfg)(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H]: the lm_head weight, or the embedding matrix when the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache of the kind this model's attention writes, for `batch` sequences of `capacity` tokens."""
        return attention_class(self.cfg).cache_class(len(self.layers), batch, capacity)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | Sequence[int] | None,
        max_seqlen: int,
        cache: KVCache | None = None,
        last_only: bool = False,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
        layer_call: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [T, H], position_ids [T] or [3, T] -> final hidden states [T, H] (after the last norm).

        `cu_seqlens`: the samples' offsets, best as host ints (MindVL.forward passes its PackLayout's), which every
        layer hands to the attention as they are: nothing is read back from the device.

        With `cache` (from `new_kv_cache`): an empty cache takes a prefill (T packed prompt tokens, cu_seqlens
        [B+1]); a filled one takes a decode step (T = B, one token per sequence, cu_seqlens unused). `last_only` (a
        prefill) returns only each prompt's last hidden state [B, H] and skips most of the rest of the last layer's
        work (see the module docstring).

        `deepstack` (Qwen3-VL): (visual positions [n] int64, features [[n, H], ...]); feature l is added to the
        hidden states at those positions after layer l, as transformers' Qwen3VLTextModel does.

        `layer_call(fn, *args)` runs pieces of the forward in place of `fn(*args)`: the rotary tables, and with a
        cache each decoder layer (`layer(x, cos, sin, cu_seqlens, max_seqlen, kv, rows)`; in a decode step
        `layer.decode_forward`, each residual add left to the next layer's norm) and the final norm. It is how the
        decode step runs them compiled (mindvl.infer.decode_compile) without the model knowing of it.
        """
        run = layer_call or _call
        cos, sin = run(self.rotary_tables, position_ids, inputs_embeds.dtype)
        x = inputs_embeds
        index, extra = deepstack if deepstack is not None else (None, [])
        if cache is None:
            # One opaque object for every layer: compiled layers are guarded on its type, not on the offsets
            # (host.Segments); `attend` takes the longest segment from it.
            segments = as_segments(cu_seqlens)
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, segments, None if segments is not None else max_seqlen)
                if i < len(extra):
                    x = x.index_add(0, index, extra[i].to(x.dtype))
            return self.norm(x)
        expected = attention_class(self.cfg).cache_class
        if type(cache) is not expected or len(cache.keys) != len(self.layers):
            raise ValueError(f"this model needs a {expected.__name__} of {len(self.layers)} layers "
                             f"(model.new_kv_cache), got a {type(cache).__name__} of {len(cache.keys)}")
        if last_only and (cu_seqlens is None or cache.filled):
            raise ValueError("last_only applies to a prefill into an empty cache (with cu_seqlens)")
        cache.begin(x.shape[0], cu_seqlens, x.device)
        if layer_call is not None and cache.filled and not last_only and not extra:
            # A compiled decode step: each residual add joins the next norm's kernel (DecoderLayer.decode_forward).
            pending = None
            for i, layer in enumerate(self.layers):
                x, pending = run(layer.decode_forward, x, pending, cos, sin, cu_seqlens, max_seqlen, LayerKV(cache, i))
            cache.commit()
            return run(residual_norm, self.norm, x, pending)
        last = len(self.layers) - 1
        rows = cu_seqlens[1:].long() - 1 if last_only else None  # [B]: each prompt's last token
        narrow_last = rows is not None and len(extra) <= last  # DeepStack into the last layer needs all its rows
        for i, layer in enumerate(self.layers):
            x = run(layer, x, cos, sin, cu_seqlens, max_seqlen, LayerKV(cache, i), rows if i == last and narrow_last
                    else None)
            if i < len(extra):
                x = x.index_add(0, index, extra[i].to(x.dtype))
        if rows is not None and not narrow_last:
            x = x[rows]
        cache.commit()
        return run(self.norm, x)

    def rotary_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [T] or [3, T] -> cos, sin [T, rotary dim] in `dtype` (transformers rotates text in x.dtype)."""
        cos, sin = attention_class(self.cfg).rotary(position_ids, self.cfg)
        return cos.to(dtype), sin.to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.output_weight.T


def _call(fn, *args):
    return fn(*args)


def residual_norm(norm: nn.Module, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """The last layer's output (x + its MLP's, DecoderLayer.decode_forward) through the final norm."""
    return norm(x + pending)
