"""The planner's QLoRA memory is what the trainer holds: the adapted base weights leave FSDP (their bf16 shards and
all-gathers leave the trace) and come back whole on every rank in NF4 bytes, plus the transient of dequantizing the
largest; checked against the LoRA plan of the same recipe and hand counts of the layers (2 fake ranks)."""

from __future__ import annotations

import math

import pytest

from mindvl.config import load_recipe
from mindvl.plan import get_device, plan

ARCH = {"text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 8, "mrope_section": [1, 1, 2]},
        "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                   "fullatt_block_indexes": [1]}}

LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "gate_proj", "qkv"], "modules": ["language_model",
                                                                                             "visual"]}
# the tiny test model's adapted layers (out, in): 2 LLM layers x (q, v, gate), 2 vision blocks x (qkv, gate)
ADAPTED = [(32, 32), (16, 32), (64, 32)] * 2 + [(96, 32), (48, 32)] * 2


def nf4_hand(numel: int) -> int:
    """torchao's NF4 storage by hand: a byte per 2 weights, an int8 scale per 64, an fp32 factor per group of at
    most 256 scales (the largest divisor of the scale count)."""
    blocks = numel // 64
    group = max(d for d in range(1, min(256, blocks) + 1) if blocks % d == 0)
    return numel // 2 + blocks + 4 * (blocks // group)


@pytest.mark.parametrize("world", [1, 2])
def test_qlora_plan_holds_the_nf4_base_whole_instead_of_bf16_shards(tmp_path, world):
    def planned(quantize):
        raw = {"output_dir": str(tmp_path / "o"), "model": {"arch": ARCH, "lora": {**LORA, "quantize": quantize}},
               "data": {"sources": [{"synth": {"tasks": ["ocr"], "n": 8}}], "seq_len": 192,
                        "max_pixels": 16 * 28 * 28, "synth_cache": str(tmp_path / "cache")},
               "phase": {"name": "multitask", "trainable": []}, "batch": {"global_batch_size": 2},
               "budget": {"max_steps": 1}}
        return plan(load_recipe(raw=raw), world, get_device("h100-80g"))

    lora, qlora = planned(None), planned("nf4")
    bf16_shards = sum(2 * math.ceil(o / world) * i for o, i in ADAPTED)  # rank 0's bf16 rows of them under LoRA
    nf4 = sum(nf4_hand(o * i) for o, i in ADAPTED)
    dequant = 14 * max(o * i for o, i in ADAPTED)  # bf16 compute: 14 bytes a weight (benchmarks/bench_qlora.py)
    assert qlora.breakdown["parameters"] == lora.breakdown["parameters"] - bf16_shards + nf4
    assert sum(qlora.breakdown.values()) == qlora.peak_bytes_per_rank
    # the trace holds the base weights as parameters only (not also as activations through a view in a forward):
    # the activations at the peak are LoRA's plus the dequantization transient
    assert qlora.breakdown["activations"] == lora.breakdown["activations"] + dequant
    assert qlora.breakdown["unsharded_parameters"] <= lora.breakdown["unsharded_parameters"]  # no base gathered
    assert any(n.startswith("QLoRA (nf4): ") and "whole on every rank" in n for n in qlora.notes)
