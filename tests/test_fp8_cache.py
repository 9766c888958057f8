"""The host weight cache with stream_dtype: the first load publishes a float8 entry, every
other load maps it, and streaming from it equals the quantized model run resident. See
[Note: fp8 streaming]"""

import json
import logging

import pytest
import torch
from safetensors import safe_open

import dlo
from dlo.host.cache.identity import without_content
from dlo.host.cache.manifest import MANIFEST
from dlo.models.tiny import TINY_MODELS

pytest.importorskip("diffusers")


def outputs(model, seeds=(1, 2)):
    with torch.inference_mode():
        return [model(**TINY_MODELS["wan"].inputs(seed))[0] for seed in seeds]


def cached(tmp_path, **fields):
    return dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), **fields)


def entry_dtypes(tmp_path):
    """key -> {tensor name: dtype} of every published entry, read from its files."""
    found = {}
    for entry in sorted((tmp_path / "cache" / "v1").iterdir()):
        dtypes = {}
        for path in entry.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                dtypes.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
        found[entry.name] = dtypes
    return found


def record_landings(patch):
    """The sources of each float8 load's copies (one list per load)."""
    from dlo.hotpath.executors import CpuExecutor

    loads = []
    run = CpuExecutor.run

    def record(self, load):
        if load.finish is not None:
            loads.append([task.source for task in load.copies(0)])
        return run(self, load)

    patch.setattr(CpuExecutor, "run", record)
    return loads


def test_the_cache_publishes_float8_weights_once_and_every_load_maps_them(tmp_path, caplog, monkeypatch, driver):
    """Registered (the fake driver): every load copies straight from the entry's pages."""
    directory = tmp_path / "wan"
    model = TINY_MODELS["wan"].build(seed=2)
    model.save_pretrained(directory)
    config = cached(tmp_path, stream_dtype="fp8")
    dlo.quantize_resident(model, config)
    expected = outputs(model)
    for warm in (False, True):
        with caplog.at_level(logging.INFO):
            loaded, plan = dlo.load_transformer(directory, config)
        assert any("warm start" in r.getMessage() for r in caplog.records) == warm
        caplog.clear()
        with monkeypatch.context() as patch:
            loads = record_landings(patch)
            with dlo.enable(loaded, "cpu", config, plan=plan) as handle:
                got = outputs(loaded)
                stats = handle.stats()
                copies = [len(sources) for sources in loads]
                mapped = all(handle._checkpoint.holds(source) for sources in loads for source in sources)
                loads.clear()  # views of the mapping must not outlive it
        # Each load is one copy out of the entry's pages: the entry holds the block's float8
        # image as it lands. See [Note: one copy per block]
        assert mapped and len(copies) == stats.copies and set(copies) == {1}
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        assert stats.host_bytes == 0 and stats.host_bytes_by_dtype["float8_e4m3fn"] > 0
    (dtypes,) = entry_dtypes(tmp_path).values()
    assert dtypes["blocks.0.attn1.to_q.weight"] == "F8_E4M3" and dtypes["blocks.0.attn1.to_q.weight_scale"] == "F32"
    assert dtypes["blocks.0.attn1.to_q.bias"] == "F32" and dtypes["proj_out.weight"] == "F32"


def test_the_stream_format_is_part_of_the_entry_identity(tmp_path, caplog):
    """Each format's load identity is its own (the content differs anyway: the identities must
    too, or one format's warm start would find the other's entry and load cold)."""
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=2).save_pretrained(directory)
    with caplog.at_level(logging.WARNING):
        for fields in (dict(stream_dtype="fp8"), dict(stream_dtype="fp8", fp8_scale="per_tensor"), {}):
            dlo.load_transformer(directory, cached(tmp_path, **fields))
    assert "not warm-starting" not in caplog.text
    scales = sorted(d.get("blocks.0.attn1.to_q.weight_scale", "-") for d in entry_dtypes(tmp_path).values())
    assert len(scales) == 3 and scales.count("F32") == 2 and scales.count("-") == 1
    manifests = [json.loads((entry / MANIFEST).read_text()) for entry in (tmp_path / "cache" / "v1").iterdir()]
    loads = {json.dumps(without_content(manifest["identity"]), sort_keys=True) for manifest in manifests}
    assert len(loads) == 3


def test_resident_blocks_of_a_float8_entry_hold_the_dequantized_weights(tmp_path):
    """The entry serves any resident_layers: it holds every block's weights as float8."""
    directory = tmp_path / "wan"
    model = TINY_MODELS["wan"].build(seed=2)
    model.save_pretrained(directory)
    config = cached(tmp_path, stream_dtype="fp8", resident_layers=1)
    dlo.quantize_resident(model, cached(tmp_path, stream_dtype="fp8"))  # every block, as the entry
    expected = outputs(model)
    loaded, plan = dlo.load_transformer(directory, config)
    with dlo.enable(loaded, "cpu", config, plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, outputs(loaded)))
