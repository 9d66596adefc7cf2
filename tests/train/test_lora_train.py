"""A tiny LoRA run: the loss falls, only the adapters change (bit for bit on the rest), final/ holds the merged weights
and a PEFT-layout adapter that reproduces them from the base, `mindvl export` writes the same, and a run killed with
SIGKILL resumes exactly (CPU)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import env, latest_step, load_weights, mindvl_cmd, raw_recipe, run, write_recipe

from mindvl.checkpoint.adapters import read_adapter
from mindvl.checkpoint.training import export_checkpoint
from mindvl.config import load_recipe
from mindvl.data import load_tokenizer
from mindvl.models import MindVLConfig
from mindvl.models.lora import merge_state
from mindvl.train.materialize import model_source
from mindvl.train.parallel import ParallelEnv
from mindvl.train.trainer import train

LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "gate_proj", "qkv"], "modules": ["language_model",
                                                                                             "visual"]}
STEPS = 6


def lora_recipe(tmp_path, out_name: str = "o", steps: int = STEPS, **extra) -> dict:
    return raw_recipe(tmp_path / out_name, tmp_path / "cache", model={"lora": LORA}, phase={"trainable": []},
                      optim={"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 0.0}, budget={"max_steps": steps}, **extra)


def initial_weights(recipe) -> tuple[MindVLConfig, dict[str, torch.Tensor]]:
    config, source = model_source(recipe, load_tokenizer(), ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    return config, dict(source.tensors(config))


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_run_learns_changing_only_the_adapters(tmp_path):
    recipe = load_recipe(raw=lora_recipe(tmp_path))
    result = train(recipe)
    curve = losses(result.output_dir)
    assert curve[-1] < curve[0] - 0.05, curve  # it learns

    config, start = initial_weights(recipe)
    final = load_weights(result.final_dir)
    lora, adapters, full = read_adapter(result.final_dir / "adapter", config)
    assert not full and lora.r == 4 and lora.scaling == 2.0
    assert len(adapters) == 2 * (2 * 3 + 2 * 2)  # 2 LLM layers x (q, v, gate) + 2 vision blocks x (qkv, gate)
    assert all(bool(t.abs().sum() > 0) for n, t in adapters.items() if n.endswith("lora_B"))  # B left zero: trained
    adapted = {n.rpartition(".")[0] + ".weight" for n in adapters}
    for name, value in start.items():
        if name not in adapted:  # every weight without an adapter: unchanged, bit for bit
            assert torch.equal(final[name], value), name
    # the adapted weights: exactly the untouched base plus the saved adapters (so the base did not move either)
    merged = merge_state({**start, **adapters}, lora.scaling)
    for name in adapted:
        assert torch.equal(final[name], merged[name]), name
        assert not torch.equal(final[name], start[name]), name

    exported = export_checkpoint(result.output_dir, tmp_path / "exported")  # `mindvl export` of a LoRA run
    assert load_weights(exported).keys() == final.keys()
    assert all(torch.equal(load_weights(exported)[n], final[n]) for n in final)
    _, again, _ = read_adapter(exported / "adapter", config)
    assert all(torch.equal(again[n], adapters[n]) for n in adapters)


def test_unknown_lora_key_is_refused_before_the_run_folder(tmp_path):
    raw = lora_recipe(tmp_path)
    raw["model"]["lora"] = {**LORA, "rank": 8}
    with pytest.raises(ValueError, match=r"^model.lora.rank: unknown key \(known: r, alpha, dropout, targets, "):
        train(load_recipe(raw=raw))
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_lora_run_killed_with_sigkill_resumes_exactly(tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    ref = write_recipe(tmp_path / "ref.yaml", lora_recipe(tmp_path, "ref"))
    done = run(mindvl_cmd("train", str(ref)), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    recipe = write_recipe(tmp_path / "k.yaml", lora_recipe(tmp_path, "killed"))
    proc = subprocess.Popen(mindvl_cmd("train", str(recipe), "resume=auto"), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while latest_step(out) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = latest_step(out)
    assert 2 <= killed_at < STEPS, killed_at
    final = run(mindvl_cmd("train", str(recipe), "resume=auto"), timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]

    ours, reference = load_weights(out / "final"), load_weights(ref_out / "final")
    assert set(ours) == set(reference) and all(torch.equal(ours[n], reference[n]) for n in reference)
    a, b = (load_file(str(o / "final" / "adapter" / "adapter_model.safetensors")) for o in (out, ref_out))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in b)
    assert losses(out) == losses(ref_out)


def test_lora_composes_with_fsdp_checkpointing_and_a_fully_trained_projector(tmp_path):
    """Projector fully trained + LLM LoRA, under one-rank FSDP2 with full activation checkpointing (fp32 on CPU):
    the same weights as the plain run (the transforms change where tensors live, not what is computed), and
    final/adapter carries the projector as PEFT's modules_to_save."""
    results = {}
    for name, parallel in (("plain", {}), ("fsdp", {"fsdp": "on", "activation_checkpointing": "full"})):
        raw = lora_recipe(tmp_path, name, steps=3, parallel=parallel)
        raw["model"]["lora"] = {**LORA, "modules": ["language_model"], "targets": ["q_proj", "down_proj"]}
        raw["phase"] = {"trainable": ["projector"]}
        results[name] = train(load_recipe(raw=raw))
    plain, fsdp = (load_weights(results[k].final_dir) for k in ("plain", "fsdp"))
    assert set(plain) == set(fsdp)
    for n in plain:
        torch.testing.assert_close(fsdp[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    config, start = initial_weights(load_recipe(raw=lora_recipe(tmp_path)))
    assert not torch.equal(plain["projector.fc1.weight"], start["projector.fc1.weight"])  # trained in full
    assert torch.equal(plain["visual.blocks.0.attn.qkv.weight"], start["visual.blocks.0.attn.qkv.weight"])  # frozen
    _, adapters, full = read_adapter(results["plain"].final_dir / "adapter", config)
    assert set(full) == {n for n in start if n.startswith("projector.")}
    assert all(torch.equal(full[n], plain[n]) for n in full)
    assert {n.rsplit(".", 2)[-2] for n in adapters} == {"q_proj", "down_proj"}


def test_qlora_plumbing_with_a_stand_in_backend(tmp_path, monkeypatch):
    """Where torchao is not installed (tests/train/test_qlora.py tests its real NF4 where it is), a stand-in backend
    (the "quantized" weight a plain copy) checks the plumbing: the recipe passes the guard, under one-rank FSDP the
    adapted base weights are left out of FSDP (whole tensors, swapped after loading), and the run trains its
    adapters and writes final/ as a LoRA run does."""
    import mindvl.train.qlora as qlora

    calls = {"quantized": 0}

    class NotNF4:  # no tensor is one: dequantized() passes the copies through
        pass

    def to_nf4(w, block, scaler_block):
        calls["quantized"] += 1
        assert block == 64 and (w.numel() // block) % scaler_block == 0
        return w.clone()

    monkeypatch.setattr(qlora, "_backend", lambda: (to_nf4, NotNF4))
    raw = lora_recipe(tmp_path, steps=2, parallel={"fsdp": "on", "mixed_precision": "fp32"})
    raw["model"]["lora"] = {**LORA, "quantize": "nf4"}
    result = train(load_recipe(raw=raw))
    assert calls["quantized"] == 2 * 3 + 2 * 2
    config, start = initial_weights(load_recipe(raw=raw))
    lora, adapters, _ = read_adapter(result.final_dir / "adapter", config)
    assert lora.r == 4 and all(bool(t.abs().sum() > 0) for n, t in adapters.items() if n.endswith("lora_B"))
    final, merged = load_weights(result.final_dir), merge_state({**start, **adapters}, lora.scaling)
    assert all(torch.equal(final[n], merged[n]) for n in final)
