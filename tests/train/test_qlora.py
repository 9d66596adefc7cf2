"""QLoRA on torchao's real NF4 (CPU): quantization equals a hand-written NF4 reference; a QLoRA layer computes what a
LoRA layer on the dequantized weight computes (forward and backward); the frozen base stays 4-bit through training;
QLoRA under FSDP2 over 2 gloo processes equals 1 process; `mindvl export` of a QLoRA checkpoint redoes the NF4 base.
Tests that need torchao skip without it (`pip install 'mindvl[qlora]'`); the refusal without it is tested always."""

from __future__ import annotations

import sys

import pytest
import torch
from test_lora_train import LORA, lora_recipe, losses
from train_helpers import CLI, assert_same_run, load_weights, run, run_ranks, write_recipe

import mindvl.train.qlora as qlora
from mindvl.checkpoint.adapters import read_adapter
from mindvl.checkpoint.dcp_io import read_metadata
from mindvl.checkpoint.training import export_checkpoint
from mindvl.config import load_recipe
from mindvl.models.lora import LoRALinear
from mindvl.train.trainer import train

needs_torchao = pytest.mark.skipif(qlora._backend() is None, reason="torchao is not installed (mindvl[qlora])")
QLORA = {**LORA, "quantize": "nf4"}


def qlora_recipe(tmp_path, out_name: str = "o", steps: int = 6, **extra) -> dict:
    raw = lora_recipe(tmp_path, out_name, steps, **extra)
    raw["model"]["lora"] = dict(QLORA)
    return raw


def nf4_reference(w: torch.Tensor, block: int, scaler_block: int) -> torch.Tensor:
    """NF4 by hand (QLoRA's recipe, written from the paper, not from torchao): per block of `block` weights the
    absmax scale, each weight the nearest of the 16 code values; the scales double-quantized to int8 around their
    mean with one factor per `scaler_block` scales; returns the dequantized weight."""
    code = torch.tensor(qlora.NF4_CODEBOOK, dtype=w.dtype)
    blocks = w.reshape(-1, block)
    absmax = blocks.abs().amax(dim=1)
    index = (blocks / absmax[:, None]).unsqueeze(-1).sub(code).abs().argmin(dim=-1)
    centred = (absmax - absmax.mean()).reshape(-1, scaler_block)
    factor = 128 / centred.abs().amax(dim=1, keepdim=True)  # int8 over [-absmax, absmax] of each group
    scales = ((centred * factor).round().clamp(-128, 127) / factor).reshape(-1) + absmax.mean()
    return (code[index] * scales[:, None]).reshape(w.shape)


@needs_torchao
@pytest.mark.parametrize("shape", [(64, 256), (48, 32), (96, 160)])
def test_nf4_dequantizes_to_the_hand_reference(shape):
    """(64, 256): 256 blocks, one double-quantization group of 256; (48, 32), (96, 160): 24 and 240 blocks, whose
    groups are the largest divisors up to 256 (24 and 240)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    block, scaler_block = qlora.nf4_blocks(w.numel())
    assert block == 64 and (w.numel() // 64) % scaler_block == 0
    q = qlora.quantized(w)
    assert qlora.is_quantized(q) and q.quantized_data.dtype == torch.uint8
    assert q.quantized_data.numel() == w.numel() // 2  # two 4-bit codes per byte
    ref = nf4_reference(w, block, scaler_block)
    torch.testing.assert_close(qlora.dequantized(q), ref, rtol=1e-6, atol=1e-7)
    # and the quantization error is NF4's: at most half the widest code gap (0.1604 x absmax of the block) plus
    # the int8 scale error, far below the weights' own size
    err = (qlora.dequantized(q) - w).abs().reshape(-1, 64).amax(dim=1)
    absmax = w.reshape(-1, 64).abs().amax(dim=1)
    assert bool((err <= 0.5 * 0.3208 * absmax * 1.02 + 1e-6).all())


def test_nf4_refuses_a_weight_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match=r"^model.lora.quantize: layers.0.q_proj.weight has 96 elements, not a "
                                         r"multiple of NF4's block of 64; leave that layer out"):
        qlora.nf4_blocks(96, "layers.0.q_proj.weight")


@needs_torchao
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlora_layer_equals_lora_on_the_dequantized_weight(dtype):
    """Forward and backward of an NF4-based LoRALinear equal a plain LoRALinear whose weight is the dequantized NF4
    weight (the same adapters, input and upstream gradient): the 4-bit base only changes what W is."""
    gen = torch.Generator().manual_seed(1)
    base = torch.nn.Linear(128, 64, bias=True, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(64, 128, generator=gen) * 0.05)
    q, ref = LoRALinear(base, 4, 8.0), LoRALinear(torch.nn.Linear(128, 64, dtype=dtype), 4, 8.0)
    with torch.no_grad():
        q.lora_B.copy_(torch.randn(q.lora_B.shape, generator=gen) * 0.1)
        ref.load_state_dict(q.state_dict())
        q.weight = torch.nn.Parameter(qlora.quantized(q.weight), requires_grad=False)
        ref.weight.copy_(qlora.dequantized(q.weight))
    ref.weight.requires_grad_(False)
    x = torch.randn(3, 5, 128, generator=gen, dtype=dtype)
    xq, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    up = torch.randn(3, 5, 64, generator=gen, dtype=dtype)
    yq, yr = q(xq), ref(xr)
    (yq * up).sum().backward()
    (yr * up).sum().backward()
    pairs = ((yq, yr), (xq.grad, xr.grad), (q.lora_A.grad, ref.lora_A.grad), (q.lora_B.grad, ref.lora_B.grad),
             (q.bias.grad, ref.bias.grad))
    for a, b in pairs:  # fp32: rounding; bf16: NF4's linear adds the bias after the matmul (F.linear fuses it), so
        #                 the two round differently: within 4 bf16 ulps (2^-8 relative) of the tensor's scale
        atol = 1e-6 if dtype == torch.float32 else 4 * 2**-8 * float(b.detach().abs().max())
        torch.testing.assert_close(a, b, rtol=1e-6 if dtype == torch.float32 else 0, atol=atol)
    assert q.weight.grad is None


NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")


def nf4_element_bytes(t) -> int:
    return sum(getattr(t, a).numel() * getattr(t, a).element_size() for a in NF4_PARTS)


def nf4_storage_bytes(t) -> int:
    """What the weight holds in memory (torchao keeps a one-group factor as a view of a per-block buffer)."""
    return sum(getattr(t, a).untyped_storage().nbytes() for a in NF4_PARTS)


@needs_torchao
def test_the_frozen_base_stays_4_bit_through_training_steps(tmp_path):
    """The model the trainer builds (prepare_model, fill, quantize) holds every adapted base weight as NF4 of
    nf4_bytes(numel) bytes, under 0.6 bytes a weight in memory (4 bits + scales; bf16 is 2 bytes), and after
    optimizer steps they are still NF4 with the same codes while the adapters moved."""
    from train_helpers import CPU_ENV, recipe_and_packs

    from mindvl.data import load_tokenizer
    from mindvl.train.materialize import build_model
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import prepare_model

    recipe = load_recipe(raw=qlora_recipe(tmp_path, parallel={"fsdp": "off", "mixed_precision": "fp32"}))
    model = build_model(recipe, load_tokenizer(), CPU_ENV, lambda m: prepare_model(m, recipe, CPU_ENV))
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 2 * 3 + 2 * 2
    codes = {}
    for name, layer in layers:
        assert qlora.is_quantized(layer.weight) and not layer.weight.requires_grad, name
        assert nf4_element_bytes(layer.weight) == qlora.nf4_bytes(layer.weight.numel()), name
        assert nf4_storage_bytes(layer.weight) < 0.6 * layer.weight.numel(), name
        codes[name] = layer.weight.quantized_data.clone()
    _, _, packs = recipe_and_packs(tmp_path, 2)
    optimizer = build_optimizer(model, recipe.optim)
    b_before = {n: m.lora_B.detach().clone() for n, m in layers}
    for pack in packs:
        loss, count = model(**pack)
        (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, layer in layers:
        assert qlora.is_quantized(layer.weight) and torch.equal(layer.weight.quantized_data, codes[name]), name
        assert not torch.equal(layer.lora_B, b_before[name]), name


def test_qlora_without_its_backend_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(qlora, "_backend", lambda: None)
    with pytest.raises(ValueError) as err:
        train(load_recipe(raw=qlora_recipe(tmp_path)))
    assert str(err.value).startswith("model.lora.quantize: nf4 (QLoRA) needs torchao, which is not installed here; "
                                     "pip install 'mindvl[qlora]'")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


@needs_torchao
@pytest.mark.slow
def test_qlora_under_fsdp2_on_two_processes_equals_one_process(tmp_path):
    """1 process without FSDP vs FSDP2 over 2 gloo processes (the NF4 base whole on each rank, outside FSDP;
    adapters sharded): the same losses and weights (fp32, 1e-5); the checkpoints hold no frozen tensor, and `mindvl
    export` of the 2-rank checkpoint (the base read again, NF4 redone) writes the run's final weights."""
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")
    kw = {"steps": 3, "checkpoint": {"every": 3, "keep": 1}}
    one = write_recipe(tmp_path / "one.yaml", qlora_recipe(tmp_path, "one", batch={"data_shards": 2}, **kw))
    two = write_recipe(tmp_path / "two.yaml", qlora_recipe(tmp_path, "two", **kw))
    r1 = run([sys.executable, str(script), "train", str(one), "parallel.fsdp=off"], timeout=300)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_ranks(tmp_path, 2, ["train", str(two)], script=script)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "2 rank(s)" in r2.stdout
    assert_same_run(tmp_path / "one", tmp_path / "two", 1e-5)
    assert losses(tmp_path / "one")[-1] != losses(tmp_path / "one")[0]

    ckpt = tmp_path / "two" / "checkpoints" / "step_00000003"
    saved = {k for k in read_metadata(ckpt).state_dict_metadata if k.startswith("model.")}
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:5]
    r = run([sys.executable, str(script), "export", str(ckpt), "--out", str(tmp_path / "exported")], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    final, exported = load_weights(tmp_path / "two" / "final"), load_weights(tmp_path / "exported")
    assert final.keys() == exported.keys()
    for n in final:
        torch.testing.assert_close(exported[n], final[n], rtol=0, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="a QLoRA checkpoint .* export it with the CLI"):
        export_checkpoint(ckpt, tmp_path / "plain")  # the library call without the quantizer


@needs_torchao
def test_qlora_with_the_bf16_policy_on_one_device_trains_its_adapters(tmp_path):
    """The 24 GB recipe's setting: bf16 mixed precision on one device (FSDP's policy over a one-rank group), the NF4
    base outside FSDP: the loss falls and the adapter folder holds trained adapters."""
    raw = qlora_recipe(tmp_path, steps=4, parallel={"mixed_precision": "bf16"})
    result = train(load_recipe(raw=raw))
    curve = losses(result.output_dir)
    assert curve[-1] < curve[0], curve
    from test_lora_train import initial_weights

    config, _ = initial_weights(load_recipe(raw=raw))
    _, adapters, _ = read_adapter(result.final_dir / "adapter", config)
    assert adapters and all(bool(t.abs().sum() > 0) for n, t in adapters.items() if n.endswith("lora_B"))


@needs_torchao
def test_qlora_resume_rebuilds_the_nf4_base_and_continues_exactly(tmp_path):
    """A QLoRA checkpoint holds no NF4 tensor; resuming it in a new run folder reads the base again, quantizes it
    again (deterministic) and continues: step 3 and the final weights equal the uninterrupted run's bit for bit."""
    raw = qlora_recipe(tmp_path, "a", steps=3, parallel={"fsdp": "off", "mixed_precision": "fp32"})
    train(load_recipe(raw=raw))
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert all(".lora_" in k for k in read_metadata(step2).state_dict_metadata if k.startswith("model."))
    again = qlora_recipe(tmp_path, "b", steps=3, parallel={"fsdp": "off", "mixed_precision": "fp32"})
    again["checkpoint"]["resume"] = str(step2)
    train(load_recipe(raw=again))
    assert losses(tmp_path / "b")[-1] == losses(tmp_path / "a")[-1]
    a, b = load_weights(tmp_path / "a" / "final"), load_weights(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
