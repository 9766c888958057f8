"""`dlo generate --lora` and `dlo serve --lora`'s checks: real LoRA files (diffusers'
save_lora_weights, seeded) on the tiny pipelines, the output against the plain pipeline with the
same adapters; every refusal before the pipeline loads. The server's per-request `lora` field is
tested on a real server in test_serve.py."""

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from dlo.cli import generate_job
from dlo.cli.main import main

diffusers = pytest.importorskip("diffusers")
from lora_files import save_lora  # noqa: E402  (needs diffusers)
from plain_pipeline import plain_pipeline  # noqa: E402
from test_generate import flags, reference_call  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_peft():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notices on adapters it injects
        yield


@pytest.fixture(scope="module")
def flux_loras(tiny_flux_dir, tiny_wan_dir, tmp_path_factory):
    """Adapters a and b for the tiny Flux pipeline's transformer; a LoRA of the tiny Wan
    pipeline's (another model), and one of a wider Flux (another size of the model)."""
    directory = tmp_path_factory.mktemp("pipeline-loras")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    made = {name: save_lora(transformer, "flux", name, directory, seed) for seed, name in enumerate("ab", 1)}
    wan = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer")
    made["wan"] = save_lora(wan, "wan", "a", directory / "wan", 3)
    wider = dict(transformer.config)
    wider["num_attention_heads"] += 1  # every attention Linear is wider
    made["wider"] = save_lora(diffusers.FluxTransformer2DModel.from_config(wider), "flux", "b", directory / "wider", 4)
    return made


def _image(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_generate_with_two_loras_equals_the_plain_pipeline_with_them(tiny_flux_dir, flux_loras, tmp_path, capsys):
    out = tmp_path / "cube.png"
    # b given as its directory: diffusers' file name there
    argv = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", "--output", str(out),
            *flags("flux"), "--lora", f"{flux_loras['a']}:0.7", "--lora", str(flux_loras["b"].parent)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"LoRA lora0: {flux_loras['a']} at scale 0.7" in printed and f"LoRA lora1: {flux_loras['b']} at scale 1" in printed
    pipe = plain_pipeline(tiny_flux_dir)
    base = np.asarray(reference_call(pipe, "flux").images[0])
    pipe.load_lora_weights(str(flux_loras["a"]), adapter_name="lora0")
    pipe.load_lora_weights(str(flux_loras["b"]), adapter_name="lora1")
    pipe.set_adapters(["lora0", "lora1"], [0.7, 1.0])
    expected = np.asarray(reference_call(pipe, "flux").images[0])
    assert not np.array_equal(expected, base)  # the LoRAs change the image: the comparison can fail
    assert np.array_equal(_image(out), expected)


@pytest.fixture
def nothing_loads(monkeypatch):
    """A pipeline load fails the test: every refusal comes before it."""

    def refused(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the refusal")

    monkeypatch.setattr(generate_job, "load_pipeline", refused)


@pytest.mark.parametrize(
    ("lora", "says"),
    [
        ("{wan}", "layers are not in the FluxTransformer2DModel (e.g. blocks.0."),
        ("{wider}", "has 48 output features, the transformer's 32: a LoRA for another size of the model?"),
        ("{tmp}/missing.safetensors", "no such file or directory (nor a Hugging Face hub id like org/name)"),
        ("{tmp}/lora.bin", "not a .safetensors file"),
        ("{tmp}", "holds a.safetensors, b.safetensors; give the LoRA file's path"),
        ("{tmp}/a.safetensors", "is not a LoRA diffusers can read"),
        ("{tmp}/b.safetensors", "none of its 1 weights is for a component of FluxPipeline"),
    ],
    ids=["another-model", "another-size", "missing", "not-safetensors", "ambiguous-directory", "not-safetensors-data",
         "no-lora-keys"],
)
def test_a_lora_that_does_not_fit_is_refused_in_one_line_before_the_pipeline_loads(
    tiny_flux_dir, flux_loras, tmp_path, capsys, nothing_loads, lora, says
):
    from safetensors.torch import save_file

    (tmp_path / "lora.bin").write_bytes(b"\0" * 8)
    (tmp_path / "a.safetensors").write_bytes(b"not a safetensors file")
    save_file({"unet.down.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "b.safetensors")
    given = lora.format(tmp=tmp_path, **flux_loras)
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "x.png"),
            *flags("flux"), "--lora", given]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dlo: error: --lora {given}:1: ") and says in err[0], err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "M", "--prompt", "x", "--output", "x.png", "--lora", "a.safetensors:inf"],
         "argument --lora: the scale of 'a.safetensors:inf' must be a finite number"),
        (["generate", "M", "--prompt", "x", "--output", "x.png", "--lora", ":0.5"],
         "argument --lora: ':0.5' names no file: give PATH[:SCALE]"),
        (["serve", "M", "--lora", "a.safetensors"], "argument --lora: 'a.safetensors': give NAME=PATH[:SCALE]"),
        (["serve", "M", "--lora", "a.b=x.safetensors"], "argument --lora: the name 'a.b': use 1 to 64 letters"),
        (["serve", "M", "--lora", "s=x.safetensors", "--lora", "s=y.safetensors:0.5"],
         "--lora s=...: given twice; give each LoRA its own NAME"),
    ],
    ids=["scale-inf", "no-path", "serve-no-name", "serve-bad-name", "serve-same-name"],
)
def test_lora_flags_are_refused_in_one_line_before_anything_is_looked_up(argv, says, capsys):
    try:
        status = main(argv)
    except SystemExit as parser_exit:  # argparse's own refusal of a flag's value
        status = parser_exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and says in err[0], err


def test_a_hub_id_lora_is_found_in_the_cache_and_one_not_there_is_named_offline(flux_loras, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from hub_layout import cache_repo

    from dlo.cli.lora_flags import lora_flag
    from dlo.cli.model_source import resolve_lora
    from dlo.errors import ConfigError

    hub = cache_repo(tmp_path / "hub", "org/style-lora", flux_loras["a"].parent)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    lora = resolve_lora(lora_flag("org/style-lora:0.5"), "lora0", "--offline was given")
    assert lora.path.name == "pytorch_lora_weights.safetensors" and lora.path.read_bytes() == flux_loras["a"].read_bytes()
    assert lora.scale == 0.5 and lora.flag == "--lora org/style-lora:0.5"
    with pytest.raises(ConfigError, match=r"^--lora org/absent: not in the Hugging Face cache .* and --offline was given"):
        resolve_lora(lora_flag("org/absent"), "lora0", "--offline was given")
