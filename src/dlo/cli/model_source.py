"""Where a model named on the command line lives: a local directory, or a Hugging Face hub id
(`org/name`) resolved through the user's hub cache (downloaded there when online)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dlo.cli.lora_flags import LoraFlag
from dlo.errors import ConfigError, first_line
from dlo.host.single_file_layout import checked_converter_options
from dlo.pipelines.lora_adapters import LORA_WEIGHTS_FILE, LoraFile, check_lora, lora_weights_file
from dlo.pipelines.single_file import check_single_file

# The hub's repository id form; anything that is also an existing path is taken as the path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Only the diffusers layout: model_index.json and the component folders, not the single-file
# original checkpoints many repositories also carry at their root, nor other frameworks' weights.
_ALLOW = ["model_index.json", "*/*"]
_IGNORE = ["*.pth", "*.ckpt", "*.pt", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.gguf"]


def is_hub_id(target: str) -> bool:
    return bool(_HUB_ID.match(target)) and not Path(target).expanduser().exists()


def _hub_snapshot(
    repo_id: str, cache_only: str | None, label: str = "MODEL", allow: list[str] = _ALLOW,
    ignore: list[str] = _IGNORE, download_only: Callable[[str], list[str]] | None = None,
) -> Path:
    """The hub cache's snapshot of `repo_id` (downloaded unless `cache_only` says why not);
    `label`: how messages name it (the flag, the argument); `download_only(repo_id)`: the
    files to download, where `allow` would take too many."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:  # the local cache first, without touching the network
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=allow, ignore_patterns=ignore))
    except LocalEntryNotFoundError:
        pass
    missing = f"{label} {repo_id}: not in the Hugging Face cache {constants.HF_HUB_CACHE}"
    if cache_only or constants.HF_HUB_OFFLINE:
        why = cache_only or "HF_HUB_OFFLINE is set"
        raise ConfigError(
            f"{missing} and {why}; download it first (`hf download {repo_id}`) or pass its directory"
        )
    try:
        files = download_only(repo_id) if download_only is not None else allow
        return Path(snapshot_download(repo_id, allow_patterns=files, ignore_patterns=ignore))
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{label} {repo_id}: no such repository on the Hugging Face hub, or it is gated or private "
            "(log in with `hf auth login`)"
        ) from None
    except (HfHubHTTPError, OSError) as err:
        raise ConfigError(f"{missing} and the download failed ({first_line(err)})") from None


def resolve_model(target: str, cache_only: str | None = None) -> Path:
    """The local directory `target` names: itself, or the hub cache snapshot of a hub id.
    `cache_only`: why the hub must not be asked (said when the model is not cached)."""
    if is_hub_id(target):
        return _hub_snapshot(target, cache_only)
    path = Path(target).expanduser()
    if not path.is_dir():
        raise ConfigError(f"MODEL {target}: no such directory (nor a Hugging Face hub id like org/name)")
    return path


def _hub_lora_file(repo_id: str, flag: str) -> str:
    """The one file of a hub LoRA repository to download (its name listed, nothing fetched):
    diffusers' LoRA file name, or the only .safetensors file at its root."""
    from huggingface_hub import list_repo_files

    files = list_repo_files(repo_id)
    if "model_index.json" in files:
        raise ConfigError(f"{flag}: {repo_id} is a pipeline repository, not a LoRA")
    root = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if LORA_WEIGHTS_FILE in root:
        return LORA_WEIGHTS_FILE
    if len(root) != 1:
        held = f"holds {', '.join(root)} at its root" if root else "holds no .safetensors file at its root"
        raise ConfigError(f"{flag}: {repo_id} {held}; download the LoRA file (`hf download {repo_id} FILE`) and give its path")
    return root[0]


def checked_weight_files(
    transformer_flag: str | None, lora_flags: list[LoraFlag] | None, pipeline: type, transformer: nn.Module,
    cache_only: str | None, converter_options: list[tuple[str, str]] | None = None,
) -> tuple[Path | None, tuple[LoraFile, ...]]:
    """--transformer FILE (with its --converter-option pairs) and each --lora, found and checked
    against `transformer` (on the meta device) before anything loads. An unnamed --lora
    (generate's) is adapter lora<i>."""
    transformer_file = Path(transformer_flag).expanduser() if transformer_flag is not None else None
    if transformer_file is not None:
        check_single_file(transformer_file, "--transformer")
    check_converter_flags(converter_options or [], transformer_file, type(transformer))
    loras = tuple(resolve_lora(flag, flag.name or f"lora{i}", cache_only) for i, flag in enumerate(lora_flags or ()))
    for lora in loras:
        check_lora(pipeline, transformer, lora)
    return transformer_file, loras


def check_converter_flags(options: list[tuple[str, str]], transformer_file: Path | None, cls: type) -> dict[str, object]:
    """The --converter-option flags as the converter of --transformer FILE takes them: each KEY
    once, one it takes, its VALUE read as the type of the option's default."""
    if not options:
        return {}
    if transformer_file is None:
        raise ConfigError("--converter-option passes options to the single-file converter of --transformer FILE; give one")
    keys = [key for key, _ in options]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ConfigError(f"--converter-option {repeated[0]}=...: given twice; give each KEY once")
    return checked_converter_options(cls, dict(options), "--converter-option")


def check_gguf_kernels(transformer_file: Path | None, device: torch.device) -> None:
    """--gguf-kernels: a --transformer .gguf file, Triton, and a CUDA device (or Triton's CPU
    interpreter), checked before anything loads."""
    if transformer_file is None or transformer_file.suffix != ".gguf":
        raise ConfigError(
            "--gguf-kernels dequantizes the weights of a --transformer .gguf file; give one with --transformer "
            "FILE.gguf, or leave --gguf-kernels out"
        )
    from dlo.backend.gguf_kernel_linears import load_kernels

    try:
        kernels = load_kernels()
    except ConfigError as err:
        raise ConfigError(f"--gguf-kernels: {err}") from None
    if device.type != "cuda" and not kernels.on_cpu:
        raise ConfigError(
            f"--gguf-kernels runs Triton kernels on a CUDA device, not {device}; use --device cuda, or leave "
            "--gguf-kernels out"
        )


def resolve_lora(flag: LoraFlag, name: str, cache_only: str | None = None) -> LoraFile:
    """The LoRA file a --lora names, as adapter `name`: a .safetensors file, a directory holding
    one, or a hub id (the file at the repository's root, through the hub cache)."""
    if is_hub_id(flag.target) and not flag.target.endswith(".safetensors"):  # a file name: a missing path
        directory = _hub_snapshot(
            flag.target, cache_only, "--lora", allow=["*.safetensors"], ignore=[],
            download_only=lambda repo_id: [_hub_lora_file(repo_id, flag.text())],
        )
    else:
        directory = Path(flag.target).expanduser()
        if directory.is_file():
            if directory.suffix != ".safetensors":
                raise ConfigError(f"{flag.text()}: not a .safetensors file; dlo loads LoRAs saved as safetensors")
            return LoraFile(name, directory, flag.scale, flag.text())
        if not directory.is_dir():
            raise ConfigError(f"{flag.text()}: no such file or directory (nor a Hugging Face hub id like org/name)")
    return LoraFile(name, lora_weights_file(directory, flag.text()), flag.scale, flag.text())
