"""Single .safetensors files in their original layout streamed on CUDA from their mapping,
registered where used as saved, equal to diffusers' `from_single_file` model on the device."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
diffusers = pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from single_file_layouts import flux_original, wan_original  # noqa: E402
from test_single_file_mapping import FLUX_WIDE, random_model  # noqa: E402


def run(model, name, dtype, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype, "cuda"))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_an_original_layout_file_streams_registered_on_cuda_equal_to_diffusers(tmp_path, name):
    if name == "wan":
        model, dtype = TINY_MODELS["wan"].build(seed=2), torch.float32
        layout = wan_original
    else:
        model, dtype = random_model(diffusers.FluxTransformer2DModel, FLUX_WIDE, torch.bfloat16), torch.bfloat16
        layout = lambda state: flux_original(state, 1, 1)  # noqa: E731
    config_dir, path = tmp_path / "config", tmp_path / f"{name}.safetensors"
    model.save_config(config_dir)
    save_file(layout({k: v.contiguous() for k, v in model.state_dict().items()}), path)
    reference = type(model).from_single_file(str(path), config=str(config_dir), torch_dtype=dtype).eval().cuda()
    expected = run(reference, name, dtype)
    del reference, model
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    with dlo.enable(loaded, "cuda", dlo.OffloadConfig(num_slots=2), plan=plan) as handle:
        got = run(loaded, name, dtype)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.host_bytes == 0 and stats.registered_bytes > 0 and stats.staging_bytes == 0
