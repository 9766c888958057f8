"""The reference the generate and serve tests compare with: a pipeline without dlo."""

import diffusers
from ordinary_tensors import ordinary_tensors


def plain_pipeline(directory):
    """The pipeline without dlo, every tensor an ordinary allocation."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(directory)
    ordinary_tensors(*pipe.components.values())
    return pipe
