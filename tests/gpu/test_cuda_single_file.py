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
from single_file_layouts import flux_original, sd3_original, wan_original  # noqa: E402
from test_single_file_mapping import FLUX_WIDE, random_model  # noqa: E402


def run(model, name, dtype, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype, "cuda"))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux", "sd3"])
def test_an_original_layout_file_streams_registered_on_cuda_equal_to_diffusers(tmp_path, name):
    """SD3's last block holds a concatenation (its context norm's halves swapped): its parts are
    copied straight from the registered mapping into their rows of the slot, as every other
    tensor is (no staging)."""
    if name == "wan":
        model, dtype = TINY_MODELS["wan"].build(seed=2), torch.float32
        layout = wan_original
    elif name == "sd3":
        model, dtype = TINY_MODELS["sd3"].build(seed=2), torch.float32
        layers = model.config.num_layers
        layout = lambda state: sd3_original(state, layers)  # noqa: E731
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


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_a_gguf_file_streams_its_packed_bytes_registered_on_cuda_equal_to_diffusers(tmp_path, quant):
    """A GGUF file mapped by dlo.load_transformer: its packed bytes copied straight from the
    registered mapping (its small casts converted once beside it), equal to diffusers' GGUF model
    resident on the device, with diffusers' dequantization and with dlo's kernels."""
    gguf = pytest.importorskip("gguf")
    from gguf_files import WIDE_WAN, load_gguf, write_gguf

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WIDE_WAN)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", gguf.GGMLQuantizationType[quant])
    reference = load_gguf(path, tmp_path, "WanTransformer3DModel", torch.bfloat16).cuda()
    expected = run(reference, "wan", torch.bfloat16)
    with dlo.use_gguf_kernels(reference):
        expected_kernels = run(reference, "wan", torch.bfloat16)
    del reference
    for kernels in (False, True):
        loaded, plan = dlo.load_transformer(path, torch_dtype=torch.bfloat16, model_config=tmp_path)
        swapped = dlo.use_gguf_kernels(loaded) if kernels else None
        with dlo.enable(loaded, "cuda", dlo.OffloadConfig(num_slots=2), plan=plan) as handle:
            got = run(loaded, "wan", torch.bfloat16)
            stats = handle.stats()
        if swapped is not None:
            swapped.restore()
        assert all(torch.equal(a, b) for a, b in zip(expected_kernels if kernels else expected, got))
        # Private host memory: the small casts beside the mapping only (the packed bytes are the file's).
        assert 0 < stats.host_bytes < path.stat().st_size / 16
        assert stats.registered_bytes > 0 and stats.staging_bytes == 0


def test_an_sd3_scaled_fp8_file_streams_on_cuda_equal_to_its_dequantized_weights(tmp_path):
    """SD3's swapped float8 norms are computed at load into the private file (their per-tensor
    scale kept) and stream beside the mapped float8 weights, dequantized on the device: equal to
    diffusers' single-file model of the same weights dequantized, resident on the device."""
    from test_single_file_mapping import reference, sd3_scaled_fp8

    path, config_dir, dequantized, model = sd3_scaled_fp8(tmp_path, per_row=False)
    expected = run(reference(dequantized, config_dir, type(model), torch.bfloat16).cuda(), "sd3", torch.bfloat16)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    with dlo.enable(loaded, "cuda", dlo.OffloadConfig(num_slots=2), plan=plan) as handle:
        got = run(loaded, "sd3", torch.bfloat16)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes > 0 and stats.host_bytes > 0  # the private norms beside the registered file


@pytest.mark.parametrize("per_row", [False, True], ids=["per tensor", "per row"])
def test_a_comfyui_fp8mixed_flux2_file_streams_on_cuda_equal_to_its_dequantized_weights(tmp_path, per_row):
    """ComfyUI's current format (`weight_scale`, `input_scale`, `comfy_quant`), the double blocks
    float8: each split q/k/v part streams registered from the mapping with its weight's scale (per
    row: the scale's rows beside its own), dequantized on the device, equal to diffusers' model of
    the dequantized weights resident on the device."""
    from test_quantized_single_files import flux2_file
    from test_single_file_mapping import per_row_fp8, reference, scaled_fp8

    quantize = per_row_fp8 if per_row else scaled_fp8
    path, config_dir, dequantized, _ = flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks."), quantize=quantize)
    expected = run(reference(dequantized, config_dir, diffusers.Flux2Transformer2DModel, torch.bfloat16).cuda(), "flux2", torch.bfloat16)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    with dlo.enable(loaded, "cuda", dlo.OffloadConfig(num_slots=2), plan=plan) as handle:
        got = run(loaded, "flux2", torch.bfloat16)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes > 0 and stats.host_bytes == 0
