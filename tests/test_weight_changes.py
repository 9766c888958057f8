"""Weights that change after enable() are never lost: each change reaches the weights dlo
streams (the next call and the state after disable() equal the same change made resident),
or is refused with a StreamingError before any streamed weight changed. One test per row of
what users do: LoRA adapters, fuse/unfuse, in-place edits, load_state_dict, dtype casts.
See [Note: stand-ins], [Note: editing a streamed block] in dlo.backend.weight_changes."""

import warnings
from contextlib import nullcontext

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS

MODELS = ["wan", "flux", "qwenimage"]


@pytest.fixture(autouse=True)
def _quiet_peft():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's "already merged" and diffusers' notices
        yield


def run(model, name, seed=1):
    with torch.inference_mode():
        return model(**TINY_MODELS[name].inputs(seed))[0]


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def both(models, change):
    for model in models:
        change(model)


@pytest.mark.parametrize("name", MODELS)
def test_adapters_loaded_switched_and_deleted_after_enable_match_resident_and_never_stream(tiny_pair, tiny_loras, name):
    loras = tiny_loras(name)
    reference, streamed, _ = tiny_pair(name)
    with dlo.enable(TINY_MODELS[name].build(), "cpu") as plain:
        base_host_bytes = plain.stats().host_bytes
    both((reference, streamed), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        assert handle.stats().host_bytes == base_host_bytes  # the adapter loaded before enable() stays resident
        assert torch.equal(run(reference, name), run(streamed, name))
        both((reference, streamed), lambda m: m.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer"))
        both((reference, streamed), lambda m: m.set_adapters(["a", "b"], [0.6, 1.3]))
        assert torch.equal(run(reference, name, 2), run(streamed, name, 2))
        both((reference, streamed), lambda m: m.disable_lora())
        assert torch.equal(run(reference, name, 3), run(streamed, name, 3))
        both((reference, streamed), lambda m: m.enable_lora())
        both((reference, streamed), lambda m: m.delete_adapters("a"))
        assert torch.equal(run(reference, name, 4), run(streamed, name, 4))
        assert handle.stats().host_bytes == base_host_bytes and handle.stats().rewritten_blocks == 0
    assert same_state(reference, streamed)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_pipeline_load_lora_weights_after_enable_pipeline_matches_resident(tiny_flux_dir, tiny_wan_dir, tmp_path, name):
    """The way most users load a LoRA. Flux's loader compares the LoRA's shapes with the
    base weights' (the stand-ins have them)."""
    import diffusers
    from lora_files import pipeline_inputs, save_loras

    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name]
    reference, streamed = (diffusers.DiffusionPipeline.from_pretrained(directory) for _ in range(2))
    loras = save_loras(reference.transformer, name, tmp_path)
    with dlo.enable_pipeline(streamed, "cpu") as handle:
        both((reference, streamed), lambda p: p.load_lora_weights(loras["a"], adapter_name="a"))
        both((reference, streamed), lambda p: p.load_lora_weights(loras["b"], adapter_name="b"))
        both((reference, streamed), lambda p: p.set_adapters(["a", "b"], [0.8, 0.5]))
        with torch.inference_mode():
            expected = reference.transformer(**pipeline_inputs(name, 1))[0]
            assert torch.equal(streamed.transformer(**pipeline_inputs(name, 1))[0], expected)
        both((reference, streamed), lambda p: p.fuse_lora(lora_scale=0.9))  # diffusers' own: the handle's
        assert streamed.fused_loras == reference.fused_loras == {"a", "b"}
        with torch.inference_mode():
            expected = reference.transformer(**pipeline_inputs(name, 2))[0]
            assert torch.equal(streamed.transformer(**pipeline_inputs(name, 2))[0], expected)
        fused = handle.handles["transformer"].stats().rewritten_blocks
        both((reference, streamed), lambda p: p.unfuse_lora())  # layer by layer: each opens its block
        assert streamed.fused_loras == reference.fused_loras == set()
        assert handle.handles["transformer"].stats().rewritten_blocks > fused
        with torch.inference_mode():
            expected = reference.transformer(**pipeline_inputs(name, 4))[0]
            assert torch.equal(streamed.transformer(**pipeline_inputs(name, 4))[0], expected)
        handle.fuse_lora(lora_scale=0.9)
        reference.fuse_lora(lora_scale=0.9)
        assert streamed.fused_loras == reference.fused_loras == {"a", "b"}
        both((reference, streamed), lambda p: p.unload_lora_weights())  # the fused weights stay
        with torch.inference_mode():
            expected = reference.transformer(**pipeline_inputs(name, 3))[0]
            assert torch.equal(streamed.transformer(**pipeline_inputs(name, 3))[0], expected)
    assert same_state(reference.transformer, streamed.transformer)


@pytest.mark.parametrize("name", MODELS)
def test_fuse_lora_reaches_the_streamed_weights_and_unfuse_gives_back_what_resident_does(tiny_pair, tiny_loras, name):
    loras = tiny_loras(name)
    reference, streamed, _ = tiny_pair(name)
    with dlo.enable(streamed, "cpu") as handle:
        run(streamed, name)
        for model in (reference, streamed):
            model.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer")
            model.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer")
            model.set_adapters(["a", "b"], [1.0, 0.7])
        reference.fuse_lora(lora_scale=0.8, adapter_names=["a"])
        handle.fuse_lora(lora_scale=0.8, adapter_names=["a"])
        assert torch.equal(run(reference, name, 2), run(streamed, name, 2))
        fused = handle.stats().rewritten_blocks
        assert fused == handle.stats().streamed_blocks  # "a" is in every block
        reference.unfuse_lora()
        handle.unfuse_lora()
        assert torch.equal(run(reference, name, 3), run(streamed, name, 3))
        assert handle.stats().rewritten_blocks == 2 * fused
        reference.fuse_lora()
        handle.fuse_lora()
    assert same_state(reference, streamed)  # fused, after disable()


def test_the_pipelines_own_fuse_lora_reaches_a_streamed_text_encoder(tiny_flux_dir, tmp_path):
    """diffusers merges a text encoder's PEFT layers in place (a transformers model has no
    fuse_lora of its own): while enabled, pipe.fuse_lora() / unfuse_lora() are the pipeline
    handle's, with diffusers' arguments, so a streamed text encoder's layers merge through its
    blocks; after disable() they are diffusers' again."""
    import diffusers
    from lora_files import pipeline_inputs, save_loras
    from peft import LoraConfig, inject_adapter_in_model

    reference, streamed = (diffusers.DiffusionPipeline.from_pretrained(tiny_flux_dir) for _ in range(2))
    lora = save_loras(reference.transformer, "flux", tmp_path)["a"]
    ids = torch.arange(8)[None]

    def outputs(pipe, seed):
        with torch.inference_mode():
            return pipe.text_encoder(ids)[0], pipe.transformer(**pipeline_inputs("flux", seed))[0]

    def equal(seed):
        return all(torch.equal(a, b) for a, b in zip(outputs(reference, seed), outputs(streamed, seed)))

    with dlo.enable_pipeline(streamed, "cpu", components=["text_encoder"]) as handle:
        assert set(handle.handles) == {"transformer", "text_encoder"}
        for pipe in (reference, streamed):
            pipe.load_lora_weights(lora, adapter_name="a")
            torch.manual_seed(0)
            config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            inject_adapter_in_model(config, pipe.text_encoder, adapter_name="te")
        assert equal(1)
        both((reference, streamed), lambda p: p.fuse_lora(components=["transformer", "text_encoder"], lora_scale=0.5))
        assert equal(2) and streamed.fused_loras == reference.fused_loras == {"a", "te"}
        both((reference, streamed), lambda p: p.unfuse_lora(components=["transformer", "text_encoder"]))
        assert equal(3) and streamed.fused_loras == reference.fused_loras == set()
        both((reference, streamed), lambda p: p.fuse_lora(["text_encoder"]))
    assert "fuse_lora" not in vars(streamed) and "unfuse_lora" not in vars(streamed)
    assert same_state(reference.text_encoder, streamed.text_encoder) and same_state(reference.transformer, streamed.transformer)


@pytest.mark.parametrize("when", ["before", "after", "in real_state_dict"])
@pytest.mark.parametrize("then", ["unfuse the transformer", "unfuse", "unload"])
def test_a_flux_control_lora_puts_its_norm_layers_back_as_resident(tiny_flux_dir, tmp_path, then, when):
    """A Flux control LoRA carries norm layers, which diffusers loads into the transformer in
    place of its own and puts back on unfuse or unload (from a copy of state_dict() made at
    the load). Loaded before enable_pipeline, or after it (diffusers' norm loading then reads the
    streamed blocks' values, not their NaN stand-ins), or with the transformer alone enabled,
    loaded in `handle.real_state_dict()`: every way back equals resident; the pipeline's unfuse
    runs diffusers' own after dlo's."""
    import diffusers
    from lora_files import pipeline_inputs, save_lora
    from safetensors.torch import load_file, save_file

    reference, streamed = (diffusers.DiffusionPipeline.from_pretrained(tiny_flux_dir) for _ in range(2))
    state = load_file(save_lora(reference.transformer, "flux", "a", tmp_path, 1))
    generator = torch.Generator().manual_seed(5)
    for key, value in reference.transformer.state_dict().items():
        if ".norm_q." in key or ".norm_k." in key:
            state[f"transformer.{key}"] = 1 + 0.5 * torch.randn(value.shape, generator=generator)
    save_file(state, tmp_path / "control.safetensors")

    def load(pipe):
        pipe.load_lora_weights(tmp_path / "control.safetensors", adapter_name="control")

    if when == "before":
        both((reference, streamed), load)
    change = {
        "unfuse the transformer": lambda p: p.unfuse_lora(components=["transformer"]),
        "unfuse": lambda p: p.unfuse_lora(),
        "unload": lambda p: p.unload_lora_weights(),
    }[then]
    enabled = dlo.enable(streamed.transformer, "cpu") if when == "in real_state_dict" else dlo.enable_pipeline(streamed, "cpu")
    with enabled:
        if when == "after":
            both((reference, streamed), load)
        elif when == "in real_state_dict":
            load(reference)
            with enabled.real_state_dict():
                load(streamed)
        both((reference, streamed), change)
        with torch.inference_mode():
            expected = reference.transformer(**pipeline_inputs("flux", 1))[0]
            assert torch.equal(streamed.transformer(**pipeline_inputs("flux", 1))[0], expected)
    assert "_load_norm_into_transformer" not in vars(streamed)
    assert same_state(reference.transformer, streamed.transformer)


@pytest.mark.parametrize("safe_fusing", [False, True])
def test_diffusers_own_fuse_and_unfuse_lora_reach_the_streamed_weights_as_resident(tiny_pair, tiny_loras, safe_fusing):
    """The model's own fuse_lora() / unfuse_lora() while enabled are the handle's (a write into
    a stand-in used to fail in torch, or in PEFT's safe merge as NaN "adapter seems to be
    broken"); after disable() they are diffusers' again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    loras = tiny_loras("flux")
    reference, streamed, _ = tiny_pair("flux")
    for name in "ab":
        both((reference, streamed), lambda m: m.load_lora_adapter(loras[name], adapter_name=name, prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        both((reference, streamed), lambda m: m.fuse_lora(lora_scale=0.7, safe_fusing=safe_fusing, adapter_names=["a"]))
        assert torch.equal(run(reference, "flux", 2), run(streamed, "flux", 2))
        fused = handle.stats().rewritten_blocks
        assert fused == handle.stats().streamed_blocks  # "a" is in every block
        both((reference, streamed), lambda m: m.unfuse_lora())
        assert torch.equal(run(reference, "flux", 3), run(streamed, "flux", 3))
        assert handle.stats().rewritten_blocks == 2 * fused
        both((reference, streamed), lambda m: m.fuse_lora())
    assert "fuse_lora" not in vars(streamed) and "unfuse_lora" not in vars(streamed)
    layers = [m for m in streamed.modules() if isinstance(m, BaseTunerLayer)]
    assert any(layer.merged for layer in layers) and not any("unmerge" in vars(layer) for layer in layers)
    assert same_state(reference, streamed)  # fused, after disable()
    both((reference, streamed), lambda m: m.unfuse_lora())  # diffusers' own, on real weights
    assert same_state(reference, streamed)


def test_loading_another_lora_while_one_is_fused_unmerges_it_first_as_resident(tiny_pair, tiny_loras):
    """PEFT unmerges every merged layer before it activates a newly loaded adapter: each
    layer's unmerge() opens its block (it used to fail in torch, half way through the load)."""
    loras = tiny_loras("flux")
    reference, streamed, _ = tiny_pair("flux")
    both((reference, streamed), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        both((reference, streamed), lambda m: m.fuse_lora(lora_scale=0.5))
        fused = handle.stats().rewritten_blocks
        both((reference, streamed), lambda m: m.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer"))
        assert handle.stats().rewritten_blocks > fused
        assert torch.equal(run(reference, "flux", 2), run(streamed, "flux", 2))
        both((reference, streamed), lambda m: m.set_adapters(["a", "b"], [0.4, 1.1]))
        assert torch.equal(run(reference, "flux", 3), run(streamed, "flux", 3))
    assert same_state(reference, streamed)


def _unmerge_each_layer(model):
    """What diffusers' pipe.unfuse_lora() does: each PEFT layer's own unmerge()."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in [m for m in model.modules() if isinstance(m, BaseTunerLayer)]:
        layer.unmerge()


def _merged_lists(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: list(m.merged_adapters) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


@pytest.mark.parametrize("then", ["unmerge each layer", "disable_lora", "load another"])
def test_a_call_inside_handle_editing_keeps_its_blocks_fused_layers_known(tiny_pair, tiny_loras, then):
    """A block open for an edit is resident only until the edit ends: a call made inside it
    must not take the block's merged layers for a resident block's (whose PEFT unmerges are
    real), or after the edit they would stream merged with no unmerge through dlo."""
    loras = tiny_loras("wan")
    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer"))
    change = {
        "unmerge each layer": _unmerge_each_layer,
        "disable_lora": lambda m: m.disable_lora(),
        "load another": lambda m: m.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer"),
    }[then]
    with dlo.enable(streamed, "cpu") as handle:
        both((reference, streamed), lambda m: m.fuse_lora(lora_scale=0.5))
        with handle.editing(streamed.blocks[1]):
            assert torch.equal(run(reference, "wan", 1), run(streamed, "wan", 1))
        both((reference, streamed), change)
        for seed in (2, 3):
            assert torch.equal(run(reference, "wan", seed), run(streamed, "wan", seed))
        assert _merged_lists(streamed) == _merged_lists(reference)
    assert same_state(reference, streamed)


@pytest.mark.parametrize("opened", ["every block", "one block"])
def test_fuse_unfuse_and_layer_unmerges_inside_handle_editing_reach_every_block(tiny_pair, tiny_loras, opened):
    """Inside `handle.editing(...)` the model's fuse_lora / unfuse_lora and a layer's own
    unmerge() run on the blocks the edit opened, and open any other block on its own (one at a
    time), as they run resident."""
    reference, streamed, _ = tiny_pair("flux")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("flux")["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        run(streamed, "flux")
        blocks = () if opened == "every block" else (streamed.transformer_blocks[0],)
        reference.fuse_lora(lora_scale=0.5)
        with handle.editing(*blocks):
            streamed.fuse_lora(lora_scale=0.5)
        assert torch.equal(run(reference, "flux", 2), run(streamed, "flux", 2))
        for model in (reference, streamed):
            with handle.editing(*blocks) if model is streamed else nullcontext():
                model.transformer_blocks[0].attn.to_q.unmerge()
                model.single_transformer_blocks[1].attn.to_k.unmerge()
        assert torch.equal(run(reference, "flux", 3), run(streamed, "flux", 3))
        assert _merged_lists(streamed) == _merged_lists(reference)
        reference.unfuse_lora()
        with handle.editing(*blocks):
            streamed.unfuse_lora()
        assert torch.equal(run(reference, "flux", 4), run(streamed, "flux", 4))
    assert same_state(reference, streamed)


@pytest.mark.parametrize("then", ["disable_lora", "unmerge each layer"])
def test_peft_merges_made_inside_handle_editing_are_unmerged_through_the_blocks_later(tiny_pair, tiny_loras, then):
    """PEFT's own merge of each layer inside `with handle.editing():` (the edit writes it back):
    the merged layers are recorded when the edit ends, so a forward with adapters disabled or a
    layer's own unmerge() later goes through the block as for a fuse."""
    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        run(streamed, "wan")
        for model in (reference, streamed):
            with handle.editing() if model is streamed else nullcontext():
                for layer in [m for m in model.blocks.modules() if hasattr(m, "merged_adapters")]:
                    layer.merge()
        assert torch.equal(run(reference, "wan", 2), run(streamed, "wan", 2))
        both((reference, streamed), (lambda m: m.disable_lora()) if then == "disable_lora" else _unmerge_each_layer)
        for seed in (3, 4):
            assert torch.equal(run(reference, "wan", seed), run(streamed, "wan", seed))
    assert same_state(reference, streamed)


def test_a_call_inside_handle_editing_plans_no_residency(tiny_pair):
    """resident_layers='auto': the blocks an edit holds open look resident to a call made in
    it; no plan is made or measured from such a call (one made there dropped every slot for
    blocks the edit then streamed again: every later call refused)."""
    reference, streamed, _ = tiny_pair("wan")
    config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=1.0)
    with dlo.enable(streamed, "cpu", config) as handle:
        run(streamed, "wan")
        for seed in (2, 3):
            with handle.editing(*streamed.blocks):
                assert torch.equal(run(reference, "wan", seed), run(streamed, "wan", seed))
        assert handle.stats().residency.state == "measuring"
        for seed in (4, 5, 6):
            assert torch.equal(run(reference, "wan", seed), run(streamed, "wan", seed))
        assert handle.stats().residency.resident  # planned from calls outside the edit


@pytest.mark.parametrize("how", ["disable_lora", "unmerge each layer"])
def test_an_unmerge_in_a_kept_resident_float8_block_is_requantized_at_once(tiny_pair, tiny_loras, how):
    """stream_dtype='fp8', every block kept resident: an unmerge of a fused layer (PEFT's in
    the forward after disable_lora(), or diffusers' layer by layer) rewrites the block's host
    copy and requantizes its device memory at once, so nothing changes at a later edit or at
    disable() (unmerged on the device only, it was requantized then: the outputs moved)."""
    _, streamed, _ = tiny_pair("wan")
    config = dlo.OffloadConfig(stream_dtype="fp8", resident_layers="auto", hbm_budget_gib=1.0)
    handle = dlo.enable(streamed, "cpu", config)
    for seed in range(3):
        run(streamed, "wan", seed)
    assert handle.stats().resident_blocks == 4
    streamed.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer")
    streamed.fuse_lora()
    if how == "disable_lora":
        streamed.disable_lora()
    else:
        _unmerge_each_layer(streamed)
    first = run(streamed, "wan", 9)
    with handle.editing(streamed.blocks[0]):
        pass
    assert torch.equal(run(streamed, "wan", 9), first)
    handle.disable()
    assert torch.equal(run(streamed, "wan", 9), first)


def test_peft_merges_inside_handle_editing_then_a_call_in_it_are_kept(tiny_pair, tiny_loras):
    """A second adapter merged with PEFT's own merge() into fused layers inside an edit, then a
    call inside the same edit: the open blocks' layers are recorded as they are (their device
    memory is real), never taken for a list that lost adapters."""
    loras = tiny_loras("wan")
    reference, streamed, _ = tiny_pair("wan")
    with dlo.enable(streamed, "cpu") as handle:
        for model in (reference, streamed):
            model.load_lora_adapter(loras["a"], adapter_name="a", prefix="transformer")
            model.load_lora_adapter(loras["b"], adapter_name="b", prefix="transformer")
            model.set_adapters(["a", "b"])
            model.fuse_lora(adapter_names=["a"])
        for model in (reference, streamed):
            with handle.editing() if model is streamed else nullcontext():
                for layer in [m for m in model.modules() if hasattr(m, "merged_adapters")]:
                    layer.merge(adapter_names=["b"])
                assert torch.equal(run(model, "wan", 1), run(reference, "wan", 1))
        assert _merged_lists(streamed) == _merged_lists(reference)
        both((reference, streamed), lambda m: m.unfuse_lora())
        assert torch.equal(run(reference, "wan", 2), run(streamed, "wan", 2))
    assert same_state(reference, streamed)


def test_a_fuse_right_after_an_interrupted_call_reaches_the_blocks_it_left_running(tiny_pair, tiny_loras):
    """A Ctrl-C as a block ends (before the runtime records its end) leaves it marked running;
    a fuse before the next call takes it as over, as the next call would, not as a change
    from inside its own forward."""
    from dlo.hotpath.runtime import StreamingRuntime

    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        ends = StreamingRuntime.after_block

        def interrupted(runtime, index):
            if index == 2:
                raise KeyboardInterrupt
            ends(runtime, index)

        StreamingRuntime.after_block = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                run(streamed, "wan")
        finally:
            StreamingRuntime.after_block = ends
        assert handle._runtime.is_running(2)
        both((reference, streamed), lambda m: m.fuse_lora(lora_scale=0.5))
        assert torch.equal(run(reference, "wan", 2), run(streamed, "wan", 2))
    assert same_state(reference, streamed)


def test_an_edit_whose_block_is_left_as_it_was_takes_back_the_merges_made_in_it(tiny_pair, tiny_loras):
    """A PEFT merge and a refused change (a weight given another dtype) in one edited block:
    the block is left as it was, merge included, and so is PEFT's list of what that block's
    layers hold merged; a later fuse and unfuse then equal the resident model's."""
    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        block = streamed.blocks[1]
        with pytest.raises(dlo.StreamingError, match="block 'blocks.1' was left as it was"):
            with handle.editing(block):
                block.attn1.to_q.merge()
                block.attn1.to_k.weight.data = block.attn1.to_k.weight.data.half()
        assert block.attn1.to_q.merged_adapters == []
        assert torch.equal(run(reference, "wan", 1), run(streamed, "wan", 1))
        both((reference, streamed), lambda m: m.fuse_lora())
        assert torch.equal(run(reference, "wan", 2), run(streamed, "wan", 2))
        both((reference, streamed), lambda m: m.unfuse_lora())
        assert torch.equal(run(reference, "wan", 3), run(streamed, "wan", 3))
    assert same_state(reference, streamed)


def test_blocks_promoted_in_inference_mode_hold_ordinary_tensors(tiny_pair, tiny_loras):
    """A block promoted during a call under torch.inference_mode() (automatic residency)
    outlives it: its weights are ordinary tensors, so a fused DoRA adapter (whose unmerge
    records autograd) unfuses and a new adapter loads as on the resident model."""
    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["dora"], adapter_name="d", prefix="transformer"))
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=1.0)) as handle:
        both((reference, streamed), lambda m: m.fuse_lora())
        for seed in range(4):
            run(streamed, "wan", seed)  # under inference_mode
        assert handle.stats().resident_blocks == 4
        assert not any(p.is_inference() for p in streamed.blocks.parameters())
        both((reference, streamed), lambda m: m.unfuse_lora())
        both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["b"], adapter_name="b", prefix="transformer"))
        assert torch.equal(run(reference, "wan", 7), run(streamed, "wan", 7))
    assert same_state(reference, streamed)


def test_a_safe_fuse_refusing_a_nan_layer_stops_where_diffusers_stops(tiny_pair, tiny_loras):
    """PEFT's safe merge raises at a layer whose merge gives NaN: the layers before it (in
    module order, as diffusers' fuse_lora walks them) are merged, those after it not."""
    reference, streamed, _ = tiny_pair("flux")
    for model in (reference, streamed):
        model.load_lora_adapter(tiny_loras("flux")["a"], adapter_name="a", prefix="transformer")
        with torch.no_grad():
            model.single_transformer_blocks[1].attn.to_q.lora_B["a"].weight[0, 0] = float("nan")
    with dlo.enable(streamed, "cpu"):
        for model in (reference, streamed):
            with pytest.raises(ValueError, match="NaNs detected"):
                model.fuse_lora(safe_fusing=True)
        merged = _merged_lists(streamed)
        assert merged == _merged_lists(reference) and merged["transformer_blocks.0.attn.to_q"] and not merged["proj_out"]
        for model in (reference, streamed):
            with torch.no_grad():
                model.single_transformer_blocks[1].attn.to_q.lora_B["a"].weight[0, 0] = 0.0  # NaN equals nothing
    assert same_state(reference, streamed)


def test_an_interrupted_enable_of_a_fused_model_leaves_its_layers_plain(tiny_pair, tiny_loras, monkeypatch):
    """Ctrl-C as enable() ends, once the fused layers' unmerge and the model's fuse_lora were
    replaced: the rollback puts PEFT's and diffusers' back, so a plain unfuse afterwards is
    PEFT's own."""
    from dlo.backend import handle as handle_module

    reference, streamed, _ = tiny_pair("flux")
    for model in (reference, streamed):
        model.load_lora_adapter(tiny_loras("flux")["a"], adapter_name="a", prefix="transformer")
        model.fuse_lora(lora_scale=0.5)

    installed = handle_module.LoraFusion.install

    def interrupted(self):
        installed(self)  # the layers' unmerge and the model's fuse_lora replaced, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(handle_module.LoraFusion, "install", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dlo.enable(streamed, "cpu")
    monkeypatch.undo()
    assert not [name for name, m in streamed.named_modules() if {"unmerge", "fuse_lora"} & vars(m).keys()]
    both((reference, streamed), _unmerge_each_layer)
    assert same_state(reference, streamed)


def test_layers_unloaded_after_a_fuse_are_freed_while_streaming(tiny_pair, tiny_loras):
    """unload_lora_weights() after a fuse keeps the fused weights and drops the PEFT layers:
    dlo's record of what they merged holds them weakly, so their adapters are freed."""
    import gc
    import weakref

    _, streamed, _ = tiny_pair("flux")
    streamed.load_lora_adapter(tiny_loras("flux")["a"], adapter_name="a", prefix="transformer")
    with dlo.enable(streamed, "cpu"):
        streamed.fuse_lora()
        layer = weakref.ref(streamed.transformer_blocks[0].attn.to_q)
        streamed.unload_lora()
        gc.collect()
        assert layer() is None
        run(streamed, "flux")


def test_an_unmerge_past_the_layers_own_is_refused_at_the_next_call_and_unfuse_finishes_it(tiny_pair, tiny_loras):
    """PEFT's class method called directly pops the adapter from the merged list, then fails to
    write the stand-in: the layer would apply its LoRA on top of the fused weight."""
    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer"))
    reference.fuse_lora()
    with dlo.enable(streamed, "cpu"):
        streamed.fuse_lora()
        layer = streamed.blocks[1].attn1.to_q
        with pytest.raises(RuntimeError, match="written-to tensor"):
            type(layer).unmerge(layer)
        with pytest.raises(dlo.StreamingError, match=r"dropped merged adapters .* unfuse_lora\(\)"):
            run(streamed, "wan")
        assert torch.equal(run(reference, "wan", 2), run(streamed, "wan", 2))  # still fused, consistently
        both((reference, streamed), lambda m: m.unfuse_lora())
        assert torch.equal(run(reference, "wan", 3), run(streamed, "wan", 3))


def test_an_unmerge_past_the_layers_own_then_disable_is_refused_and_the_module_stays_fused(tiny_pair, tiny_loras):
    """No call between the cut-short unmerge and disable(): disable() makes the same check
    (raising after the module is plain), so the plain model holds the fused weight, listed
    merged, as the reference."""
    reference, streamed, _ = tiny_pair("wan")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("wan")["a"], adapter_name="a", prefix="transformer"))
    reference.fuse_lora()
    handle = dlo.enable(streamed, "cpu")
    streamed.fuse_lora()
    layer = streamed.blocks[1].attn1.to_q
    with pytest.raises(RuntimeError, match="written-to tensor"):
        type(layer).unmerge(layer)
    with pytest.raises(dlo.StreamingError, match="dropped merged adapters"):
        handle.disable()
    assert handle.state is dlo.HandleState.DISABLED and layer.merged_adapters == ["a"]
    assert same_state(reference, streamed)
    assert torch.equal(run(reference, "wan"), run(streamed, "wan"))


def test_disable_lora_after_fuse_unmerges_as_the_resident_forward_does(tiny_pair, tiny_loras):
    """PEFT unmerges a merged layer in its forward when adapters are disabled: inside the
    block's call, where only the slot would change."""
    reference, streamed, _ = tiny_pair("flux")
    both((reference, streamed), lambda m: m.load_lora_adapter(tiny_loras("flux")["a"], adapter_name="a", prefix="transformer"))
    with dlo.enable(streamed, "cpu") as handle:
        reference.fuse_lora()
        handle.fuse_lora()
        both((reference, streamed), lambda m: m.disable_lora())
        assert torch.equal(run(reference, "flux", 2), run(streamed, "flux", 2))
        both((reference, streamed), lambda m: m.enable_lora())
        assert torch.equal(run(reference, "flux", 3), run(streamed, "flux", 3))  # LoRA unfused, applied
    assert same_state(reference, streamed)


@pytest.mark.parametrize("name", MODELS)
def test_in_place_edits_between_calls_are_refused_and_change_nothing(tiny_pair, name):
    reference, streamed, _ = tiny_pair(name)
    with dlo.enable(streamed, "cpu"):
        expected = run(streamed, name)
        weights = [(n, p) for n, p in streamed.named_parameters() if p.dim() == 2 and bool(p.isnan().all())]
        first, second = weights[0], weights[1]
        with pytest.raises(RuntimeError, match="written-to tensor"), torch.no_grad():
            first[1].mul_(0.5)  # torch refuses the write into the stand-in: nothing changed
        assert torch.equal(run(streamed, name), expected)
        with torch.no_grad():
            first[1].zero_()  # goes through, into the stand-in
        second[1].data = torch.ones(second[1].shape)
        with pytest.raises(dlo.StreamingError, match=rf"{first[0]!r} was written in place .*\(and 1 more\)"):
            run(streamed, name)
        assert torch.equal(run(streamed, name), expected)  # dropped: the weights dlo streams are unchanged
        assert bool(first[1].isnan().all())  # the stand-in reads NaN again
    assert same_state(reference, streamed)


@pytest.mark.parametrize("name", MODELS)
def test_edits_inside_handle_editing_reach_the_streamed_weights(tiny_pair, name):
    reference, streamed, _ = tiny_pair(name)

    block = f"{dlo.discover(reference).block_lists[0]}.1"  # the second block of the first list
    names = [f"{block}.{n}" for n, p in reference.get_submodule(block).named_parameters() if p.dim() == 2][:3]

    def edit(model):
        weights = [model.get_parameter(n) for n in names]
        with torch.no_grad():
            weights[0].mul_(0.5)
            weights[1].data = weights[1].data * -1
            weights[2].copy_(torch.full(weights[2].shape, 0.01))

    with dlo.enable(streamed, "cpu") as handle:
        run(streamed, name)
        with handle.editing():  # every streamed block opened and closed unchanged: none is rewritten
            pass
        assert handle.stats().rewritten_blocks == 0
        edit(reference)
        with handle.editing(streamed.get_submodule(names[0].rsplit(".", 2)[0])):  # a module inside the block
            edit(streamed)
        assert torch.equal(run(reference, name, 2), run(streamed, name, 2))
        assert handle.stats().rewritten_blocks == 1
        with pytest.raises(dlo.StreamingError, match="not a streamed block"):
            handle.editing(streamed.proj_out)
    assert same_state(reference, streamed)


@pytest.mark.parametrize("device_room", [True, False], ids=["compared-in-chunks", "out-of-device-memory"])
def test_an_edit_of_only_the_last_byte_of_a_block_is_found_and_written(tiny_pair, monkeypatch, device_room):
    """A block is compared with its host copy a chunk at a time (here 256 bytes: many chunks);
    with no device room for a chunk the host way is taken. Either way a change in the block's
    last tensor only reaches the streamed weights."""
    from dlo.host import block_rewrite

    monkeypatch.setattr(block_rewrite, "COMPARE_CHUNK_BYTES", 256)
    if not device_room:
        def no_room(*args):
            raise torch.OutOfMemoryError("no device memory for the compare")

        monkeypatch.setattr("dlo.backend.weight_changes.rewrite_in_place", no_room)
    reference, streamed, _ = tiny_pair("wan")
    with dlo.enable(streamed, "cpu") as handle:
        run(streamed, "wan")
        block = handle._runtime.blocks[0]
        last = max(block.layout.placements, key=lambda p: p.offset).spec.name
        assert block.layout.nbytes > 8 * 256
        name = f"{block.name}.{last}"
        for model in (reference, streamed):
            with torch.no_grad(), handle.editing(streamed.get_submodule(block.name)) if model is streamed else nullcontext():
                model.get_parameter(name).view(-1)[-1] += 1.0
        assert handle.stats().rewritten_blocks == 1
        assert torch.equal(run(reference, "wan", 2), run(streamed, "wan", 2))
    assert same_state(reference, streamed)


@pytest.mark.parametrize("name", MODELS)
def test_load_state_dict_reaches_the_streamed_weights(tiny_pair, name):
    reference, streamed, _ = tiny_pair(name)
    other = TINY_MODELS[name].build(seed=5).state_dict()
    with dlo.enable(streamed, "cpu") as handle:
        run(streamed, name)
        reference.load_state_dict(other)
        streamed.load_state_dict(other)
        assert torch.equal(run(reference, name, 2), run(streamed, name, 2))
        assert handle.stats().rewritten_blocks == handle.stats().streamed_blocks
        one_block = {k: v * 2 for k, v in other.items() if ".1." in k}  # strict=False: the rest stays
        reference.load_state_dict(one_block, strict=False)
        streamed.load_state_dict(one_block, strict=False)
        assert torch.equal(run(reference, name, 3), run(streamed, name, 3))
    assert same_state(reference, streamed)


@pytest.mark.parametrize("name", MODELS)
def test_a_load_state_dict_that_cannot_finish_is_refused_before_any_weight_changes(tiny_pair, name):
    """torch copies every other tensor and raises a size mismatch at the end (half applied)."""
    _, streamed, _ = tiny_pair(name)
    other = TINY_MODELS[name].build(seed=5).state_dict()
    wrong = next(k for k in other if other[k].dim() == 2 and ".1." in k)
    with dlo.enable(streamed, "cpu"):
        expected = run(streamed, name)
        before = {k: v.clone() for k, v in streamed.state_dict().items() if not v.isnan().any()}
        with pytest.raises(dlo.StreamingError, match=rf"{wrong!r} has shape \(3, 3\), the model's .* nothing was loaded"):
            streamed.load_state_dict({**other, wrong: torch.zeros(3, 3)})
        with pytest.raises(dlo.StreamingError, match="assign=True"):
            streamed.load_state_dict(other, assign=True)
        assert all(torch.equal(v, streamed.state_dict()[k]) for k, v in before.items())  # non-block parts too
        assert torch.equal(run(streamed, name), expected)


@pytest.mark.parametrize("cast", ["half", "to-bfloat16"])
def test_a_dtype_cast_after_enable_is_refused_by_name(tiny_pair, cast):
    _, streamed, _ = tiny_pair("flux")
    with dlo.enable(streamed, "cpu"):
        run(streamed, "flux")
        streamed.half() if cast == "half" else streamed.to(torch.bfloat16)
        with pytest.raises(dlo.StreamingError, match=r"'transformer_blocks.0.* became (float16|bfloat16) .*disable\(\) first"):
            run(streamed, "flux")
        assert all(bool(p.isnan().all()) for p in streamed.transformer_blocks.parameters())  # stand-ins again


def test_disable_finishes_then_refuses_a_change_that_missed_the_streamed_weights(tiny_pair):
    reference, streamed, _ = tiny_pair("wan")
    handle = dlo.enable(streamed, "cpu")
    run(streamed, "wan")
    streamed.blocks[2].ffn.net[2].weight.data = torch.zeros(32, 64)
    with pytest.raises(dlo.StreamingError, match="'blocks.2.ffn.net.2.weight' was written in place"):
        handle.disable()
    assert handle.state is dlo.HandleState.DISABLED
    assert same_state(reference, streamed)  # the weights dlo streamed, not the dropped zeros
