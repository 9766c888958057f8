"""resident_layers='auto' on CUDA: the budget read from the device, the peak from the caching
allocator, promotion and new slots between calls with the copy stream running. Parity with
the resident model before and after the plan. See [Note: automatic residency]"""

import copy

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS, TinyModel, _wan_inputs
from dlo.planning.plan_summary import summarize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GIB = 2**30

# Blocks of 8.4 MB in bf16: well above the megabyte or so by which the allocator's peak moves
# from one enable() to the next, so a budget between two block counts stays between them.
WAN_MB = TinyModel(
    "wan-8mb-blocks",
    "WanTransformer3DModel",
    dict(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=64, freq_dim=64, ffn_dim=2048, num_layers=8, rope_max_seq_len=32,
    ),
    _wan_inputs(latent=(1, 4, 2, 8, 8), text=(1, 12, 64)),
)
MODELS = {"wan": WAN_MB, "flux": TINY_MODELS["flux"]}


def outputs(model, entry, seeds):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, torch.bfloat16, "cuda"))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_auto_residency_is_bit_identical_and_within_the_budget_on_cuda(name):
    entry = MODELS[name]
    reference = entry.build(seed=0, dtype=torch.bfloat16)
    streamed = copy.deepcopy(reference)
    seeds = [1, 2, 3, 4, 5]
    expected = outputs(reference.cuda(), entry, seeds)
    del reference
    torch.cuda.empty_cache()
    summary = summarize(streamed, dlo.discover(streamed))

    # No budget given: the device's free memory, where a tiny model fits whole.
    with dlo.enable(streamed, "cuda", dlo.OffloadConfig(resident_layers="auto")) as handle:
        got = outputs(streamed, entry, seeds)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.residency.state == "planned", stats.residency.note
    assert len(stats.residency.resident) == len(summary.blocks) and stats.slot_bytes == 0
    activations = stats.residency.activation_bytes

    # Room for what streaming needs, the activations measured above and about one more block.
    largest = max(b.nbytes for b in summary.blocks)
    budget = (summary.device_weight_bytes + activations + 1.5 * largest) / 0.98
    if name == "flux":  # tiny blocks (0.1 MB): the peak's drift alone is worth several
        budget += 4 * 2**20
    with dlo.enable(streamed, "cuda", dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=budget / GIB)) as handle:
        got = outputs(streamed, entry, seeds)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    residency = stats.residency
    assert residency.state == "planned", residency.note
    assert stats.peak_device_bytes <= residency.budget_bytes
    if name == "wan":
        assert 1 <= len(residency.resident) < len(summary.blocks)
