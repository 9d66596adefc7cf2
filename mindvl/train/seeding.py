"""`seed=` reaches everything random that is not pinned by its own seed.

- model init: `model.init_seed`, else the recipe's `seed` (materialize.init_seed);
- data order (unit shuffles, mixture draws): `data.seed`, else the recipe's `seed`;
- torch / NumPy / Python global generators (anything else random in the step): `seed + rank`.
Synthetic sources keep their own `synth.seed` (it names the generated data set, not the run).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from mindvl.config import Recipe


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def data_section(recipe: Recipe) -> dict:
    """The recipe's `data:` with `seed` defaulting to the recipe's `seed`."""
    return {"seed": recipe.seed, **recipe.data}
