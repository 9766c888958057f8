"""The tiny pipeline directories load from disk and generate deterministically at the requested size."""

import numpy as np
import pytest
import torch

from dlo.models.tiny_pipelines import GENERATE_DEFAULTS, save_tiny_flux_pipeline, save_tiny_wan_pipeline


def _generate(pipe, name: str) -> np.ndarray:
    generator = torch.Generator().manual_seed(0)
    result = pipe(prompt="a red cube", num_inference_steps=2, generator=generator, **GENERATE_DEFAULTS[name])
    return np.asarray(result.images[0] if name == "flux" else result.frames[0])


@pytest.mark.parametrize(
    ("name", "save", "pipeline_class"),
    [("flux", save_tiny_flux_pipeline, "FluxPipeline"), ("wan", save_tiny_wan_pipeline, "WanPipeline")],
    ids=["flux", "wan"],
)
def test_tiny_pipeline_loads_and_generates(tmp_path, monkeypatch, name, save, pipeline_class):
    import diffusers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = save(tmp_path / name)
    assert sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) < 20 * 2**20
    pipe = diffusers.DiffusionPipeline.from_pretrained(directory)
    assert type(pipe).__name__ == pipeline_class
    pipe.set_progress_bar_config(disable=True)

    first, second = _generate(pipe, name), _generate(pipe, name)

    defaults = GENERATE_DEFAULTS[name]
    size = (defaults["height"], defaults["width"], 3)
    assert first.shape == (size if name == "flux" else (defaults["num_frames"], *size))
    assert np.array_equal(first, second)
    assert first.std() > 0
