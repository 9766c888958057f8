"""`dlo demo`: stream a small real diffusers DiT and prove it matches the resident run.

Runs a short denoising-style loop (each step feeds the model's output back into the latent)
twice from the same seed: fully resident on the device, then with dlo streaming the blocks.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import dlo
from dlo.cli.compile_flag import compile_model, compile_resident_like_streamed
from dlo.cli.config_flags import config_from_flags, device_and_dtype
from dlo.cli.denoise_loop import Trajectory, denoise
from dlo.cli.format import human_bytes, table
from dlo.cli.model_target import build_on_meta, check_config_for_model
from dlo.cli.weight_bytes import payload_bytes
from dlo.config.offload_config import AUTO
from dlo.models.tiny import TINY_MODELS, TinyModel
from dlo.observe.stats import OffloadStats
from dlo.pipelines.output_path import check_publishable, published


@dataclass(frozen=True)
class QuantizationError:
    """The last step's output with float8 weights against the unquantized model's."""

    relative_l2: float
    cosine: float

    @classmethod
    def between(cls, quantized: torch.Tensor, unquantized: torch.Tensor) -> QuantizationError:
        a, b = quantized.double().flatten(), unquantized.double().flatten()
        return cls(float((a - b).norm() / b.norm()), float(torch.nn.functional.cosine_similarity(a, b, dim=0)))


@dataclass(frozen=True)
class DemoResult:
    model: str
    class_name: str
    weight_bytes: int
    device: torch.device
    dtype: torch.dtype
    resident: Trajectory
    streamed: Trajectory
    stats: OffloadStats
    fp8_error: QuantizationError | None = None
    fp8_gemms: bool = False

    @property
    def identical(self) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.resident.outputs, self.streamed.outputs))


def _from_checkpoint(
    entry: TinyModel, directory: Path, dtype: torch.dtype, config: dlo.OffloadConfig
) -> tuple[nn.Module, nn.Module, dlo.HostWeightPlan | None]:
    """(resident reference, model to stream, its plan), both loaded from `directory`. An
    empty or missing directory first gets the built-in model's sharded checkpoint."""
    if not directory.is_dir() or not any(directory.iterdir()):
        entry.build(seed=0, dtype=dtype).save_pretrained(directory, max_shard_size="16MB")
    saved = json.loads((dlo.host.checkpoint.find_transformer_dir(directory) / "config.json").read_text())
    if saved.get("_class_name") != entry.class_name or any(saved.get(k) != v for k, v in entry.config.items() if not isinstance(v, tuple)):
        raise dlo.ConfigError(
            f"--from-checkpoint {directory} holds a {saved.get('_class_name')} checkpoint that is not the built-in "
            f"{entry.name!r} model; dlo demo makes inputs for its built-in models only (use `dlo inspect` for others)"
        )
    import diffusers

    reference = getattr(diffusers, entry.class_name).from_pretrained(directory, torch_dtype=dtype).eval()
    with torch.no_grad():  # ordinary allocations, as a user's resident model would have
        for tensor in [*reference.parameters(), *reference.buffers()]:
            tensor.data = tensor.data.clone()
    streamed, plan = dlo.load_transformer(directory, config, torch_dtype=dtype)
    return reference, streamed, plan


def run_demo(
    model_name: str,
    device: torch.device,
    config: dlo.OffloadConfig,
    steps: int,
    dtype: torch.dtype,
    trace_path: str | None = None,
    checkpoint_dir: Path | None = None,
    compile_how: str = "none",
) -> DemoResult:
    entry = TINY_MODELS[model_name]
    plan = None
    if checkpoint_dir is not None:
        reference, streamed, plan = _from_checkpoint(entry, checkpoint_dir, dtype, config)
    else:
        reference = entry.build(seed=0, dtype=dtype)
        streamed = copy.deepcopy(reference)
    weight_bytes = payload_bytes(reference)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    leading = 0 if config.resident_layers == AUTO else config.resident_layers
    # With float8 the resident model gets the same weights, dequantized on the device; the
    # unquantized copy (for the error) waits on the CPU, out of the resident run's peak.
    unquantized = copy.deepcopy(reference) if config.stream_dtype is not None else None
    reference = reference.to(device)
    dlo.quantize_resident(reference, config)
    compile_resident_like_streamed(reference, compile_how, leading)
    resident = denoise(reference, entry, steps, dtype, device)
    resident_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else weight_bytes
    del reference
    fp8_error = None
    if unquantized is not None:
        unquantized = unquantized.to(device)
        compile_resident_like_streamed(unquantized, compile_how, leading)
        baseline = denoise(unquantized, entry, steps, dtype, device)
        fp8_error = QuantizationError.between(resident.outputs[-1], baseline.outputs[-1])
        del unquantized
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if compile_how != "none":
        torch._dynamo.reset()  # the streamed model's compile counters count its own graphs
        compile_model(streamed, compile_how)
    with dlo.enable(streamed, device, config, plan=plan) as handle:
        run = denoise(streamed, entry, steps, dtype, device)
        stats = handle.stats()
        if trace_path:
            with published(Path(trace_path).expanduser()) as partial:
                handle.export_trace(partial)
    return DemoResult(
        model=model_name,
        class_name=entry.class_name,
        weight_bytes=weight_bytes,
        device=device,
        dtype=dtype,
        resident=Trajectory(resident.outputs, resident.step_s, resident_bytes),
        streamed=Trajectory(run.outputs, run.step_s, stats.peak_device_bytes),
        stats=stats,
        fp8_error=fp8_error,
        fp8_gemms=config.fp8_compute,
    )


def _backing(stats: OffloadStats) -> str:
    if stats.registered_bytes:
        return f"{stats.backing}, {human_bytes(stats.mapped_bytes)} mapped shared read-only, registered: direct copies"
    if stats.mapped_bytes:
        return f"{stats.backing}, {human_bytes(stats.mapped_bytes)} mapped shared read-only"
    return f"{human_bytes(stats.host_bytes)} private, {stats.backing}"


def _residency(stats: OffloadStats) -> str:
    chosen = stats.residency
    budget = f"budget {human_bytes(chosen.budget_bytes)}"
    if chosen.state != "planned":
        return f"{chosen.state}, {budget}" + (f": {chosen.note}" if chosen.note else "")
    measured = f", measured {chosen.measured_call_s * 1e3:.2f} ms" if chosen.measured_call_s is not None else ""
    return (
        f"{len(chosen.resident)} blocks resident, {chosen.num_slots} slots, {budget}; "
        f"predicted {chosen.predicted_call_s * 1e3:.2f} ms per call{measured}"
    )


def render(result: DemoResult) -> str:
    stats, steps = result.stats, len(result.streamed.step_s)
    memory = "peak device memory" if result.device.type == "cuda" else "device weight memory"

    def median_ms(traj: Trajectory) -> str:
        return f"{statistics.median(traj.step_s) * 1e3:.2f} ms"

    rows = [
        ["time per step (median)", median_ms(result.resident), median_ms(result.streamed)],
        [memory, human_bytes(result.resident.device_bytes), human_bytes(result.streamed.device_bytes)],
        ["blocks streamed", "-", f"{stats.streamed_blocks} (+{stats.resident_blocks} resident)"],
        ["bytes streamed per step", "-", human_bytes(stats.bytes_streamed / steps)],
        ["H2D rate", "-", f"{stats.h2d_gbps:.2f} GB/s"],
        ["exposed copy per step", "-", f"{stats.exposed_copy_s / steps * 1e3:.2f} ms"],
        ["setup", "-", f"{stats.setup_s * 1e3:.1f} ms"],
        ["host copy of the blocks", "-", _backing(stats)],
    ]
    if result.fp8_error is not None:
        by_dtype = ", ".join(f"{human_bytes(n)} {name}" for name, n in sorted(stats.host_bytes_by_dtype.items()))
        rows.append(["host bytes by dtype", "-", by_dtype])
        error = result.fp8_error
        rows.append(
            ["float8 vs unquantized (last step)", "-", f"relative L2 {error.relative_l2:.2e}, cosine {error.cosine:.6f}"]
        )
    if stats.residency is not None:
        rows.append(["resident_layers='auto'", "-", _residency(stats)])
    if stats.compile.graphs:
        counts = stats.compile
        compiled = f"{counts.graphs} graphs, {counts.recompiles} recompiles, {counts.graph_breaks} graph breaks"
        rows.append(["torch.compile", "-", compiled])
    verdict = "bit-identical" if result.identical else "DIFFERENT"
    if result.fp8_gemms:
        verdict += " (the resident run has the same float8 weights and runs the same FP8 GEMMs)"
    elif result.fp8_error is not None:
        verdict += " (the resident run has the same float8 weights, dequantized on its device)"
    dtype = str(result.dtype).removeprefix("torch.")
    return "\n".join(
        [
            f"dlo demo: {result.class_name} ({result.model}), {human_bytes(result.weight_bytes)} of weights, "
            f"{dtype} on {result.device}, {steps} steps",
            "",
            table(["", "resident", "streamed (dlo)"], rows),
            "",
            f"outputs: {verdict} over {steps} steps",
        ]
    )


def save_outputs(path: str, resident: list[torch.Tensor], streamed: list[torch.Tensor]) -> None:
    """Both runs' per-step outputs, for a check that does not take the demo's word for it."""
    with published(Path(path).expanduser()) as partial:
        torch.save({"resident": resident, "streamed": streamed}, partial)


def run(args: argparse.Namespace) -> int:
    device, dtype = device_and_dtype(args)
    config = config_from_flags(args, **({"use_allgather": True} if args.nproc > 1 else {}))  # the all-gather demo
    for flag, path in (("--trace", args.trace), ("--save-outputs", args.save_outputs)):
        if path:
            check_publishable(Path(path).expanduser(), flag)
    check_config_for_model(build_on_meta(args.model), config, args.model, dtype, device)
    if args.nproc > 1:
        from dlo.cli.demo_ranks import run_ranks

        if args.trace or args.from_checkpoint is not None:
            raise dlo.ConfigError("--nproc runs the all-gather demo; it does not take --trace or --from-checkpoint")
        if args.compile != "none":
            raise dlo.ConfigError("--nproc runs the all-gather demo; it does not take --compile")
        return run_ranks(args.model, device.type, args.nproc, config, args.steps, dtype, args.save_outputs)
    if args.from_checkpoint is None:
        result = run_demo(args.model, device, config, args.steps, dtype, args.trace, compile_how=args.compile)
    elif args.from_checkpoint:
        result = run_demo(
            args.model, device, config, args.steps, dtype, args.trace, Path(args.from_checkpoint), args.compile
        )
    else:
        with tempfile.TemporaryDirectory(prefix="dlo-demo-") as directory:
            result = run_demo(args.model, device, config, args.steps, dtype, args.trace, Path(directory), args.compile)
    if args.save_outputs:
        save_outputs(args.save_outputs, result.resident.outputs, result.streamed.outputs)
    print(render(result))
    if args.trace:
        print(f"timeline written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    return 0 if result.identical else 1
