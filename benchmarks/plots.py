"""The docs' plots, drawn from the JSON records in benchmarks/results/ (matplotlib, the [docs]
extra). Each plot names its record's date, machine and command under it.

    python benchmarks/plots.py OUT_DIR      # writes OUT_DIR/<plot>.png

The docs build (docs/_hooks/generated_files.py) calls `draw_all` and serves the PNGs.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _caption(fig, record: dict) -> None:
    fig.text(0.01, 0.01, f"{record['date']}, {record['machine']}\n{record['command']}", fontsize=6.5, va="bottom")


def _png(fig) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
    return out.getvalue()


def streaming() -> bytes:
    """Seconds per forward: resident, dlo, diffusers group offloading, per shape, with the floor."""
    record = _record("bench_streaming-2026-11-29-h200.json")
    shapes = {"wan": "Wan-14B-shaped 480p/81f", "flux": "Flux-shaped 1024²"}
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, (shape, title) in zip(axes, shapes.items()):
        rows = [r for r in record["rows"] if r["shape"] == shape]
        names = [r["variant"] for r in rows]
        ax.bar(names, [r["median_s"] for r in rows], color=["#999999", "#1f77b4", "#ff7f0e"])
        ax.axhline(rows[0]["floor_s"], color="black", linestyle="--", linewidth=1, label="floor")
        for i, r in enumerate(rows):
            ax.annotate(f"{r['peak_hbm_gib']:.1f} GiB", (i, r["median_s"]), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("s per forward (median)")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Streaming vs resident vs diffusers group offloading (labels: peak HBM)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _caption(fig, record)
    return _png(fig)


def residency() -> bytes:
    """Flux seconds per forward under each HBM budget: automatic residency vs the best hand-set choice."""
    record = _record("bench_residency-2026-11-30-h200.json")
    rows = record["rows"]
    diffusers = record["diffusers_group_offloading"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    budgets = [r["budget_gib"] for r in rows]
    ax.plot(budgets, [r["auto_s"] for r in rows], "o-", label='resident_layers="auto"')
    ax.plot(budgets, [r["best_hand_set_s"] for r in rows], "s--", label="best hand-set resident_layers that fits")
    ax.axhline(diffusers["median_s"], color="#ff7f0e", linestyle=":", label="diffusers group offloading")
    ax.set_xlabel("HBM budget (GiB)")
    ax.set_ylabel("s per forward (median)")
    ax.set_title("Flux-shaped 1024²: automatic residency under a budget", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _caption(fig, record)
    return _png(fig)


def timeline() -> bytes:
    """The copy and compute intervals of each block, from a `dlo demo --trace` file."""
    record = _record("demo-trace-cpu.json")
    events = [e for e in record["trace"]["traceEvents"] if e.get("ph") == "X"]
    start = min(e["ts"] for e in events)
    lanes = {"copy": 1, "compute": 0}
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for e in events:
        lane = lanes[e["cat"]]
        begin, length = (e["ts"] - start) / 1e3, e["dur"] / 1e3
        ax.broken_barh([(begin, length)], (lane - 0.4, 0.8), color="#1f77b4" if lane else "#2ca02c", edgecolor="white")
        if length > 3:
            ax.text(begin + length / 2, lane, e["name"].split(".")[-1], ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([0, 1], ["compute", "copy"])
    ax.set_xlabel("ms since the first event")
    ax.set_title("One trace of dlo demo: each block's copy into a slot, then its compute", fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    _caption(fig, record)
    return _png(fig)


PLOTS: dict[str, Callable[[], bytes]] = {"streaming": streaming, "residency": residency, "timeline": timeline}


def draw_all() -> dict[str, bytes]:
    return {f"{name}.png": draw() for name, draw in PLOTS.items()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/plots.py OUT_DIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, png in draw_all().items():
        (out / name).write_bytes(png)
        print(out / name)
