"""diffusers GGUF models streamed by dlo.enable: each GGUFParameter's packed bytes stream as
they are and the forward dequantizes them as diffusers' resident GGUF model does, bit for bit,
for every quant type diffusers dequantizes. Real GGUF files (gguf_files.py). See [Note: GGUF
streaming] in dlo.planning.gguf_weights."""

import importlib.util

import pytest
import torch

import dlo
from dlo.errors import StreamingError
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, dequantize_gguf_tensor  # noqa: E402
from gguf_files import WIDE_WAN, load_gguf, quiet_diffusers, write_gguf  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet_diffusers")

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def wide_wan(tmp_path_factory):
    """A seeded Wan transformer wide enough for every quant type, and its config's directory."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WIDE_WAN)
    directory = tmp_path_factory.mktemp("wide-wan")
    model.save_config(directory)
    return model, directory


def _tiny_gguf(tmp_path, name, quant_type):
    """(file, config directory, class name) of dlo.models.tiny's `name` written as `quant_type`."""
    model = TINY_MODELS[name].build(seed=0)
    model.save_config(tmp_path)
    return write_gguf(model, tmp_path / f"{quant_type.name}.gguf", quant_type), tmp_path, type(model).__name__


def _outputs(model, name="flux", seeds=(1, 2)):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed))[0] for seed in seeds]


def _gguf_parameters(model):
    return {n: p for n, p in model.named_parameters() if type(p).__name__ == "GGUFParameter"}


@pytest.mark.parametrize("quant_type", SUPPORTED_GGUF_QUANT_TYPES, ids=lambda q: q.name)
def test_every_quant_type_streams_its_packed_bytes_and_equals_the_resident_gguf_model(tmp_path, wide_wan, quant_type):
    model, config_dir = wide_wan
    path, cls = write_gguf(model, tmp_path / "model.gguf", quant_type), "WanTransformer3DModel"
    reference, streamed = load_gguf(path, config_dir, cls), load_gguf(path, config_dir, cls)
    packed = _gguf_parameters(streamed)
    assert any(n.startswith("blocks.") for n in packed)  # the blocks hold GGUF weights
    expected = _outputs(reference, "wan", seeds=(1,))
    assert torch.isfinite(expected[0]).all()
    seen = {}

    def record(module, args):  # inside the call: the same parameter, on the slot's packed bytes
        seen[module] = (type(module.weight).__name__, module.weight.quant_type, module.weight.dtype)

    hooks = [m.register_forward_pre_hook(record) for m in streamed.modules() if type(m).__name__ == "GGUFLinear"]
    with dlo.enable(streamed, "cpu") as handle:
        got = _outputs(streamed, "wan", seeds=(1,))
        stats = handle.stats()
    for hook in hooks:
        hook.remove()
    assert torch.equal(expected[0], got[0])
    assert set(seen.values()) == {("GGUFParameter", quant_type, torch.uint8)}
    block_bytes = sum(p.nbytes for n, p in packed.items() if n.startswith("blocks."))
    assert stats.host_bytes_by_dtype["uint8"] == block_bytes  # packed as in the file, not dequantized
    after = streamed.state_dict()
    assert all(torch.equal(after[k], v) for k, v in reference.state_dict().items())
    assert all(type(after[n]).__name__ == "GGUFParameter" and after[n].quant_type == p.quant_type for n, p in packed.items())


@pytest.mark.parametrize(
    "config",
    [
        dlo.OffloadConfig(stream_dtype="fp8"),  # the blocks' float weights as float8, the GGUF ones packed
        dlo.OffloadConfig(resident_layers=1),
        dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=1.0),
        dlo.OffloadConfig(num_slots=3),
    ],
    ids=["fp8", "resident-block", "auto-residency", "three-slots"],
)
@pytest.mark.parametrize("name", ["wan", "flux"])
def test_gguf_blocks_with_every_mode_equal_the_resident_gguf_model_the_same_way(tmp_path, config, name):
    path, config_dir, cls = _tiny_gguf(tmp_path, name, Q.Q8_0)
    reference, streamed = load_gguf(path, config_dir, cls), load_gguf(path, config_dir, cls)
    dlo.quantize_resident(reference, config)
    expected = _outputs(reference, name, seeds=(1, 2, 3))
    with dlo.enable(streamed, "cpu", config) as handle:
        got = _outputs(streamed, name, seeds=(1, 2, 3))
        stats = handle.stats()
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True, True, True]
    # auto: the first calls stream every block, then the budget (ample here) keeps them all resident
    assert stats.resident_blocks > 0 if config.resident_layers else stats.streamed_blocks > 0


def test_between_calls_a_gguf_weight_reads_nan_and_a_new_tensor_for_it_is_refused(tmp_path):
    path, config_dir, cls = _tiny_gguf(tmp_path, "flux", Q.Q8_0)
    reference, streamed = load_gguf(path, config_dir, cls), load_gguf(path, config_dir, cls)
    expected = _outputs(reference, seeds=(3,))
    with dlo.enable(streamed, "cpu"):
        _outputs(streamed)
        weight = streamed.transformer_blocks[1].attn.to_q.weight
        assert type(weight).__name__ == "GGUFParameter" and torch.isnan(dequantize_gguf_tensor(weight.clone())).all()
        weight.data = torch.zeros_like(weight.data)
        with pytest.raises(StreamingError, match=r"'transformer_blocks\.1\.attn\.to_q\.weight' was written in place"):
            _outputs(streamed)
        assert [torch.equal(a, b) for a, b in zip(expected, _outputs(streamed, seeds=(3,)))] == [True]


def test_fusing_a_lora_into_gguf_weights_is_refused_before_anything_fused_and_it_runs_unfused(tmp_path):
    from lora_files import save_lora

    path, config_dir, cls = _tiny_gguf(tmp_path, "wan", Q.Q8_0)
    lora = save_lora(TINY_MODELS["wan"].build(seed=0), "wan", "a", tmp_path / "lora", 1)
    reference, streamed = load_gguf(path, config_dir, cls), load_gguf(path, config_dir, cls)
    with dlo.enable(streamed, "cpu") as handle:
        _outputs(streamed, "wan")
        for model in (reference, streamed):
            model.load_lora_adapter(str(lora), adapter_name="a", prefix="transformer")
        before = {k: v.clone() for k, v in streamed.state_dict().items()}
        with pytest.raises(StreamingError, match=r"fuse_lora: the base Linear of '.*' holds a GGUF weight \(packed Q8_0"):
            handle.fuse_lora()
        assert handle.stats().rewritten_blocks == 0
        assert [torch.equal(a, b) for a, b in zip(_outputs(reference, "wan"), _outputs(streamed, "wan"))] == [True, True]
    after = streamed.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("blocks."))
    assert all(torch.equal(after[k], v) for k, v in reference.state_dict().items())


def test_after_a_refused_in_place_write_the_gguf_stand_ins_still_read_nan(tmp_path):
    """The write landed in the one uint8 stand-in every GGUF weight shares; refusing it refills
    the stand-in with 0xFF, not with a value that dequantizes to a plausible weight."""
    path, config_dir, cls = _tiny_gguf(tmp_path, "flux", Q.Q8_0)
    streamed = load_gguf(path, config_dir, cls)
    with dlo.enable(streamed, "cpu"):
        _outputs(streamed)
        weight = streamed.transformer_blocks[1].attn.to_q.weight
        with torch.no_grad():
            weight[0, 0] = 7  # an in-place write torch lets through (one element)
        with pytest.raises(StreamingError, match="was written in place"):
            _outputs(streamed)
        for other in (weight, streamed.transformer_blocks[0].attn.to_k.weight):
            assert torch.isnan(dequantize_gguf_tensor(other.clone())).all()


def test_generate_with_a_gguf_transformer_file_equals_the_plain_pipeline_with_it(tiny_flux_dir, tmp_path, capsys):
    """`dlo generate MODEL --transformer FILE.gguf`: MODEL's other components, the GGUF file's
    transformer streamed packed; the image equals the plain pipeline holding the same GGUF
    transformer. A file it cannot take is one line before anything loads."""
    import numpy as np
    from PIL import Image
    from plain_pipeline import plain_pipeline
    from test_generate import flags, reference_call

    from dlo.cli.main import main

    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    path = write_gguf(transformer, tmp_path / "flux-Q8_0.gguf", Q.Q8_0)
    out = tmp_path / "cube.png"
    argv = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", *flags("flux")]
    assert main([*argv, "--output", str(out), "--transformer", str(path)]) == 0
    pipe = plain_pipeline(tiny_flux_dir)
    base = np.asarray(reference_call(pipe, "flux").images[0])
    pipe.transformer = load_gguf(path, tiny_flux_dir / "transformer", "FluxTransformer2DModel")
    expected = np.asarray(reference_call(pipe, "flux").images[0])
    assert not np.array_equal(expected, base)  # Q8_0 changes the image: the comparison can fail
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), expected)
    capsys.readouterr()
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    (tmp_path / "model.bin").write_bytes(b"\0")
    other = write_gguf(TINY_MODELS["wan"].build(seed=0), tmp_path / "wan.gguf", Q.Q8_0)  # another model's file
    for given, says in [
        (other, "diffusers' single-file converter for FluxTransformer2DModel cannot read it"),
        (tmp_path / "bad.gguf", "header_invalid: GGUF version 0; dlo reads versions (2, 3)"),
        (tmp_path / "model.bin", "give a .gguf file or a single-file .safetensors checkpoint"),
        (tmp_path / "absent.gguf", "no such file"),
    ]:
        assert main([*argv, "--output", str(tmp_path / "x.png"), "--transformer", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dlo: error: --transformer {given}: {says}"), err
    assert main([*argv, "--output", str(tmp_path / "x.png"), "--transformer", ""]) == 2  # not taken for no flag
    assert capsys.readouterr().err.strip() == "dlo: error: --transformer .: no such file"
    assert not (tmp_path / "x.png").exists()


def test_generate_with_gguf_kernels_equals_the_plain_pipeline_and_refuses_what_it_cannot_run(
    tiny_flux_dir, tmp_path, capsys, monkeypatch
):
    """`--gguf-kernels`: the --transformer .gguf file's weights dequantize with dlo's Triton
    kernels, run here by Triton's CPU interpreter in a `dlo generate` process of its own; the
    image equals the plain pipeline holding the same GGUF transformer (diffusers' torch
    dequantization). Without a .gguf --transformer, or without CUDA, one line before loading."""
    import os
    import subprocess
    import sys

    import numpy as np
    from PIL import Image
    from plain_pipeline import plain_pipeline
    from test_generate import flags, reference_call

    from dlo.cli.main import main

    pytest.importorskip("triton")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    path = write_gguf(transformer, tmp_path / "flux-Q4_0.gguf", Q.Q4_0)
    out = tmp_path / "cube.png"
    argv = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", *flags("flux")]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "dlo.cli.main", *argv, "--output", str(out), "--transformer", str(path), "--gguf-kernels"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    pipe = plain_pipeline(tiny_flux_dir)
    pipe.transformer = load_gguf(path, tiny_flux_dir / "transformer", "FluxTransformer2DModel")
    linears = sum(type(m).__name__ == "GGUFLinear" for m in pipe.transformer.modules())
    assert linears > 0 and f"--gguf-kernels: {linears} GGUF Linears dequantize with dlo's Triton kernels" in done.stdout
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(reference_call(pipe, "flux").images[0]))
    capsys.readouterr()
    for extra, says in [
        ([], "--gguf-kernels dequantizes the weights of a --transformer .gguf file"),
        (["--transformer", str(path)], "--gguf-kernels: dlo.use_gguf_kernels runs Triton kernels on a CUDA GPU"),
    ]:
        assert main([*argv, "--output", str(tmp_path / "x.png"), "--gguf-kernels", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dlo: error: {says}"), err
    with monkeypatch.context() as driver:  # a machine with a GPU, asked for the CPU
        driver.setattr(torch.cuda, "is_available", lambda: True)
        assert main([*argv, "--output", str(tmp_path / "x.png"), "--gguf-kernels", "--transformer", str(path)]) == 2
        assert capsys.readouterr().err.strip() == (
            "dlo: error: --gguf-kernels runs Triton kernels on a CUDA device, not cpu; use --device cuda, or leave "
            "--gguf-kernels out"
        )
    assert not (tmp_path / "x.png").exists()
    if importlib.util.find_spec("fastapi") is not None:  # dlo serve checks it the same way
        assert main(["serve", str(tiny_flux_dir), "--device", "cpu", "--no-host-weight-cache", "--gguf-kernels"]) == 2
        assert capsys.readouterr().err.startswith("dlo: error: --gguf-kernels dequantizes the weights of a --transformer")
    # A serve replica's load (what each replica process runs) swaps the Linears too.
    replica = (
        "import sys, torch, dlo; from dlo.serve.replica import ReplicaSpec, _load; "
        "spec = ReplicaSpec(sys.argv[1], 'cpu', torch.float32, dlo.OffloadConfig(), (), sys.argv[2], True); "
        "pipe, handle = _load(spec); print(type(pipe.transformer.transformer_blocks[0].attn.to_q).__name__); handle.disable()"
    )
    done = subprocess.run([sys.executable, "-c", replica, str(tiny_flux_dir), str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "GGUFKernelLinear", done.stderr[-2000:]


def test_a_serve_replica_holds_the_gguf_transformer_file_and_serve_refuses_what_it_cannot_take(tiny_flux_dir, tmp_path, capsys):
    """The replica's load (in this process: what each replica process runs) with --transformer:
    its image equals the plain pipeline holding the same GGUF transformer. `dlo serve` refuses a
    damaged file before anything loads (the host weight cache on, as by default)."""
    import numpy as np
    from plain_pipeline import plain_pipeline
    from test_generate import reference_call

    from dlo.cli.main import main
    from dlo.serve.replica import ReplicaSpec, _load

    pytest.importorskip("fastapi")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    path = write_gguf(transformer, tmp_path / "flux-Q8_0.gguf", Q.Q8_0)
    pipe, handle = _load(ReplicaSpec(str(tiny_flux_dir), "cpu", torch.float32, dlo.OffloadConfig(), (), str(path)))
    try:
        assert type(pipe.transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "GGUFParameter"
        got = np.asarray(reference_call(pipe, "flux").images[0])
        assert handle.stats()["transformer"].streamed_blocks > 0
    finally:
        handle.disable()
    plain = plain_pipeline(tiny_flux_dir)
    plain.transformer = load_gguf(path, tiny_flux_dir / "transformer", "FluxTransformer2DModel")
    assert np.array_equal(got, np.asarray(reference_call(plain, "flux").images[0]))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    capsys.readouterr()  # the pipelines' progress bars
    assert main(["serve", str(tiny_flux_dir), "--device", "cpu", "--transformer", str(tmp_path / "bad.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "header_invalid: GGUF version 0" in err[0], err
