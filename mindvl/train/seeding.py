"""`seed=` reaches everything random that is not pinned by its own seed.

- model init: `model.init_seed`, else the recipe's `seed` (materialize.init_seed);
- data order (unit shuffles, mixture draws): `data.seed`, else the recipe's `seed`;
- torch / NumPy / Python global generators (anything else random in the step): `seed + rank`.
Synthetic sources keep their own `synth.seed` (it names the generated data set, not the run).
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch

from mindvl.config import Recipe
from mindvl.data import DataConfig


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def data_section(recipe: Recipe) -> DataConfig:
    """The recipe's data config (`seed` defaulted to the recipe's `seed` at load), as a copy the caller may fill in
    (the trainer sets `video.tokens_per_second` from the model)."""
    return copy.deepcopy(recipe.data)
