"""A rank's shard read from the files (See [Note: shards read from disk]), in a read buffer and
as a copy kept in host memory, against the same bytes cut out of the block's whole image as
packing writes it, for random blocks: plain, concatenated (several files), private and float8
tensors, any group size and chunk size."""

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from dlo.host.block_sources import DiskShardSource, MappedSource
from dlo.host.checkpoint import Checkpoint
from dlo.host.direct_reads import DIRECT_ALIGNMENT, DiskReader
from dlo.host.image_segments import image_segments
from dlo.host.pinned_buffer import HostBuffer, aligned_empty
from dlo.host.tensor_source import QuantizedSource, TensorSource
from dlo.planning.block_layout import TensorSpec
from dlo.planning.shard_layout import plan_shards
from dlo.planning.wire_layout import Fp8Format, landing_views, plan_wire_layout

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool]


def _value(rng, shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape).to(dtype)
    return torch.randn(shape).to(dtype)


def random_block(tmp_path, rng):
    """Tensors of a block, their sources in a checkpoint of 1-3 files (with unrelated tensors
    between them), and their float8 formats."""
    files = [dict() for _ in range(rng.randint(1, 3))]
    tensors, sources, formats = [], [], []
    for t in range(rng.randint(1, 8)):
        kind = rng.choice(["plain", "concat", "private", "float8"])
        rows, dtype = rng.randint(1, 200), rng.choice(DTYPES)
        shape = rng.choice([(rows,), (rows, rng.randint(1, 50))])
        if kind == "float8":
            shape, dtype = (rows, rng.randint(1, 50)), torch.bfloat16
        value = _value(rng, shape, dtype)
        rng.choice(files)[f"junk{t}"] = torch.randn(rng.randint(1, 3000))
        formats.append(None)
        if kind == "plain":
            rng.choice(files)[f"t{t}"] = value
            sources.append(TensorSource((f"t{t}",), shape, dtype))
        elif kind == "concat":
            cuts = sorted(rng.sample(range(1, rows), min(2, rows - 1)))
            keys = [f"t{t}.{i}" for i in range(len(cuts) + 1)]
            for key, part in zip(keys, torch.tensor_split(value, cuts)):
                rng.choice(files)[key] = part.contiguous()
            sources.append(TensorSource(tuple(keys), shape, dtype))
        elif kind == "private":
            sources.append(None)
        else:
            formats[-1] = Fp8Format(FP8, per_channel=rng.random() < 0.5)
            rng.choice(files)[f"t{t}.w"] = value.float().clamp(-400, 400).to(FP8)
            rng.choice(files)[f"t{t}.s"] = torch.rand(formats[-1].scale_shape(rows))
            sources.append(QuantizedSource(f"t{t}.w", f"t{t}.s", shape, dtype, formats[-1]))
        tensors.append(value)
    names = [f"part-{i}.safetensors" for i in range(len(files))]
    for name, content in zip(names, files):
        save_file(content or {"empty": torch.zeros(1)}, tmp_path / name)
    index = {"weight_map": {key: name for name, content in zip(names, files) for key in content}}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return Checkpoint(tmp_path), tensors, sources, formats


@pytest.mark.parametrize("seed", range(40))
def test_a_shard_read_from_the_files_holds_the_bytes_of_the_packed_image(tmp_path, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    checkpoint, tensors, sources, formats = random_block(tmp_path, rng)
    specs = [TensorSpec(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    layout, wire = plan_wire_layout(specs, formats)
    image = torch.zeros(wire.nbytes, dtype=torch.uint8)
    MappedSource(checkpoint, tuple(s if s is not None else t for s, t in zip(sources, tensors))).pack(layout, wire, image)
    read = torch.zeros_like(image)  # the bytes a view of the block reads: what the shards must hold
    quantized = {q.index for q in wire.quantized}  # their placements are in the slot, past the wire's plain region
    for index, placement in enumerate(layout.placements):
        if index not in quantized:
            read[placement.offset : placement.offset + placement.spec.nbytes] = 1
    for data, scale in landing_views(read[wire.plain_bytes :], wire):
        data.view(torch.uint8).fill_(1)
        scale.view(torch.uint8).fill_(1)
    segments = image_segments(tensors, sources, layout, wire, checkpoint)
    assert segments is not None
    size = rng.randint(1, 4)
    shards = plan_shards(wire.nbytes, size, rng.choice([0, 512, 1000, 4096, 65536]))
    padded = torch.zeros(shards.padded_bytes, dtype=torch.uint8)
    padded[: wire.nbytes] = image
    needed = torch.zeros_like(padded)
    needed[: wire.nbytes] = read
    reader = DiskReader(3)
    try:
        for rank in range(size):
            source = DiskShardSource.plan(segments, shards, rank)
            buffer = aligned_empty(source.buffer_bytes, torch.device("cpu"), DIRECT_ALIGNMENT)
            buffer.fill_(0xAB)  # stale bytes: only the gaps may keep them
            source.read(reader, buffer)
            kept = source.kept(buffer, HostBuffer(source.shard_bytes, pin=False))
            for piece, got, held in zip(shards.pieces(rank), source.pieces_in(buffer), kept.pieces):
                expected = padded[piece.image_start : piece.image_start + piece.nbytes]
                mask = needed[piece.image_start : piece.image_start + piece.nbytes].bool()
                assert torch.equal(got[mask], expected[mask]) and torch.equal(held, expected), (rank, piece)
    finally:
        reader.close()
