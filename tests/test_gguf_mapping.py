"""`dlo.load_transformer(FILE.gguf, model_config=...)`: a GGUF file's packed bytes stream straight
from its mapping into the modules diffusers' GGUF loader builds, equal to diffusers' own
`from_single_file` GGUF model run resident. Real GGUF files (gguf_files.py), in diffusers'
key layout and in the original ones (single_file_layouts.py). See [Note: GGUF files mapped] in
dlo.host.gguf_model."""

import logging

import pytest
import torch

import dlo
from dlo.host.gguf_file import GgufFile
from dlo.host.single_file_layout import converted_layout
from dlo.models.tiny import TINY_MODELS
from single_file_layouts import flux2_original, flux_original, minimax_h3_original, sd3_original, wan_original

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
from gguf_files import WIDE_WAN, load_gguf, quiet_diffusers, write_gguf  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet_diffusers")
from test_single_file_mapping import FLUX_WIDE, random_model  # noqa: E402

Q = gguf.GGMLQuantizationType


def run(model, inputs):
    with torch.inference_mode():
        return [model(**kwargs)[0] for kwargs in inputs]


def streamed(path, config_dir, inputs, dtype, **load):
    """The outputs of the file's model loaded by dlo and streamed, its mapping, plan, adapters
    and stats."""
    model, plan = dlo.load_transformer(path, torch_dtype=dtype, model_config=config_dir, **load)
    assert plan is not None and plan.backing == "checkpoint_mmap"
    mapping, adapters = plan.peek().checkpoint, plan.adapter_counts()
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=2), plan=plan)
    try:
        got = run(model, inputs)
        stats = handle.stats()
    finally:
        handle.disable(restore=False)  # the model is dropped: no private copy of its mapped blocks
    return got, mapping, plan, adapters, stats


def packed_weights_of_the_file(mapping, path):
    """Names of the streamed tensors that are packed bytes viewed in the GGUF file itself."""
    return {name for name, source in mapping.tensors.items() if source.entry.ggml_type and source.file.path == path}


@pytest.mark.parametrize("quant_type", [Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.Q4_K, Q.Q6_K, Q.BF16], ids=lambda q: q.name)
def test_a_gguf_file_streams_its_packed_bytes_from_the_mapping_equal_to_diffusers(tmp_path, quant_type):
    """Every block weight is a range of the file, used as saved: no adapter, no private host
    copy; the small casts (biases, norms into bfloat16) are converted once beside it."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WIDE_WAN)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", quant_type)
    inputs = [TINY_MODELS["wan"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    expected = run(load_gguf(path, tmp_path, "WanTransformer3DModel", torch.bfloat16), inputs)
    got, mapping, plan, adapters, stats = streamed(path, tmp_path, inputs, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert adapters == {}
    packed = packed_weights_of_the_file(mapping, path)
    assert packed and all(plan.bindings[name].dtype == torch.uint8 for name in packed & set(plan.bindings))
    # Private: the small casts only, this process's own memory; the packed bytes stay the file's.
    private = sum(s.entry.nbytes for n, s in mapping.tensors.items() if n in plan.bindings and s.file.private)
    assert 0 < stats.host_bytes == private < path.stat().st_size / 16


def test_an_original_layout_wan_gguf_file_dequantizes_its_float32_kept_layers_as_diffusers_does(tmp_path):
    """Wan's time embedder is kept in float32: diffusers' loader dequantizes its packed weights
    at load; dlo does the same, once, into the private file beside the mapping."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", Q.Q8_0, layout=wan_original)
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    expected = run(load_gguf(path, tmp_path, "WanTransformer3DModel", torch.bfloat16), inputs)
    got, mapping, plan, adapters, stats = streamed(path, tmp_path, inputs, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    time_embedder = mapping.tensors["condition_embedder.time_embedder.linear_1.weight"]
    assert time_embedder.file.path != path and time_embedder.entry.dtype == torch.float32
    assert "blocks.0.attn1.to_q.weight" in packed_weights_of_the_file(mapping, path)


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["default", "float16"])
def test_the_mapped_model_gives_each_tensor_the_dtype_diffusers_gives_it(tmp_path, dtype):
    """torch_dtype=None computes in float32, as diffusers' GGUF loader does; float16 keeps the
    class's fp32-kept modules (Wan's norms, modulation tables, time embedder) in float32."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", Q.Q8_0, layout=wan_original)
    inputs = [entry.inputs(seed, dtype or torch.float32) for seed in (1, 2)]
    reference = load_gguf(path, tmp_path, "WanTransformer3DModel", dtype or torch.float32)
    expected = run(reference, inputs)
    got, mapping, plan, adapters, stats = streamed(path, tmp_path, inputs, dtype)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # The kept norm is read from the file as it is (float32); a bias is cast beside it in float16.
    assert plan.bindings["blocks.0.norm2.weight"].dtype == reference.blocks[0].norm2.weight.dtype == torch.float32
    assert not mapping.tensors["blocks.0.norm2.weight"].file.private
    bias = mapping.tensors["blocks.0.attn1.to_q.bias"]
    assert bias.entry.dtype == reference.blocks[0].attn1.to_q.bias.dtype and bias.file.private == (dtype is not None)


def test_the_mapped_model_is_marked_quantized_as_diffusers_marks_its_gguf_model(tmp_path):
    """diffusers refuses to cast its GGUF model to another dtype (it would cast the float32-kept
    layers); the mapped model carries the same quantizer and is refused the same way."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", Q.Q8_0)
    loaded, plan = dlo.load_transformer(path, torch_dtype=torch.bfloat16, model_config=tmp_path)
    assert loaded.is_quantized and type(loaded.hf_quantizer).__name__ == "GGUFQuantizer"
    assert loaded.hf_quantizer.compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Casting a quantized model to a new `dtype` is unsupported"):
        loaded.to(torch.float16)
    plan.peek().checkpoint.close()


def test_a_gguf_file_streams_from_disk_beyond_a_host_budget(tmp_path):
    """Under host_budget_gib the blocks left on disk are read from the GGUF file on every use;
    their small casts, in the private file beside it, come from memory."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**{**WIDE_WAN, "num_layers": 4})
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", Q.Q8_0)
    inputs = [TINY_MODELS["wan"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    expected = run(load_gguf(path, tmp_path, "WanTransformer3DModel", torch.bfloat16), inputs)
    loaded, plan = dlo.load_transformer(path, torch_dtype=torch.bfloat16, model_config=tmp_path)
    config = dlo.OffloadConfig(num_slots=2, host_budget_gib=0.5 * path.stat().st_size / 2**30)
    with dlo.enable(loaded, "cpu", config, plan=plan) as handle:
        got = run(loaded, inputs)
        disk = handle.stats().disk
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert disk is not None and len(disk.blocks) > 0 and disk.reads >= 2 * len(disk.blocks) and disk.read_bytes > 0


def converting_one_more_tensor(monkeypatch, name, make):
    """diffusers' Wan converter, then `name` replaced by `make(converted)` (as a future
    converter might make a tensor)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]

    def converted(checkpoint, **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        out[name] = make(out)
        return out

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", entry)


def test_a_tensor_a_converter_makes_of_no_file_tensor_is_a_plain_one(tmp_path, monkeypatch):
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    converting_one_more_tensor(monkeypatch, "proj_out.bias", lambda out: torch.full_like(out["proj_out.bias"], 0.25))
    path = write_gguf(model, tmp_path / "wan.gguf", Q.Q8_0, layout=wan_original)
    inputs = [entry.inputs(1)]
    expected = run(load_gguf(path, tmp_path, "WanTransformer3DModel"), inputs)
    got, mapping, _, _, _ = streamed(path, tmp_path, inputs, None)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    bias = mapping.tensors["proj_out.bias"]
    assert bias.entry.ggml_type is None and bias.file.private


def test_a_tensor_a_converter_makes_of_a_packed_and_a_plain_tensor_falls_back_naming_it(tmp_path, monkeypatch, caplog):
    """Made of a Q8_0 tensor and an F32 one, it has no one ggml type: diffusers' loader takes
    the file (fallback checkpoint_plan_incompatible, the tensor named)."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    mixed = lambda out: out["proj_out.weight"] + out["proj_out.bias"][:, None]  # noqa: E731
    converting_one_more_tensor(monkeypatch, "proj_out.weight", mixed)
    path = write_gguf(model, tmp_path / "wan.gguf", Q.Q8_0, layout=wan_original)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        _, plan = dlo.load_transformer(path, model_config=tmp_path)
    assert plan is None
    assert (
        "checkpoint mmap fallback checkpoint_plan_incompatible: diffusers' converter makes 'proj_out.weight' of "
        "tensors of different ggml types" in caplog.text
    )


def test_a_flux_gguf_file_in_bfl_layout_maps_each_split_projection_in_place(large_file_dir):
    """The BFL layout packs q, k and v in one tensor: diffusers' converter splits its rows, so
    each projection is a range of the packed bytes, keeping its quant type."""
    cls = diffusers.FluxTransformer2DModel
    model = random_model(cls, FLUX_WIDE, torch.bfloat16)  # quantized from bfloat16 values: half the memory of float32
    model.save_config(large_file_dir)
    path = write_gguf(model, large_file_dir / "flux.gguf", Q.Q8_0, layout=lambda state: flux_original(state, 1, 1))
    names, config = set(model.state_dict()), dict(model.config)
    del model
    inputs = [TINY_MODELS["flux"].inputs(1, torch.bfloat16)]
    expected = run(load_gguf(path, large_file_dir, "FluxTransformer2DModel", torch.bfloat16), inputs)
    got, mapping, plan, adapters, stats = streamed(path, large_file_dir, inputs, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert adapters == {} and 0 < stats.host_bytes < path.stat().st_size / 16
    file = GgufFile(path)
    try:
        layout = converted_layout(file, cls, config, names)
        whole = file.entries["double_blocks.0.img_attn.qkv.weight"]
        to_k = layout.entries["transformer_blocks.0.attn.to_k.weight"]
        assert (to_k.begin, to_k.ggml_type) == (whole.begin + whole.nbytes // 3, "Q8_0")
    finally:
        file.close()
    assert mapping.tensors["transformer_blocks.0.attn.to_k.weight"].file.path == path


@pytest.mark.parametrize("quant_type", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_an_sd3_gguf_file_streams_its_last_blocks_swapped_norm_as_packed_parts(tmp_path, quant_type):
    """SD3's converter swaps the halves of the last block's context norm: with its Linear weight
    packed, the two halves are packed rows of the file (a quant block never spans rows), joined
    as they are; diffusers' loader joins the same bytes before it dequantizes them."""
    torch.manual_seed(0)
    entry = TINY_MODELS["sd3"]
    width = 256 if quant_type == Q.Q4_K else None  # the K-quants' 256-value blocks
    config = dict(entry.config, **({"attention_head_dim": 128, "caption_projection_dim": width,
                                    "joint_attention_dim": width} if width else {}))
    model = diffusers.SD3Transformer2DModel(**config)
    model.save_config(tmp_path)
    layers = model.config.num_layers
    path = write_gguf(model, tmp_path / "sd3.gguf", quant_type, layout=lambda state: sd3_original(state, layers))
    del model
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    if width:
        inputs = [dict(kwargs, encoder_hidden_states=torch.randn(1, 4, width, dtype=torch.bfloat16)) for kwargs in inputs]
    expected = run(load_gguf(path, tmp_path, "SD3Transformer2DModel", torch.bfloat16), inputs)
    got, mapping, plan, adapters, stats = streamed(path, tmp_path, inputs, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    norm = f"transformer_blocks.{layers - 1}.norm1_context.linear.weight"
    parts = [mapping.tensors[f"{norm}#{i}"] for i in range(2)]
    assert {(part.entry.ggml_type, part.file.path) for part in parts} == {(quant_type.name, path)}
    assert adapters == {"concat": 2}  # the norm's weight and bias


@pytest.mark.parametrize("quant_type", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_a_flux2_gguf_file_in_bfl_layout_streams_each_split_qkv_packed_in_place(tmp_path, quant_type):
    """Flux.2's converter splits each stream's fused q/k/v into three: packed rows of the file
    (a quant block never spans rows), each streamed as it lies, equal to diffusers' GGUF model."""
    entry = TINY_MODELS["flux2"]
    model = entry.build(seed=2, dtype=torch.float32)
    model.save_config(tmp_path)
    layers = model.config.num_layers, model.config.num_single_layers
    path = write_gguf(model, tmp_path / "flux2.gguf", quant_type, layout=lambda state: flux2_original(state, *layers))
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    expected = run(load_gguf(path, tmp_path, "Flux2Transformer2DModel", torch.bfloat16), inputs)
    got, mapping, plan, adapters, stats = streamed(path, tmp_path, inputs, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    qkv = GgufFile(path)
    try:
        fused = qkv.entries["double_blocks.1.txt_attn.qkv.weight"]
    finally:
        qkv.close()
    third = fused.nbytes // 3
    for i, part in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
        source = mapping.tensors[f"transformer_blocks.1.attn.{part}.weight"]
        assert (source.file.path, source.entry.begin, source.entry.ggml_type) == (path, fused.begin + i * third, quant_type.name)
    assert adapters == {}


def test_a_float16_gguf_file_computed_in_bfloat16_streams_its_casts_as_adapters(tmp_path):
    """Casting a whole F16 file would copy it: its casts stay adapters, packed on every load,
    and the file stays mapped (and shared)."""
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "flux.gguf", Q.F16)
    inputs = [entry.inputs(1, torch.bfloat16)]
    expected = run(load_gguf(path, tmp_path, "FluxTransformer2DModel", torch.bfloat16), inputs)
    got, mapping, plan, adapters, stats = streamed(path, tmp_path, inputs, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert adapters.get("cast", 0) > 0 and stats.host_bytes == 0  # nothing of the blocks copied privately


def test_gguf_files_it_cannot_map_load_with_diffusers_or_are_refused_in_one_line(tmp_path, caplog):
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=2)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "flux.gguf", Q.Q8_0)
    inputs = [entry.inputs(1)]
    expected = run(load_gguf(path, tmp_path, "FluxTransformer2DModel"), inputs)
    unmapped, plan = dlo.load_transformer(path, dlo.OffloadConfig(checkpoint_mmap=False), model_config=tmp_path)
    assert plan is None and all(torch.equal(a, b) for a, b in zip(expected, run(unmapped, inputs)))
    with caplog.at_level(logging.WARNING, logger="dlo"):
        sliced, plan = dlo.load_transformer(path, model_config=tmp_path, topology=dlo.Topology(tp_size=2))
    assert plan is None and "checkpoint mmap fallback unsupported_tp" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(expected, run(sliced, inputs)))

    unread = tmp_path / "iq.gguf"  # a type the gguf package knows and diffusers does not dequantize
    writer = gguf.GGUFWriter(unread, "dlo-test")
    writer.add_tensor("x", torch.zeros(1, 66, dtype=torch.uint8).numpy(), raw_dtype=Q.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for load, message in [
        (lambda: dlo.load_transformer(path, model_config=tmp_path, fuse_qkv=True), "a GGUF file's stay packed: set fuse_qkv=False"),
        (lambda: dlo.load_transformer(unread, model_config=tmp_path), "diffusers' GGUF loader has no dequantization for IQ2_XXS"),
    ]:
        with pytest.raises(dlo.ConfigError, match=message.replace("'", ".")) as refused:
            load()
        assert "\n" not in str(refused.value)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(dlo.CheckpointError, match="truncated"):
        dlo.load_transformer(damaged, model_config=tmp_path)


def test_block_tensors_the_converter_computes_of_packed_rows_keep_their_quant_type_privately(tmp_path):
    """MiniMax-H3's converter gathers q, k and v from interleaved rows of the packed fused tensor
    (a quant block never spans rows): computed once into the private file beside the mapping as
    packed Q8_0 rows, streamed equal to diffusers' GGUF model given the same option. (Here they
    are under a sixteenth of the tiny file; a full-size file's are about a fifth: it falls back.)"""
    from test_converter_options import HEADS, HEAD_DIM, MINIMAX, MiniMax, equal, outputs

    model = random_model(MiniMax, MINIMAX, torch.float32)
    model.save_config(tmp_path)
    layout = lambda state: minimax_h3_original(state, HEADS, HEAD_DIM, "interleaved")  # noqa: E731
    path = write_gguf(model, tmp_path / "minimax.gguf", Q.Q8_0, layout=layout)
    quantization = diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
    expected = outputs(MiniMax.from_single_file(
        str(path), config=str(tmp_path), quantization_config=quantization, qkv_layout="interleaved"
    ).eval())
    loaded, plan = dlo.load_transformer(path, model_config=tmp_path, converter_options={"qkv_layout": "interleaved"})
    assert plan is not None
    q = plan.peek().checkpoint.tensors["transformer_blocks.0.attn.to_q.weight"]
    assert q.file.private and q.entry.ggml_type == "Q8_0"
    assert equal(expected, outputs(loaded, plan))
