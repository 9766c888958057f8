"""`dlo inspect FILE`: a GGUF or single-file safetensors checkpoint's tensor types and bytes per
block, from its validated header alone (no tensor byte is read, no model is built)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

from dlo.cli.format import human_bytes, table
from dlo.host.gguf_file import read_gguf_index
from dlo.host.safetensors_file import SAFETENSORS_DTYPE, read_entries

# "<list>.<index>." starts a block's tensor name: transformer_blocks.3.attn.to_q.weight
_BLOCK = re.compile(r"^(?P<list>.+?)\.(?P<index>\d+)\.")
FILE_SUFFIXES = (".gguf", ".safetensors")


def _tensors(path: Path) -> list[tuple[str, str, int]]:
    """(name, type, bytes) of every tensor of the file; a damaged header is a CheckpointError."""
    if path.suffix == ".gguf":
        return [(t.name, t.quant, t.nbytes) for t in read_gguf_index(path).tensors.values()]
    return [(e.key, SAFETENSORS_DTYPE[e.dtype], e.nbytes) for e in read_entries(path).values()]


def _types(counts: Counter) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in counts.most_common())


def render_file(path: Path) -> str:
    blocks: dict[str, dict[int, list[tuple[str, int]]]] = defaultdict(lambda: defaultdict(list))
    others: list[tuple[str, int]] = []
    tensors = _tensors(path)
    for name, kind, nbytes in tensors:
        match = _BLOCK.match(name)
        if match:
            blocks[match["list"]][int(match["index"])].append((kind, nbytes))
        else:
            others.append((kind, nbytes))
    rows = []
    for list_name, members in blocks.items():
        per_block = {sum(n for _, n in block) for block in members.values()}
        kinds = Counter(kind for block in members.values() for kind, _ in block)
        first = next(iter(members.values()))
        rows.append([list_name, len(members), _types(Counter(kind for kind, _ in first)),
                     " / ".join(human_bytes(n) for n in sorted(per_block))])
        if kinds != Counter({k: c * len(members) for k, c in Counter(kind for kind, _ in first).items()}):
            rows[-1][2] += " (first block; the others differ)"
    total = sum(nbytes for _, _, nbytes in tensors)
    lines = [
        f"{path.name}: {len(tensors)} tensors, {human_bytes(total)}",
        "",
        table(["block list", "blocks", "tensor types per block", "bytes per block"], rows) if rows else "no block lists",
        "",
        f"outside the blocks:   {human_bytes(sum(n for _, n in others))} ({_types(Counter(k for k, _ in others)) or 'none'})",
        f"tensor types:         {_types(Counter(kind for _, kind, _ in tensors))}",
    ]
    return "\n".join(lines)
