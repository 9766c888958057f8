"""Streamed runs are bit-identical to the same model fully resident (docs/design.md)."""

import pytest
import torch

import dlo

MODELS = ["wan", "flux", "flux2", "sd3", "qwenimage", "hunyuanvideo", "cogvideox", "ltx"]


def outputs(model, entry, seeds, dtype=torch.float32):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, dtype))[0] for seed in seeds]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("num_slots", "resident_layers"), [(2, 0), (3, 0), (2, 1), (3, 2)])
def test_streamed_matches_resident_over_consecutive_calls(tiny_pair, name, num_slots, resident_layers):
    reference, streamed, entry = tiny_pair(name)
    config = dlo.OffloadConfig(num_slots=num_slots, resident_layers=resident_layers)
    seeds = [1, 2, 3]
    expected = outputs(reference, entry, seeds)
    with dlo.enable(streamed, "cpu", config) as handle:
        got = outputs(streamed, entry, seeds)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.resident_blocks == resident_layers
    blocks = stats.streamed_blocks
    # Every call copies every block, and the ring's last prefetches (num_slots - 1) load the
    # next call's first blocks; blocks that fit in the slots all at once are copied once.
    assert stats.copies == (blocks if blocks <= num_slots else blocks * len(seeds) + num_slots - 1)
    assert stats.demand_loads == 1  # the very first block only: the ring predicted the rest


def test_bf16_streamed_matches_resident(tiny_pair):
    reference, streamed, entry = tiny_pair("flux", dtype=torch.bfloat16)
    expected = outputs(reference, entry, [5], torch.bfloat16)
    with dlo.enable(streamed, "cpu"):
        assert torch.equal(outputs(streamed, entry, [5], torch.bfloat16)[0], expected[0])


def test_skipped_blocks_between_calls_stay_correct(tiny_pair):
    """SD3's skip_layers changes the path from call to call; no stale slot is ever used."""
    reference, streamed, entry = tiny_pair("sd3")
    calls = [None, [1], [1], None, [0, 2], None]

    def run(model):
        with torch.inference_mode():
            return [model(**entry.inputs(i), skip_layers=skip)[0] for i, skip in enumerate(calls)]

    expected = run(reference)
    with dlo.enable(streamed, "cpu") as handle:
        got = run(streamed)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.demand_loads > 1  # the changed paths were detected and loaded on demand


def test_block_called_twice_and_out_of_order(tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(0))

    def run(model):
        blocks = model.blocks
        with torch.inference_mode():
            temb = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(1))
            context = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(2))
            rope = model.rope(torch.zeros(1, 4, 2, 8, 10))
            hidden = x
            for index in (0, 0, 3, 1, 2, 2, 0):
                hidden = blocks[index](hidden, context, temb, rope)
            return hidden

    with dlo.enable(streamed, "cpu"):
        assert torch.equal(run(reference), run(streamed))


def test_disable_restores_a_plain_module_and_enable_works_again(tiny_pair):
    reference, streamed, entry = tiny_pair("flux")
    expected = outputs(reference, entry, [4])[0]
    handle = dlo.enable(streamed, "cpu")
    outputs(streamed, entry, [4])
    handle.disable()
    handle.disable()  # idempotent
    assert handle.state is dlo.HandleState.DISABLED
    assert all(p.numel() > 0 for p in streamed.parameters())
    assert not streamed._forward_pre_hooks and not streamed.transformer_blocks[0]._forward_pre_hooks
    assert torch.equal(outputs(streamed, entry, [4])[0], expected)
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(num_slots=3)):
        assert torch.equal(outputs(streamed, entry, [4])[0], expected)


def test_streamed_blocks_hold_shaped_nan_stand_ins_between_calls(tiny_pair):
    """Shape, dtype and device as resident (what PEFT and diffusers' LoRA loaders read), no
    memory of their own (every stride 0), NaN to read, refusing writes."""
    reference, streamed, entry = tiny_pair("wan")
    with dlo.enable(streamed, "cpu"):
        outputs(streamed, entry, [1])
        for (name, p), ref in zip(streamed.blocks.named_parameters(), reference.blocks.parameters()):
            assert (p.shape, p.dtype, p.device) == (ref.shape, ref.dtype, ref.device), name
            assert set(p.stride()) <= {0} and bool(p.isnan().all()), name
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"), torch.no_grad():
            streamed.blocks[0].attn1.to_q.weight.mul_(0.5)
        assert not any(bool(p.isnan().any()) for p in streamed.proj_out.parameters())  # resident: its own


def test_all_blocks_resident_streams_nothing(tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(resident_layers=4)) as handle:
        assert torch.equal(outputs(streamed, entry, [3])[0], outputs(reference, entry, [3])[0])
        assert handle.stats().copies == 0
