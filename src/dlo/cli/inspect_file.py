"""`dlo inspect FILE`: a GGUF or single-file safetensors checkpoint's tensor types and bytes per
block, from its validated header alone (no tensor byte is read, no model is built)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

from dlo.cli.format import human_bytes, table
from dlo.errors import ConfigError
from dlo.host.gguf_file import read_gguf_index
from dlo.host.quantized_layers import FLOAT8, SCALE_SUFFIXES, ignored_key, layer_of, scale_layout
from dlo.host.safetensors_file import SAFETENSORS_DTYPE, TensorEntry, read_entries

# "<list>.<index>." starts a block's tensor name: transformer_blocks.3.attn.to_q.weight
_BLOCK = re.compile(r"^(?P<list>.+?)\.(?P<index>\d+)\.")
FILE_SUFFIXES = (".gguf", ".safetensors")


def _tensors(path: Path) -> tuple[list[tuple[str, str, int]], dict[str, TensorEntry]]:
    """(name, type, bytes) of every tensor of the file, and a safetensors file's entries; a
    damaged header is a CheckpointError."""
    if path.suffix == ".gguf":
        try:
            import gguf  # noqa: F401  (the index reader's quant tables)
        except ImportError:
            raise ConfigError(f"{path}: GGUF files need the [gguf] extra: pip install 'dlo[gguf]'") from None
    try:
        if path.suffix == ".gguf":
            return [(t.name, t.quant, t.nbytes) for t in read_gguf_index(path).tensors.values()], {}
        entries = read_entries(path)
        return [(e.key, SAFETENSORS_DTYPE[e.dtype], e.nbytes) for e in entries.values()], entries
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror or err})") from None


def _float8_weights(entries: dict[str, TensorEntry]) -> str | None:
    """How the file's float8 weights are scaled, and what lies beside them that no model reads
    (ComfyUI's activation scales and format markers); None without float8 weights."""
    weights = [key for key, entry in entries.items() if entry.dtype in FLOAT8 and key.endswith(".weight")]
    if not weights:
        return None
    kinds: Counter = Counter()
    for key in weights:
        scales = [entries[layer_of(key) + suffix] for suffix in SCALE_SUFFIXES if layer_of(key) + suffix in entries]
        rows = entries[key].shape[0] if entries[key].shape else 0
        layout = scale_layout(rows, scales[0].shape) if len(scales) == 1 else None
        kinds[f"a {layout.replace(' ', '-')} scale" if layout else "no scale" if not scales else "scales dlo does not read"] += 1
    unread = sum(ignored_key(key) for key in entries)
    plural = "s" if unread > 1 else ""
    beside = f"; beside them {unread} tensor{plural} no model reads (activation scales, format markers)" if unread else ""
    return f"{len(weights)}: {', '.join(f'{n} with {kind}' for kind, n in kinds.most_common())}{beside}"


def _types(counts: Counter) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in counts.most_common())


def _block_lists(tensors: list[tuple[str, str, int]]) -> dict[str, list[list[tuple[str, int]]]]:
    """The block lists among the names: "<list>.<i>." for i = 0..n-1, n >= 2 (a single indexed
    module, such as an embedding's `.1.`, is not a list). Each block's (type, bytes) pairs."""
    found: dict[str, dict[int, list[tuple[str, int]]]] = defaultdict(lambda: defaultdict(list))
    for name, kind, nbytes in tensors:
        match = _BLOCK.match(name)
        if match:
            found[match["list"]][int(match["index"])].append((kind, nbytes))
    return {
        name: [members[i] for i in range(len(members))]
        for name, members in found.items()
        if len(members) >= 2 and set(members) == set(range(len(members)))
    }


def render_file(path: Path) -> str:
    tensors, entries = _tensors(path)
    lists = _block_lists(tensors)
    rows = []
    for list_name, blocks in lists.items():
        per_block = sorted({sum(n for _, n in block) for block in blocks})
        kinds = [Counter(kind for kind, _ in block) for block in blocks]
        described = _types(kinds[0]) + ("" if all(k == kinds[0] for k in kinds) else " (block 0; the others differ)")
        rows.append([list_name, len(blocks), described, " / ".join(human_bytes(n) for n in per_block)])
    in_blocks = {name for name, *_ in tensors if (m := _BLOCK.match(name)) and m["list"] in lists}
    others = [(kind, nbytes) for name, kind, nbytes in tensors if name not in in_blocks]
    total = sum(nbytes for _, _, nbytes in tensors)
    lines = [
        f"{path.name}: {len(tensors)} tensors, {human_bytes(total)}",
        "",
        table(["block list", "blocks", "tensor types per block", "bytes per block"], rows) if rows else "no block lists",
        "",
        f"outside the blocks:   {human_bytes(sum(n for _, n in others))} ({_types(Counter(k for k, _ in others)) or 'none'})",
        f"tensor types:         {_types(Counter(kind for _, kind, _ in tensors))}",
    ]
    float8 = _float8_weights(entries)
    if float8 is not None:
        lines.append(f"float8 weights:       {float8}")
    return "\n".join(lines)
