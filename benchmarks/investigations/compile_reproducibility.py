"""Is a regionally compiled resident model reproducible by itself? The control for bench_compile's
bit-identity column.

In one process, for one shape of bench_streaming.py: compile the resident model
(compile_repeated_blocks(fullgraph=True)), run it --calls times on the same inputs (are the calls
equal to each other?), then build and compile the same model again — dynamo reset, inductor's
and Triton's caches kept, so the second compilation reuses the first one's kernels and the
configurations they picked by timing — and run it once (equal to the first compilation?); with
--dlo, a third model compiled the same way and then streamed by dlo.enable (equal to the first?
to the second?).
--deterministic also sets torch.use_deterministic_algorithms(True) and, where this torch has
it, torch._inductor.config.deterministic (no kernel choice by timing). --kernels DIR writes, per
compilation that produced new code, the generated wrapper modules (the code that calls every
kernel, extern GEMMs included) and kernels.json: each Triton kernel's source file and the
configuration its autotuner runs with, to diff two compilations offline.

On the GPU machine, from the repository root, with diffusers on PYTHONPATH (see bench_compile.py):

  python3 benchmarks/investigations/compile_reproducibility.py --shapes flux,wan
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 benchmarks/investigations/compile_reproducibility.py --shapes flux --deterministic
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch._dynamo
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import fresh_inductor_cache

import dlo
# The maintained benchmarks' models and helpers, one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_streaming import SHAPES, build_model, release, to_device  # noqa: E402


def _loaded_modules() -> list:
    modules = PyCodeCache.modules
    return list(modules.values()) if isinstance(modules, dict) else list(modules)


def _write_kernels(modules: list, directory: Path) -> None:
    """The wrapper modules among `modules` (they define `call`) and the kernels they launch."""
    directory.mkdir(parents=True, exist_ok=True)
    kernels = {}
    for index, module in enumerate(m for m in modules if hasattr(m, "call")):
        shutil.copy(module.__file__, directory / f"wrapper{index:02d}.py")
        for name, value in vars(module).items():
            launchers = getattr(value, "launchers", None)
            if launchers is None or not hasattr(value, "configs"):
                continue
            chosen = str(launchers[0].config) if len(launchers) == 1 else f"{len(launchers)} launchers"
            kernels[f"{index:02d}/{name}"] = {"file": Path(getattr(value, "filename", "") or "").name, "config": chosen}
    (directory / "kernels.json").write_text(json.dumps(kernels, indent=1, sort_keys=True) + "\n")


def _compiled_outputs(
    shape_name: str, device: torch.device, calls: int, streamed: bool = False, kernels: Path | None = None
) -> list[torch.Tensor]:
    shape = SHAPES[shape_name]
    known = len(_loaded_modules())
    torch._dynamo.reset()
    model = build_model(shape, 0, device)  # built (seeded) on the CPU
    model.compile_repeated_blocks(fullgraph=True)
    handle = dlo.enable(model, device) if streamed else None
    if handle is None:
        model.to(device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(1)), device)
    outputs = []
    with torch.inference_mode():
        for _ in range(calls):
            outputs.append(model(**inputs)[0].cpu())
    if kernels is not None:
        _write_kernels(_loaded_modules()[known:], kernels)
    if handle is not None:
        handle.disable()
    del model, handle
    release(device)
    return outputs


def _compare(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "equal"
    return f"max abs diff {(a.float() - b.float()).abs().max().item():.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=["flux"])
    parser.add_argument("--calls", type=int, default=3, help="calls of the first compilation (default: 3)")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--dlo", action="store_true", help="also a third compilation, streamed by dlo")
    parser.add_argument("--kernels", type=Path, default=None, help="write each compilation's code and kernel choices here")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        if hasattr(torch._inductor.config, "deterministic"):
            torch._inductor.config.deterministic = True
    rows = []
    with fresh_inductor_cache():
        for name in args.shapes:
            where = (lambda tag: args.kernels / f"{name}-{tag}") if args.kernels is not None else (lambda tag: None)
            first = _compiled_outputs(name, device, args.calls, kernels=where("first"))
            again = _compiled_outputs(name, device, 1, kernels=where("again"))
            calls = ", ".join(_compare(first[0], later) for later in first[1:])
            streamed = ["-", "-"]
            if args.dlo:
                dlo_output = _compiled_outputs(name, device, 2, True, where("dlo"))[-1]
                streamed = [_compare(first[0], dlo_output), _compare(again[0], dlo_output)]
            cells = [name, str(args.deterministic), calls, _compare(first[0], again[0]), *streamed]
            rows.append("| " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    print("\n| shape | deterministic | later calls vs call 1 | second compilation vs first | dlo vs first | dlo vs second |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
