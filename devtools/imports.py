"""The modules a source file imports, read from its syntax tree (nothing is executed): the tests of the layers'
import boundaries and of the wheel's contents read the code the same way."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a source file imports, relative imports resolved against its package."""
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return found
