"""Models loaded by diffusers from safetensors checkpoints stream like freshly built ones."""

import pytest
import torch
from ordinary_tensors import ordinary_tensors

import dlo
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("shard", [None, "200KB"])
def test_from_pretrained_model_matches_an_ordinary_allocation(tmp_path, shard):
    """Whatever storage from_pretrained leaves behind (mmap views, offsets inside shards),
    dlo packs streamed blocks at 512-byte offsets and copies the rest into ordinary
    allocations on cpu, so the result equals a model whose every tensor was cloned."""
    entry = TINY_MODELS["flux"]
    kwargs = {"max_shard_size": shard} if shard else {}
    entry.build(seed=3).save_pretrained(tmp_path, **kwargs)
    shards = len(list(tmp_path.glob("*.safetensors")))
    assert shards == 1 if shard is None else shards > 1

    reference = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path).eval()
    ordinary_tensors(reference)
    streamed = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path).eval()
    with torch.inference_mode():
        expected = [reference(**entry.inputs(seed))[0] for seed in (1, 2)]
    with dlo.enable(streamed, "cpu"), torch.inference_mode():
        got = [streamed(**entry.inputs(seed))[0] for seed in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
