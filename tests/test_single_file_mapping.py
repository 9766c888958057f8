"""`dlo.load_transformer(FILE, model_config=...)`: single .safetensors files, in their original
key layout or diffusers', streamed from their mapping, equal to diffusers' own
`from_single_file` model. See [Note: single files through diffusers' converter]."""

import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import dlo
from dlo.host.safetensors_file import SafetensorsFile
from dlo.host.single_file_layout import converted_layout
from dlo.models.tiny import TINY_MODELS
from ordinary_tensors import ordinary_tensors
from single_file_layouts import flux_original, hunyuan_video_original, sd3_original, wan_original

diffusers = pytest.importorskip("diffusers")

# Flux at its real width: diffusers' Flux converter splits the fused projections by the sizes
# of FLUX.1 (3072 wide, MLP 4x), whatever the file holds. One block of each kind: 0.9 GiB in bf16.
FLUX_WIDE = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(16, 56, 56),
)

# HunyuanVideo at its real width, for the same reason (its converter splits a single block's
# linear1 at 3072 rows): one block of each kind and one refiner block, MLPs 1x. 0.7 GiB in bf16.
HUNYUAN_WIDE = dict(
    in_channels=4, out_channels=4, num_attention_heads=24, attention_head_dim=128, num_layers=1, num_single_layers=1,
    num_refiner_layers=1, mlp_ratio=1.0, text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(16, 56, 56),
)


def random_model(cls, config: dict, dtype: torch.dtype, seed: int = 2):
    """`cls(**config)` with seeded N(0, 0.02) weights drawn in `dtype` in place (a real-width
    Flux block pair is 1 GB in bfloat16: no other copy of it is made; fresh memory is slow to
    fault in on the test machines)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls(**config)
    generator = torch.Generator().manual_seed(seed)
    made: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        for key, meta in module._parameters.items():
            if meta is not None and id(meta) not in made:
                made[id(meta)] = torch.nn.Parameter(torch.empty(meta.shape, dtype=dtype).normal_(0, 0.02, generator=generator))
            if meta is not None:
                module._parameters[key] = made[id(meta)]
    return model.to(dtype).eval()  # its float buffers too


def write(tmp_path, name: str, model, layout) -> tuple:
    config_dir = tmp_path / f"{name}-config"
    model.save_config(config_dir)
    path = tmp_path / f"{name}.safetensors"
    save_file(layout({k: v.contiguous() for k, v in model.state_dict().items()}), path)
    return path, config_dir


def reference(path, config_dir, cls, dtype):
    """diffusers' own single-file model (of a file, or of a state dict in a file's layout), its
    tensors copied out of any mapping."""
    source = path if isinstance(path, dict) else str(path)
    model = cls.from_single_file(source, config=str(config_dir), torch_dtype=dtype).eval()
    ordinary_tensors(model)
    return model


def run(model, inputs):
    with torch.inference_mode():
        return [model(**kwargs)[0] for kwargs in inputs]


def assert_streams_equal_to_diffusers(path, config_dir, cls, dtype, inputs, **load):
    """Returns the plan's adapter counts (read before enable() takes the plan) and the stats."""
    expected = run(reference(path, config_dir, cls, dtype), inputs)
    model, plan = dlo.load_transformer(path, model_config=config_dir, **{"torch_dtype": dtype, **load})
    assert plan is not None and plan.backing == "checkpoint_mmap"
    adapters = plan.adapter_counts()
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=2), plan=plan)
    try:
        got = run(model, inputs)
        stats = handle.stats()
    finally:
        handle.disable(restore=False)  # the model is dropped: no private copy of its mapped blocks
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.host_bytes == 0  # every block streamed from the mapping: no private copy
    return adapters, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_a_wan_single_file_streams_from_its_mapping_equal_to_diffusers(tmp_path, layout, dtype):
    """In half precision too: diffusers' single-file loader casts the whole model (Wan's
    fp32-kept modules and its RoPE tables included), and so does the mapped load."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2, dtype=dtype)
    path, config_dir = write(tmp_path, "wan", model, wan_original if layout == "original" else dict)
    inputs = [entry.inputs(seed, dtype) for seed in (1, 2)]
    adapters, stats = assert_streams_equal_to_diffusers(path, config_dir, type(model), dtype, inputs)
    assert adapters == {}  # renames only: each tensor is a range of the file as it is
    assert stats.mapped_bytes == path.stat().st_size
    if dtype != torch.float32:  # torch_dtype=None: the file's own dtype, as diffusers' loader is given it
        adapters, _ = assert_streams_equal_to_diffusers(path, config_dir, type(model), dtype, inputs, torch_dtype=None)


def test_a_flux_file_in_bfl_layout_streams_its_fused_projections_split_in_place(large_file_dir):
    """The BFL layout fuses q, k, v (and the MLP's input, in single blocks): diffusers' converter
    splits them along the rows, so each part is a range of the file; its final norm's shift and
    scale are swapped (a `cat` of the two halves of one tensor): two ranges, concatenated."""
    cls = diffusers.FluxTransformer2DModel
    model = random_model(cls, FLUX_WIDE, torch.bfloat16)
    path, config_dir = write(large_file_dir, "flux", model, lambda state: flux_original(state, 1, 1))
    config, names = dict(model.config), set(model.state_dict())
    del model  # its GB freed for what the loads make (fresh memory is slow to fault in on test machines)
    inputs = [TINY_MODELS["flux"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    adapters, stats = assert_streams_equal_to_diffusers(path, config_dir, cls, torch.bfloat16, inputs)
    assert stats.mapped_bytes == path.stat().st_size  # no converted file beside it
    assert adapters == {}  # in the blocks; the final norm's concatenation lies outside them
    file = SafetensorsFile(path)
    try:
        with torch.inference_mode():  # where a caller may be: views made in it have no base
            layout = converted_layout(file, cls, config, names)
        whole = file.entries["double_blocks.0.img_attn.qkv.weight"]
        assert layout.entries["transformer_blocks.0.attn.to_k.weight"].begin == whole.begin + whole.nbytes // 3
        linear1 = file.entries["single_blocks.0.linear1.weight"]
        assert layout.entries["single_transformer_blocks.0.proj_mlp.weight"].end == linear1.end
        assert layout.computed == {}
        norm = file.entries["final_layer.adaLN_modulation.1.weight"]  # [shift; scale]
        scale, shift = (layout.entries[part] for part in layout.concatenated["norm_out.linear.weight"])
        assert (scale.begin, shift.begin, shift.end) == (norm.begin + norm.nbytes // 2, norm.begin, scale.begin)
    finally:
        file.close()


def test_a_hunyuan_video_file_in_its_own_layout_streams_its_fused_projections_split_in_place(large_file_dir):
    """HunyuanVideo's layout fuses q, k, v (img_attn_qkv, txt_attn_qkv, the refiner's
    self_attn_qkv) and a single block's q, k, v and MLP input (linear1): diffusers' converter
    splits them along the rows, so each block tensor is a range of the file."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers as convert

    cls = diffusers.HunyuanVideoTransformer3DModel
    model = random_model(cls, HUNYUAN_WIDE, torch.bfloat16)
    state = model.state_dict()
    converted = convert(hunyuan_video_original(state))  # the layout is the converter's inverse
    assert converted.keys() == state.keys() and all(torch.equal(state[k], v) for k, v in converted.items())
    del converted, state
    path, config_dir = write(large_file_dir, "hunyuan", model, hunyuan_video_original)
    del model
    inputs = [TINY_MODELS["hunyuanvideo"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    adapters, stats = assert_streams_equal_to_diffusers(path, config_dir, cls, torch.bfloat16, inputs)
    assert adapters == {} and stats.mapped_bytes == path.stat().st_size  # ranges only, no converted file


def test_an_ltx_file_in_its_own_layout_streams_its_transformer_and_leaves_its_vae(tmp_path):
    """LTX-Video's single files hold the VAE beside the transformer (under `vae.`): diffusers'
    converter keeps the transformer's tensors, renamed, and they stream from the mapping; the
    VAE's are no part of the model (not refused as tensors it does not read)."""
    from single_file_layouts import ltx_original

    entry = TINY_MODELS["ltx"]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    vae = {"decoder.conv_in.weight": torch.randn(8, 4, 3, 3, 3, dtype=torch.bfloat16), "encoder.conv_out.bias": torch.zeros(8)}
    path, config_dir = write(tmp_path, "ltx", model, lambda state: ltx_original(state, vae))
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    adapters, _ = assert_streams_equal_to_diffusers(path, config_dir, type(model), torch.bfloat16, inputs)
    assert adapters == {}  # renames only


def test_an_sd3_file_streams_its_last_blocks_swapped_norm_as_a_concatenation(tmp_path):
    """SD3's converter swaps the halves of the last block's context norm (a block tensor): two
    ranges of the file, concatenated when the block is packed, so the whole file streams from
    its mapping (before, that one tensor left the file to diffusers' loader)."""
    entry = TINY_MODELS["sd3"]
    model = entry.build(seed=2)
    layers = model.config.num_layers
    path, config_dir = write(tmp_path, "sd3", model, lambda state: sd3_original(state, layers))
    inputs = [entry.inputs(seed) for seed in (1, 2)]
    adapters, _ = assert_streams_equal_to_diffusers(path, config_dir, type(model), torch.float32, inputs)
    assert adapters == {"concat": 2}  # the last block's context norm: weight and bias (blocks only)
    file = SafetensorsFile(path)
    try:
        layout = converted_layout(file, type(model), dict(model.config), set(model.state_dict()))
    finally:
        file.close()
    assert layout.computed == {}
    last = f"transformer_blocks.{layers - 1}.norm1_context.linear"
    assert set(layout.concatenated) == {f"{last}.weight", f"{last}.bias", "norm_out.linear.weight", "norm_out.linear.bias"}


def test_a_file_that_cannot_be_mapped_loads_with_diffusers_and_says_why(tmp_path, caplog):
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    path, config_dir = write(tmp_path, "wan", model, wan_original)
    diffusers_model = reference(path, config_dir, type(model), torch.float32)
    expected = run(diffusers_model, [entry.inputs(1)])

    def assert_computes_as_diffusers(loaded):
        """The model as loaded holds diffusers' tensors (values, shapes and strides); run on
        ordinary allocations, as the reference is, it computes what diffusers' model does."""
        theirs = diffusers_model.state_dict()
        mine = loaded.state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) and mine[k].stride() == theirs[k].stride() for k in mine)
        ordinary_tensors(loaded)
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, [entry.inputs(1)])))

    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        loaded, plan = dlo.load_transformer(path, config, torch_dtype=torch.float32, model_config=config_dir)
    assert plan is None and "checkpoint mmap fallback unsupported_online_quantization" in caplog.text
    assert_computes_as_diffusers(loaded)
    unmapped, plan = dlo.load_transformer(path, dlo.OffloadConfig(checkpoint_mmap=False), model_config=config_dir)
    assert plan is None
    assert_computes_as_diffusers(unmapped)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlo"):
        sliced, plan = dlo.load_transformer(path, model_config=config_dir, topology=dlo.Topology(tp_size=2))
    assert plan is None and "checkpoint mmap fallback unsupported_tp" in caplog.text
    assert_computes_as_diffusers(sliced)
    flux_config = tmp_path / "flux-config"  # diffusers' own loader, given another model's config, fails: one line
    TINY_MODELS["flux"].build(seed=2).save_config(flux_config)
    with pytest.raises(dlo.ConfigError, match="diffusers could not load it as a FluxTransformer2DModel") as refused:
        dlo.load_transformer(path, dlo.OffloadConfig(checkpoint_mmap=False), model_config=flux_config)
    assert "\n" not in str(refused.value)


def test_single_files_it_cannot_take_are_refused_in_one_line(tmp_path):
    entry = TINY_MODELS["wan"]
    path, config_dir = write(tmp_path, "wan", entry.build(seed=2), wan_original)
    refusals = [
        (lambda: dlo.load_transformer(path), "is a single file: give model_config="),
        (lambda: dlo.load_transformer(config_dir, model_config=config_dir), "is a directory with its own config.json"),
        (lambda: dlo.load_transformer(path, model_config="no-such-org/no-such-model"), "neither a directory nor a hub id"),
    ]
    no_converter = tmp_path / "cogvideox-config"  # a class diffusers reads no single file of
    TINY_MODELS["cogvideox"].build(seed=2).save_config(no_converter)
    refusals.append((lambda: dlo.load_transformer(path, model_config=no_converter), "has no single-file loader for"))
    pickled = tmp_path / "wan.ckpt"
    pickled.write_bytes(b"not read")
    refusals.append((lambda: dlo.load_transformer(pickled, model_config=config_dir), "reads single .safetensors and .gguf files"))
    for load, message in refusals:
        with pytest.raises(dlo.ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as refused:
            load()
        assert "\n" not in str(refused.value)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(dlo.CheckpointError):
        dlo.load_transformer(truncated, model_config=config_dir)
    magic_only = tmp_path / "wan.gguf"
    magic_only.write_bytes(b"GGUF")
    with pytest.raises(dlo.CheckpointError, match="truncated"):
        dlo.load_transformer(magic_only, model_config=config_dir)


@pytest.mark.parametrize(
    ("scale_name", "marker"), [("scale_weight", "scaled_fp8"), ("weight_scale", "model.diffusion_model.scaled_fp8")]
)
def test_a_comfyui_scaled_fp8_file_in_wan_layout_streams_like_its_dequantized_weights(tmp_path, scale_name, marker):
    """ComfyUI's fp8_scaled files: float8 block weights, a `scale_weight` (or `weight_scale`)
    beside each, a `scaled_fp8` marker (under the file's key prefix). Streamed from the
    original layout (in the file's bfloat16, as diffusers' single-file loader casts a model:
    Wan's fp32-kept modules and RoPE tables too), equal to diffusers' single-file model of the
    same weights dequantized (here, independently of dlo)."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    stored, dequantized = {}, {}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks.") and name.endswith(".weight") and tensor.dim() == 2:
            scale = (tensor.float().abs().amax() / 448).clamp_min(1e-12)
            stored[name] = (tensor.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            stored[name[: -len("weight")] + scale_name] = scale.reshape(())
            dequantized[name] = (stored[name].float() * scale).to(torch.bfloat16)
        else:
            stored[name] = dequantized[name] = tensor.contiguous()
    config_dir = tmp_path / "config"
    model.save_config(config_dir)
    path = tmp_path / "wan_fp8_scaled.safetensors"
    save_file({**wan_original(stored), marker: torch.zeros(0, dtype=torch.float8_e4m3fn)}, path)
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    expected = run(reference(wan_original(dequantized), config_dir, type(model), torch.bfloat16), inputs)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan is not None
    with dlo.enable(loaded, "cpu", plan=plan) as handle:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))
        assert handle.stats().host_bytes == 0
    with pytest.raises(dlo.ConfigError, match="holds float8 weights, which dlo reads only from the checkpoint mapping"):
        dlo.load_transformer(path, dlo.OffloadConfig(checkpoint_mmap=False), model_config=config_dir)


def test_generate_with_a_single_file_transformer_streams_it_from_its_mapping(tiny_flux_dir, tmp_path, capsys):
    import numpy as np
    from PIL import Image
    from plain_pipeline import plain_pipeline
    from test_generate import flags, reference_call

    from dlo.cli.main import main

    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in transformer.state_dict().items()}, path)
    out = tmp_path / "cube.png"
    argv = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", *flags("flux")]
    assert main([*argv, "--output", str(out), "--transformer", str(path)]) == 0
    assert "checkpoint_mmap" in capsys.readouterr().out  # the backing of the streamed blocks
    expected = reference_call(plain_pipeline(tiny_flux_dir), "flux").images[0]
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected))


@pytest.mark.parametrize("name", ["wan", "sd3"])
def test_a_single_file_streams_from_disk_beyond_a_host_budget(tmp_path, name):
    """The disk tier reads a single file's blocks by the ranges the converter found (SD3's last
    block: two of them concatenated)."""
    entry = TINY_MODELS[name]
    model = entry.build(seed=2)
    layers = model.config.num_layers
    layout = wan_original if name == "wan" else lambda state: sd3_original(state, layers)
    path, config_dir = write(tmp_path, name, model, layout)
    inputs = [entry.inputs(seed) for seed in (1, 2)]
    expected = run(reference(path, config_dir, type(model), torch.float32), inputs)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    config = dlo.OffloadConfig(host_budget_gib=path.stat().st_size * 0.3 / 2**30)
    with dlo.enable(loaded, "cpu", config, plan=plan) as handle:
        got = run(loaded, inputs)
        disk = handle.stats().disk
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert disk is not None and len(disk.blocks) > 0 and disk.read_bytes > 0
    if name == "sd3":
        assert f"transformer_blocks.{layers - 1}" in disk.blocks, disk.blocks


# Ways a converter may write a tensor: in place, through an alias that shares its storage but
# not its `_base` (`.detach()`, `.data`), or by giving it another storage (`t.data = ...`).
WRITES = {
    "in place": lambda t: t.mul_(2),
    "through detach()": lambda t: t.detach().mul_(2),
    "through .data": lambda t: t.data.mul_(2),
    "by .data =": lambda t: setattr(t, "data", t * 2),
}


def doubling_one_block_weight(monkeypatch, name, how="in place"):
    """diffusers' Wan converter, then a write into one converted block tensor (as a future
    converter might; `how`: one of WRITES): that tensor is no longer the file's bytes."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]

    def converted(checkpoint, **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        WRITES[how](out[name])
        return out

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", entry)


@pytest.mark.parametrize("how", WRITES)
def test_a_block_tensor_the_converter_writes_is_computed_never_mapped_from_the_file(tmp_path, monkeypatch, how):
    """However the converter writes into it, the tensor is no range of the file: it is computed
    (held privately beside the mapping) and streams equal to diffusers' single-file model."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    path, config_dir = write(tmp_path, "wan", model, wan_original)
    doubling_one_block_weight(monkeypatch, "blocks.1.attn1.to_q.weight", how)
    inputs = [entry.inputs(1, torch.bfloat16)]
    expected = run(reference(path, config_dir, type(model), torch.bfloat16), inputs)
    assert not torch.equal(expected[0], run(model, inputs)[0])  # the doubled weight changes the output
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan.peek().checkpoint.tensors["blocks.1.attn1.to_q.weight"].file.private
    with dlo.enable(loaded, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))


def test_ranges_follow_views_and_copies_of_the_file_and_nothing_else():
    """What the converter's tensors are, seen through shape-only stand-ins: a range of the
    file's bytes only where the bytes are the tensor's, in order."""
    from dlo.host.safetensors_file import TensorEntry
    from dlo.host.single_file_layout import _Provenance

    entries = {"a": TensorEntry("a", torch.float32, (6, 4), 1000, 1096), "b": TensorEntry("b", torch.float32, (2, 3, 4, 4), 2000, 2384)}
    stand_ins = {key: torch.empty(e.shape, dtype=e.dtype, device="meta") for key, e in entries.items()}
    a, b = stand_ins["a"], stand_ins["b"]
    with _Provenance(stand_ins, entries) as provenance:
        q, k, v = torch.chunk(a, 3)
        copied = torch.cat([k])
        rows = torch.cat([q, k])
        swapped = torch.cat([k, q])
        columns = torch.cat([a[:, :2], a[:, 2:]], dim=1)
        cast = a.to(torch.bfloat16)
        transposed = a.t().contiguous()
        channels_last = b.clone(memory_format=torch.channels_last).permute(0, 2, 3, 1)
        written = torch.cat([v])
        written.mul_(2)
    begins = {name: (r.key, r.begin) if (r := provenance.range_of(t)) else None for name, t in [
        ("k", k), ("copied", copied), ("rows", rows), ("swapped", swapped), ("columns", columns), ("cast", cast),
        ("transposed", transposed), ("channels_last", channels_last), ("written", written), ("a.t()", a.t()),
    ]}
    assert begins == {
        "k": ("a", 1032), "copied": ("a", 1032), "rows": ("a", 1000), "swapped": None, "columns": None, "cast": None,
        "transposed": None, "channels_last": None, "written": None, "a.t()": None,
    }
    assert provenance.made_from(swapped) == {"a"} and provenance.made_from(channels_last) == {"b"}


def test_parts_follow_cats_of_ranges_in_another_order_and_no_write_through_any_alias():
    """A `cat` along the rows of ranges out of file order holds its parts, in order; not once it
    (or what it was made of) was written, through whatever alias."""
    from dlo.host.safetensors_file import TensorEntry
    from dlo.host.single_file_layout import _Provenance

    entries = {"a": TensorEntry("a", torch.float32, (6, 4), 1000, 1096), "b": TensorEntry("b", torch.float32, (6, 4), 2000, 2096)}
    stand_ins = {key: torch.empty(e.shape, dtype=e.dtype, device="meta") for key, e in entries.items()}
    a, b = stand_ins["a"], stand_ins["b"]
    with _Provenance(stand_ins, entries) as provenance:
        q, k, v = torch.chunk(a, 3)
        made = {"swapped": torch.cat([k, q]), "three": torch.cat([v, q, k]), "adjacent": torch.cat([q, k])}
        made["across tensors"] = torch.cat([b[4:], a[:2]])
        made["made of a written source"] = torch.cat([b[2:4], b[:2]])
        view_of_b, view_of_a = b[2:4], a[2:4]
        b.detach().mul_(2)  # after the cat: its copy keeps the file's bytes; b's views do not
        for how, write in WRITES.items():
            made[f"written {how}"] = torch.cat([k, q])
            write(made[f"written {how}"])
        written_source = a.clone()
        written_source.data.mul_(2)
        made["of a source written through .data"] = torch.cat([written_source[2:4], written_source[:2]])
    parts = {
        name: tuple((r.key, r.begin, shape) for r, shape in found) if (found := provenance.parts_of(t)) else None
        for name, t in made.items()
    }
    assert parts == {
        "swapped": (("a", 1032, (2, 4)), ("a", 1000, (2, 4))),
        "three": (("a", 1064, (2, 4)), ("a", 1000, (2, 4)), ("a", 1032, (2, 4))),
        "adjacent": None,  # one range: see range_of
        "across tensors": (("b", 2064, (2, 4)), ("a", 1000, (2, 4))),
        "made of a written source": (("b", 2032, (2, 4)), ("b", 2000, (2, 4))),
        **{f"written {how}": None for how in WRITES},
        "of a source written through .data": None,
    }
    assert provenance.range_of(made["adjacent"]).begin == 1000
    assert provenance.range_of(view_of_b) is None and provenance.range_of(view_of_a).begin == 1032


def scaled_fp8(weight: torch.Tensor, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ComfyUI's per-tensor scaled float8 of `weight`: (data, scale, data dequantized into
    bfloat16), computed a few rows at a time (small float32 temporaries: a real-width Flux weight
    is 0.26 GB in float32)."""
    scale = (torch.stack([part.float().abs().amax() for part in weight.split(rows)]).amax() / 448).clamp_min(1e-12)
    data = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    dequantized = torch.empty(weight.shape, dtype=torch.bfloat16)
    for part, quantized, restored in zip(weight.split(rows), data.split(rows), dequantized.split(rows)):
        quantized.copy_((part.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
        restored.copy_((quantized.float() * scale).to(torch.bfloat16))
    return data, scale.reshape(()), dequantized


def test_a_comfyui_scaled_fp8_flux_file_in_bfl_layout_gives_each_split_part_its_fused_scale(large_file_dir):
    """ComfyUI's Flux fp8_scaled file: the fused q/k/v (and linear1) weights float8 with one
    scale each; their parts stream with that scale, equal to diffusers' model of the same
    weights dequantized (here, independently of dlo) in the same layout."""
    cls = diffusers.FluxTransformer2DModel
    model = random_model(cls, FLUX_WIDE, torch.bfloat16)
    config_dir = large_file_dir / "config"
    model.save_config(config_dir)
    original = flux_original({k: v.contiguous() for k, v in model.state_dict().items()}, 1, 1)
    del model
    stored, dequantized = {}, {}
    for key in list(original):
        tensor = original.pop(key)  # each bf16 weight freed once quantized
        if key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight") and tensor.dim() == 2:
            stored[key], scale, dequantized[key] = scaled_fp8(tensor)
            stored[key[: -len("weight")] + "scale_weight"] = scale
        else:
            stored[key] = dequantized[key] = tensor
    fp8_path = large_file_dir / "flux-fp8-scaled.safetensors"
    save_file({**stored, "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, fp8_path)
    del stored
    inputs = [TINY_MODELS["flux"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    # diffusers' loader takes the state dict itself (writing it costs seconds of disk).
    expected = run(reference(dequantized, config_dir, cls, torch.bfloat16), inputs)
    del dequantized
    loaded, plan = dlo.load_transformer(fp8_path, torch_dtype=torch.bfloat16, model_config=config_dir)
    assert plan is not None
    with dlo.enable(loaded, "cpu", plan=plan) as handle:
        got = run(loaded, inputs)
        assert handle.stats().host_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_dlo_inspect_refuses_a_float8_file_it_cannot_map_as_the_loader_does(tmp_path, capsys):
    """A float8 file whose mapping is refused cannot be loaded (diffusers' loader would drop its
    scales): `dlo inspect FILE --model-config` says so in the loader's own words, not that it
    would fall back."""
    from dlo.cli.main import main

    model = TINY_MODELS["wan"].build(seed=2, dtype=torch.bfloat16)
    stored = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks.") and name.endswith(".weight") and tensor.dim() == 2:
            scale = (tensor.float().abs().amax() / 448).clamp_min(1e-12)
            stored[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            stored[name[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            stored[name] = tensor.contiguous()
    stored["extra.weight"] = torch.zeros(4)  # no runtime tensor: the mapping is refused
    config_dir, path = tmp_path / "config", tmp_path / "wan_fp8_scaled.safetensors"
    model.save_config(config_dir)
    save_file(wan_original(stored), path)
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    assert "holds float8 weights" in str(refused.value) and "checkpoint_plan_incompatible" in str(refused.value)
    assert main(["inspect", str(path), "--model-config", str(config_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == f"dlo: error: {refused.value}"


@pytest.fixture
def wan_converter_computing(monkeypatch):
    """diffusers' Wan converter with the block weights named by the test computed (their rows in
    reverse order): no longer ranges of the file."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]
    computed: set[str] = set()

    def converted(checkpoint, **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        return {k: v.flip(0) if k in computed else v for k, v in out.items()}

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", entry)
    return computed


def test_a_block_tensor_the_converter_computes_is_held_privately_while_small(tmp_path, caplog, wan_converter_computing):
    """One computed block weight (a small share of the file) is computed once into the private
    file beside the mapping and streams from there, the rest from the file; computed block
    weights making up more than a sixteenth of the file send it to diffusers' loader."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    path, config_dir = write(tmp_path, "wan", model, wan_original)
    inputs = [entry.inputs(seed) for seed in (1, 2)]
    wan_converter_computing.add("blocks.0.attn1.to_q.weight")
    expected = run(reference(path, config_dir, type(model), torch.float32), inputs)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan is not None and plan.backing == "checkpoint_mmap"
    sources = plan.peek().checkpoint.tensors
    assert sources["blocks.0.attn1.to_q.weight"].file.private and not sources["blocks.0.attn1.to_k.weight"].file.private
    with dlo.enable(loaded, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))
    assert not all(torch.equal(a, b) for a, b in zip(expected, run(model, inputs)))  # the flip changes the outputs

    wan_converter_computing.update(k for k, v in model.state_dict().items() if k.startswith("blocks.") and v.dim() == 2)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        _, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan is None
    assert "checkpoint mmap fallback checkpoint_plan_incompatible: diffusers' converter computes 'blocks.0." in caplog.text
    assert "block tensors, " in caplog.text and "% of wan.safetensors's bytes): not ranges of it" in caplog.text


def sd3_scaled_fp8(tmp_path, per_row: bool, quantized=lambda key: True):
    """A tiny SD3 in its own layout with its 2-D weights (those `quantized` names) float8 and a
    scale beside each (per tensor, ComfyUI's `scale_weight`, or per row, `weight_scale`), the
    same weights dequantized into bfloat16 in that layout, its config directory and model."""
    model = TINY_MODELS["sd3"].build(seed=2, dtype=torch.bfloat16)
    config_dir = tmp_path / "config"
    model.save_config(config_dir)
    original = sd3_original({k: v.contiguous() for k, v in model.state_dict().items()}, model.config.num_layers)
    stored, dequantized = {}, {}
    for key, tensor in original.items():
        if key.endswith(".weight") and tensor.dim() == 2 and quantized(key):
            amax = tensor.float().abs().amax(dim=1, keepdim=True) if per_row else tensor.float().abs().amax()
            scale = (amax / 448).clamp_min(1e-12)
            stored[key] = (tensor.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            stored[key[: -len("weight")] + ("weight_scale" if per_row else "scale_weight")] = scale.reshape(-1 if per_row else ())
            dequantized[key] = (stored[key].float() * scale).to(torch.bfloat16)
        else:
            stored[key] = dequantized[key] = tensor
    path = tmp_path / "sd3_fp8_scaled.safetensors"
    save_file(stored, path)
    return path, config_dir, dequantized, model


def test_an_sd3_scaled_fp8_file_streams_its_swapped_norms_with_their_scales(tmp_path, capsys):
    """SD3's converter swaps the halves of the last block's context norm and of the final norm:
    float8 values moved within one weight keep its per-tensor scale, computed once as float8
    into the private file; the file streams equal to diffusers' single-file model of the same
    weights dequantized (before, the whole file was refused)."""
    path, config_dir, dequantized, model = sd3_scaled_fp8(tmp_path, per_row=False)
    inputs = [TINY_MODELS["sd3"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    expected = run(reference(dequantized, config_dir, type(model), torch.bfloat16), inputs)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan is not None
    last = f"transformer_blocks.{model.config.num_layers - 1}.norm1_context.linear"
    norm = plan.peek().bindings[f"{last}.weight"]
    assert norm.scale_key == f"{last}.scale_weight"  # float8 with the weight's own scale
    with dlo.enable(loaded, "cpu", plan=plan) as handle:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))
        assert handle.stats().host_bytes == math.prod(norm.shape)  # its float8 bytes held privately, nothing else
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)  # the blocks read from the file on every use
    with dlo.enable(loaded, "cpu", dlo.OffloadConfig(host_budget_gib=0.0002), plan=plan) as handle:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))
        assert last.rsplit(".", 2)[0] in handle.stats().disk.blocks
    from dlo.cli.main import main

    assert main(["inspect", str(path), "--model-config", str(config_dir)]) == 0
    assert "; 1 of them computed at load, held privately," in capsys.readouterr().out


def test_a_per_row_scale_of_float8_values_the_converter_moves_is_refused_in_one_line(tmp_path):
    """A per-row scale does not follow rows the converter reorders (SD3's swapped halves): the
    file cannot be read exactly, and is refused rather than dequantized with the wrong scales."""
    last = TINY_MODELS["sd3"].config["num_layers"] - 1
    path, config_dir, _, _ = sd3_scaled_fp8(tmp_path, per_row=True, quantized=lambda key: key.startswith(
        f"joint_blocks.{last}.context_block.adaLN_modulation"
    ))
    with pytest.raises(dlo.DloError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    assert "\n" not in str(refused.value)
    assert (
        f"diffusers' converter makes 'transformer_blocks.{last}.norm1_context.linear.weight' of float8 values of "
        f"['joint_blocks.{last}.context_block.adaLN_modulation.1.weight'] that no one scale of the file dequantizes"
    ) in str(refused.value)


def minimax_with_a_float8_fc1(tmp_path, per_row: bool, scale_name: str = "scale_weight"):
    """MiniMax-H3 in its own layout (q/k/v stacked), bfloat16, with block 0's gated MLP input
    (whose halves the converter swaps) float8 beside a `scale_name` (per tensor or per row),
    and diffusers' model of the same weights dequantized."""
    from test_converter_options import HEADS, HEAD_DIM, MINIMAX, MiniMax

    from single_file_layouts import minimax_h3_original

    model = random_model(MiniMax, MINIMAX, torch.bfloat16)
    config_dir = tmp_path / "config"
    model.save_config(config_dir)
    stored = minimax_h3_original({k: v.contiguous() for k, v in model.state_dict().items()}, HEADS, HEAD_DIM, "stacked")
    dequantized = dict(stored)
    key = next(k for k in stored if k.startswith(("blocks.0.", "layers.0.")) and "fc1.weight" in k)
    weight = stored[key].float()
    scale = (weight.abs().amax(dim=1, keepdim=True) if per_row else weight.abs().amax()) / 448
    stored[key] = (weight / scale).to(torch.float8_e4m3fn)
    stored[key[: -len("weight")] + scale_name] = scale.reshape(-1 if per_row else ())
    dequantized[key] = (stored[key].float() * scale).to(torch.bfloat16)
    path = tmp_path / "minimax-fp8.safetensors"
    save_file(stored, path)
    expected = MiniMax.from_single_file(dequantized, config=str(config_dir), torch_dtype=torch.bfloat16)
    return path, config_dir, expected, key


@pytest.mark.parametrize("scale_name", ["scale_weight", "weight_scale"])
def test_a_per_row_scale_never_scales_rows_the_converter_swapped(tmp_path, scale_name):
    """MiniMax-H3's converter swaps the halves of the gated MLP's input weight: a per-row scale
    would then scale the wrong rows. The file is refused naming the weight; with a per-tensor
    scale it streams, each value dequantized as diffusers' model of the dequantized weights
    holds it (a `weight_scale` too, which the converter, had it been given it, would have tried
    to cut in halves as it does the weight)."""
    path, config_dir, _, key = minimax_with_a_float8_fc1(tmp_path, per_row=True, scale_name=scale_name)
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    assert f"of float8 values of [{key!r}] that no one scale of the file dequantizes" in str(refused.value)
    path, config_dir, expected, _ = minimax_with_a_float8_fc1(tmp_path, per_row=False, scale_name=scale_name)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    name = "transformer_blocks.0.ff.net.0.proj.weight"
    source, checkpoint = plan.peek().bindings[name], plan.peek().checkpoint
    assert torch.equal(source.materialize(checkpoint), expected.get_parameter(name).data)


@pytest.mark.parametrize(
    ("made", "says"),
    [
        (lambda w: w.to(torch.bfloat16), "that no one scale of the file dequantizes"),  # its float8 values read as numbers
        (lambda w: (w.float() + 1).to(torch.float8_e4m3fn), "not only moves them"),  # arithmetic, float8 again
    ],
    ids=["cast", "arithmetic"],
)
def test_float8_values_a_converter_computes_with_are_refused_in_one_line(tmp_path, monkeypatch, made, says):
    """A converter that casts a float8 weight, or computes with its values, makes a tensor no
    scale of the file dequantizes: the file is refused naming it, never streamed."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    path, config_dir, dequantized, model = sd3_scaled_fp8(tmp_path, per_row=False)
    name = "transformer_blocks.0.attn.to_out.0.weight"
    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["SD3Transformer2DModel"])
    convert = entry["checkpoint_mapping_fn"]

    def converted(checkpoint, **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        out[name] = made(out[name])
        return out

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "SD3Transformer2DModel", entry)
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    assert "\n" not in str(refused.value) and name in str(refused.value) and says in str(refused.value)


def unscaled_float8_file(tmp_path, name: str, state: dict, model) -> tuple:
    """`state` (a layout of `model`'s) with every 2-D weight float8_e4m3fn and no scale anywhere,
    written with `model`'s config; its path, config directory, and what diffusers' single-file
    model of it computes for two inputs, with the inputs."""
    stored = {k: v.to(torch.float8_e4m3fn) if k.endswith(".weight") and v.dim() == 2 else v.contiguous() for k, v in state.items()}
    model.save_config(tmp_path / "config")
    path = tmp_path / f"{name}_fp8_e4m3fn.safetensors"
    save_file(stored, path)
    inputs = [TINY_MODELS[name].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    return path, tmp_path / "config", run(reference(path, tmp_path / "config", type(model), torch.bfloat16), inputs), inputs


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_a_float8_file_without_scales_streams_its_values_as_they_are(tmp_path, layout):
    """float8 weights with no scale anywhere in the file (as e4m3fn checkpoints are published):
    the values as they are, which diffusers' own single-file loader casts; dlo streams them as
    float8 with a scale of 1, equal to diffusers' model of the very file. A file where some
    float8 weights have a scale and others none is refused naming one without."""
    model = TINY_MODELS["wan"].build(seed=2, dtype=torch.bfloat16)
    state = wan_original(model.state_dict()) if layout == "original" else dict(model.state_dict())
    path, config_dir, expected, inputs = unscaled_float8_file(tmp_path, "wan", state, model)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    assert plan.peek().bindings["blocks.0.attn1.to_q.weight"].format.dtype == torch.float8_e4m3fn  # half bf16's bytes
    with dlo.enable(loaded, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))
    assert not all(torch.equal(a, b) for a, b in zip(expected, run(model, inputs)))  # float8 changes the outputs
    one = next(key for key in state if key.startswith("blocks.") and key.endswith(".weight") and state[key].dim() == 2)
    save_file({**load_file(path), one[: -len("weight")] + "scale_weight": torch.ones(())}, path)
    with pytest.raises(dlo.DloError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    says = "holds float8 values without a scale beside it (dlo reads" if layout == "original" else "float8 weight with no scales"
    assert "\n" not in str(refused.value) and says in str(refused.value), str(refused.value)


def test_an_unscaled_float8_sd3_file_streams_its_swapped_norms_too(tmp_path):
    """Every 2-D weight float8 with no scale, SD3's final and last-block norms swapped by the
    converter (their float8 values moved, as checked): equal to diffusers' model of the file,
    and so is diffusers' own loader taking it (checkpoint_mmap=False: nothing to drop). Scales
    under a name dlo does not read (`weight_scale_inv`) are not taken for no scale: refused."""
    model = TINY_MODELS["sd3"].build(seed=2, dtype=torch.bfloat16)
    state = sd3_original({k: v.contiguous() for k, v in model.state_dict().items()}, model.config.num_layers)
    path, config_dir, expected, inputs = unscaled_float8_file(tmp_path, "sd3", state, model)
    for config in (dlo.OffloadConfig(), dlo.OffloadConfig(checkpoint_mmap=False)):
        loaded, plan = dlo.load_transformer(path, config, model_config=config_dir)
        assert (plan is not None) == config.checkpoint_mmap
        with dlo.enable(loaded, "cpu", plan=plan):
            assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))
    weights = load_file(path)
    inverse = {k[: -len("weight")] + "weight_scale_inv": torch.ones(()) for k, v in weights.items() if v.dtype == torch.float8_e4m3fn}
    save_file({**weights, **inverse}, path)
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    assert "holds float8 values without a scale beside it (dlo reads float8 weights with their " in str(refused.value)


def per_row_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row scaled float8 of `weight`: (data, scale [rows, 1], data dequantized into bfloat16)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12)
    data = (weight.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return data, scale, (data.float() * scale).to(torch.bfloat16)


def wan_scaled_fp8_file(tmp_path, two_scales: bool = False, quantize=scaled_fp8) -> tuple:
    """A tiny Wan in its own layout, bfloat16, every block Linear weight float8 (`quantize`: per
    tensor, or `per_row_fp8`) beside a `scale_weight` (and a `weight_scale` too with
    `two_scales`); its path, config directory, the dequantized weights (in the file's layout) and
    the inputs."""
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    stored, dequantized = {}, {}
    for key, tensor in wan_original(model.state_dict()).items():
        if key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2:
            stored[key], scale, dequantized[key] = quantize(tensor)
            stored[key[: -len("weight")] + "scale_weight"] = scale
            if two_scales:
                stored[key[: -len("weight")] + "weight_scale"] = scale * 2
        else:
            stored[key] = dequantized[key] = tensor.contiguous()
    model.save_config(tmp_path / "config")
    save_file(stored, tmp_path / "wan_fp8.safetensors")
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    return tmp_path / "wan_fp8.safetensors", tmp_path / "config", dequantized, inputs


def patched_wan_converter(monkeypatch, edit) -> None:
    """diffusers' Wan converter, then `edit` on what it returns (for diffusers' loader too)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    converters = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = converters["checkpoint_mapping_fn"]

    def converted(checkpoint, **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        edit(out)
        return out

    converters["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", converters)


def test_a_float8_weight_the_converter_moves_takes_its_own_scale_along(tmp_path, monkeypatch):
    """The converter never sees the scales: dlo gives each to the tensors made of its weight.
    A converter that swaps two float8 weights (under the names of each other's scales, as Wan's
    passes keys through) streams each with its own scale, equal to diffusers' model of the
    dequantized weights converted the same way."""
    q, k = "blocks.0.attn1.to_q.weight", "blocks.0.attn1.to_k.weight"

    def swap(out):
        out[q], out[k] = out[k], out[q]

    patched_wan_converter(monkeypatch, swap)
    path, config_dir, dequantized, inputs = wan_scaled_fp8_file(tmp_path)
    expected_model = reference(dequantized, config_dir, diffusers.WanTransformer3DModel, torch.bfloat16)
    expected = run(expected_model, inputs)
    loaded, plan = dlo.load_transformer(path, model_config=config_dir)
    source, checkpoint = plan.peek().bindings[q], plan.peek().checkpoint
    assert torch.equal(source.materialize(checkpoint), expected_model.get_parameter(q).data)
    with dlo.enable(loaded, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(loaded, inputs)))


@pytest.mark.parametrize("case", ["two scales", "a tensor under a scale's name"])
def test_a_scale_that_may_not_be_its_weights_is_refused(tmp_path, monkeypatch, case):
    """A weight with both a `scale_weight` and a `weight_scale` has two; a converter that makes a
    tensor under the name the weight's scale takes beside it would have the model read that one.
    Either is refused naming it, never streamed."""
    if case != "two scales":
        patched_wan_converter(monkeypatch, lambda out: out.update({"blocks.0.attn1.to_q.scale_weight": torch.ones(())}))
    path, config_dir, _, _ = wan_scaled_fp8_file(tmp_path, two_scales=case == "two scales")
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir)
    says = "has two scales beside it" if case == "two scales" else "makes a tensor named 'blocks.0.attn1.to_q.scale_weight'"
    assert "\n" not in str(refused.value) and says in str(refused.value), str(refused.value)


def test_two_weights_whose_scales_would_take_one_name_are_unreadable(tmp_path, monkeypatch):
    """Two float8 weights the converter puts in one layer would leave one scale name for both."""
    from diffusers import WanTransformer3DModel

    patched_wan_converter(monkeypatch, lambda out: out.update({"blocks.0.attn1.to_q.bias": out["blocks.0.attn1.to_k.weight"]}))
    path, config_dir, _, _ = wan_scaled_fp8_file(tmp_path)
    config = WanTransformer3DModel.load_config(config_dir)
    file = SafetensorsFile(path)
    try:
        layout = converted_layout(file, WanTransformer3DModel, config, set())
    finally:
        file.close()
    assert layout.unreadable == {
        "blocks.0.attn1.to_q.weight": "the scales of 'blocks.0.self_attn.k.weight' and 'blocks.0.self_attn.q.weight' "
        "would both be 'blocks.0.attn1.to_q.scale_weight'"
    }


CUTS = {  # a view of the converted q weight [rows, columns] -> (rows it starts at, or None: unreadable)
    "the second half of its rows": (lambda w: w[w.shape[0] // 2:], 16),
    "rows from the middle of one": (lambda w: w.flatten()[8: 8 + 16 * w.shape[1]].view(16, w.shape[1]), None),
    "half-width rows": (lambda w: w.view(w.shape[0] * 2, w.shape[1] // 2)[:16], None),
}


@pytest.mark.parametrize("cut", CUTS)
def test_a_per_row_scale_follows_a_range_of_whole_rows_of_its_weight_only(tmp_path, monkeypatch, cut):
    """A range of whole rows of a float8 weight (a fused projection split) takes the same rows
    of its per-row scale, a range of the file too; a range of other rows is unreadable."""
    from diffusers import WanTransformer3DModel

    view, first = CUTS[cut]
    q = "blocks.0.attn1.to_q.weight"
    patched_wan_converter(monkeypatch, lambda out: out.update({q: view(out[q])}))
    path, config_dir, _, _ = wan_scaled_fp8_file(tmp_path, quantize=per_row_fp8)
    file = SafetensorsFile(path)
    try:
        layout = converted_layout(file, WanTransformer3DModel, WanTransformer3DModel.load_config(config_dir), set())
        scale = file.entries["blocks.0.self_attn.q.scale_weight"]
    finally:
        file.close()
    if first is None:
        assert "that no one scale of the file dequantizes" in layout.unreadable[q]
    else:
        rows = layout.entries[q].shape[0]
        got = layout.entries["blocks.0.attn1.to_q.scale_weight"]
        assert (got.begin, got.end, got.shape) == (scale.begin + first * 4, scale.begin + (first + rows) * 4, (rows, 1))
        assert q not in layout.unreadable
