"""Eviction that never removes an entry in use, `dlo cache` commands, and trust checks."""

import gc
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import dlo
from dlo.cli.main import main
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.identity import digest_of
from dlo.host.cache.manifest import Rejection, RejectionKind
from dlo.models.tiny import TINY_MODELS

SHM = Path("/dev/shm")


def saved_wan(tmp_path):
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=2).save_pretrained(directory)
    return directory, dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"))


@pytest.fixture
def loaded(tmp_path):
    """A model loaded through the cache: its plan holds the entry until disable()."""
    directory, config = saved_wan(tmp_path)
    model, plan = dlo.load_transformer(directory, config)
    (key,) = EntryStore(config.cache_dir).keys()
    return model, plan, config, key


def test_an_entry_in_use_is_never_evicted(loaded, capsys):
    model, plan, config, key = loaded
    cache = ["--cache-dir", config.cache_dir]
    assert main(["cache", "ls", *cache]) == 0
    capsys.readouterr()
    assert main(["cache", "rm", key[:12], *cache]) == 2
    assert "in use by 1 process(es)" in capsys.readouterr().err
    assert main(["cache", "gc", "--max-size", "0", *cache]) == 1
    assert "kept" in capsys.readouterr().out
    handle = dlo.enable(model, "cpu", config, plan=plan)
    handle.disable()  # closes the mapping and releases the hold
    assert main(["cache", "gc", "--max-size", "0", *cache]) == 0
    assert EntryStore(config.cache_dir).keys() == []


def test_ls_shows_the_users(loaded, capsys):
    _, _, config, key = loaded
    assert main(["cache", "ls", "--cache-dir", config.cache_dir]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(key[:16])][0]
    assert "WanTransformer3DModel" in row and row.rstrip().endswith("1")


def test_a_plan_never_enabled_holds_the_entry_until_its_mapping_is_collected(tmp_path, caplog):
    directory, config = saved_wan(tmp_path)
    model, plan = dlo.load_transformer(directory, config)  # published, then mapped
    store = EntryStore(config.cache_dir)
    (key,) = store.keys()
    del plan
    gc.collect()
    assert store.users(key) == 1  # the model's parameters still view the entry
    del model
    gc.collect()
    assert store.users(key) == 0
    with caplog.at_level(logging.INFO, logger="dlo"):
        model, plan = dlo.load_transformer(directory, config)
    assert "warm start from cache entry" in caplog.text and store.users(key) == 1
    del model, plan
    gc.collect()
    assert store.users(key) == 0 and store.evict(key)


def publish(store, name, tensors):
    """Publish `tensors` under the key of an identity named `name` (a key is its identity's digest)."""
    key = digest_of({"name": name})
    store.publish(key, tensors, {"name": name})
    return key


def test_rm_force_waits_for_the_last_user(tmp_path, capsys):
    store = EntryStore(tmp_path)
    key = publish(store, "busy", {"w": torch.ones(4)})
    fd = store.hold(key)
    threading.Timer(0.5, os.close, args=(fd,)).start()
    started = time.monotonic()
    assert main(["cache", "rm", key[:8], "--force", "--timeout", "30", "--cache-dir", str(tmp_path)]) == 0
    assert time.monotonic() - started >= 0.4 and store.keys() == []


def test_verify_reports_a_corrupted_entry(tmp_path, capsys):
    store = EntryStore(tmp_path)
    entry = store.validate(publish(store, "verified", {"w": torch.ones(1024)}))
    shard = next(entry.path.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    key = entry.path.name[:16]
    assert line.startswith(f"{key}  BAD  ") and "does not hash to its manifest digest" in line
    assert line.endswith(f"; remove it: dlo cache rm {key} (the next load that uses it publishes it again)")


def _refused_and_rebuilt(root, tamper, reason):
    store = EntryStore(root)
    key = publish(store, "tampered", {"w": torch.ones(8)})
    tamper(store.entry_path(key))
    found = store.validate(key)
    assert isinstance(found, Rejection) and found.kind is RejectionKind.UNTRUSTED and reason in found.detail
    publish(store, "tampered", {"w": torch.ones(8)})  # moved aside under the lock, rebuilt
    assert isinstance(store.validate(key), Entry)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda p: os.chmod(p, 0o775), "writable by group or others"),
        (lambda p: os.chmod(next(p.glob("*.safetensors")), 0o666), "writable by group or others"),
        (lambda p: (p / "link.safetensors").symlink_to(next(p.glob("*.safetensors"))), "is a symlink"),
    ],
)
def test_untrusted_entries_are_refused_and_rebuilt(tmp_path, tamper, reason):
    _refused_and_rebuilt(tmp_path, tamper, reason)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_an_entry_file_of_another_user_is_refused_and_rebuilt(tmp_path):
    tamper = lambda p: os.chown(next(p.glob("*.safetensors")), 65534, 65534)  # noqa: E731
    _refused_and_rebuilt(tmp_path, tamper, "belongs to uid 65534")


def test_a_group_writable_root_falls_back(tmp_path, caplog):
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build().save_pretrained(directory)
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with caplog.at_level(logging.WARNING):
        _, plan = dlo.load_transformer(directory, dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(root)))
    assert plan is None and "invalid_configuration" in caplog.text and "writable by group or others" in caplog.text
    assert not (root / "v1").exists()


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm tmpfs")
def test_a_tmpfs_root_is_refused_unless_allowed(tmp_path, caplog):
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build().save_pretrained(directory)
    root = SHM / f"dlo-test-{os.getpid()}"
    try:
        with caplog.at_level(logging.WARNING):
            refused = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(root / "cache"))
            _, plan = dlo.load_transformer(directory, refused)
        assert plan is None and "is on tmpfs" in caplog.text
        assert not root.exists()  # refused before anything was made: no empty directories left
        allowed = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(root), cache_allow_any_filesystem=True)
        _, plan = dlo.load_transformer(directory, allowed)
        assert plan is not None
        plan.take().checkpoint.close()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_sizes_parse_like_humans_write_them():
    from dlo.cli.cache_flags import parse_size

    assert parse_size("200G") == 200 * 2**30 and parse_size("1.5T") == int(1.5 * 2**40)
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")
