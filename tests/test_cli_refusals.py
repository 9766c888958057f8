"""Bad flags and bad pipelines are refused before any weight loads: one line `dlo: error: ...`,
status 2, naming the flag and what it allows."""

import shutil
import subprocess
import sys

import diffusers
import pytest

import dlo
from dlo.cli.main import main
from dlo.models.tiny import TinyModel


@pytest.fixture
def weights_never_load(monkeypatch):
    """Any weight loading (the transformer, a pipeline, a built-in model) fails the test."""

    def loaded(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(dlo, "load_transformer", loaded)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", classmethod(loaded))
    monkeypatch.setattr(TinyModel, "build", loaded)


def refusal(argv, capsys) -> str:
    """The one line `main(argv)` printed, after checking it refused with status 2."""
    try:
        status = main(argv)
    except SystemExit as exited:  # argparse's own refusals
        status = exited.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("dlo: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("pipeline", "flags", "line"),
    [
        ("flux", ["--output", "{tmp}/is-a-dir.png"], "--output {tmp}/is-a-dir.png: is a directory; give a file name inside it"),
        ("flux", ["--output", "{tmp}/a-file/x.png"], "--output {tmp}/a-file/x.png: a parent of it is a file, not a directory"),
        ("flux", ["--output", "/proc/x.png"], "--output /proc/x.png: cannot be written (No such file or directory)"),
        ("flux", ["--output", "{tmp}/missing/x.png"], "--output {tmp}/missing/x.png: directory {tmp}/missing does not exist"),
        ("wan", ["--fps", "-3", "--output", "{tmp}/x.gif"], "argument --fps: must be at least 1, got -3"),
        ("wan", ["--fps", "0", "--output", "{tmp}/x.gif"], "argument --fps: must be at least 1, got 0"),
        ("flux", ["--height", "-64"], "--height -64: FluxPipeline takes positive multiples of 16 (16, 32, ...)"),
        ("flux", ["--height", "0"], "--height 0: FluxPipeline takes positive multiples of 16 (16, 32, ...)"),
        ("wan", ["--height", "40", "--output", "{tmp}/x.gif"], "--height 40: WanPipeline takes positive multiples of 16"),
        ("wan", ["--frames", "0", "--output", "{tmp}/x.gif"], "--frames 0: WanPipeline takes 4k+1 frames (1, 5, 9, ...)"),
        ("wan", ["--frames", "6", "--output", "{tmp}/x.gif"], "--frames 6: WanPipeline takes 4k+1 frames (1, 5, 9, ...)"),
        ("flux", ["--max-sequence-length", "100000"], "--max-sequence-length 100000: FluxPipeline takes 1 to 512"),
        ("flux", ["--height", "100000", "--width", "100000"], "--height/--width/--frames 100000x100000: 39062500 transformer tokens, over the limit of 131072"),
        ("flux", ["--height", "64", "--width", "64", "--max-tokens", "15"], "64x64: 16 transformer tokens, over the limit of 15"),
        ("flux", ["--resident-layers", "100"], "--resident-layers 100: the transformer has 5 blocks; give 0 to 5"),
    ],
)
def test_generate_refuses_before_loading(pipeline, flags, line, tiny_flux_dir, tiny_wan_dir, tmp_path, weights_never_load, capsys):
    (tmp_path / "is-a-dir.png").mkdir()
    (tmp_path / "a-file").write_text("")
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[pipeline]
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    output = [] if "--output" in flags else ["--output", str(tmp_path / "x.png")]
    argv = ["generate", str(directory), "--prompt", "x", "--device", "cpu", *output, *flags]
    assert line.format(tmp=tmp_path) in refusal(argv, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "is-a-dir.png"]  # the probe left nothing


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--resident-layers", "100"], "--resident-layers 100: wan-demo has 8 blocks; give 0 to 8"),
        (["--model", "flux", "--resident-layers", "6"], "--resident-layers 6: flux has 5 blocks; give 0 to 5"),
        (["--trace", "/nonexistent-dir/t.json"], "--trace /nonexistent-dir/t.json: directory /nonexistent-dir does not exist"),
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ],
)
def test_demo_refuses_before_building(flags, line, weights_never_load, capsys):
    assert line in refusal(["demo", "--device", "cpu", *flags], capsys)


def test_an_existing_output_file_is_kept_by_the_probe(tmp_path):
    from dlo.cli.output_path import check_writable

    existing = tmp_path / "keep.png"
    existing.write_bytes(b"old")
    check_writable(existing, "--output")
    assert existing.read_bytes() == b"old"


@pytest.fixture
def damaged_flux_dir(tiny_flux_dir, tmp_path):
    return shutil.copytree(tiny_flux_dir, tmp_path / "flux")


def test_a_garbage_vae_file_is_one_line_naming_component_and_file(damaged_flux_dir, weights_never_load, capsys):
    weights = damaged_flux_dir / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{not a header}" + bytes(100))
    argv = ["generate", str(damaged_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(damaged_flux_dir / "a.png")]
    assert f"dlo: error: vae: {weights}: header_invalid" in refusal(argv, capsys)


def test_a_missing_text_encoder_names_its_directory(damaged_flux_dir, weights_never_load, capsys):
    shutil.rmtree(damaged_flux_dir / "text_encoder")
    argv = ["generate", str(damaged_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(damaged_flux_dir / "a.png")]
    assert refusal(argv, capsys) == (
        f"dlo: error: text_encoder: {damaged_flux_dir / 'text_encoder'} is missing "
        "(model_index.json lists a transformers CLIPTextModel there)"
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["generate", "{flux}", "--prompt", "x", "--output", "{tmp}/out.png"], "--output {tmp}/out.png: is a directory"),
        (["demo", "--resident-layers", "100"], "--resident-layers 100: wan-demo has 8 blocks; give 0 to 8"),
    ],
    ids=["output-is-a-directory", "demo-resident-layers"],
)
def test_the_process_prints_one_line_and_exits_2(argv, line, tiny_flux_dir, tmp_path):
    (tmp_path / "out.png").mkdir()
    argv = [a.format(flux=tiny_flux_dir, tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-m", "dlo.cli.main", *argv, "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()] and line.format(tmp=tmp_path) in done.stderr
