"""LoRA every way diffusers offers, with every host backing and mode, against the resident
model doing the same (torch.equal): adapters loaded before and after enable(), rescaled,
hot-swapped, fused and unfused. Mapped blocks are copied on write (the files never change),
float8 blocks requantized, resident blocks edited where they are. See [Note: fusing LoRA into
streamed blocks], [Note: rewriting a host copy]."""

import hashlib
import warnings

import pytest
import torch
from lora_files import float8_weights, requantize_changed
from ordinary_tensors import ordinary_tensors

import dlo
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(autouse=True)
def _quiet_peft():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run(model, name, seed=1, dtype=torch.float32):
    with torch.inference_mode():
        return model(**TINY_MODELS[name].inputs(seed, dtype))[0]


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def ordinary(directory, name, dtype=None):
    """diffusers' loader, every tensor then in an ordinary allocation (as enable() places them)."""
    model = getattr(diffusers, TINY_MODELS[name].class_name).from_pretrained(directory, torch_dtype=dtype).eval()
    ordinary_tensors(model)
    return model


def digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


BACKINGS = {
    "pageable": dlo.OffloadConfig(),
    "checkpoint": dlo.OffloadConfig(),
    "cache": None,  # made per test: its directory is the test's
    "fp8": dlo.OffloadConfig(stream_dtype="fp8"),
    "fp8-cache": None,  # the cache's entry holds the float8 weights (one scale per weight)
    "resident-block": dlo.OffloadConfig(resident_layers=1),
    "auto-residency": dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=1.0),
}


def _setup(tmp_path, backing, name):
    directory = tmp_path / name
    TINY_MODELS[name].build().save_pretrained(directory)
    config = BACKINGS[backing]
    if backing in ("cache", "fp8-cache"):
        fp8 = dict(stream_dtype="fp8", fp8_scale="per_tensor") if backing == "fp8-cache" else {}
        config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), **fp8)
    reference = ordinary(directory, name)
    if backing in ("checkpoint", "cache", "fp8-cache"):
        model, plan = dlo.load_transformer(directory, config)
        assert plan is not None
    else:
        model, plan = ordinary(directory, name), None
    dlo.quantize_resident(reference, config)
    return reference, model, plan, config, directory


def both(models, change):
    for model in models:
        change(model)


def fuse_both(reference, handle, config, **kwargs):
    before = float8_weights(reference, config) if config.stream_dtype else {}
    reference.fuse_lora(**kwargs)
    requantize_changed(reference, before, config)
    handle.fuse_lora(**kwargs)


def unfuse_both(reference, handle, config):
    before = float8_weights(reference, config) if config.stream_dtype else {}
    reference.unfuse_lora()
    requantize_changed(reference, before, config)
    handle.unfuse_lora()


@pytest.mark.parametrize("backing", list(BACKINGS))
def test_lora_every_way_matches_resident(tmp_path, tiny_loras, backing):
    name = "flux"
    loras = tiny_loras(name)
    reference, model, plan, config, directory = _setup(tmp_path, backing, name)
    files_before = digests(tmp_path)
    if plan is None:  # a plan names the tensors as loaded: LoRAs come after enable() there
        both((reference, model), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        if plan is not None:
            both((reference, model), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
        assert torch.equal(run(reference, name), run(model, name))
        assert torch.equal(run(reference, name, 2), run(model, name, 2))  # auto residency: planned now
        both((reference, model), lambda m: m.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer"))
        both((reference, model), lambda m: m.set_adapters(["a", "b"], [0.7, 1.2]))
        assert torch.equal(run(reference, name, 3), run(model, name, 3))
        fuse_both(reference, handle, config, lora_scale=0.6, adapter_names=["a"])
        assert torch.equal(run(reference, name, 4), run(model, name, 4))
        stats = handle.stats()
        unfuse_both(reference, handle, config)
        assert torch.equal(run(reference, name, 5), run(model, name, 5))
        both((reference, model), lambda m: m.load_lora_adapter(loras["c"], adapter_name="a", prefix="transformer", hotswap=True))
        assert torch.equal(run(reference, name, 6), run(model, name, 6))
        both((reference, model), lambda m: m.delete_adapters("b"))
        fuse_both(reference, handle, config)
        assert torch.equal(run(reference, name, 7), run(model, name, 7))
        after = handle.stats()
    assert same_state(reference, model)
    assert digests(tmp_path) == files_before  # no checkpoint or cache file was written
    promoted = stats.resident_blocks if backing == "auto-residency" else 0
    assert stats.rewritten_blocks == stats.streamed_blocks + promoted  # "a" is in every block dlo streams or promoted
    assert after.host_bytes_by_dtype == stats.host_bytes_by_dtype  # the same bytes per dtype, requantized in place
    if backing in ("checkpoint", "cache", "fp8-cache"):
        assert stats.copied_on_write_bytes == stats.host_bytes > 0  # the fused blocks only; the rest stays mapped
        assert after.copied_on_write_bytes == stats.copied_on_write_bytes  # copied once, rewritten in place since
    else:
        assert stats.copied_on_write_bytes == 0
    assert backing != "auto-residency" or promoted > 0


@pytest.mark.parametrize("backing", ["pageable", "checkpoint"])
def test_diffusers_own_fuse_lora_on_blocks_kept_resident_is_kept_after_disable(tmp_path, tiny_loras, backing):
    """Every block promoted (resident_layers='auto' with room for all): the weights are real
    between calls, diffusers' own fuse_lora() changes them on the device, and disable() writes
    them back (copy on write for the mapping)."""
    name = "wan"
    reference, model, plan, _, _ = _setup(tmp_path, backing, name)
    config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=1.0)
    handle = dlo.enable(model, "cpu", config, plan=plan)
    both((reference, model), lambda m: m.load_lora_adapter(tiny_loras(name)["a"], adapter_name="a", prefix="transformer"))
    run(model, name)
    run(model, name, 2)
    assert handle.stats().streamed_blocks == 0
    both((reference, model), lambda m: m.fuse_lora(lora_scale=0.5))
    assert torch.equal(run(reference, name, 3), run(model, name, 3))
    final = handle.disable()
    assert final.rewritten_blocks == 4 and (final.copied_on_write_bytes > 0) == (backing == "checkpoint")
    assert same_state(reference, model)


def test_lora_with_fp8_gemms_runs_unfused_and_a_fuse_is_refused_before_any_change(tiny_loras):
    """fp8_compute: a LoRA loaded after enable() is bf16 beside its float8 GEMM base layer (as
    on the resident model), and fusing into float8 weights is refused by name."""
    name = "flux"
    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True)
    reference = TINY_MODELS[name].build(dtype=torch.bfloat16)
    model = TINY_MODELS[name].build(dtype=torch.bfloat16)
    dlo.quantize_resident(reference, config)
    with dlo.enable(model, "cpu", config) as handle:
        run(model, name, dtype=torch.bfloat16)
        both((reference, model), lambda m: m.load_lora_adapter(tiny_loras(name)["a"], adapter_name="a", prefix="transformer"))
        assert model.transformer_blocks[0].attn.to_q.lora_A["a"].weight.dtype == torch.bfloat16
        expected = run(reference, name, 2, torch.bfloat16)
        assert torch.equal(run(model, name, 2, torch.bfloat16), expected)
        with pytest.raises(dlo.StreamingError, match="'transformer_blocks.0.attn.to_q' runs as an FP8 GEMM .*nothing was fused"):
            handle.fuse_lora()
        assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged_adapters"))
        assert torch.equal(run(model, name, 2, torch.bfloat16), expected)


def _lora_pair_compiled(tiny_loras, name):
    """(resident reference, model with its blocks compiled by dynamo's eager backend), adapter
    "a" loaded in both. The caller resets dynamo when done."""
    reference = TINY_MODELS[name].build()
    model = TINY_MODELS[name].build()
    both((reference, model), lambda m: m.load_lora_adapter(tiny_loras(name)["a"], adapter_name="a", prefix="transformer"))
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    return reference, model


def test_a_lora_scale_change_recompiles_once_per_block_class_not_per_block(tiny_loras, caplog):
    """compile_repeated_blocks: dynamo guards on a LoRA layer's scale, so the first new scale
    compiles each block class once more (Flux: 2 classes, 5 blocks), the next ones none (the
    scale is dynamic from then on), as resident; streaming adds none, and dlo's warning about a
    graph per block stays quiet. (The eager backend keeps the test fast: the guards are
    dynamo's, whatever the backend; tests/gpu compiles with inductor.)"""
    name = "flux"
    reference, model = _lora_pair_compiled(tiny_loras, name)
    try:
        with dlo.enable(model, "cpu") as handle, caplog.at_level("WARNING", logger="dlo"):
            counts = []
            for seed, scale in [(1, None), (2, 0.5), (3, 0.25), (4, 1.5)]:
                if scale is not None:
                    both((reference, model), lambda m: m.set_adapters("a", scale))
                assert torch.equal(run(reference, name, seed), run(model, name, seed))
                counts.append(handle.stats().compile)
    finally:
        torch._dynamo.reset()
    first, rescaled, *later = counts
    assert rescaled.graphs - first.graphs == 2 and rescaled.recompiles - first.recompiles == 2  # one per class
    assert all(c == rescaled for c in later)
    assert not [r for r in caplog.records if "recompiled" in r.getMessage()]


def test_diffusers_own_fuse_and_layer_unmerges_on_compiled_blocks_recompile_per_class_not_per_block(tiny_loras, caplog):
    """compile_repeated_blocks, then diffusers' fuse_lora() and a pipeline's unfuse (each
    layer's own unmerge(), which dlo replaces on merged streamed layers): outputs equal the
    resident model's, and the replacement (an instance attribute) adds no graph per block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    name = "flux"
    reference, model = _lora_pair_compiled(tiny_loras, name)
    try:
        with dlo.enable(model, "cpu") as handle, caplog.at_level("WARNING", logger="dlo"):
            assert torch.equal(run(reference, name, 1), run(model, name, 1))
            first = handle.stats().compile
            both((reference, model), lambda m: m.fuse_lora(lora_scale=0.5))
            assert torch.equal(run(reference, name, 2), run(model, name, 2))
            fused = handle.stats().compile
            for m in (reference, model):
                for layer in [x for x in m.modules() if isinstance(x, BaseTunerLayer)]:
                    layer.unmerge()
            assert torch.equal(run(reference, name, 3), run(model, name, 3))
            unfused = handle.stats().compile
    finally:
        torch._dynamo.reset()
    # dynamo guards on a layer's merged state: each change compiles Flux's 2 block classes once more
    assert fused.graphs - first.graphs == 2 and unfused.graphs - fused.graphs == 2
    assert not [r for r in caplog.records if "recompiled" in r.getMessage()]


def test_a_lora_loaded_before_enable_on_a_mapped_model_is_refused_naming_the_order(tmp_path, tiny_loras):
    reference, model, plan, config, _ = _setup(tmp_path, "cache", "wan")
    model.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer")
    with pytest.raises(dlo.EnableError, match=r"load LoRAs after dlo.enable\(model, device, config, plan=plan\)"):
        dlo.enable(model, "cpu", config, plan=plan)


def test_dora_adapters_loaded_or_initialized_after_enable_fuse_and_unfuse_as_resident(tiny_pair, tiny_loras):
    """A DoRA layer's magnitudes are adapter tensors (resident) and its merge reads the base
    weight (in the opened block). PEFT initializing one reads the base weight too: a new DoRA
    adapter is added inside handle.editing(), where the base weights hold their values."""
    from peft import LoraConfig

    reference, model, _ = tiny_pair("wan")
    with dlo.enable(model, "cpu") as handle:
        run(model, "wan")
        both((reference, model), lambda m: m.load_lora_adapter(tiny_loras("wan")["dora"], adapter_name="d", prefix="transformer"))
        assert torch.equal(run(reference, "wan", 2), run(model, "wan", 2))
        reference.fuse_lora()
        handle.fuse_lora()
        assert torch.equal(run(reference, "wan", 3), run(model, "wan", 3))
        reference.unfuse_lora()
        handle.unfuse_lora()
        assert torch.equal(run(reference, "wan", 4), run(model, "wan", 4))
        config = LoraConfig(r=4, target_modules=["to_k"], use_dora=True, init_lora_weights="gaussian")
        torch.manual_seed(7)
        reference.add_adapter(config, adapter_name="fresh")
        torch.manual_seed(7)
        with handle.editing():
            model.add_adapter(config, adapter_name="fresh")
        both((reference, model), lambda m: m.set_adapters(["d", "fresh"], [1.0, 1.0]))
        assert torch.equal(run(reference, "wan", 5), run(model, "wan", 5))
    assert same_state(reference, model)
