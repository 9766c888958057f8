"""dlo.use_gguf_kernels: diffusers' GGUF Linears dequantize through dlo's kernels, keeping their
modules and parameters, before or after dlo.enable; refusals before anything changes. See
[Note: GGUF kernel Linears] in dlo.backend.gguf_kernel_linears and [Note: GGUF kernels] in
dlo.backend.gguf_kernels.

On the CPU the kernels run in two ways: a stand-in `Kernels` that dequantizes with diffusers'
own code (the swap, the forward and the streaming need no Triton), and, where Triton is
installed, the real Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1), compared
with diffusers' dequantization bit for bit. tests/gpu/test_cuda_gguf_kernels.py runs them on CUDA.
"""

import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import dlo
from dlo.backend import gguf_kernel_linears
from dlo.backend.gguf_kernel_linears import Kernels
from dlo.errors import ConfigError, StreamingError
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor  # noqa: E402
from gguf_blocks import KERNEL_QUANTS, WIDE_FLUX, gguf_parameter, random_blocks, same_values  # noqa: E402
from gguf_files import load_gguf, write_gguf  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(autouse=True)
def _quiet_diffusers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes on the weights it keeps in float32
        yield


def _tiny_flux_gguf(tmp_path, quant="Q8_0", config=None):
    """(path, config dir) of a seeded Flux transformer (dlo's tiny one, or `config`) as a GGUF file."""
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**config) if config else TINY_MODELS["flux"].build(seed=0)
    model.save_config(tmp_path)
    return write_gguf(model, tmp_path / f"{quant}.gguf", gguf.GGMLQuantizationType[quant]), tmp_path


def _load(path, config_dir):
    return load_gguf(path, config_dir, "FluxTransformer2DModel")


def _outputs(model, seeds=(1, 2)):
    with torch.inference_mode():
        return [model(**TINY_MODELS["flux"].inputs(seed))[0] for seed in seeds]


def _gguf_linears(model):
    return [m for m in model.modules() if isinstance(m, GGUFLinear)]


def reference_kernels(calls=None, quants=KERNEL_QUANTS, on_cpu=True):
    """Kernels that dequantize with diffusers' code (what the Triton kernels equal), recording
    each call's (quant, packed dtype, packed shape)."""

    def dequantize(packed, quant, dtype):
        if calls is not None:
            calls.append((quant, packed.dtype, tuple(packed.shape)))
        return dequantize_gguf_tensor(gguf_parameter(packed, quant)).to(dtype)

    return Kernels(dequantize, frozenset(quants), DTYPES, on_cpu)


@pytest.fixture
def with_kernels(monkeypatch):
    """Make use_gguf_kernels take the given Kernels (no Triton, no CUDA needed)."""

    def use(kernels):
        monkeypatch.setattr(gguf_kernel_linears, "load_kernels", lambda: kernels)

    return use


def test_without_triton_it_is_refused_in_one_line_before_any_linear_changes(tmp_path, monkeypatch):
    model = _load(*_tiny_flux_gguf(tmp_path))
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton fails
    with pytest.raises(ConfigError, match=r"^dlo.use_gguf_kernels needs Triton, which is not installed: pip install"):
        dlo.use_gguf_kernels(model)
    assert {type(m) for m in _gguf_linears(model)} == {GGUFLinear}


def test_without_cuda_it_is_refused_in_one_line_before_any_linear_changes(tmp_path, monkeypatch):
    model = _load(*_tiny_flux_gguf(tmp_path))
    # Triton importable, its kernels built for the GPU (not the interpreter), and no GPU.
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "dlo.backend.gguf_kernels", types.SimpleNamespace(INTERPRETED=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as refused:
        dlo.use_gguf_kernels(model)
    message = str(refused.value)
    assert "\n" not in message and "runs Triton kernels on a CUDA GPU, and torch sees none" in message
    assert {type(m) for m in _gguf_linears(model)} == {GGUFLinear}


def test_a_model_without_gguf_linears_or_already_swapped_is_refused(tmp_path, with_kernels):
    with_kernels(reference_kernels())
    with pytest.raises(ConfigError, match="FluxTransformer2DModel has no diffusers GGUFLinear; load it from a GGUF"):
        dlo.use_gguf_kernels(TINY_MODELS["flux"].build(seed=0))
    model = _load(*_tiny_flux_gguf(tmp_path))
    handle = dlo.use_gguf_kernels(model)
    classes = [type(m) for m in _gguf_linears(model)]
    with pytest.raises(ConfigError, match="already runs .* GGUF Linears through the kernels; call restore"):
        dlo.use_gguf_kernels(model)
    assert [type(m) for m in _gguf_linears(model)] == classes
    handle.restore()
    dlo.use_gguf_kernels(model).restore()  # after restore() it can be asked again


def test_the_linears_keep_their_modules_and_parameters_and_restore_gives_gguf_linears_back(tmp_path, with_kernels):
    path, config_dir = _tiny_flux_gguf(tmp_path)
    reference, model = _load(path, config_dir), _load(path, config_dir)
    calls = []
    with_kernels(reference_kernels(calls))
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    linears = _gguf_linears(model)
    handle = dlo.use_gguf_kernels(model)
    assert handle.converted == len(linears) > 0 and handle.left == {}
    assert {type(m).__name__ for m in linears} == {"GGUFKernelLinear"}
    assert all(isinstance(m, GGUFLinear) for m in linears)  # still diffusers' GGUFLinear to diffusers
    assert dict(model.named_modules()) == modules  # the same module objects, in the same places
    assert all(p is parameters[n] for n, p in model.named_parameters())
    assert not any(vars(m).get("forward") for m in linears)  # no instance forward: the class changed
    assert [torch.equal(a, b) for a, b in zip(_outputs(reference), _outputs(model))] == [True, True]
    assert len(calls) == 2 * len(linears) and {(q, d) for q, d, _ in calls} == {("Q8_0", torch.uint8)}
    handle.restore()
    handle.restore()  # idempotent
    assert {type(m) for m in linears} == {GGUFLinear}
    assert dict(model.named_modules()) == modules and all(p is parameters[n] for n, p in model.named_parameters())
    calls.clear()
    _outputs(model)
    assert calls == []  # diffusers' own forward again


@pytest.mark.parametrize("order", ["kernels-then-enable", "enable-then-kernels"])
def test_streamed_with_the_kernels_equals_resident_with_them_whichever_comes_first(tmp_path, with_kernels, order):
    path, config_dir = _tiny_flux_gguf(tmp_path)
    resident, streamed = _load(path, config_dir), _load(path, config_dir)
    calls = []
    with_kernels(reference_kernels(calls))
    with dlo.use_gguf_kernels(resident):
        expected = _outputs(resident, seeds=(1, 2, 3))
    packed = {n: p for n, p in streamed.named_parameters() if type(p).__name__ == "GGUFParameter"}
    calls.clear()
    if order == "kernels-then-enable":
        kernels = dlo.use_gguf_kernels(streamed)
        handle = dlo.enable(streamed, "cpu")
    else:
        handle = dlo.enable(streamed, "cpu")
        kernels = dlo.use_gguf_kernels(streamed)
    with handle, kernels:
        got = _outputs(streamed, seeds=(1, 2, 3))
        assert handle.stats().streamed_blocks > 0
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True, True, True]
    assert calls and {(q, d) for q, d, _ in calls} == {("Q8_0", torch.uint8)}  # the slot's packed bytes
    assert {type(m) for m in _gguf_linears(streamed)} == {GGUFLinear}
    after = dict(streamed.named_parameters())
    assert all(after[n] is p and p.quant_type.name == "Q8_0" for n, p in packed.items())


def test_linears_of_types_the_kernels_do_not_take_keep_diffusers_dequantization(tmp_path, with_kernels, caplog):
    path, config_dir = _tiny_flux_gguf(tmp_path, "Q5_0")
    reference, model = _load(path, config_dir), _load(path, config_dir)
    calls = []
    with_kernels(reference_kernels(calls, quants=("Q8_0",)))
    with caplog.at_level("INFO", logger="dlo"):
        handle = dlo.use_gguf_kernels(model)
    assert handle.converted == 0 and handle.left == {"Q5_0": len(_gguf_linears(model))}
    assert "keep diffusers' torch dequantization" in caplog.text
    assert [torch.equal(a, b) for a, b in zip(_outputs(reference), _outputs(model))] == [True, True]
    assert calls == []


def test_a_call_with_a_swapped_linears_weight_on_the_cpu_is_refused(tmp_path, with_kernels):
    model = _load(*_tiny_flux_gguf(tmp_path))
    with_kernels(reference_kernels(on_cpu=False))  # kernels that run on CUDA only, as Triton's do
    with dlo.use_gguf_kernels(model):
        with pytest.raises(StreamingError) as refused:
            _outputs(model)
    message = str(refused.value)
    assert "\n" not in message and "weight (Q8_0) is on cpu and the kernels run on CUDA" in message


# Triton's CPU interpreter: the real kernels, where Triton is installed.


@pytest.fixture(scope="module")
def interpreted():
    """dlo.backend.gguf_kernels built for Triton's interpreter, as a module of its own (the
    kernels are built when the module runs; dlo's own import of it is left alone)."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        name = "dlo_gguf_kernels_interpreted"
        source = Path(gguf_kernel_linears.__file__).with_name("gguf_kernels.py")
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    assert module.INTERPRETED
    return module


@pytest.fixture
def interpreting(interpreted, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton checks it again when a kernel first runs
    return interpreted


@pytest.mark.parametrize("quant", KERNEL_QUANTS)
def test_interpreted_kernels_equal_diffusers_dequantization_bit_for_bit(interpreting, quant):
    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    assert (interpreting.KERNELS[quant].values, interpreting.KERNELS[quant].bytes) == (values, nbytes)
    for rows, columns, finite in [(5, 512, True), (3, 256, False), (1, 1024, True)]:  # partial programs too
        packed = random_blocks(quant, rows, columns, seed=rows, finite=finite)
        dense = dequantize_gguf_tensor(gguf_parameter(packed, quant))
        for dtype in DTYPES:
            got = interpreting.dequantize(packed, quant, dtype)
            assert got.shape == (rows, columns) and got.dtype == dtype
            assert same_values(got, dense.to(dtype)), (rows, columns, finite, dtype)


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_1"])
def test_interpreted_kernels_streamed_equal_resident_and_diffusers(tmp_path, interpreting, with_kernels, quant):
    path, config_dir = _tiny_flux_gguf(tmp_path, quant, WIDE_FLUX)
    plain, resident, streamed = (_load(path, config_dir) for _ in range(3))
    with_kernels(Kernels(interpreting.dequantize, frozenset(interpreting.KERNELS), interpreting.DTYPES, True))
    expected = _outputs(plain)
    with dlo.use_gguf_kernels(resident) as handle:
        assert handle.converted > 0
        got_resident = _outputs(resident)
    with dlo.use_gguf_kernels(streamed), dlo.enable(streamed, "cpu"):
        got_streamed = _outputs(streamed)
    assert [torch.equal(a, b) for a, b in zip(got_resident, got_streamed)] == [True, True]
    assert [torch.equal(a, b) for a, b in zip(expected, got_resident)] == [True, True]
