"""What makes two loads share a cache entry: the identity and its key (docs/guides/host-weight-cache.md).

Equivalent processes (any DP rank, any SP rank, any path spelling of the same model) get one
key; anything that can change the final tensors (the checkpoint files, the model config, TP
coordinates, SP size, dtype, loader inputs, the loader and model code, and the bytes
themselves) gets its own, and so does each version of the entry's layout (where its files
put the bytes). The all-gather group is no part of it: See [Note: shards from the shared entry].

[Note: warm start identity]
The identity has two parts: the *load identity*, known before anything is loaded (the
checkpoint files' identities included), and the content digest of the final tensors. A warm
start recomputes the load identity and maps an entry only if the entry's manifest holds that
load identity (and its key is the hash of the manifest's identity): a source index record,
a mere hint, can point a load at an entry but never make it map another load's entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import dlo
from dlo.config import Topology
from dlo.host.cache.entry_layout import LAYOUT_VERSION
from dlo.host.checkpoint import INDEX_NAME, WEIGHTS_NAME
from dlo.host.preflight import Fallback

SCHEMA_VERSION = 3  # 2: the load identity names the config and the checkpoint files; 3: and their ctime
CONTENT = "content"  # the digest of the final tensors, which a warm start cannot know
PACKED = "packed"  # nor the quant type of each GGUF tensor among them, where there are some
_KEY = re.compile(r"[0-9a-f]{64}")


def is_key(text: object) -> bool:
    """Whether `text` (untrusted: read from disk or typed by a user) is a key as dlo writes
    them, a SHA-256 hex digest, and so safe to put in a path."""
    return isinstance(text, str) and _KEY.fullmatch(text) is not None


def digest_of(value: object) -> str:
    """SHA-256 of the canonical JSON of `value` (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def content_digest(tensors: Mapping[str, torch.Tensor], threads: int | None = None) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order; the tensors
    are hashed in parallel (hashlib releases the GIL), on every usable core by default."""

    def one(name: str) -> bytes:
        tensor = tensors[name]
        digest = hashlib.sha256(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
        return digest.digest()

    names = sorted(tensors)
    with ThreadPoolExecutor(threads or len(os.sched_getaffinity(0))) as pool:
        parts = list(pool.map(one, names))
    return hashlib.sha256(b"".join(parts)).hexdigest()


def code_hash(model_class: type) -> str:
    """The code that produced the tensors: dlo's and diffusers' versions and the model's source."""
    import diffusers

    try:
        source = inspect.getsource(inspect.getmodule(model_class))
    except (OSError, TypeError):
        source = model_class.__qualname__
    text = f"dlo {dlo.__version__}|diffusers {diffusers.__version__}|torch {torch.__version__}|{source}"
    return hashlib.sha256(text.encode()).hexdigest()


def file_stamp(path: Path) -> list:
    """[name, size, mtime_ns, ctime_ns, device, inode] of one file the load reads."""
    info = path.stat()
    # ctime too: a rewrite that keeps size and mtime (cp -p, rsync --inplace -t) changes it
    return [path.name, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_dev, info.st_ino]


def checkpoint_files(directory: Path) -> list[list]:
    """The stamp of every file the ordinary loader reads from a safetensors checkpoint
    directory (see `_load_format_fallback`)."""
    return [
        file_stamp(path)
        for path in sorted(Path(directory).resolve().iterdir())
        if path.is_file() and path.suffix in (".safetensors", ".json")
    ]


def _load_format_fallback(directory: Path) -> Fallback | None:
    """`unsupported_load_format` unless diffusers' loader reads safetensors weights here: it
    prefers them (the index, else the single file) and otherwise reads pickled `.bin` files,
    which `checkpoint_files` does not stamp, so new weights there would warm-start the old entry."""
    if (directory / INDEX_NAME).is_file() or (directory / WEIGHTS_NAME).is_file():
        return None
    return Fallback(
        "unsupported_load_format",
        f"{directory} has no {WEIGHTS_NAME} nor {INDEX_NAME}: the cache takes only safetensors weights "
        "(re-save the model with save_pretrained(..., safe_serialization=True))",
    )


def _topology_fallback(topology: Topology, model_config: Mapping[str, object]) -> Fallback | None:
    checks = [
        (topology.hsdp, "unsupported_hsdp", "HSDP shards weights across replicas"),
        (topology.ep_size > 1, "unsupported_expert_parallel", f"expert parallel size {topology.ep_size}"),
        (topology.pp_size > 1, "unsupported_pp", f"pipeline parallel size {topology.pp_size}"),
        (topology.cfg_size > 1, "unsupported_cfg_parallel", f"CFG parallel size {topology.cfg_size}"),
        (bool(model_config.get("quantization_config")), "unsupported_quantization", "the model is quantized"),
    ]
    return next((Fallback(code, reason) for hit, code, reason in checks if hit), None)


def load_identity(
    source: Path,
    model_class: type,
    model_config: Mapping[str, object],
    dtype: str,
    loader_inputs: Mapping[str, object],
    topology: Topology,
    revision: str | None = None,
) -> dict | Fallback:
    """Everything of the identity but the content digest (see [Note: warm start identity]) of
    a load of `source`, a model directory or a single file (its `model_config` from elsewhere);
    or why the cache cannot take it: a topology or config it does not serve,
    `unsupported_load_format` if a directory's weights are not safetensors, or
    `unstable_identity` if the config or the loader inputs are not JSON-stable."""
    source = Path(source).expanduser().resolve()
    single_file = source.is_file()
    unsupported = _topology_fallback(topology, model_config) or (None if single_file else _load_format_fallback(source))
    if unsupported is not None:
        return unsupported
    try:
        config = json.loads(json.dumps(model_config, sort_keys=True, allow_nan=False))
        inputs = json.loads(json.dumps(loader_inputs, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as err:
        return Fallback("unstable_identity", f"loader inputs or config are not JSON-stable ({err})")
    return {
        "schema": SCHEMA_VERSION,
        "entry_layout": LAYOUT_VERSION,  # where the entry puts each tensor: See [Note: one copy per block]
        "model_path": str(source),
        "revision": revision,
        "model_class": f"{model_class.__module__}.{model_class.__qualname__}",
        "config": config,
        "files": [file_stamp(source)] if single_file else checkpoint_files(source),
        "dtype": dtype,
        "load_format": "single_file" if single_file else "diffusers",  # a single file: diffusers' converter ran
        "loader_inputs": inputs,
        "code": code_hash(model_class),
        "tp": [topology.tp_size, topology.tp_rank],
        "sp_size": topology.sp_size,  # an SP guard; the SP rank and all of DP are left out
    }


def build_identity(load: Mapping[str, object], digest: str, packed: Mapping[str, str]) -> tuple[dict, str]:
    """(identity, key) of a load whose final tensors have content digest `digest`; `packed`:
    the quant type of each GGUF tensor among them (See [Note: GGUF entries])."""
    identity = {**load, CONTENT: digest, **({PACKED: dict(sorted(packed.items()))} if packed else {})}
    return identity, digest_of(identity)


def without_content(identity: Mapping[str, object]) -> dict:
    """The load identity inside a full identity."""
    return {name: value for name, value in identity.items() if name not in (CONTENT, PACKED)}
