"""FP8 GEMMs in streamed blocks (See [Note: fp8 compute]): eligible Linears keep float8
weights in the slot and run torch._scaled_mm; the streamed model equals the same model
converted resident by dlo.quantize_resident, bit for bit."""

import copy

import pytest
import torch
from torch import nn

import dlo
from dlo.backend.fp8_compute import check_fp8_gemms
from dlo.errors import ConfigError, EnableError, StreamingError
from dlo.hotpath.fp8_gemm import Fp8GemmLinear, quantize_rows
from dlo.models.tiny import TINY_MODELS, TinyModel
from dlo.planning.fp8_selection import gemm_linears
from dlo.planning.offload_plan import resolve_blocks
from dlo.planning.plan_summary import summarize

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
        landing = handle._runtime.executor.landings
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


def test_peft_lora_base_layers_run_as_gemms_but_not_dora_ones_nor_the_adapters():
    """Real PEFT adapters (what diffusers' load_lora_weights makes): a LoRA layer's base Linear
    becomes a GEMM, its lora_A/lora_B stay (PEFT casts inputs to their dtype); a DoRA layer's
    base stays too (DoRA reads the base weight itself: as float8 without its scale, its output
    was wrong in resident and streamed models alike, so the error bound below catches it)."""
    from peft import LoraConfig  # a test dependency (pyproject [test])

    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    model.add_adapter(LoraConfig(r=16, target_modules=["to_q"]), adapter_name="plain")
    model.add_adapter(LoraConfig(r=16, target_modules=["to_v"], use_dora=True), adapter_name="dora")
    model.set_adapters(["plain", "dora"])
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:  # PEFT starts lora_B at zero: no effect to get wrong
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    config = dlo.OffloadConfig(**GEMMS)
    reference, streamed = copy.deepcopy(model), copy.deepcopy(model)
    dlo.quantize_resident(reference, config)
    with dlo.enable(streamed, "cpu", config):
        converted = gemm_names(streamed)
        got = outputs(streamed, entry)
    assert all(torch.equal(a, b) for a, b in zip(outputs(reference, entry), got))
    assert "transformer_blocks.0.attn.to_q.base_layer" in converted
    assert not any(".to_v." in name or "lora_" in name for name in converted)
    # Float8 rounding alone gives about 5e-3 here; a DoRA base read as float8 gave 3.6e-2.
    assert all(relative_error(a, b) < 1.5e-2 for a, b in zip(got, outputs(model, entry)))


def test_quantize_resident_converts_a_linear_shared_by_two_blocks_never():
    model = TINY_MODELS["wan"].build(seed=0, dtype=torch.bfloat16)
    shared = model.blocks[0].attn1.to_v
    model.blocks[1].attn1.to_v = shared
    weight_only = copy.deepcopy(model)
    dlo.quantize_resident(weight_only, dlo.OffloadConfig(stream_dtype="fp8"))
    dlo.quantize_resident(model, dlo.OffloadConfig(**GEMMS))
    assert type(shared) is nn.Linear and "weight_scale" not in shared._buffers
    assert torch.equal(shared.weight, weight_only.blocks[0].attn1.to_v.weight)  # quantized once, dequantized
    assert "blocks.1.attn1.to_q" in gemm_names(model)


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


def _failing_enable(model, config, monkeypatch, failure):
    """enable() failing as `failure` (a monkeypatch step) says; the module's tensors as found
    (values and storage) must be what it gives back."""
    found = {name: (tensor.clone(), tensor.data_ptr()) for name, tensor in model.state_dict().items()}
    failure(monkeypatch)
    with pytest.raises((torch.OutOfMemoryError, EnableError, KeyboardInterrupt)):
        dlo.enable(model, "cpu", config)
    monkeypatch.undo()
    state = model.state_dict()
    assert not gemm_names(model) and state.keys() == found.keys()
    for name, (value, address) in found.items():
        # The very tensors found (not views of a host image holding float8 weights too), bit for bit.
        assert state[name].data_ptr() == address and state[name].dtype == value.dtype, name
        assert torch.equal(state[name].contiguous().view(torch.uint8), value.view(torch.uint8)), name


def _out_of_memory_at_slots(monkeypatch):
    from dlo.hotpath.executors import CpuExecutor

    def out_of_memory(self, nbytes):
        raise torch.OutOfMemoryError("fake device out of memory")

    monkeypatch.setattr(CpuExecutor, "allocate_slot", out_of_memory)


def _interrupt_call(monkeypatch, name, at):
    """Ctrl-C at the `at`-th call of `dlo.backend.fp8_compute.<name>`."""
    import dlo.backend.fp8_compute as conversion

    calls = []
    real = getattr(conversion, name)

    def interrupted(*args):
        calls.append(args)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(conversion, name, interrupted)


def _interrupt_at_the_third_conversion(monkeypatch):
    _interrupt_call(monkeypatch, "quantize_into", 3)


@pytest.mark.parametrize("failure", [_out_of_memory_at_slots, _interrupt_at_the_third_conversion])
@pytest.mark.parametrize("entry", [TINY_MODELS["flux"], WAN_MIXED], ids=["flux", "wan-mixed"])
def test_a_failed_enable_gives_back_the_tensors_it_found(monkeypatch, failure, entry):
    model = entry.build(seed=0, dtype=torch.bfloat16)
    expected = outputs(model, entry)
    _failing_enable(model, dlo.OffloadConfig(**GEMMS), monkeypatch, failure)
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, entry), expected))


def test_a_weight_float8_cannot_scale_fails_enable_and_gives_back_the_rest(monkeypatch):
    model = TINY_MODELS["flux"].build(seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        model.single_transformer_blocks[1].proj_out.weight[0, 0] = float("nan")
    _failing_enable(model, dlo.OffloadConfig(**GEMMS), monkeypatch, lambda _: None)


def test_a_disable_cut_short_and_called_again_gives_back_the_dequantized_linears(monkeypatch):
    model = TINY_MODELS["flux"].build(seed=0, dtype=torch.bfloat16)
    weight_only = copy.deepcopy(model)
    dlo.quantize_resident(weight_only, dlo.OffloadConfig(stream_dtype="fp8"))
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(**GEMMS))
    outputs(model, TINY_MODELS["flux"], seeds=(1,))
    _interrupt_call(monkeypatch, "dequantized", 5)
    with pytest.raises(KeyboardInterrupt):
        handle.disable()
    monkeypatch.undo()
    handle.disable()
    assert not gemm_names(model)
    state, expected = model.state_dict(), weight_only.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) and state[k].dtype == expected[k].dtype for k in expected)


def test_fp8_gemms_compile_whole_blocks_and_still_match_the_compiled_resident_model():
    """On Wan (was Flux): the FP8 GEMMs inside a fullgraph-compiled block are the same ops for
    every block class; Flux's two classes and the recompile of its first single-stream block
    tripled the graphs inductor compiles to C++ (~50-85 s cold here), and its regional compile
    is tests/test_compile.py's."""
    entry = TINY_MODELS["wan"]
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
    """quantize_rows equals quantize_into, the weights' quantizer, per row: tiny, zero, saturating rows."""
    from dlo.host.fp8_codec import quantize_into

    rows = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows[1] = 0  # all zero: scale 1
    rows[2] *= 1e-38  # tiny: scales near fp32's smallest
    rows[3, 5] = 3e4  # one large value: the rest of the row rounds to zero or subnormals
    data, scale = quantize_rows(rows, torch.float8_e4m3fn)
    expected_data = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
    expected_scale = torch.empty(6, 1, dtype=torch.float32)
    quantize_into(rows, expected_data, expected_scale, "rows")
    assert torch.equal(scale, expected_scale) and float(scale[1]) == 1.0
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert float(data[3, 5].float()) == 448.0  # the row's amax lands on the float8 maximum


def test_an_input_that_is_not_bf16_is_refused_by_name():
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    dlo.quantize_resident(model, dlo.OffloadConfig(**GEMMS))
    linear = model.get_submodule(sorted(gemm_names(model))[0])
    with torch.inference_mode(), pytest.raises(StreamingError, match="takes bf16 inputs; it got torch.float32"):
        linear(torch.randn(3, linear.in_features))


def test_summarize_sizes_slots_as_enable_holds_them():
    """The plan summary (auto residency's budget, dlo inspect) counts float8 weights and scales."""
    model = WAN_MIXED.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(**GEMMS)
    summary = summarize(model, dlo.discover(model), config)
    plain = summarize(model, dlo.discover(model), dlo.OffloadConfig(stream_dtype="fp8"))
    with dlo.enable(model, "cpu", config) as handle:
        assert summary.largest_block.nbytes == handle._runtime.slot_capacity < plain.largest_block.nbytes


def test_linears_claimed_by_others_skipped_or_other_dtypes_stay_plain():
    """Hooks, a forward of its own (accelerate's hooks), a LoRA adapter's Linear, a weight_scale
    of its own, an fp32 bias, fp8_skip: left as they are (dequantized float8, or bf16)."""
    model = TINY_MODELS["wan"].build(seed=0, dtype=torch.bfloat16)
    attention = model.blocks[1].attn1
    attention.to_q.register_forward_hook(lambda module, args, output: None)
    attention.to_k.forward = attention.to_k.forward  # an instance forward, as accelerate sets one
    attention.lora_A = nn.ModuleDict({"default": nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)})
    attention.to_v.register_buffer("weight_scale", torch.ones(1))
    attention.to_out[0].bias.data = attention.to_out[0].bias.data.float()
    config = dlo.OffloadConfig(**GEMMS, fp8_skip=(r"blocks\.0\.attn1\.to_q",))
    linears = {name for name, _ in gemm_linears(model, resolve_blocks(model, dlo.discover(model)), config)}
    assert "blocks.1.attn2.to_q" in linears and "blocks.0.attn1.to_k" in linears
    left = {"blocks.0.attn1.to_q", "blocks.1.attn1.to_q", "blocks.1.attn1.to_k", "blocks.1.attn1.lora_A.default",
            "blocks.1.attn1.to_v", "blocks.1.attn1.to_out.0"}
    assert not left & linears


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


def test_load_transformer_falls_back_to_the_ordinary_load_and_logs_why(tmp_path, caplog):
    entry = TINY_MODELS["flux"]  # no fp32-kept modules: the saved bf16 model is the loaded one
    saved = entry.build(seed=0, dtype=torch.bfloat16)
    saved.save_pretrained(tmp_path)
    config = dlo.OffloadConfig(**GEMMS)
    with caplog.at_level("WARNING", logger="dlo"):
        model, plan = dlo.load_transformer(tmp_path, config)
    assert plan is None
    assert [r.dlo_fallback for r in caplog.records if hasattr(r, "dlo_fallback")] == ["unsupported_online_quantization"]
    dlo.quantize_resident(saved, config)
    with dlo.enable(model, "cpu", config):
        got = outputs(model, entry)
    assert all(torch.equal(a, b) for a, b in zip(outputs(saved, entry), got))


def test_a_float8_checkpoint_is_refused_before_it_is_loaded(tmp_path):
    from fp8_checkpoints import write_fp8_checkpoint

    directory, _ = write_fp8_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="does not take a float8 checkpoint: set fp8_compute=False"):
        dlo.load_transformer(directory, dlo.OffloadConfig(**GEMMS))


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
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(EnableError, match="not on ROCm"):
        check_fp8_gemms(torch.device("cuda", 0))
