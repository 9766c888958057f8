"""fp8 streaming (See [Note: fp8 streaming]): float8 weights on the host and the link,
dequantized in the slot, bit-identical to the same quantized model run resident."""

import copy

import pytest
import torch
from torch import nn

import dlo
from dlo.models.tiny import TINY_MODELS
from dlo.planning.block_layout import ALIGNMENT, TensorSpec
from dlo.planning.wire_layout import Fp8Format, landing_views, plan_wire_layout

FP8 = torch.float8_e4m3fn


def outputs(model, name, dtype, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype))[0] for seed in seeds]


def linear_weights(model):
    """name -> tensor of every nn.Linear weight inside the blocks dlo streams."""
    block_lists = tuple(f"{path}." for path in dlo.discover(model).block_lists)
    return {
        f"{name}.weight": module.weight
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith(block_lists)
    }


@pytest.mark.parametrize(
    ("name", "dtype", "scale"),
    [
        ("wan", torch.bfloat16, "per_channel"),
        ("wan", torch.float32, "per_tensor"),
        ("flux", torch.bfloat16, "per_tensor"),
        ("flux", torch.float32, "per_channel"),
        ("hunyuanvideo", torch.bfloat16, "per_channel"),
    ],
)
def test_fp8_streamed_matches_the_quantized_model_run_resident(name, dtype, scale):
    unquantized = TINY_MODELS[name].build(seed=0, dtype=dtype)
    reference, streamed = copy.deepcopy(unquantized), copy.deepcopy(unquantized)
    config = dlo.OffloadConfig(stream_dtype=FP8, fp8_scale=scale, num_slots=3)
    changed = dlo.quantize_resident(reference, config)
    assert changed == len(linear_weights(unquantized))
    expected = outputs(reference, name, dtype)
    with dlo.enable(streamed, "cpu", config) as handle:
        got = outputs(streamed, name, dtype)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # The quantization is real: the outputs moved, by about what float8 rounding gives.
    plain = outputs(unquantized, name, dtype)
    errors = [float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, plain)]
    assert all(0 < error < 0.05 for error in errors)
    weights = linear_weights(unquantized)
    assert stats.host_bytes_by_dtype["float8_e4m3fn"] == sum(w.numel() for w in weights.values())
    scales = sum(w.shape[0] if scale == "per_channel" else 1 for w in weights.values())
    plain_fp32 = _plain_fp32(unquantized)  # Wan keeps its norms in fp32 in bf16 models too
    assert stats.host_bytes_by_dtype["float32"] == plain_fp32 + scales * 4


def _plain_fp32(model):
    """fp32 bytes of the streamed blocks' tensors that are not Linear weights."""
    quantized = {id(w) for w in linear_weights(model).values()}
    block_lists = tuple(f"{path}." for path in dlo.discover(model).block_lists)
    total = 0
    for module_name, module in model.named_modules():
        if module_name.startswith(block_lists):
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if id(tensor) not in quantized and tensor.dtype == torch.float32:
                    total += tensor.numel() * 4
    return total


def test_fp8_halves_the_bytes_each_call_streams():
    model = TINY_MODELS["flux"].build(seed=0, dtype=torch.bfloat16)
    calls = {}
    for stream_dtype in (None, "fp8"):
        streamed = copy.deepcopy(model)
        with dlo.enable(streamed, "cpu", dlo.OffloadConfig(stream_dtype=stream_dtype)) as handle:
            outputs(streamed, "flux", torch.bfloat16, seeds=(1,))
            before = handle.stats().bytes_streamed
            outputs(streamed, "flux", torch.bfloat16, seeds=(2,))
            calls[stream_dtype] = handle.stats().bytes_streamed - before
    weights = linear_weights(model).values()
    # Each Linear weight crosses as 1 byte per value instead of 2, plus its scales and at
    # most two more alignment paddings (data, scales) per weight.
    extra = sum(w.shape[0] * 4 + 2 * ALIGNMENT for w in weights)
    assert calls["fp8"] <= calls[None] - sum(w.numel() for w in weights) + extra


def test_skipped_and_fp32_kept_weights_stream_unchanged():
    model = TINY_MODELS["wan"].build(seed=0)
    model._keep_in_fp32_modules = ["ffn"]  # the model's own list: its blocks' ffn.net.* layers stay fp32
    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_skip=(r"blocks\.1\.attn1\.to_q",))
    kept = {
        name: w.clone() for name, w in linear_weights(model).items() if ".ffn." in name or "blocks.1.attn1.to_q" in name
    }
    reference, streamed = copy.deepcopy(model), copy.deepcopy(model)
    changed = dlo.quantize_resident(reference, config)
    assert changed == len(linear_weights(model)) - len(kept)
    expected = outputs(reference, "wan", torch.float32)
    handle = dlo.enable(streamed, "cpu", config)
    assert all(torch.equal(a, b) for a, b in zip(expected, outputs(streamed, "wan", torch.float32)))
    handle.disable()
    after = linear_weights(streamed)
    assert all(torch.equal(after[name], value) for name, value in kept.items())  # never quantized


def test_disable_gives_back_the_dequantized_weights():
    model = TINY_MODELS["flux"].build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(stream_dtype="fp8")
    reference = copy.deepcopy(model)
    dlo.quantize_resident(reference, config)
    dlo.enable(model, "cpu", config).disable()
    expected = reference.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in model.state_dict().items())


def test_a_failed_enable_gives_back_the_unquantized_weights(monkeypatch):
    from dlo.hotpath.executors import CpuExecutor

    model = TINY_MODELS["wan"].build(seed=0)
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}

    def out_of_memory(self, nbytes):
        raise torch.OutOfMemoryError("fake device out of memory")

    monkeypatch.setattr(CpuExecutor, "allocate_landings", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        dlo.enable(model, "cpu", dlo.OffloadConfig(stream_dtype="fp8"))
    assert all(torch.equal(tensor, before[key]) for key, tensor in model.state_dict().items())


def test_a_weight_holding_nan_is_refused_by_name_and_nothing_changes():
    model = TINY_MODELS["flux"].build(seed=0)
    with torch.no_grad():
        model.transformer_blocks[0].ff.net[2].weight[3, 1] = float("nan")
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    with pytest.raises(dlo.EnableError, match=r"transformer_blocks\.0\.ff\.net\.2\.weight.*NaN or Inf.*fp8_skip"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(stream_dtype="fp8"))
    after = model.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items() if key != "transformer_blocks.0.ff.net.2.weight")
    assert torch.equal(after["transformer_blocks.0.ff.net.2.weight"].isnan(), before["transformer_blocks.0.ff.net.2.weight"].isnan())


def test_e5m2_and_promoted_blocks_match_the_quantized_resident_model():
    """float8_e5m2, with resident_layers='auto' promoting blocks (dequantized into memory of
    their own instead of a slot) after the measured call."""
    model = TINY_MODELS["flux"].build(seed=0)
    config = dlo.OffloadConfig(stream_dtype="float8_e5m2", resident_layers="auto", hbm_budget_gib=1.0)
    reference = copy.deepcopy(model)
    dlo.quantize_resident(reference, config)
    expected = outputs(reference, "flux", torch.float32, seeds=(1, 2, 3, 4))
    with dlo.enable(model, "cpu", config) as handle:
        got = outputs(model, "flux", torch.float32, seeds=(1, 2, 3, 4))
        stats = handle.stats()
    assert stats.residency.state == "planned" and stats.resident_blocks > 0
    assert "float8_e5m2" in stats.host_bytes_by_dtype
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("cache", [False, True], ids=["checkpoint-mmap", "host-weight-cache"])
def test_a_mapped_checkpoint_streams_its_weights_quantized(tmp_path, driver, cache):
    """A bf16 checkpoint mapping: quantized into private buffers at enable(), so the mapping
    is not registered. Through the cache: the entry holds the float8 weights, registered
    and copied from directly (the fake driver stands in for CUDA's)."""
    directory = tmp_path / "flux"
    model = TINY_MODELS["flux"].build(seed=2)
    model.save_pretrained(directory)
    fields = dict(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True) if cache else {}
    config = dlo.OffloadConfig(stream_dtype="fp8", **fields)
    dlo.quantize_resident(model, config)
    expected = outputs(model, "flux", torch.float32)
    loaded, plan = dlo.load_transformer(directory, config)
    with dlo.enable(loaded, "cpu", config, plan=plan) as handle:
        got = outputs(loaded, "flux", torch.float32)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    registers = [call for call in driver.calls if call[0] == "register"]
    assert (stats.registered_bytes > 0, bool(registers)) == (cache, cache)
    assert (stats.host_bytes == 0) == cache  # private float8 copies only without the cache


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(stream_dtype=torch.float16), "stream_dtype must be None, torch.float8_e4m3fn"),
        (dict(stream_dtype="int8"), "stream_dtype must be None"),
        (dict(stream_dtype="fp8", fp8_scale="per_block"), "fp8_scale must be one of"),
        (dict(stream_dtype="fp8", fp8_skip="ff"), "fp8_skip must be a tuple"),
        (dict(stream_dtype="fp8", fp8_skip=("ff[",)), r"fp8_skip: 'ff\[' is not a regular expression"),
        (dict(fp8_skip=("ff",)), "set stream_dtype"),
        (dict(fp8_scale="per_tensor"), "set stream_dtype"),
    ],
)
def test_config_refuses_fp8_options_it_cannot_honour(fields, message):
    with pytest.raises(dlo.ConfigError, match=message):
        dlo.OffloadConfig(**fields)


def test_config_stores_one_spelling_of_the_stream_dtype():
    assert dlo.OffloadConfig(stream_dtype=torch.float8_e4m3fn) == dlo.OffloadConfig(stream_dtype="fp8")
    assert dlo.OffloadConfig(stream_dtype=torch.float8_e5m2).stream_dtype == "float8_e5m2"


def test_the_wire_layout_keeps_plain_tensors_first_and_nothing_overlaps():
    specs = [
        TensorSpec("to_q.weight", (48, 40), torch.bfloat16),
        TensorSpec("to_q.bias", (48,), torch.bfloat16),
        TensorSpec("norm.weight", (40,), torch.float32),
        TensorSpec("ff.weight", (40, 96), torch.bfloat16),
    ]
    fp8 = Fp8Format(FP8, per_channel=True)
    quantize = [True, False, False, True]
    layout, wire = plan_wire_layout(specs, [fp8 if q else None for q in quantize])
    plain = [p for p, q in zip(layout.placements, quantize) if not q]
    weights = [p for p, q in zip(layout.placements, quantize) if q]
    assert [p.spec.name for p in layout.placements] == [s.name for s in specs]  # declaration order kept
    assert all(p.offset % ALIGNMENT == 0 for p in layout.placements)
    assert max(p.offset + p.spec.nbytes for p in plain) <= wire.plain_bytes <= min(p.offset for p in weights)
    landing = torch.zeros(wire.landing_bytes, dtype=torch.uint8)
    views = landing_views(landing, wire)
    spans = sorted(
        (v.data_ptr() - landing.data_ptr(), v.numel() * v.element_size())
        for pair in views
        for v in pair
    )
    assert all(start % ALIGNMENT == 0 for start, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert [tuple(d.shape) for d, _ in views] == [(48, 40), (40, 96)]
    assert [tuple(s.shape) for _, s in views] == [(48, 1), (40, 1)]
