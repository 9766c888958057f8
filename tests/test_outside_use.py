"""Blocks whose parts run outside the block's own call: streamed only where that is exact.
See [Note: blocks used outside their call]."""

import logging

import pytest
import torch
from torch import nn

import dlo


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class PairsThenBlocks(nn.Module):
    """ConsisID's shape: `layers` lists pairs that the parent unpacks, so no listed item ever
    runs as a module; `blocks` is an ordinary list of blocks."""

    def __init__(self, pairs=3, blocks=3):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.ModuleList([Attn(), FeedForward()]) for _ in range(pairs)])
        self.blocks = nn.ModuleList([FeedForward() for _ in range(blocks)])

    def forward(self, x):
        x = self.inp(x)
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        for block in self.blocks:
            x = block(x) + x
        return x


def _calls(model, inputs):
    with torch.inference_mode():
        return [model(x) for x in inputs]


def test_lists_of_unpacked_pairs_are_not_discovered_as_blocks():
    assert dlo.discover(PairsThenBlocks()).block_lists == ("blocks",)


def test_a_model_with_unpacked_pairs_streams_its_real_blocks_bit_identically():
    torch.manual_seed(0)
    model = PairsThenBlocks()
    inputs = [torch.randn(2, 8) for _ in range(3)]
    expected = _calls(model, inputs)
    with dlo.enable(model, "cpu") as handle:
        assert all(torch.equal(a, b) for a, b in zip(_calls(model, inputs), expected))
        assert handle.stats().streamed_blocks == 3 and handle.stats().resident_blocks == 0


def test_a_plan_naming_unpacked_pairs_keeps_them_resident_from_the_first_call(caplog):
    """Forced through a user plan, the pairs' parts run while their 'block' is not running:
    each is promoted when that happens, so even the first call is exact."""
    torch.manual_seed(1)
    model = PairsThenBlocks()
    inputs = [torch.randn(2, 8) for _ in range(3)]
    expected = _calls(model, inputs)
    plan = dlo.OffloadPlan(block_lists=("layers", "blocks"))
    with caplog.at_level(logging.WARNING, logger="dlo"), dlo.enable(model, "cpu", plan=plan) as handle:
        assert all(torch.equal(a, b) for a, b in zip(_calls(model, inputs), expected))
        stats = handle.stats()
    assert stats.resident_blocks == 3 and stats.streamed_blocks == 3  # of 6: the pairs are resident now
    assert "layers.0.0 ran outside the call of its block 'layers.0'" in caplog.text
    # Only the real blocks cross: three calls of three, and the next call's first one prefetched.
    block_bytes = sum(dlo.planning.block_layout.align_up(t.numel() * 4) for t in model.blocks[0].parameters())
    assert stats.copies == 3 * 3 + 1 and stats.bytes_streamed == stats.copies * block_bytes


def test_dit_using_its_first_block_after_the_loop_matches_resident(caplog):
    """DiTTransformer2DModel computes transformer_blocks[0].norm1.emb(...) after its loop."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(2)
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=3, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10,
    ).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.copy_(torch.randn(tensor.shape) * 0.05)
    inputs = [
        dict(hidden_states=torch.randn(1, 4, 8, 8), timestep=torch.tensor([t]), class_labels=torch.tensor([c]))
        for t, c in ((10, 1), (500, 7))
    ]
    with torch.inference_mode():
        expected = [model(**kw).sample for kw in inputs]
    with caplog.at_level(logging.WARNING, logger="dlo"), dlo.enable(model, "cpu") as handle:
        with torch.inference_mode():
            got = [model(**kw).sample for kw in inputs]
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert "transformer_blocks.0.norm1" in caplog.text and stats.resident_blocks == 1
    with torch.inference_mode():  # after disable(): a plain module with its weights
        assert torch.equal(model(**inputs[0]).sample, expected[0])


def test_a_block_first_used_outside_its_call_in_a_later_call_is_promoted_then():
    """The probe stays: a path that reaches into a block only on the third call is served."""

    class SometimesReaching(PairsThenBlocks):
        reach = False

        def forward(self, x):
            x = super().forward(x)
            return self.blocks[1].up(x)[..., :8] + x if self.reach else x

    torch.manual_seed(3)
    model = SometimesReaching()
    x = torch.randn(2, 8)
    model.reach = True
    expected_reaching = _calls(model, [x])[0]
    model.reach = False
    expected = _calls(model, [x])[0]
    with dlo.enable(model, "cpu") as handle:
        assert all(torch.equal(out, expected) for out in _calls(model, [x, x]))
        assert handle.stats().resident_blocks == 0
        model.reach = True
        assert torch.equal(_calls(model, [x])[0], expected_reaching)
        assert handle.stats().resident_blocks == 1


def test_a_failed_promotion_changes_nothing_and_a_later_one_succeeds(monkeypatch):
    """The device runs out of memory for the promoted copy: that call fails, the block keeps
    streaming, and the next call promotes it and matches resident."""
    from dlo.hotpath import rank_local as runtime_module

    class Reaching(PairsThenBlocks):
        def forward(self, x):
            x = super().forward(x)
            return self.blocks[1].up(x)[..., :8] + x

    torch.manual_seed(4)
    model = Reaching()
    x = torch.randn(2, 8)
    expected = _calls(model, [x])[0]
    real = runtime_module.aligned_empty
    failures = []

    def out_of_memory_once(nbytes, device, *args):
        if not failures:
            failures.append(nbytes)
            raise torch.OutOfMemoryError("fake device out of memory")
        return real(nbytes, device, *args)

    monkeypatch.setattr(runtime_module, "aligned_empty", out_of_memory_once)
    with dlo.enable(model, "cpu") as handle:
        with pytest.raises(torch.OutOfMemoryError):
            _calls(model, [x])
        assert handle.stats().resident_blocks == 0 and not handle._runtime.planner.is_resident(1)
        assert torch.equal(_calls(model, [x])[0], expected)
        assert handle.stats().resident_blocks == 1


def test_a_submodule_shared_by_every_block_is_not_probed():
    """One activation module reached from every block holds no weights: nothing to promote."""
    torch.manual_seed(5)
    model = PairsThenBlocks()
    act = nn.GELU()
    for block in model.blocks:
        block.act = act  # registered in every block, called by none of them here
    x = torch.randn(2, 8)
    expected = _calls(model, [x])[0]
    with dlo.enable(model, "cpu") as handle:
        act(x)  # outside every block's call
        assert torch.equal(_calls(model, [x])[0], expected)
        assert handle.stats().resident_blocks == 0
    assert len(act._forward_pre_hooks) == 0
