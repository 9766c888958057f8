"""Token embeddings that look their rows up in their host copy instead of crossing the link.
See [Note: token embeddings looked up on the host] in dlo.hotpath.runtime."""

import copy

import pytest
import torch
from torch import nn
from transformers import T5Config, T5EncoderModel

import dlo
from dlo.planning.offload_plan import with_single_blocks

EMBEDDING = "encoder.embed_tokens"
PLAN = dlo.OffloadPlan(block_lists=(EMBEDDING, "encoder.block"), host_lookups=(EMBEDDING,))


def t5_encoder(seed=0):
    torch.manual_seed(seed)
    config = T5Config(vocab_size=320, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4)
    return T5EncoderModel(config).eval()


def encode(model, seed=0):
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return model(ids).last_hidden_state


def host_image(handle):
    source = handle._runtime.blocks[0].source
    return source.host.tensor


def test_an_embedding_looked_up_on_the_host_equals_resident_and_never_crosses_the_link():
    reference = t5_encoder()
    model = copy.deepcopy(reference)
    with dlo.enable(model, "cpu", plan=PLAN) as handle:
        weight = model.get_submodule(EMBEDDING).weight
        image = host_image(handle)
        seen = []  # inside its call the weight is a view of the block's host copy, not a slot
        model.get_submodule(EMBEDDING).register_forward_hook(
            lambda module, args, out: seen.append(
                (module.weight.data_ptr() - image.data_ptr(), module.weight.stride(), args[0].device)
            )
        )
        runtime = handle._runtime
        link = sum(runtime.loads.link_bytes(i) for i in range(1, len(runtime.blocks)))
        for seed in range(3):
            before = handle.stats().bytes_streamed
            assert torch.equal(encode(model, seed), encode(reference, seed))
            copied = handle.stats().bytes_streamed - before
            # Every layer once a call (the first also prefetches the next call's first), the embedding never.
            assert copied == link if seed else link < copied < link + weight.numel() * weight.element_size()
        assert weight.stride() == (0, 0)  # a stand-in between calls
        assert all(0 <= offset < image.numel() and stride == (32, 1) for offset, stride, _ in seen)
        assert len(seen) == 3
        slots = [queue.state.size for queue in runtime.queues]
        assert max(slots) < weight.numel() * weight.element_size()  # the slots are sized for the layers
    assert torch.equal(encode(model), encode(reference))  # disable() gives the weights back
    assert model.get_submodule(EMBEDDING).weight.stride() == (32, 1)


def test_a_tied_alias_that_runs_promotes_the_embedding_which_then_runs_on_the_device(caplog):
    """T5's `shared` holds the embedding's weight: run on its own, it promotes the block, and
    the stack's own lookups then read that memory."""
    reference = t5_encoder()
    model = copy.deepcopy(reference)
    ids = torch.tensor([[1, 5, 7]])
    with dlo.enable(model, "cpu", plan=PLAN) as handle, torch.inference_mode():
        assert torch.equal(encode(model), encode(reference))
        assert torch.equal(model.shared(ids), reference.shared(ids))
        assert 0 in handle._runtime.promoted
        assert torch.equal(encode(model, 1), encode(reference, 1))
    assert "shared ran outside the call of its block 'encoder.embed_tokens'" in caplog.text


def test_an_edited_embedding_is_looked_up_from_its_rewritten_host_copy():
    reference = t5_encoder()
    model = copy.deepcopy(reference)

    def edit(encoder):
        with torch.no_grad():
            encoder.get_submodule(EMBEDDING).weight[3:9].mul_(-2.0)

    with dlo.enable(model, "cpu", plan=PLAN) as handle:
        encode(model)
        edit(reference)
        with handle.editing(model.get_submodule(EMBEDDING)):
            edit(model)
        assert handle.stats().rewritten_blocks == 1
        assert not handle._runtime.promoted  # closed: it looks up on the host again
        for seed in range(2):
            assert torch.equal(encode(model, seed), encode(reference, seed))


def test_an_interrupt_inside_the_lookup_leaves_the_next_calls_exact():
    reference = t5_encoder()
    model = copy.deepcopy(reference)

    def interrupt(module, args):
        raise KeyboardInterrupt("inside the lookup")

    with dlo.enable(model, "cpu", plan=PLAN) as handle:
        hook = model.get_submodule(EMBEDDING).register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            encode(model)
        hook.remove()
        # The weight is a stand-in again (not refused as changed), and nothing counts as running.
        assert model.get_submodule(EMBEDDING).weight.stride() == (0, 0)
        assert not handle._runtime.is_running(0)
        for seed in range(2):
            assert torch.equal(encode(model, seed), encode(reference, seed))


def test_host_lookups_that_cannot_be_served_are_refused_before_anything_changes():
    model = t5_encoder()
    weight = model.get_submodule(EMBEDDING).weight
    with pytest.raises(dlo.DiscoveryError, match=r"host_lookups names \['encoder.final_layer_norm'\] which are not in"):
        dlo.OffloadPlan(block_lists=(EMBEDDING, "encoder.block"), host_lookups=("encoder.final_layer_norm",))
    norm = dlo.OffloadPlan(
        block_lists=("encoder.final_layer_norm", "encoder.block"), host_lookups=("encoder.final_layer_norm",)
    )
    with pytest.raises(dlo.DiscoveryError, match="T5LayerNorm in T5EncoderModel: only a plain nn.Embedding"):
        dlo.enable(model, "cpu", plan=norm)
    model.get_submodule(EMBEDDING).max_norm = 1.0  # a lookup that rewrites the rows it reads
    with pytest.raises(dlo.DiscoveryError, match="only a plain nn.Embedding without max_norm"):
        dlo.enable(model, "cpu", plan=PLAN)
    model.get_submodule(EMBEDDING).max_norm = None
    with pytest.raises(dlo.ConfigError, match="not in all-gather mode's shards; leave them out of host_lookups"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True), plan=PLAN)
    assert model.get_submodule(EMBEDDING).weight is weight and weight.stride() == (32, 1)
    with dlo.enable(model, "cpu", plan=PLAN):  # nothing was left managed
        pass


def test_a_subclassed_embedding_with_a_forward_of_its_own_is_not_looked_up_on_the_host():
    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2

    model = t5_encoder()
    model.encoder.embed_tokens = Scaled(320, 32)
    plan = with_single_blocks(model, dlo.OffloadPlan(block_lists=("encoder.block",)), 1)
    assert EMBEDDING in plan.block_lists and EMBEDDING not in plan.host_lookups
    assert "shared" in plan.host_lookups  # no longer tied to the stack's embedding: a plain one of its own


def llama_encoder():  # HunyuanVideo's text encoder class
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaModel(config).eval()


def qwen_vl_encoder():  # Qwen-Image's text encoder class: its vision tower streams too
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                  fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=0, eos_token_id=1)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("build, embedding", [(llama_encoder, "embed_tokens"),
                                               (qwen_vl_encoder, "model.language_model.embed_tokens")])
def test_decoder_only_text_encoders_stream_under_the_budgets_plan_equal_to_resident(build, embedding):
    """The Llama and Qwen2.5-VL encoders diffusers' pipelines use, planned as a pipeline budget
    plans an encoder (its large non-block modules as blocks of their own): the embedding looks
    its rows up on the host, and every hidden state the pipelines read equals resident."""
    from dlo.planning.offload_plan import discover

    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    plan = with_single_blocks(model, discover(model), 1)
    assert embedding in plan.host_lookups

    def hidden_states(encoder, seed):
        ids = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            return encoder(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states

    with dlo.enable(model, "cpu", plan=plan):
        for seed in range(2):
            got, want = hidden_states(model, seed), hidden_states(reference, seed)
            assert len(got) == len(want) == 4 and all(map(torch.equal, got, want))


def test_a_ctrl_c_held_while_the_embedding_starts_leaves_a_stand_in_between_calls(monkeypatch):
    """A SIGINT arriving while the lookup's start holds signals fires as that step ends: the
    call raises KeyboardInterrupt and, between calls, the embedding is a stand-in again, never
    a view of its host copy (an edit would then change the only copy it is looked up from)."""
    import signal

    from dlo.hotpath.runtime import StreamingRuntime

    reference = t5_encoder()
    model = copy.deepcopy(reference)
    real, fire = StreamingRuntime._start_on_host, []

    def interrupted(self, index):
        if fire:
            fire.pop()
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, delivered while the step holds it
        return real(self, index)

    monkeypatch.setattr(StreamingRuntime, "_start_on_host", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # pytest-xdist's workers ignore it
    try:
        check_a_ctrl_c_at_the_start(model, reference, fire)
    finally:
        signal.signal(signal.SIGINT, previous)


def check_a_ctrl_c_at_the_start(model, reference, fire):
    with dlo.enable(model, "cpu", plan=PLAN) as handle:
        encode(model)
        fire.append(True)
        with pytest.raises(KeyboardInterrupt):
            encode(model)
        assert model.get_submodule(EMBEDDING).weight.stride() == (0, 0)
        assert not any(map(handle._runtime.is_running, range(len(handle._runtime.blocks))))
        assert torch.equal(encode(model, 1), encode(reference, 1))
