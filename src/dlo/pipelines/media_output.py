"""Writing generated images and videos, and knowing in advance which files can be written."""

from __future__ import annotations

from pathlib import Path

from dlo.errors import ConfigError
from dlo.pipelines.output_path import published

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".gif", ".webp")


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
