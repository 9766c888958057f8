"""A transformer from one file, as people download them: a GGUF file (Q8_0, Q4_K, ...) or a
single-file `.safetensors` checkpoint (original or diffusers key layout), with the pipeline's own
transformer config. A GGUF model is loaded by diffusers' `from_single_file` and streams its packed
bytes (See [Note: GGUF streaming]); a single-file checkpoint streams from its mapping where
diffusers' converter allows (See [Note: single files through diffusers' converter])."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.errors import ConfigError, first_line
from dlo.host.checkpoint import read_model_config
from dlo.host.gguf_file import read_gguf_index
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.model_build import model_class as model_class_of
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
    unsupported = sorted({t.quant for t in index.tensors.values()} - diffusers_gguf_types())
    if unsupported:
        raise ConfigError(
            f"{flag} {path}: diffusers' GGUF loader has no dequantization for {', '.join(unsupported)}; "
            f"it reads {', '.join(sorted(diffusers_gguf_types()))}"
        )


def diffusers_gguf_types() -> set[str]:
    """The ggml types diffusers' GGUF loader reads: plain F32/F16 and those it dequantizes."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return {"F32", "F16", *(quant.name for quant in SUPPORTED_GGUF_QUANT_TYPES)}


def load_single_file(
    path: Path, model_dir: Path, dtype: torch.dtype, config: OffloadConfig, flag: str
) -> tuple[nn.Module, HostWeightPlan | None]:
    """The transformer `model_dir/transformer/config.json` describes, from `path` in `dtype` (a
    GGUF model's compute dtype), and its plan: a .safetensors file streams from its mapping
    where it can (dlo.load_transformer), a GGUF file is loaded by diffusers' `from_single_file`;
    a failure of diffusers' loader is one ConfigError."""
    import diffusers

    import dlo

    if path.suffix != ".gguf":
        return dlo.load_transformer(path, config, torch_dtype=dtype, model_config=model_dir / "transformer")
    config_path = model_dir / "transformer" / "config.json"
    model_class = model_class_of(read_model_config(config_path.parent).get("_class_name"), config_path)
    quantization = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
    try:
        model = model_class.from_single_file(
            str(path), config=str(model_dir), subfolder="transformer", torch_dtype=dtype, quantization_config=quantization
        )
    except Exception as err:  # diffusers' converters raise many kinds
        raise ConfigError(f"{flag} {path}: diffusers could not load it as a {model_class.__name__} ({first_line(err)})") from None
    return model, None
