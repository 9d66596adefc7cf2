"""DeepSeek-V3-style language model: Multi-head Latent Attention (MLA) + DeepSeek-MoE, on mindvl's packed layout.

Numerics follow transformers' DeepseekV3ForCausalLM (5.23; shared/reference/model-numerics.md §4):

- MLA: q = q_b(rms(q_a(x))) (or a plain q_proj when q_lora_rank is None); one latent kv_a(x) = [c_kv | k_rot] per
  token, k/v = kv_b(rms(c_kv)) per head, and ONE rotary key k_rot shared by all heads. The rotary part uses the
  interleaved pair layout of the checkpoints when `rope_interleave` (transformers' even/odd formula). The softmax
  scale is (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn rope scaling; the yarn rotary
  frequencies and their cos/sin attention factor are transformers' `_compute_yarn_parameters`. The two latent
  norms use eps 1e-6 whatever `rms_norm_eps` says (transformers' default).
- Routing (fp32): sigmoid scores; `e_score_correction_bias` is added only to CHOOSE experts; groups are scored by
  the sum of their top-2 biased scores, all but `topk_group` groups are masked with -inf (transformers >= 5.8),
  then top-k; the weights are the UNBIASED scores of the chosen experts, optionally normalised to sum 1, times
  `routed_scaling_factor`. Shared experts are one SwiGLU of width moe_intermediate_size * n_shared_experts.
- Layers [0, first_k_dense_replace) use a dense SwiGLU MLP of width intermediate_size.

Layout: one packed row inputs_embeds [T, H] with `cu_seqlens` (samples never attend across boundaries) and positions
restarting per sample ([T], or [3, T] for M-RoPE; a 1-D model given [3, T] uses row 0). `MoETextModel` has
`TextModel`'s interface, so MindVL and the trainer use either; FSDP2 wraps each element of `layers`, so a block's
experts are sharded with it. Routed experts are stored as three [E, ...] tensors (transformers >= 5's in-memory
form; conversion to and from the hub's per-expert tensors lives in mindvl.checkpoint). Because every expert of a
layer is a slice of the same parameter, all expert weights get a gradient (zeros for idle experts) every step, so
FSDP's reduce-scatters stay identical across ranks however the tokens are routed.

Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2): in training mode each router counts the tokens it sends
to every expert (`expert_load`, an int64 non-persistent buffer: not a parameter, not in checkpoints). The trainer
calls `update_router_bias(model, rate, all_reduce)` after each optimizer step: the counts are summed over ranks (the
optional `all_reduce` callable, e.g. `torch.distributed.all_reduce`; the model never imports torch.distributed),
then `bias += rate * sign(mean_load - load)` and the counts reset. The update depends only on the SIGN of each
expert's deviation, so counting every token twice (activation checkpointing re-runs the forward in backward)
changes nothing. The correction bias is kept in float32 however the model is cast, as transformers does.

Tracing: `with record_routing(model) as routers:` makes every router keep, per forward, its top-k expert ids and
routing weights in descending weight order (`router.records`); mindvl.moe_analysis.trace reads them.

Generation: `forward(..., cache=MLACache)` prefills / decodes with a cache of latents and rope keys
(mindvl.models.mla_cache). Experts run as grouped GEMMs (`F.grouped_mm`, or an exact `unbind(0)` fallback where it
cannot run); their `dispatcher` (a no-op here) is where expert parallelism plugs in from outside
(mindvl.train.expert_parallel). Not here: multi-token prediction.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .config import TextConfig
from .layers import GatedMLP, RMSNorm, activation, inverse_frequencies, rotate_half
from .mla_cache import LayerMLA, MLACache

# transformers' DeepseekV3RMSNorm default, used for q_a_layernorm / kv_a_layernorm regardless of rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


# ------------------------------------------------------------------------------------------------------- rotary


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(cfg: TextConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters` over the rotary width: (inv_freq float32 [rope/2], cos/sin factor)."""
    rs, dim, base = cfg.rope_scaling, cfg.qk_rope_head_dim, cfg.rope_theta
    factor = rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"]
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    orig = rs["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def mla_rope_cos_sin(position_ids: torch.Tensor, cfg: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [T] or [3, T] -> cos, sin float32 [T, qk_rope_head_dim] (cat(freqs, freqs), times yarn's factor).

    With `mrope_section`, frequency slot j takes the temporal/height/width position of its section (Qwen2.5-VL's
    M-RoPE, as in layers.rope_cos_sin); without it, [3, T] positions use the temporal row.
    """
    dim = cfg.qk_rope_head_dim
    if cfg.rope_scaling is None:
        inv_freq, factor = inverse_frequencies(dim, cfg.rope_theta, position_ids.device), 1.0
    else:
        inv_freq, factor = yarn_inverse_frequencies(cfg, position_ids.device)
    if position_ids.dim() == 2 and cfg.mrope_section is not None:
        per_axis = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, rope/2]
        chunks = per_axis.split(list(cfg.mrope_section), dim=-1)
        freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    else:
        pos = position_ids[0] if position_ids.dim() == 2 else position_ids
        freqs = pos.float()[:, None] * inv_freq[None, :]  # [T, rope/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] with rotary pairs stored interleaved (x0,x1),(x2,x3)...; cos/sin [T, d] = cat(f, f).

    Output is in the de-interleaved [evens | odds] order, exactly as transformers' apply_rotary_pos_emb_interleave
    (both q and k are permuted the same way, so q.k is unchanged).
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d] already in x's dtype (transformers rotates text in the activation dtype)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


# ------------------------------------------------------------------------------------------------------- MLA


class MLAttention(nn.Module):
    """Multi-head Latent Attention on a packed row: x [T, H] -> [T, H]."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        h, nh, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.num_heads = nh
        self.nope, self.rope, self.v_dim, self.kv_rank = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=bias)
        self.interleaved = bool(cfg.rope_interleave)
        self.scale = qk**-0.5
        rs = cfg.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):  # yarn's softmax temperature (~1.874 for V3)
            self.scale *= _yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
        self.backend = "auto"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor | None,
                max_seqlen: int, kv: LayerMLA | None = None) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(n, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(kv_latent)  # [T, r]: what an MLA cache stores
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary_half
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[:, None, :], cos, sin)  # k_rot: one head, shared
        if kv is not None:
            out = kv.attend_latent(self.kv_b_proj.weight, q_pass, q_rot, latent, k_rot[:, 0], self.v_dim,
                                   self.scale, cu_seqlens, max_seqlen, self.backend)
            return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))
        kv = self.kv_b_proj(latent).view(n, self.num_heads, self.nope + self.v_dim)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_pass, q_rot], dim=-1)  # [T, nh, nope + rope]
        k = torch.cat([k_pass, k_rot.expand(n, self.num_heads, self.rope)], dim=-1)
        out = attend(q, k, v, cu_seqlens, max_seqlen, causal=True, scale=self.scale, backend=self.backend)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))  # out [T, nh, v_dim]


# ------------------------------------------------------------------------------------------------------- MoE


class TopKRouter(nn.Module):
    """Sigmoid router with a selection-only correction bias and group-limited top-k: x [T, H] -> weights, ids [T, k].

    Buffers: `e_score_correction_bias` [E] float32 (persistent: it is part of the model, and of HF checkpoints) and
    `expert_load` [E] int64 (non-persistent: tokens routed to each expert in training forwards since the last
    `update_router_bias`).
    """

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.register_buffer("expert_load", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self.record = False
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids [T, k] int64, weights [T, k] fp32)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) would round the bias (updates of ~1e-3 would vanish): keep it float32, like
        # transformers' _keep_in_fp32_modules_strict. Device moves still apply.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias.is_floating_point() and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, e = x.shape[0], self.num_experts
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E], router in fp32
        choice = scores + self.e_score_correction_bias.float()[None]
        if self.n_group > 1:
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        if self.training:
            with torch.no_grad():
                flat = ids.reshape(-1)
                self.expert_load.index_add_(0, flat, torch.ones_like(flat))
        if self.record:
            with torch.no_grad():
                w, order = weights.detach().sort(dim=-1, descending=True, stable=True)
                self.records.append((ids.gather(1, order), w))
        return weights, ids


def _grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` can run here (else the exact `unbind(0)` fallback is used).

    Its kernels (CPU, and CUDA from sm80 in bf16) need fp32/bf16 operands whose rows are 16-byte aligned (CPU backward
    checks strides), and under FakeTensorMode / torch.compile its meta function accepts bf16 only. Elsewhere (NPU)
    the fallback keeps the cost linear in E.
    """
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type not in ("cpu", "cuda", "meta"):  # e.g. npu: torch_npu has no grouped_mm kernel registered
        return False
    if any(w.dtype != x.dtype or (w.shape[-1] * w.element_size()) % 16 or (w.shape[-2] * w.element_size()) % 16
           for w in weights):
        return False
    if x.device.type == "cuda" and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 8):
        return False
    from torch._subclasses.fake_tensor import is_fake

    if (torch.compiler.is_compiling() or is_fake(x) or x.is_meta) and x.dtype != torch.bfloat16:
        return False
    return True


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None,
                   use_grouped_mm: bool) -> torch.Tensor:
    """Rows of x [N, in] grouped by expert (expert e owns rows offsets[e-1]:offsets[e]) times weight [E, out, in]^T.

    -> [N, out]. One grouped GEMM (`F.grouped_mm`, int32 end offsets), or, where it cannot run, one matmul per
    expert over `weight.unbind(0)`: unbinding once gives every expert a view whose gradient lands in ONE [E, ...]
    buffer (indexing `weight[e]` per expert would allocate and zero-fill a full [E, out, in] gradient per expert).
    """
    if use_grouped_mm:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    assert counts is not None
    parts = [F.linear(chunk, w) for chunk, w in zip(x.split(counts), weight.unbind(0), strict=True)]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


class LocalTokenDispatch:
    """Routes (token, slot) rows to the experts held by this process: all of them (the default, no communication).

    Expert parallelism (mindvl.train.expert_parallel) swaps in a dispatcher with the same three methods that sends
    rows to the ranks owning their experts. The model never imports torch.distributed.
    """

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [N, H] sorted by global expert id, counts [E] int64 -> (rows for the local experts sorted by local
        expert, their per-local-expert counts [E_local])."""
        return rows, counts

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Expert outputs in the order `dispatch` returned -> outputs in the order `dispatch` was given."""
        return out

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The experts parameter as this process holds it -> a plain [E_local, ...] tensor."""
        return weight


class RoutedExperts(nn.Module):
    """E SwiGLU experts as [E, ...] tensors: gate_proj/up_proj [E, I, H], down_proj [E, H, I].

    forward(x [T, H], ids [T, k], weights [T, k] fp32) -> [T, H] in x.dtype. The T*k (token, slot) rows are sorted by
    expert once (stable: token order within an expert), handed to the dispatcher (a no-op on one process, all-to-all
    under expert parallelism), run through one grouped GEMM per projection and scattered back with one index_add.
    No Python loop over experts and no [T, E, ...] tensor. Accumulation follows transformers 5.x (each row's output is
    weighted in fp32, then cast to x.dtype before it is added).
    """

    def __init__(self, num_experts: int, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts  # global E (under expert parallelism this process holds a slice)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.act = activation(act)
        self.dispatcher: LocalTokenDispatch = LocalTokenDispatch()
        self.use_grouped_mm = True  # False forces the unbind fallback (benchmarks, tests)

    def experts_forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [N, H] grouped by (local) expert with counts [E_local] -> SwiGLU outputs [N, H]."""
        d = self.dispatcher
        gate, up, down = d.local_weight(self.gate_proj), d.local_weight(self.up_proj), d.local_weight(self.down_proj)
        grouped = self.use_grouped_mm and _grouped_mm_runs(rows, gate, up, down)
        offsets = counts.cumsum(0).to(torch.int32)
        split = None if grouped else counts.tolist()
        h = self.act(grouped_linear(rows, gate, offsets, split, grouped)) * grouped_linear(rows, up, offsets, split,
                                                                                           grouped)
        return grouped_linear(h, down, offsets, split, grouped)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) rows grouped by expert
        # [E] int64; a fixed-size scatter, not bincount (whose output size depends on the data), made from `flat` so
        # that it is a fake tensor exactly when the routing is (the planner's fake tensors)
        counts = flat.new_zeros(self.num_experts).index_add_(0, flat, torch.ones_like(flat))
        tokens, slot_weights = order // k, weights.reshape(-1)[order]
        rows, local_counts = self.dispatcher.dispatch(x[tokens], counts)
        y = self.dispatcher.combine(self.experts_forward(rows, local_counts))
        return torch.zeros_like(x).index_add_(0, tokens, (y * slot_weights[:, None]).to(x.dtype))


class MoE(nn.Module):
    """Routed experts + shared experts: x [T, H] -> [T, H]."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, bias=False, act=cfg.hidden_act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_idx < cfg.first_k_dense_replace:
            self.mlp: nn.Module = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False, act=cfg.hidden_act)
        else:
            self.mlp = MoE(cfg)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerMLA | None = None):  # x [T, H]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETextModel(nn.Module):
    """Embedding, MLA/MoE decoder layers, final norm and output projection; TextModel's interface."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        if not cfg.is_moe:
            raise ValueError(f"MoETextModel needs family 'deepseek_v3', not {cfg.family!r}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H]: the lm_head weight, or the embedding matrix when the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
        max_seqlen: int, cache: MLACache | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [T, H], position_ids [T] or [3, T] -> final hidden states [T, H] (after the last norm).

        With `cache` (an MLACache): an empty cache takes a prefill (T packed prompt tokens, cu_seqlens [B+1]); a
        filled one takes a decode step (T = B, one token per sequence, cu_seqlens unused), as TextModel.
        """
        cos, sin = mla_rope_cos_sin(position_ids, self.cfg)
        cos, sin = cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)  # transformers rotates in x.dtype
        x = inputs_embeds
        if cache is None:
            for layer in self.layers:
                x = layer(x, cos, sin, cu_seqlens, max_seqlen)
            return self.norm(x)
        if not isinstance(cache, MLACache) or len(cache.keys) != len(self.layers):
            raise ValueError(f"MoETextModel needs an MLACache of {len(self.layers)} layers (model.new_kv_cache)")
        cache.begin(x.shape[0], cu_seqlens, x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cu_seqlens, max_seqlen, LayerMLA(cache, i))
        cache.commit()
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.output_weight.T


# ------------------------------------------------------------------------------------------ balancing, tracing


def routers(model: nn.Module) -> list[TopKRouter]:
    """Every router of `model`, in layer order."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@torch.no_grad()
def update_router_bias(model: nn.Module, rate: float,
                       all_reduce: Callable[[torch.Tensor], object] | None = None) -> float:
    """DeepSeek-V3's auxiliary-loss-free balancing step: bias += rate * sign(mean_load - load), then reset counts.

    `all_reduce(t)` sums a tensor over data-parallel ranks in place (or returns the sum), e.g.
    `torch.distributed.all_reduce`; every rank then applies the same update, so the biases stay identical. All
    layers' counts travel in one call. Returns the largest relative overload max_l (max_e load / mean_load - 1)
    over the MoE layers (DeepSeek's MaxVio, 0.0 without routers or tokens), for logging.
    """
    rs = routers(model)
    if not rs:
        return 0.0
    loads = torch.stack([r.expert_load for r in rs])  # [L, E] int64
    if all_reduce is not None:
        summed = all_reduce(loads)
        loads = summed if isinstance(summed, torch.Tensor) else loads
    loads = loads.float()
    mean = loads.mean(-1, keepdim=True)
    for router, load, m in zip(rs, loads, mean, strict=True):
        router.e_score_correction_bias += rate * torch.sign(m - load).to(router.e_score_correction_bias.device)
        router.expert_load.zero_()
    busy = mean.squeeze(-1) > 0
    if not bool(busy.any()):
        return 0.0
    return float((loads.amax(-1)[busy] / mean.squeeze(-1)[busy] - 1).max())


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[TopKRouter]]:
    """Within the block, every router appends (ids [T, k], weights [T, k]) per forward to `router.records`, in
    descending routing-weight order (ties keep transformers' top-k slot order). Records are cleared on entry."""
    rs = routers(model)
    for r in rs:
        r.record, r.records = True, []
    try:
        yield rs
    finally:
        for r in rs:
            r.record = False
