"""Forward time of one transformer three ways: resident, streamed by dlo, diffusers group offloading.

For each shape (docs/benchmarks.md) the model is built on the CPU in bf16 (the modules the class keeps in
fp32 on load stay fp32, as from_pretrained(torch_dtype=torch.bfloat16) leaves them) with random
weights drawn from one seed (nothing is downloaded), and run on one device in three variants, one
at a time, each freed before the next so that every peak belongs to one variant:

  resident   the whole model moved to the device: the compute-only reference.
  dlo        dlo.enable(model, device, dlo.OffloadConfig()) on the CPU model: the blocks
             stream from pinned host memory into two rotating device slots.
  diffusers  model.enable_group_offload(offload_type="block_level", num_blocks_per_group=1,
             use_stream=True, record_stream=True) on the CPU model. Needs CUDA streams:
             skipped with --device cpu.

Per variant: setup time (CPU model -> ready to run), median and min of --iters timed forwards
after --warmup untimed ones (device synchronized before and after each), peak device memory
(torch.cuda.max_memory_allocated, reset before setup), and bytes copied host -> device per
forward. dlo's bytes, achieved H2D rate and exposed copy time (the time the compute stream
waited for a block still in flight) are handle.stats() deltas over the timed forwards.
diffusers' bytes are counted, not measured: block_level onloads every group on every forward,
the blocks and also its "unmatched" group of everything else (embeddings, norms, head), which
it copies in and back out synchronously from pageable memory.

floor = max(resident median, block bytes / link rate): no block-streaming scheme beats the
resident model's compute or the time to move every block once over the link (docs/benchmarks.md: pinned
H2D 55.3 GB/s on the H200, --link-gbps). "x floor" is a variant's median over that floor.
dlo's output must equal the resident output bit for bit (torch.equal); for diffusers the max
abs difference from the resident output is reported.

On the GPU machine, from the repository root (diffusers comes from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_streaming.py

CPU smoke test (tiny Wan, no diffusers variant):

  python benchmarks/bench_streaming.py --device cpu --shapes tiny --warmup 1 --iters 2

The markdown table comes last. It and the raw numbers are written as JSON (results_json.py) to
--json; the file is rewritten after each shape, so a run cut short keeps the shapes it finished.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Protocol

import diffusers
import torch
from diffusers.models.modeling_utils import no_init_weights
from torch import nn

import dlo
from dlo.models.tiny import TINY_MODELS
from results_json import add_json_flag, write_json

Inputs = dict[str, Any]

DTYPE = torch.bfloat16
INIT_STD = 0.02
GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """A diffusers transformer class, its constructor arguments and its forward inputs (built
    on the CPU from a generator)."""

    name: str
    class_name: str
    config: dict[str, Any]
    make_inputs: Callable[[torch.Generator], Inputs]


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(DTYPE)


def _wan_inputs(generator: torch.Generator) -> Inputs:
    # 480x832, 81 frames: 21 latent frames of 60x104 (32760 tokens after 1x2x2 patches); 512 text tokens.
    return dict(
        hidden_states=_randn(generator, 1, 16, 21, 60, 104),
        timestep=torch.rand(1, generator=generator) * 1000,
        encoder_hidden_states=_randn(generator, 1, 512, 4096),
        return_dict=False,
    )


def _flux_inputs(generator: torch.Generator) -> Inputs:
    # 1024x1024: 64x64 packed latent patches (4096 tokens); 512 text tokens.
    img_ids = torch.zeros(64, 64, 3)
    img_ids[..., 1] = torch.arange(64)[:, None]
    img_ids[..., 2] = torch.arange(64)[None, :]
    return dict(
        hidden_states=_randn(generator, 1, 4096, 64),
        encoder_hidden_states=_randn(generator, 1, 512, 4096),
        pooled_projections=_randn(generator, 1, 768),
        timestep=torch.rand(1, generator=generator),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(512, 3),
        return_dict=False,
    )


def _tiny_wan_inputs(generator: torch.Generator) -> Inputs:
    return TINY_MODELS["wan"].make_inputs(generator, DTYPE, torch.device("cpu"))


SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        Shape(
            "wan",  # Wan 2.1 14B dims, 12 of its 40 layers
            "WanTransformer3DModel",
            dict(
                num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, text_dim=4096,
                in_channels=16, out_channels=16, num_layers=12,
            ),
            _wan_inputs,
        ),
        Shape(
            "flux",  # Flux.1 dims, 6 of 19 double-stream and 12 of 38 single-stream layers
            "FluxTransformer2DModel",
            dict(
                num_attention_heads=24, attention_head_dim=128, joint_attention_dim=4096,
                pooled_projection_dim=768, in_channels=64, guidance_embeds=False,
                num_layers=6, num_single_layers=12,
            ),
            _flux_inputs,
        ),
        Shape("tiny", TINY_MODELS["wan"].class_name, TINY_MODELS["wan"].config, _tiny_wan_inputs),
    )
}


def _construct(shape: Shape) -> nn.Module:
    """The model with uninitialized parameters: the class's own init (billions of kaiming
    draws on the CPU) is skipped, and untouched parameter memory costs no RAM."""
    with no_init_weights():
        return getattr(diffusers, shape.class_name)(**shape.config)


def load_dtype(model: nn.Module, name: str) -> torch.dtype:
    """The dtype from_pretrained(torch_dtype=bf16) gives parameter `name`: fp32 inside the
    class's `_keep_in_fp32_modules` (Wan: norms, time embedder, scale-shift tables), else bf16.
    Buffers keep the dtype the constructor gave them there too."""
    keep = model._keep_in_fp32_modules or ()
    return torch.float32 if any(module in name.split(".") for module in keep) else DTYPE


def build_model(shape: Shape, seed: int, device: torch.device) -> nn.Module:
    """`shape`'s model on the CPU in its load dtypes, every parameter drawn from N(0, INIT_STD^2).

    The draws run on `device` (a GPU makes 4e9 of them in milliseconds) from `seed`, so every
    variant of a shape gets the same weights."""
    model = _construct(shape)
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        draw = torch.randn(param.shape, generator=generator, device=device, dtype=load_dtype(model, name))
        param.data = draw.mul_(INIT_STD).cpu()
    return model.eval()


def block_bytes(shape: Shape) -> int:
    """Bytes of the blocks in dlo's plan for `shape`, in their load dtypes: what any
    block-streaming scheme moves per forward. Counted on a meta-device skeleton (no memory)."""
    with torch.device("meta"):
        model = _construct(shape)
    total = 0
    for path in dlo.discover(model).block_lists:
        block_list = model.get_submodule(path)
        total += sum(p.numel() * load_dtype(model, n).itemsize for n, p in block_list.named_parameters(path))
        total += sum(b.numel() * b.element_size() for b in block_list.buffers())
    return total


def tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in chain(module.parameters(), module.buffers()))


def to_device(inputs: Inputs, device: torch.device) -> Inputs:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Collect the last variant (diffusers' hooks hold reference cycles) and return its device memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Streaming:
    """Host -> device traffic per timed forward."""

    bytes_per_forward: int
    h2d_gbps: float | None = None  # dlo only: achieved copy rate
    exposed_copy_s: float | None = None  # dlo only: copy time the compute stream waited for


class Session(Protocol):
    """One variant set up on one model. The timed forwards run between `start_window()` and
    `streaming(forwards)`; `close()` undoes the setup."""

    model: nn.Module

    def start_window(self) -> None: ...

    def streaming(self, forwards: int) -> Streaming: ...

    def close(self) -> None: ...


class Resident:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model.to(device)

    def start_window(self) -> None:
        pass

    def streaming(self, forwards: int) -> Streaming:
        return Streaming(bytes_per_forward=0)

    def close(self) -> None:
        pass


class DloStreaming:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.handle = dlo.enable(model, device, dlo.OffloadConfig())
        self._window_start = self.handle.stats()

    def start_window(self) -> None:
        self._window_start = self.handle.stats()

    def streaming(self, forwards: int) -> Streaming:
        start, end = self._window_start, self.handle.stats()
        nbytes = end.bytes_streamed - start.bytes_streamed
        copy_s = end.copy_s - start.copy_s
        return Streaming(
            bytes_per_forward=nbytes // forwards,
            h2d_gbps=nbytes / copy_s / GB if copy_s > 0 else None,
            exposed_copy_s=(end.exposed_copy_s - start.exposed_copy_s) / forwards,
        )

    def close(self) -> None:
        self.handle.disable()  # unpins the host copies before they are freed


class DiffusersGroupOffload:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        model.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
            record_stream=True,
        )
        self.model = model
        # block_level onloads every group once per forward: each block, and the unmatched group
        # holding every other tensor. So the whole model crosses the link each forward.
        self._bytes_per_forward = tensor_bytes(model)

    def start_window(self) -> None:
        pass

    def streaming(self, forwards: int) -> Streaming:
        return Streaming(bytes_per_forward=self._bytes_per_forward)

    def close(self) -> None:
        pass


VARIANTS: dict[str, Callable[[nn.Module, torch.device], Session]] = {
    "resident": Resident,
    "dlo": DloStreaming,
    "diffusers": DiffusersGroupOffload,
}
SKIPPED_ON_CPU = {"diffusers": "group offloading with use_stream=True needs CUDA streams"}


@dataclass(frozen=True)
class Measured:
    setup_s: float
    forward_s: tuple[float, ...]
    peak_hbm_bytes: int | None
    streaming: Streaming
    output: torch.Tensor  # of the last timed forward, on the CPU


def timed_forwards(
    model: nn.Module, inputs: Inputs, device: torch.device, iters: int
) -> tuple[list[float], torch.Tensor]:
    """Seconds of each forward, and the last output."""
    seconds = []
    for _ in range(iters):
        synchronize(device)
        started = time.perf_counter()
        output = model(**inputs)[0]
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds, output


def measure(shape: Shape, variant: str, device: torch.device, args: argparse.Namespace) -> Measured:
    model = build_model(shape, args.seed, device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    return measure_session(VARIANTS[variant], model, inputs, device, args)


def measure_session(
    make: Callable[[nn.Module, torch.device], Session], model: nn.Module, inputs: Inputs, device: torch.device,
    args: argparse.Namespace,
) -> Measured:
    """`make(model, device)` set up, --warmup untimed and --iters timed forwards, then closed."""
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    session = make(model, device)
    synchronize(device)
    setup_s = time.perf_counter() - started
    try:
        with torch.inference_mode():
            for _ in range(args.warmup):
                session.model(**inputs)
            session.start_window()
            seconds, output = timed_forwards(session.model, inputs, device, args.iters)
            streaming = session.streaming(args.iters)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        session.close()
    return Measured(setup_s, tuple(seconds), peak, streaming, output.cpu())


@dataclass(frozen=True)
class Row:
    """One shape x variant, as printed and as written to the JSON report."""

    shape: str
    variant: str
    setup_s: float
    median_s: float
    min_s: float
    forward_s: tuple[float, ...]
    peak_hbm_bytes: int | None
    h2d_bytes_per_forward: int
    h2d_gbps: float | None
    exposed_copy_s_per_forward: float | None
    floor_s: float
    x_floor: float
    equal_to_resident: bool | None  # None for the resident reference itself
    max_abs_diff_vs_resident: float | None


def make_row(shape: str, variant: str, run: Measured, reference: torch.Tensor, floor_s: float) -> Row:
    median = statistics.median(run.forward_s)
    is_reference = variant == "resident"
    max_abs_diff = (run.output.float() - reference.float()).abs().max().item()
    return Row(
        shape=shape,
        variant=variant,
        setup_s=run.setup_s,
        median_s=median,
        min_s=min(run.forward_s),
        forward_s=run.forward_s,
        peak_hbm_bytes=run.peak_hbm_bytes,
        h2d_bytes_per_forward=run.streaming.bytes_per_forward,
        h2d_gbps=run.streaming.h2d_gbps,
        exposed_copy_s_per_forward=run.streaming.exposed_copy_s,
        floor_s=floor_s,
        x_floor=median / floor_s,
        equal_to_resident=None if is_reference else torch.equal(run.output, reference),
        max_abs_diff_vs_resident=None if is_reference else max_abs_diff,
    )


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _gib(nbytes: int | None) -> str:
    return _num(None if nbytes is None else nbytes / GIB, ".2f")


def _verdict(row: Row) -> str:
    if row.equal_to_resident is None:
        return "reference"
    if row.equal_to_resident:
        return "bit-identical"
    return f"max abs diff {row.max_abs_diff_vs_resident:.3g}"


def describe(row: Row) -> str:
    return (
        f"{row.shape}/{row.variant}: setup {row.setup_s:.2f} s | forward median {row.median_s:.4f} s, "
        f"min {row.min_s:.4f} s | peak {_gib(row.peak_hbm_bytes)} GiB | "
        f"H2D {row.h2d_bytes_per_forward / GB:.3g} GB/forward at {_num(row.h2d_gbps, '.1f')} GB/s, "
        f"exposed {_num(row.exposed_copy_s_per_forward, '.4f')} s/forward | {row.x_floor:.2f}x floor | "
        f"output vs resident: {_verdict(row)}"
    )


def markdown_table(rows: list[Row]) -> str:
    header = (
        "| shape | variant | setup s | median s | min s | peak HBM GiB | H2D GB/fwd | H2D GB/s "
        "| exposed s/fwd | floor s | x floor | output vs resident |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        cells = [
            r.shape, r.variant, f"{r.setup_s:.2f}", f"{r.median_s:.4f}", f"{r.min_s:.4f}", _gib(r.peak_hbm_bytes),
            f"{r.h2d_bytes_per_forward / GB:.3g}", _num(r.h2d_gbps, ".1f"), _num(r.exposed_copy_s_per_forward, ".4f"),
            f"{r.floor_s:.4f}", f"{r.x_floor:.2f}", _verdict(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_shape(shape: Shape, variants: list[str], device: torch.device, args: argparse.Namespace) -> list[Row]:
    runs: dict[str, Measured] = {}
    for variant in variants:
        run = runs[variant] = measure(shape, variant, device, args)
        release(device)
        median = statistics.median(run.forward_s)
        print(f"{shape.name}/{variant}: setup {run.setup_s:.2f} s, median {median:.4f} s", flush=True)
    floor_s = max(statistics.median(runs["resident"].forward_s), block_bytes(shape) / (args.link_gbps * GB))
    rows = [make_row(shape.name, v, run, runs["resident"].output, floor_s) for v, run in runs.items()]
    for row in rows:
        print(describe(row), flush=True)
    return rows


def environment(device: torch.device) -> dict[str, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "diffusers": diffusers.__version__, "dlo": dlo.__version__}


def write_report(
    path: Path, args: argparse.Namespace, device: torch.device, rows: list[Row], notes: list[str]
) -> None:
    write_json(
        path, "bench_streaming", [asdict(row) for row in rows], markdown_table(rows),
        environment=environment(device),
        settings={
            "warmup": args.warmup, "iters": args.iters, "link_gbps": args.link_gbps, "seed": args.seed,
            "dtype": str(DTYPE), "init_std": INIT_STD,
        },
        block_bytes={name: block_bytes(SHAPES[name]) for name in sorted({r.shape for r in rows})},
        notes=notes,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", type=lambda text: text.split(","), default=["wan", "flux"],
        help=f"comma-separated, from {', '.join(SHAPES)} (default: wan,flux; tiny is the smoke-test Wan)",
    )
    parser.add_argument("--device", default="cuda", help="device to run on: cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards per variant (default: 2)")
    parser.add_argument("--iters", type=int, default=5, help="timed forwards per variant (default: 5)")
    parser.add_argument(
        "--link-gbps", type=float, default=55.3,
        help="host->device link rate in GB/s for the floor (default: 55.3, pinned H2D on the H200, docs/benchmarks.md)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights; the inputs use seed + 1 (default: 0)"
    )
    add_json_flag(parser, "bench_streaming")
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    return args


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--shapes, --warmup and --iters, as every benchmark over SHAPES takes them."""
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(" | ".join(f"{k} {v}" for k, v in environment(device).items()), flush=True)
    variants = [v for v in VARIANTS if device.type == "cuda" or v not in SKIPPED_ON_CPU]
    notes = [f"{v} skipped on {device.type}: {why}" for v, why in SKIPPED_ON_CPU.items() if v not in variants]
    rows: list[Row] = []
    for name in args.shapes:
        rows += run_shape(SHAPES[name], variants, device, args)
        write_report(args.json, args, device, rows, notes)
    print()
    for note in notes:
        print(f"note: {note}")
    print(f"report: {args.json}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
