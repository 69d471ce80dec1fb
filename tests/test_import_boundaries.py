"""The layers stay apart: the core imports no verl, and neither glue (verl, OpenRLHF) imports the CPU development
tooling."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib, pkgutil, sys
import {package}
for info in pkgutil.walk_packages({package}.__path__, "{package}."):
    importlib.import_module(info.name)
leaked = sorted(m for m in sys.modules if m == "{forbidden}" or m.startswith("{forbidden}."))
print("LEAKED", leaked)
sys.exit(1 if leaked else 0)
"""


@pytest.mark.parametrize("package,forbidden", [
    ("oar_verl.core", "verl"),  # the maths runs without verl
    ("oar_verl.integration", "oar_verl.cpu"),  # the glue that runs on GPU clusters never loads the CPU shims
])
def test_package_does_not_import(package, forbidden):
    proc = subprocess.run([sys.executable, "-c", CHECK.format(package=package, forbidden=forbidden)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("module", ["oar_verl.integration.estimator", "oar_verl.integration.worker",
                                    "oar_verl.integration.step", "oar_verl.integration.guard"])
def test_plugin_loads_whatever_is_imported_first(module):
    """verl loads our plugin on ``import verl``; a module of ours that imports verl first must not leave the plugin
    half-loaded (an import cycle would make it log "plugin failed to load" and drop the ``oar`` estimator)."""
    code = (f"import {module}\nfrom verl.trainer.ppo.core_algos import get_adv_estimator_fn\n"
            "get_adv_estimator_fn('oar')\nfrom oar_verl.integration import plugin\nassert plugin.loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "plugin failed to load" not in proc.stderr, proc.stderr[-4000:]


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, relative imports resolved against its package."""
    rel = path.relative_to(ROOT).with_suffix("")
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


@pytest.mark.parametrize("forbidden", ["verl", "oar_verl.integration", "oar_verl.cpu"])
def test_openrlhf_glue_imports_neither_verl_nor_the_cpu_tooling(forbidden):
    """Read from the sources (OpenRLHF is only installed in .venv-openrlhf): the OpenRLHF glue imports OpenRLHF and
    the core, never verl, the verl glue or the CPU platform that development runs put around it."""
    files = sorted((ROOT / "oar_verl" / "openrlhf").rglob("*.py"))
    assert files
    leaks = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f)
                                              if m == forbidden or m.startswith(forbidden + "."))
             for f in files}
    assert not any(leaks.values()), {f: m for f, m in leaks.items() if m}


@pytest.mark.parametrize("forbidden", ["research", "benchmarks"])
def test_the_product_imports_no_research(forbidden):
    """The product (``oar_verl``, the wheel) never imports the research package: research imports the product."""
    files = sorted((ROOT / "oar_verl").rglob("*.py"))
    leaks = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f)
                                              if m == forbidden or m.startswith(forbidden + "."))
             for f in files}
    assert not any(leaks.values()), {f: m for f, m in leaks.items() if m}
