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
from plain_pipeline import plain_pipeline  # noqa: E402
from test_generate import flags, reference_call  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_peft():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notices on adapters it injects
        yield


def _image(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_generate_with_two_loras_equals_the_plain_pipeline_with_them(tiny_flux_dir, tiny_flux_loras, tmp_path, capsys):
    out = tmp_path / "cube.png"
    # b given as its directory: diffusers' file name there
    argv = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", "--output", str(out),
            *flags("flux"), "--lora", f"{tiny_flux_loras['a']}:0.7", "--lora", str(tiny_flux_loras["b"].parent)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"LoRA lora0: {tiny_flux_loras['a']} at scale 0.7" in printed and f"LoRA lora1: {tiny_flux_loras['b']} at scale 1" in printed
    pipe = plain_pipeline(tiny_flux_dir)
    base = np.asarray(reference_call(pipe, "flux").images[0])
    pipe.load_lora_weights(str(tiny_flux_loras["a"]), adapter_name="lora0")
    pipe.load_lora_weights(str(tiny_flux_loras["b"]), adapter_name="lora1")
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
        ("{tmp}", "holds a.safetensors, b.safetensors, c.safetensors; give the LoRA file's path"),
        ("{tmp}/a.safetensors", "is not a LoRA diffusers can read"),
        ("{tmp}/b.safetensors", "it holds weights for unet, which FluxPipeline has no LoRA loader for"),
        ("{tmp}/c.safetensors", "it holds weights for unet, which FluxPipeline has no LoRA loader for"),
        ("{tmp}/loras/style.safetensors", "no such file or directory"),  # not taken for a hub id
    ],
    ids=["another-model", "another-size", "missing", "not-safetensors", "ambiguous-directory", "not-safetensors-data",
         "another-pipeline", "partly-another-pipeline", "missing-relative-file"],
)
def test_a_lora_that_does_not_fit_is_refused_in_one_line_before_the_pipeline_loads(
    tiny_flux_dir, tiny_flux_loras, tmp_path, capsys, nothing_loads, lora, says
):
    from safetensors.torch import save_file

    (tmp_path / "lora.bin").write_bytes(b"\0" * 8)
    (tmp_path / "a.safetensors").write_bytes(b"not a safetensors file")
    save_file({"unet.down.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "b.safetensors")
    text_encoder = {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32)}
    save_file({"unet.down.lora_A.weight": torch.zeros(2, 2), **text_encoder}, tmp_path / "c.safetensors")
    given = lora.format(tmp=tmp_path, **tiny_flux_loras)
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "x.png"),
            *flags("flux"), "--lora", given]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dlo: error: --lora {given}: ") and says in err[0], err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "M", "--prompt", "x", "--output", "x.png", "--lora", "a.safetensors:1e3"],
         "argument --lora: the scale of 'a.safetensors:1e3': give one from -100 to 100"),
        (["generate", "M", "--prompt", "x", "--output", "x.png", "--lora", ":0.5"],
         "argument --lora: ':0.5' names no file: give PATH[:SCALE]"),
        (["serve", "M", "--lora", "a.safetensors"], "argument --lora: 'a.safetensors': give NAME=PATH[:SCALE]"),
        (["serve", "M", "--lora", "a.b=x.safetensors"], "argument --lora: the name 'a.b': use 1 to 64 letters"),
        (["serve", "M", "--lora", "s=x.safetensors", "--lora", "s=y.safetensors:0.5"],
         "--lora s=...: given twice; give each LoRA its own NAME"),
    ],
    ids=["scale-too-large", "no-path", "serve-no-name", "serve-bad-name", "serve-same-name"],
)
def test_lora_flags_are_refused_in_one_line_before_anything_is_looked_up(argv, says, capsys):
    try:
        status = main(argv)
    except SystemExit as parser_exit:  # argparse's own refusal of a flag's value
        status = parser_exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and says in err[0], err


def test_a_hub_id_lora_is_found_in_the_cache_and_one_not_there_is_named_offline(tiny_flux_loras, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from hub_layout import cache_repo

    from dlo.cli.lora_flags import lora_flag
    from dlo.cli.model_source import resolve_lora
    from dlo.errors import ConfigError

    hub = cache_repo(tmp_path / "hub", "org/style-lora", tiny_flux_loras["a"].parent)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    lora = resolve_lora(lora_flag("org/style-lora:0.5"), "lora0", "--offline was given")
    assert lora.path.name == "pytorch_lora_weights.safetensors" and lora.path.read_bytes() == tiny_flux_loras["a"].read_bytes()
    assert lora.scale == 0.5 and lora.flag == "--lora org/style-lora:0.5"
    with pytest.raises(ConfigError, match=r"^--lora org/absent: not in the Hugging Face cache .* and --offline was given"):
        resolve_lora(lora_flag("org/absent"), "lora0", "--offline was given")


def test_a_path_with_a_colon_is_taken_whole_where_it_exists_and_only_plain_numbers_are_scales(tmp_path):
    from dlo.cli.lora_flags import lora_flag, named_lora_flag

    (tmp_path / "run:2").mkdir()
    assert (lora_flag(f"{tmp_path}/run:2").target, lora_flag(f"{tmp_path}/run:2").scale) == (f"{tmp_path}/run:2", 1.0)
    assert (lora_flag(f"{tmp_path}/run:2:0.5").target, lora_flag(f"{tmp_path}/run:2:0.5").scale) == (f"{tmp_path}/run:2", 0.5)
    for odd in ("1_0", " 2", "nan", "inf"):  # float() takes these; a scale is written as a plain number
        assert lora_flag(f"a.safetensors:{odd}").target == f"a.safetensors:{odd}"
    flag = named_lora_flag("style=x.safetensors:-.5")
    assert (flag.name, flag.target, flag.scale, flag.text()) == ("style", "x.safetensors", -0.5, "--lora style=x.safetensors:-.5")


def test_a_lora_diffusers_then_fails_to_load_is_one_line_not_a_traceback(tiny_flux_dir, tmp_path, capsys):
    """A text encoder's layers are not checked before loading (dlo builds only the transformer
    on the meta device): diffusers' failure there is still one line naming the flag."""
    from safetensors.torch import save_file

    path = tmp_path / "te.safetensors"
    save_file({"text_encoder.text_model.encoder.layers.99.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32),
               "text_encoder.text_model.encoder.layers.99.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)}, path)
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "x.png"),
            *flags("flux"), "--lora", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dlo: error: --lora {path}: diffusers could not load it ("), err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("listing", "chosen"),
    [
        (["README.md", "pytorch_lora_weights.safetensors", "checkpoint-500/pytorch_lora_weights.safetensors"],
         "pytorch_lora_weights.safetensors"),
        (["style.safetensors", "samples/a.png", "old/style-v1.safetensors"], "style.safetensors"),
        (["a.safetensors", "b.safetensors"], "holds a.safetensors, b.safetensors at its root; download the LoRA file"),
        (["model_index.json", "flux1-dev.safetensors"], "is a pipeline repository, not a LoRA"),
    ],
    ids=["diffusers-name", "only-root-file", "several", "a-pipeline"],
)
def test_a_hub_lora_downloads_one_root_file_chosen_from_the_repository_listing(monkeypatch, listing, chosen):
    """Online, the listing (no download) picks the one file snapshot_download then fetches: never
    every .safetensors of the repository (checkpoints, subfolders, a whole model)."""
    import huggingface_hub

    from dlo.cli.model_source import _hub_lora_file
    from dlo.errors import ConfigError

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: listing)  # the hub, unreachable here
    if chosen.endswith(".safetensors"):
        assert _hub_lora_file("org/lora", "--lora org/lora") == chosen
    else:
        with pytest.raises(ConfigError, match=chosen):
            _hub_lora_file("org/lora", "--lora org/lora")
