"""How quantized single files describe their float8 layers: where a weight's scale lies, what
ComfyUI's files keep beside it that no diffusers model reads (activation scales, format markers),
and the descriptions of each layer's format (a `comfy_quant` marker, the header's
`_quantization_metadata`), which dlo reads only to refuse a layer it cannot read exactly. See
[Note: single files through diffusers' converter] in dlo.host.single_file_layout."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from dlo.host.safetensors_file import SafetensorsFile, TensorEntry

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Where scaled-float8 checkpoints keep a weight's scale, beside <layer>.weight: <layer>.weight_scale
# (ModelOpt, compressed-tensors, ComfyUI's current files) or <layer>.scale_weight (ComfyUI's first
# format).
SCALE_SUFFIXES = (".weight_scale", ".scale_weight")
# A layer's quantization format in ComfyUI's current files: UTF-8 JSON bytes ({"format": ...}).
MARKER_SUFFIX = ".comfy_quant"
# What ComfyUI's quantized files hold beside the weights and a diffusers model does not read: the
# format markers (the file's `scaled_fp8`, under its key prefix; each layer's `comfy_quant`) and
# the activations' scales of its fp8 matmuls (dlo dequantizes the weights; activations stay as
# they are, as in diffusers' model of the dequantized weights).
IGNORED_SUFFIXES = (".scaled_fp8", ".scale_input", ".input_scale", MARKER_SUFFIX)
# The formats of ComfyUI's markers dlo reads: float8 weights, whose dtype the format must be.
MARKER_FLOAT8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# What a float8 layer's configuration may say besides its format: how ComfyUI runs its matmul
# (dlo dequantizes the weight whatever it says). Anything else may change what the values mean.
FLOAT8_SETTINGS = {"format", "full_precision_matrix_mult"}
# Where ComfyUI's files name a diffusion model's layers (their keys or the header's table).
COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
MARKER_MAX_BYTES = 4096


def layer_of(key: str) -> str:
    """The layer a key of a weight, its scale or its marker belongs to: all but the last name."""
    return key.rsplit(".", 1)[0]


def scale_layout(rows: int, scale_shape: tuple[int, ...]) -> str | None:
    """"per tensor" or "per row" for a scale of `scale_shape` beside a weight of `rows` rows;
    None for any other shape (which dlo does not read)."""
    if scale_shape in ((), (1,), (1, 1)):
        return "per tensor"
    return "per row" if scale_shape in ((rows,), (rows, 1)) else None


def unquantized_float_dtype(entries: Mapping[str, TensorEntry]) -> torch.dtype | None:
    """The most common float dtype of `entries` but float8 values, their scales and the keys no
    model reads (ComfyUI's float32 activation scales): what the file's float8 weights are
    dequantized into and, for a single file with torch_dtype=None, what its model is cast to.
    None without such floats."""
    counts = Counter(
        entry.dtype for key, entry in entries.items()
        if entry.dtype.is_floating_point and entry.dtype not in FLOAT8 and not key.endswith(SCALE_SUFFIXES)
        and not ignored_key(key)
    )
    return counts.most_common(1)[0][0] if counts else None


def ignored_key(key: str) -> bool:
    """A key of a ComfyUI quantized file no diffusers model reads."""
    return key == "scaled_fp8" or key.endswith(IGNORED_SUFFIXES)


def unscaled_float8(entries: Mapping[str, TensorEntry]) -> bool:
    """Whether `entries` (a file's, the keys no model reads aside: activation scales too, which
    do not change what a weight's values mean) hold float8 weights with no scale at all: the
    values as they are (e4m3fn checkpoints), which diffusers' loader casts exactly. Not so where
    anything else named like a scale lies beside a float8 weight (`weight_scale_inv`...): scales
    dlo does not read, which diffusers' loader would drop."""
    float8_layers = {layer_of(key) for key, entry in entries.items() if entry.dtype in FLOAT8}
    scales = [key for key in entries if "scale" in key.rsplit(".", 1)[-1] and layer_of(key) in float8_layers]
    return bool(float8_layers) and not scales


def quantization_problem(file: SafetensorsFile) -> str | None:
    """Why `file` holds a layer quantized in a way dlo cannot read exactly, or None: a format
    other than float8 (ComfyUI's int8, nvfp4, mxfp8...: its `comfy_quant` marker or the header's
    `_quantization_metadata` says so, or an integer weight lies beside a scale), a float8 format
    that is not its weight's dtype, a setting dlo does not know, or a marker and the header that
    name two formats. Layers are matched with ComfyUI's key prefixes (`model.diffusion_model.`)
    left out on both sides."""
    table = _metadata_layers(file)
    if table is None:
        return "the header's _quantization_metadata is unreadable (ComfyUI writes JSON with a table of layers): re-save the file"
    markers = _by_layer((key[: -len(MARKER_SUFFIX)], key) for key in file.entries if key.endswith(MARKER_SUFFIX))
    weights = _by_layer((layer_of(key), key) for key in file.entries if key.endswith(".weight"))
    described = set(table) | set(markers)
    twice = next((layer for found in (table, markers, weights) for layer in described if isinstance(found.get(layer), list)), None)
    if twice is not None:
        return f"the file names the layer {twice!r} twice, with and without a prefix ({COMFY_PREFIXES[0]}...): re-save it"
    markers = {layer: _marker_conf(file, key) for layer, key in markers.items()}
    weights = {layer: file.entries[key] for layer, key in weights.items() if layer in described}
    for layer in sorted(described):
        confs = [found[layer] for found in (markers, table) if layer in found]
        formats = [conf.get("format") if conf else None for conf in confs]
        if not all(isinstance(fmt, str) for fmt in formats):
            return f"the quantization of {layer!r} is unreadable (ComfyUI writes UTF-8 JSON naming its format): re-save the file"
        fmt = formats[0]
        if len(set(formats)) > 1:
            return (
                f"{layer!r} is quantized as {formats[0]!r} (its comfy_quant) and as {formats[1]!r} (the header's "
                "_quantization_metadata): the file contradicts itself; re-save it"
            )
        if fmt not in MARKER_FLOAT8:
            return (
                f"{layer!r} is quantized as {fmt!r} (says the file): dlo reads float8 weights ({', '.join(MARKER_FLOAT8)}, "
                "with or without scales), GGUF files and unquantized ones"
            )
        unknown = sorted(set().union(*confs) - FLOAT8_SETTINGS)
        if unknown:
            return (
                f"{layer!r} is quantized as {fmt!r} with {unknown[0]!r} (says the file), which dlo does not know: it "
                "reads float8 weights as their values times their scale"
            )
        weight = weights.get(layer)
        if weight is not None and weight.dtype != MARKER_FLOAT8[fmt]:
            return f"{layer!r} is quantized as {fmt!r} (says the file) but has a {weight.dtype} weight: re-save the file"
    for key in file.entries:
        weight = file.entries.get(f"{layer_of(key)}.weight")
        if key.endswith(SCALE_SUFFIXES) and weight is not None and not weight.dtype.is_floating_point:
            return (
                f"'{layer_of(key)}.weight' holds {weight.dtype} values beside a scale (an integer-quantized layer): dlo "
                "reads float8 weights, GGUF files and unquantized ones"
            )
    return None


def _by_layer(named) -> dict:
    """(layer, value) pairs by their layer without ComfyUI's prefix; a layer named twice (with
    and without the prefix) holds a list of its values."""
    found: dict = {}
    for layer, value in named:
        layer = _unprefixed(layer)
        found[layer] = [found[layer], value] if layer in found else value
    return found


def shared_comfy_prefix(keys: Iterable[str]) -> str | None:
    """The ComfyUI prefix every one of `keys` starts with, or None."""
    keys = list(keys)
    return next((prefix for prefix in COMFY_PREFIXES if keys and all(key.startswith(prefix) for key in keys)), None)


def _unprefixed(layer: str) -> str:
    """`layer` without the prefix ComfyUI may put before a diffusion model's keys."""
    return next((layer[len(prefix):] for prefix in COMFY_PREFIXES if layer.startswith(prefix)), layer)


def _metadata_layers(file: SafetensorsFile) -> dict[str, dict | None] | None:
    """Each layer's configuration in the header's `_quantization_metadata` (ComfyUI's; None
    where one is unreadable): empty without that table, None where it is unreadable."""
    raw = (file.metadata or {}).get("_quantization_metadata")
    if raw is None:
        return {}
    try:
        layers = json.loads(raw)["layers"]
        return _by_layer((str(layer), _conf(conf)) for layer, conf in layers.items())
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def _marker_conf(file: SafetensorsFile, key: str) -> dict | None:
    """A layer's configuration in its `comfy_quant` marker, or None where it is no such marker."""
    entry = file.entries[key]
    if entry.dtype != torch.uint8 or len(entry.shape) != 1 or entry.nbytes > MARKER_MAX_BYTES:
        return None
    try:
        return _conf(json.loads(file.view(key).numpy().tobytes().decode("utf-8")))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


def _conf(value: object) -> dict | None:
    """A layer's quantization configuration: a table, or its format alone."""
    return value if isinstance(value, dict) else {"format": value} if isinstance(value, str) else None
