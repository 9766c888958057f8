"""An output computed from non-finite values is refused, never written (issue 35): a NaN cast to
8 bits is 0, so a damaged weight file used to give an all-black image and exit status 0."""

import shutil

import pytest
import torch

from dlo.cli.main import main
from dlo.pipelines.media_output import NonFiniteOutput, check_finite
from dlo.models.tiny import TINY_MODELS
from nan_weights import poison


def refusal(status, captured):
    """The one `dlo: error:` line of a refused run (progress bars aside), after status 1.

    In-process main() (formerly a `dlo` process each, ~8 s of imports apiece here): the
    refusal is main's status and what it wrote; the exit status is main's return
    (dlo.cli.launch and `-m dlo.cli.main` hand it to sys.exit, tests/test_cli_process.py runs
    those as processes)."""
    assert status == 1, captured.err
    lines = [line for line in captured.err.replace("\r", "\n").splitlines() if line.startswith("dlo")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.fixture
def progress_bars_restored():
    """generate quiets the libraries' loading bars for the rest of its process: put them back."""
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as transformers_logging

    yield
    transformers_logging.enable_progress_bar()
    enable_progress_bars()
    diffusers_logging.enable_progress_bar()


def test_generate_refuses_an_image_from_a_damaged_transformer_and_writes_nothing(
    tiny_flux_dir, tmp_path, capsys, progress_bars_restored
):
    model = tmp_path / "flux"
    shutil.copytree(tiny_flux_dir, model)
    poison(model / "transformer" / "diffusion_pytorch_model.safetensors", "proj_out.weight")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["generate", str(model), "--prompt", "a red cube", "--device", "cpu", "--steps", "2", "--height", "32",
            "--width", "32", "--output", str(out / "cube.png")]
    status = main(argv)
    captured = capsys.readouterr()
    line = refusal(status, captured)
    assert line.startswith("dlo: error: the generated image has 3072 non-finite values (NaN or infinity) of 3072; "
                           "nothing was written.")
    assert "check the model's files, or try another --dtype" in line
    assert list(out.iterdir()) == []


def test_demo_refuses_a_run_of_a_damaged_checkpoint_and_saves_no_outputs(tmp_path, capsys):
    checkpoint = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=0).save_pretrained(checkpoint)
    poison(checkpoint / "diffusion_pytorch_model.safetensors", "proj_out.weight")
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "wan", "--from-checkpoint", str(checkpoint), "--device", "cpu", "--steps", "2",
            "--save-outputs", str(saved)]
    status = main(argv)
    captured = capsys.readouterr()
    line = refusal(status, captured)
    assert line.startswith("dlo: error: the resident run's output at step 1 has ") and "non-finite values" in line
    assert captured.out == "" and not saved.exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_any_non_finite_value_is_refused_naming_how_many(value):
    values = torch.zeros(2, 3)
    values[1, 2] = value
    with pytest.raises(NonFiniteOutput, match=r"^the output has 1 non-finite values \(NaN or infinity\) of 6; "):
        check_finite("the output", values.numpy())
    check_finite("the output", torch.zeros(2, 3, dtype=torch.bfloat16))  # finite: nothing to say
