"""enable_pipeline(components=...) on CUDA: text encoders (and the VAE) streamed by dlo beside
the transformer, each through its own slots, equal to the pipeline resident."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dlo
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS, save_tiny_flux_pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
diffusers = pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plain_pipeline import plain_pipeline  # noqa: E402


def image(pipe):
    kwargs = dict(GENERATE_DEFAULTS["flux"])
    with torch.inference_mode():
        out = pipe("a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(0), **kwargs)
    return np.asarray(out.images[0])


@pytest.mark.parametrize("components", [["text_encoder", "text_encoder_2"], "auto"])
def test_streamed_components_equal_the_resident_pipeline_on_cuda(tmp_path, components):
    save_tiny_flux_pipeline(tmp_path / "flux")
    expected = image(plain_pipeline(tmp_path / "flux").to("cuda"))
    pipe = plain_pipeline(tmp_path / "flux")
    # reserve_gib beyond the device: nothing fits, so "auto" streams every component it can.
    with dlo.enable_pipeline(pipe, "cuda", components=components, reserve_gib=1e6) as handle:
        got = image(pipe)
        placement = dict(handle.placement)
    assert np.array_equal(got, expected)
    assert placement["text_encoder"] == placement["text_encoder_2"] == "streamed"
    if components == "auto":
        assert placement["vae"] == "streamed"
