"""Random converters over a float8 file's weights (See [Note: single files through diffusers'
converter]): diffusers' Wan converter, then a random program of moves, splits, joins, casts,
transposes, arithmetic and mixes on block 0's float8 self-attention weights, run alike on dlo's stand-ins
and on diffusers' own load of the weights dequantized. Whatever dlo loads must be, tensor for
tensor, what diffusers' model of the dequantized weights holds; the rest is refused in one line.
Programs of moves a scale follows are never refused."""

import random

import pytest
import torch

import dlo
from test_single_file_mapping import patched_wan_converter, per_row_fp8, reference, scaled_fp8, wan_scaled_fp8_file

diffusers = pytest.importorskip("diffusers")

WEIGHTS = [f"blocks.0.{attn}.{name}.weight" for attn in ("attn1", "attn2") for name in ("to_q", "to_k", "to_v", "to_out.0")]  # (dim, dim)
FFN = "blocks.0.ffn.net.0.proj.weight"  # (2 dim, dim)


def swap(out, a, b):
    out[a], out[b] = out[b], out[a]


def halves_joined(out, a, b):  # the rows as they were: a range again
    half = out[a].shape[0] // 2
    out[a] = torch.cat([out[a][:half], out[a][half:]])


def halves_swapped(out, a, b):  # SD3's norms, MiniMax-H3's gated MLP
    half = out[a].shape[0] // 2
    out[a] = torch.cat([out[a][half:], out[a][:half]])


def transposed(out, a, b):
    out[a] = out[a].t().contiguous()


def cast_there_and_back(out, a, b):
    out[a] = out[a].to(torch.bfloat16).to(out[a].dtype)


def rows_of_the_ffn(out, a, b):  # a range of whole rows of another, larger weight (a fused projection's part)
    ffn = out[FFN]
    out[a] = ffn[ffn.shape[0] - out[a].shape[0]:] if WEIGHTS.index(b) % 2 else ffn[: out[a].shape[0]]


def negated(out, a, b):  # exact in float8 as in any float: the same values, moved by sign
    out[a] = -out[a]


def plus_one(out, a, b):  # arithmetic: no scale of the file dequantizes the result
    out[a] = (out[a].float() + 1).to(out[a].dtype)


def mixed(out, a, b):  # rows of two weights
    half = out[a].shape[0] // 2
    out[a] = torch.cat([out[a][:half], out[b][half:]])


# op -> whether dlo must load a program of such ops (per-tensor scale, per-row scale)
OPS = {
    swap: (True, True), halves_joined: (True, True), rows_of_the_ffn: (True, True), halves_swapped: (True, False),
    transposed: (True, False),
    cast_there_and_back: (False, False), negated: (False, False), plus_one: (False, False), mixed: (False, False),
}


def per_row_bf16(weight):
    """Per-row scales stored in bfloat16 (the values dequantized with them as stored)."""
    data, scale, _ = per_row_fp8(weight)
    scale = scale.to(torch.bfloat16).reshape(-1)
    return data, scale, (data.float() * scale.float()[:, None]).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("per_row", "quantize"), [(False, scaled_fp8), (True, per_row_fp8), (True, per_row_bf16)],
    ids=["per tensor", "per row", "per row bf16 [rows]"],
)
def test_random_converters_load_float8_weights_exactly_or_refuse_them(tmp_path, monkeypatch, per_row, quantize):
    rng = random.Random(1 + per_row)
    path, config_dir, dequantized, _ = wan_scaled_fp8_file(tmp_path, quantize=quantize)
    outcomes = {"loaded": 0, "refused": 0}
    for trial in range(24):
        steps = [(rng.choice(list(OPS)), *rng.sample(WEIGHTS, 2)) for _ in range(rng.randint(1, 3))]
        monkeypatch.undo()
        patched_wan_converter(monkeypatch, lambda out: [op(out, a, b) for op, a, b in steps])
        must_load = all(OPS[op][per_row] for op, _, _ in steps)
        try:
            _, plan = dlo.load_transformer(path, model_config=config_dir)
        except dlo.ConfigError as refused:
            assert not must_load, (steps, str(refused))
            assert "\n" not in str(refused) and f"{path} holds float8 weights" in str(refused), str(refused)
            outcomes["refused"] += 1
            continue
        expected = reference(dict(dequantized), config_dir, diffusers.WanTransformer3DModel, torch.bfloat16)  # it pops keys
        layout = plan.peek()
        for name, source in layout.bindings.items():
            assert torch.equal(source.materialize(layout.checkpoint), expected.get_parameter(name).data), (steps, name)
        layout.checkpoint.close()
        outcomes["loaded"] += 1
    assert outcomes["loaded"] >= 4 and outcomes["refused"] >= 4, outcomes
