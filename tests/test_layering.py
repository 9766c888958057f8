"""Imports point down the planes only, and no two modules of dlo import each other.

Every `import dlo...` / `from dlo... import` counts, also those inside functions: a lazy
import is still a dependency, it only hides a cycle from the interpreter.
"""

import ast
from pathlib import Path

import dlo

SOURCE = Path(dlo.__file__).parent

# Lower planes first; a module may import its own plane or a lower one.
PLANES = ["errors", "config", "planning", "host", "observe", "hotpath", "backend", "models", "pipelines", "serve", "cli"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SOURCE.rglob("*.py"):
        name = _module_name(path)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dlo"):
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("dlo"))
        graph[name] = found - {name}
    return graph


def _plane(module: str) -> int | None:
    parts = module.split(".")
    return PLANES.index(parts[1]) if len(parts) > 1 and parts[1] in PLANES else None


def test_every_import_points_to_the_same_or_a_lower_plane():
    upward = []
    for module, imported in _imports().items():
        if module == "dlo":  # the package front door re-exports every plane
            continue
        for target in imported:
            if _plane(module) is not None and _plane(target) is not None and _plane(target) > _plane(module):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_import_cycles_between_dlo_modules():
    graph = {module: {t for t in targets if t in _imports_known} for module, targets in _imports().items()}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for target in graph.get(module, ()):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module != "dlo" and module not in done:
            visit(module, [module])
    assert [c for c in cycles if not c.startswith("dlo ->")] == []


_imports_known = {_module_name(path) for path in SOURCE.rglob("*.py")} - {"dlo"}
