"""A diffusers model directory's safetensors weights: one file, or shards listed by an index."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind, SafetensorsFile, TensorEntry

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"


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


@dataclass(frozen=True)
class SourceTensor:
    """Where one checkpoint tensor lives."""

    file: SafetensorsFile
    entry: TensorEntry


def _shard_names(directory: Path) -> list[str]:
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        if (directory / WEIGHTS_NAME).is_file():
            return [WEIGHTS_NAME]
        raise CheckpointError(
            CheckpointErrorKind.NO_CHECKPOINT, directory, f"neither {WEIGHTS_NAME} nor {INDEX_NAME} is there"
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, f"no readable weight_map ({err})") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(CheckpointErrorKind.INDEX_INVALID, index_path, f"shard {name!r} is not a file name")
        if not (directory / name).is_file():
            raise CheckpointError(CheckpointErrorKind.MISSING_SHARD, index_path, f"names {name!r}, which is missing")
    return names


class Checkpoint:
    """Every tensor of a model directory's checkpoint, each mapped exactly once."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.files: list[SafetensorsFile] = []
        self.tensors: dict[str, SourceTensor] = {}
        try:
            for name in _shard_names(self.directory):
                shard = SafetensorsFile(self.directory / name)
                self.files.append(shard)
                for key, entry in shard.entries.items():
                    if key in self.tensors:
                        raise CheckpointError(
                            CheckpointErrorKind.DUPLICATE_KEY,
                            shard.path,
                            f"{key!r} is also in {self.tensors[key].file.path.name}",
                        )
                    self.tensors[key] = SourceTensor(shard, entry)
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def view(self, key: str) -> torch.Tensor:
        source = self.tensors[key]
        return source.file.view(key)

    def close(self) -> None:
        for shard in self.files:
            shard.close()
