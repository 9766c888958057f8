"""Reference pages generated from the code at build time (an MkDocs hook, see mkdocs.yml).

A page asks for a generated part with a marker line `<!-- dlo-reference: NAME -->`:
`offload-config` (every OffloadConfig field: type, default, CLI flag, rule), `offload-stats`
(every OffloadStats field with its meaning, from the class docstring), `cli` (every command's
`--help`, from the argparse parser) and `python-api` (mkdocstrings entries for every name
`dlo` exports). The same functions back tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

MARKER = re.compile(r"^<!-- dlo-reference: ([a-z-]+) -->$", re.MULTILINE)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(spec: dataclasses.Field) -> str:
    if spec.default is dataclasses.MISSING:
        return "(required)"
    value = spec.default
    if isinstance(value, str) and value.startswith(str(Path.home())):
        value = "~" + value[len(str(Path.home())):]  # the default is expanded at import: show it unexpanded
    return f"`{value!r}`"


def config_flag(spec: dataclasses.Field) -> str:
    """The CLI flag of a field, as dlo.cli.config_flags makes it."""
    flag = "--" + spec.name.replace("_", "-")
    if spec.type in (bool, "bool"):
        return f"`{flag}` / `--no-{flag[2:]}`"
    return " ".join(f"`{name}`" for name in (flag, *spec.metadata.get("aliases", ())))


def offload_config() -> str:
    from dlo.config import OffloadConfig

    rows = ["| field | type | default | CLI flag | what it does, and the values it takes |", "| --- | --- | --- | --- | --- |"]
    for spec in dataclasses.fields(OffloadConfig):
        rows.append(
            f"| `{spec.name}` | `{_cell(str(spec.type))}` | {_default(spec)} | {config_flag(spec)} | "
            f"{_cell(spec.metadata['help'])} |"
        )
    return "\n".join(rows)


_ENTRY = re.compile(r"^    (?! )(?P<names>[a-z0-9_]+(?: / [a-z0-9_]+)*): (?P<text>.*)$")


def stats_fields() -> dict[str, str]:
    """OffloadStats field -> its meaning, read from the class docstring's `name: text` entries
    (`a / b: text` documents both)."""
    from dlo.observe.stats import OffloadStats

    meanings: dict[str, str] = {}
    current: list[str] = []
    for line in (OffloadStats.__doc__ or "").splitlines():
        entry = _ENTRY.match(line)
        if entry:
            current = entry["names"].split(" / ")
            for name in current:
                meanings[name] = entry["text"]
        elif line.startswith("        ") and current:
            for name in current:
                meanings[name] += " " + line.strip()
        else:
            current = []
    return meanings


def offload_stats() -> str:
    from dlo.observe.stats import OffloadStats

    meanings = stats_fields()
    rows = ["| field | type | meaning |", "| --- | --- | --- |"]
    for spec in dataclasses.fields(OffloadStats):
        rows.append(f"| `{spec.name}` | `{_cell(str(spec.type))}` | {_cell(meanings.get(spec.name, ''))} |")
    return "\n".join(rows)


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{prefix} {name}")
    return found


def cli_commands() -> list[tuple[str, str]]:
    """(command, its --help text) for `dlo` and every subcommand, at a fixed width."""
    from dlo.cli.main import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: make the page stable
    try:
        return [(name, sub.format_help()) for name, sub in _commands(build_parser(), "dlo")]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def cli() -> str:
    parts = []
    for name, text in cli_commands():
        level = "##" if name.count(" ") <= 1 else "###"
        parts.append(f"{level} `{name}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def python_api() -> str:
    import dlo

    return "\n".join(f"::: {dlo._EXPORTS[name]}.{name}\n" for name in dlo.__all__)


GENERATED = {"offload-config": offload_config, "offload-stats": offload_stats, "cli": cli, "python-api": python_api}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def generated(match: re.Match) -> str:
        return GENERATED[match[1]]()

    return MARKER.sub(generated, markdown)
