"""Registering an as-saved checkpoint mapping (docs/guides/host-weight-cache.md, for the mappings
of docs/guides/checkpoints.md), on CPU with a fake driver: blocks copy straight from the
checkpoint's pages when no tensor needs a cast (a concatenation is copied part by part into its
rows of the slot); a cast keeps the staging path."""

import logging

import pytest
import torch

from safetensors.torch import save_file

import dlo
from test_checkpoint_mmap import ordinary
from dlo.hotpath.executors import CpuExecutor
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


@pytest.fixture
def flux(tmp_path):
    """(directory of a sharded tiny Flux checkpoint, its resident outputs)."""
    TINY_MODELS["flux"].build(seed=5).save_pretrained(tmp_path, max_shard_size="100KB")
    return tmp_path, run(ordinary(tmp_path, "flux", torch.float32))


def run(model, dtype=torch.float32):
    with torch.inference_mode():
        return [model(**TINY_MODELS["flux"].inputs(seed, dtype))[0] for seed in (1, 2)]


def test_an_as_saved_checkpoint_mapping_is_registered_and_copied_from_directly(flux, driver, monkeypatch):
    directory, expected = flux
    sources = []
    issue = CpuExecutor.run

    def record(self, load):
        sources.extend(task.source.data_ptr() for task in load.copies(0))
        return issue(self, load)

    monkeypatch.setattr(CpuExecutor, "run", record)
    model, plan = dlo.load_transformer(directory)
    assert plan.backing == "checkpoint_mmap"
    with dlo.enable(model, "cpu", plan=plan) as handle:
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes > 0 and stats.registration_fallback == "" and stats.staging_bytes == 0
    # One copy per tensor from the mapping (not one staged copy per block): two calls of every
    # block, and the third call's first block prefetched.
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    per_call = sum(len(block.state_dict()) for block in blocks)
    assert stats.copies == 2 * len(blocks) + 1
    assert len(sources) == 2 * per_call + len(blocks[0].state_dict())
    shards = len(list(directory.glob("*.safetensors")))
    assert stats.registered_ranges == shards  # one page-aligned range per checkpoint file
    assert driver.registered == {}


def test_fused_projections_copy_part_by_part_from_the_registered_mapping(flux, driver, monkeypatch):
    """fuse_qkv=True: each fused weight is its checkpoint's q, k and v, one after another; the
    mapping is registered all the same and each part is copied from its view of the mapping
    into its own rows of the slot."""
    directory, _ = flux
    expected = run(ordinary(directory, "flux", torch.float32, fuse_qkv=True))
    copies = set()  # (target's byte offset in its slot, source address)
    issue = CpuExecutor.run

    def record(self, load):
        copies.update((t.target.data_ptr() - load.slot.buffer.data_ptr(), t.source.data_ptr()) for t in load.copies(0))
        return issue(self, load)

    monkeypatch.setattr(CpuExecutor, "run", record)
    model, plan = dlo.load_transformer(directory, fuse_qkv=True)
    assert plan.adapter_counts().get("concat", 0) > 0
    mapping = plan.peek().checkpoint
    with dlo.enable(model, "cpu", plan=plan) as handle:
        got = run(model)
        stats = handle.stats()
        parts = []
        for block in handle._runtime.blocks:
            for placement in block.layout.placements:
                if placement.spec.name.endswith("to_qkv.weight"):
                    layer, at = f"{block.name}.{placement.spec.name[: -len('to_qkv.weight')]}", placement.offset
                    for part in ("to_q", "to_k", "to_v"):
                        view = mapping.view(f"{layer}{part}.weight")
                        parts.append((at, view.data_ptr()))
                        at += view.nbytes
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes > 0 and stats.registration_fallback == "" and stats.staging_bytes == 0
    assert parts and set(parts) <= copies


def test_fused_projections_of_resident_blocks_come_whole_from_the_registered_mapping(tmp_path, driver):
    """Resident blocks' fused weights are put together from the mapping's parts at enable()."""
    TINY_MODELS["flux"].build(seed=5).save_pretrained(tmp_path)
    expected = run(ordinary(tmp_path, "flux", torch.float32, fuse_qkv=True))
    model, plan = dlo.load_transformer(tmp_path, fuse_qkv=True)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=2), plan=plan) as handle:
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.resident_blocks == 2 and stats.registered_bytes > 0 and stats.staging_bytes == 0


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_a_gguf_sd3_file_with_a_swapped_norm_is_registered(tmp_path, driver, quant):
    """The swapped norm's packed halves, rows of one quant type, are copied from the registered
    file into their rows of the slot: equal to diffusers' GGUF model."""
    gguf = pytest.importorskip("gguf")
    from gguf_files import load_gguf, write_gguf
    from single_file_layouts import sd3_original
    from test_gguf_mapping import streamed

    torch.manual_seed(0)
    wide = {"attention_head_dim": 128, "caption_projection_dim": 256, "joint_attention_dim": 256} if quant == "Q4_K" else {}
    model = diffusers.SD3Transformer2DModel(**{**TINY_MODELS["sd3"].config, **wide})
    model.save_config(tmp_path)
    layers = model.config.num_layers
    path = write_gguf(model, tmp_path / "sd3.gguf", gguf.GGMLQuantizationType[quant], layout=lambda state: sd3_original(state, layers))
    inputs = [TINY_MODELS["sd3"].inputs(seed, torch.bfloat16) for seed in (1, 2)]
    if wide:
        inputs = [dict(i, encoder_hidden_states=torch.randn(1, 4, 256, dtype=torch.bfloat16)) for i in inputs]
    reference = load_gguf(path, tmp_path, "SD3Transformer2DModel", torch.bfloat16)
    with torch.inference_mode():
        expected = [reference(**i)[0] for i in inputs]
    got, _, _, adapters, stats = streamed(path, tmp_path, inputs, torch.bfloat16)
    assert adapters == {"concat": 2}
    assert stats.registered_bytes > 0 and stats.staging_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_an_sd3_float8_file_with_a_swapped_norm_is_registered(tmp_path, driver):
    """float8 block weights (landed, then dequantized) beside the swapped norm's parts, all from
    the registered file: equal to diffusers' model of the dequantized weights."""
    from single_file_layouts import sd3_original
    from test_quantized_single_files import comfyui_layer
    from test_single_file_mapping import reference

    entry = TINY_MODELS["sd3"]
    model = entry.build(seed=2, dtype=torch.bfloat16)
    model.save_config(tmp_path / "config")
    stored, dequantized = {}, {}
    for key, tensor in sd3_original({k: v.contiguous() for k, v in model.state_dict().items()}, model.config.num_layers).items():
        if key.startswith("joint_blocks.") and tensor.dim() == 2 and "adaLN" not in key:
            comfyui_layer(stored, dequantized, key, tensor)
        else:
            stored[key] = dequantized[key] = tensor
    path = tmp_path / "sd3.safetensors"
    save_file(stored, path)
    inputs = [entry.inputs(seed, torch.bfloat16) for seed in (1, 2)]
    resident = reference(dequantized, tmp_path / "config", diffusers.SD3Transformer2DModel, torch.bfloat16)
    with torch.inference_mode():
        expected = [resident(**i)[0] for i in inputs]
    loaded, plan = dlo.load_transformer(path, model_config=tmp_path / "config")
    assert plan.adapter_counts() == {"concat": 2}
    with dlo.enable(loaded, "cpu", plan=plan) as handle, torch.inference_mode():
        got = [loaded(**i)[0] for i in inputs]
        stats = handle.stats()
    assert stats.registered_bytes > 0 and stats.staging_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_checkpoint_that_needs_a_cast_is_staged_not_registered(flux, driver, caplog):
    directory, _ = flux
    expected = run(ordinary(directory, "flux", torch.bfloat16), torch.bfloat16)
    model, plan = dlo.load_transformer(directory, torch_dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="dlo"), dlo.enable(model, "cpu", plan=plan) as handle:
        got = run(model, torch.bfloat16)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert "not used in their saved dtype (a cast)" in stats.registration_fallback
    assert stats.registered_bytes == 0 and driver.calls == []  # decided before any driver call
    assert "host registration not used" not in caplog.text  # expected, so not a warning


def test_the_ceiling_applies_to_checkpoint_mappings(flux, driver):
    directory, expected = flux
    model, plan = dlo.load_transformer(directory)
    config = dlo.OffloadConfig(pin_limit_gib=1e-6)
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert "exceeds the registration ceiling" in stats.registration_fallback
    assert [c for c in driver.calls if c[0] == "register"] == []
