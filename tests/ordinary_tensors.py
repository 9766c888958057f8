"""References run on ordinary allocations: diffusers' own loading can leave parameters as mmap'd
views of a file at odd offsets (8 bytes past a 64-byte boundary, for one), and CPU kernels round
the last bits differently there than on allocator-aligned memory, where enable() puts weights."""

import torch


def ordinary_tensors(*modules) -> None:
    """Copies every parameter and buffer of `modules` (anything not a module, such as a
    pipeline's scheduler, is skipped) into an ordinary allocation, in place."""
    with torch.no_grad():
        for module in modules:
            if isinstance(module, torch.nn.Module):
                for tensor in [*module.parameters(), *module.buffers()]:
                    tensor.data = tensor.data.clone()
