"""An output computed from non-finite values is refused, never written (issue 35): a NaN cast to
8 bits is 0, so a damaged weight file used to give an all-black image and exit status 0."""

import shutil
import subprocess
import sys

import pytest
import torch

from dlo.pipelines.media_output import NonFiniteOutput, check_finite
from dlo.models.tiny import TINY_MODELS
from nan_weights import poison

DLO = [sys.executable, "-m", "dlo.cli.main"]
def refusal(done):
    """The one `dlo: error:` line of a refused run (progress bars aside), after status 1."""
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.startswith("dlo")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_generate_refuses_an_image_from_a_damaged_transformer_and_writes_nothing(tiny_flux_dir, tmp_path):
    model = tmp_path / "flux"
    shutil.copytree(tiny_flux_dir, model)
    poison(model / "transformer" / "diffusion_pytorch_model.safetensors", "proj_out.weight")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["generate", str(model), "--prompt", "a red cube", "--device", "cpu", "--steps", "2", "--height", "32",
            "--width", "32", "--output", str(out / "cube.png")]
    done = subprocess.run([*DLO, *argv], capture_output=True, text=True, timeout=300)
    line = refusal(done)
    assert line.startswith("dlo: error: the generated image has 3072 non-finite values (NaN or infinity) of 3072; "
                           "nothing was written.")
    assert "check the model's files, or try another --dtype" in line
    assert list(out.iterdir()) == []


def test_demo_refuses_a_run_of_a_damaged_checkpoint_and_saves_no_outputs(tmp_path):
    checkpoint = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=0).save_pretrained(checkpoint)
    poison(checkpoint / "diffusion_pytorch_model.safetensors", "proj_out.weight")
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "wan", "--from-checkpoint", str(checkpoint), "--device", "cpu", "--steps", "2",
            "--save-outputs", str(saved)]
    done = subprocess.run([*DLO, *argv], capture_output=True, text=True, timeout=300)
    line = refusal(done)
    assert line.startswith("dlo: error: the resident run's output at step 1 has ") and "non-finite values" in line
    assert done.stdout == "" and not saved.exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_any_non_finite_value_is_refused_naming_how_many(value):
    values = torch.zeros(2, 3)
    values[1, 2] = value
    with pytest.raises(NonFiniteOutput, match=r"^the output has 1 non-finite values \(NaN or infinity\) of 6; "):
        check_finite("the output", values.numpy())
    check_finite("the output", torch.zeros(2, 3, dtype=torch.bfloat16))  # finite: nothing to say
