"""The disk tier on CUDA: pinned read buffers, copies from them on the copy stream, events
guarding their reuse (See [Note: the disk tier])."""

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS
from test_host_tier_choice import double_kept  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
diffusers = pytest.importorskip("diffusers")


def run(model, name, dtype, seeds):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype, "cuda"))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize("torch_dtype", [None, torch.bfloat16], ids=["as-saved", "cast"])
@pytest.mark.parametrize("fraction", [0.3, 0.9])
def test_disk_tier_matches_resident_on_cuda(tmp_path, name, torch_dtype, fraction):
    TINY_MODELS[name].build(seed=2).save_pretrained(tmp_path)
    dtype = torch_dtype or torch.float32
    cls = getattr(diffusers, TINY_MODELS[name].class_name)
    expected = run(cls.from_pretrained(tmp_path, torch_dtype=dtype).eval().cuda(), name, dtype, range(6))
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    model, plan = dlo.load_transformer(tmp_path, torch_dtype=torch_dtype)
    with dlo.enable(model, "cuda", dlo.OffloadConfig(host_budget_gib=fraction * size / 2**30), plan=plan) as handle:
        got = run(model, name, dtype, range(6))
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # The last four calls ran on the blocks chosen from the second (See [Note: which blocks stay in RAM]).
    assert stats.disk is not None and stats.disk.choice.state == "chosen"
    assert stats.disk.reads >= 4 * len(stats.disk.blocks) > 0
    assert stats.registered_bytes == 0 and stats.registration_fallback.startswith("host_budget_gib")


def test_blocks_moved_between_pinned_host_memory_and_disk_on_cuda(tmp_path, double_kept):
    """The tiny Flux at 0.9 of its files, the choice made DOUBLE_KEPT: a double block moves
    into a new pinned copy and a single block's pinned copy is released; every call equals
    resident."""
    TINY_MODELS["flux"].build(seed=2).save_pretrained(tmp_path)
    cls = getattr(diffusers, TINY_MODELS["flux"].class_name)
    expected = run(cls.from_pretrained(tmp_path).eval().cuda(), "flux", torch.float32, range(5))
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    model, plan = dlo.load_transformer(tmp_path)
    with dlo.enable(model, "cuda", dlo.OffloadConfig(host_budget_gib=0.9 * size / 2**30), plan=plan) as handle:
        got = run(model, "flux", torch.float32, range(5))
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    choice = stats.disk.choice
    assert choice.moved_to_ram == ("transformer_blocks.0",) and choice.moved_to_disk == ("single_transformer_blocks.0",)
    assert stats.pinned and stats.host_bytes + stats.disk.read_buffer_bytes <= stats.disk.budget_bytes


def test_a_float8_checkpoint_read_from_disk_on_cuda(tmp_path):
    """float8 bytes read from disk land in the landing buffers and are dequantized there."""
    from fp8_checkpoints import resident_from, write_fp8_checkpoint

    directory, dequantized = write_fp8_checkpoint(tmp_path)
    expected = run(resident_from(dequantized).cuda(), "flux", torch.bfloat16, range(4))
    model, plan = dlo.load_transformer(directory)
    with dlo.enable(model, "cuda", dlo.OffloadConfig(host_budget_gib=0.00037), plan=plan) as handle:
        got = run(model, "flux", torch.bfloat16, range(4))
        disk = handle.stats().disk
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert disk is not None and len(disk.blocks) > 0


@pytest.mark.parametrize("source", ["checkpoint", "fp8"])
def test_all_gather_shards_read_from_disk_on_cuda(tmp_path, source):
    """All-gather mode in a group of one (this one GPU): shards read per use into pinned read
    buffers, copied on the copy stream, float8 ones dequantized from the landing buffers;
    every call and the module after disable() equal resident. See [Note: shards read from disk]"""
    from fp8_checkpoints import resident_from, write_fp8_checkpoint

    if source == "fp8":
        directory, dequantized = write_fp8_checkpoint(tmp_path)
        resident, dtype, budget = resident_from(dequantized), torch.bfloat16, 0.00014  # 4 of 5 blocks on disk
    else:
        TINY_MODELS["flux"].build(seed=2).save_pretrained(tmp_path)
        directory, dtype = tmp_path, torch.float32
        resident = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path).eval()
        budget = 0.9 * sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) / 2**30
    expected = run(resident.cuda(), "flux", dtype, range(4))
    model, plan = dlo.load_transformer(directory)
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget)
    with dlo.enable(model, "cuda", config, plan=plan) as handle:
        got = run(model, "flux", dtype, range(4))
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.gather_group_size == 1 and stats.pinned
    assert stats.disk.reads >= 4 * len(stats.disk.blocks) > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, run(model.cuda(), "flux", dtype, range(4))))
