"""The gated delta rule and the short causal convolution of Qwen3.5's linear-attention layers, on packed rows.

Plain PyTorch, no kernels. Every function takes a packed row (several samples concatenated along T, marked by
`cu_seqlens` int32 [n+1]) and never lets one sample see another: the convolution's window and the recurrent state
both start from zero (or from a given per-sample state) at every sample boundary.

The recurrence (per value head; S is a [dk, dv] state, q and k are L2-normalised, q is scaled by dk^-1/2):

    S <- exp(g_t) * S                          (decay, g_t <= 0)
    u_t = beta_t * (v_t - S^T k_t)             (delta rule: write only what S does not already predict)
    S <- S + k_t u_t^T
    o_t = S^T q_t

`gated_delta_rule` computes it chunk by chunk (C tokens at a time, the form of the Gated DeltaNet paper): within a
chunk, with Gamma_i = exp(g_1 + ... + g_i) and S0 the state at the chunk start,

    u_i + sum_{j<i} beta_i (k_i . k_j) Gamma_i/Gamma_j u_j = beta_i v_i - beta_i Gamma_i S0^T k_i

is a unit lower-triangular system (I + L) U = beta V - diag(beta Gamma) K S0, solved once per chunk for its two
right-hand sides; then O = diag(Gamma) Q S0 + (QK^T * M) U with M_ij = Gamma_i/Gamma_j for j <= i, and the state
after the chunk is Gamma_C S0 + (K * Gamma_C/Gamma)^T U. Only the chunk-to-chunk step is sequential, and it runs
for all samples at once: step j advances the j-th chunk of every sample that has one. Each sample is padded to a
multiple of C with k = v = q = beta = g = 0, which leaves its state unchanged, so the final state is exact. The
chunks are stored step by step (samples with more chunks first), so each step works on contiguous slices.

`gated_delta_step` is the one-token recurrence (decoding); `causal_conv1d` / `causal_conv1d_step` the depthwise
convolution (kernel K over the previous K-1 inputs of the same sample, then SiLU).

transformers 5.23's torch fallbacks (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`) accept `cu_seqlens` but
ignore it: on a packed row they carry the state and the convolution window across samples. Only fla's kernels
honour it there. So packed rows are tested here against each sample run alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .host import Segments, host_offsets, to_device


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and transformers' form: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def sample_index(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample id [T], position inside its sample [T]) for a packed row."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=total)
    return seq, torch.arange(total, device=cu.device) - cu[:-1][seq]


# ------------------------------------------------------------------------------------------------- convolution


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution then SiLU, reset at every sample start: x [T, C], weight [C, K] -> [T, C].

    y_t = silu(sum_{j<K} weight[:, K-1-j] * x_{t-j}), where inputs before the sample's first token count as zero.
    Written as K shifted multiply-adds (K is 4 in Qwen3.5): each shift is masked where it would reach into the
    previous sample. The sum accumulates in float32 (as a conv kernel does), then, as in transformers, it is rounded
    to the weight's dtype, activated there, and returned in x's.
    """
    k = weight.shape[1]
    _, pos = sample_index(cu_seqlens, x.shape[0])
    xf, wf = x.float(), weight.float()
    y = xf * wf[:, k - 1]
    for j in range(1, k):
        shifted = F.pad(xf[:-j], (0, 0, j, 0)) if x.shape[0] > j else torch.zeros_like(xf)
        y = y + shifted * (pos >= j).float()[:, None] * wf[:, k - 1 - j]
    return F.silu(y.to(weight.dtype)).to(x.dtype)


def conv_states(x: torch.Tensor, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """Each sample's last `width` inputs, zero-padded on the left when it is shorter: x [T, C] -> [n, C, width]
    (the window a decode step continues from)."""
    cu = cu_seqlens.long()
    ends = cu[1:]
    offs = torch.arange(-width, 0, device=x.device)
    index = ends[:, None] + offs[None, :]  # [n, width]
    valid = index >= cu[:-1, None]
    rows = x[index.clamp(min=0)] * valid[..., None].to(x.dtype)  # [n, width, C]
    return rows.transpose(1, 2).contiguous()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [B, C], weight [C, K], state [B, C, K-1] (previous inputs, oldest first) ->
    (silu(conv) [B, C], the new state)."""
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=-1)  # [B, C, K]
    y = (window.float() * weight.float()[None]).sum(-1)  # float32 accumulation, as causal_conv1d
    return F.silu(y.to(weight.dtype)).to(x.dtype), window[:, :, 1:].to(state.dtype)


# ------------------------------------------------------------------------------------------------ delta rule


def _prepare(q, k, v, g, beta):
    """fp32, L2-normalised q/k with q scaled by dk^-1/2; k heads repeated to the value heads (each key head serves
    Hv/Hk consecutive value heads)."""
    hv = v.shape[1]
    if q.shape[1] != hv:
        q = q.repeat_interleave(hv // q.shape[1], dim=1)
        k = k.repeat_interleave(hv // k.shape[1], dim=1)
    q = l2_normalize(q.float())
    k = l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    return q, k, v.float(), g.float(), beta.float()


_PLANS: dict = {}
_PLAN_CACHE_SIZE = 8  # the linear-attention layers of a forward (and its recomputation) share one row's plan


def chunk_plan(cu_seqlens: torch.Tensor | Sequence[int] | Segments, chunk_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], torch.Tensor]:
    """Where every token of a packed row goes in the chunked layout, planned on the host from the sample offsets:
    (order [n]: samples by decreasing chunk count, rank [n]: its inverse, running: the samples still going at each
    chunk step, offsets: each step's first chunk, slot [T]: each token's row in the [N * C] padded layout); the
    tensors on `device`. Host offsets (a `PackLayout`'s) make it without reading the device; a tensor is read once.
    Cached on the offsets, so the layers of a forward build it once."""
    host = host_offsets(cu_seqlens)
    key = (host, chunk_size, str(device))
    if key in _PLANS:
        return _PLANS[key]
    c, n, total = chunk_size, len(host) - 1, host[-1]
    lengths = torch.tensor([b - a for a, b in zip(host[:-1], host[1:], strict=True)], dtype=torch.long)
    chunks = (lengths + c - 1) // c  # per sample
    # Chunks are laid out step-major: all samples' first chunks, then all second chunks, ... with the samples
    # ordered by decreasing chunk count, so the samples still running at step j are a prefix and the chunks of
    # step j are one contiguous slice (no gathers in the sequential loop).
    order = torch.argsort(chunks, descending=True, stable=True)
    rank = torch.empty_like(order).index_copy_(0, order, torch.arange(n))
    counts = chunks[order].tolist()  # host tensors: no device involved
    running = [sum(1 for m in counts if m > j) for j in range(counts[0] if n else 0)]  # samples at step j
    offsets = [0]
    for m in running:
        offsets.append(offsets[-1] + m)
    seq = torch.repeat_interleave(torch.arange(n), lengths, output_size=total)
    pos = torch.arange(total) - torch.tensor(host[:-1], dtype=torch.long)[seq]
    slot = (torch.tensor(offsets[:-1] or [0], dtype=torch.long)[pos // c] + rank[seq]) * c + pos % c
    plan = (to_device(order, device), to_device(rank, device), running, offsets, to_device(slot, device))
    if len(_PLANS) >= _PLAN_CACHE_SIZE:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan
    return plan


# A compile boundary: its chunk loop is planned from the host offsets, which a compiled graph would be guarded on
# (a recompile per pack layout; see host.Segments). It runs eagerly inside a compiled Qwen3.5 layer.
@torch.compiler.disable
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int] | Segments,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed gated delta rule: q, k [T, Hk, dk], v [T, Hv, dv], g (log decay) and beta [T, Hv], cu_seqlens [n+1]
    (host ints: nothing is read from the device; or a tensor, read once), initial_state [n, Hv, dk, dv] or None
    (zeros) -> (o [T, Hv, dv] in v's dtype, final states [n, Hv, dk, dv] float32). q and k are L2-normalised here."""
    dtype, total = v.dtype, v.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    hv, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    c = chunk_size
    order, rank, running, offsets, slot = chunk_plan(cu_seqlens, c, v.device)
    n = order.shape[0]
    total_chunks = offsets[-1]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [N, Hv, C, ...]
        out = x.new_zeros(total_chunks * c, *x.shape[1:]).index_copy(0, slot, x)
        return out.unflatten(0, (total_chunks, c)).transpose(1, 2)

    q, k, v = padded(q), padded(k), padded(v)  # [N, Hv, C, d]
    g, beta = padded(g), padded(beta)  # [N, Hv, C]

    # Within each chunk (all chunks at once).
    gam = g.cumsum(-1)  # log Gamma_i
    causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    ratio = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # Gamma_i/Gamma_j, j<=i
    kk = k @ k.transpose(-1, -2)
    lower = (beta[..., :, None] * kk * ratio).tril(-1)  # L
    system = lower + torch.eye(c, dtype=v.dtype, device=v.device)
    w_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, (beta * gam.exp())[..., None] * k, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * ratio  # (QK^T * M), diagonal included
    q_dec = q * gam.exp()[..., None]  # diag(Gamma) Q
    k_dec = k * (gam[..., -1:] - gam).exp()[..., None]  # K * Gamma_C/Gamma
    chunk_decay = gam[..., -1].exp()[..., None, None]  # Gamma_C [N, Hv, 1, 1]

    # Across chunks: step j advances the j-th chunk of every sample that has one (the first running[j] samples).
    state = (torch.zeros(n, hv, dk, dv, device=v.device, dtype=v.dtype) if initial_state is None
             else initial_state.to(v.dtype)[order])
    outs = []
    for a, m in zip(offsets[:-1], running, strict=True):
        s0 = state[:m]
        u = w_v[a:a + m] - w_k[a:a + m] @ s0
        outs.append(q_dec[a:a + m] @ s0 + attn[a:a + m] @ u)
        new = chunk_decay[a:a + m] * s0 + k_dec[a:a + m].transpose(-1, -2) @ u
        state = new if m == n else torch.cat([new, state[m:]])
    state = state[rank]  # back to the samples' order
    if not outs:
        return v.new_zeros(total, hv, dv).to(dtype), state
    o = torch.cat(outs).transpose(1, 2).flatten(0, 1)[slot]  # [N, C, Hv, dv] -> [T, Hv, dv]
    return o.to(dtype), state


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, Hk, dk], v [B, Hv, dv], g and beta [B, Hv], state [B, Hv, dk, dv] ->
    (o [B, Hv, dv] in v's dtype, new state float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float() * g.exp()[..., None, None]
    u = beta[..., None] * (v - (s * k[..., None]).sum(-2))
    s = s + k[..., :, None] * u[..., None, :]
    return (s * q[..., None]).sum(-2).to(dtype), s
