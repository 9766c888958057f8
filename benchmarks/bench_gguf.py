"""GGUF transformers: a diffusers GGUF model resident, streamed packed by dlo, and under diffusers'
group offloading, beside dlo streaming the same model in bf16.

Per shape (bench_streaming.py's models, random bf16 weights from one seed) the model is written
once per quant type as a GGUF file under --tmp (diffusers' tensor names, so diffusers converts
nothing) and loaded back as users load one: `from_single_file(path, config=...,
quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16), torch_dtype=torch.bfloat16)`.
Every Linear weight of the blocks is stored in the quant type; its block bytes are seeded noise
below 0x10 (so every float16 scale is finite and small), not a quantization of the bf16 weights:
the `gguf` package quantizes only some types, and slowly; a forward's time does not depend on the
values. The other tensors are F32 in the file, bf16 once loaded.

Variants, one at a time, each on a fresh load and freed before the next:

  dlo bf16     dlo.enable on the bf16 model: the reference of the "x bf16" column.
  resident     the GGUF model moved to the device: diffusers dequantizes each Linear's weight in
               torch before its matmul (the compute reference).
  dlo          dlo.enable(model, device) on the CPU GGUF model: the packed bytes stream as they are
               and the forward dequantizes them exactly as the resident model does.
  diffusers    enable_group_offload(block_level, 1 block a group, use_stream, record_stream) on the
               GGUF model (needs CUDA; skipped on the CPU).
  resident + kernels   the resident GGUF model with dlo.use_gguf_kernels: each Linear's weight
               dequantized by one dlo Triton kernel launch, then diffusers' F.linear (needs CUDA
               and Triton; skipped on the CPU).
  dlo + kernels        dlo.use_gguf_kernels, then dlo.enable, on the CPU GGUF model.
  dlo mapped   dlo.load_transformer(path, torch_dtype=torch.bfloat16, model_config=...), then
               dlo.enable(model, device, plan=plan): the file's packed bytes stream from its
               mapping (shared page cache, registered for direct copies) instead of a private copy.
  dlo mapped + kernels the same, dlo.use_gguf_kernels before dlo.enable.

floor = max(the compute reference's median, packed block bytes / --link-gbps), the compute
reference being "resident + kernels" for the kernel rows and "resident" for the others; the "dlo
bf16" row has no resident run beside it, so its floor is its block bytes / --link-gbps alone.
Outputs are compared (torch.equal) with "resident + kernels" for "dlo + kernels", with "resident"
for the others: dlo's must be bit-identical; for the rest the max abs difference is shown.

On the GPU machine, from the repository root (diffusers and gguf from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_gguf.py --shapes flux,wan --quants Q8_0,Q4_0,Q4_K --tmp /tmp/bench_gguf
  (--variants resident,dlo,... measures only those; --num-slots N for every dlo row)

CPU smoke test: python benchmarks/bench_gguf.py --device cpu --shapes wide --quants Q8_0,Q4_K --warmup 0 --iters 1

The markdown table comes last; it and the raw numbers go as JSON to --json (results_json.py),
rewritten after each quant type.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import dlo
from bench_streaming import (
    GB, SHAPES, DiffusersGroupOffload, DloStreaming, Measured, Resident, Shape, build_model, environment,
    measure_session, to_device,
)
from results_json import add_json_flag, write_json



class ResidentKernels(Resident):
    """The resident GGUF model, its GGUF Linears run through dlo's kernels."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__(model, device)
        self.kernels = dlo.use_gguf_kernels(self.model)

    def close(self) -> None:
        self.kernels.restore()


class Dlo(DloStreaming):
    """bench_streaming's dlo session, with the config of --num-slots (set by main). Its close
    prints how the blocks were copied and the process's CPU seconds (every thread) per timed
    forward: host packing shows there."""

    config = dlo.OffloadConfig()

    def __init__(self, model: nn.Module, device: torch.device, plan: dlo.HostWeightPlan | None = None) -> None:
        self.model = model
        self.handle = dlo.enable(model, device, self.config, plan=plan)
        self._window_start = self.handle.stats()

    def start_window(self) -> None:
        super().start_window()
        self._cpu_start = time.process_time()

    def streaming(self, forwards: int):
        self._cpu_per_forward = (time.process_time() - self._cpu_start) / forwards
        return super().streaming(forwards)

    def close(self) -> None:
        stats = self.handle.stats()
        print(f"  {type(self).__name__}: registered {stats.registered_bytes / 2**30:.2f} GiB, staging "
              f"{stats.staging_bytes / 2**30:.2f} GiB, host {stats.host_bytes / 2**30:.2f} GiB, mapped "
              f"{stats.mapped_bytes / 2**30:.2f} GiB, registration fallback {stats.registration_fallback!r}, "
              f"CPU s per forward {self._cpu_per_forward:.4f}", flush=True)
        super().close()


class DloKernels(Dlo):
    """dlo streaming the GGUF model whose GGUF Linears run through dlo's kernels."""

    def __init__(self, model: nn.Module, device: torch.device, plan: dlo.HostWeightPlan | None = None) -> None:
        self.kernels = dlo.use_gguf_kernels(model)  # before enable(): the same parameters stream
        super().__init__(model, device, plan)

    def close(self) -> None:
        super().close()
        self.kernels.restore()


VARIANTS = {
    "resident": Resident, "dlo": Dlo, "diffusers": DiffusersGroupOffload,
    "resident + kernels": ResidentKernels, "dlo + kernels": DloKernels,
    "dlo mapped": Dlo, "dlo mapped + kernels": DloKernels,  # given the plan: see measure_file
}
MAPPED = {"dlo mapped", "dlo mapped + kernels"}  # loaded by dlo.load_transformer, not diffusers
# What each variant's output is compared with, and its compute reference for the floor.
REFERENCE = {"dlo": "resident", "diffusers": "resident", "resident + kernels": "resident",
             "dlo + kernels": "resident + kernels", "dlo mapped": "resident",
             "dlo mapped + kernels": "resident + kernels"}
CUDA_ONLY = {"diffusers", "resident + kernels", "dlo + kernels", "dlo mapped + kernels"}
# A Wan transformer wide enough for the K-quants' 256-value blocks: the CPU smoke test's shape.
WIDE = Shape(
    "wide", "WanTransformer3DModel",
    dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
         text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=32),
    SHAPES["tiny"].make_inputs,
)
ALL_SHAPES = {**SHAPES, WIDE.name: WIDE}


@dataclass(frozen=True)
class Row:
    shape: str
    quant: str
    variant: str
    median_s: float
    forward_s: tuple[float, ...]
    peak_hbm_bytes: int | None
    block_bytes: int  # the blocks' bytes in this variant's weights (packed for GGUF)
    h2d_gbps: float | None
    exposed_copy_s_per_forward: float | None
    equal_to_resident: bool | None  # to REFERENCE[variant]'s output ("resident + kernels" for dlo + kernels)
    max_abs_diff_vs_resident: float | None


def write_gguf(model: nn.Module, path: Path, quant: str, seed: int) -> None:
    """`model` as a GGUF file: the blocks' Linear weights as `quant` (seeded block bytes below
    0x10), every other tensor F32."""
    import gguf

    quant_type = gguf.GGMLQuantizationType[quant]
    values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
    block_prefixes = tuple(f"{path}." for path in dlo.discover(model).block_lists)
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    generator = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(path, "dlo-bench")
    for name, tensor in model.state_dict().items():
        rows, columns = tensor.shape if tensor.dim() == 2 else (0, 0)
        packed = (
            name.startswith(block_prefixes) and name.endswith(".weight") and name.rpartition(".")[0] in linears
            and columns % values_per_block == 0
        )
        if packed:
            noise = torch.randint(0, 0x10, (rows, columns // values_per_block * block_bytes), generator=generator,
                                  dtype=torch.uint8)
            writer.add_tensor(name, noise.numpy(), raw_dtype=quant_type)
        else:
            writer.add_tensor(name, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_gguf(path: Path, config_dir: Path, class_name: str) -> nn.Module:
    import diffusers

    quantization = diffusers.GGUFQuantizationConfig(compute_dtype=torch.bfloat16)
    return getattr(diffusers, class_name).from_single_file(
        str(path), config=str(config_dir), quantization_config=quantization, torch_dtype=torch.bfloat16
    ).eval()


def blocks_nbytes(model: nn.Module) -> int:
    total = 0
    for path in dlo.discover(model).block_lists:
        block_list = model.get_submodule(path)
        total += sum(t.numel() * t.element_size() for t in (*block_list.parameters(), *block_list.buffers()))
    return total


def measure(model: nn.Module, variant: str, inputs: dict, device: torch.device, args: argparse.Namespace):
    """bench_streaming's measurement of one variant, and the blocks' bytes in this model."""
    nbytes = blocks_nbytes(model)
    return measure_session(VARIANTS[variant], model, inputs, device, args), nbytes


def measure_file(path: Path, config_dir: Path, shape: Shape, variant: str, inputs: dict, device: torch.device,
                 args: argparse.Namespace):
    """`measure` of the GGUF file loaded the way `variant` loads it."""
    if variant not in MAPPED:
        return measure(load_gguf(path, config_dir, shape.class_name), variant, inputs, device, args)
    model, plan = dlo.load_transformer(path, torch_dtype=torch.bfloat16, model_config=config_dir)
    assert plan is not None, "the GGUF file was not mapped (the fallback is logged)"
    nbytes = blocks_nbytes(model)
    return measure_session(functools.partial(VARIANTS[variant], plan=plan), model, inputs, device, args), nbytes


def row(shape: str, quant: str, variant: str, measured: tuple[Measured, int], reference: torch.Tensor | None) -> Row:
    run, nbytes = measured
    compared = reference is not None
    return Row(
        shape, quant, variant, statistics.median(run.forward_s), run.forward_s, run.peak_hbm_bytes, nbytes,
        run.streaming.h2d_gbps, run.streaming.exposed_copy_s,
        torch.equal(run.output, reference) if compared else None,
        (run.output.float() - reference.float()).abs().max().item() if compared else None,
    )


def run_shape(shape: Shape, device: torch.device, args: argparse.Namespace) -> list[Row]:
    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=f"bench_gguf_{shape.name}_", dir=args.tmp))
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    model = build_model(shape, args.seed, device)
    model.save_config(directory)
    started = time.perf_counter()
    files = {quant: directory / f"{quant}.gguf" for quant in args.quants}
    for quant, path in files.items():
        write_gguf(model, path, quant, args.seed + 2)
    print(f"{shape.name}: wrote {', '.join(files)} in {time.perf_counter() - started:.1f} s", flush=True)
    rows = [row(shape.name, "bf16", "dlo bf16", measure(model, "dlo", inputs, device, args), None)]
    del model
    for quant, path in files.items():
        outputs: dict[str, torch.Tensor] = {}
        for variant in args.variants:
            measured = measure_file(path, directory, shape, variant, inputs, device, args)
            outputs[variant] = measured[0].output
            rows.append(row(shape.name, quant, variant, measured, outputs.get(REFERENCE.get(variant, ""))))
            print(f"{shape.name}/{quant}/{variant}: median {rows[-1].median_s:.4f} s", flush=True)
        path.unlink()
        if args.progress is not None:
            args.progress(rows)
    shutil.rmtree(directory)
    return rows


def markdown_table(rows: list[Row], link_gbps: float) -> str:
    header = ("| shape | quant | variant | median s | floor s | x floor | x dlo bf16 | block GB | H2D GB/s "
              "| exposed s/fwd | peak HBM GiB | output vs resident |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        same = [o for o in rows if o.shape == r.shape and o.quant == r.quant]
        compute = "resident + kernels" if "kernels" in r.variant else "resident"
        resident = next((o for o in same if o.variant == compute), None)
        bf16 = next(o for o in rows if o.shape == r.shape and o.variant == "dlo bf16")
        floor = max(resident.median_s if resident else 0.0, r.block_bytes / (link_gbps * GB))
        versus = "" if REFERENCE.get(r.variant, "resident") == "resident" else f" to {REFERENCE[r.variant]}"
        verdict = ("reference" if r.variant == "resident" else "" if r.equal_to_resident is None
                   else f"bit-identical{versus}" if r.equal_to_resident
                   else f"max abs diff {r.max_abs_diff_vs_resident:.3g}{versus}")
        cells = [
            r.shape, r.quant, r.variant, f"{r.median_s:.4f}", f"{floor:.4f}", f"{r.median_s / floor:.3f}",
            f"{r.median_s / bf16.median_s:.3f}", f"{r.block_bytes / GB:.2f}",
            "" if r.h2d_gbps is None else f"{r.h2d_gbps:.1f}",
            "" if r.exposed_copy_s_per_forward is None else f"{r.exposed_copy_s_per_forward:.4f}",
            "" if r.peak_hbm_bytes is None else f"{r.peak_hbm_bytes / 2**30:.2f}", verdict,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=lambda t: t.split(","), default=["flux", "wan"],
                        help=f"comma-separated, from {', '.join(ALL_SHAPES)} (default: flux,wan)")
    parser.add_argument("--quants", type=lambda t: t.split(","), default=["Q8_0", "Q4_0", "Q4_K"],
                        help="comma-separated GGUF quant types (default: Q8_0,Q4_0,Q4_K)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-gbps", type=float, default=55.3, help="host->device rate for the floor (default: 55.3)")
    parser.add_argument("--tmp", default=None, help="where the GGUF files are written (default: the system's temp dir)")
    parser.add_argument("--num-slots", type=int, default=2, help="dlo's OffloadConfig.num_slots (default: 2)")
    parser.add_argument("--variants", type=lambda t: t.split(","), default=list(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all that run on --device)")
    add_json_flag(parser, "bench_gguf")
    args = parser.parse_args()
    import gguf

    unknown = [s for s in args.shapes if s not in ALL_SHAPES] + [
        q for q in args.quants if q not in gguf.GGMLQuantizationType.__members__
    ] + [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --shapes, --quants or --variants {unknown}")
    device = torch.device(args.device)
    Dlo.config = dlo.OffloadConfig(num_slots=args.num_slots)
    args.variants = [v for v in VARIANTS if v in args.variants and (device.type == "cuda" or v not in CUDA_ONLY)]
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    rows: list[Row] = []

    def progress(shape_rows: list[Row]) -> None:  # the record so far, rewritten after each quant type
        done = rows + shape_rows
        write_json(args.json, "bench_gguf", [asdict(r) for r in done], markdown_table(done, args.link_gbps),
                   environment=environment(device), settings=settings)

    args.progress = progress
    for name in args.shapes:
        rows += run_shape(ALL_SHAPES[name], device, args)
        progress([])
    print()
    print(markdown_table(rows, args.link_gbps))
    return 0 if all(r.equal_to_resident is not False for r in rows if r.variant.startswith("dlo")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
