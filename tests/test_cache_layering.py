"""Imports in the host plane point down only: no two modules import each other, even lazily
inside a function (the loader and the cache's consumer once did)."""

import ast
from pathlib import Path

import dlo

SOURCE = Path(dlo.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every dlo module `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("dlo.")}


def test_host_modules_import_no_module_that_imports_them_back():
    graph = {module_name(path): imports(path) for path in (SOURCE / "host").rglob("*.py")}
    graph = {name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()}

    def reaches(start, goal, seen):
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)) for t in graph[start])

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert cycles == []
