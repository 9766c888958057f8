"""FP8 GEMMs in streamed blocks (See [Note: fp8 compute]): eligible Linears keep float8
weights in the slot and run torch._scaled_mm; the streamed model equals the same model
converted resident by dlo.quantize_resident, bit for bit."""

import copy

import pytest
import torch
from torch import nn

import dlo
from dlo.backend.fp8_compute import check_fp8_gemms
from dlo.errors import ConfigError, EnableError
from dlo.hotpath.fp8_gemm import Fp8GemmLinear, quantize_rows
from dlo.models.tiny import TINY_MODELS, TinyModel

GEMMS = dict(stream_dtype="fp8", fp8_compute=True, num_slots=3)
# Wan with a feed-forward width that is no multiple of 16: its ff Linears cannot be FP8 GEMMs
# and stream as dequantized float8 beside the attention's GEMMs, in the same blocks.
WAN_MIXED = TinyModel("wan-mixed", "WanTransformer3DModel", {**TINY_MODELS["wan"].config, "ffn_dim": 40},
                      TINY_MODELS["wan"].make_inputs)


def outputs(model, entry, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, torch.bfloat16))[0] for seed in seeds]


def gemm_names(model):
    return {name for name, module in model.named_modules() if type(module) is Fp8GemmLinear}


def relative_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", ["wan", "flux", "hunyuanvideo"])
@pytest.mark.parametrize("scale", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("resident_layers", [0, 1])
def test_streamed_fp8_gemms_match_the_same_gemms_resident(name, scale, resident_layers):
    entry = TINY_MODELS[name]
    unquantized = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(**GEMMS, fp8_scale=scale, resident_layers=resident_layers)
    reference, streamed, weight_only = (copy.deepcopy(unquantized) for _ in range(3))
    dlo.quantize_resident(reference, config)
    dlo.quantize_resident(weight_only, dlo.OffloadConfig(stream_dtype="fp8", fp8_scale=scale))
    expected = outputs(reference, entry)
    with dlo.enable(streamed, "cpu", config):
        converted = gemm_names(streamed)
        got = outputs(streamed, entry)
    assert converted and converted == gemm_names(reference)
    first_block = f"{dlo.discover(unquantized).block_lists[0]}.0."  # resident with resident_layers=1
    assert any(n.startswith(first_block) for n in converted) == (resident_layers == 0)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # The activations were quantized too (not the weight-only outputs), by about float8's rounding.
    plain, weight_only_out = outputs(unquantized, entry), outputs(weight_only, entry)
    assert not any(torch.equal(a, b) for a, b in zip(got, weight_only_out))
    assert all(0 < relative_error(a, b) < 0.05 for a, b in zip(got, plain))


def test_gemm_and_dequantized_linears_share_blocks_and_slots():
    unquantized = WAN_MIXED.build(seed=0, dtype=torch.bfloat16)
    reference, streamed = copy.deepcopy(unquantized), copy.deepcopy(unquantized)
    config = dlo.OffloadConfig(**GEMMS)
    dlo.quantize_resident(reference, config)
    with dlo.enable(streamed, "cpu", config) as handle:
        converted = gemm_names(streamed)
        got = outputs(streamed, WAN_MIXED)
        landing = handle._runtime.transfer.landings
    assert all(torch.equal(a, b) for a, b in zip(outputs(reference, WAN_MIXED), got))
    assert converted and not any(".ffn." in name for name in converted)
    assert landing and landing[0].numel() > 0  # the ff weights still land and are dequantized


def test_linears_that_cannot_be_gemms_stay_plain_linears():
    """A Linear subclass (its own forward), a weight tied between two Linears: dequantized float8."""

    class Marked(nn.Linear):
        pass

    model = TINY_MODELS["wan"].build(seed=0, dtype=torch.bfloat16)
    attention = model.blocks[0].attn1
    marked = Marked(attention.to_out[0].in_features, attention.to_out[0].out_features, dtype=torch.bfloat16)
    marked.load_state_dict(attention.to_out[0].state_dict())
    attention.to_out[0] = marked
    attention.to_k.weight = attention.to_q.weight
    reference, streamed = copy.deepcopy(model), copy.deepcopy(model)
    config = dlo.OffloadConfig(**GEMMS)
    dlo.quantize_resident(reference, config)
    with dlo.enable(streamed, "cpu", config):
        converted = gemm_names(streamed)
        got = outputs(streamed, TINY_MODELS["wan"])
    assert "blocks.0.attn1.to_v" in converted
    assert not {"blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_out.0"} & converted
    assert all(torch.equal(a, b) for a, b in zip(outputs(reference, TINY_MODELS["wan"]), got))


@pytest.mark.parametrize("scale", ["per_channel", "per_tensor"])
def test_disable_gives_back_linears_holding_the_dequantized_weights(scale):
    model = TINY_MODELS["flux"].build(seed=0, dtype=torch.bfloat16)
    weight_only = copy.deepcopy(model)
    dlo.quantize_resident(weight_only, dlo.OffloadConfig(stream_dtype="fp8", fp8_scale=scale))
    with dlo.enable(model, "cpu", dlo.OffloadConfig(**GEMMS, fp8_scale=scale)):
        outputs(model, TINY_MODELS["flux"], seeds=(1,))
    assert not gemm_names(model)
    state, expected = model.state_dict(), weight_only.state_dict()
    assert state.keys() == expected.keys()  # no weight_scale left
    assert all(torch.equal(state[k], expected[k]) and state[k].dtype == expected[k].dtype for k in expected)


def test_a_failed_enable_gives_back_the_weights_it_found(monkeypatch):
    from dlo.hotpath.transfer import SyncTransfer

    model = TINY_MODELS["wan"].build(seed=0, dtype=torch.bfloat16)
    found = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    expected = outputs(model, TINY_MODELS["wan"])

    def out_of_memory(self, nbytes):
        raise torch.OutOfMemoryError("fake device out of memory")

    monkeypatch.setattr(SyncTransfer, "allocate_slot", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        dlo.enable(model, "cpu", dlo.OffloadConfig(**GEMMS))
    monkeypatch.undo()
    assert not gemm_names(model)
    state = model.state_dict()
    assert state.keys() == found.keys()
    assert all(torch.equal(state[k], found[k]) and state[k].dtype == found[k].dtype for k in found)
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, TINY_MODELS["wan"]), expected))


def test_fp8_gemms_compile_whole_blocks_and_still_match_the_compiled_resident_model():
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(**GEMMS)
    reference, streamed = copy.deepcopy(model), copy.deepcopy(model)
    dlo.quantize_resident(reference, config)
    torch._dynamo.reset()
    reference.compile_repeated_blocks(fullgraph=True)  # fullgraph: a graph break in a block raises
    expected = outputs(reference, entry, seeds=(1, 2))
    torch._dynamo.reset()  # the streamed model compiles its own graphs
    with dlo.enable(streamed, "cpu", config) as handle:
        streamed.compile_repeated_blocks(fullgraph=True)
        got = outputs(streamed, entry, seeds=(1, 2))
        assert handle.stats().compile.graphs > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_rows_are_quantized_by_the_weights_rule():
    rows = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0, 1e-3, -7.0]], dtype=torch.bfloat16)
    data, scale = quantize_rows(rows, torch.float8_e4m3fn)
    assert scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert torch.equal(scale[:, 0], torch.tensor([2.0 / 448, 1.0, 1.0]))  # an all-zero row: scale 1
    assert data.dtype == torch.float8_e4m3fn and float(data[0].float().abs().max()) == 448.0
    assert torch.equal(data[1].float(), torch.zeros(3)) and torch.equal(data[2, 0].float(), torch.tensor(448.0))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(fp8_compute=True), "needs stream_dtype='fp8'"),
        (dict(fp8_compute=True, stream_dtype="float8_e5m2"), "got 'float8_e5m2'"),
        (dict(fp8_compute=True, stream_dtype="fp8", host_weight_cache=True), "host_weight_cache=False"),
        (dict(fp8_compute=1, stream_dtype="fp8"), "fp8_compute must be True or False"),
    ],
)
def test_config_refuses_fp8_compute_without_what_it_needs(fields, message):
    with pytest.raises(ConfigError, match=message):
        dlo.OffloadConfig(**fields)


def test_a_model_with_no_eligible_linear_is_refused_unchanged():
    model = TINY_MODELS["wan"].build(seed=0, dtype=torch.float32)  # fp32 weights: no row-wise GEMM output
    found = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ConfigError, match="found no Linear .* bf16 weights"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(**GEMMS))
    with pytest.raises(ConfigError, match="found no Linear"):
        dlo.quantize_resident(copy.deepcopy(model), dlo.OffloadConfig(**GEMMS))
    assert all(torch.equal(t, found[k]) and t.dtype == found[k].dtype for k, t in model.state_dict().items())


def test_load_transformer_refuses_a_mapped_load_before_reading_anything(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint_mmap=False"):
        dlo.load_transformer(tmp_path / "not-there", dlo.OffloadConfig(**GEMMS))


def test_enable_refuses_a_host_weight_plan_and_leaves_it_usable(tmp_path):
    TINY_MODELS["wan"].build(seed=0, dtype=torch.bfloat16).save_pretrained(tmp_path)
    model, plan = dlo.load_transformer(tmp_path)
    assert plan is not None
    with pytest.raises(ConfigError, match="checkpoint_mmap=False"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(**GEMMS), plan=plan)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(), plan=plan):
        outputs(model, TINY_MODELS["wan"], seeds=(1,))


def test_devices_without_fp8_gemms_are_refused(monkeypatch):
    with pytest.raises(EnableError, match="fp8_compute=False"):
        check_fp8_gemms(torch.device("meta"))
    # The driver's answer for an A100 (capability 8.0): faked, there is no GPU here.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(EnableError, match=r"A100 \(compute capability 8\.0\) lacks"):
        check_fp8_gemms(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_gemms(torch.device("cuda", 0))  # Hopper: accepted
