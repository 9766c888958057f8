"""resident_layers='auto' on CUDA: the budget read from the device, the peak from the caching
allocator, promotion and new slots between calls with the copy stream running. Parity with
the resident model before and after the plan. See [Note: automatic residency]"""

import copy

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS
from dlo.planning.plan_summary import summarize
from wide_models import WAN_MB

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GIB = 2**30

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


@pytest.mark.parametrize("when", ["enable", "replace_slots"])
def test_slots_made_under_inference_mode_serve_later_no_grad_calls_on_cuda(when):
    """The copy stream's `copy_` into a slot refuses an inference tensor outside inference
    mode: slots made under it (enable() there, or replaced by automatic residency inside a
    call) must still load blocks in a later call under no_grad."""
    entry = TINY_MODELS["wan"]
    reference = entry.build(seed=0, dtype=torch.bfloat16)
    streamed = copy.deepcopy(reference)
    expected = outputs(reference.cuda(), entry, [1])
    with torch.inference_mode():
        handle = dlo.enable(streamed, "cuda")
        if when == "replace_slots":
            runtime = handle._runtime
            runtime.replace_slots(3, runtime.blocks[0].layout.nbytes)
    with handle, torch.no_grad():
        got = streamed(**entry.inputs(1, torch.bfloat16, "cuda"))[0]
    assert torch.equal(expected[0], got)
