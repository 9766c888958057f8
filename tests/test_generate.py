"""`dlo generate` and `dlo.enable_pipeline` on tiny but complete local pipelines."""

import errno
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import dlo
from dlo.cli import model_source
from dlo.cli.main import main
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS
from dlo.pipelines.media_output import write_image

diffusers = pytest.importorskip("diffusers")
from plain_pipeline import plain_pipeline  # noqa: E402  (needs diffusers)


def flags(name):
    d = GENERATE_DEFAULTS[name]
    out = ["--steps", "2", "--height", str(d["height"]), "--width", str(d["width"])]
    out += ["--max-sequence-length", str(d["max_sequence_length"]), "--guidance", str(d["guidance_scale"])]
    return out + (["--frames", str(d["num_frames"])] if "num_frames" in d else [])


def reference_call(pipe, name, seed=0):
    kwargs = {k: v for k, v in GENERATE_DEFAULTS[name].items()}
    with torch.inference_mode():
        return pipe("a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_generate_writes_a_png_identical_to_the_plain_pipeline(tiny_flux_dir, tmp_path, capsys):
    out = tmp_path / "cube.png"
    assert main(["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", "--output", str(out), *flags("flux")]) == 0
    printed = capsys.readouterr().out
    assert "transformer" in printed and "checkpoint_mmap" in printed and f"wrote {out}" in printed
    written = Image.open(out)
    assert written.format == "PNG" and written.size == (64, 64)
    expected = reference_call(plain_pipeline(tiny_flux_dir), "flux").images[0]
    assert np.array_equal(np.asarray(written.convert("RGB")), np.asarray(expected))


def test_generate_through_a_registered_cache_is_identical_and_says_so(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    from fake_driver import FakeDriver

    from dlo.backend import cuda_registration

    monkeypatch.setattr(cuda_registration, "registration_driver", lambda device: FakeDriver())
    out = tmp_path / "cube.png"
    cache = ["--host-weight-cache", "--cache-dir", str(tmp_path / "cache")]
    assert main(["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", "--output", str(out), *flags("flux"), *cache]) == 0
    assert "host_weight_cache (registered)" in capsys.readouterr().out
    expected = reference_call(plain_pipeline(tiny_flux_dir), "flux").images[0]
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected))


def test_generate_writes_an_mp4(tiny_wan_dir, tmp_path):
    import imageio.v3 as iio

    out = tmp_path / "clip.mp4"
    assert main(["generate", str(tiny_wan_dir), "--prompt", "a cat", "--device", "cpu", "--output", str(out), *flags("wan")]) == 0
    frames = iio.imread(out, index=None)  # decoded back by ffmpeg
    assert frames.shape[0] == 5 and frames.shape[1:3] == (32, 32)


@pytest.fixture
def no_mp4_encoder(monkeypatch):
    """imageio-ffmpeg absent: its import fails (a None in sys.modules), as in an install without it."""
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)


@pytest.mark.parametrize("suffix", [".gif", ".webp"])
def test_generate_writes_an_animation_without_an_mp4_encoder(tiny_wan_dir, tmp_path, suffix, no_mp4_encoder):
    out = tmp_path / f"clip{suffix}"
    assert main(["generate", str(tiny_wan_dir), "--prompt", "a cat", "--device", "cpu", "--output", str(out), *flags("wan")]) == 0
    animation = Image.open(out)
    assert animation.n_frames == 5 and animation.size == (32, 32)


def test_mp4_without_an_encoder_is_refused_with_the_alternatives_before_the_model_is_looked_up(
    tmp_path, monkeypatch, capsys, no_mp4_encoder
):
    def looked_up(repo_id, cache_only):
        raise AssertionError("the hub was asked before the refusal")

    monkeypatch.setattr(model_source, "_hub_snapshot", looked_up)
    assert main(["generate", "some-org/a-video-model", "--prompt", "x", "--output", str(tmp_path / "a.mp4")]) == 2
    assert capsys.readouterr().err == (
        f"dlo: error: --output {tmp_path / 'a.mp4'}: no MP4 encoder (pip install 'dlo[video]'); write an animated "
        ".webp or .gif instead\n"
    )


class FailingImage:
    """An image whose encoder writes part of the file, then fails with `error`."""

    def __init__(self, error: BaseException):
        self.error = error

    def save(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half an image")
        raise self.error


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()], ids=["failed", "interrupted"])
def test_a_failed_or_interrupted_write_keeps_the_existing_output(tmp_path, error):
    existing = tmp_path / "keep.png"
    existing.write_bytes(b"the old image")
    with pytest.raises(type(error)):
        write_image(FailingImage(error), existing)
    assert existing.read_bytes() == b"the old image"
    assert list(tmp_path.iterdir()) == [existing]  # no partial file left


def test_an_interrupted_generate_keeps_the_existing_output(tiny_flux_dir, tmp_path, monkeypatch, capsys):
    def interrupted(image, path, *args, **kwargs):
        Path(path).write_bytes(b"half an image")
        raise KeyboardInterrupt  # Ctrl-C while the encoder writes

    monkeypatch.setattr(Image.Image, "save", interrupted)
    existing = tmp_path / "keep.png"
    existing.write_bytes(b"the old image")
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(existing), *flags("flux")]
    assert main(argv) == 130 and capsys.readouterr().err.endswith("dlo: interrupted\n")
    assert existing.read_bytes() == b"the old image"
    assert list(tmp_path.iterdir()) == [existing]


def test_enable_pipeline_matches_the_plain_pipeline(tiny_wan_dir):
    expected = reference_call(plain_pipeline(tiny_wan_dir), "wan").frames[0]
    pipe = plain_pipeline(tiny_wan_dir)
    with dlo.enable_pipeline(pipe, "cpu", dlo.OffloadConfig(num_slots=3)) as handle:
        got = reference_call(pipe, "wan").frames[0]
        stats = handle.stats()["transformer"]
    assert np.array_equal(got, expected)
    # 2 steps x 2 passes (classifier-free guidance) x 4 blocks, 3 slots: 16 block runs
    assert stats.streamed_blocks == 4 and stats.copies > 0
    assert set(handle.placement) == {"vae", "text_encoder"}


@pytest.mark.parametrize(
    ("setup", "output", "message"),
    [
        ("missing", "a.png", "no such directory (nor a Hugging Face hub id like org/name)"),
        ("no_index", "a.png", "no model_index.json"),
        ("unknown", "a.png", "unknown pipeline 'NoSuchPipeline'"),
        ("bad_json", "a.png", "model_index.json is not readable JSON"),
        ("unet", "a.png", "has no transformer component"),
        ("flux", "a.mp3", "write one of .png, .jpg, .jpeg, .webp (images) or .mp4, .gif, .webp (videos)"),
        ("flux", "a.mp4", "makes an image"),
        ("wan", "a.png", "makes a video; write one of .mp4"),
        ("flux", "missing-dir/a.png", "directory {tmp}/missing-dir does not exist"),
    ],
)
def test_generate_refuses_bad_input_before_loading(tmp_path, tiny_flux_dir, tiny_wan_dir, capsys, setup, output, message):
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}.get(setup, tmp_path / setup)
    if setup in ("no_index", "unknown", "unet", "bad_json"):
        directory.mkdir()
    if setup == "bad_json":
        (directory / "model_index.json").write_text("{")
    if setup == "unknown":
        (directory / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    if setup == "unet":
        index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
        (directory / "model_index.json").write_text(json.dumps(index))
    assert main(["generate", str(directory), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / output)]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_fp8_gemms_on_fp32_weights_are_refused_before_loading(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    import dlo.cli.generate as generate_cmd

    def loaded(*args, **kwargs):
        raise AssertionError("the pipeline was loaded")

    monkeypatch.setattr(generate_cmd, "generate", loaded)
    args = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "a.png")]
    assert main([*args, "--stream-dtype", "fp8", "--fp8-compute"]) == 2  # the CPU's default dtype: fp32
    assert "has no Linear to run as an FP8 GEMM (they need bf16 weights: --dtype bfloat16)" in capsys.readouterr().err


def test_frames_on_an_image_pipeline_is_refused(tiny_flux_dir, tmp_path, capsys):
    args = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--frames", "5", "--output", str(tmp_path / "a.png")]
    assert main(args) == 2
    assert "--frames: FluxPipeline does not take it" in capsys.readouterr().err


def test_enable_pipeline_needs_a_transformer():
    class NotAPipeline:
        components = {"unet": torch.nn.Linear(2, 2)}

    with pytest.raises(dlo.ConfigError, match="has no transformer component"):
        dlo.enable_pipeline(NotAPipeline(), "cpu")


def test_pipeline_components_go_to_the_device_while_they_fit_the_room_left():
    from dlo.backend.pipeline import place_within

    sizes = {"text_encoder": 60, "vae": 30, "text_encoder_2": 20}
    assert place_within(sizes, room=100) == {"text_encoder": "device", "vae": "device", "text_encoder_2": "cpu offload"}
    assert place_within(sizes, room=50) == {"text_encoder": "cpu offload", "vae": "device", "text_encoder_2": "cpu offload"}
    assert place_within(sizes, room=-5) == dict.fromkeys(sizes, "cpu offload")


def _column(printed: str, header: str) -> str:
    """The transformer row's cell under `header` in generate's statistics table."""
    lines = printed.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("component"))
    start = lines[top].index(header)
    widths = lines[top + 1]  # the dashes under each header
    end = widths.find(" ", start)
    row = next(line for line in lines[top + 2:] if line.startswith("transformer"))
    return row[start:end if end != -1 else None].strip()


def test_streamed_per_step_is_what_inspect_predicts_per_call_and_h2d_is_na_on_cpu(tiny_flux_dir, tmp_path, capsys):
    """Guidance 0: one transformer call a step. The counters also hold the prefetch of the
    next call's first block after the last step, which the per-step figure leaves out."""
    assert main(["inspect", str(tiny_flux_dir)]) == 0
    per_call = capsys.readouterr().out.split("streamed per call:")[1].split()[:2]
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "x.png")]
    assert main([*argv, *flags("flux")]) == 0  # 2 steps
    printed = capsys.readouterr().out
    per_step = _column(printed, "streamed/step")
    assert per_step.startswith(" ".join(per_call) + " (") and per_step.endswith(" over the 2 steps)")
    assert _column(printed, "H2D") == "n/a (cpu)"
    assert main([*argv, *flags("flux"), "--steps", "1"]) == 0
    assert _column(capsys.readouterr().out, "streamed/step").endswith(" in all (with the next call's prefetch)")


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_text_encoders_streamed_too_match_the_plain_pipeline(tiny_flux_dir, tiny_wan_dir, name):
    """components=: the text encoders (CLIP and T5; UMT5) stream block by block beside the
    transformer, each with its own handle and stats; the output is the plain pipeline's."""
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name]
    encoders = ["text_encoder", "text_encoder_2"] if name == "flux" else ["text_encoder"]
    expected = reference_call(plain_pipeline(directory), name)
    pipe = plain_pipeline(directory)
    with dlo.enable_pipeline(pipe, "cpu", dlo.OffloadConfig(num_slots=3), components=encoders) as handle:
        got = reference_call(pipe, name)
        stats = handle.stats()
    result = (lambda out: out.images[0]) if name == "flux" else (lambda out: out.frames[0])
    assert np.array_equal(np.asarray(result(got)), np.asarray(result(expected)))
    assert set(stats) == {"transformer", *encoders}
    assert all(stats[e].streamed_blocks > 0 and stats[e].copies > 0 for e in encoders)
    assert all(handle.placement[e] == "streamed" for e in encoders) and handle.placement["vae"] == "device"


@pytest.mark.parametrize(
    ("components", "message"),
    [
        (["text_encoder_3"], r"components names 'text_encoder_3', which is not a module component .* \['text_encoder', 'text_encoder_2', 'vae'\]"),
        (["transformer"], "components names 'transformer', which is not a module component"),
        ("text_encoder", "components must be a list of component names or 'auto'"),
    ],
)
def test_components_that_cannot_stream_are_refused_before_anything_is_enabled(tiny_flux_dir, components, message):
    pipe = plain_pipeline(tiny_flux_dir)
    before = {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(dlo.ConfigError, match=message):
        dlo.enable_pipeline(pipe, "cpu", components=components)
    assert {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()} == before
    with dlo.enable_pipeline(pipe, "cpu"):  # nothing was left enabled
        pass


def test_a_component_without_repeated_blocks_is_refused_by_name(tiny_flux_dir):
    pipe = plain_pipeline(tiny_flux_dir)
    pipe.text_encoder = torch.nn.Linear(2, 2)  # a component with nothing to stream block by block
    with pytest.raises(dlo.ConfigError, match=r"component 'text_encoder' \(Linear\) has no repeated blocks"):
        dlo.enable_pipeline(pipe, "cpu", components=["text_encoder"])


def test_components_auto_on_the_cpu_places_everything_on_the_device(tiny_flux_dir):
    """'auto' streams only what does not fit; on the CPU everything fits."""
    pipe = plain_pipeline(tiny_flux_dir)
    with dlo.enable_pipeline(pipe, "cpu", components="auto") as handle:
        assert set(handle.handles) == {"transformer"} and set(handle.placement.values()) == {"device"}


def test_generate_streams_the_components_it_is_given_equal_to_the_plain_pipeline(tiny_flux_dir, tmp_path, capsys):
    out = tmp_path / "cube.png"
    argv = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", "--output", str(out), *flags("flux")]
    assert main([*argv, "--components", "text_encoder,text_encoder_2"]) == 0
    printed = capsys.readouterr().out
    assert "text_encoder on streamed, text_encoder_2 on streamed" in printed, printed
    expected = reference_call(plain_pipeline(tiny_flux_dir), "flux").images[0]
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected))


@pytest.mark.parametrize(
    ("components", "message"),
    [
        ("tokenizer", "dlo: error: --components: components names 'tokenizer', which is not a module component"),
        ("transformer", "dlo: error: --components: components names 'transformer', which is not a module component"),
        ("text_encoder,,vae", "argument --components: 'text_encoder,,vae' is not auto nor component names"),
    ],
)
def test_generate_refuses_components_it_cannot_stream_before_loading(tiny_flux_dir, tmp_path, capsys, monkeypatch, components, message):
    import dlo.cli.generate as generate_cmd

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline loaded before --components was checked")

    monkeypatch.setattr(generate_cmd, "generate", no_load)
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--output", str(tmp_path / "a.png")]
    try:
        status = main([*argv, *flags("flux"), "--components", components])
    except SystemExit as usage_error:  # argparse's: the flag's own form
        status = usage_error.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
