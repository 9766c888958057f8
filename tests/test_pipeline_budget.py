"""The whole pipeline under one device budget (hbm_budget_gib): the plan from plain numbers, the
VAE decode's predicted peak, and tiny real pipelines placed by it, equal to the plain pipeline
decoding the same way."""

import numpy as np
import pytest
import torch

import dlo
from dlo.backend.decode_peak import OutputSize, _meta_twin, decode_costs, latent_shape, meta_peak
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS
from dlo.planning.pipeline_budget import HEADROOM, ComponentCost, DecodeCost, DecodeMode, Placement, plan_pipeline

diffusers = pytest.importorskip("diffusers")
from plain_pipeline import plain_pipeline  # noqa: E402  (needs diffusers)

MIB = 2**20
# A Wan-like pipeline in MiB: the transformer streams in 1000 (non-block parts + 2 slots) of its
# 9000; the encoder in 900 of its 6000, held only while it runs; the VAE has no blocks; the
# scheduler-like 'head' holds less on the device whole (10) than streamed (20).
COMPONENTS = [
    ComponentCost("transformer", 9000 * MIB, 1000 * MIB, every_step=True),
    ComponentCost("text_encoder", 6000 * MIB, 900 * MIB, before_steps=True),
    ComponentCost("vae", 300 * MIB, None),
    ComponentCost("head", 10 * MIB, 20 * MIB, before_steps=True),
]
HELD_WEIGHTS = (1000 + 300 + 10) * MIB  # through the steps and the decode; the encoder's 900 only in its phase
DECODES = [
    DecodeCost(DecodeMode.WHOLE, 4000 * MIB),
    DecodeCost(DecodeMode.SLICED, 2500 * MIB),
    DecodeCost(DecodeMode.TILED, 1000 * MIB),
]


def budget_for(nbytes):
    """The smallest budget whose usable part (less HEADROOM) holds `nbytes`."""
    return int(nbytes / (1 - HEADROOM)) + 1


def usable(budget):
    return int(budget * (1 - HEADROOM))


def test_a_budget_that_holds_everything_puts_every_component_on_the_device():
    # 15310 MiB of weights + max(4000 decode, 3000 reserve).
    plan = plan_pipeline(budget_for((15310 + 4000) * MIB), COMPONENTS, DECODES, 3000 * MIB)
    assert set(plan.placement.values()) == {Placement.DEVICE}
    assert plan.decode.mode is DecodeMode.WHOLE and plan.transformer_budget_bytes is None
    # The activation reserve counts when it is the larger: 1 MiB short of 15310 + 5000.
    plan = plan_pipeline(budget_for((15310 + 5000) * MIB) - MIB, COMPONENTS, DECODES, 5000 * MIB)
    assert plan.placement["transformer"] is Placement.STREAMED


def test_a_component_that_must_stream_streams_even_when_everything_fits():
    budget = budget_for((15310 + 4000) * MIB)
    plan = plan_pipeline(budget, COMPONENTS, DECODES, 0, streamed=frozenset({"transformer"}))
    assert plan.placement["transformer"] is Placement.STREAMED and plan.placement["text_encoder"] is Placement.DEVICE
    assert plan.transformer_budget_bytes == usable(budget)
    assert plan.other_phase_bytes == (1000 + 6000 + 300 + 10 + 4000) * MIB  # its slots, the rest whole, the decode


def test_everything_stays_on_the_device_with_a_sliced_or_tiled_decode_before_anything_streams():
    # 15310 MiB of weights + max(2500 sliced, 2000 reserve): the whole decode (4000) does not fit.
    plan = plan_pipeline(budget_for((15310 + 2500) * MIB), COMPONENTS, DECODES, 2000 * MIB)
    assert set(plan.placement.values()) == {Placement.DEVICE} and plan.decode.mode is DecodeMode.SLICED


def test_otherwise_blocks_stream_where_that_holds_less_and_the_transformer_gets_what_the_decode_leaves():
    budget = budget_for(HELD_WEIGHTS + 4000 * MIB)
    plan = plan_pipeline(budget, COMPONENTS, DECODES, 10**6 * MIB)
    assert plan.placement == {
        "transformer": Placement.STREAMED,
        "text_encoder": Placement.STREAMED,
        "vae": Placement.DEVICE,  # no repeated blocks
        "head": Placement.DEVICE,  # streaming it would hold more
    }
    assert plan.weight_bytes == HELD_WEIGHTS and plan.released == {"text_encoder": 900 * MIB}
    assert plan.decode.mode is DecodeMode.WHOLE and plan.transformer_budget_bytes == usable(budget)
    assert plan.other_phase_bytes == HELD_WEIGHTS + 4000 * MIB  # the decode: larger than the encoder's 900
    assert "text_encoder: 0.88 GiB more while it runs, given back when the transformer starts" in plan.describe()


@pytest.mark.parametrize(
    ("room", "mode"), [(3999, DecodeMode.SLICED), (2500, DecodeMode.SLICED), (2499, DecodeMode.TILED), (1000, DecodeMode.TILED)]
)
def test_the_decode_is_sliced_then_tiled_when_whole_does_not_fit(room, mode):
    budget = budget_for(HELD_WEIGHTS + room * MIB)
    plan = plan_pipeline(budget, COMPONENTS, DECODES, 0)
    assert plan.decode.mode is mode
    assert plan.other_phase_bytes == HELD_WEIGHTS + plan.decode.peak_bytes  # each decode > the encoder's 900


def test_the_encoders_phase_adds_up_their_parts_and_may_set_the_minimum_and_the_residency_budget():
    # Two encoders of 900 each: the first keeps its slots while the second runs (until the steps).
    components = [*COMPONENTS, ComponentCost("text_encoder_2", 6000 * MIB, 900 * MIB, before_steps=True)]
    budget = budget_for(HELD_WEIGHTS + 1800 * MIB)
    plan = plan_pipeline(budget, components, DECODES, 0)
    assert plan.released == {"text_encoder": 900 * MIB, "text_encoder_2": 900 * MIB}
    assert plan.decode.mode is DecodeMode.TILED  # 1000 < 1800: the encoders' phase is the larger
    assert plan.other_phase_bytes == HELD_WEIGHTS + 1800 * MIB
    with pytest.raises(dlo.ConfigError) as refused:
        plan_pipeline(budget_for(HELD_WEIGHTS + 1799 * MIB), components, DECODES, 0)
    assert "or 1.76 GiB while text_encoder and text_encoder_2 run" in str(refused.value)


def test_a_streamed_vae_is_held_through_the_decode_not_released():
    components = [*COMPONENTS[:2], ComponentCost("vae", 300 * MIB, 100 * MIB), COMPONENTS[3]]
    plan = plan_pipeline(budget_for(HELD_WEIGHTS + 4000 * MIB), components, DECODES, 10**6 * MIB, frozenset({"vae"}))
    assert plan.placement["vae"] is Placement.STREAMED and "vae" not in plan.released
    assert plan.weight_bytes == HELD_WEIGHTS - 200 * MIB  # its 100 streamed, not its 300


def test_a_budget_below_the_minimum_is_refused_naming_it():
    least = (HELD_WEIGHTS + 1000 * MIB) / (1 - HEADROOM) / 2**30  # the tiled decode (1000) > the encoder (900)
    budget = budget_for(HELD_WEIGHTS + 999 * MIB)
    with pytest.raises(dlo.ConfigError) as refused:
        plan_pipeline(budget, COMPONENTS, DECODES, 0)
    message = str(refused.value)
    assert message.startswith(
        f"OffloadConfig.hbm_budget_gib={budget / 2**30:.3f} is below the {least:.3f} GiB this pipeline needs at the least"
    )
    assert f"{budget / 2**30:.3f}" != f"{least:.3f}"
    assert "transformer, text_encoder streamed" in message and "tiled VAE decode" in message
    assert "\n" not in message


# The VAE decode's predicted peak (meta device), on the tiny pipelines' real VAE classes.


def small_tiles(vae):
    """Tiles smaller than the tiny pipelines' outputs, so that a tiled decode has several."""
    if hasattr(vae, "tile_latent_min_size"):  # AutoencoderKL (Flux)
        vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 4
    else:  # AutoencoderKLWan
        vae.tile_sample_min_height = vae.tile_sample_min_width = 24
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = 16


def size_of(name, batch=1):
    d = GENERATE_DEFAULTS[name]
    return OutputSize(d["height"], d["width"], d.get("num_frames", 1), batch)


def exact_peak(pipe, size, tiling, slicing):
    """The tiled or sliced decode itself counted on meta (slow for real sizes, exact)."""
    twin = _meta_twin(pipe.vae)
    small_tiles(twin)
    if tiling:
        twin.enable_tiling()
    if slicing:
        twin.enable_slicing()
    shape = latent_shape(pipe, size)
    return meta_peak(lambda: twin.decode(torch.empty(shape, device="meta")), twin.state_dict().values())


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_the_predicted_tiled_and_sliced_peaks_bound_the_decodes_counted_exactly(tiny_flux_dir, tiny_wan_dir, name):
    pipe = plain_pipeline({"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name])
    small_tiles(pipe.vae)
    size = size_of(name, batch=2)
    costs = {cost.mode: cost.peak_bytes for cost in decode_costs(pipe, size)}
    assert list(costs) == [DecodeMode.WHOLE, DecodeMode.SLICED, DecodeMode.TILED]
    # Each prediction adds the post-processing's two float32 copies of the output, which come
    # after the decode: the decode's own part must bound the decode counted exactly.
    post = 2 * size.batch * 3 * size.frames * size.height * size.width * 4
    assert costs[DecodeMode.WHOLE] - post >= exact_peak(pipe, size, tiling=False, slicing=False)
    assert costs[DecodeMode.SLICED] - post >= exact_peak(pipe, size, tiling=False, slicing=True)
    assert costs[DecodeMode.TILED] - post >= exact_peak(pipe, size, tiling=True, slicing=True)
    assert costs[DecodeMode.TILED] < costs[DecodeMode.SLICED] < costs[DecodeMode.WHOLE]


def test_a_tile_as_large_as_the_output_offers_no_tiled_decode(tiny_wan_dir):
    pipe = plain_pipeline(tiny_wan_dir)  # Wan's tiles are 256 pixels, the output 32
    assert [cost.mode for cost in decode_costs(pipe, size_of("wan"))] == [DecodeMode.WHOLE]


def test_attention_is_counted_as_a_fused_kernel_allocates_it_and_weights_are_not_counted():
    import torch.nn.functional as F

    q = k = v = torch.empty(1, 1, 4096, 64, device="meta")
    # The output (1 MiB) and the float32 log-sum-exp (16 KiB), not the 64 MiB of a 4096² score matrix.
    assert meta_peak(lambda: F.scaled_dot_product_attention(q, k, v)) == 4096 * 64 * 4 + 4096 * 4
    weight = torch.empty(256, 256, device="meta")
    assert meta_peak(lambda: (weight.t(), weight.detach()), [weight]) == 0
    assert meta_peak(lambda: weight.t(), []) == 256 * 256 * 4  # a view counts its base when not excluded


def test_a_call_fills_the_sizes_it_leaves_out_from_the_pipelines_defaults(tiny_wan_dir, tiny_flux_dir):
    from dlo.backend.decode_peak import call_size

    assert call_size(plain_pipeline(tiny_wan_dir), 64, 96, None) == OutputSize(64, 96, 81)
    assert call_size(plain_pipeline(tiny_flux_dir), None, 512, None) == OutputSize(1024, 512, 1)


def test_an_image_pipeline_with_a_video_vae_decodes_five_dimensional_latents():
    """Qwen-Image's VAE is Wan's kind (latents with a frame axis) in an image pipeline."""
    from types import SimpleNamespace

    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False])
    pipe = SimpleNamespace(vae=vae, vae_scale_factor=2)
    assert latent_shape(pipe, OutputSize(32, 48)) == (1, 4, 1, 16, 24)
    assert decode_costs(pipe, OutputSize(32, 48))[0].mode is DecodeMode.WHOLE


def test_a_size_the_vae_cannot_decode_is_one_line_naming_it(tiny_flux_dir):
    with pytest.raises(dlo.ConfigError) as refused:
        decode_costs(plain_pipeline(tiny_flux_dir), OutputSize(4, 4))
    assert str(refused.value).startswith("OffloadConfig.hbm_budget_gib: AutoencoderKL cannot decode latents of shape")
    assert "\n" not in str(refused.value)


def test_a_failure_while_the_decode_is_set_up_gives_the_vae_back_as_it_was(tiny_flux_dir):
    from dlo.backend.decode_peak import apply_decode

    vae = plain_pipeline(tiny_flux_dir).vae
    undo = []

    def refused():
        raise KeyboardInterrupt

    vae.enable_slicing = refused
    with pytest.raises(KeyboardInterrupt):
        apply_decode(vae, DecodeMode.TILED, 2, undo)
    assert vae.use_tiling
    undo.pop()()
    assert not vae.use_tiling and not vae.use_slicing


# Tiny pipelines placed by the plan: outputs equal to the plain pipeline decoding the same way.


def run(pipe, name):
    kwargs = dict(GENERATE_DEFAULTS[name])
    with torch.inference_mode():
        out = pipe("a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(0), **kwargs)
    return np.asarray(out.images[0] if name == "flux" else out.frames[0])


def budget_config(nbytes):
    return dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=nbytes / 2**30)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_under_a_budget_the_pipeline_streams_decodes_tiled_and_equals_the_plain_pipeline_tiled(
    tiny_flux_dir, tiny_wan_dir, name
):
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name]
    plain = plain_pipeline(directory)
    expected_whole = run(plain, name)
    small_tiles(plain.vae)
    plain.vae.enable_tiling()
    expected_tiled = run(plain, name)
    assert not np.array_equal(expected_tiled, expected_whole)  # tiling changes the output a little

    pipe = plain_pipeline(directory)
    small_tiles(pipe.vae)
    size = size_of(name)
    costs = {cost.mode: cost.peak_bytes for cost in decode_costs(pipe, size)}
    # A reserve no budget holds: the plan streams. A budget of ample room: a whole decode.
    with dlo.enable_pipeline(pipe, "cpu", budget_config(2**30), size=size, reserve_gib=1e6) as handle:
        plan = handle.plan
        assert plan.decode.mode is DecodeMode.WHOLE and not pipe.vae.use_tiling
        assert handle.handles["transformer"].residency_budget == usable(2**30)
        assert np.array_equal(run(pipe, name), expected_whole)
    streamed = {n for n, where in plan.placement.items() if where is Placement.STREAMED}
    assert "transformer" in streamed and set(handle.handles) == streamed
    assert plan.placement["vae"] is Placement.DEVICE  # its decoder runs its blocks per frame and tile
    # Room for the tiled decode but not the whole one.
    between = (costs[DecodeMode.WHOLE] + costs[DecodeMode.TILED]) // 2
    with dlo.enable_pipeline(pipe, "cpu", budget_config(budget_for(plan.weight_bytes + between)), size=size, reserve_gib=1e6) as handle:
        assert handle.plan.decode.mode is DecodeMode.TILED and pipe.vae.use_tiling
        assert np.array_equal(run(pipe, name), expected_tiled)
    assert not pipe.vae.use_tiling  # disable() gives the VAE back as it was


# Room beyond the held weights and the decode, in blocks: for one transformer less than its 4
# blocks, which would all be resident (and its slots dropped) were the decode not handed over.
@pytest.mark.parametrize(("two", "room"), [(False, 1.7), (True, 3.0)], ids=["wan", "wan-2.2-two-transformers"])
def test_the_transformers_resident_blocks_leave_room_for_the_decode(tiny_wan_dir, two, room):
    """A budget where the decode, not the steps, binds: the resident blocks chosen (by each
    transformer, the second one seeing the first's) fit beside the held weights and the decode."""
    import copy

    from dlo.backend.pipeline import _streamed_bytes, pipeline_plan
    from dlo.planning.plan_summary import summarize

    def wan(pipe):
        if two:  # Wan 2.2: a second transformer for the low-noise half of the steps
            pipe.register_modules(transformer_2=copy.deepcopy(pipe.transformer))
            pipe.register_to_config(boundary_ratio=0.9)  # the first of the 2 steps on the first
        return pipe

    expected = run(wan(plain_pipeline(tiny_wan_dir)), "wan")
    pipe = wan(plain_pipeline(tiny_wan_dir))
    size = size_of("wan")
    names = ["transformer", "transformer_2"] if two else ["transformer"]
    summary = summarize(pipe.transformer, dlo.discover(pipe.transformer))
    smallest = min(block.nbytes for block in summary.blocks)
    probe = pipeline_plan(pipe, budget_config(2**30), size, reserve_gib=1e6)
    budget = budget_for(probe.weight_bytes + probe.decode.peak_bytes + int(room * smallest))
    with dlo.enable_pipeline(pipe, "cpu", budget_config(budget), size=size, reserve_gib=1e6) as handle:
        plan = handle.plan
        assert plan.decode.mode is DecodeMode.WHOLE
        got = [run(pipe, "wan") for _ in range(3)]  # each residency measured in the second of its calls
        transformers = [handle.handles[name] for name in names]
        assert all(h.stats().residency.state in ("planned", "kept") for h in transformers)
        planned = sum(_streamed_bytes(pipe.components[name], budget_config(budget)) for name in names)
        held = plan.weight_bytes - planned + sum(h.device_bytes() for h in transformers)
        resident = sum(h.stats().resident_blocks for h in transformers)
    assert all(np.array_equal(g, expected) for g in got)
    assert held + plan.decode.peak_bytes <= usable(budget)
    assert resident >= 1  # room was left for some
    if two:  # the first disabled by hand before the second plans its residency
        pipe = wan(plain_pipeline(tiny_wan_dir))
        with dlo.enable_pipeline(pipe, "cpu", budget_config(budget), size=size, reserve_gib=1e6) as handle:
            handle.handles["transformer"].disable()
            assert all(np.array_equal(run(pipe, "wan"), expected) for _ in range(3))
            assert handle.handles["transformer_2"].stats().residency.state in ("planned", "kept")


def test_a_budget_that_holds_everything_runs_the_plain_pipeline_on_the_device(tiny_flux_dir):
    pipe = plain_pipeline(tiny_flux_dir)
    expected = run(plain_pipeline(tiny_flux_dir), "flux")
    with dlo.enable_pipeline(pipe, "cpu", budget_config(2**30), size=size_of("flux"), reserve_gib=0.1) as handle:
        assert handle.handles == {} and set(handle.placement.values()) == {"device"}
        assert "transformer" in handle.placement
        assert np.array_equal(run(pipe, "flux"), expected)


def test_a_budget_below_the_minimum_is_refused_before_anything_moves(tiny_flux_dir):
    pipe = plain_pipeline(tiny_flux_dir)
    before = {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(dlo.ConfigError, match=r"^OffloadConfig.hbm_budget_gib=0.000 is below the .* this pipeline needs"):
        dlo.enable_pipeline(pipe, "cpu", budget_config(2**30 / 1e5))
    assert {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()} == before
    with dlo.enable_pipeline(pipe, "cpu"):  # nothing was left enabled
        pass


def test_a_pipeline_without_a_default_size_needs_one(tiny_flux_dir):
    pipe = plain_pipeline(tiny_flux_dir)
    pipe.default_sample_size = None
    with pytest.raises(dlo.ConfigError, match=r"^FluxPipeline has no default output size to plan the VAE decode for: give the call.s size \(enable_pipeline.s size=OutputSize"):
        dlo.enable_pipeline(pipe, "cpu", budget_config(2**30))
    with pytest.raises(dlo.ConfigError, match=r"OutputSize.frames must be an int >= 1, got 0"):
        OutputSize(64, 64, frames=0)


# A streamed encoder holds the device in its own phase only: its large non-block modules stream
# as blocks of their own, and its slots go back when the transformer starts.


def slot_bytes(handle):
    return [slot.buffer.numel() for slot in handle._runtime.slots]


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_a_streamed_encoder_looks_its_embedding_up_on_the_host_and_gives_its_slots_back_when_the_transformer_starts(
    tiny_flux_dir, tiny_wan_dir, name, monkeypatch
):
    import dlo.backend.pipeline as pipeline

    # Every module of its own weights outside the blocks (embeddings, final norms) streams alone;
    # the embeddings look their rows up on the host.
    monkeypatch.setattr(pipeline, "SINGLE_BLOCK_BYTES", 1)
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name]
    expected = run(plain_pipeline(directory), name)
    pipe = plain_pipeline(directory)
    config = budget_config(2**30)
    with dlo.enable_pipeline(pipe, "cpu", config, size=size_of(name), reserve_gib=1e6, components=["text_encoder"]) as handle:
        encoders = list(handle.plan.released)
        assert "text_encoder" in encoders  # named (the tiny ones hold less on the device whole)
        # UMT5's embedding is tied under two names: the one its stack runs streams.
        single = "embeddings.token_embedding" if name == "flux" else "encoder.embed_tokens"
        assert handle.handles["text_encoder"].plan.block_lists[0] == single
        assert single in handle.handles["text_encoder"].plan.host_lookups
        held_at_end = {encoder: [] for encoder in encoders}  # the slot bytes as each encoder call ends
        for encoder in encoders:
            assert not any(slot_bytes(handle.handles[encoder]))  # given back right after enable()
            pipe.components[encoder].register_forward_hook(
                lambda *_, e=encoder: held_at_end[e].append(sum(slot_bytes(handle.handles[e])))
            )
        tokens = {encoder: pipe.components[encoder].get_input_embeddings().weight for encoder in encoders}
        assert all(weight.stride() == (0, 0) for weight in tokens.values())  # stand-ins between calls
        for call in range(2):
            before = {encoder: s.bytes_streamed for encoder, s in handle.stats().items()}
            assert np.array_equal(run(pipe, name), expected)
            for encoder, weight in tokens.items():
                passes = len(held_at_end[encoder])  # Wan encodes the negative prompt too
                assert passes and all(held_at_end[encoder])  # taken again while it ran
                held_at_end[encoder].clear()
                assert not any(slot_bytes(handle.handles[encoder]))  # and given back
                # Once the order is learned (the first call's prefetches follow the plan's order,
                # single blocks first), every block but the embeddings is copied once per pass:
                # nothing is prefetched for the next call, whose slots go back first.
                runtime = handle.handles[encoder]._runtime
                lookups = [i for i, block in enumerate(runtime.blocks) if block.name.endswith(("_embedding", "embed_tokens"))]
                assert weight is runtime.blocks[lookups[0]].tensors[0]
                per_pass = sum(runtime.loads.link_bytes(i) for i in range(len(runtime.blocks)) if i not in lookups)
                streamed = handle.stats()[encoder].bytes_streamed - before[encoder]
                assert streamed == passes * per_pass if call else streamed >= passes * per_pass
        assert all(slot_bytes(handle.handles["transformer"]))  # the transformer keeps its slots


def test_a_module_tied_to_a_streamed_single_block_that_runs_promotes_it_and_computes_exactly(tiny_flux_dir, caplog):
    """T5's `shared` and `encoder.embed_tokens` hold one weight; streaming `shared`, which never
    runs, leaves `encoder.embed_tokens` as its alias: when it runs, the block is promoted."""
    encoder = plain_pipeline(tiny_flux_dir).text_encoder_2
    ids = torch.randint(0, encoder.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = encoder(ids).last_hidden_state
    plan = dlo.OffloadPlan(block_lists=("shared", "encoder.block"))
    with dlo.enable(encoder, "cpu", plan=plan) as handle, torch.inference_mode():
        assert torch.equal(encoder(ids).last_hidden_state, expected)
        assert handle.stats().resident_blocks == 1
    assert "encoder.embed_tokens ran outside the call of its block 'shared'" in caplog.text


def test_a_tensor_tied_to_a_streamed_block_and_held_by_a_module_of_other_tensors_is_refused():
    """An alias holds only the block's tensor; `head` holds it beside a bias of its own: it gets
    no probe, so enable() refuses the tie, whatever module holds the tensor first."""
    from torch import nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.alias = nn.Linear(4, 4, bias=False)
            self.layers = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(2)])
            self.head = nn.Linear(4, 4)
            self.alias.weight = self.head.weight = self.layers[0].weight

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with pytest.raises(dlo.EnableError, match=r"^layers.0.weight is the same tensor as 'head.weight'"):
        dlo.enable(Tied(), "cpu")


def test_an_embedding_tied_to_a_head_of_another_class_stays_on_the_device():
    """A causal LM's `embed_tokens` and `lm_head` may both run: neither streams alone."""
    from torch import nn

    from dlo.planning.offload_plan import with_single_blocks

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(64, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.lm_head = nn.Linear(8, 64, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    model = CausalLM()
    plan = dlo.OffloadPlan(block_lists=("layers",))
    assert with_single_blocks(model, plan, 1).block_lists == ("layers",)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied: both stream
    assert with_single_blocks(model, plan, 1).block_lists == ("embed_tokens", "lm_head", "layers")


def test_an_encoder_disabled_by_hand_leaves_the_pipeline_running(tiny_flux_dir):
    expected = run(plain_pipeline(tiny_flux_dir), "flux")
    pipe = plain_pipeline(tiny_flux_dir)
    config = budget_config(2**30)
    with dlo.enable_pipeline(pipe, "cpu", config, size=size_of("flux"), reserve_gib=1e6, components=["text_encoder"]) as handle:
        assert "text_encoder" in handle.plan.released
        handle.handles["text_encoder"].disable()  # a plain module on the CPU again
        assert np.array_equal(run(pipe, "flux"), expected)


def test_release_slots_gives_the_slot_memory_back_and_the_next_call_takes_it_again():
    from dlo.models.tiny import TINY_MODELS

    entry = TINY_MODELS["flux"]
    reference = entry.build(seed=1)
    streamed = entry.build(seed=1)
    with torch.inference_mode():
        expected = reference(**entry.inputs(0))[0]
    with dlo.enable(streamed, "cpu") as handle, torch.inference_mode():
        held = sum(slot_bytes(handle))
        assert handle.release_slots() == held > 0 and not any(slot_bytes(handle))
        assert handle.release_slots() == 0  # nothing left to give back
        assert torch.equal(streamed(**entry.inputs(0))[0], expected)
        assert any(slot_bytes(handle))
    with pytest.raises(dlo.StreamingError, match=r"^handle.release_slots\(\): the handle is disabled"):
        handle.release_slots()
    with dlo.enable(entry.build(seed=1), "cpu", dlo.OffloadConfig(use_allgather=True)) as gathered:
        with pytest.raises(dlo.StreamingError, match=r"^handle.release_slots\(\): in all-gather mode .* rank-local mode"):
            gathered.release_slots()


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_interrupts_at_random_instants_of_a_pipeline_call_with_released_encoders_never_leave_a_wrong_output(
    tiny_flux_dir, tiny_wan_dir, monkeypatch, name
):
    """An alarm raising KeyboardInterrupt at a random instant of a pipeline call (8 times), the
    encoders' embeddings streamed, their slots given back at each transformer call (Wan's
    encoder runs twice between two of them): after each caught interrupt, a whole call equals
    the plain pipeline."""
    import random
    import signal
    import time

    import dlo.backend.pipeline as pipeline

    monkeypatch.setattr(pipeline, "SINGLE_BLOCK_BYTES", 1)
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name]
    expected = run(plain_pipeline(directory), name)
    pipe = plain_pipeline(directory)
    pipe.set_progress_bar_config(disable=True)  # an alarm inside tqdm can leave its lock held: tests/conftest.py
    rng = random.Random(0)

    def alarm(sig, frame):
        raise KeyboardInterrupt("alarm")

    config = budget_config(2**30)
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with dlo.enable_pipeline(pipe, "cpu", config, size=size_of(name), reserve_gib=1e6, components=["text_encoder"]) as handle:
            assert "text_encoder" in handle.plan.released
            run(pipe, name)  # the first call learns the order
            started = time.perf_counter()
            run(pipe, name)
            call_s = time.perf_counter() - started
            interrupted = attempts = 0
            while interrupted < 8 and attempts < 100:  # an alarm may come after its call
                attempts += 1
                try:  # an alarm firing after the call returned, before it is disarmed, is caught here too
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, call_s))
                    try:
                        run(pipe, name)
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except KeyboardInterrupt:
                    interrupted += 1
                assert np.array_equal(run(pipe, name), expected)
            assert interrupted >= 8
    finally:
        signal.signal(signal.SIGALRM, previous)


# The command line: dlo generate and dlo inspect with --hbm-budget-gib.


def generate_argv(directory, out, budget_gib):
    d = GENERATE_DEFAULTS["flux"]
    return [
        "generate", str(directory), "--prompt", "a red cube", "--device", "cpu", "--output", str(out), "--steps", "2",
        "--height", str(d["height"]), "--width", str(d["width"]), "--max-sequence-length", str(d["max_sequence_length"]),
        "--guidance", str(d["guidance_scale"]), "--resident", "auto", "--hbm-budget-gib", str(budget_gib),
    ]


def test_generate_under_a_budget_prints_its_plan_and_writes_the_plain_pipelines_image(tiny_flux_dir, tmp_path, capsys):
    from PIL import Image

    from dlo.cli.main import main

    out = tmp_path / "cube.png"
    assert main(generate_argv(tiny_flux_dir, out, 0.01)) == 0
    printed = capsys.readouterr().out
    assert "pipeline plan (--hbm-budget-gib):\n  transformer: streamed\n" in printed
    assert "VAE decode: whole" in printed
    expected = run(plain_pipeline(tiny_flux_dir), "flux")
    assert np.array_equal(np.asarray(Image.open(out)), expected)


def test_generate_refuses_a_budget_below_the_pipelines_minimum_before_loading(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    import dlo.cli.generate_job as generate_job
    from dlo.cli.main import main

    def loaded(*args, **kwargs):
        raise AssertionError("a weight was loaded before the budget was checked")

    monkeypatch.setattr(generate_job, "load_pipeline", loaded)
    # Above what the transformer alone needs to stream, below the pipeline's weights plus its decode.
    assert main(generate_argv(tiny_flux_dir, tmp_path / "x.png", 0.0015)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("dlo: error: --hbm-budget-gib 0.001 is below the ") and "raise --hbm-budget-gib" in err


def test_inspect_shows_the_pipeline_plan_for_a_budget(tiny_flux_dir, capsys):
    from dlo.cli.main import main

    assert main(["inspect", str(tiny_flux_dir), "--resident", "auto", "--hbm-budget-gib", "4"]) == 0
    printed = capsys.readouterr().out
    assert "pipeline budget:      4.00 GiB for a 1024x1024 call\n  transformer: streamed" in printed
    assert "VAE decode: whole" in printed
    assert main(["inspect", "flux", "--resident", "auto", "--hbm-budget-gib", "4"]) == 0
    assert "pipeline budget:      not applicable: flux is not a pipeline directory" in capsys.readouterr().out


def test_serve_refuses_a_budget_below_the_pipelines_minimum_before_any_replica_starts(tiny_flux_dir, capsys, monkeypatch):
    import dlo.serve.server as server
    from dlo.cli.main import main

    def started(*args, **kwargs):
        raise AssertionError("the server started before the budget was checked")

    monkeypatch.setattr(server, "serve", started)
    # Planned for FluxPipeline's default 1024x1024: the tiny VAE's whole decode alone needs more.
    argv = ["serve", str(tiny_flux_dir), "--device", "cpu", "--resident", "auto", "--hbm-budget-gib", "0.01"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dlo: error: --hbm-budget-gib 0.010 is below the ")
