"""The docs cannot drift from the code: the generated reference covers every OffloadConfig and
OffloadStats field and every command, Troubleshooting names every error class, checkpoint error
kind and fallback code, nothing cites a file outside the repository, and the README stays a front
page whose Quick start is what CI runs."""

import dataclasses
import importlib
import importlib.util
import pkgutil
import re
import subprocess
from pathlib import Path

import pytest

import dlo
from dlo.config import OffloadConfig
from dlo.errors import DloError
from dlo.host.preflight import FALLBACK_CODES
from dlo.host.safetensors_file import CheckpointErrorKind
from dlo.observe.stats import OffloadStats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("dlo_docs_reference", ROOT / "docs" / "_hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_offload_config_field_is_in_the_reference_with_its_rule(reference):
    table = reference.offload_config()
    for spec in dataclasses.fields(OffloadConfig):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{spec.name}` |"))
        assert spec.metadata["help"].replace("|", "\\|") in row


def test_every_offload_stats_field_has_its_meaning_in_the_class_docstring(reference):
    meanings = reference.stats_fields()
    assert {spec.name for spec in dataclasses.fields(OffloadStats) if not meanings.get(spec.name)} == set()


def test_every_command_is_in_the_cli_reference(reference):
    commands = dict(reference.cli_commands())
    assert {"dlo", "dlo demo", "dlo generate", "dlo serve", "dlo inspect", "dlo make-tiny", "dlo cache",
            "dlo cache ls", "dlo cache verify", "dlo cache rm", "dlo cache gc"} <= set(commands)
    assert "--stall-timeout-s" in commands["dlo serve"] and "--num-slots" in commands["dlo generate"]


def _error_classes() -> set[str]:
    for info in pkgutil.walk_packages(dlo.__path__, "dlo."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # a module of an optional dependency (triton...)
            continue
    found, todo = set(), [DloError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


def test_troubleshooting_names_every_error_class_kind_and_fallback_code():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    names = _error_classes() | {kind.value for kind in CheckpointErrorKind} | set(FALLBACK_CODES)
    assert {name for name in names if f"`{name}`" not in page} == set()


# Files outside the repository (the project's contract lives elsewhere) are never cited.
# (Built from pieces, so that this file does not match itself.)
OUTSIDE = re.compile("|".join(["SPEC" + " §", "SPEC" + r"\.md", r"\.\./" + "shared/", "/work/" + "shared"]))
def test_nothing_in_the_repository_cites_a_file_outside_it():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    citing = [
        name for name in files
        if name.endswith((".py", ".md", ".toml", ".yml", ".txt"))
        and (ROOT / name).is_file() and OUTSIDE.search((ROOT / name).read_text(errors="replace"))
    ]
    assert citing == []


def test_the_readme_is_a_front_page_whose_quick_start_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    quick_start = re.search(r"## Quick start\n.*?```bash\n(.*?)```", readme, re.S)[1].strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    assert len(quick_start) == 2 and all(command in ci for command in quick_start)
