"""Real GGUF files for the tests, written with the `gguf` package's writer, and the diffusers
GGUF models loaded from them (`from_single_file` with a GGUFQuantizationConfig), as users
load the GGUF files they download.

The files hold diffusers' tensor names (diffusers then converts nothing). Every Linear weight
of the model whose rows fit the quant type's blocks is stored in that type: quantized by
`gguf.quants` where it can, else (the K-quants, IQ4_XS) random block bytes of values below
0x10, so that every float16 scale in them is finite and below 2**-12 (the weights stay small
enough for the outputs to be finite). The other tensors are F32.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

# A Wan transformer wide enough for the 256-value blocks of the K-quants (inner width and MLP
# 256), with the inputs of dlo.models.tiny's "wan".
WIDE_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4, text_dim=32,
    freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=32,
)


@pytest.fixture
def quiet_diffusers():
    """diffusers' notes on the weights its GGUF loader dequantizes into float32, silenced (for a
    whole module: import it and set `pytestmark = pytest.mark.usefixtures("quiet_diffusers")`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _packed(weight: np.ndarray, quant_type, generator: np.random.Generator) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.quantize(weight, quant_type)
    except NotImplementedError:  # gguf quantizes only some types: crafted blocks with finite scales
        block, type_bytes = gguf.GGML_QUANT_SIZES[quant_type]
        rows = weight.shape[0]
        return generator.integers(0, 0x10, size=(rows, weight.shape[1] // block * type_bytes), dtype=np.uint8)


def write_gguf(model: torch.nn.Module, path: Path, quant_type, seed: int = 0, layout=None) -> Path:
    """`model`'s state dict as a GGUF file, its Linear weights as `quant_type` where they fit.
    `layout` (a function of the state dict, single_file_layouts.py) writes the file in another
    key layout; its 2-D weights are then the Linear weights."""
    import gguf

    block, _ = gguf.GGML_QUANT_SIZES[quant_type]
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    state = model.state_dict()
    if layout is None:
        packed = {name for name in state if name.endswith(".weight") and name.rpartition(".")[0] in linears}
    else:
        state = layout(state)
        packed = {name for name, tensor in state.items() if name.endswith(".weight") and tensor.dim() == 2}
    generator = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "dlo-test")
    for name, tensor in state.items():
        values = tensor.detach().float().numpy()
        if name in packed and values.shape[-1] % block == 0:
            writer.add_tensor(name, _packed(values, quant_type, generator), raw_dtype=quant_type)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_gguf(path: Path, config_dir: Path, model_class: str, compute_dtype: torch.dtype = torch.float32):
    """diffusers' GGUF model of the file (`config_dir`: the transformer's config.json)."""
    import diffusers

    quantization = diffusers.GGUFQuantizationConfig(compute_dtype=compute_dtype)
    return getattr(diffusers, model_class).from_single_file(
        str(path), config=str(config_dir), quantization_config=quantization
    ).eval()
