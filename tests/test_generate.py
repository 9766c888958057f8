"""`dlo generate` and `dlo.enable_pipeline` on tiny but complete local pipelines."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import dlo
from dlo.cli.main import main
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS

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


@pytest.mark.parametrize("suffix", [".gif", ".webp"])
def test_generate_writes_an_animation_without_an_mp4_encoder(tiny_wan_dir, tmp_path, suffix):
    out = tmp_path / f"clip{suffix}"
    assert main(["generate", str(tiny_wan_dir), "--prompt", "a cat", "--device", "cpu", "--output", str(out), *flags("wan")]) == 0
    animation = Image.open(out)
    assert animation.n_frames == 5 and animation.size == (32, 32)


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
        ("flux", "a.mp3", "makes an image; write one of .png"),
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


def test_frames_on_an_image_pipeline_is_refused(tiny_flux_dir, tmp_path, capsys):
    args = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--frames", "5", "--output", str(tmp_path / "a.png")]
    assert main(args) == 2
    assert "--frames: FluxPipeline does not take it" in capsys.readouterr().err


def test_enable_pipeline_needs_a_transformer():
    class NotAPipeline:
        components = {"unet": torch.nn.Linear(2, 2)}

    with pytest.raises(dlo.ConfigError, match="has no transformer component"):
        dlo.enable_pipeline(NotAPipeline(), "cpu")


def test_mp4_without_an_encoder_is_refused_with_the_alternatives(tiny_wan_dir, tmp_path):
    import subprocess
    import sys

    # A real failed import in a fresh interpreter: imageio_ffmpeg is absent there.
    code = (
        "import sys; sys.modules['imageio_ffmpeg'] = None; from dlo.cli.main import main; "
        f"sys.exit(main(['generate', {str(tiny_wan_dir)!r}, '--prompt', 'x', '--device', 'cpu', "
        f"'--output', {str(tmp_path / 'a.mp4')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no MP4 encoder (pip install imageio-ffmpeg); write an animated .webp or .gif instead" in done.stderr


def test_pipeline_components_go_to_the_device_while_they_fit_the_room_left():
    from dlo.backend.pipeline import place_within

    sizes = {"text_encoder": 60, "vae": 30, "text_encoder_2": 20}
    assert place_within(sizes, room=100) == {"text_encoder": "device", "vae": "device", "text_encoder_2": "cpu offload"}
    assert place_within(sizes, room=50) == {"text_encoder": "cpu offload", "vae": "device", "text_encoder_2": "cpu offload"}
    assert place_within(sizes, room=-5) == dict.fromkeys(sizes, "cpu offload")
