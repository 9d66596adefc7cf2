"""Building the training model on the meta device and filling it tensor by tensor (sharded under FSDP2) gives
exactly the weights of the plain paths: `MindVL.init_weights(seed)` and `load_model(folder)`."""

from __future__ import annotations

import pytest
import torch
from train_helpers import raw_recipe, run_ranks

from mindvl.checkpoint import load_model, save_pretrained
from mindvl.config import load_recipe
from mindvl.data import load_tokenizer
from mindvl.models import MindVL
from mindvl.train.materialize import build_model, fill_weights, init_seed, model_source
from mindvl.train.parallel import ParallelEnv

ENV = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random recipe, its reference model from the plain path, and that model saved as a folder."""
    tmp = tmp_path_factory.mktemp("materialize")
    recipe = load_recipe(raw={**raw_recipe(tmp / "o", tmp / "cache"), "seed": 0})
    tok = load_tokenizer()
    config, _ = model_source(recipe, tok, ENV)
    reference = MindVL(config)
    reference.init_weights(seed=init_seed(recipe))  # model.init_seed, else the recipe seed
    folder = save_pretrained(reference, tmp / "model")
    return recipe, tok, reference, folder


def test_random_init_equals_init_weights(tiny):
    recipe, tok, reference, _ = tiny
    built = build_model(recipe, tok, ENV)
    want = reference.state_dict()
    got = built.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(not t.is_meta for t in got.values())


def test_init_from_folder_equals_from_pretrained(tiny):
    recipe, tok, reference, folder = tiny
    again = load_recipe(raw=recipe.to_dict() | {"model": {"init_from": str(folder)}})
    built = build_model(again, tok, ENV)
    plain = load_model(folder)
    assert all(torch.equal(built.state_dict()[n], t) for n, t in plain.state_dict().items())
    assert built.training


def test_fill_weights_refuses_unknown_and_missing_names(tiny):
    _, _, reference, _ = tiny
    with torch.device("meta"):
        model = MindVL(reference.config)
    model.to_empty(device="cpu")
    state = reference.state_dict()
    with pytest.raises(ValueError, match="not a tensor of this model"):
        fill_weights(model, iter([("projector.nope", torch.zeros(1))]), torch.device("cpu"))
    missing = next(iter(state))
    with pytest.raises(ValueError, match=r"no value for .*" + missing.replace(".", r"\.")):
        fill_weights(model, ((n, t) for n, t in state.items() if n != missing), torch.device("cpu"))


SCRIPT = """
import sys, torch
from mindvl.config import load_recipe, ParallelSection
from mindvl.checkpoint.training import full_model_state
from mindvl.data import load_tokenizer
from mindvl.train.materialize import build_model
from mindvl.train.parallel import destroy, init_distributed, parallelize
from mindvl.train.phases import apply_phase
from mindvl.checkpoint.safetensors_io import TensorFolder

env = init_distributed("cpu")
recipe = load_recipe(raw={"model": {"init_from": sys.argv[1]}, "budget": {"max_steps": 1},
                          "data": {"sources": [{"synth": {"tasks": ["ocr"], "n": 4}}]}})
cfg = ParallelSection(fsdp="on", activation_checkpointing=True)
def prepare(m):
    apply_phase(m, ["projector", "language_model"])
    return parallelize(m, env, cfg)
model = build_model(recipe, load_tokenizer(), env, prepare)
local = sum(p.to_local().numel() for p in model.parameters())
total = sum(p.numel() for p in model.parameters())
state = full_model_state(model)
if env.is_main:
    want = dict(TensorFolder(sys.argv[1]).iter_tensors())
    assert set(state) == set(want), sorted(set(state) ^ set(want))[:4]
    bad = [n for n in want if not torch.equal(state[n], want[n])]
    assert not bad, bad[:4]
    print(f"OK local {local} of {total}")
destroy(env)
"""


@pytest.mark.slow
def test_two_ranks_fill_their_shards_from_a_folder(tiny, tmp_path):
    _, _, _, folder = tiny
    script = tmp_path / "fill.py"
    script.write_text(SCRIPT)
    r = run_ranks(tmp_path, 2, [str(folder)], script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    local, total = (int(x) for x in r.stdout.split("OK local ")[1].split(" of "))
    assert local < 0.6 * total  # each rank holds about half of every sharded tensor
