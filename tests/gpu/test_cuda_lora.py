"""LoRA and weight changes on CUDA: adapters loaded after enable() land on the device, fusing
runs PEFT's merge on the device and rewrites the host copies (pinned in place, a registered
mapping copied on write, float8 requantized), with the copy stream running; every call
torch.equal to the resident model on the same GPU doing the same. See [Note: fusing LoRA into
streamed blocks], [Note: editing a streamed block]."""

import hashlib
import warnings

import pytest
import torch
from lora_files import float8_weights, requantize_changed, save_loras
from wide_models import WAN_MB

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = {"wan": WAN_MB, "flux": TINY_MODELS["flux"]}
KINDS = {"wan": "wan", "flux": "flux"}  # whose LoRA targets (lora_files.ADAPTERS) each model has


@pytest.fixture(autouse=True)
def _quiet_peft():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run(model, entry, seed):
    with torch.inference_mode():
        return model(**entry.inputs(seed, torch.bfloat16, "cuda"))[0]


def both(models, change):
    for model in models:
        change(model)


def _fused_both(reference, handle, config, call, **kwargs):
    _changed_both(reference, config, lambda m: getattr(m, call)(**kwargs), lambda: getattr(handle, call)(**kwargs))


def _changed_both(reference, config, change, streamed_change):
    """`change` made to the reference (requantized as dlo requantizes, with float8), then `streamed_change`."""
    before = float8_weights(reference, config) if config.stream_dtype else {}
    change(reference)
    requantize_changed(reference, before, config)
    streamed_change()


def _unmerge_each_layer(model):
    """What diffusers' pipe.unfuse_lora() does: each PEFT layer's own unmerge()."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in [m for m in model.modules() if isinstance(m, BaseTunerLayer)]:
        layer.unmerge()


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize(
    "backing", ["pinned", "checkpoint", "fp8", "auto-residency", "pinned-3-slots"],
)
def test_lora_fused_and_unfused_while_streaming_matches_resident_on_cuda(tmp_path, name, backing):
    entry = MODELS[name]
    built = entry.build(seed=0, dtype=torch.bfloat16)
    loras = save_loras(entry.build(seed=0), KINDS[name], tmp_path / "loras")
    config = {
        "pinned": dlo.OffloadConfig(),
        "checkpoint": dlo.OffloadConfig(),
        "fp8": dlo.OffloadConfig(stream_dtype="fp8"),
        "auto-residency": dlo.OffloadConfig(resident_layers="auto"),
        "pinned-3-slots": dlo.OffloadConfig(num_slots=3),
    }[backing]
    plan = None
    reference = entry.build(seed=0, dtype=torch.bfloat16).cuda()
    if backing == "checkpoint":
        built.save_pretrained(tmp_path / "model")
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "model").iterdir()}
        model, plan = dlo.load_transformer(tmp_path / "model", torch_dtype=torch.bfloat16)
        assert plan is not None
        # The checkpoint as diffusers loads it (the class's fp32-kept modules and non-persistent
        # buffers in fp32), not the model it was saved from (cast whole with .to()).
        reference = type(built).from_pretrained(tmp_path / "model", torch_dtype=torch.bfloat16).cuda()
    else:
        model = entry.build(seed=0, dtype=torch.bfloat16)
    dlo.quantize_resident(reference, config)
    with dlo.enable(model, "cuda", config, plan=plan) as handle:
        assert torch.equal(run(reference, entry, 1), run(model, entry, 1))
        run(model, entry, 2)  # auto residency: the plan is applied after this call
        both((reference, model), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
        both((reference, model), lambda m: m.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer"))
        assert all(p.is_cuda for n, p in model.named_parameters() if "lora_" in n)
        both((reference, model), lambda m: m.set_adapters(["a", "b"], [0.8, 0.6]))
        assert torch.equal(run(reference, entry, 3), run(model, entry, 3))
        _fused_both(reference, handle, config, "fuse_lora", lora_scale=0.7)
        assert torch.equal(run(reference, entry, 4), run(model, entry, 4))
        assert torch.equal(run(reference, entry, 5), run(model, entry, 5))
        _fused_both(reference, handle, config, "unfuse_lora")
        assert torch.equal(run(reference, entry, 6), run(model, entry, 6))
        # diffusers' own: the model's fuse_lora (dlo's while enabled), a pipeline's unfuse (each
        # merged streamed layer's unmerge() opens its block), a LoRA loaded while one is fused
        # (PEFT unmerges the fused one first)
        for change in (
            lambda m: m.fuse_lora(lora_scale=0.5),
            _unmerge_each_layer,
            lambda m: m.fuse_lora(adapter_names=["a"]),
            lambda m: m.load_lora_adapter(loras["b"], adapter_name="b2", prefix="transformer"),
        ):
            _changed_both(reference, config, change, lambda: change(model))
            assert torch.equal(run(reference, entry, 7), run(model, entry, 7))
        stats = handle.stats()
    assert stats.rewritten_blocks > 0
    if backing == "checkpoint":
        assert stats.copied_on_write_bytes > 0
        assert files == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "model").iterdir()}
    # disable() gives the streamed blocks CPU tensors; the rest (the adapters too) stays on the device.
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k].cpu(), expected[k].cpu()) for k in state)
    assert all(state[k].dtype == expected[k].dtype for k in state)  # torch.equal would promote


def test_load_state_dict_while_streaming_from_pinned_memory_matches_resident_on_cuda():
    entry = WAN_MB
    model = entry.build(seed=0, dtype=torch.bfloat16)
    reference = entry.build(seed=0, dtype=torch.bfloat16).cuda()
    other = entry.build(seed=3, dtype=torch.bfloat16).state_dict()
    with dlo.enable(model, "cuda") as handle:
        run(model, entry, 1)  # the ring has prefetched the next call's first blocks
        both((reference, model), lambda m: m.load_state_dict(other))
        assert torch.equal(run(reference, entry, 2), run(model, entry, 2))
        assert handle.stats().rewritten_blocks == handle.stats().streamed_blocks


def test_a_lora_scale_change_recompiles_once_per_block_class_with_inductor(tmp_path):
    entry = TINY_MODELS["flux"]
    loras = save_loras(entry.build(seed=0), "flux", tmp_path)
    reference = entry.build(seed=0, dtype=torch.bfloat16).cuda()
    model = entry.build(seed=0, dtype=torch.bfloat16)
    both((reference, model), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
    torch._dynamo.reset()
    both((reference, model), lambda m: m.compile_repeated_blocks(fullgraph=True))
    try:
        with dlo.enable(model, "cuda") as handle:
            assert torch.equal(run(reference, entry, 1), run(model, entry, 1))
            first = handle.stats().compile
            both((reference, model), lambda m: m.set_adapters("a", 0.5))
            assert torch.equal(run(reference, entry, 2), run(model, entry, 2))
            both((reference, model), lambda m: m.set_adapters("a", 0.25))
            assert torch.equal(run(reference, entry, 3), run(model, entry, 3))
            last = handle.stats().compile
    finally:
        torch._dynamo.reset()
    # Both models share dynamo's cache: each class's new-scale graph is compiled once for both.
    assert last.recompiles - first.recompiles <= 2
