"""A whole text-to-image/video pipeline under one device budget (enable_pipeline with
hbm_budget_gib), beside the pipeline resident, dlo streaming the transformer alone, and diffusers'
three offloads, one variant at a time in one process.

Pipelines, random weights at real shapes (nothing downloaded), bf16 (the VAE too):
  wan   WanPipeline: Wan-14B-shaped transformer (12 of 40 layers), UMT5-XXL-shaped text encoder
        (24 layers, 256384-token vocabulary), the Wan 2.1 VAE; 480x832, 81 frames, guidance 5.
  flux  FluxPipeline: Flux-shaped transformer (6+12 layers), T5-XXL-shaped and CLIP-L-shaped
        text encoders, the Flux VAE; 1024x1024, guidance 0.
  tiny  the tiny Wan pipeline of dlo.models.tiny_pipelines (a CPU smoke test of this script).
The tokenizers are dlo's tiny ones (random weights make the words irrelevant); the prompts are
padded to 512 tokens as the real ones are.

Variants (each: one untimed call, then --iters timed calls, the median reported; peak =
torch.cuda.max_memory_allocated over setup and every call, reserved = the caching allocator's
max_memory_reserved; encode / decode = the median call's seconds in the text encoders and in the
VAE decode, each between synchronizations at its edges):
  resident         every component on the device (the reference output)
  dlo transformer  enable_pipeline without a budget: the transformer streamed, the rest resident
  dlo budget       enable_pipeline(OffloadConfig(resident_layers="auto", hbm_budget_gib=B))
  dlo budget capped  the same on a device of the budget's size: the caching allocator may reserve
                   no more than B (torch.cuda.set_per_process_memory_fraction; past it, it frees its
                   cached blocks and retries before it raises out-of-memory). Run last whatever the
                   order asked: the convolution plans cuDNN picks under the cap stay cached for
                   the variants after it (a slower decode with other bits, measured)
  dlo ample        the same with a budget that holds everything
  model offload    diffusers' enable_model_cpu_offload
  group offload    diffusers' pipe.enable_group_offload(block_level, 1 block per group, streams)
  sequential       diffusers' enable_sequential_cpu_offload
dlo's outputs are compared with the resident pipeline decoding the same way (a tiled plan with a
tiled resident decode). The budget target: time <= 1.05x "dlo transformer", peak <= B.
Run it as dlo's commands run under a budget, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(the JSON records the setting): with the allocator's defaults the capped Wan run fails.

Also: the VAE decode's peak predicted by dlo (on the meta device) beside the one measured on
the device (max_memory_allocated less what was allocated before), whole and tiled.

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  cd benchmarks && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench_pipeline_budget.py --pipelines wan,flux
CPU smoke test: python bench_pipeline_budget.py --pipelines tiny --device cpu --variants resident,dlo-budget
"""

from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np
import torch
from diffusers.models.modeling_utils import no_init_weights

import bench_streaming as bench
import dlo
from dlo.backend.decode_peak import OutputSize, decode_costs, latent_shape
from dlo.backend.pipeline import pipeline_plan
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS, _clip_tokenizer, _t5_tokenizer
from dlo.planning.pipeline_budget import DecodeMode
from results_json import add_json_flag, write_json

GIB = 2**30
VARIANTS = ("resident", "dlo-transformer", "dlo-budget", "dlo-budget-capped", "dlo-ample", "model-offload", "group-offload", "sequential")


def _random(module: torch.nn.Module, seed: int, device: torch.device) -> torch.nn.Module:
    """Every parameter drawn on `device` (fast), then kept on the CPU in bf16."""
    generator = torch.Generator(device).manual_seed(seed)
    for param in module.parameters():
        param.data = torch.randn(param.shape, generator=generator, device=device).mul_(0.02).to(torch.bfloat16).cpu()
    return module.eval()


def _t5_xxl(config_cls, vocab: int):
    return config_cls(
        vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
    )


def build(name: str, device: torch.device):
    """The pipeline and its call arguments."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    if name == "tiny":
        from dlo.models.tiny_pipelines import save_tiny_wan_pipeline
        import tempfile

        directory = save_tiny_wan_pipeline(tempfile.mkdtemp())
        pipe = diffusers.WanPipeline.from_pretrained(directory)
        return pipe, {**GENERATE_DEFAULTS["wan"], "num_inference_steps": 2}
    if name == "wan":
        with no_init_weights():
            encoder = UMT5EncoderModel(_t5_xxl(UMT5Config, 256384))
            vae = diffusers.AutoencoderKLWan()
        pipe = diffusers.WanPipeline(
            tokenizer=_t5_tokenizer(),
            text_encoder=_random(encoder, 1, device),
            vae=_random(vae, 2, device),
            scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
            transformer=bench.build_model(bench.SHAPES["wan"], seed=0, device=device),
        )
        call = dict(height=480, width=832, num_frames=81, guidance_scale=5.0, num_inference_steps=2, max_sequence_length=512)
        return pipe, call
    with no_init_weights():
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            max_position_embeddings=77, projection_dim=768,
        ))
        t5 = T5EncoderModel(_t5_xxl(T5Config, 32128))
        vae = diffusers.AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, sample_size=1024,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        )
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=_random(vae, 2, device), text_encoder=_random(clip, 3, device), tokenizer=_clip_tokenizer(),
        text_encoder_2=_random(t5, 1, device), tokenizer_2=_t5_tokenizer(),
        transformer=bench.build_model(bench.SHAPES["flux"], seed=0, device=device),
    )
    return pipe, dict(height=1024, width=1024, guidance_scale=0.0, num_inference_steps=4, max_sequence_length=512)


def call(pipe, kwargs: dict, device: torch.device) -> tuple[np.ndarray, float]:
    bench.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = pipe("a red cube", generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
    bench.synchronize(device)
    media = out.frames[0] if hasattr(out, "frames") else out.images[0]
    return np.asarray(media), time.perf_counter() - start


class Phases:
    """Seconds a call spends in its text encoders and in its VAE decode, each timed between
    device synchronizations at its edges (the denoising steps are the rest of the call)."""

    ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")

    def __init__(self, pipe, device: torch.device) -> None:
        self.seconds = {"encode": 0.0, "decode": 0.0}
        self._device = device
        self._hooks = []
        for name in self.ENCODERS:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                self._hooks.append(module.register_forward_pre_hook(lambda *_: self._start()))
                self._hooks.append(module.register_forward_hook(lambda *_: self._stop("encode")))
        self._vae, self._decode = pipe.vae, pipe.vae.decode

        def timed_decode(*args, **kwargs):
            self._start()
            try:
                return self._decode(*args, **kwargs)
            finally:
                self._stop("decode")

        pipe.vae.decode = timed_decode

    def _start(self) -> None:
        bench.synchronize(self._device)
        self._started = time.perf_counter()

    def _stop(self, phase: str) -> None:
        bench.synchronize(self._device)
        self.seconds[phase] += time.perf_counter() - self._started

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self._vae.decode  # the class's method again


@dataclass
class Row:
    pipeline: str
    variant: str
    call_s: float
    peak_gib: float | None
    decode: str
    equal: str
    note: str = ""
    encode_s: float | None = None  # of the median call
    decode_s: float | None = None
    reserved_gib: float | None = None  # the caching allocator's peak: what the process held


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reserved_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else None


def run_variant(name, variant, pipe, kwargs, size, device, args) -> tuple[Row, np.ndarray]:
    if variant != "dlo-budget-capped":
        return measure_variant(name, variant, pipe, kwargs, size, device, args)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.empty_cache()  # what is reserved now counts against the cap
    torch.cuda.set_per_process_memory_fraction(args.budget[name] * GIB / total, index)
    try:
        return measure_variant(name, variant, pipe, kwargs, size, device, args)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def measure_variant(name, variant, pipe, kwargs, size, device, args) -> tuple[Row, np.ndarray]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    handle, decode, note = None, "whole", ""
    if variant == "resident":
        pipe.to(device)
    elif variant == "dlo-transformer":
        handle = dlo.enable_pipeline(pipe, device, dlo.OffloadConfig())
    elif variant in ("dlo-budget", "dlo-budget-capped", "dlo-ample"):
        budget = 1000.0 if variant == "dlo-ample" else args.budget[name]
        config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=budget)
        handle = dlo.enable_pipeline(pipe, device, config, size=size)
        decode = handle.plan.decode.mode.value
        note = f"budget {budget} GiB; " + "; ".join(handle.plan.describe())
    elif variant == "model-offload":
        pipe.enable_model_cpu_offload(device=device)
    elif variant == "group-offload":
        pipe.enable_group_offload(device, offload_type="block_level", num_blocks_per_group=1, use_stream=True, record_stream=True)
    elif variant == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    phases = Phases(pipe, device)
    call(pipe, kwargs, device)  # untimed: compiles nothing, but plans dlo's residency and warms the kernels
    calls = []
    for _ in range(args.iters):
        phases.reset()
        media, seconds = call(pipe, kwargs, device)
        calls.append((seconds, phases.seconds))
    phases.remove()
    seconds, spent = sorted(calls, key=lambda c: c[0])[len(calls) // 2]
    peak = peak_gib(device)
    if handle is not None:
        stats = handle.stats()
        transformer = stats.get("transformer")
        if transformer is not None and transformer.residency is not None:
            note += f"; residency {transformer.residency.state}, {len(transformer.residency.resident)} blocks resident"
        handle.disable()
    return Row(name, variant, seconds, peak, decode, "", note, spent["encode"], spent["decode"], reserved_gib(device)), media


def decode_rows(name, pipe, size, device) -> list[dict]:
    """The VAE decode's predicted peak beside the measured one, whole and tiled."""
    if device.type != "cuda":
        return []
    vae = pipe.vae.to(device)
    shape = latent_shape(pipe, size)
    rows = []
    for cost in decode_costs(pipe, size):
        if cost.mode is DecodeMode.SLICED:
            continue
        if cost.mode is DecodeMode.TILED:
            vae.enable_tiling()
        latents = torch.randn(shape, device=device, dtype=vae.dtype)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            video = vae.decode(latents).sample
            video.float().mul(0.5).add(0.5).clamp(0, 1)  # the post-processing's float32 copies
        measured = torch.cuda.max_memory_allocated(device) - before
        rows.append({"pipeline": name, "decode": cost.mode.value, "predicted_gib": cost.peak_bytes / GIB,
                     "measured_gib": measured / GIB, "predicted_over_measured": cost.peak_bytes / max(measured, 1)})
        print(f"{name} {cost.mode.value} decode: predicted {cost.peak_bytes / GIB:.2f} GiB, measured "
              f"{measured / GIB:.2f} GiB", flush=True)
        del latents, video
    vae.disable_tiling()
    pipe.vae.to("cpu")
    bench.release(device)
    return rows


def run_pipeline(name: str, device: torch.device, args) -> tuple[list[Row], list[dict]]:
    pipe, kwargs = build(name, device)
    size = OutputSize(kwargs["height"], kwargs["width"], kwargs.get("num_frames", 1))
    decodes = decode_rows(name, pipe, size, device)
    budget = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=args.budget[name])
    tiled = pipeline_plan(pipe, budget, size).decode.mode is DecodeMode.TILED  # from shapes: nothing moves
    rows, outputs = [], {}
    for variant in args.variants:
        if variant in ("model-offload", "group-offload", "sequential"):
            pipe, kwargs = build(name, device)  # diffusers' hooks move and wrap the weights: a fresh pipeline
        try:
            row, media = run_variant(name, variant, pipe, kwargs, size, device, args)
        except torch.OutOfMemoryError as err:
            traceback.print_exc()  # where the allocator gave up: the planner's miss to explain
            row, media = Row(name, variant, float("nan"), peak_gib(device), "-", "-", f"out of memory: {err}"[:200]), None
        if variant == "resident" and tiled:  # the reference of a tiled plan, on the same resident pipeline
            pipe.vae.enable_tiling()
            outputs["resident-tiled"] = (call(pipe, kwargs, device)[0], "tiled")
            pipe.vae.disable_tiling()
        if variant == "resident":
            pipe.to("cpu")
        outputs[variant] = (media, row.decode)
        rows.append(row)
        bench.release(device)
        args.save(rows, decodes)  # a run cut short keeps the variants it finished
        print(
            f"{name}/{variant}: {row.call_s:.3f} s per call (encode {row.encode_s}, decode {row.decode_s}), peak "
            f"{row.peak_gib} GiB, reserved {row.reserved_gib} GiB, {row.decode} decode {row.note}", flush=True,
        )
    for row in rows:
        media, decode = outputs[row.variant]
        reference = outputs.get("resident-tiled" if decode == "tiled" else "resident", (None,))[0]
        if media is None or reference is None or row.variant == "resident":
            continue
        row.equal = "bit-identical" if np.array_equal(media, reference, equal_nan=True) else f"max abs diff {np.abs(media - reference).max():.3g}"
    return rows, decodes


def table(rows: list[Row]) -> str:
    lines = [
        "| pipeline | variant | s per call | encode s | decode s | peak GiB | reserved GiB | decode | output vs resident |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None or value != value else f"{value:.{digits}f}"

    for r in rows:
        lines.append(
            f"| {r.pipeline} | {r.variant} | {number(r.call_s, 3)} | {number(r.encode_s, 3)} | {number(r.decode_s, 3)} | "
            f"{number(r.peak_gib, 2)} | {number(r.reserved_gib, 2)} | {r.decode} | {r.equal or '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default="wan,flux")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--wan-budget", type=float, default=8.0)
    parser.add_argument("--flux-budget", type=float, default=6.0)
    add_json_flag(parser, "bench_pipeline_budget")
    args = parser.parse_args()
    args.variants = sorted(args.variants.split(","), key=lambda v: v == "dlo-budget-capped")  # last: see the docstring
    if "dlo-budget-capped" in args.variants and args.device.split(":")[0] != "cuda":
        parser.error("--variants dlo-budget-capped caps a CUDA device's allocator: pass --device cuda or leave it out")
    args.budget = {"wan": args.wan_budget, "flux": args.flux_budget, "tiny": 0.01}
    device = torch.device(args.device)
    rows, decodes = [], []

    def save(more_rows: list[Row], more_decodes: list[dict]) -> None:
        done = rows + more_rows
        write_json(args.json, "bench_pipeline_budget", [asdict(r) for r in done], table(done),
                   decode_prediction=decodes + more_decodes, settings={"iters": args.iters, "budgets": args.budget})

    args.save = save
    for name in args.pipelines.split(","):
        got, predicted = run_pipeline(name, device, args)
        rows += got
        decodes += predicted
        save([], [])
    print(table(rows))


if __name__ == "__main__":
    main()
