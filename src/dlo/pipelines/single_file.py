"""A transformer from one file, as people download them: a GGUF file (Q8_0, Q4_K, ...) or a
single-file `.safetensors` checkpoint (original or diffusers key layout), with the pipeline's own
transformer config, loaded by `dlo.load_transformer`: either kind streams from the file's mapping
where diffusers' converter allows (See [Note: single files through diffusers' converter]), a
GGUF file its packed bytes (See [Note: GGUF streaming])."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.errors import ConfigError
from dlo.host.gguf_file import check_diffusers_reads, read_gguf_index
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.safetensors_file import CheckpointError, SafetensorsFile

SINGLE_FILE_SUFFIXES = (".gguf", ".safetensors")


def check_single_file(path: Path, flag: str) -> None:
    """Refuse, reading its header only, a file diffusers' single-file loader cannot take."""
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    if path.suffix not in SINGLE_FILE_SUFFIXES:
        raise ConfigError(f"{flag} {path}: give a .gguf file or a single-file .safetensors checkpoint")
    if path.suffix == ".safetensors":
        try:
            SafetensorsFile(path).close()
        except CheckpointError as err:
            raise ConfigError(f"{flag} {err}") from None
        return
    try:
        import gguf  # noqa: F401  (the index reader's quant tables)
    except ImportError:
        raise ConfigError(f"{flag} {path}: GGUF files need the [gguf] extra: pip install 'dlo[gguf]'") from None
    try:
        index = read_gguf_index(path)  # the header and tensor index; no tensor byte is read
    except CheckpointError as err:
        raise ConfigError(f"{flag} {err}") from None
    check_diffusers_reads(index, f"{flag} {path}")


def load_single_file(
    path: Path, model_dir: Path, dtype: torch.dtype, config: OffloadConfig, flag: str,
    converter_options: tuple[tuple[str, str], ...] = (),
) -> tuple[nn.Module, HostWeightPlan | None]:
    """The transformer `model_dir/transformer/config.json` describes, from `path` in `dtype` (a
    GGUF model's compute dtype), and its plan (dlo.load_transformer, its converter given
    `converter_options`); a refusal is one ConfigError naming `flag`."""
    import dlo

    try:
        return dlo.load_transformer(
            path, config, torch_dtype=dtype, model_config=model_dir / "transformer", converter_options=dict(converter_options)
        )
    except (ConfigError, CheckpointError) as err:
        raise ConfigError(f"{flag} {err}") from None
