"""Loading a diffusers pipeline directory: every component checked before any weight loads,
and diffusers' loader called the current way."""

from __future__ import annotations

from pathlib import Path

import torch

from dlo.cli.library_noise import quiet_loading_bars
from dlo.errors import ConfigError
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind, SafetensorsFile

def _listed_components(index: dict) -> dict[str, tuple[str, str]]:
    """model_index.json's components: name -> (library, class), the unused (null) ones left out."""
    return {
        name: (entry[0], entry[1])
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and None not in entry
    }


def _is_model(library: str, class_name: str) -> bool:
    """Whether the component is a model (config.json and weight files), not a scheduler or tokenizer."""
    import diffusers
    import transformers

    bases = {"diffusers": (diffusers, diffusers.ModelMixin), "transformers": (transformers, transformers.PreTrainedModel)}
    if library not in bases:
        return False
    module, base = bases[library]
    cls = getattr(module, class_name, None)
    return isinstance(cls, type) and issubclass(cls, base)


def check_components(model_dir: Path, index: dict) -> None:
    """Refuse, naming the component, the file and what is wrong, a pipeline whose components are
    missing or whose safetensors files are damaged; reads only directories and headers."""
    for name, (library, class_name) in _listed_components(index).items():
        directory = model_dir / name
        if not directory.is_dir():
            raise ConfigError(f"{name}: {directory} is missing (model_index.json lists a {library} {class_name} there)")
        if not _is_model(library, class_name):
            continue
        if not (directory / "config.json").is_file():
            raise ConfigError(f"{name}: {directory / 'config.json'} is missing")
        for path in sorted(directory.glob("*.safetensors")):
            try:
                SafetensorsFile(path).close()
            except CheckpointError as err:
                if err.kind is CheckpointErrorKind.UNKNOWN_DTYPE:
                    continue  # a dtype dlo does not stream is no damage; the component's own loader reads it
                raise ConfigError(f"{name}: {err}") from None


def _dtype_argument() -> str:
    """diffusers (PR 14205, 2026-07) renamed from_pretrained's `torch_dtype` to `dtype` and warns
    on the old name; earlier releases know only `torch_dtype`."""
    import diffusers.utils

    return "dtype" if hasattr(diffusers.utils, "_resolve_dtype") else "torch_dtype"


def load_pipeline(model_dir: Path, cls: type, dtype: torch.dtype, **components: object):
    """`cls.from_pretrained(model_dir)` in `dtype`, with `components` already loaded; a failure of
    diffusers' loader is one ConfigError naming the directory (check_components ran first)."""
    quiet_loading_bars()
    try:
        return cls.from_pretrained(model_dir, **{_dtype_argument(): dtype}, **components)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{model_dir}: diffusers could not load the {cls.__name__}: {first_line}") from None
