"""Writing generated images and videos, and knowing in advance which files can be written."""

from __future__ import annotations

from pathlib import Path

from dlo.errors import ConfigError, DloError
from dlo.pipelines.output_path import published

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".gif", ".webp")
# A pipeline call's output as float arrays, before the cast to 8 bits: a NaN cast to uint8
# becomes 0, so an image computed from non-finite values would be written as a black one.
ARRAY_OUTPUT = {"output_type": "np"}


class NonFiniteOutput(DloError, ArithmeticError):
    """A computed output holds NaN or infinity; nothing was written (exit status 1)."""


def check_finite(what: str, values: object) -> None:
    """Refuse `values` (an array or tensor) holding NaN or infinity, in one line naming `what`."""
    import torch

    tensor = torch.as_tensor(values)
    bad = int(tensor.numel() - torch.isfinite(tensor).sum())
    if bad:
        raise NonFiniteOutput(
            f"{what} has {bad} non-finite values (NaN or infinity) of {tensor.numel()}; nothing was written. Damaged "
            "weights or a float16 overflow cause this: check the model's files, or try another --dtype"
        )


def finite_media(result: object, video: bool) -> object:
    """The first image (a PIL image) or video (its frames, an array) of a pipeline call made
    with ARRAY_OUTPUT, refused by check_finite before anything is made of it."""
    media = result.frames[0] if video else result.images[0]
    check_finite("the generated video" if video else "the generated image", media)
    if video:
        return media
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(media)[0]  # as the pipeline's own output_type="pil"


def has_mp4_encoder() -> bool:
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return False
    return True


def check_output_suffix(path: Path) -> None:
    """Refuse, from the flag alone (before a model is looked up), a suffix no pipeline writes,
    or an MP4 without its encoder."""
    suffix = path.suffix.lower()
    if suffix not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise ConfigError(
            f"--output {path}: write one of {', '.join(IMAGE_SUFFIXES)} (images) or {', '.join(VIDEO_SUFFIXES)} (videos)"
        )
    if suffix == ".mp4" and not has_mp4_encoder():
        raise ConfigError(
            f"--output {path}: no MP4 encoder (pip install 'dlo[video]'); write an animated .webp or .gif instead"
        )


def check_output_kind(path: Path, video: bool) -> None:
    """Refuse, before any model is loaded, an output format this pipeline cannot write."""
    allowed = VIDEO_SUFFIXES if video else IMAGE_SUFFIXES
    if path.suffix.lower() not in allowed:
        kind = "a video" if video else "an image"
        raise ConfigError(f"--output {path}: this pipeline makes {kind}; write one of {', '.join(allowed)}")


def write_image(image, path: Path) -> None:
    with published(path) as partial:
        image.save(partial)


def write_video(frames, path: Path, fps: int) -> None:
    """`frames`: a list of PIL images or HxWx3 arrays (floats in [0, 1] or uint8)."""
    import numpy as np
    from PIL import Image

    images = [
        frame if isinstance(frame, Image.Image) else Image.fromarray(_uint8(np.asarray(frame)))
        for frame in frames
    ]
    with published(path) as partial:
        if path.suffix.lower() == ".mp4":
            import imageio

            with imageio.get_writer(partial, fps=fps, codec="libx264", macro_block_size=1) as writer:
                for image in images:
                    writer.append_data(np.asarray(image))
        else:  # animated GIF / WebP through Pillow; WebP lossless: the frames as generated
            lossless = {"lossless": True} if path.suffix.lower() == ".webp" else {}
            images[0].save(
                partial, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0, **lossless
            )


def _uint8(array):
    import numpy as np

    if array.dtype == np.uint8:
        return array
    return (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
