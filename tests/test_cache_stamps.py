"""Warm start without re-hashing (issue 19, docs/guides/host-weight-cache.md): an entry whose files kept the stamps
recorded at their last full validation is not hashed again; any change to a file (touched,
truncated, replaced by one of the same size, rewritten in place with its mtime put back)
brings back the full validation. `dlo cache verify` always hashes."""

import json
import logging
import os

import pytest
import torch

import dlo
from dlo.cli.main import main
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


@pytest.fixture
def published(tmp_path):
    """(model directory, cache root, entry directory) after a cold load published the entry."""
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=2).save_pretrained(directory)
    dlo.load_transformer(directory, config(tmp_path))
    (entry,) = (tmp_path / "cache" / "v1").iterdir()
    return directory, tmp_path / "cache", entry


def config(tmp_path, verify="stamp"):
    return dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_verify=verify)


def load(directory, tmp_path, caplog, verify="stamp"):
    """(hashed, warm started, outputs) of a load through the cache."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        model, plan = dlo.load_transformer(directory, config(tmp_path, verify))
    messages = [r.getMessage() for r in caplog.records]
    with dlo.enable(model, "cpu", config(tmp_path, verify), plan=plan), torch.inference_mode():
        out = model(**TINY_MODELS["wan"].inputs(1))[0]
    hashed = any(m.startswith("dlo: hashed") for m in messages)
    return hashed, any(m.startswith("dlo: warm start") for m in messages), out


def resident(directory):
    model = diffusers.WanTransformer3DModel.from_pretrained(directory).eval()
    with torch.inference_mode():
        return model(**TINY_MODELS["wan"].inputs(1))[0]


def shard(entry):
    return next(entry.glob("*.safetensors"))


def test_a_warm_start_with_matching_stamps_skips_hashing(published, tmp_path, caplog):
    directory, _, _ = published
    hashed, warm, out = load(directory, tmp_path, caplog)
    assert warm and not hashed and torch.equal(out, resident(directory))
    hashed, warm, _ = load(directory, tmp_path, caplog, verify="full")
    assert warm and hashed


def rewrite_in_place_keeping_mtime(path):
    """Other bytes, same size, same inode, mtime put back: only the ctime tells."""
    info = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    with open(path, "r+b") as handle:
        handle.write(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert path.stat().st_mtime_ns == info.st_mtime_ns and path.stat().st_ino == info.st_ino


def replace_with_same_size(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    other = path.with_name("other")
    other.write_bytes(bytes(data))
    os.chmod(other, 0o600)
    info = path.stat()
    os.utime(other, ns=(info.st_atime_ns, info.st_mtime_ns))
    os.replace(other, path)


@pytest.mark.parametrize(
    ("change", "still_valid"),
    [
        (lambda path: os.utime(path), True),  # touched: same bytes
        (rewrite_in_place_keeping_mtime, False),
        (replace_with_same_size, False),
        (lambda path: os.truncate(path, path.stat().st_size - 1), False),
    ],
    ids=["touched", "rewritten-in-place-mtime-kept", "replaced-same-size", "truncated"],
)
def test_any_change_to_a_file_brings_back_the_full_validation(published, tmp_path, caplog, change, still_valid):
    directory, _, entry = published
    change(shard(entry))
    hashed, warm, out = load(directory, tmp_path, caplog)
    assert torch.equal(out, resident(directory))
    if still_valid:
        assert hashed and warm  # hashed again, then new stamps recorded...
        hashed, warm, _ = load(directory, tmp_path, caplog)
        assert warm and not hashed  # ...so the next warm start skips hashing again
    else:
        assert not warm  # rejected (hashing, or the size check first), rebuilt cold
        assert "not warm-starting" in caplog.text


def test_dlo_cache_verify_hashes_even_when_the_stamps_match(published, capsys):
    _, root, entry = published
    stamp_file = root / ".stamps" / f"{entry.name}.json"
    assert stamp_file.exists()
    rewrite_in_place_keeping_mtime(shard(entry))
    stamps = json.loads(stamp_file.read_text())  # as if the stamps matched (bits flipped by the disk)
    info = shard(entry).stat()
    stamps[shard(entry).name] = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    stamp_file.write_text(json.dumps(stamps))
    assert main(["cache", "verify", "--cache-dir", str(root)]) == 1
    assert f"{entry.name[:16]}  BAD  digest_mismatch" in capsys.readouterr().out


def test_cache_verify_is_a_checked_config_field():
    assert dlo.OffloadConfig().cache_verify == "stamp"
    with pytest.raises(dlo.ConfigError, match=r"cache_verify must be one of \['stamp', 'full'\], got 'fast'"):
        dlo.OffloadConfig(cache_verify="fast")
