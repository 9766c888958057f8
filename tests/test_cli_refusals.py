"""Bad flags and bad pipelines are refused before any weight loads: one line `dlo: error: ...`,
status 2, naming the flag and what it allows."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

import diffusers
import pytest

import dlo
from dlo.cli import model_source
from dlo.cli.generate_job import MAX_SEED
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


@pytest.fixture
def hub_never_asked(monkeypatch):
    """Looking a hub id up (the cache, or a download of tens of GB) fails the test."""

    def looked_up(repo_id, cache_only):
        raise AssertionError(f"the hub was asked for {repo_id} before the refusal")

    monkeypatch.setattr(model_source, "_hub_snapshot", looked_up)


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
        ("flux", ["--seed", "-1"], f"argument --seed: must be from 0 to {MAX_SEED}, got -1"),
        ("flux", ["--seed", str(2**64)], f"argument --seed: must be from 0 to {MAX_SEED}, got {2**64}"),
        ("flux", ["--nproc", "3", "--parallel", "dp", "--seed", str(MAX_SEED - 1)],
         f"--seed {MAX_SEED - 1}: with --parallel dp rank r uses --seed + r, and rank 2's would be over {MAX_SEED}; "
         f"give at most {MAX_SEED - 2}"),
        ("flux", ["--guidance", "nan"], "argument --guidance: must be a finite number, got nan"),
        ("flux", ["--guidance=-inf"], "argument --guidance: must be a finite number, got -inf"),
        # the name fits the filesystem's 255 bytes, the partial file written beside it does not
        ("flux", ["--output", "{tmp}/" + "a" * 240 + ".png"], "then renamed, and that file cannot be created (File name too long); give a shorter name"),
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
        (["--output", "{tmp}/x.mp3"], "--output {tmp}/x.mp3: write one of .png, .jpg, .jpeg, .webp (images) or .mp4, .gif, .webp (videos)"),
        (["--device", "xla"], "--device xla: dlo streams to 'cuda' devices"),
        (["--device", "cuda:99"], "--device cuda:99 but "),  # no CUDA here, or fewer devices
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--num-slots", "0"], "--num-slots must be >= 2, got 0"),
        (["--resident", "auto", "--nproc", "2", "--parallel", "dp"], "--resident-layers auto needs rank-local mode"),
        (["--gather-chunk-mib", "32"], "--gather-chunk-mib 32 sizes all-gather mode's collectives and does nothing without it: set --use-allgather"),
        (["--nproc", "2", "--parallel", "dp", "--device", "cpu:1"], "--device cpu:1: with --nproc each rank takes its own device"),
        (["--seed", str(2**64)], f"argument --seed: must be from 0 to {MAX_SEED}"),
        (["--nproc", "2", "--parallel", "dp", "--seed", str(MAX_SEED)], f"give at most {MAX_SEED - 1}"),
    ],
)
def test_generate_refuses_what_the_flags_alone_show_before_asking_the_hub(flags, line, tmp_path, hub_never_asked, weights_never_load, capsys):
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    output = [] if "--output" in flags else ["--output", str(tmp_path / "x.png")]
    argv = ["generate", "some-org/some-model", "--prompt", "x", *output, *flags]
    assert line.format(tmp=tmp_path) in refusal(argv, capsys)
    assert list(tmp_path.iterdir()) == []  # the probe left nothing


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--max-queue", "-1"], "--max-queue -1: give 0 or more"),
        (["--timeout-s", "nan"], "--timeout-s nan: give a number of seconds > 0"),
        (["--timeout-s", "inf"], "--timeout-s inf: give a number of seconds > 0"),
        (["--timeout-s", "0"], "--timeout-s 0.0: give a number of seconds > 0"),
        (["--keep-videos-s", "0"], "--keep-videos-s 0.0: give a number of seconds > 0"),
        (["--keep-videos-s", "nan"], "--keep-videos-s nan: give a number of seconds > 0"),
        (["--stall-timeout-s", "-1"], "--stall-timeout-s -1.0: give a number of seconds > 0, or 0 for never"),
        (["--stall-timeout-s", "inf"], "--stall-timeout-s inf: give a number of seconds > 0, or 0 for never"),
        (["--stall-timeout-s", "nan"], "--stall-timeout-s nan: give a number of seconds > 0, or 0 for never"),
        (["--port", "0"], "argument --port: must be from 1 to 65535, got 0"),
        (["--port", "70000"], "argument --port: must be from 1 to 65535, got 70000"),
    ],
)
def test_serve_refuses_bad_flags_before_anything_loads(flags, line, hub_never_asked, weights_never_load, capsys):
    assert line in refusal(["serve", "some-org/some-model", "--device", "cpu", *flags], capsys)


@contextlib.contextmanager
def permissions_apply():
    """Root passes every permission check: as root, run the body with the effective uid of
    `nobody` (the real uid stays root, to switch back); as anyone else, as is."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_an_existing_output_in_a_directory_that_takes_no_new_file_is_refused_and_kept(hub_never_asked, capsys):
    # Outside pytest's tmp_path: its parents are closed to other users.
    base = tempfile.mkdtemp(prefix="dlo-readonly-dir-")
    directory = os.path.join(base, "out")
    existing = os.path.join(directory, "keep.png")
    try:
        os.chmod(base, 0o755)
        os.mkdir(directory)
        with open(existing, "wb") as file:
            file.write(b"old")
        os.chmod(existing, 0o666)  # the file itself can be written, by anyone
        os.chmod(directory, 0o555)  # but no file can be created beside it
        with permissions_apply():
            line = refusal(["generate", "some-org/some-model", "--prompt", "x", "--output", existing], capsys)
        assert line == (
            f"dlo: error: --output {existing}: it is written as .keep.dlo-partial-{os.getpid()}.png beside it, then "
            f"renamed, and that file cannot be created (Permission denied); make {directory} writable, or write elsewhere"
        )
        with open(existing, "rb") as file:
            assert file.read() == b"old"
        assert os.listdir(directory) == ["keep.png"]
    finally:
        os.chmod(directory, 0o755)
        shutil.rmtree(base)


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
    from dlo.pipelines.output_path import check_writable

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
