"""Shared fixtures for the data pipeline tests: the default tokenizer, small synthetic corpora, file writers."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindvl.data.synth import generate
from mindvl.data.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    """60 synthetic samples (all four tasks), generated once per session."""
    out = tmp_path_factory.mktemp("synth")
    generate(out, 60, seed=1)
    return out
