"""The call rules: what a pipeline accepts, read from its directory's configs, checked by a pure function."""

import pytest

from dlo.pipelines.call_rules import CallRequest, CallRuleError, CallRules, read_call_rules, tokens, validate_call

# Wan-shaped rules written out: VAE scale 8 x patch 2, 4k+1 frames, 512 text tokens, 480x832x81 default.
WAN = CallRules("WanPipeline", spatial_multiple=16, temporal_multiple=4, max_sequence_length=512, vae_channels=96,
                default_size=(480, 832, 81))
FLUX = CallRules("FluxPipeline", spatial_multiple=16, temporal_multiple=None, max_sequence_length=512,
                 vae_channels=128, default_size=(1024, 1024, 1))
LIMIT = 2**17


def test_rules_are_read_from_the_pipeline_configs(tiny_flux_dir, tiny_wan_dir):
    import diffusers

    flux = read_call_rules(tiny_flux_dir, diffusers.FluxPipeline)
    # VAE of 4 blocks: scale 2**3 = 8; Flux packs 2x2 latents although its config says patch_size 1
    assert (flux.spatial_multiple, flux.temporal_multiple, flux.max_sequence_length) == (16, None, 512)
    assert flux.default_size == (1024, 1024, 1)  # Flux's 128 latent pixels x scale 8
    assert flux.vae_channels == 8  # the tiny VAE's block_out_channels[0]
    wan = read_call_rules(tiny_wan_dir, diffusers.WanPipeline)
    assert (wan.spatial_multiple, wan.temporal_multiple, wan.max_sequence_length) == (16, 4, 512)
    assert wan.default_size == (480, 832, 81)


def test_tokens_count_latent_patches_and_latent_frames():
    assert tokens(WAN, 480, 832, 81) == 30 * 52 * 21
    assert tokens(FLUX, 1024, 1024, 1) == 64 * 64


def test_a_valid_request_comes_back_unchanged():
    request = CallRequest(height=480, width=832, num_frames=81, max_sequence_length=512)
    assert validate_call(WAN, request, LIMIT, 2) == request
    assert validate_call(FLUX, CallRequest(), LIMIT, 2) == CallRequest()  # defaults: the pipeline's own


@pytest.mark.parametrize(
    ("rules", "request_", "field", "allowed"),
    [
        (WAN, CallRequest(height=40), "height", "WanPipeline takes positive multiples of 16 (16, 32, ...)"),
        (WAN, CallRequest(width=0), "width", "WanPipeline takes positive multiples of 16 (16, 32, ...)"),
        (FLUX, CallRequest(height=-64), "height", "FluxPipeline takes positive multiples of 16 (16, 32, ...)"),
        (WAN, CallRequest(num_frames=0), "num_frames", "WanPipeline takes 4k+1 frames (1, 5, 9, ...)"),
        (WAN, CallRequest(num_frames=80), "num_frames", "WanPipeline takes 4k+1 frames (1, 5, 9, ...)"),
        (FLUX, CallRequest(max_sequence_length=513), "max_sequence_length", "FluxPipeline takes 1 to 512"),
        (FLUX, CallRequest(max_sequence_length=0), "max_sequence_length", "FluxPipeline takes 1 to 512"),
    ],
)
def test_each_rule_refuses_with_the_allowed_values(rules, request_, field, allowed):
    with pytest.raises(CallRuleError) as refused:
        validate_call(rules, request_, LIMIT, 2)
    assert (refused.value.field, refused.value.allowed) == (field, allowed)


def test_a_size_over_the_token_limit_is_refused_with_a_memory_estimate():
    with pytest.raises(CallRuleError) as refused:
        validate_call(FLUX, CallRequest(height=100000, width=100000), LIMIT, 2)
    # 6250 x 6250 tokens; the VAE: 10**10 pixels x (128 channels x 2 bytes + 3 x 4 bytes) = 2496 GiB
    assert refused.value.field == "size" and refused.value.value == "100000x100000"
    assert "39062500 transformer tokens, over the limit of 131072" in refused.value.allowed
    assert "at least 2495.9 GiB" in refused.value.allowed
    # one side given: the other is the pipeline's default (1024): 6250 x 64 tokens
    with pytest.raises(CallRuleError, match="400000 transformer tokens"):
        validate_call(FLUX, CallRequest(height=100000), LIMIT, 2)
    # the limit is the caller's: Wan's default 480x832x81 fits 2**17, not 2**14
    with pytest.raises(CallRuleError, match="32760 transformer tokens, over the limit of 16384"):
        validate_call(WAN, CallRequest(), 2**14, 2)
