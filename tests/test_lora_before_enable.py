"""A LoRA loaded before `dlo.enable` (PEFT adapters inside the blocks, as diffusers'
`load_lora_weights` makes them) streams with its blocks, bit-identical to the same model
resident; with fp8 streaming, `fp8_skip` keeps the adapters' weights as they are. The LoRA guide
(docs/guides/lora.md) relies on both."""

import copy

import torch
from peft import LoraConfig  # a test dependency (pyproject [test])

import dlo
from dlo.models.tiny import TINY_MODELS


def _lora_flux() -> torch.nn.Module:
    model = TINY_MODELS["flux"].build(seed=0)
    # init_lora_weights=False: lora_B random too, so the adapters change every output.
    model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    return model


def test_a_lora_added_before_enable_streams_bit_identical_to_resident():
    model = _lora_flux()
    resident = copy.deepcopy(model)
    inputs = TINY_MODELS["flux"].inputs(seed=1)
    with torch.inference_mode():
        expected = resident(**inputs)[0]
        resident.disable_adapters()
        without_lora = resident(**inputs)[0]
    assert not torch.equal(expected, without_lora)  # the adapters matter
    with dlo.enable(model, "cpu") as handle, torch.inference_mode():
        assert torch.equal(model(**inputs)[0], expected)
        assert handle.stats().streamed_blocks == 5


def test_fp8_skip_keeps_the_lora_weights_in_their_dtype():
    model = _lora_flux()
    lora = {name: tensor.clone() for name, tensor in model.named_parameters() if "lora_" in name}
    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_skip=("lora_",))
    with dlo.enable(model, "cpu", config) as handle:
        assert handle.stats().host_bytes_by_dtype["float8_e4m3fn"] > 0
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], tensor) for name, tensor in lora.items())
