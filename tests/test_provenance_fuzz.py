"""Random converters against the provenance of single-file tensors (See [Note: single files
through diffusers' converter]): the same random program of views, splits, concatenations,
copies and writes (through the tensor, a view, `.detach()`, `.data`, or a `.data` swap) runs on
the meta stand-ins under `_Provenance` and on real tensors holding a file's bytes. Whatever the
provenance says a tensor holds (a range of the file, or ranges one after another) must be
exactly that tensor's bytes in the real run."""

import random

import pytest
import torch

from dlo.host.safetensors_file import TensorEntry
from dlo.host.single_file_layout import _Provenance

COLUMNS = 8  # every file tensor is (rows, COLUMNS) float32: any two can be concatenated by rows
HEADER = 64  # the file's first data byte


def file_of(rng: random.Random) -> tuple[dict[str, TensorEntry], torch.Tensor]:
    """Entries of a few tensors laid out one after another (small gaps), and the file's bytes."""
    entries, at = {}, HEADER
    for i in range(rng.randint(2, 4)):
        rows = rng.randint(2, 12)
        nbytes = rows * COLUMNS * 4
        entries[f"t{i}"] = TensorEntry(f"t{i}", torch.float32, (rows, COLUMNS), at, at + nbytes)
        at += nbytes + 4 * rng.randint(0, 4)
    data = torch.randint(0, 256, (at,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return entries, data


def rows_of(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.shape[1] == COLUMNS and t.shape[0] > 0


def program(rng: random.Random, steps: int):
    """A random program: a list of (op, argument indices, parameters), run the same way on both sides."""
    ops = []
    for _ in range(steps):
        ops.append((rng.choice(OPS), [rng.random() for _ in range(3)], [rng.random() for _ in range(3)]))
    return ops


def _pick(live: list[torch.Tensor], u: float, want=lambda t: True) -> int | None:
    candidates = [i for i, t in enumerate(live) if want(t)]
    return candidates[int(u * len(candidates))] if candidates else None


def op_chunk(live, u, p):
    i = _pick(live, u[0], lambda t: rows_of(t) and t.shape[0] >= 2)
    if i is not None:
        parts = torch.chunk(live[i], 2, dim=0)
        live.append(parts[int(p[0] * len(parts))])


def op_rows(live, u, p):
    i = _pick(live, u[0], rows_of)
    if i is not None:
        rows = live[i].shape[0]
        begin = int(p[0] * rows)
        end = begin + 1 + int(p[1] * (rows - begin - 1))
        live.append(live[i][begin:end])


def op_cat(live, u, p):
    picked = [_pick(live, x, rows_of) for x in u[: 1 + int(p[0] * 3)]]
    if None not in picked:
        live.append(torch.cat([live[i] for i in picked]))


def op_copy(live, u, p):
    i = _pick(live, u[0])
    if i is not None:
        t = live[i]
        live.append([t.clone(), t.contiguous(), t.to(torch.float32), torch.cat([t]) if t.dim() else t.clone()][int(p[0] * 4)])


def op_transpose(live, u, p):
    i = _pick(live, u[0], lambda t: t.dim() == 2)
    if i is not None:
        live.append(live[i].t())


def op_reshape(live, u, p):
    i = _pick(live, u[0], rows_of)
    if i is not None:
        live.append(live[i].reshape(-1).reshape(-1, COLUMNS))


def op_write(live, u, p):
    i = _pick(live, u[0])
    if i is not None:
        t = live[i]
        how = int(p[0] * 5)
        if how == 0:
            t.mul_(2)
        elif how == 1:
            t.detach().add_(1)
        elif how == 2:
            t.data.mul_(3)
        elif how == 3 and rows_of(t):
            t[: 1].zero_()
        else:
            t.data = t * 2


def op_flat_slice(live, u, p):
    i = _pick(live, u[0], lambda t: t.is_contiguous() and t.numel() > 1)
    if i is not None:
        flat = live[i].view(-1)
        begin = int(p[0] * flat.numel())
        live.append(flat[begin : begin + 1 + int(p[1] * (flat.numel() - begin - 1))])


def op_unbind(live, u, p):
    i = _pick(live, u[0], rows_of)
    if i is not None:
        rows = live[i].unbind(0)
        live.append(rows[int(p[0] * len(rows))])


def op_split(live, u, p):
    i = _pick(live, u[0], lambda t: rows_of(t) and t.shape[0] >= 3)
    if i is not None:
        first = 1 + int(p[0] * (live[i].shape[0] - 2))
        parts = torch.split(live[i], [first, live[i].shape[0] - first])
        live.append(parts[int(p[1] * 2)])


OPS = [op_chunk, op_rows, op_cat, op_copy, op_transpose, op_reshape, op_write, op_flat_slice, op_unbind, op_split]


def run(ops, start: list[torch.Tensor]) -> list[torch.Tensor]:
    live = list(start)
    for op, u, p in ops:
        op(live, u, p)
    return live


@pytest.mark.parametrize("seed", range(300))
def test_what_the_provenance_claims_is_the_real_bytes(seed):
    rng = random.Random(seed)
    entries, data = file_of(rng)
    ops = program(rng, rng.randint(3, 14))
    keys = list(entries)
    with torch.inference_mode(False):
        stand_ins = {key: torch.empty(entries[key].shape, dtype=torch.float32, device="meta") for key in keys}
        with _Provenance(stand_ins, entries) as provenance:
            meta = run(ops, [stand_ins[key] for key in keys])
        real = run(ops, [data.clone()[e.begin : e.end].view(torch.float32).view(e.shape) for e in entries.values()])
        claims = 0
        for i, (m, r) in enumerate(zip(meta, real, strict=True)):
            held = provenance.range_of(m)
            parts = provenance.parts_of(m) if held is None else None
            if held is not None:
                want = [(held.begin, r.numel() * 4)]
            elif parts is not None:
                want = [(where.begin, (torch.Size(shape).numel()) * 4) for where, shape in parts]
            else:
                continue
            claims += 1
            expected = torch.cat([data[begin : begin + n] for begin, n in want])
            got = r.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(got, expected), f"tensor {i} of the program: {held or parts} is not what it holds"
    assert claims >= len(keys) or any(op is op_write for op, _, _ in ops)
