"""The JSON record every maintained benchmark writes beside the table it prints: its rows with the
date, the machine and the command, so a run can be compared later and the docs' plots can be
drawn from it (plots.py).

Where: `--json PATH`; by default `$OUT/<name>.json` when OUT is set (the device machine's output
folder), else `benchmarks/results/runs/<name>-<UTC time>.json` (not committed: keep the runs that
matter in benchmarks/results/ by hand, with their RESULTS.md section).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def default_path(name: str) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"{name}.json"
    return RESULTS / "runs" / f"{name}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"


def add_json_flag(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--json", type=Path, default=default_path(name),
        help=f"where to write the run's JSON record (default: $OUT/{name}.json if OUT is set, else "
        "benchmarks/results/runs/)",
    )


def machine() -> str:
    """The accelerators (or the CPU), the core count and torch, in one line."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        device = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        device = f"cpu ({platform.processor() or platform.machine()})"
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}"


def write_json(path: Path, name: str, rows: list[Any], table: str = "", **extra: Any) -> Path:
    """Write the record (rows: dicts or dataclasses' asdict) and return its path."""
    record = {
        "benchmark": name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        # The caching allocator's settings (newer torch reads the first name first): reserved peaks depend on them.
        "allocator": {name: os.environ[name] for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if name in os.environ},
        **extra,
        "table": table,
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
