"""`dlo cache` keeps the cache tidy and says exactly what happened (issue 13): read-only
commands create nothing, leftovers are listed and collected, removal takes everything that
belonged to an entry, and each refusal is one line with status 2."""

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import dlo
from dlo.cli.main import main
from dlo.host.cache import entry_store
from dlo.host.cache.entry_store import EntryStore
from dlo.host.cache.identity import digest_of
from dlo.models.tiny import TINY_MODELS


def cache(root):
    return ["--cache-dir", str(root)]


def error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err.rstrip("\n")


def publish(root, name="entry"):
    key = digest_of({"name": name})
    EntryStore(root).publish(key, {"w": torch.ones(1024)}, {"name": name})
    return key


def tree(root):
    """Every path under `root` with its mode and modification time."""
    return {str(p.relative_to(root)): (p.lstat().st_mode, p.lstat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["rm", "abcdef01"], ["gc", "--max-size", "1G"]], ids=lambda c: c[0])
def test_a_missing_cache_root_is_an_error_naming_it_and_is_not_created(tmp_path, capsys, command):
    root = tmp_path / "typo"
    assert main(["cache", *command, *cache(root)]) == 2
    assert error_line(capsys) == (
        f"dlo: error: the cache root {root} does not exist (check --cache-dir / OffloadConfig.cache_dir)"
    )
    assert not root.exists()


def test_a_cache_root_that_is_a_symlink_is_an_error_naming_its_target(tmp_path, capsys):
    real = tmp_path / "real"
    publish(real)
    (tmp_path / "link").symlink_to(real)
    assert main(["cache", "ls", *cache(tmp_path / "link")]) == 2
    assert error_line(capsys) == (
        f"dlo: error: the cache root {tmp_path / 'link'} is a symlink: set --cache-dir / OffloadConfig.cache_dir to {real}"
    )


def test_the_missing_root_error_from_a_real_process(tmp_path):
    root = tmp_path / "typo"
    command = [sys.executable, "-m", "dlo.cli.main", "cache", "ls", *cache(root)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    message = f"dlo: error: the cache root {root} does not exist (check --cache-dir / OffloadConfig.cache_dir)"
    assert done.stderr.splitlines() == [message]
    assert not root.exists()


@pytest.fixture
def used_cache(tmp_path):
    """A cache a load used and let go: an entry, its lock file, its source record, and the
    hold file its (closed) hold left behind."""
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=2).save_pretrained(directory)
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"))
    _, plan = dlo.load_transformer(directory, config)
    plan.take().checkpoint.close()  # releases the hold; its file stays until proved dead
    root = tmp_path / "cache"
    (key,) = os.listdir(root / "v1")
    assert (root / ".locks" / f"{key}.lock").exists() and len(os.listdir(root / "sources")) == 1
    assert len(os.listdir(root / ".users" / key)) == 1
    return root, key


def test_ls_shows_each_entrys_model_and_dtype(used_cache, tmp_path, capsys):
    root, key = used_cache
    assert main(["cache", "ls", *cache(root)]) == 0
    header, _, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["key", "model", "dtype", "size", "last", "used", "in", "use", "by"]
    # loaded with torch_dtype=None: each tensor in the checkpoint's own dtype
    assert row.split()[:4] == [key[:16], "WanTransformer3DModel", str(tmp_path / "wan"), "checkpoint"]


def test_ls_and_verify_change_nothing(used_cache, capsys):
    root, key = used_cache
    before = tree(root)
    assert main(["cache", "ls", *cache(root)]) == 0
    assert main(["cache", "verify", *cache(root)]) == 0
    assert tree(root) == before


@pytest.mark.parametrize("command", [["rm", "{key}"], ["gc", "--max-size", "0"]], ids=["rm", "gc"])
def test_removing_an_entry_removes_everything_that_belonged_to_it(used_cache, capsys, command):
    root, key = used_cache
    assert main(["cache", *[part.format(key=key) for part in command], *cache(root)]) == 0
    assert os.listdir(root / "v1") == [] and os.listdir(root / ".locks") == []
    assert os.listdir(root / "sources") == [] and os.listdir(root / ".users") == []
    assert os.listdir(root / ".tmp") == [] and os.listdir(root / ".stamps") == []


def test_a_corrupt_entry_moved_aside_is_listed_and_gc_removes_it(tmp_path, capsys):
    key = publish(tmp_path)
    shard = next((tmp_path / "v1" / key).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x01")
    publish(tmp_path)  # moves the corrupt entry aside, publishes a good one
    (aside,) = os.listdir(tmp_path / ".tmp")
    assert aside.startswith(f"{key}.corrupt.")
    assert main(["cache", "ls", *cache(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(key[:16])]
    assert len(rows) == 2 and f"(corrupt, in .tmp/{aside}: dlo cache gc removes it)" in rows[1]
    assert main(["cache", "gc", "--max-size", "1G", *cache(tmp_path)]) == 0
    assert f"removed .tmp/{aside}" in capsys.readouterr().out.splitlines()
    assert os.listdir(tmp_path / ".tmp") == [] and os.listdir(tmp_path / "v1") == [key]


def test_gc_removes_a_dead_writers_temp_dir_whatever_its_pid(tmp_path, capsys):
    """A temp dir whose key's lock is free has no writer at work, even where its pid names a
    live process here (pid 1; this one): a dead writer of another PID namespace, or a pid
    reused. A writer at work holds the lock: the next test."""
    key = publish(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    temps = [tmp_path / ".tmp" / f"{key}.{pid}.{uuid.uuid4().hex}" for pid in (int(dead.stdout), 1, os.getpid())]
    for temp in temps:
        temp.mkdir(mode=0o700)
        (temp / "model-00001-of-00001.safetensors").write_bytes(bytes(2**20))
    assert main(["cache", "ls", *cache(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert all(f"(dead_writer, in .tmp/{temp.name}: dlo cache gc removes it)" in listed for temp in temps)
    assert main(["cache", "gc", "--max-size", "1G", *cache(tmp_path)]) == 0
    removed = capsys.readouterr().out
    assert not any(temp.exists() for temp in temps)
    assert all(f"removed .tmp/{temp.name}" in removed for temp in temps)


def test_ls_and_gc_leave_a_writer_at_work_alone_whatever_its_pid(tmp_path, capsys, monkeypatch):
    """A container sharing the cache may not see the writer's pid (or see another process
    under it): while the writer holds its key's lock, ls does not list its temp dir as a dead
    writer's and gc does not remove it."""
    hashing, resume = threading.Event(), threading.Event()
    digests = entry_store.file_digests

    def paused(handles, threads):  # the writer, between writing its shards and hashing them
        hashing.set()
        assert resume.wait(timeout=60)
        return digests(handles, threads)

    monkeypatch.setattr(entry_store, "file_digests", paused)
    key = digest_of({"name": "written"})
    outcome = []
    writer = threading.Thread(
        target=lambda: outcome.append(EntryStore(tmp_path).publish(key, {"w": torch.ones(1024)}, {"name": "written"}))
    )
    # The writer names its temp dir with a pid that is gone here, as one of another container.
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    with monkeypatch.context() as patched:
        patched.setattr(os, "getpid", lambda: gone)
        writer.start()
        # Until the writer hashes (or dies): it fsyncs its shards first, which waits behind
        # whatever else the machine has dirtied (a run with GBs written beside it took > 60 s).
        deadline = time.monotonic() + 600
        while not hashing.wait(timeout=1) and writer.is_alive() and time.monotonic() < deadline:
            pass
        started = hashing.is_set()
    try:
        assert started
        (temp,) = os.listdir(tmp_path / ".tmp")
        assert temp.split(".")[1] == str(gone)
        assert main(["cache", "ls", *cache(tmp_path)]) == 0
        assert "dead_writer" not in capsys.readouterr().out
        assert main(["cache", "gc", "--max-size", "1G", *cache(tmp_path)]) == 0
        assert os.listdir(tmp_path / ".tmp") == [temp] and f"removed .tmp/{temp}" not in capsys.readouterr().out
    finally:
        resume.set()
        writer.join(timeout=60)
    assert len(outcome) == 1 and os.listdir(tmp_path / "v1") == [key]
    assert os.listdir(tmp_path / ".tmp") == []


def test_rm_force_with_a_timeout_on_a_busy_entry_says_it_timed_out(tmp_path, capsys):
    key = publish(tmp_path)
    hold = EntryStore(tmp_path).hold(key)
    try:
        assert main(["cache", "rm", key[:10], "--force", "--timeout", "0.3", *cache(tmp_path)]) == 2
    finally:
        os.close(hold)
    assert error_line(capsys) == f"dlo: error: timed out after 0.3 s: {key[:16]} is still in use by 1 process(es)"
    assert os.listdir(tmp_path / "v1") == [key]


def test_rm_without_force_on_a_busy_entry_says_how_to_wait(tmp_path, capsys):
    key = publish(tmp_path)
    hold = EntryStore(tmp_path).hold(key)
    try:
        assert main(["cache", "rm", key, *cache(tmp_path)]) == 2
    finally:
        os.close(hold)
    assert error_line(capsys) == (
        f"dlo: error: {key[:16]} is in use by 1 process(es); stop them, or add --force to wait for them"
    )


def test_a_full_length_key_that_does_not_exist_is_not_found(tmp_path, capsys):
    publish(tmp_path)
    missing = digest_of({"name": "missing"})
    assert main(["cache", "rm", missing, *cache(tmp_path)]) == 2
    assert error_line(capsys) == f"dlo: error: no entry {missing!r} in {tmp_path} (dlo cache ls lists them)"


def test_an_ambiguous_prefix_asks_for_more_of_the_key(tmp_path, capsys):
    key = publish(tmp_path)
    prefix = key[:8]
    twin = prefix + ("0" if key[8] != "0" else "1") * 56  # a second entry sharing the first 8 digits
    (tmp_path / "v1" / twin).mkdir(mode=0o700)
    assert main(["cache", "rm", prefix, *cache(tmp_path)]) == 2
    assert error_line(capsys) == f"dlo: error: {prefix!r} matches 2 entries in {tmp_path}; give more of the key"
    assert len(os.listdir(tmp_path / "v1")) == 2


@pytest.mark.parametrize(
    "key, why",
    [
        ("", "'' is too short: give at least 8 characters of the key (`dlo cache ls` shows 16)"),
        ("{key7}", "'{key7}' is too short: give at least 8 characters of the key (`dlo cache ls` shows 16)"),
        ("{KEY}", "'{KEY}' is not (the start of) a key: keys are lowercase hex digits"),
    ],
    ids=["empty", "seven", "upper"],
)
@pytest.mark.parametrize("action", ["rm", "verify"])
def test_a_key_too_short_to_name_one_entry_is_refused_and_nothing_is_touched(tmp_path, action, key, why):
    """An unset $KEY in a script (`dlo cache rm "$KEY"`) prefixes every key: the only entry
    would go. Refused by the parser, from a real process, before the cache is looked at."""
    published = publish(tmp_path)
    before = tree(tmp_path)
    typed = key.format(key7=published[:7], KEY=published[:16].upper())
    command = [sys.executable, "-m", "dlo.cli.main", "cache", action, typed, *cache(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"dlo: error: argument KEY: {why.format(key7=published[:7], KEY=published[:16].upper())} "
        f"(see `dlo cache {action} --help`)"
    ]
    assert tree(tmp_path) == before


def test_timeout_without_force_is_refused_before_anything_is_removed(tmp_path, capsys):
    key = publish(tmp_path)
    assert main(["cache", "rm", key, "--timeout", "3", *cache(tmp_path)]) == 2
    assert error_line(capsys) == (
        "dlo: error: --timeout is how long --force waits for an entry's users; add --force or drop --timeout"
    )
    assert os.listdir(tmp_path / "v1") == [key]


def test_a_ten_byte_transformer_checkpoint_is_reported_truncated(tmp_path, capsys):
    from dlo.models.tiny_pipelines import save_tiny_flux_pipeline

    directory = tmp_path / "flux"
    save_tiny_flux_pipeline(directory)
    weights = directory / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])
    command = ["generate", str(directory), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "a.png")]
    capsys.readouterr()
    assert main(command) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dlo")]
    assert line.startswith(f"dlo: error: transformer: {weights}: truncated: header length ") and "10-byte file" in line


def test_ls_skips_a_writer_that_finished_while_it_looked(tmp_path, capsys, monkeypatch):
    """The temp dir was listed, then its writer renamed it into place and let the lock go
    before ls probed the lock: not a dead writer's, and no crash."""
    key = publish(tmp_path)
    temp = tmp_path / ".tmp" / f"{key}.1.{uuid.uuid4().hex}"
    temp.mkdir(mode=0o700)

    def finished(lock_path):
        shutil.rmtree(temp)  # published (renamed away) just now
        return False

    monkeypatch.setattr(entry_store, "is_held", finished)
    assert main(["cache", "ls", *cache(tmp_path)]) == 0
    assert "dead_writer" not in capsys.readouterr().out


def test_gc_keeps_every_entrys_last_use_so_eviction_stays_least_recently_used_first(tmp_path):
    """Removing a dead process's hold (what every gc does) is no use of the entry: a no-op
    `gc` from a real process leaves the "last used" time it evicts by, and `ls` shows, as
    they were."""
    first, second = publish(tmp_path, "first"), publish(tmp_path, "second")
    store = EntryStore(tmp_path)
    for key in (first, second):
        os.close(store.hold(key))  # a process used it and exited: its hold file is left, dead
    used = {key: store.last_used(key) for key in (first, second)}
    assert used[first] <= used[second]
    command = [sys.executable, "-m", "dlo.cli.main", "cache", "gc", "--max-size", "10G", *cache(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / ".users" / first) == []  # the dead holds went
    assert {key: store.last_used(key) for key in (first, second)} == used
    assert main(["cache", "gc", "--max-size", str(store.size(second)), *cache(tmp_path)]) == 0
    assert store.keys() == [second]  # the least recently used went first
    assert os.listdir(tmp_path / ".used") == [second]  # and its record with it
