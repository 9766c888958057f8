"""fp8 streaming on CUDA: float8 weights cross the link into a landing buffer and are
dequantized into the slot on the dequantization stream; outputs equal the same quantized
model run resident on the GPU. See [Note: fp8 streaming] and [Note: fp8 landing]"""

import copy

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS
from wide_models import WAN_MB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = {"wan": TINY_MODELS["wan"], "flux": TINY_MODELS["flux"], "wan-8mb": WAN_MB}


def outputs(model, entry, seeds, dtype):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, dtype, "cuda"))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux", "wan-8mb"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", ["per_channel", "per_tensor"])
@pytest.mark.parametrize(("num_slots", "resident_layers"), [(2, 0), (3, 1)])
def test_fp8_streamed_matches_the_quantized_model_resident_on_cuda(name, dtype, scale, num_slots, resident_layers):
    entry = MODELS[name]
    model = entry.build(seed=0, dtype=dtype)
    config = dlo.OffloadConfig(
        stream_dtype="fp8", fp8_scale=scale, num_slots=num_slots, resident_layers=resident_layers
    )
    reference = copy.deepcopy(model).cuda()
    assert dlo.quantize_resident(reference, config) > 0  # dequantized on the GPU
    seeds = [1, 2, 3, 4]
    expected = outputs(reference, entry, seeds, dtype)
    with dlo.enable(model, "cuda", config) as handle:
        got = outputs(model, entry, seeds, dtype)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.pinned and "float8_e4m3fn" in stats.host_bytes_by_dtype


def test_fp8_auto_residency_promotes_dequantized_blocks_on_cuda():
    entry = WAN_MB
    model = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(stream_dtype="fp8", resident_layers="auto")
    reference = copy.deepcopy(model).cuda()
    dlo.quantize_resident(reference, config)
    seeds = [1, 2, 3, 4]
    expected = outputs(reference, entry, seeds, torch.bfloat16)
    with dlo.enable(model, "cuda", config) as handle:
        got = outputs(model, entry, seeds, torch.bfloat16)
        stats = handle.stats()
    assert stats.residency.state == "planned" and stats.resident_blocks > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 37, 3072])
def test_the_one_pass_kernel_computes_what_the_two_torch_kernels_compute(fp8, dtype, rows):
    """The definition, round(float(q) * scale), as torch computes it in two exact steps."""
    pytest.importorskip("triton")
    from dlo.host.fp8_codec import dequantize_into

    generator = torch.Generator(device="cuda").manual_seed(rows)
    data = (torch.randn(rows, 4099, device="cuda", generator=generator) * 64).clamp(-400, 400).to(fp8)
    for scale in (torch.rand(rows, 1, device="cuda", generator=generator) * 1e-2, torch.tensor([[3.7e-3]], device="cuda")):
        expected = torch.empty(data.shape, dtype=dtype, device="cuda")
        expected.copy_(data)
        expected.mul_(scale)
        got = torch.empty_like(expected)
        dequantize_into(got, data, scale)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("pin_limit_gib", [0.0, 1e-6], ids=["registered", "staged"])
def test_a_float8_checkpoint_streams_on_cuda_as_its_dequantized_weights(tmp_path, pin_limit_gib):
    """Registered: float8 bytes copied straight from the mapping into the landing buffers;
    over the pin limit: packed into pinned staging buffers first."""
    from fp8_checkpoints import resident_from, write_fp8_checkpoint

    directory, dequantized = write_fp8_checkpoint(tmp_path)
    entry = TINY_MODELS["flux"]
    expected = outputs(resident_from(dequantized).cuda(), entry, [1, 2, 3], torch.bfloat16)
    config = dlo.OffloadConfig(pin_limit_gib=pin_limit_gib)
    model, plan = dlo.load_transformer(directory, config)
    with dlo.enable(model, "cuda", config, plan=plan) as handle:
        got = outputs(model, entry, [1, 2, 3], torch.bfloat16)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert (stats.registered_bytes > 0) == (pin_limit_gib == 0.0)
    assert (stats.staging_bytes > 0) == (pin_limit_gib > 0.0)


def test_float8_and_unquantized_blocks_share_the_slots_through_interrupted_calls():
    """Double blocks float8 (written on the dequantization stream), single blocks bf16
    (written on the copy stream) in the same slots; a call interrupted after its second
    block leaves prefetched float8 blocks that never ran, and the next writer of their slots
    must wait for them. Every later call equals the quantized model resident."""
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_skip=("single_transformer_blocks",), num_slots=3)
    reference = copy.deepcopy(model).cuda()
    dlo.quantize_resident(reference, config)
    expected = outputs(reference, entry, [1, 2, 3], torch.bfloat16)

    class Stop(Exception):
        pass

    def stop(module, args):
        raise Stop

    with dlo.enable(model, "cuda", config) as handle:
        assert {"float8_e4m3fn", "bfloat16"} <= handle.stats().host_bytes_by_dtype.keys()
        for seed, want in zip([1, 2, 3], expected):
            hook = model.transformer_blocks[1].register_forward_pre_hook(stop)
            with pytest.raises(Stop), torch.inference_mode():
                model(**entry.inputs(seed, torch.bfloat16, "cuda"))
            hook.remove()
            assert torch.equal(outputs(model, entry, [seed], torch.bfloat16)[0], want)


def test_streaming_runs_the_one_pass_kernel_where_it_is_available(monkeypatch):
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the one-pass kernel needs compute capability 8.9 or newer")
    from dlo.host import fp8_codec
    from dlo.host.fp8_kernel import dequantize_cuda

    launches = []

    def counted(target, data, scale):
        launches.append(target.numel())
        dequantize_cuda(target, data, scale)

    monkeypatch.setattr(fp8_codec, "_fused_kernel", lambda device: counted)
    entry = WAN_MB
    model = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(stream_dtype="fp8")
    reference = copy.deepcopy(model).cuda()
    dlo.quantize_resident(reference, config)
    expected = outputs(reference, entry, [1], torch.bfloat16)
    launches.clear()
    with dlo.enable(model, "cuda", config):
        got = outputs(model, entry, [1], torch.bfloat16)
    assert torch.equal(expected[0], got[0])
    weights = sum(m.weight.numel() for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
    assert sum(launches) >= weights  # every streamed weight went through it (and the warm-up)


@pytest.mark.parametrize("name", ["wan", "flux", "wan-8mb"])
@pytest.mark.parametrize("scale", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("resident_layers", [0, 1, "auto"])
def test_fp8_gemms_streamed_match_the_same_gemms_resident_on_cuda(name, scale, resident_layers):
    """See [Note: fp8 compute]: the slot holds the float8 weights, the block runs torch._scaled_mm."""
    from dlo.hotpath.fp8_gemm import Fp8GemmLinear

    entry = MODELS[name]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_scale=scale, fp8_compute=True, resident_layers=resident_layers)
    reference = copy.deepcopy(model).cuda()
    dlo.quantize_resident(reference, config)
    assert any(type(m) is Fp8GemmLinear for m in reference.modules())
    weight_only = copy.deepcopy(model).cuda()
    dlo.quantize_resident(weight_only, dlo.OffloadConfig(stream_dtype="fp8", fp8_scale=scale))
    seeds = [1, 2, 3, 4]
    expected = outputs(reference, entry, seeds, torch.bfloat16)
    with dlo.enable(model, "cuda", config) as handle:
        got = outputs(model, entry, seeds, torch.bfloat16)
        gemms = sum(type(m) is Fp8GemmLinear for m in model.modules())
        stats = handle.stats()
    assert gemms > 0 and stats.pinned
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # The activations were quantized too: not the weight-only model's outputs.
    assert not torch.equal(got[0], outputs(weight_only, entry, seeds[:1], torch.bfloat16)[0])


def test_an_fp8_gemm_takes_inputs_that_are_not_row_major_on_cuda():
    """cuBLASLt takes a row-major first operand only: the Linear makes its input rows so."""
    from dlo.hotpath.fp8_gemm import Fp8GemmLinear

    model = TINY_MODELS["flux"].build(seed=0, dtype=torch.bfloat16).cuda()
    dlo.quantize_resident(model, dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True))
    linear = next(m for m in model.modules() if type(m) is Fp8GemmLinear)
    generator = torch.Generator(device="cuda").manual_seed(0)
    columns = torch.randn(1, linear.in_features, 7, generator=generator, device="cuda", dtype=torch.bfloat16)
    transposed = columns.transpose(1, 2)  # (1, 7, in): a batch-1 view whose rows are columns in memory
    with torch.inference_mode():
        assert torch.equal(linear(transposed), linear(transposed.contiguous()))
