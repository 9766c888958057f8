import copy

import pytest
import torch

from dlo.models.tiny import TINY_MODELS


@pytest.fixture
def tiny_pair():
    """(resident reference, deep copy to stream, tiny model entry) for a tiny model name."""

    def make(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
        entry = TINY_MODELS[name]
        reference = entry.build(seed=seed, dtype=dtype)
        return reference, copy.deepcopy(reference), entry

    return make
