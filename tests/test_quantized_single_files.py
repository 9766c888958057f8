"""ComfyUI's current quantized single files (Flux.2's `fp8mixed`...): float8 Linear weights each
beside a 0-dim `weight_scale`, an `input_scale` and a `comfy_quant` marker naming its format,
other layers left unquantized; and the formats dlo cannot read, refused before anything is
mapped. See [Note: single files through diffusers' converter]."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dlo
from dlo.host.safetensors_file import SafetensorsFile
from dlo.models.tiny import TINY_MODELS
from single_file_layouts import flux2_original, flux3_original, ltx2_original, qwen_image21_original, z_image_original
from test_single_file_mapping import per_row_fp8, random_model, reference, run, scaled_fp8

diffusers = pytest.importorskip("diffusers")


def marker(conf) -> torch.Tensor:
    """A layer's `comfy_quant`: its configuration as UTF-8 JSON bytes."""
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def comfyui_layer(stored: dict, dequantized: dict, key: str, tensor: torch.Tensor, quantize=scaled_fp8) -> None:
    """The weight `key` as ComfyUI's current format writes it into `stored`: float8 values, a
    `weight_scale` (`quantize`: per tensor, or `per_row_fp8`), an `input_scale` and a
    `comfy_quant` marker; its values dequantized into `dequantized`."""
    layer = key[: -len(".weight")]
    stored[key], stored[f"{layer}.weight_scale"], dequantized[key] = quantize(tensor)
    stored[f"{layer}.input_scale"] = torch.tensor(0.01)
    stored[f"{layer}.comfy_quant"] = marker({"format": "float8_e4m3fn"})


def flux2_file(tmp_path, quantized=lambda key: False, edit=lambda stored: None, metadata=None, quantize=scaled_fp8) -> tuple:
    """The tiny Flux.2 in its BFL layout, bfloat16, the block Linear weights `quantized` names
    float8 as ComfyUI writes them (`quantize`: per tensor, or `per_row_fp8`); its path, config
    directory, the dequantized weights (BFL layout) and the inputs."""
    entry = TINY_MODELS["flux2"]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    model.save_config(tmp_path / "config")
    state = flux2_original(model.state_dict(), model.config.num_layers, model.config.num_single_layers)
    stored, dequantized = {}, {}
    for key, tensor in state.items():
        if key.startswith(("double_blocks.", "single_blocks.")) and tensor.dim() == 2 and quantized(key):
            comfyui_layer(stored, dequantized, key, tensor, quantize)
        else:
            stored[key] = dequantized[key] = tensor
    edit(stored)
    path = tmp_path / "flux2.safetensors"
    save_file(stored, path, metadata=metadata)
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    return path, tmp_path / "config", dequantized, inputs


def assert_streams_like(path, config_dir, dequantized, inputs, private_bytes=0, cls=None):
    """Streamed from the mapping (and `private_bytes` of dlo's private file), equal to diffusers'
    single-file model (of `cls`, default Flux.2) of `dequantized`."""
    cls = diffusers.Flux2Transformer2DModel if cls is None else cls
    expected = run(reference(dict(dequantized), config_dir, cls, torch.bfloat16), inputs)
    model, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan is not None and plan.backing == "checkpoint_mmap"
    offsets = {name: (source.entry.begin, source.entry.dtype) for name, source in plan.peek().checkpoint.tensors.items()}
    with dlo.enable(model, "cpu", plan=plan) as handle:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model, inputs)))
        assert handle.stats().host_bytes == private_bytes  # every other block tensor a range of the file
    return offsets


def file_offsets(path) -> dict:
    file = SafetensorsFile(path)
    try:
        return {key: entry.begin for key, entry in file.entries.items()}
    finally:
        file.close()


def test_a_flux2_file_in_bfl_layout_streams_from_its_mapping(tmp_path):
    """Flux.2's converter splits each stream's fused q/k/v along its rows: ranges of the file."""
    path, *rest = flux2_file(tmp_path)
    offsets = assert_streams_like(path, *rest)
    qkv = file_offsets(path)["double_blocks.0.img_attn.qkv.weight"]
    assert offsets["transformer_blocks.0.attn.to_k.weight"] == (qkv + 32 * 32 * 2, torch.bfloat16)


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", ""])
def test_a_converter_failing_on_a_prefixed_file_is_refused_naming_the_prefix(tmp_path, prefix):
    """Flux.2's converter does not strip ComfyUI's `model.diffusion_model.` (diffusers'
    from_single_file fails too): the refusal names the prefix, not the config. The same failure
    on a file without a prefix (another model's file) still asks about the config."""
    path, config_dir, *_ = flux2_file(tmp_path)
    if prefix:
        save_file({f"{prefix}{key}": tensor for key, tensor in load_file(path).items()}, path)
    else:  # Flux's converter given a Wan file
        save_file(TINY_MODELS["wan"].build(seed=0).state_dict(), path)
        config_dir = tmp_path / "flux"
        TINY_MODELS["flux"].build(seed=0).save_config(config_dir)
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    message = str(refused.value)
    assert "\n" not in message and "cannot read it" in message
    if prefix:
        assert f"every key of the file is under {prefix!r}, which that converter does not strip" in message
        assert "the config of the model" not in message
    else:
        assert f"is {config_dir} the config of the model this file holds?" in message and "prefix" not in message


def test_a_comfyui_fp8mixed_flux2_file_streams_like_its_dequantized_weights(tmp_path):
    """Every double block's Linear weights float8 (the fused q/k/v too: Flux.2's converter would
    chunk a 0-dim scale beside it as it chunks the weight, so it is never given one) and the
    single blocks left in bfloat16: each part of a fused weight streams as float8 with the
    weight's scale, equal to diffusers' model of the dequantized weights; the input scales and
    markers are not read."""
    path, config_dir, dequantized, inputs = flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks."))
    offsets = assert_streams_like(path, config_dir, dequantized, inputs)
    in_file = file_offsets(path)
    for i, part in enumerate(("to_q", "to_k", "to_v")):  # 32 rows each, one byte a value
        weight = in_file["double_blocks.1.img_attn.qkv.weight"] + i * 32 * 32
        assert offsets[f"transformer_blocks.1.attn.{part}.weight"] == (weight, torch.float8_e4m3fn)
        scale = in_file["double_blocks.1.img_attn.qkv.weight_scale"]
        assert offsets[f"transformer_blocks.1.attn.{part}.weight_scale"] == (scale, torch.float32)
    assert offsets["single_transformer_blocks.0.attn.to_out.weight"][1] == torch.bfloat16


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale_shape", ["rows x 1", "rows"])
def test_a_per_row_scaled_flux2_file_gives_each_split_part_its_rows_of_the_scale(tmp_path, scale_dtype, scale_shape):
    """A per-row `weight_scale` beside each stream's fused q/k/v (of any scale dtype dlo reads,
    either shape): each part streams as float8 with the scale's rows beside its own, equal to
    diffusers' model of the dequantized weights."""
    def quantize(weight):
        data, scale, _ = per_row_fp8(weight)
        scale = scale.to(scale_dtype).reshape(-1, 1) if scale_shape == "rows x 1" else scale.to(scale_dtype).reshape(-1)
        return data, scale, (data.float() * scale.float().reshape(-1, 1)).to(torch.bfloat16)

    path, config_dir, dequantized, inputs = flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks."), quantize=quantize)
    offsets = assert_streams_like(path, config_dir, dequantized, inputs)
    scale = file_offsets(path)["double_blocks.0.txt_attn.qkv.weight_scale"]
    size = scale_dtype.itemsize
    for i, part in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):  # 32 rows each
        assert offsets[f"transformer_blocks.0.attn.{part}.weight_scale"] == (scale + i * 32 * size, scale_dtype)


def int8_layer(stored):
    """ComfyUI's int8_tensorwise layer: int8 values, a per-row scale."""
    key = "double_blocks.0.img_mlp.0.weight"
    stored[key] = torch.ones(stored[key].shape, dtype=torch.int8)
    stored["double_blocks.0.img_mlp.0.weight_scale"] = torch.ones(stored[key].shape[0], 1)


REFUSED = {
    "int8 marker": (
        lambda s: (int8_layer(s), s.update({"double_blocks.0.img_mlp.0.comfy_quant": marker({"format": "int8_tensorwise"})})),
        None, "'double_blocks.0.img_mlp.0' is quantized as 'int8_tensorwise' (says the file): dlo reads float8 weights",
    ),
    "int8 without a marker": (
        lambda s: (int8_layer(s), s.pop("double_blocks.0.img_mlp.0.comfy_quant")), None, "'double_blocks.0.img_mlp.0.weight' holds torch.int8 values beside a scale",
    ),
    "marker of another float8": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": marker({"format": "float8_e5m2"})}), None,
        "'double_blocks.0.img_mlp.0' is quantized as 'float8_e5m2' (says the file) but has a torch.float8_e4m3fn weight",
    ),
    "marker not JSON": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": torch.tensor([0xFF, 0x00], dtype=torch.uint8)}), None,
        "the quantization of 'double_blocks.0.img_mlp.0' is unreadable",
    ),
    "marker nested too deep": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": torch.full((4000,), ord("["), dtype=torch.uint8)}),
        None, "the quantization of 'double_blocks.0.img_mlp.0' is unreadable",
    ),
    "marker too large": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": marker({"format": "float8_e4m3fn", "pad": " " * 5000})}),
        None, "the quantization of 'double_blocks.0.img_mlp.0' is unreadable",
    ),
    "marker not bytes": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": marker("float8_e4m3fn").float()}), None,
        "the quantization of 'double_blocks.0.img_mlp.0' is unreadable",
    ),
    "marker with a setting dlo does not know": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": marker({"format": "float8_e4m3fn", "convrot": True})}),
        None, "'double_blocks.0.img_mlp.0' is quantized as 'float8_e4m3fn' with 'convrot' (says the file), which dlo does not know",
    ),
    "marker and header disagree": (
        lambda s: None, {"_quantization_metadata": json.dumps({"layers": {"double_blocks.0.img_mlp.0": {"format": "nvfp4"}}})},
        "'double_blocks.0.img_mlp.0' is quantized as 'float8_e4m3fn' (its comfy_quant) and as 'nvfp4' (the header's "
        "_quantization_metadata): the file contradicts itself",
    ),
    "header table under a prefix naming another float8": (
        lambda s: s.pop("double_blocks.0.img_mlp.0.comfy_quant"),
        {"_quantization_metadata": json.dumps({"layers": {"model.diffusion_model.double_blocks.0.img_mlp.0": "float8_e5m2"}})},
        "'double_blocks.0.img_mlp.0' is quantized as 'float8_e5m2' (says the file) but has a torch.float8_e4m3fn weight",
    ),
    "a prefixed marker naming another float8 than its prefixed weight": (
        lambda s: s.update({
            "model.diffusion_model.double_blocks.0.img_mlp.0.comfy_quant": marker("float8_e5m2"),
            "model.diffusion_model.double_blocks.0.img_mlp.0.weight": s.pop("double_blocks.0.img_mlp.0.weight"),
        }) or s.pop("double_blocks.0.img_mlp.0.comfy_quant"), None,
        "'double_blocks.0.img_mlp.0' is quantized as 'float8_e5m2' (says the file) but has a torch.float8_e4m3fn weight",
    ),
    "a prefixed marker against the table": (
        lambda s: s.update({"model.diffusion_model.double_blocks.0.img_mlp.0.comfy_quant": s.pop("double_blocks.0.img_mlp.0.comfy_quant")}),
        {"_quantization_metadata": json.dumps({"layers": {"double_blocks.0.img_mlp.0": "nvfp4"}})},
        "'double_blocks.0.img_mlp.0' is quantized as 'float8_e4m3fn' (its comfy_quant) and as 'nvfp4'",
    ),
    "a setting in the table only": (
        lambda s: s.update({"double_blocks.0.img_mlp.0.comfy_quant": marker("float8_e4m3fn")}),
        {"_quantization_metadata": json.dumps({"layers": {"double_blocks.0.img_mlp.0": {"format": "float8_e4m3fn", "convrot": 1}}})},
        "'double_blocks.0.img_mlp.0' is quantized as 'float8_e4m3fn' with 'convrot' (says the file)",
    ),
    "a layer described with and without the prefix": (
        lambda s: s.update({"model.diffusion_model.double_blocks.0.img_mlp.0.comfy_quant": marker("nvfp4")}), None,
        "the file names the layer 'double_blocks.0.img_mlp.0' twice, with and without a prefix",
    ),
    "metadata not JSON": (
        lambda s: None, {"_quantization_metadata": "{layers"}, "the header's _quantization_metadata is unreadable",
    ),
    "metadata nested too deep": (
        lambda s: None, {"_quantization_metadata": "[" * 5000}, "the header's _quantization_metadata is unreadable",
    ),
    "metadata layers not a table": (
        lambda s: None, {"_quantization_metadata": json.dumps({"layers": ["double_blocks.0.img_mlp.0"]})},
        "the header's _quantization_metadata is unreadable",
    ),
    "header metadata": (
        lambda s: None,
        {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {"single_blocks.0.linear2": {"format": "nvfp4"}}})},
        "'single_blocks.0.linear2' is quantized as 'nvfp4' (says the file)",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_layer_in_a_format_dlo_cannot_read_is_refused_before_anything_in_one_line(tmp_path, case, capsys):
    """ComfyUI's other formats (int8, nvfp4...), said by a layer's marker, by the header's
    `_quantization_metadata` or by an integer weight beside a scale, and a marker that disagrees
    with its weight or cannot be read: refused in one line naming the layer, also where
    diffusers' loader would take the file (which would read the values as numbers), and by
    `dlo inspect` in the same words."""
    from dlo.cli.main import main

    edit, metadata, says = REFUSED[case]
    path, config_dir, _, _ = flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks.0."), edit=edit, metadata=metadata)
    for config in (dlo.OffloadConfig(), dlo.OffloadConfig(checkpoint_mmap=False), dlo.OffloadConfig(host_weight_cache=True)):
        with pytest.raises(dlo.ConfigError) as refused:
            dlo.load_transformer(path, config, model_config=config_dir)
        assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{path}: {says}"), str(refused.value)
    assert main(["inspect", str(path), "--model-config", str(config_dir)]) == 2
    assert capsys.readouterr().err.strip() == f"dlo: error: {refused.value}"


def open_mappings() -> tuple[int, list[str]]:
    """The process's open file descriptors (a count) and its file mappings of the tests' files
    and of unlinked ones (dlo's private files)."""
    import os

    with open("/proc/self/maps") as maps:
        mapped = [line.split(maxsplit=5)[-1].strip() for line in maps if len(line.split()) == 6]
    return len(os.listdir("/proc/self/fd")), sorted(m for m in mapped if "(deleted)" in m or "pytest-" in m)


def test_an_interrupt_at_any_line_of_a_single_file_load_leaves_nothing_open(tmp_path):
    """KeyboardInterrupt at sampled lines dlo runs loading a Flux.2 fp8mixed file (its header
    checks, the converter's provenance run, the private file of the computed final norm, the
    plan): nothing the load opened stays open or mapped, and the next load streams exact."""
    import random

    from test_one_load_path import PACKAGE, _LineInterrupt

    path, config_dir, dequantized, inputs = flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks."))
    expected = run(reference(dequantized, config_dir, diffusers.Flux2Transformer2DModel, torch.bfloat16), inputs)
    host = (str(PACKAGE / "host"),)

    def interrupted_load(at):
        before = open_mappings()
        with _LineInterrupt(at, files=host) as traced:
            try:
                model, plan = dlo.load_transformer(path, model_config=config_dir)
            except KeyboardInterrupt:
                model = plan = None
        if model is not None:  # past the last traced line: the load is whole
            with dlo.enable(model, "cpu", plan=plan):
                assert all(torch.equal(a, b) for a, b in zip(expected, run(model, inputs))), at
            del model, plan
        assert open_mappings() == before, at
        return traced.lines

    lines = interrupted_load(None)
    assert lines > 200
    for at in sorted(random.Random(0).sample(range(1, lines + 1), 40)):
        interrupted_load(at)
    interrupted_load(None)


DOUBLE_0 = [f"double_blocks.0.{layer}" for layer in ("img_attn.qkv", "txt_attn.qkv", "img_attn.proj", "txt_attn.proj",
                                                      "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2")]
ACCEPTED = {
    "the header's table too": (lambda s: None, {layer: {"format": "float8_e4m3fn"} for layer in DOUBLE_0}),
    "the header's table alone": (
        lambda s: [s.pop(f"{layer}.comfy_quant") for layer in DOUBLE_0], {layer: "float8_e4m3fn" for layer in DOUBLE_0}
    ),
    "the header's table under another prefix": (
        lambda s: None, {f"model.diffusion_model.{layer}": {"format": "float8_e4m3fn"} for layer in DOUBLE_0}
    ),
    "a marker and the table differing in a matmul setting only": (
        lambda s: None, {layer: {"format": "float8_e4m3fn", "full_precision_matrix_mult": True} for layer in DOUBLE_0}
    ),
    "markers of a bare format, a matmul setting": (
        lambda s: s.update({
            "double_blocks.0.img_mlp.0.comfy_quant": marker("float8_e4m3fn"),
            "double_blocks.0.img_mlp.2.comfy_quant": marker({"format": "float8_e4m3fn", "full_precision_matrix_mult": True}),
        }), None,
    ),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_float8_layers_the_file_describes_as_comfyui_does_stream(tmp_path, case):
    """The descriptions ComfyUI writes of float8 layers (per layer, in the header's table, both,
    the table's names under a prefix the keys lack, a bare format, how the matmul runs) are
    taken, equal to diffusers' model of the dequantized weights."""
    edit, layers = ACCEPTED[case]
    metadata = None if layers is None else {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    assert_streams_like(*flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks.0."), edit=edit, metadata=metadata))


def test_activation_scales_and_format_markers_say_nothing_about_the_weights(tmp_path):
    """float8 weights with no weight scale beside an `input_scale` each hold their values as they
    are (streamed with a scale of 1); a bfloat16 file keeping ComfyUI's empty float8 `scaled_fp8`
    marker is a plain file, which diffusers' loader may take too."""
    def unscaled(stored):
        for key in [k for k in stored if k.endswith(".weight_scale")]:
            stored.pop(key)

    path, config_dir, _, inputs = flux2_file(tmp_path, quantized=lambda key: key.startswith("double_blocks."), edit=unscaled)
    values = {key: tensor.to(torch.bfloat16) for key, tensor in load_file(path).items() if not key.endswith((".comfy_quant", ".input_scale"))}
    assert_streams_like(path, config_dir, values, inputs, private_bytes=2 * 12 * 4)  # float32 scales of 1, 12 a block
    plain, config_dir, state, inputs = flux2_file(
        tmp_path, edit=lambda stored: stored.update({"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)})
    )
    assert_streams_like(plain, config_dir, state, inputs)
    model, plan = dlo.load_transformer(plain, dlo.OffloadConfig(checkpoint_mmap=False), model_config=config_dir)
    assert plan is None  # not refused as a float8 file: diffusers' loader takes it


def test_dlo_inspect_says_how_a_files_float8_weights_are_scaled(tmp_path, capsys):
    """From the header alone: per-tensor, per-row or no scale, and the tensors beside them no
    model reads; no such line for a file without float8."""
    from dlo.cli.main import main

    def unscaled(stored):
        for key in [k for k in stored if k.endswith((".weight_scale", ".input_scale", ".comfy_quant"))]:
            stored.pop(key)

    def first_format(stored):
        for key in [k for k in stored if k.endswith((".weight_scale", ".input_scale", ".comfy_quant"))]:
            value = stored.pop(key)
            if key.endswith(".weight_scale"):
                stored[key.replace(".weight_scale", ".scale_weight")] = value
        stored["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)

    def block_scales(stored):  # one scale per 16 values of a row
        weight = stored["double_blocks.0.img_mlp.0.weight"]
        stored["double_blocks.0.img_mlp.0.weight_scale"] = torch.ones(weight.shape[0], weight.shape[1] // 16)

    cases = {
        "per tensor": ({}, "8: 8 with a per-tensor scale; beside them 16 tensors no model reads (activation scales, format markers)"),
        "per row": ({"quantize": per_row_fp8}, "8: 8 with a per-row scale; beside them 16"),
        "none": ({"edit": unscaled}, "8: 8 with no scale\n"),
        "comfyui's first format": (  # scale_weight beside each, one empty float8 `scaled_fp8` marker for the file
            {"edit": first_format}, "8: 8 with a per-tensor scale; beside them 1 tensor no model reads"
        ),
        "scales of another shape": ({"edit": block_scales}, "8: 7 with a per-tensor scale, 1 with scales dlo does not read;"),
    }
    for case, (kwargs, says) in cases.items():
        path, *_ = flux2_file(tmp_path / case, quantized=lambda key: key.startswith("double_blocks.0."), **kwargs)
        assert main(["inspect", str(path)]) == 0
        assert f"float8 weights:       {says}" in capsys.readouterr().out + "\n", case
    path, *_ = flux2_file(tmp_path / "plain")
    assert main(["inspect", str(path)]) == 0
    assert "float8" not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["qwenimage", "hunyuanvideo"])
def test_a_comfyui_file_in_diffusers_names_streams_like_its_dequantized_weights(tmp_path, name):
    """A file in diffusers' names (as ComfyUI's Qwen-Image files are: no converter runs), the
    float8 weights of its `transformer_blocks` in ComfyUI's current format: streamed as float8,
    equal to diffusers' model of the dequantized weights."""
    entry = TINY_MODELS[name]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    model.save_config(tmp_path / "config")
    stored, dequantized = {}, {}
    for key, tensor in model.state_dict().items():
        if key.startswith("transformer_blocks.") and key.endswith(".weight") and tensor.dim() == 2:
            comfyui_layer(stored, dequantized, key, tensor)
        else:
            stored[key] = dequantized[key] = tensor.contiguous()
    save_file(stored, tmp_path / f"{name}.safetensors")
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    assert_streams_like(tmp_path / f"{name}.safetensors", tmp_path / "config", dequantized, inputs, cls=type(model))


Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2,
               n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])
FLUX3 = dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4))
LTX2 = dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
            audio_cross_attention_dim=16, num_layers=2, caption_channels=16)
QWEN21 = dict(in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=32,
              mlp_ratio=3, axes_dims_rope=(4, 6, 6))


def comfyui_file(
    tmp_path, cls, config: dict, layout, quantize, blocks=("layers.", "transformer_blocks."), prefix="model.diffusion_model."
) -> tuple:
    """A random `cls(**config)` in bfloat16 written as ComfyUI writes it: in `layout`, under
    `prefix`, the 2-D weights of its `blocks` (key prefixes in `layout`) in ComfyUI's current
    float8 format. Its path, config directory, and the dequantized weights."""
    model = random_model(cls, config, torch.bfloat16)
    model.save_config(tmp_path / "config")
    stored, dequantized = {}, {}
    for key, tensor in layout(model.state_dict()).items():
        name = f"{prefix}{key}"
        if key.startswith(blocks) and key.endswith(".weight") and tensor.dim() == 2:
            comfyui_layer(stored, dequantized, name, tensor, quantize)
        else:
            stored[name] = dequantized[name] = tensor.contiguous()
    path = tmp_path / f"{cls.__name__}.safetensors"
    save_file(stored, path)
    return path, tmp_path / "config", dequantized


def assert_loads_like(path, config_dir, cls, dequantized) -> dict:
    """Every parameter and buffer of the file's model as dlo loads it (block tensors as their
    sources will stream them) equal, dtype and values, to diffusers' single-file model of
    `dequantized`, no block tensor held privately. Returns the plan's bindings."""
    expected = reference(dict(dequantized), config_dir, cls, torch.bfloat16)
    wanted = {**dict(expected.named_parameters(remove_duplicate=False)), **dict(expected.named_buffers())}
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    layout = plan.peek()
    got = {**dict(loaded.named_parameters(remove_duplicate=False)), **dict(loaded.named_buffers())}
    got.update({name: source.materialize(layout.checkpoint) for name, source in layout.bindings.items()})
    assert got.keys() == wanted.keys()
    for name, tensor in got.items():
        assert tensor.dtype == wanted[name].dtype and torch.equal(tensor, wanted[name]), name
    bindings = dict(layout.bindings)
    with dlo.enable(loaded, "cpu", plan=plan) as handle:
        assert handle.stats().host_bytes == 0  # every block tensor a range of the file
    return bindings


@pytest.mark.parametrize("quantize", [scaled_fp8, per_row_fp8], ids=["per tensor", "per row"])
def test_a_comfyui_qwen_image_21_file_loads_its_fused_gate_and_up_split_with_their_scales(tmp_path, quantize):
    """ComfyUI's Qwen-Image 2.1 files: keys under `model.diffusion_model.`, each block's SwiGLU
    gate and up projections fused into one `gate_up`, the block weights float8. diffusers'
    converter strips the prefix, splits `gate_up`, and would have left a scale under its old
    name: each half loads as float8 from the file with the fused weight's scale (per row: its
    half of the rows), every parameter and buffer equal to diffusers' single-file model of the
    dequantized weights (no forward: its inputs are beyond the tiny builders)."""
    cls = diffusers.QwenImage21Transformer2DModel
    path, config_dir, dequantized = comfyui_file(tmp_path, cls, QWEN21, qwen_image21_original, quantize)
    bindings = assert_loads_like(path, config_dir, cls, dequantized)
    assert all(bindings[f"transformer_blocks.1.img_mlp.{part}.weight"].format.dtype == torch.float8_e4m3fn
               for part in ("gate_layer", "proj"))


@pytest.mark.parametrize("quantize", [scaled_fp8, per_row_fp8], ids=["per tensor", "per row"])
def test_a_comfyui_flux3_file_loads_its_renamed_float8_weights_with_their_scales(tmp_path, quantize):
    """Flux.3 in its own layout (no key prefix: diffusers' converter strips none), every block's
    weights float8 in ComfyUI's current format: diffusers' converter renames the weights by their
    ends (`q_proj.weight`) and would have left each scale under its old name. Each weight loads as float8 with its own
    scale, every parameter and buffer equal to diffusers' single-file model of the dequantized
    weights (no forward: its inputs are beyond the tiny builders)."""
    cls = diffusers.Flux3Transformer2DModel
    blocks = ("content_mode_blocks.", "txt_mode_blocks.", "single_blocks.")
    path, config_dir, dequantized = comfyui_file(tmp_path, cls, FLUX3, flux3_original, quantize, blocks, prefix="")
    bindings = assert_loads_like(path, config_dir, cls, dequantized)
    assert bindings["mode_blocks.image.1.attn.to_q.weight"].format.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("quantize", [scaled_fp8, per_row_fp8], ids=["per tensor", "per row"])
def test_a_comfyui_ltx2_file_loads_its_renamed_float8_weights_with_their_scales(tmp_path, quantize):
    """LTX-2 in its own layout under `model.diffusion_model.`, with its text connectors'
    tensors beside the transformer's (diffusers' converter drops them), every block weight
    float8 in ComfyUI's current format: each loads as float8 with its own scale, every
    parameter and buffer equal to diffusers' single-file model of the dequantized weights (no
    forward: its audio and video inputs are beyond the tiny builders)."""
    cls = diffusers.LTX2VideoTransformer3DModel
    path, config_dir, dequantized = comfyui_file(tmp_path, cls, LTX2, ltx2_original, quantize)
    bindings = assert_loads_like(path, config_dir, cls, dequantized)
    assert all(bindings[f"transformer_blocks.1.{name}.weight"].format.dtype == torch.float8_e4m3fn
               for name in ("attn1.to_q", "audio_to_video_attn.to_out.0", "audio_ff.net.2"))


def z_image_run(model) -> list[torch.Tensor]:
    """Two forwards of a tiny Z-Image: one 8x8 latent frame, 8 caption tokens."""
    outputs = []
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        latents = [torch.randn(16, 1, 8, 8, generator=generator).to(torch.bfloat16)]
        caption = [torch.randn(8, 32, generator=generator).to(torch.bfloat16)]
        with torch.inference_mode():
            outputs.append(model(latents, torch.tensor([0.3 * seed]), caption, return_dict=False)[0][0])
    return outputs


@pytest.mark.parametrize("quantize", [scaled_fp8, per_row_fp8], ids=["per tensor", "per row"])
def test_a_comfyui_z_image_file_streams_its_split_qkv_with_the_fused_scale(tmp_path, quantize):
    """Z-Image in its own layout (q, k and v fused into `qkv`) under `model.diffusion_model.`,
    its blocks' weights float8 in ComfyUI's current format: diffusers' converter would have cut
    the fused weight's 0-dim scale in three (it splits every key containing `qkv.weight`). Each
    of q, k, v streams as float8 from the file with the fused weight's scale (per row: its third
    of the rows): every tensor and two forwards equal to diffusers' model of the dequantized
    weights."""
    cls = diffusers.ZImageTransformer2DModel
    path, config_dir, dequantized = comfyui_file(tmp_path, cls, Z_IMAGE, z_image_original, quantize)
    bindings = assert_loads_like(path, config_dir, cls, dequantized)
    assert all(bindings[f"layers.1.attention.to_{p}.weight"].format.dtype == torch.float8_e4m3fn for p in "qkv")
    expected = z_image_run(reference(dict(dequantized), config_dir, cls, torch.bfloat16))
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    with dlo.enable(loaded, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, z_image_run(loaded)))


def test_dlo_generate_streams_a_comfyui_fp8mixed_transformer_file_as_its_dequantized_weights(tiny_wan_dir, tmp_path):
    """`dlo generate MODEL --transformer FILE` with a ComfyUI-format Wan file (its blocks' weights
    float8 with `weight_scale`, `input_scale` and `comfy_quant`, in Wan's own layout): the same
    video, byte for byte, as the same pipeline given a bfloat16 file of the dequantized weights."""
    from test_generate import flags

    from dlo.cli.main import main
    from single_file_layouts import wan_original

    state = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").state_dict()
    stored, dequantized = {}, {}
    for key, tensor in wan_original(state).items():
        if key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2:
            comfyui_layer(stored, dequantized, key, tensor)
        else:
            stored[key] = dequantized[key] = tensor.contiguous()
    save_file(stored, tmp_path / "wan_fp8mixed.safetensors")
    save_file(dequantized, tmp_path / "wan_dequantized.safetensors")
    save_file({key: tensor.contiguous() for key, tensor in wan_original(state).items()}, tmp_path / "wan_unquantized.safetensors")
    argv = ["generate", str(tiny_wan_dir), "--prompt", "a cat", "--device", "cpu", *flags("wan"), "--dtype", "bfloat16"]
    videos = {}
    for name in ("wan_fp8mixed", "wan_dequantized", "wan_unquantized"):
        out = tmp_path / f"{name}.webp"  # lossless: the frames as generated
        assert main([*argv, "--output", str(out), "--transformer", str(tmp_path / f"{name}.safetensors")]) == 0
        videos[name] = out.read_bytes()
    assert videos["wan_fp8mixed"] == videos["wan_dequantized"] != videos["wan_unquantized"]  # float8 changes the video
