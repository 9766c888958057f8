"""`save_pretrained` of a model streamed on CUDA (See [Note: saving a streamed model]): blocks
streamed from pinned host copies, kept resident on the device, float8-streamed, and one running
on its slot (a save from a hook inside a call) save the safetensors files the resident model on
the same GPU saves, byte for byte."""

import copy

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def same_weight_files(got, expected) -> bool:
    names = sorted(p.name for p in got.iterdir())
    return names == sorted(p.name for p in expected.iterdir()) and all(
        (got / n).read_bytes() == (expected / n).read_bytes() for n in names
    )


@pytest.mark.parametrize(
    "config",
    [dlo.OffloadConfig(), dlo.OffloadConfig(resident_layers=1), dlo.OffloadConfig(stream_dtype="fp8")],
    ids=["pinned", "resident-layer", "fp8"],
)
@pytest.mark.parametrize("inside_a_call", [False, True], ids=["between-calls", "inside-a-call"])
def test_a_save_on_cuda_writes_the_resident_models_files(tmp_path, config, inside_a_call):
    entry = TINY_MODELS["flux"]
    reference = entry.build(seed=0, dtype=torch.bfloat16)
    streamed = copy.deepcopy(reference)
    reference = reference.to("cuda")
    dlo.quantize_resident(reference, config)
    options = dict(max_shard_size="20KB")
    reference.save_pretrained(tmp_path / "resident", **options)
    inputs = entry.inputs(1, torch.bfloat16, "cuda")
    with dlo.enable(streamed, "cuda", config), torch.inference_mode():
        if inside_a_call:
            inside = streamed.transformer_blocks[1].norm1.linear
            hook = inside.register_forward_pre_hook(lambda m, a: streamed.save_pretrained(tmp_path / "streamed", **options))
            got = streamed(**inputs)[0]
            hook.remove()
        else:
            got = streamed(**inputs)[0]
            streamed.save_pretrained(tmp_path / "streamed", **options)
        assert torch.equal(got, reference(**inputs)[0])
        assert torch.equal(streamed(**inputs)[0], reference(**inputs)[0])
    assert same_weight_files(tmp_path / "streamed", tmp_path / "resident")
