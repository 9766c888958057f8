"""Damaging a safetensors file as a bad disk or copy can: 8 bytes of a tensor's data set to NaN."""

import json
import struct

NAN_BYTES = b"\xff" * 8  # two float32 NaNs, as 8 flipped bytes can make


def poison(weights, name):
    """Overwrite the first 8 bytes of tensor `name`'s data in a safetensors file, in place."""
    with open(weights, "r+b") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        start, _ = json.loads(file.read(length))[name]["data_offsets"]
        file.seek(8 + length + start)
        file.write(NAN_BYTES)
