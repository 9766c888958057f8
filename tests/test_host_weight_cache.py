"""Loading through the host weight cache (docs/guides/host-weight-cache.md): one entry per node for equivalent loads,
in-place mapping that keeps Parameter objects, exact streaming, fail-closed fallbacks."""

import fcntl
import json
import logging
import os

import pytest
import safetensors.torch
import torch
from ordinary_tensors import ordinary_tensors
from torch import nn

import dlo
from dlo.host.cache.collect import collect_tensors
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.identity import build_identity, load_identity
from dlo.host.preflight import Fallback
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


def save(tmp_path, name):
    directory = tmp_path / name
    TINY_MODELS[name].build(seed=2).save_pretrained(directory)
    return directory


def cached(tmp_path, **fields):
    return dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), **fields)


def entries(tmp_path):
    root = tmp_path / "cache" / "v1"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def run(model, name, seeds=(1, 2)):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed))[0] for seed in seeds]


@pytest.mark.parametrize("name", ["wan", "flux", "sd3"])
def test_streaming_from_the_cache_matches_resident_and_keeps_parameters(tmp_path, name):
    directory = save(tmp_path, name)
    reference = getattr(diffusers, TINY_MODELS[name].class_name).from_pretrained(directory).eval()
    ordinary_tensors(reference)
    expected = run(reference, name)
    model, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert plan is not None and plan.backing == "host_weight_cache"
    parameters = {n: p for n, p in model.named_parameters()}
    with dlo.enable(model, "cpu", cached(tmp_path), plan=plan) as handle:
        got = run(model, name)
        stats = handle.stats()
        assert stats.host_bytes == 0 and stats.backing == "host_weight_cache"
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert all(p is parameters[n] for n, p in model.named_parameters())  # same objects throughout


def test_equivalent_loads_share_one_entry(tmp_path):
    directory = save(tmp_path, "flux")
    dlo.load_transformer(directory, cached(tmp_path))
    (key,) = entries(tmp_path)
    manifest = tmp_path / "cache" / "v1" / key / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    os.symlink(directory, tmp_path / "alias")  # another spelling of the same model path
    _, plan = dlo.load_transformer(tmp_path / "alias", cached(tmp_path))
    assert plan is not None and entries(tmp_path) == [key] and manifest.stat().st_mtime_ns == stamp


def test_one_changed_weight_is_a_new_entry(tmp_path):
    directory = save(tmp_path, "wan")
    dlo.load_transformer(directory, cached(tmp_path))
    path = directory / "diffusion_pytorch_model.safetensors"
    weights = safetensors.torch.load_file(path)
    weights["blocks.0.attn1.to_q.bias"][0] += 1
    safetensors.torch.save_file(weights, path, metadata={"format": "pt"})
    dlo.load_transformer(directory, cached(tmp_path))
    assert len(entries(tmp_path)) == 2


def test_identity_splits_on_tp_coordinates_and_sp_size_but_not_dp_or_sp_rank(tmp_path):
    directory = save(tmp_path, "wan")

    def key(**topology):
        load = load_identity(directory, nn.Linear, {}, "bf16", {}, dlo.Topology(**topology))
        return build_identity(load, "c0ffee", {})[1]

    base = key()
    assert key(dp_size=4, dp_rank=3) == base and key(sp_size=2, sp_rank=1) == key(sp_size=2, sp_rank=0)
    assert len({base, key(tp_size=2, tp_rank=0), key(tp_size=2, tp_rank=1), key(sp_size=2)}) == 4


def fallback_codes(caplog):
    return [r.dlo_fallback for r in caplog.records if hasattr(r, "dlo_fallback")]


@pytest.mark.parametrize(
    ("topology", "code"),
    [
        (dict(hsdp=True), "unsupported_hsdp"),
        (dict(ep_size=2), "unsupported_expert_parallel"),
        (dict(pp_size=2), "unsupported_pp"),
        (dict(cfg_size=2), "unsupported_cfg_parallel"),
    ],
)
def test_unsupported_layouts_fail_closed_and_write_nothing(tmp_path, caplog, topology, code):
    directory = save(tmp_path, "wan")
    with caplog.at_level(logging.WARNING):
        model, plan = dlo.load_transformer(directory, cached(tmp_path), topology=dlo.Topology(**topology))
    assert plan is None and fallback_codes(caplog) == [code] and entries(tmp_path) == []
    assert all(p.numel() > 0 and p.is_contiguous() for p in model.parameters())  # ordinary tensors


def test_unstable_loader_inputs_fail_closed(tmp_path, caplog):
    directory = save(tmp_path, "wan")
    with caplog.at_level(logging.WARNING):
        _, plan = dlo.load_transformer(directory, cached(tmp_path), loader_inputs={"lora": {"a", "b"}})
    assert plan is None and fallback_codes(caplog) == ["unstable_identity"] and entries(tmp_path) == []


def test_a_held_lock_times_out_and_keeps_the_ordinary_tensors(tmp_path, caplog):
    directory = save(tmp_path, "wan")
    dlo.load_transformer(directory, dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "probe")))
    (key,) = os.listdir(tmp_path / "probe" / "v1")  # the key does not depend on the cache root
    (tmp_path / "cache" / ".locks").mkdir(parents=True)
    holder = os.open(tmp_path / "cache" / ".locks" / f"{key}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.WARNING):
            model, plan = dlo.load_transformer(directory, cached(tmp_path, cache_lock_timeout_s=0.3))
    finally:
        os.close(holder)
    assert plan is None and fallback_codes(caplog) == ["lock_timeout"] and entries(tmp_path) == []
    with torch.inference_mode():
        model(**TINY_MODELS["wan"].inputs(0))  # a working, ordinarily loaded model


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("break_it", "code", "reason"),
    [
        (lambda m: setattr(m.b, "weight", m.a.weight), "unsupported_alias", "shares its storage"),
        (lambda m: setattr(m.b, "weight", nn.Parameter(m.a.weight.detach().t())), "unsupported_tensor", "not contiguous"),
        (lambda m: setattr(m.b, "weight", nn.Parameter(torch.zeros(8, 4)[:4])), "unsupported_alias", "larger storage"),
        (lambda m: setattr(m.b, "weight", nn.Parameter(torch.zeros(4, 4, device="meta"))), "unsupported_tensor", "meta"),
        (lambda m: m.b.register_buffer("c", torch.zeros(2, dtype=torch.complex64)), "unsupported_tensor", "complex64"),
        (lambda m: [delattr(m, "a"), delattr(m, "b")], "unsupported_tensor", "no parameters"),
    ],
)
def test_collection_rejects_what_it_cannot_map_back(break_it, code, reason):
    model = _Pair()
    break_it(model)
    found = collect_tensors(model)
    assert isinstance(found, Fallback) and found.code == code and reason in found.reason


def test_config_rules_for_the_cache():
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(dlo.ConfigError, match="cache_lock_timeout_s must be a finite number > 0"):
            dlo.OffloadConfig(cache_lock_timeout_s=bad)
    with pytest.raises(dlo.ConfigError, match="cache_dir must be a non-empty path"):
        dlo.OffloadConfig(cache_dir="")


def warm_started(caplog):
    return any("warm start" in r.getMessage() for r in caplog.records)


def test_warm_start_maps_the_entry_without_loading(tmp_path, caplog):
    directory = save(tmp_path, "flux")
    model, plan = dlo.load_transformer(directory, cached(tmp_path))
    expected = None
    with dlo.enable(model, "cpu", cached(tmp_path), plan=plan):
        expected = run(model, "flux")
    with caplog.at_level(logging.INFO):
        model, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert warm_started(caplog) and plan.backing == "host_weight_cache"
    with dlo.enable(model, "cpu", cached(tmp_path), plan=plan):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model, "flux")))
    assert len(entries(tmp_path)) == 1


def test_a_warm_started_model_takes_load_state_dict_into_some_of_its_blocks(tmp_path, caplog):
    """Each warm-started tensor has a version counter of its own, as a cold-loaded one: as views
    of the entry's file they shared its one counter, and a load into the single blocks had the
    next call refuse every other block as if its stand-ins had been written in place."""
    directory = save(tmp_path, "flux")
    dlo.load_transformer(directory, cached(tmp_path))  # publishes the entry
    with caplog.at_level(logging.INFO):
        model, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert warm_started(caplog)
    reference = diffusers.FluxTransformer2DModel.from_pretrained(directory).eval()
    other = {k: v * 1.5 for k, v in TINY_MODELS["flux"].build(seed=3).state_dict().items() if "single" in k}
    ordinary_tensors(reference)
    reference.load_state_dict(other, strict=False)
    with dlo.enable(model, "cpu", cached(tmp_path), plan=plan):
        run(model, "flux")
        model.load_state_dict(other, strict=False)
        got = run(model, "flux")
    assert all(torch.equal(a, b) for a, b in zip(run(reference, "flux"), got))


def test_a_touched_checkpoint_is_loaded_cold_again(tmp_path, caplog):
    directory = save(tmp_path, "wan")
    dlo.load_transformer(directory, cached(tmp_path))
    os.utime(directory / "diffusion_pytorch_model.safetensors")  # same bytes, new mtime
    with caplog.at_level(logging.INFO):
        _, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert plan is not None and not warm_started(caplog)
    # The checkpoint files' identities are part of the entry's identity (a warm start can
    # only bind to what it can recompute without loading): another file, another entry.
    assert len(entries(tmp_path)) == 2


def test_a_checkpoint_rewritten_with_its_size_and_mtime_kept_is_not_warm_started(tmp_path, caplog):
    """cp -p / rsync --inplace -t: new bytes, same size and mtime; only the ctime changes."""
    from safetensors.torch import load_file, save_file

    directory = save(tmp_path, "wan")
    dlo.load_transformer(directory, cached(tmp_path))
    weights = directory / "diffusion_pytorch_model.safetensors"
    before = weights.stat()
    tensors = load_file(weights)
    tensors["blocks.0.attn1.to_q.weight"] = torch.full_like(tensors["blocks.0.attn1.to_q.weight"], 7.0)
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    with caplog.at_level(logging.INFO):
        model, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert not warm_started(caplog)
    with dlo.enable(model, "cpu", cached(tmp_path), plan=plan):
        pass
    assert torch.equal(model.blocks[0].attn1.to_q.weight, torch.full_like(model.blocks[0].attn1.to_q.weight, 7.0))


def test_a_checkpoint_of_pickled_weights_falls_back_and_its_new_weights_are_loaded(tmp_path, caplog):
    """diffusers' loader reads diffusion_pytorch_model.bin when there is no safetensors file;
    the load identity does not stamp it, so a cached load would warm-start the old weights."""
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=2).save_pretrained(directory, safe_serialization=False)
    with caplog.at_level(logging.WARNING):
        _, plan = dlo.load_transformer(directory, cached(tmp_path), torch.float32)
    assert plan is None and fallback_codes(caplog) == ["unsupported_load_format"] and entries(tmp_path) == []
    assert "safe_serialization=True" in caplog.text
    new = TINY_MODELS["wan"].build(seed=7).state_dict()
    torch.save(new, directory / "diffusion_pytorch_model.bin")  # only the weights change
    model, plan = dlo.load_transformer(directory, cached(tmp_path), torch.float32)
    loaded = model.state_dict()
    assert plan is None and sorted(loaded) == sorted(new)
    assert all(torch.equal(loaded[name], new[name]) for name in new)


def test_a_corrupted_entry_is_not_warm_started(tmp_path, caplog):
    directory = save(tmp_path, "wan")
    dlo.load_transformer(directory, cached(tmp_path))
    (key,) = entries(tmp_path)
    shard = next((tmp_path / "cache" / "v1" / key).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO):
        _, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert plan is not None and not warm_started(caplog)
    assert isinstance(EntryStore(tmp_path / "cache").validate(key), Entry)  # rebuilt


def test_a_disk_full_mid_publication_keeps_the_ordinary_tensors(tmp_path, small_filesystem, caplog):
    directory = save(tmp_path, "wan")
    # Room for the bytes, not for the files: the root, .users, .users/<key>, the hold file,
    # .locks, the lock file, .tmp, v1 and the temp dir take all 9 inodes, so creating the
    # entry's shard fails with a real ENOSPC.
    root = small_filesystem("size=128m,nr_inodes=9,mode=0700")
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(root), cache_allow_any_filesystem=True)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        model, plan = dlo.load_transformer(directory, config)
    assert plan is None and fallback_codes(caplog) == ["insufficient_disk"]
    assert not (root / "v1").exists() or not list((root / "v1").iterdir())
    assert not list((root / ".tmp").iterdir())
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    run(model, "wan", seeds=(1,))  # the ordinary tensors work


def test_a_quantized_model_fails_closed_before_its_loader_runs(tmp_path, caplog):
    directory = save(tmp_path, "wan")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (directory / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING), pytest.raises(Exception) as raised:
        dlo.load_transformer(directory, cached(tmp_path))
    # The code is logged first; then diffusers' own quantizing loader runs, which needs
    # bitsandbytes and a GPU here: its error, and no cache entry.
    assert fallback_codes(caplog) == ["unsupported_quantization"] and entries(tmp_path) == []
    assert not isinstance(raised.value, dlo.DloError)


@pytest.mark.parametrize("failure", ["tie", "rename"])
def test_a_failed_enable_leaves_private_tensors_not_views_of_a_closed_mapping(tmp_path, failure):
    # In a child process: reading an unmapped view is a segfault, which must fail this test,
    # not end the test run.
    from child_processes import child_context
    from failed_enables import failed_enable

    directory = save(tmp_path, "wan")
    reference = diffusers.WanTransformer3DModel.from_pretrained(directory).eval()
    if failure == "tie":
        reference.blocks[1].ffn.net[0].proj.bias = reference.blocks[0].ffn.net[0].proj.bias
    expected = run(reference, "wan", seeds=(1,))[0]
    out = tmp_path / "out.pt"
    args = (str(directory), str(tmp_path / "cache"), str(out), failure)
    child = child_context().Process(target=failed_enable, args=args)
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert torch.equal(torch.load(out), expected)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def overlapping_images(model, config):
    """Two tensors at one offset: the entry writer refuses them with a ValueError."""
    return [{"blocks.0.attn1.to_q.weight": 0, "blocks.0.attn1.to_k.weight": 0}]


def no_blocks(model, config):
    raise dlo.errors.DiscoveryError("no block list found")


@pytest.mark.parametrize("images", [overlapping_images, no_blocks])
def test_a_block_layout_the_cache_cannot_write_falls_back_and_keeps_no_descriptor(tmp_path, caplog, monkeypatch, images):
    from dlo.host.cache import consume

    directory = save(tmp_path, "wan")
    monkeypatch.setattr(consume, "block_images", images)
    before = open_fds()
    with caplog.at_level(logging.WARNING):
        _, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert plan is None and fallback_codes(caplog) == ["cache_operation_failed"] and entries(tmp_path) == []
    assert open_fds() == before


def test_an_entry_of_another_layout_version_is_not_used(tmp_path, monkeypatch):
    from dlo.host.cache import identity

    directory = save(tmp_path, "wan")
    with monkeypatch.context() as patched:
        patched.setattr(identity, "LAYOUT_VERSION", identity.LAYOUT_VERSION - 1)
        _, old_plan = dlo.load_transformer(directory, cached(tmp_path))
    (old,) = entries(tmp_path)
    _, plan = dlo.load_transformer(directory, cached(tmp_path))  # neither warm-started from nor joined
    assert plan is not None and len(entries(tmp_path)) == 2
    assert plan._weights.checkpoint.directory.name != old
