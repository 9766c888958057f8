"""Checkpoints that are already float8 with scales (ecosystem formats: ComfyUI's
`scale_weight`, ModelOpt / compressed-tensors' `weight_scale`) stream as stored and equal
the model dequantized independently from the file. See [Note: fp8 streaming]"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import dlo
from dlo.models.tiny import TINY_MODELS
from fp8_checkpoints import FP8, resident_from, write_fp8_checkpoint


def outputs(model, seeds=(1, 2)):
    with torch.inference_mode():
        return [model(**TINY_MODELS["flux"].inputs(seed, torch.bfloat16))[0] for seed in seeds]


@pytest.mark.parametrize(
    ("scale_name", "per_channel"),
    [("weight_scale", True), ("scale_weight", False)],
    ids=["modelopt-per-channel", "comfyui-per-tensor"],
)
def test_a_float8_checkpoint_streams_as_stored_and_matches_its_dequantized_weights(tmp_path, scale_name, per_channel):
    directory, dequantized = write_fp8_checkpoint(tmp_path, scale_name, per_channel)
    expected = outputs(resident_from(dequantized))
    model, plan = dlo.load_transformer(directory)
    assert plan is not None
    with dlo.enable(model, "cpu", plan=plan) as handle:
        got = outputs(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    stored = load_file(directory / "diffusion_pytorch_model.safetensors")
    float8_bytes = sum(t.numel() for t in stored.values() if t.dtype == FP8)
    assert stats.host_bytes_by_dtype["float8_e4m3fn"] == float8_bytes
    assert stats.host_bytes == 0  # nothing private: the float8 bytes are the mapping's


def test_resident_blocks_of_a_float8_checkpoint_hold_the_dequantized_weights(tmp_path):
    directory, dequantized = write_fp8_checkpoint(tmp_path)
    expected = outputs(resident_from(dequantized))
    model, plan = dlo.load_transformer(directory)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=2, num_slots=3), plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, outputs(model)))


def _drop_one_scale(state):
    del state["transformer_blocks.0.ff.net.2.weight_scale"]


def _both_scale_names(state):
    state["transformer_blocks.0.ff.net.2.scale_weight"] = state["transformer_blocks.0.ff.net.2.weight_scale"].clone()


def _wrong_scale_shape(state):
    state["transformer_blocks.0.ff.net.2.weight_scale"] = torch.ones(3, 2)


def _nan_scale(state):
    state["transformer_blocks.0.ff.net.2.weight_scale"][1, 0] = float("nan")


def _float64_scale(state):
    state["transformer_blocks.0.ff.net.2.weight_scale"] = state["transformer_blocks.0.ff.net.2.weight_scale"].double()


def _float8_bias(state):
    state["transformer_blocks.0.ff.net.2.bias"] = state["transformer_blocks.0.ff.net.2.bias"].to(FP8)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_one_scale, r"ff\.net\.2\.weight'.*no scales \(looked for 'transformer_blocks\.0\.ff\.net\.2\.weight_scale'"),
        (_both_scale_names, r"two sets of scales"),
        (_wrong_scale_shape, r"scales of shape \[3, 2\] for a weight of 32 rows"),
        (_nan_scale, r"weight_scale' holds NaN or Inf"),
        (_float64_scale, r"scales must be fp32, bf16 or fp16, found torch.float64"),
        (_float8_bias, r"ff\.net\.2\.bias'.*only as the 2-D weight of a Linear layer"),
    ],
)
def test_float8_weights_dlo_cannot_dequantize_exactly_are_refused_by_name(tmp_path, edit, message):
    directory, _ = write_fp8_checkpoint(tmp_path, edit=edit)
    with pytest.raises(dlo.CheckpointError, match=message) as raised:
        dlo.load_transformer(directory)
    assert raised.value.kind == dlo.CheckpointErrorKind.FP8_SCALES


def _shard(directory, index_lists_scales=True):
    """The checkpoint in two shards and an index; without `index_lists_scales`, the index a
    converter that added scales to the shards left as it was."""
    path = directory / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    path.unlink()
    names = sorted(state)
    weight_map = {}
    for number, keys in enumerate([names[: len(names) // 2], names[len(names) // 2 :]], 1):
        shard = f"diffusion_pytorch_model-0000{number}-of-00002.safetensors"
        save_file({key: state[key] for key in keys}, directory / shard)
        weight_map.update({key: shard for key in keys if index_lists_scales or not key.endswith("weight_scale")})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("fields", [dict(checkpoint_mmap=False), dict(host_weight_cache=True)])
@pytest.mark.parametrize("index", [None, "stale"], ids=["one-file", "shards-with-an-index-without-the-scales"])
def test_a_float8_checkpoint_is_never_loaded_the_ordinary_way(tmp_path, fields, index):
    """diffusers' loader would cast the float8 values and drop the scales: wrong weights.
    Every file's header counts, also where the index is inconsistent (dlo's mapping refuses
    such an index, diffusers' loader does not)."""
    directory, _ = write_fp8_checkpoint(tmp_path)
    if index == "stale":
        _shard(directory, index_lists_scales=False)
    config = dlo.OffloadConfig(**fields, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(dlo.ConfigError, match="holds float8 weights, which dlo reads only from the checkpoint mapping"):
        dlo.load_transformer(directory, config, torch.bfloat16)


@pytest.mark.parametrize("fields", [dict(checkpoint_mmap=False), dict(host_weight_cache=True)])
def test_a_safetensors_header_that_cannot_be_read_is_refused_before_the_ordinary_loader(tmp_path, fields):
    """Whether the files hold float8 cannot be told: refused by name, nothing loaded."""
    directory, _ = write_fp8_checkpoint(tmp_path)
    _shard(directory)
    os.truncate(directory / "diffusion_pytorch_model-00002-of-00002.safetensors", 4)  # a partial copy
    with pytest.raises(dlo.CheckpointError, match="00002-of-00002.safetensors: truncated") as raised:
        dlo.load_transformer(directory, dlo.OffloadConfig(**fields, cache_dir=str(tmp_path / "cache")), torch.bfloat16)
    assert raised.value.kind == dlo.CheckpointErrorKind.TRUNCATED
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "fields", [dict(), dict(checkpoint_mmap=False), dict(host_weight_cache=True)], ids=["mapped", "ordinary", "cache"]
)
def test_safetensors_files_the_loader_does_not_read_are_left_alone(tmp_path, fields):
    """A bf16 checkpoint beside a float8 variant and a truncated copy, neither of which the
    index or the single-file name points at: neither is the loader's, so neither is read."""
    directory = tmp_path / "flux"
    reference = TINY_MODELS["flux"].build(seed=3, dtype=torch.bfloat16)
    reference.save_pretrained(directory)
    fp8_directory, _ = write_fp8_checkpoint(tmp_path)
    os.link(fp8_directory / "diffusion_pytorch_model.safetensors", directory / "fp8-variant.safetensors")
    (directory / "partial-copy.safetensors").write_bytes(b"\x00" * 4)
    config = dlo.OffloadConfig(**fields, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True)
    model, plan = dlo.load_transformer(directory, config, torch.bfloat16)
    with dlo.enable(model, "cpu", config, plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(outputs(model), outputs(reference)))


@pytest.mark.parametrize("stream_dtype", [None, "fp8"])
def test_a_registered_float8_checkpoint_is_copied_from_its_pages_into_the_landing_buffer(tmp_path, driver, stream_dtype):
    """With the fake registration driver on the CPU: the mapping is registered (its float8
    weights need no host adapter), also when stream_dtype asks for float8 (the weights
    already are), and the loads read the mapping's own pages."""
    from dlo.hotpath.executors import CpuExecutor

    directory, dequantized = write_fp8_checkpoint(tmp_path)
    expected = outputs(resident_from(dequantized))
    config = dlo.OffloadConfig(stream_dtype=stream_dtype)
    model, plan = dlo.load_transformer(directory, config)
    sources = []
    run = CpuExecutor.run

    def record(self, load):
        if load.finish is not None:
            sources.extend(task.source for task in load.copies(0))
        return run(self, load)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuExecutor, "run", record)
        with dlo.enable(model, "cpu", config, plan=plan) as handle:
            got = outputs(model)
            stats = handle.stats()
            mapping = handle._checkpoint
            assert sources and all(mapping.holds(source) for source in sources if source.dtype == FP8)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes > 0 and stats.host_bytes == 0


def test_all_gather_mode_shards_a_float8_checkpoint_as_float8(tmp_path):
    """A group of one (no process group): the rank's one shard is the whole float8 image,
    copied out of the mapping at enable(); disable() gives back the dequantized weights."""
    directory, dequantized = write_fp8_checkpoint(tmp_path)
    expected = outputs(resident_from(dequantized))
    model, plan = dlo.load_transformer(directory)
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True), plan=plan)
    got = outputs(model)
    stats = handle.stats()
    handle.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.backing == "shards" and stats.host_bytes_by_dtype["float8_e4m3fn"] > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, outputs(model)))


def test_resident_blocks_of_a_registered_float8_checkpoint_are_dequantized(tmp_path, driver):
    """Resident tensors of a registered mapping are otherwise copied straight from its pages:
    float8 ones are dequantized instead."""
    directory, dequantized = write_fp8_checkpoint(tmp_path)
    expected = outputs(resident_from(dequantized))
    config = dlo.OffloadConfig(resident_layers=2, num_slots=3)
    model, plan = dlo.load_transformer(directory, config)
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        assert handle.stats().registered_bytes > 0
        assert all(torch.equal(a, b) for a, b in zip(expected, outputs(model)))
