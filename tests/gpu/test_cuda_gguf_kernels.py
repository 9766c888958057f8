"""dlo.use_gguf_kernels on CUDA: every kernel's output equals diffusers' dequantization bit for
bit, and a Flux GGUF model streamed by dlo with the kernels equals the same model resident with
them (and diffusers' own resident GGUF model). See [Note: GGUF kernels] and [Note: GGUF kernel
Linears]."""

import warnings

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")
from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor  # noqa: E402
from gguf_blocks import KERNEL_QUANTS, WIDE_FLUX, gguf_parameter, random_blocks, same_values  # noqa: E402
from gguf_files import write_gguf  # noqa: E402

from dlo.backend.gguf_kernels import KERNELS, dequantize  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(autouse=True)
def _quiet_diffusers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("quant", KERNEL_QUANTS)
def test_every_kernel_equals_diffusers_dequantization_on_cuda(quant):
    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    assert (KERNELS[quant].values, KERNELS[quant].bytes) == (values, nbytes)
    # Odd row counts (partial programs), a Flux-sized weight, and float16 fields holding anything.
    for rows, columns, finite in [(17, 3072, True), (3072, 3072, True), (33, 1280, False)]:
        packed = random_blocks(quant, rows, columns, seed=rows, finite=finite)
        on_cpu = dequantize_gguf_tensor(gguf_parameter(packed, quant))
        on_gpu = dequantize_gguf_tensor(gguf_parameter(packed.cuda(), quant))
        # A slot holds it at any byte offset: the kernels read bytes, whatever the alignment.
        buffer = torch.zeros(packed.numel() + 1, dtype=torch.uint8, device="cuda")
        buffer[1:].copy_(packed.flatten())
        unaligned = buffer[1:].view(packed.shape)
        for dtype in DTYPES:
            got = dequantize(packed.cuda(), quant, dtype)
            assert got.shape == (rows, columns) and got.dtype == dtype and got.is_cuda
            assert same_values(got, on_gpu.to(dtype)), (rows, columns, finite, dtype)
            assert same_values(got.cpu(), on_cpu.to(dtype)), (rows, columns, finite, dtype)
            assert same_values(dequantize(unaligned, quant, dtype), got)


def _load(path, config_dir, dtype):
    quantization = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
    return diffusers.FluxTransformer2DModel.from_single_file(
        str(path), config=str(config_dir), quantization_config=quantization, torch_dtype=dtype
    ).eval()


def _outputs(model, dtype, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**TINY_MODELS["flux"].inputs(seed, dtype, "cuda"))[0] for seed in seeds]


@pytest.fixture(scope="module")
def wide_flux(tmp_path_factory):
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**WIDE_FLUX)
    directory = tmp_path_factory.mktemp("wide-flux")
    model.save_config(directory)
    return model, directory


@pytest.mark.parametrize(
    ("quant", "dtype"),
    [(q, torch.bfloat16) for q in KERNEL_QUANTS] + [("Q8_0", torch.float32), ("Q4_K", torch.float32)],
    ids=lambda v: getattr(v, "name", None) or str(v).replace("torch.", ""),
)
def test_flux_gguf_streamed_with_the_kernels_equals_resident_with_them_on_cuda(tmp_path, wide_flux, quant, dtype):
    model, config_dir = wide_flux
    path = write_gguf(model, tmp_path / f"{quant}.gguf", gguf.GGMLQuantizationType[quant])
    plain, resident, streamed = (_load(path, config_dir, dtype) for _ in range(3))
    expected = _outputs(plain.cuda(), dtype)
    assert all(torch.isfinite(e).all() for e in expected)
    with dlo.use_gguf_kernels(resident.cuda()) as kernels:
        assert kernels.converted == sum(isinstance(m, GGUFLinear) for m in resident.modules()) > 0
        got_resident = _outputs(resident, dtype)
    # Before dlo.enable for some types, after it for the others: the same parameters either way.
    if KERNEL_QUANTS.index(quant) % 2:
        kernels = dlo.use_gguf_kernels(streamed)
        handle = dlo.enable(streamed, "cuda")
    else:
        handle = dlo.enable(streamed, "cuda")
        kernels = dlo.use_gguf_kernels(streamed)
    with handle, kernels:
        got_streamed = _outputs(streamed, dtype)
        assert handle.stats().streamed_blocks > 0
    assert [torch.equal(a, b) for a, b in zip(got_resident, got_streamed)] == [True, True, True]
    assert [torch.equal(a, b) for a, b in zip(expected, got_resident)] == [True, True, True]
