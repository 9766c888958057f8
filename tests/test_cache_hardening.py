"""The host weight cache never maps weights the load did not ask for (docs/guides/host-weight-cache.md): warm starts
bound to the load identity, untrusted keys and names, owner-only directories, descriptors
validated and mapped, validation that never raises, and a rollback after the swap."""

import json
import logging
import os
import stat

import pytest
import torch

import dlo
from dlo.host.cache.entry_store import CacheUnavailable, Entry, EntryStore
from dlo.host.cache.identity import digest_of
from dlo.host.cache.manifest import MANIFEST, Rejection, RejectionKind
from dlo.models.tiny import TINY_MODELS
from ordinary_tensors import ordinary_tensors

diffusers = pytest.importorskip("diffusers")


def save(tmp_path, name, seed):
    directory = tmp_path / name
    TINY_MODELS["wan"].build(seed=seed).save_pretrained(directory)
    return directory


def cached(tmp_path):
    return dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"))


def outputs(model, dtype=torch.float32):
    with torch.inference_mode():
        return model(**TINY_MODELS["wan"].inputs(1, dtype))[0]


def resident(directory):
    model = diffusers.WanTransformer3DModel.from_pretrained(directory).eval()
    ordinary_tensors(model)
    return outputs(model)


def streamed(directory, config):
    model, plan = dlo.load_transformer(directory, config)
    with dlo.enable(model, "cpu", config, plan=plan):
        return outputs(model)


def warm_started(caplog):
    return any("warm start from" in r.getMessage() for r in caplog.records)


def fallback_codes(caplog):
    return [r.dlo_fallback for r in caplog.records if hasattr(r, "dlo_fallback")]


def records(tmp_path):
    return sorted((tmp_path / "cache" / "sources").glob("*.json"))


# -- warm start bound to identity -------------------------------------------------------------


def test_swapped_source_records_never_map_another_models_entry(tmp_path, caplog):
    model_a, model_b = save(tmp_path, "a", seed=2), save(tmp_path, "b", seed=3)
    dlo.load_transformer(model_a, cached(tmp_path))
    (record_a,) = records(tmp_path)
    dlo.load_transformer(model_b, cached(tmp_path))
    (record_b,) = set(records(tmp_path)) - {record_a}
    text_a, text_b = record_a.read_text(), record_b.read_text()
    record_a.write_text(text_b)  # A's sources now point at B's entry
    record_b.write_text(text_a)
    with caplog.at_level(logging.INFO):
        got = streamed(model_a, cached(tmp_path))
    assert not warm_started(caplog)
    assert "not warm-starting" in caplog.text and "published by another load" in caplog.text
    assert torch.equal(got, resident(model_a))


def test_a_manifest_whose_tensors_section_differs_from_the_files_is_not_warm_started(tmp_path, caplog):
    directory = save(tmp_path, "a", seed=2)
    dlo.load_transformer(directory, cached(tmp_path))
    (entry,) = (tmp_path / "cache" / "v1").iterdir()
    manifest = json.loads((entry / MANIFEST).read_text())
    name = sorted(manifest["tensors"])[0]
    manifest["tensors"][name]["dtype"] = "torch.float16"  # the files say float32
    (entry / MANIFEST).write_text(json.dumps(manifest))
    found = EntryStore(tmp_path / "cache").validate(entry.name)
    assert isinstance(found, Rejection) and found.kind is RejectionKind.TENSORS_DIFFER and name in found.detail
    with caplog.at_level(logging.INFO):
        got = streamed(directory, cached(tmp_path))
    assert not warm_started(caplog) and "tensors_differ" in caplog.text
    assert torch.equal(got, resident(directory))


def test_warm_start_with_a_cast_dtype_is_bit_identical(tmp_path, caplog):
    directory = save(tmp_path, "a", seed=2)
    config = cached(tmp_path)
    model, plan = dlo.load_transformer(directory, config, torch_dtype=torch.bfloat16)
    with dlo.enable(model, "cpu", config, plan=plan):
        cold = outputs(model, torch.bfloat16)
    with caplog.at_level(logging.INFO):
        model, plan = dlo.load_transformer(directory, config, torch_dtype=torch.bfloat16)
    assert warm_started(caplog)
    with dlo.enable(model, "cpu", config, plan=plan):
        assert torch.equal(outputs(model, torch.bfloat16), cold)


# -- keys and names from disk are untrusted ---------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["../../" + "e" * 58, "/" + "e" * 63, "e" * 63 + "\x00", "E" * 64, "e" * 65, "e" * 4096],
    ids=["dotdot", "absolute", "nul", "uppercase", "65-chars", "overlong"],
)
def test_a_source_record_naming_a_path_is_never_followed(tmp_path, caplog, key):
    directory = save(tmp_path, "a", seed=2)
    dlo.load_transformer(directory, cached(tmp_path))
    (record,) = records(tmp_path)
    record.write_text(json.dumps({"key": key}))
    before = sorted(p.name for p in tmp_path.iterdir())
    with caplog.at_level(logging.INFO):
        _, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert plan is not None and not warm_started(caplog)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made outside the root


@pytest.mark.parametrize("key", ["../../" + "e" * 58, "/etc", "e" * 63 + "\x00", "e" * 300])
def test_the_store_turns_only_keys_into_paths(tmp_path, key):
    store = EntryStore(tmp_path / "cache")
    found = store.validate(key)
    assert isinstance(found, Rejection) and found.kind is RejectionKind.BAD_KEY
    for operation in (store.hold, store.evict, lambda k: store.publish(k, {"w": torch.ones(1)}, {})):
        with pytest.raises(ValueError, match="is not a cache key"):
            operation(key)
    assert os.listdir(tmp_path) == []  # refused before any path was made


def published(root):
    identity = {"name": "entry"}
    key = digest_of(identity)
    EntryStore(root).publish(key, {"a": torch.arange(4.0), "b": torch.ones(2, 3)}, identity)
    return key


def edit_manifest(root, key, edit):
    path = root / "v1" / key / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def rename_file(manifest, new):
    (old,) = manifest["files"]
    manifest["files"][new] = manifest["files"].pop(old)


@pytest.mark.parametrize(
    ("edit", "kind", "detail"),
    [
        (lambda m: rename_file(m, "../x.safetensors"), RejectionKind.BAD_FILE_NAME, "../x.safetensors"),
        (lambda m: rename_file(m, "/etc/passwd"), RejectionKind.BAD_FILE_NAME, "/etc/passwd"),
        (lambda m: rename_file(m, "a\x00b"), RejectionKind.BAD_FILE_NAME, "a\\x00b"),
        (lambda m: rename_file(m, "x" * 300), RejectionKind.BAD_FILE_NAME, "xxx"),
        (lambda m: rename_file(m, "\ud800.safetensors"), RejectionKind.BAD_FILE_NAME, "\\ud800"),
        (lambda m: rename_file(m, ".."), RejectionKind.BAD_FILE_NAME, "'..'"),
        (lambda m: rename_file(m, MANIFEST), RejectionKind.BAD_FILE_NAME, MANIFEST),
        (lambda m: m["files"].update({k: "x" for k in m["files"]}), RejectionKind.MANIFEST_MALFORMED, "not an object"),
        (lambda m: [f.pop("size") for f in m["files"].values()], RejectionKind.MANIFEST_MALFORMED, "size"),
        (lambda m: [f.update(size="12") for f in m["files"].values()], RejectionKind.MANIFEST_MALFORMED, "size"),
        (lambda m: [f.update(sha256_chunked=7) for f in m["files"].values()], RejectionKind.MANIFEST_MALFORMED, "sha"),
        (lambda m: m.update(files=[]), RejectionKind.MANIFEST_MALFORMED, "files"),
        (lambda m: m.pop("tensors"), RejectionKind.MANIFEST_MALFORMED, "tensors"),
        (lambda m: m["tensors"].update(a=[1]), RejectionKind.MANIFEST_MALFORMED, "tensors['a']"),
        (lambda m: m["tensors"]["a"].update(shape="4"), RejectionKind.MANIFEST_MALFORMED, "shape"),
        (lambda m: m["tensors"]["a"].update(dtype="torch.complex64"), RejectionKind.MANIFEST_MALFORMED, "dtype"),
        (lambda m: m["tensors"]["a"].update(file="other"), RejectionKind.MANIFEST_MALFORMED, "file"),
        (lambda m: m["tensors"]["a"].update(shape=[2, 2]), RejectionKind.TENSORS_DIFFER, "'a'"),
        (lambda m: m["tensors"].pop("b"), RejectionKind.TENSORS_DIFFER, "names differ"),
        (lambda m: m.update(identity=["name"]), RejectionKind.MANIFEST_MALFORMED, "identity"),
        (lambda m: m.update(identity={"name": "other"}), RejectionKind.KEY_MISMATCH, "identity"),
        (lambda m: m.update(schema=1), RejectionKind.SCHEMA_MISMATCH, "schema"),
    ],
    ids=lambda value: value.name if isinstance(value, RejectionKind) else None,
)
def test_validate_names_every_malformed_manifest_instead_of_raising(tmp_path, edit, kind, detail):
    key = published(tmp_path)
    edit_manifest(tmp_path, key, edit)
    found = EntryStore(tmp_path).validate(key)
    assert isinstance(found, Rejection) and found.kind is kind and detail in found.detail


@pytest.mark.parametrize("manifest", [b"[]", b"null", b'"x"', b"[" * 100000])
def test_a_manifest_that_is_no_object_is_a_rejection(tmp_path, manifest):
    key = published(tmp_path)
    (tmp_path / "v1" / key / MANIFEST).write_bytes(manifest)
    found = EntryStore(tmp_path).validate(key)
    assert found.kind in (RejectionKind.MANIFEST_MALFORMED, RejectionKind.MANIFEST_UNREADABLE)


# -- directories and files dlo creates --------------------------------------------------------


def test_every_directory_and_file_dlo_creates_is_owner_only_whatever_the_umask(tmp_path):
    directory = save(tmp_path, "a", seed=2)
    previous = os.umask(0)
    try:
        dlo.load_transformer(directory, cached(tmp_path))
    finally:
        os.umask(previous)
    root = tmp_path / "cache"
    (key,) = os.listdir(root / "v1")
    dirs = [root, *(root / name for name in ("v1", ".locks", ".tmp", ".users", "sources")), root / "v1" / key]
    dirs.append(root / ".users" / key)
    assert {str(d.relative_to(tmp_path)): stat.S_IMODE(d.stat().st_mode) for d in dirs} == {
        str(d.relative_to(tmp_path)): 0o700 for d in dirs
    }
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) >= 5 and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}


def _use(store, name, key):
    """The store operation that uses directory `name`."""
    if name in (".locks", ".tmp"):
        return store.publish(digest_of({"name": "new"}), {"w": torch.ones(1)}, {"name": "new"})
    if name == ".users":
        return store.hold(key)
    if name == "sources":
        from dlo.host.cache.source_index import SourceIndex

        return SourceIndex(store.root).record({"load": 1}, key)
    found = store.validate(key)
    raise CacheUnavailable("invalid_configuration", found.detail)


@pytest.mark.parametrize("name", ["v1", ".locks", ".tmp", ".users", "sources"])
@pytest.mark.parametrize("tamper", ["group-writable", "symlink"])
def test_a_cache_directory_that_is_not_private_is_refused_when_used(tmp_path, name, tamper):
    key = published(tmp_path)
    EntryStore(tmp_path).hold(key)
    from dlo.host.cache.source_index import SourceIndex

    SourceIndex(tmp_path).record({"load": 0}, key)
    path = tmp_path / name
    if tamper == "group-writable":
        os.chmod(path, 0o770)
        reason = "writable by group or others"
    else:
        elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere{name}"
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
        reason = "is a symlink"
    with pytest.raises(CacheUnavailable) as raised:
        _use(EntryStore(tmp_path), name, key)
    assert raised.value.code == "invalid_configuration" and reason in raised.value.reason


def test_a_cache_root_that_is_a_symlink_is_refused_and_nothing_is_written_through_it(tmp_path, caplog):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(real)
    with caplog.at_level(logging.WARNING):
        _, plan = dlo.load_transformer(save(tmp_path, "a", seed=2), cached(tmp_path))
    assert plan is None and fallback_codes(caplog) == ["invalid_configuration"]
    message = f"the cache root {tmp_path / 'cache'} is a symlink: set --cache-dir / OffloadConfig.cache_dir to {real}"
    assert message in caplog.text
    identity = {"name": "new"}
    with pytest.raises(CacheUnavailable, match="is a symlink") as raised:  # the store refuses it too
        EntryStore(tmp_path / "cache").publish(digest_of(identity), {"w": torch.ones(1)}, identity)
    assert raised.value.code == "invalid_configuration" and os.listdir(real) == []


def test_a_lock_file_planted_as_a_symlink_is_refused_not_followed(tmp_path):
    identity = {"name": "new"}
    key = digest_of(identity)
    (tmp_path / ".locks").mkdir(mode=0o700)
    target = tmp_path.parent / f"{tmp_path.name}-planted-lock"
    (tmp_path / ".locks" / f"{key}.lock").symlink_to(target)
    with pytest.raises(CacheUnavailable) as raised:
        EntryStore(tmp_path).publish(key, {"w": torch.ones(1)}, identity)
    assert raised.value.code == "lock_failed" and not target.exists()


# -- what is validated is what is mapped ------------------------------------------------------


def test_a_file_replaced_by_path_after_validation_is_not_what_gets_mapped(tmp_path):
    from safetensors.torch import save_file

    key = published(tmp_path)
    entry = EntryStore(tmp_path).validate(key)
    assert isinstance(entry, Entry)
    (name,) = entry.manifest["files"]
    swapped = tmp_path / "swapped.safetensors"
    save_file({"a": torch.full((4,), 7.0), "b": torch.zeros(2, 3)}, str(swapped))  # same names and shapes
    os.replace(swapped, entry.path / name)
    try:
        assert torch.equal(entry.checkpoint.view("a"), torch.arange(4.0))
        assert torch.equal(entry.checkpoint.view("b"), torch.ones(2, 3))
    finally:
        entry.close()


# -- a failure after the swap -----------------------------------------------------------------


def test_a_failure_after_the_swap_restores_the_private_tensors_and_releases_the_hold(tmp_path, caplog):
    directory = save(tmp_path, "a", seed=2)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / "sources").write_text("")  # recording the source index fails after the swap
    with caplog.at_level(logging.WARNING):
        model, plan = dlo.load_transformer(directory, cached(tmp_path))
    assert plan is None and fallback_codes(caplog) == ["invalid_configuration"]
    assert "after mapping" in caplog.text and "sources is not a directory" in caplog.text
    (key,) = os.listdir(root / "v1")
    assert EntryStore(root).users(key) == 0
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    assert torch.equal(outputs(model), resident(directory))
