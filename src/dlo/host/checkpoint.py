"""A diffusers model directory's safetensors weights: one file, or shards listed by an index."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from dlo.errors import ConfigError
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind, SafetensorsFile, TensorEntry

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"


def read_model_config(directory: Path) -> dict:
    """config.json of a model directory."""
    return read_json_object(directory / "config.json")


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; anything else is a ConfigError naming the file."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ConfigError(f"{path} is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def find_transformer_dir(path: str | Path) -> Path:
    """A transformer directory, or the `transformer/` folder of a pipeline directory."""
    path = Path(path).expanduser()
    if (path / "model_index.json").is_file() and (path / "transformer" / "config.json").is_file():
        return path / "transformer"
    if (path / "config.json").is_file():
        return path
    raise CheckpointError(
        CheckpointErrorKind.NO_CHECKPOINT, path, "no config.json (nor transformer/config.json): not a diffusers model directory"
    )


def is_plain_file_name(name: object) -> bool:
    """Whether `name` (read from a file, so untrusted) names a file directly inside a
    directory: no separator, not `.`/`..`, no NUL, valid UTF-8 of at most 255 bytes (NAME_MAX)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\x00" in name:
        return False
    try:
        return len(name.encode("utf-8")) <= 255
    except UnicodeEncodeError:  # a lone surrogate, which JSON allows and no path can hold
        return False


@dataclass(frozen=True)
class SourceTensor:
    """Where one checkpoint tensor lives."""

    file: SafetensorsFile
    entry: TensorEntry


def read_weight_map(directory: Path) -> dict[str, str] | None:
    """The index's key -> shard map; None for a single-file checkpoint."""
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        if (directory / WEIGHTS_NAME).is_file():
            return None
        raise CheckpointError(
            CheckpointErrorKind.NO_CHECKPOINT, directory, f"neither {WEIGHTS_NAME} nor {INDEX_NAME} is there"
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, f"no readable weight_map ({err})") from None
    if not weight_map:
        raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, "weight_map is empty")
    for name in names:
        if not is_plain_file_name(name):
            raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, f"shard {name!r} is not a file name")
        if not (directory / name).is_file():
            raise CheckpointError(CheckpointErrorKind.MISSING_SHARD, index_path, f"names {name!r}, which is missing")
    return weight_map


def _check_index(index_path: Path, weight_map: dict[str, str], tensors: dict[str, SourceTensor]) -> None:
    """The index must say exactly where every tensor is."""
    for key, name in weight_map.items():
        if key not in tensors or tensors[key].file.path.name != name:
            where = tensors[key].file.path.name if key in tensors else "no shard"
            raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, f"puts {key!r} in {name!r}, it is in {where}")
    unlisted = sorted(set(tensors) - set(weight_map))
    if unlisted:
        raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, f"does not list {unlisted[0]!r}")


class Checkpoint:
    """Every tensor of a model directory's checkpoint, each mapped exactly once."""

    def __init__(self, directory: str | Path, opened: Mapping[str, BinaryIO] | None = None) -> None:
        """`opened`: read exactly these already-open safetensors files of `directory`, by name
        (a cache entry, mapped through the descriptors it was validated with; the caller
        keeps owning them); default: the diffusers layout (one file, or the shards its index
        lists), opened here."""
        self.directory = Path(directory)
        self.files: list[SafetensorsFile] = []
        self.tensors: dict[str, SourceTensor] = {}
        self._releases: list[_Release] = []
        try:
            weight_map = read_weight_map(self.directory) if opened is None else None
            if opened is not None:
                names = sorted(opened)
            else:
                names = sorted(set(weight_map.values())) if weight_map else [WEIGHTS_NAME]
            for name in names:
                shard = SafetensorsFile(self.directory / name, None if opened is None else opened[name])
                self.files.append(shard)
                for key, entry in shard.entries.items():
                    if key in self.tensors:
                        raise CheckpointError(
                            CheckpointErrorKind.DUPLICATE_KEY,
                            shard.path,
                            f"{key!r} is also in {self.tensors[key].file.path.name}",
                        )
                    self.tensors[key] = SourceTensor(shard, entry)
            if weight_map is not None:
                _check_index(self.directory / INDEX_NAME, weight_map, self.tensors)
        except BaseException:
            self.close()
            raise

    @classmethod
    def of_entries(cls, directory: Path, files: list[tuple[SafetensorsFile, dict[str, TensorEntry]]]) -> Checkpoint:
        """A checkpoint of already-mapped files whose tensors go by other names than the files
        give them (a single file in its original layout seen in diffusers' layout: see
        dlo.host.single_file_layout); it owns and closes the files."""
        checkpoint = cls.__new__(cls)
        checkpoint.directory, checkpoint._releases = Path(directory), []
        checkpoint.files = [file for file, _ in files]
        checkpoint.tensors = {}
        for file, entries in files:
            for name, entry in entries.items():
                if name in checkpoint.tensors:
                    checkpoint.close()
                    raise CheckpointError(CheckpointErrorKind.DUPLICATE_KEY, file.path, f"{name!r} is given twice")
                checkpoint.tensors[name] = SourceTensor(file, entry)
        return checkpoint

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def view(self, key: str) -> torch.Tensor:
        source = self.tensors[key]
        return source.file.view_entry(source.entry)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views one of the mapped files."""
        return any(shard.holds(tensor) for shard in self.files)

    def release_with_mapping(self, release: Callable[[], None]) -> None:
        """Call `release` (e.g. of a cache entry's hold) once the files are unmapped: at
        close(), or, for a checkpoint dropped unclosed (a plan never enabled), once it and
        every view of its files are collected: a model still using the views keeps it."""
        once = _Release(release, len(self.files))
        self._releases.append(once)
        for shard in self.files:
            shard.when_collected(once.one_collected)

    def close(self) -> None:
        """Unmap every file, then release what waits for that (`release_with_mapping`); a file
        that stays mapped (exported elsewhere) leaves the releases to its collection."""
        unmapped = [shard.close() for shard in self.files]
        releases, self._releases = self._releases, []
        if all(unmapped):
            for once in releases:
                once.now()


class _Release:
    """Runs `call` once: at close() (`now`) or when the last of `files` mappings is collected,
    whichever comes first. Both may run in a garbage collector's finalizer, in any thread:
    list.pop is atomic, so exactly one caller takes the call."""

    def __init__(self, call: Callable[[], None], files: int) -> None:
        self._call = [call]
        self._mapped = [None] * files

    def now(self) -> None:
        try:
            call = self._call.pop()
        except IndexError:
            return  # already released
        call()

    def one_collected(self) -> None:
        self._mapped.pop()
        if not self._mapped:
            self.now()
