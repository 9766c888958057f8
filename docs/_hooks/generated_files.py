"""Files of the site made at build time (an MkDocs hook, see mkdocs.yml): the benchmark log
(benchmarks/RESULTS.md, as the page benchmark-log.md) and the plots benchmarks/plots.py draws
from the JSON records in benchmarks/results/ (as assets/plots/NAME.png)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


def _plots():
    spec = importlib.util.spec_from_file_location("dlo_benchmark_plots", ROOT / "benchmarks" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    log = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    files.append(File.generated(config, "benchmark-log.md", content=log))
    for name, png in _plots().draw_all().items():
        files.append(File.generated(config, f"assets/plots/{name}", content=png))
    return files
