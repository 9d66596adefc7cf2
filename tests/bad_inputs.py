"""Bad inputs, each given to the real `mindvl` command in a subprocess: every one must end in exactly one line on
stderr naming the file (and key, line or tensor) and exit 2. Shared by tests/test_bad_inputs.py (asserts) and
benchmarks/bad_inputs_table.py (prints the table of benchmarks/RESULTS.md).

A case builds its inputs under a scratch folder from one tiny model folder and returns the command line; `names`
are the strings the message must contain (the file, the key or tensor)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import prefork

CLI = "import sys; from mindvl.cli import main; sys.exit(main())"
# transformers made unimportable, as on an install without it (`import transformers` raises ImportError).
CLI_WITHOUT_TRANSFORMERS = "import sys; sys.modules['transformers'] = None; " + CLI


@dataclass
class Case:
    id: str
    what: str  # the bad input, for the table
    build: Callable[[Path, Path], tuple[list[str], list[str]]]  # (scratch, model folder) -> (argv, names)
    needs_cpu_only_torch: bool = False
    code: str = CLI


def copy_model(model: Path, to: Path) -> Path:
    shutil.copytree(model, to)
    return to


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def truncated_safetensors(tmp: Path, model: Path):
    f = copy_model(model, tmp / "m") / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _, header, data = _header(f)
    first_cut = min((t["data_offsets"][1], k) for k, t in header.items()
                    if k != "__metadata__" and t["data_offsets"][1] > len(data))[1]
    return ["chat", str(tmp / "m"), "--prompt", "hi"], [str(f), repr(first_cut), "truncated"]


def huge_header_length(tmp: Path, model: Path):
    f = copy_model(model, tmp / "m") / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**60) + f.read_bytes()[8:])
    return ["chat", str(tmp / "m"), "--prompt", "hi"], [str(f), str(2**60)]


def offset_past_the_end(tmp: Path, model: Path):
    f = copy_model(model, tmp / "m") / "model.safetensors"
    _, header, data = _header(f)
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["data_offsets"] = [len(data) + 64, len(data) + 64 + 4]  # 4 bytes beyond the data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return ["chat", str(tmp / "m"), "--prompt", "hi"], [str(f), repr(name)]


def index_not_json(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    (m / "model.safetensors.index.json").write_text('{"weight_map": ')
    return ["chat", str(m), "--prompt", "hi"], [str(m / "model.safetensors.index.json")]


def string_hidden_size(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    config = json.loads((m / "config.json").read_text())
    config["text"]["hidden_size"] = "128"
    (m / "config.json").write_text(json.dumps(config))
    return ["chat", str(m), "--prompt", "hi"], [str(m / "config.json"), "text.hidden_size", "integer"]


def config_not_json(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    (m / "config.json").write_text('{"text": {"hidden_size": 64,')
    return ["chat", str(m), "--prompt", "hi"], [str(m / "config.json"), "not valid JSON"]


def hf_config_string_size(tmp: Path, model: Path):
    hf = tmp / "qwen3"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64, "hidden_size": "128",
                                                "intermediate_size": 96, "num_hidden_layers": 1,
                                                "num_attention_heads": 2}))
    return (["convert", "--from-hf", str(hf), "--out", str(tmp / "out")],
            [str(hf / "config.json"), "hidden_size", "integer"])


def video_config_not_json(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    (m / "video_preprocessor_config.json").write_text("{'fps': 2}")
    return ["chat", str(m), "--prompt", "hi"], [str(m / "video_preprocessor_config.json"), "not valid JSON"]


def tokenizer_not_json(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    (m / "tokenizer.json").write_text('{"version": ')
    return ["chat", str(m), "--prompt", "hi"], [str(m / "tokenizer.json")]


def missing_model_folder(tmp: Path, model: Path):
    return ["chat", str(tmp / "no_such_model"), "--prompt", "hi"], [str(tmp / "no_such_model"), "does not exist"]


def not_an_image(tmp: Path, model: Path):
    (tmp / "photo.png").write_text("this is text, not a PNG")
    return ["chat", str(model), "--prompt", "hi", "--image", str(tmp / "photo.png")], [str(tmp / "photo.png")]


def chat_on_cuda(tmp: Path, model: Path):
    return ["chat", str(model), "--prompt", "hi", "--device", "cuda"], ["--device cuda", "--device cpu"]


def eval_on_cuda(tmp: Path, model: Path):
    (tmp / "ocrbench.tsv").write_text("index\tquestion\tanswer\n")
    return (["eval", str(model), "--bench", f"ocrbench={tmp / 'ocrbench.tsv'}", "--out", str(tmp / "out"),
             "--device", "cuda"], ["--device cuda", "--device cpu"])


def override_python_tag(tmp: Path, model: Path):
    marker = tmp / "PWNED"
    return (["train", "tiny/warmup", f"output_dir={tmp / 'run'}",
             f'lr=!!python/object/apply:os.system ["touch {marker}"]'], ["override", "lr=", "python/object"])


def recipe_yaml_syntax(tmp: Path, model: Path):
    (tmp / "recipe.yaml").write_text("optim:\n  lr: [1e-4, 2e-4\nbudget: {max_steps: 2}\n")
    return ["train", str(tmp / "recipe.yaml")], [str(tmp / "recipe.yaml"), "line 3"]


def moe_trace_without_transformers(tmp: Path, model: Path):
    hf = tmp / "qwen2_moe"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    shutil.copy(model / "tokenizer.json", hf / "tokenizer.json")
    (tmp / "corpus.jsonl").write_text('{"text": "hello world"}\n')
    return (["moe-trace", str(hf), "--corpus", str(tmp / "corpus.jsonl"), "--out", str(tmp / "t.npz")],
            [str(hf), "pip install transformers"])


def moe_analyze_not_a_trace(tmp: Path, model: Path):
    (tmp / "trace.npz").write_text("not an npz archive\n")
    return ["moe-analyze", str(tmp / "trace.npz")], [str(tmp / "trace.npz"), "not a router trace"]


def checkpoint_shard_missing(tmp: Path, model: Path):
    """A DCP checkpoint whose data file is gone (as when `keep` pruned it mid-read): torch.distributed.checkpoint
    raises a CheckpointException, a BaseException, which the CLI unwraps."""
    import torch

    from mindvl.checkpoint import load_model
    from mindvl.checkpoint.training import save_checkpoint

    net = load_model(model)
    ckpt = save_checkpoint(tmp / "checkpoints", 1, net, torch.optim.AdamW(net.parameters()),
                           {"model_config": net.config.to_dict(), "step": 1, "tokens": 0}, {"data": {}})
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    return ["export", str(ckpt), "--out", str(tmp / "exported")], [str(shard)]


# ------------------------------------------------------------------------ crafted inputs (issue 41, the threat model)


def _checkpoint(tmp: Path, model: Path) -> Path:
    import torch

    from mindvl.checkpoint import load_model
    from mindvl.checkpoint.training import save_checkpoint

    net = load_model(model)
    return save_checkpoint(tmp / "run" / "checkpoints", 1, net, torch.optim.AdamW(net.parameters()),
                           {"model_config": net.config.to_dict(), "step": 1, "tokens": 0}, {"data": {}})


def _edit_metadata(ckpt: Path, edit) -> None:
    import pickle

    with open(ckpt / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own file: plain pickle is fine here
    edit(meta)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


def metadata_bad_memory_format(tmp: Path, model: Path):
    from torch.distributed.checkpoint.metadata import TensorProperties

    ckpt = _checkpoint(tmp, model)
    real = TensorProperties.__getstate__
    TensorProperties.__getstate__ = lambda self: (*real(self)[:3], 99, real(self)[4])
    try:
        _edit_metadata(ckpt, lambda meta: None)
    finally:
        TensorProperties.__getstate__ = real
    return ["export", str(ckpt), "--out", str(tmp / "exported")], [str(ckpt / ".metadata"), "damaged"]


def metadata_length_2_50(tmp: Path, model: Path):
    ckpt = _checkpoint(tmp, model)

    def edit(meta):
        next(iter(meta.storage_data.values())).length = 2**50

    _edit_metadata(ckpt, edit)
    return (["export", str(ckpt), "--out", str(tmp / "exported")],
            [str(ckpt / ".metadata"), str(2**50), "more than its tensor can need"])


def shard_symlink_dev_zero(tmp: Path, model: Path):
    ckpt = _checkpoint(tmp, model)
    shard = next(ckpt.glob("*.distcp"))
    shard.unlink()
    os.symlink("/dev/zero", shard)
    return ["export", str(ckpt), "--out", str(tmp / "exported")], [str(shard), "is a symlink"]


def train_state_40gb(tmp: Path, model: Path):
    ckpt = _checkpoint(tmp, model)
    state = json.loads((ckpt / "train_state.json").read_text())
    state["model_config"]["text"].update(hidden_size=1 << 14, intermediate_size=1 << 16, num_hidden_layers=40)
    (ckpt / "train_state.json").write_text(json.dumps(state))
    return (["export", str(ckpt), "--out", str(tmp / "exported")],
            [str(ckpt / "train_state.json"), "parameters", "bytes"])


def exported_recipe_symlink(tmp: Path, model: Path):
    ckpt = _checkpoint(tmp, model)
    (tmp / "secret.json").write_text('{"token": "SECRET"}')
    os.symlink(tmp / "secret.json", tmp / "run" / "recipe.json")
    return (["export", str(ckpt), "--out", str(tmp / "exported")],
            [str(tmp / "run" / "recipe.json"), "resolves outside"])


def _npy_header(shape, descr: str = "<i2") -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def npz_header_2_45(tmp: Path, model: Path):
    import zipfile

    with zipfile.ZipFile(tmp / "trace.npz", "w") as zf:
        zf.writestr("topk_ids.npy", _npy_header((2**45,)))
    return ["moe-analyze", str(tmp / "trace.npz")], [str(tmp / "trace.npz"), "declares shape"]


def npz_bzip2_bomb(tmp: Path, model: Path):
    import zipfile

    with zipfile.ZipFile(tmp / "trace.npz", "w", compression=zipfile.ZIP_BZIP2) as zf:
        zf.writestr("topk_ids.npy", _npy_header((32 << 20,)) + bytes(64 << 20))
    return ["moe-analyze", str(tmp / "trace.npz")], [str(tmp / "trace.npz"), "compression method"]


def config_deeply_nested(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    (m / "config.json").write_text('{"text": ' + "[" * 50_000 + "]" * 50_000 + "}")
    return ["chat", str(m), "--prompt", "hi"], [str(m / "config.json"), "nested deeper"]


def config_vocab_2_70(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    config = json.loads((m / "config.json").read_text())
    config["text"]["vocab_size"] = 2**70
    (m / "config.json").write_text(json.dumps(config))
    return ["chat", str(m), "--prompt", "hi"], [str(m / "config.json"), "text.vocab_size"]


def moe_trace_pickled_bin(tmp: Path, model: Path):
    import torch

    hf = tmp / "qwen2_moe"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 32,
                                                "intermediate_size": 64, "num_hidden_layers": 1,
                                                "num_attention_heads": 2, "num_experts": 4}))
    torch.save({"lm_head.weight": torch.zeros(2)}, hf / "pytorch_model.bin")
    shutil.copy(model / "tokenizer.json", hf / "tokenizer.json")
    (tmp / "corpus.jsonl").write_text('{"text": "hello world"}\n')
    return (["moe-trace", str(hf), "--corpus", str(tmp / "corpus.jsonl"), "--out", str(tmp / "t.npz")],
            [str(hf), "pytorch_model.bin"])


def index_names_another_folder(tmp: Path, model: Path):
    copy_model(model, tmp / "victim")
    m = copy_model(model, tmp / "m")
    (m / "model.safetensors").unlink()
    _, header, _ = _header(tmp / "victim" / "model.safetensors")
    weight_map = {k: "../victim/model.safetensors" for k in header if k != "__metadata__"}
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return (["chat", str(m), "--prompt", "hi"],
            [str(m / "model.safetensors.index.json"), "../victim/model.safetensors"])


def chat_template_bomb(tmp: Path, model: Path):
    m = copy_model(model, tmp / "m")
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    (m / "chat_template.jinja").write_text(bomb)
    return ["chat", str(m), "--prompt", "hi"], [str(m / "chat_template.jinja"), "ran for more than"]


def run_folder_lock_symlink(tmp: Path, model: Path):
    run = tmp / "run"
    run.mkdir()
    (tmp / "victim.txt").write_text("precious")
    os.symlink(tmp / "victim.txt", run / ".lock")
    return (["train", "tiny/warmup", f"output_dir={run}", "resume=auto"], [str(run / ".lock"), "is a symlink"])


CASES = [
    Case("safetensors-truncated", "model.safetensors cut to half its size", truncated_safetensors),
    Case("safetensors-header-2^60", "safetensors header length field = 2^60", huge_header_length),
    Case("safetensors-offset-past-end", "a tensor's data_offsets past the end of the file", offset_past_the_end),
    Case("safetensors-index-not-json", "model.safetensors.index.json that is not JSON", index_not_json),
    Case("config-hidden-size-string", 'config.json with text.hidden_size "128"', string_hidden_size),
    Case("config-not-json", "config.json that is not JSON", config_not_json),
    Case("hf-config-string-size", '`mindvl convert --from-hf` of a config.json with hidden_size "128"',
         hf_config_string_size),
    Case("video-config-not-json", "video_preprocessor_config.json that is not JSON", video_config_not_json),
    Case("tokenizer-not-json", "tokenizer.json that is not JSON", tokenizer_not_json),
    Case("chat-missing-folder", "`mindvl chat` on a folder that does not exist", missing_model_folder),
    Case("chat-not-an-image", "a text file given as `--image`", not_an_image),
    Case("chat-device-cuda", "`mindvl chat --device cuda` on a CPU-only torch", chat_on_cuda, True),
    Case("eval-device-cuda", "`mindvl eval --device cuda` on a CPU-only torch", eval_on_cuda, True),
    Case("override-python-tag", "override `lr=!!python/object/apply:os.system [...]`", override_python_tag),
    Case("recipe-yaml-syntax", "a recipe with a YAML syntax error", recipe_yaml_syntax),
    Case("moe-trace-no-transformers", "`mindvl moe-trace` of a transformers folder, transformers not importable",
         moe_trace_without_transformers, code=CLI_WITHOUT_TRANSFORMERS),
    Case("moe-analyze-not-a-trace", "`mindvl moe-analyze` on a file that is not a trace", moe_analyze_not_a_trace),
    Case("checkpoint-shard-missing", "`mindvl export` of a DCP checkpoint whose .distcp file is gone "
         "(CheckpointException)", checkpoint_shard_missing),
    Case("metadata-memory-format", "`.metadata` with an unknown memory-format value", metadata_bad_memory_format),
    Case("metadata-length-2^50", "`.metadata` whose shard entry has length 2^50", metadata_length_2_50),
    Case("shard-symlink-dev-zero", "a checkpoint shard that is a symlink to /dev/zero", shard_symlink_dev_zero),
    Case("train-state-40gb", "`train_state.json` describing a 40 GB model beside tiny shards", train_state_40gb),
    Case("export-recipe-symlink", "a run whose recipe.json is a symlink to a secret, exported",
         exported_recipe_symlink),
    Case("npz-header-2^45", "`mindvl moe-analyze` of an .npz whose header declares 2^45 elements", npz_header_2_45),
    Case("npz-bzip2-bomb", "`mindvl moe-analyze` of a 64 MiB bzip2 bomb in a few hundred bytes", npz_bzip2_bomb),
    Case("config-deeply-nested", "config.json nested 50,000 deep", config_deeply_nested),
    Case("config-vocab-2^70", "config.json with text.vocab_size 2^70", config_vocab_2_70),
    Case("moe-trace-pickled-bin", "`mindvl moe-trace` of a transformers folder holding only pytorch_model.bin",
         moe_trace_pickled_bin),
    Case("index-names-another-folder", "a safetensors index naming ../victim/model.safetensors",
         index_names_another_folder),
    Case("chat-template-bomb", "a chat template with nested range(100000) loops", chat_template_bomb),
    Case("run-folder-lock-symlink", "`train resume=auto` into a run folder whose .lock is a symlink",
         run_folder_lock_symlink),
]


def run_case(case: Case, tmp: Path, model: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess,
                                                                                 list[str]]:
    """Build the case under `tmp` and run it; (the finished process, the names its message must contain)."""
    argv, names = case.build(tmp, model)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("MINDVL_DEBUG", None)
    cmd = [sys.executable, "-c", case.code, *argv]
    if case.code == CLI:  # forked with torch and mindvl imported (tests/prefork.py); the others change imports
        cmd = prefork.command(cmd[1:], env)
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    return proc, names
