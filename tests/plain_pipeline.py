"""The reference the generate and serve tests compare with: a pipeline without dlo."""

import diffusers
import torch


def plain_pipeline(directory):
    """The pipeline without dlo, every tensor an ordinary allocation (diffusers' own loading
    can leave mmap'd views at odd offsets, which changes CPU kernels' last bits)."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(directory)
    with torch.no_grad():
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                for tensor in [*module.parameters(), *module.buffers()]:
                    tensor.data = tensor.data.clone()
    return pipe
