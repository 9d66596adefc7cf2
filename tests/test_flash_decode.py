"""Decode over the static cache through flash-attn's KV-cache kernel (kv_cache._flash_over_cache), checked on the CPU
against the sdpa path with a stand-in `flash_attn` module that implements the documented contract of
`flash_attn_with_kvcache` (q [B, Sq, Hq, D]; k_cache/v_cache [B, S_cache, Hkv, D] with a contiguous last dimension;
`cache_seqlens` int32 [B]: row b attends to its first cache_seqlens[b] slots; GQA by head groups) and of
`flash_attn_varlen_func` for the prefill (test_model_packing's naive_attention), each in float64. flash-attn itself
is CUDA-only."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from family_models import build
from test_model_packing import naive_attention
from test_static_decode import prompts_for

from mindvl.infer import generate
from mindvl.infer.generate import pack_prompts


def _one_query(q, k, v, scale):
    """q [1, Hq, D] over all of k/v [n, Hkv, D] -> [1, Hq, Dv] (float64 inside): a cache kernel's single query."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * (scale or q.shape[-1] ** -0.5)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


class StandIn:
    def __init__(self) -> None:
        self.cache_calls = 0

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                               window_size=(-1, -1)):
        assert window_size == (-1, -1) and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        return naive_attention(q, k, v, cu_q.diff().tolist(), causal, scale=softmax_scale)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=False):
        self.cache_calls += 1
        assert not causal  # one query per row sees all of its first cache_seqlens[b] slots
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and k_cache.shape[:3] == v_cache.shape[:3]
        assert q.shape[0] == k_cache.shape[0] and q.shape[2] % k_cache.shape[2] == 0
        out = q.new_empty(*q.shape[:3], v_cache.shape[-1])
        for b, n in enumerate(cache_seqlens.tolist()):
            out[b] = _one_query(q[b], k_cache[b, :n], v_cache[b, :n], softmax_scale)
        return out


@pytest.fixture
def flash(monkeypatch):
    stand_in = StandIn()
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = stand_in.flash_attn_varlen_func
    module.flash_attn_with_kvcache = stand_in.flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return stand_in


def _text_backend(model, name: str) -> None:
    for module in model.language_model.modules():
        if hasattr(module, "backend"):
            module.backend = name


@pytest.mark.parametrize("name", ["dense", "qwen3_vl", "qwen3_5"])
def test_decode_through_flash_kv_cache_equals_sdpa(name, flash):
    """Logits of the prefill's last tokens and of 4 decode steps (a finished row masked) agree with the sdpa path
    to float rounding, every decode attention (and the prefill's last-query layer) went through the cache kernel,
    and greedy tokens are the same."""
    model = build(name)
    prompts = prompts_for(model, 3)
    logits = {}
    for backend in ("sdpa", "flash"):
        _text_backend(model, backend)
        packed = pack_prompts(prompts, torch.device("cpu"))
        with torch.inference_mode():
            cache = model.new_kv_cache(3, 40)
            out, positions = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache,
                                           packed["pixel_values"], packed["image_grid_thw"])
            cache.advance = torch.tensor([1, 0, 1])  # row 1 finished: it sees its last slot again
            steps = [out]
            for _ in range(4):
                out = model.decode_step(out.argmax(-1), positions, cache)
                positions = positions + 1
                steps.append(out)
        logits[backend] = torch.stack(steps)
    attention_layers = sum(1 for m in model.language_model.modules() if hasattr(m, "backend"))  # 2, 3, 2
    assert flash.cache_calls == 1 + 4 * attention_layers  # the prefill's last layer (last queries), every step
    torch.testing.assert_close(logits["flash"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    _text_backend(model, "flash")
    got = generate(model, prompts, 9)
    _text_backend(model, "sdpa")
    assert got == generate(model, prompts, 9)
