"""A single file loaded by diffusers' single-file loader (one the mapping cannot stream: diffusers'
converter computes much of its blocks, here MiniMax-H3's q/k/v rows interleaved head by head;
or any file with `checkpoint_mmap=False`) goes through the host weight cache with
`host_weight_cache=True`: the loader converts it once, its final tensors are published (a GGUF
file's as their packed bytes, with their quant types), and later loads map the entry without
running the loader. Every output is compared with diffusers' own `from_single_file` model run
resident. See [Note: GGUF entries] in dlo.host.cache.consume."""

import logging
import os

import pytest
import torch

import dlo
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.identity import CONTENT, PACKED, digest_of, without_content
from dlo.host.cache.source_index import SourceIndex
from dlo.host.safetensors_file import PAD_PREFIX
from ordinary_tensors import ordinary_tensors
from single_file_layouts import minimax_h3_original, wan_original
from test_converter_options import HEADS, HEAD_DIM, MINIMAX, MiniMax, equal, outputs
from test_single_file_mapping import random_model, write

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
from gguf_files import write_gguf  # noqa: E402

INTERLEAVED = {"qkv_layout": "interleaved"}
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
)


def interleaved_file(tmp_path, kind: str, seed: int = 2):
    """A MiniMax-H3 file with interleaved q/k/v rows: `kind` "safetensors" (float32),
    "safetensors-bf16", or a GGUF quant type."""
    dtype = torch.bfloat16 if kind == "safetensors-bf16" else torch.float32
    model = random_model(MiniMax, MINIMAX, dtype, seed)
    layout = lambda state: minimax_h3_original(state, HEADS, HEAD_DIM, "interleaved")  # noqa: E731
    if kind.startswith("safetensors"):
        return write(tmp_path, f"minimax-{seed}", model, layout)
    config_dir = tmp_path / "config"
    model.save_config(config_dir)
    return write_gguf(model, tmp_path / f"minimax-{seed}.gguf", gguf.GGMLQuantizationType[kind], layout=layout), config_dir


def diffusers_model(path, config_dir, dtype=torch.float32, **options):
    """diffusers' own single-file model of the file in `dtype` (a GGUF file's computing in it)."""
    quantized = {}
    if path.suffix == ".gguf":
        quantized = {"quantization_config": diffusers.GGUFQuantizationConfig(compute_dtype=dtype)}
    model = MiniMax.from_single_file(
        str(path), config=str(config_dir), torch_dtype=dtype, **INTERLEAVED, **options, **quantized
    ).eval()
    if not quantized:  # a GGUF model's packed weights are dequantized into fresh tensors as it computes
        ordinary_tensors(model)
    return model


def cache_config(tmp_path, checkpoint_mmap: bool = False) -> dlo.OffloadConfig:
    """The cache in tmp_path; `checkpoint_mmap=False`: every file through diffusers' loader (the
    tiny GGUF files' interleaved q/k/v are small enough to be held privately beside the mapping)."""
    return dlo.OffloadConfig(
        host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True,
        checkpoint_mmap=checkpoint_mmap,
    )


def load(path, config_dir, config, options=INTERLEAVED):
    return dlo.load_transformer(path, config, model_config=config_dir, converter_options=options)


def packed_types(model) -> dict[str, str]:
    return {name: p.quant_type.name for name, p in model.named_parameters() if type(p).__name__ == "GGUFParameter"}


@pytest.mark.parametrize("kind", ["safetensors", "safetensors-bf16", "Q8_0", "Q4_0"])
def test_a_file_diffusers_loads_is_converted_once_and_later_loads_map_the_entry(tmp_path, caplog, monkeypatch, kind):
    """The .safetensors files are ones the mapping cannot stream (their q/k/v, computed, are a
    fifth of the file); the GGUF files are loaded with checkpoint_mmap=False. A bfloat16 file is
    loaded in its own dtype (torch_dtype=None): diffusers' loader casts the whole model,
    MiniMax-H3's fp32-kept modules and its buffers included, and a warm start builds the same."""
    path, config_dir = interleaved_file(tmp_path, kind)
    reference = diffusers_model(path, config_dir, torch.bfloat16 if kind == "safetensors-bf16" else torch.float32)
    expected = outputs(reference)
    config = cache_config(tmp_path, checkpoint_mmap=kind.startswith("safetensors"))
    with caplog.at_level(logging.INFO, logger="dlo"):
        cold, plan = load(path, config_dir, config)
    if config.checkpoint_mmap:
        assert "checkpoint mmap fallback checkpoint_plan_incompatible" in caplog.text
        assert "through the host weight cache" in caplog.text
    assert "warm start" not in caplog.text
    assert plan is not None and plan.backing == "host_weight_cache"
    assert packed_types(cold) == packed_types(reference)
    assert equal(expected, outputs(cold, plan))

    store = EntryStore(config.cache_dir)
    (key,) = store.keys()
    entry = store.validate(key)
    assert isinstance(entry, Entry)
    try:
        assert entry.manifest["identity"].get(PACKED, {}) == packed_types(reference)
        for name, weight in reference.named_parameters():  # the entry holds the loader's bytes, packed ones as packed
            assert torch.equal(entry.checkpoint.view(name), weight.data.view(weight.dtype)), name
    finally:
        entry.checkpoint.close()

    def no_loader(*args, **kwargs):
        raise AssertionError("a warm start runs no loader")

    monkeypatch.setattr(MiniMax, "from_single_file", no_loader)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dlo"):
        warm, plan = load(path, config_dir, config)
    assert f"warm start from cache entry {key[:16]}" in caplog.text
    assert packed_types(warm) == packed_types(reference)  # GGUFParameters again, each with its quant type
    # The tiny model's outputs barely depend on its block weights: every tensor is compared too
    # (views of the entry until enable() binds the blocks), buffers included.
    for mine, theirs in [(warm.state_dict(), reference.state_dict()), (dict(warm.named_buffers()), dict(reference.named_buffers()))]:
        assert mine.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype and torch.equal(mine[name].data, tensor.data), name
    assert plan.backing == "host_weight_cache" and equal(expected, outputs(warm, plan))
    assert store.keys() == [key]


@pytest.fixture
def converter_with_a_flip(monkeypatch):
    """diffusers' MiniMax-H3 converter given one more option: `flip="yes"` reverses the rows of
    the first block's q projection."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["MiniMaxH3Transformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]

    def converted(checkpoint, config, qkv_layout="stacked", flip="no", **kwargs):
        out = convert(checkpoint=checkpoint, config=config, qkv_layout=qkv_layout, **kwargs)
        if flip == "yes":
            name = "transformer_blocks.0.attn.to_q.weight"
            out[name] = out[name].flip(0)
        return out

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "MiniMaxH3Transformer3DModel", entry)


def test_another_file_or_other_converter_options_never_map_an_entry_made_before(tmp_path, caplog, converter_with_a_flip):
    """The entry's identity holds the file (size, times, inode) and the converter options: a file
    read with other options, or another file written in its place, is converted again and
    computes its own weights."""
    config = cache_config(tmp_path)
    path, config_dir = interleaved_file(tmp_path, "Q8_0", seed=2)
    first = outputs(diffusers_model(path, config_dir))
    model, plan = load(path, config_dir, config)
    assert equal(first, outputs(model, plan))
    flipped = outputs(diffusers_model(path, config_dir, flip="yes"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dlo"):
        model, plan = load(path, config_dir, config, {**INTERLEAVED, "flip": "yes"})
    assert "warm start" not in caplog.text
    assert equal(flipped, outputs(model, plan)) and not equal(first, flipped)

    other, _ = interleaved_file(tmp_path / "other", "Q8_0", seed=3)
    os.replace(other, path)  # another file under the same name
    second = outputs(diffusers_model(path, config_dir))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dlo"):
        model, plan = load(path, config_dir, config)
    assert "warm start" not in caplog.text
    assert equal(second, outputs(model, plan)) and not equal(first, second)
    assert len(EntryStore(config.cache_dir).keys()) == 3


SCALAR = {"extra": torch.zeros((), dtype=torch.uint8)}  # a uint8 tensor no Linear holds


@pytest.mark.parametrize(
    ("crafted", "extra", "says"),
    [
        (lambda packed, name: {**packed, name: "Q9_9"}, {}, "diffusers' GGUF loader packs no ['Q9_9']"),
        (lambda packed, name: {**packed, name: "F16"}, {}, "diffusers' GGUF loader packs no ['F16']"),
        (lambda packed, name: {**packed, "extra": "Q8_0"}, SCALAR, "do not build the model (IndexError"),
        (lambda packed, name: {**packed, name: "Q4_0"}, {}, "in the entry, this load makes"),  # a type of another size
        (lambda packed, name: {**packed, "norm_out.linear.bias": "Q8_0"}, {}, "is not a uint8 tensor of the entry"),
        (lambda packed, name: [name], {}, "its packed tensors are not an object"),
    ],
    ids=["unknown-type", "plain-type", "scalar", "wrong-type", "not-packed", "not-an-object"],
)
def test_an_entry_whose_quant_types_cannot_be_right_is_not_mapped(tmp_path, caplog, crafted, extra, says):
    """An entry names its GGUF tensors' quant types in its identity: a crafted one (published
    under the key its identity hashes to, and named by the warm-start index) is refused, and
    the load goes cold, computing what diffusers' model does."""
    path, config_dir = interleaved_file(tmp_path, "Q8_0")
    expected = outputs(diffusers_model(path, config_dir))
    config = cache_config(tmp_path)
    load(path, config_dir, config)
    store = EntryStore(config.cache_dir)
    (key,) = store.keys()
    entry = store.validate(key)
    try:
        identity = entry.manifest["identity"]
        tensors = {n: entry.checkpoint.view(n).clone() for n in entry.checkpoint.tensors if not n.startswith(PAD_PREFIX)}
    finally:
        entry.checkpoint.close()
    load_part = without_content(identity)
    forged = {**load_part, CONTENT: identity[CONTENT], PACKED: crafted(identity[PACKED], "transformer_blocks.0.attn.to_q.weight")}
    forged_key = digest_of(forged)  # as a writer of its own would publish it
    store.publish(forged_key, {**tensors, **extra}, forged)
    SourceIndex(store.root).record(load_part, forged_key)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlo"):
        model, plan = load(path, config_dir, config)
    assert f"not warm-starting from {forged_key[:16]}" in caplog.text and says in caplog.text, caplog.text
    assert equal(expected, outputs(model, plan))


def test_a_file_that_streams_from_its_mapping_publishes_nothing(tmp_path):
    """The cache is for files the mapping cannot stream: a file it can (Wan's renames) streams
    from its own mapping with the cache on, and nothing is written under the cache directory."""
    model = random_model(diffusers.WanTransformer3DModel, WAN, torch.float32)
    path, config_dir = write(tmp_path, "wan", model, wan_original)
    config = cache_config(tmp_path, checkpoint_mmap=True)
    _, plan = dlo.load_transformer(path, config, model_config=config_dir)
    assert plan.backing == "checkpoint_mmap"
    assert not (tmp_path / "cache").exists()


def float8_file(tmp_path, model, layout, name):
    """`model` in `layout` with each 2-D weight float8 and a per-tensor `scale_weight`, as
    ComfyUI's fp8_scaled files hold them."""
    from safetensors.torch import save_file

    config_dir = tmp_path / f"{name}-config"
    model.save_config(config_dir)
    stored = {}
    for key, tensor in layout({k: v.contiguous() for k, v in model.state_dict().items()}).items():
        if key.endswith(".weight") and tensor.dim() == 2:
            scale = (tensor.float().abs().amax() / 448).clamp_min(1e-12)
            stored[key] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            stored[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            stored[key] = tensor
    path = tmp_path / f"{name}.safetensors"
    save_file(stored, path)
    return path, config_dir


def test_a_float8_file_with_the_cache_on_streams_from_its_mapping_or_is_refused(tmp_path):
    """diffusers' loader would drop a float8 file's scales, so the cache never converts one: with
    the cache on (dlo serve's default) a float8 file the mapping streams is mapped as without
    it, and one it cannot is refused in the loader's one line; nothing is published."""
    wan = random_model(diffusers.WanTransformer3DModel, WAN, torch.bfloat16)
    path, config_dir = float8_file(tmp_path, wan, wan_original, "wan-fp8")
    config = cache_config(tmp_path, checkpoint_mmap=True)
    _, plan = dlo.load_transformer(path, config, torch_dtype=torch.bfloat16, model_config=config_dir)
    assert plan.backing == "checkpoint_mmap"
    minimax = random_model(MiniMax, MINIMAX, torch.float32)
    layout = lambda state: minimax_h3_original(state, HEADS, HEAD_DIM, "interleaved")  # noqa: E731
    path, config_dir = float8_file(tmp_path, minimax, layout, "minimax-fp8")
    with pytest.raises(dlo.ConfigError) as refused:
        load(path, config_dir, config)
    assert str(refused.value).startswith(
        f"{path} holds float8 weights, which dlo reads only from the checkpoint mapping, and the mapping was refused "
        "(checkpoint_plan_incompatible: diffusers' converter computes"
    )
    assert not (tmp_path / "cache").exists()


@pytest.fixture
def wan_converter_computing_block_weights(monkeypatch):
    """diffusers' Wan converter, every 2-D block weight computed (its rows in reverse order):
    most of the file is no range of it, so it cannot be mapped."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]

    def converted(checkpoint, **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        return {k: v.flip(0) if k.startswith("blocks.") and v.dim() == 2 else v for k, v in out.items()}

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", entry)


def test_generate_with_the_cache_converts_a_file_once_and_the_next_run_maps_it(
    tiny_wan_dir, tmp_path, monkeypatch, wan_converter_computing_block_weights
):
    """`dlo generate MODEL --transformer FILE --host-weight-cache`: the first run publishes the
    converted transformer, the second maps it without diffusers' loader; both videos equal the
    one made without the cache."""
    from safetensors.torch import save_file
    from test_generate import flags

    from dlo.cli.main import main

    state = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").state_dict()
    path = tmp_path / "wan.safetensors"
    save_file({key: t.contiguous() for key, t in wan_original(state).items()}, path)
    argv = ["generate", str(tiny_wan_dir), "--prompt", "a cat", "--device", "cpu", *flags("wan"), "--transformer", str(path)]
    cache = ["--host-weight-cache", "--cache-dir", str(tmp_path / "cache"), "--cache-allow-any-filesystem"]
    videos = {}
    for run in ("no cache", "cold", "warm"):
        if run == "warm":
            monkeypatch.setattr(diffusers.WanTransformer3DModel, "from_single_file", None)  # any call fails
        out = tmp_path / f"{run}.webp"  # lossless: the frames as generated
        assert main([*argv, *([] if run == "no cache" else cache), "--output", str(out)]) == 0
        videos[run] = out.read_bytes()
    assert videos["cold"] == videos["warm"] == videos["no cache"]
    assert len(EntryStore(tmp_path / "cache").keys()) == 1


def test_a_file_replaced_while_diffusers_loads_it_is_not_published(tmp_path, caplog, monkeypatch):
    """The entry's identity names the file as it was before the load: a file replaced while the
    loader reads it would publish the new bytes under the old file's identity, so nothing is
    published (the load keeps what it read, a fallback logged), and the next load converts the
    new file."""
    from dlo.host import single_file_load

    path, config_dir = interleaved_file(tmp_path, "Q8_0", seed=2)
    other, _ = interleaved_file(tmp_path / "other", "Q8_0", seed=3)
    first = outputs(diffusers_model(path, config_dir))
    load_file = single_file_load.ordinary_single_file_load

    def replaced_while_loading(*args):
        model = load_file(*args)
        os.replace(other, path)
        return model

    monkeypatch.setattr(single_file_load, "ordinary_single_file_load", replaced_while_loading)
    config = cache_config(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        model, plan = load(path, config_dir, config)
    assert plan is None and "cache fallback cache_operation_failed: the checkpoint files changed" in caplog.text
    assert equal(first, outputs(model)) and EntryStore(config.cache_dir).keys() == []
    monkeypatch.setattr(single_file_load, "ordinary_single_file_load", load_file)
    model, plan = load(path, config_dir, config)
    assert equal(outputs(diffusers_model(path, config_dir)), outputs(model, plan)) and plan is not None
