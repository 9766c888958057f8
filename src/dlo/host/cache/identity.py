"""What makes two loads share a cache entry: the identity and its key (SPEC §5.2).

Equivalent processes (any DP rank, any SP rank, any path spelling of the same model) get one
key; anything that can change the final tensors (TP coordinates, SP size, dtype, loader
inputs, the loader and model code, and the bytes themselves) gets its own.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import dlo
from dlo.config import Topology
from dlo.host.preflight import Fallback

SCHEMA_VERSION = 1


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


def build_identity(
    model_dir: Path,
    model_class: type,
    dtype: str,
    loader_inputs: Mapping[str, object],
    topology: Topology,
    digest: str,
    revision: str | None = None,
) -> tuple[dict, str] | Fallback:
    """(identity, key), or `unstable_identity` if the loader inputs are not JSON-stable."""
    try:
        inputs = json.loads(json.dumps(loader_inputs, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as err:
        return Fallback("unstable_identity", f"loader inputs are not JSON-stable ({err})")
    identity = {
        "schema": SCHEMA_VERSION,
        "model_path": str(Path(model_dir).expanduser().resolve()),
        "revision": revision,
        "model_class": model_class.__name__,
        "dtype": dtype,
        "load_format": "diffusers",
        "loader_inputs": inputs,
        "code": code_hash(model_class),
        "tp": [topology.tp_size, topology.tp_rank],
        "sp_size": topology.sp_size,  # an SP guard; the SP rank and all of DP are left out
        "content": digest,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return identity, key
