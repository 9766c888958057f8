"""Every checkpoint-mmap fallback code: logged with its reason, nothing mapped, and the model
loaded the ordinary way (docs/guides/checkpoints.md)."""

import json
import logging

import pytest
import safetensors.torch
import torch

import dlo
from dlo.host.checkpoint import WEIGHTS_NAME
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


@pytest.fixture
def wan_dir(tmp_path):
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=5).save_pretrained(directory)
    return directory


def fallback_codes(caplog):
    return [getattr(r, "dlo_fallback", None) for r in caplog.records if hasattr(r, "dlo_fallback")]


def assert_ordinary(model, directory):
    """A fully loaded model that computes what diffusers' own loader gives."""
    assert all(t.device.type == "cpu" and t.numel() > 0 for t in model.parameters())
    reference = diffusers.WanTransformer3DModel.from_pretrained(directory).eval()
    with torch.no_grad():
        for mine, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    ("topology", "code"),
    [(dlo.Topology(tp_size=2, tp_rank=1), "unsupported_tp"), (dlo.Topology(hsdp=True), "unsupported_hsdp")],
)
def test_topology_fallbacks(wan_dir, caplog, topology, code):
    with caplog.at_level(logging.WARNING):
        model, plan = dlo.load_transformer(wan_dir, topology=topology)
    assert plan is None and fallback_codes(caplog) == [code]
    assert_ordinary(model, wan_dir)


def test_online_quantization_falls_back_before_mapping(wan_dir, caplog):
    config = json.loads((wan_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (wan_dir / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING), pytest.raises(Exception) as raised:
        dlo.load_transformer(wan_dir)
    # dlo stepped aside with its code; what follows is diffusers' own quantizing loader, which
    # needs bitsandbytes and a GPU here: its error, not a half-mapped model.
    assert fallback_codes(caplog) == ["unsupported_online_quantization"]
    assert not isinstance(raised.value, dlo.DloError)


def test_mixed_file_with_non_transformer_tensors_falls_back(wan_dir, caplog):
    weights = safetensors.torch.load_file(wan_dir / WEIGHTS_NAME)
    weights["text_encoder.embed.weight"] = torch.ones(4, 4)
    safetensors.torch.save_file(weights, wan_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        model, plan = dlo.load_transformer(wan_dir)
    assert plan is None and fallback_codes(caplog) == ["checkpoint_plan_incompatible"]
    assert "belong to no runtime tensor" in caplog.text and "text_encoder.embed.weight" in caplog.text
    assert_ordinary(model, wan_dir)


def test_missing_block_tensor_falls_back(wan_dir, caplog):
    weights = safetensors.torch.load_file(wan_dir / WEIGHTS_NAME)
    del weights["blocks.1.ffn.net.0.proj.bias"]
    safetensors.torch.save_file(weights, wan_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        model, plan = dlo.load_transformer(wan_dir)
    assert plan is None and fallback_codes(caplog) == ["checkpoint_plan_incompatible"]
    assert "checkpoint has no 'blocks.1.ffn.net.0.proj.bias'" in caplog.text
    loaded = model.state_dict()  # the ordinary loader's model: what the file has, it loaded
    assert all(torch.equal(loaded[name], tensor) for name, tensor in weights.items())


def test_integer_checkpoint_tensor_for_a_float_parameter_falls_back(wan_dir, caplog):
    weights = safetensors.torch.load_file(wan_dir / WEIGHTS_NAME)
    weights["blocks.0.attn1.to_q.bias"] = weights["blocks.0.attn1.to_q.bias"].to(torch.int32)
    safetensors.torch.save_file(weights, wan_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        _, plan = dlo.load_transformer(wan_dir, torch_dtype=torch.float32)
    assert plan is None and fallback_codes(caplog) == ["checkpoint_plan_incompatible"]
    assert "only float casts are adapters" in caplog.text


def test_shape_mismatch_falls_back(wan_dir, caplog):
    weights = safetensors.torch.load_file(wan_dir / WEIGHTS_NAME)
    weights["blocks.2.attn2.to_k.weight"] = weights["blocks.2.attn2.to_k.weight"][:, :16].contiguous()
    safetensors.torch.save_file(weights, wan_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING), pytest.raises(Exception):
        dlo.load_transformer(wan_dir)  # the ordinary loader refuses the mismatch itself
    assert fallback_codes(caplog) == ["checkpoint_plan_incompatible"]
    assert "runtime shape [32, 32] but checkpoint has [[32, 16]]" in caplog.text


def test_corrupt_file_is_a_named_error_not_a_fallback(wan_dir):
    path = wan_dir / WEIGHTS_NAME
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(dlo.CheckpointError) as raised:
        dlo.load_transformer(wan_dir)
    assert raised.value.kind is dlo.CheckpointErrorKind.OFFSETS_INVALID
