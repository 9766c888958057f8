"""Loading a diffusers pipeline directory: its pipeline class, every component checked before any
weight loads, and diffusers' loader called the current way."""

from __future__ import annotations

from pathlib import Path

import torch

from dlo.backend.pipeline import STREAMED_COMPONENTS
from dlo.errors import ConfigError, first_line
from dlo.host.checkpoint import read_json_object
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind, SafetensorsFile
from dlo.pipelines.library_noise import quiet_loading_bars


def pipeline_class(model_dir: Path) -> tuple[type, dict]:
    """The pipeline class named by model_index.json, and the index; clear errors otherwise."""
    index_path = model_dir / "model_index.json"
    if not index_path.is_file():
        raise ConfigError(f"{model_dir} has no model_index.json: not a diffusers pipeline directory")
    index = read_json_object(index_path)
    import diffusers

    cls = getattr(diffusers, str(index.get("_class_name")), None)
    if not isinstance(cls, type) or not issubclass(cls, diffusers.DiffusionPipeline):
        raise ConfigError(
            f"{index_path}: unknown pipeline {index.get('_class_name')!r} (not a pipeline class of diffusers "
            f"{diffusers.__version__})"
        )
    if not any(index.get(name) and index[name][0] is not None for name in STREAMED_COMPONENTS):
        raise ConfigError(
            f"{index.get('_class_name')} in {model_dir} has no transformer component; dlo streams diffusion "
            "transformers (DiT), not UNets"
        )
    return cls, index


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
        raise ConfigError(f"{model_dir}: diffusers could not load the {cls.__name__}: {first_line(err)}") from None


def pipeline_on_meta(model_dir: Path, cls: type, index: dict, dtype: torch.dtype):
    """The pipeline with every model component built from its config on the meta device (shapes
    and dtypes, no memory) and no tokenizer or scheduler: what a plan needs before any weight
    loads. check_components ran first."""
    import importlib

    from transformers import AutoConfig

    components: dict[str, object] = {}
    for name, (library, class_name) in _listed_components(index).items():
        if not _is_model(library, class_name):
            components[name] = None
            continue
        module_cls = getattr(importlib.import_module(library), class_name)
        directory = model_dir / name
        try:
            with torch.device("meta"):
                if library == "diffusers":
                    module = module_cls.from_config(module_cls.load_config(directory))
                else:
                    module = module_cls._from_config(AutoConfig.from_pretrained(directory))
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"{name}: {directory / 'config.json'}: {first_line(err)}") from None
        components[name] = module.to(dtype)
    return cls(**components)
