"""Streaming straight from checkpoint mappings is bit-identical to ordinary loading (docs/guides/checkpoints.md)."""

import gc
import json
import logging

import pytest
import torch
from ordinary_tensors import ordinary_tensors
from safetensors.torch import save_file

import dlo
from dlo.host.checkpoint import INDEX_NAME, Checkpoint
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


def save(tmp_path, name, shard=None, dtype=torch.float32):
    directory = tmp_path / name
    kwargs = {"max_shard_size": shard} if shard else {}
    TINY_MODELS[name].build(seed=2, dtype=dtype).save_pretrained(directory, **kwargs)
    return directory


def ordinary(directory, name, dtype, fuse_qkv=False):
    """diffusers' own loader, every tensor then copied into an ordinary allocation (its mmap'd
    views can sit at odd offsets, which changes CPU kernels' last bits)."""
    model = getattr(diffusers, TINY_MODELS[name].class_name).from_pretrained(directory, torch_dtype=dtype).eval()
    if fuse_qkv:
        model.fuse_qkv_projections()
    ordinary_tensors(model)
    return model


def run(model, name, dtype, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux", "sd3", "qwenimage", "ltx"])
@pytest.mark.parametrize("shard", [None, "100KB"], ids=["single-file", "sharded"])
@pytest.mark.parametrize("torch_dtype", [None, torch.bfloat16], ids=["as-saved", "cast-to-bf16"])
def test_mapped_streaming_matches_ordinary_load(tmp_path, name, shard, torch_dtype):
    directory = save(tmp_path, name, shard)
    runtime_dtype = torch_dtype or torch.float32
    expected = run(ordinary(directory, name, runtime_dtype), name, runtime_dtype)
    model, plan = dlo.load_transformer(directory, torch_dtype=torch_dtype)
    assert plan is not None and plan.backing == "checkpoint_mmap"
    # The checkpoint is fp32: every tensor streamed as bf16 is a cast (Wan keeps its norms fp32).
    casts = sum(source.dtype == torch.bfloat16 for source in plan.bindings.values())
    assert plan.adapter_counts() == ({} if torch_dtype is None else {"cast": casts})
    assert torch_dtype is None or casts > 0
    with dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=2), plan=plan) as handle:
        got = run(model, name, runtime_dtype)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.host_bytes == 0 and stats.backing == "checkpoint_mmap"  # no private copy of any block
    assert stats.mapped_bytes == sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def test_fused_qkv_adapter_matches_ordinary_fusion(tmp_path):
    directory = save(tmp_path, "flux", "100KB")
    expected = run(ordinary(directory, "flux", torch.float32, fuse_qkv=True), "flux", torch.float32)
    model, plan = dlo.load_transformer(directory, fuse_qkv=True)
    # 2 double blocks fuse to_qkv and to_added_qkv, 3 single blocks to_qkv; weight + bias each
    assert plan.adapter_counts() == {"concat": (2 * 2 + 3) * 2}
    assert "transformer_blocks.0.attn.to_qkv.weight" in plan.bindings
    with dlo.enable(model, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model, "flux", torch.float32)))


def test_bf16_checkpoint_with_fp32_kept_modules_streams_as_saved(tmp_path):
    """Wan keeps norms and the time embedder in fp32: a bf16 checkpoint mixes dtypes, and
    torch_dtype=None streams each tensor in its checkpoint dtype, like from_pretrained(bf16)."""
    directory = save(tmp_path, "wan", "100KB")
    model_bf16 = diffusers.WanTransformer3DModel.from_pretrained(directory, torch_dtype=torch.bfloat16)
    model_bf16.save_pretrained(tmp_path / "bf16")
    expected = run(ordinary(tmp_path / "bf16", "wan", torch.bfloat16), "wan", torch.bfloat16)
    model, plan = dlo.load_transformer(tmp_path / "bf16")
    assert plan.adapter_counts() == {}
    assert {s.dtype for s in plan.bindings.values()} == {torch.bfloat16, torch.float32}
    with dlo.enable(model, "cpu", plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model, "wan", torch.bfloat16)))


def test_resident_layers_come_from_the_mapping(tmp_path):
    directory = save(tmp_path, "sd3")
    expected = run(ordinary(directory, "sd3", torch.float32), "sd3", torch.float32)
    model, plan = dlo.load_transformer(directory)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=2, num_slots=3), plan=plan) as handle:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model, "sd3", torch.float32)))
        assert handle.stats().resident_blocks == 2


def test_non_persistent_buffers_survive_loading(tmp_path):
    directory = save(tmp_path, "wan")
    reference = ordinary(directory, "wan", torch.float32)
    model, plan = dlo.load_transformer(directory)
    persistent = set(reference.state_dict())
    non_persistent = {n: b for n, b in reference.named_buffers() if n not in persistent}
    assert non_persistent  # Wan's RoPE tables
    loaded = dict(model.named_buffers())
    assert all(torch.equal(loaded[n], b) for n, b in non_persistent.items())


def test_blocks_are_not_loaded_until_the_plan_is_consumed(tmp_path):
    directory = save(tmp_path, "flux")
    model, plan = dlo.load_transformer(directory)
    assert all(p.device.type == "meta" for p in model.transformer_blocks.parameters())
    assert all(p.device.type == "cpu" for p in model.proj_out.parameters())
    assert plan.requires_backend and plan.source_prefixes == ("transformer_blocks.", "single_transformer_blocks.")
    with pytest.raises(dlo.EnableError, match="needs plan=<the HostWeightPlan it returned>"):
        dlo.enable(model, "cpu")  # without the plan: a hard error, never uninitialized weights
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):  # the bare model cannot run either
        run(model, "flux", torch.float32, seeds=(1,))


def test_a_plan_is_taken_once(tmp_path):
    directory = save(tmp_path, "flux")
    model, plan = dlo.load_transformer(directory)
    assert not plan.taken
    handle = dlo.enable(model, "cpu", plan=plan)
    assert plan.taken and plan.take() is None
    handle.disable()
    with pytest.raises(dlo.EnableError, match="already taken"):
        dlo.enable(model, "cpu", plan=plan)


def test_disable_leaves_private_copies_and_closes_the_mapping(tmp_path):
    directory = save(tmp_path, "flux", "100KB")
    expected = run(ordinary(directory, "flux", torch.float32), "flux", torch.float32, seeds=(4,))
    model, plan = dlo.load_transformer(directory)
    checkpoint = plan._weights.checkpoint  # observed only: the mapping the handle must close
    handle = dlo.enable(model, "cpu", plan=plan)
    run(model, "flux", torch.float32, seeds=(4,))
    handle.disable()
    assert all(shard._map.closed for shard in checkpoint.files)
    weight = model.transformer_blocks[0].attn.to_q.weight
    weight.add_(0)  # writable: a private copy, not the read-only mapping
    assert torch.equal(run(model, "flux", torch.float32, seeds=(4,))[0], expected[0])
    with dlo.enable(model, "cpu"):  # plain module again: the ordinary packed path works
        assert torch.equal(run(model, "flux", torch.float32, seeds=(4,))[0], expected[0])


def test_disable_without_restore_closes_the_mapping_and_the_module_refuses_calls(tmp_path):
    """disable(restore=False) releases what disable() does (the mapping closes) but gives the
    blocks nothing: the module and each streamed block (compiled too) refuse to run on their
    stand-ins, enable() refuses the module, and a later disable() is the first one's."""
    directory = save(tmp_path, "flux", "100KB")
    model, plan = dlo.load_transformer(directory)
    checkpoint = plan._weights.checkpoint  # observed only: the mapping the handle must close
    handle = dlo.enable(model, "cpu", plan=plan)
    assert torch.isfinite(run(model, "flux", torch.float32, seeds=(4,))[0]).all()
    final = handle.disable(restore=False)
    assert all(shard._map.closed for shard in checkpoint.files)
    assert handle.disable() is final
    weight = model.transformer_blocks[0].attn.to_q.weight
    assert weight.stride() == (0, 0) and torch.isnan(weight).all()  # a stand-in, no copy of the weights
    says = "FluxTransformer2DModel was disabled with restore=False: its streamed blocks hold no weights"
    with pytest.raises(dlo.StreamingError, match=says):
        run(model, "flux", torch.float32, seeds=(4,))
    block = model.single_transformer_blocks[1]
    block_inputs = (torch.zeros(1, 4, 32), torch.zeros(1, 32), (torch.ones(4, 4), torch.zeros(4, 4)))
    with pytest.raises(dlo.StreamingError, match=says), torch.inference_mode():
        block(*block_inputs)
    block.compile(fullgraph=True, backend="eager")  # a compiled block runs the refusal too, not a trace of it
    with pytest.raises(dlo.StreamingError, match=says), torch.inference_mode():
        block(*block_inputs)
    with pytest.raises(dlo.EnableError, match=says):
        dlo.enable(model, "cpu")


def test_checkpoint_mmap_off_loads_the_ordinary_way_without_fallback_log(tmp_path, caplog):
    directory = save(tmp_path, "wan")
    with caplog.at_level(logging.WARNING):
        model, plan = dlo.load_transformer(directory, dlo.OffloadConfig(checkpoint_mmap=False))
    assert plan is None and not caplog.records
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())


def test_pipeline_directory_loads_its_transformer(tmp_path):
    save(tmp_path / "pipe", "wan").rename(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    model, plan = dlo.load_transformer(tmp_path / "pipe")
    assert type(model).__name__ == "WanTransformer3DModel" and plan is not None


def test_a_refused_enable_leaves_real_weights_not_stand_ins(tmp_path):
    """enable() consumes the plan, then refuses the module (a weight tied across blocks): every
    planned tensor gets its checkpoint value, nothing is left uninitialized."""
    import safetensors.torch

    directory = save(tmp_path, "flux")
    model, plan = dlo.load_transformer(directory)
    model.transformer_blocks[1].attn.to_q.weight = model.transformer_blocks[0].attn.to_q.weight
    with pytest.raises(dlo.EnableError, match="is the same tensor as"):
        dlo.enable(model, "cpu", plan=plan)
    saved = safetensors.torch.load_file(directory / "diffusion_pytorch_model.safetensors")
    loaded = model.state_dict()
    tied = "transformer_blocks.1.attn.to_q.weight"
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items() if name != tied)
    assert all(p.stride() == torch.empty(p.shape).stride() for p in model.parameters())  # no broadcast stand-in


def test_private_tensors_of_a_mapped_block_are_streamed_and_given_back(tmp_path):
    """A non-persistent buffer inside a streamed block is not in the checkpoint: it streams from
    a private copy, and disable() hands it back."""
    directory = save(tmp_path, "wan")
    model, plan = dlo.load_transformer(directory)
    reference = ordinary(directory, "wan", torch.float32)
    for m in (model, reference):
        m.blocks[1].register_buffer("gain", torch.full((32,), 1.5), persistent=False)
        m.blocks[1].register_forward_hook(lambda module, args, out: out * module.gain)
    expected = run(reference, "wan", torch.float32, seeds=(1,))
    with dlo.enable(model, "cpu", plan=plan):
        assert torch.equal(run(model, "wan", torch.float32, seeds=(1,))[0], expected[0])
    assert torch.equal(model.blocks[1].gain, torch.full((32,), 1.5))


def test_a_release_tied_to_the_mapping_runs_once_when_it_is_gone(tmp_path):
    """Two shards: the release waits for the last view of either, and close() then a later
    collection release once (a second os.close of a hold could close a reused descriptor)."""
    for name in ("a", "b"):
        save_file({name: torch.ones(4)}, tmp_path / f"{name}.safetensors")
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    released = []
    dropped = Checkpoint(tmp_path)
    dropped.release_with_mapping(lambda: released.append("dropped"))
    a, b = dropped.view("a"), dropped.view("b")
    del dropped
    gc.collect()
    assert released == []  # both files are still viewed
    del a
    gc.collect()
    assert released == []
    del b
    gc.collect()
    assert released == ["dropped"]
    closed = Checkpoint(tmp_path)
    closed.release_with_mapping(lambda: released.append("closed"))
    view = closed.view("a")
    closed.close()
    assert released == ["dropped", "closed"]
    del closed, view
    gc.collect()
    assert released == ["dropped", "closed"]
    exported = Checkpoint(tmp_path)
    exported.release_with_mapping(lambda: released.append("exported"))
    export = memoryview(exported.files[0]._map)  # someone else's buffer export keeps the file mapped
    exported.close()
    assert released == ["dropped", "closed"]  # not while a file is still mapped
    export.release()
    del exported, export
    gc.collect()
    assert released == ["dropped", "closed", "exported"]
