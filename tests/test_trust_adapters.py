"""A received adapter folder (issue 41): its adapter_config.json is read as bounded JSON from a regular file, and its
weights only from a regular file inside the folder; anything else is one line naming the file."""

from __future__ import annotations

import json
import os

import pytest
from tiny_mindvl import tiny_model

from mindvl.checkpoint.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base, read_adapter

LORA = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "base_model_name_or_path": "."}


def test_a_deeply_nested_or_fifo_adapter_config_is_one_line(tmp_path):
    config = tiny_model().config
    (tmp_path / ADAPTER_CONFIG).write_text("[" * 50_000 + "]" * 50_000)
    for call in (lambda: read_adapter(tmp_path, config), lambda: adapter_base(tmp_path)):
        with pytest.raises(ValueError, match="not a readable adapter config") as err:
            call()
        assert str(tmp_path / ADAPTER_CONFIG) in str(err.value) and "\n" not in str(err.value)
    os.remove(tmp_path / ADAPTER_CONFIG)
    os.mkfifo(tmp_path / ADAPTER_CONFIG)  # would block a plain read forever
    with pytest.raises(ValueError, match="not a readable adapter config"):
        read_adapter(tmp_path, config)


def test_adapter_weights_linked_from_outside_the_folder_are_refused(tmp_path):
    folder, outside = tmp_path / "adapter", tmp_path / "elsewhere.safetensors"
    folder.mkdir()
    outside.write_bytes(b"SECRET")
    (folder / ADAPTER_CONFIG).write_text(json.dumps(LORA))
    os.symlink(outside, folder / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="not readable adapter weights.*resolves outside"):
        read_adapter(folder, tiny_model().config)
