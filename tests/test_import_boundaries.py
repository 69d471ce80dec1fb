"""The layers stay apart: the core imports no verl, and neither glue (verl, OpenRLHF) imports the CPU development
tooling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from devtools.imports import imported_modules as _imported_modules

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


PACKAGE_BOUNDARIES = [
    ("oar_verl.core", "verl"),  # the maths runs without verl
    ("oar_verl.integration", "oar_verl.quickstart"),  # the glue that runs on GPU clusters never loads the CPU shims
]
PLUGIN_FIRST = ["oar_verl.integration.estimator", "oar_verl.integration.worker", "oar_verl.integration.step",
                "oar_verl.integration.guard"]


def _plugin_first(module: str) -> str:
    return (f"import {module}\nfrom verl.trainer.ppo.core_algos import get_adv_estimator_fn\n"
            "get_adv_estimator_fn('oar')\nfrom oar_verl.integration import plugin\nassert plugin.loaded\n")


@pytest.fixture(scope="module")
def fresh_interpreters() -> dict[str, subprocess.CompletedProcess]:
    """Each check in its own fresh interpreter (an import's side effects are the thing tested), two at a time: each
    spends ~8 s importing verl, so on 2 cores the six checks take the time of three."""
    from concurrent.futures import ThreadPoolExecutor

    codes = {f"boundary:{p}:{f}": CHECK.format(package=p, forbidden=f) for p, f in PACKAGE_BOUNDARIES}
    codes.update({f"first:{m}": _plugin_first(m) for m in PLUGIN_FIRST})
    with ThreadPoolExecutor(2) as pool:
        procs = pool.map(lambda code: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                     timeout=300), codes.values())
        return dict(zip(codes, procs))


@pytest.mark.parametrize("package,forbidden", PACKAGE_BOUNDARIES)
def test_package_does_not_import(fresh_interpreters, package, forbidden):
    proc = fresh_interpreters[f"boundary:{package}:{forbidden}"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("module", PLUGIN_FIRST)
def test_plugin_loads_whatever_is_imported_first(fresh_interpreters, module):
    """verl loads our plugin on ``import verl``; a module of ours that imports verl first must not leave the plugin
    half-loaded (an import cycle would make it log "plugin failed to load" and drop the ``oar`` estimator)."""
    proc = fresh_interpreters[f"first:{module}"]
    assert proc.returncode == 0 and "plugin failed to load" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("forbidden", ["verl", "oar_verl.integration", "oar_verl.quickstart"])
def test_openrlhf_glue_imports_neither_verl_nor_the_cpu_tooling(forbidden):
    """Read from the sources (OpenRLHF is only installed in .venv-openrlhf): the OpenRLHF glue imports OpenRLHF and
    the core, never verl, the verl glue or the CPU platform that development runs put around it."""
    files = sorted((ROOT / "oar_verl" / "openrlhf").rglob("*.py"))
    assert files
    leaks = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f)
                                              if m == forbidden or m.startswith(forbidden + "."))
             for f in files}
    assert not any(leaks.values()), {f: m for f, m in leaks.items() if m}


@pytest.mark.parametrize("forbidden", ["verl", "oar_verl.integration", "oar_verl.openrlhf", "oar_verl.quickstart",
                                       "openrlhf", "devtools"])
def test_trl_glue_imports_only_trl_and_the_core(forbidden):
    """Read from the sources: the TRL adapter imports TRL and the core, never verl, the other adapters or the CPU
    tooling (a TRL user installs neither verl nor OpenRLHF)."""
    files = sorted((ROOT / "oar_verl" / "trl").rglob("*.py"))
    assert files
    leaks = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f)
                                              if m == forbidden or m.startswith(forbidden + "."))
             for f in files}
    assert not any(leaks.values()), {f: m for f, m in leaks.items() if m}


@pytest.mark.parametrize("forbidden", ["research", "benchmarks", "devtools", "tests"])
def test_the_product_imports_no_research(forbidden):
    """The product (``oar_verl``, the wheel) never imports the research package: research imports the product."""
    files = sorted((ROOT / "oar_verl").rglob("*.py"))
    leaks = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f)
                                              if m == forbidden or m.startswith(forbidden + "."))
             for f in files}
    assert not any(leaks.values()), {f: m for f, m in leaks.items() if m}


# the package's layers, bottom up: a module imports only from its own layer or below
LAYERS = {"oar_verl.core": 0, "oar_verl.integration": 1, "oar_verl.openrlhf": 1, "oar_verl.trl": 1,
          "oar_verl.rewards": 1, "oar_verl.data": 1, "oar_verl.viz": 1, "oar_verl.main": 1, "oar_verl.tools": 1,
          "oar_verl.quickstart": 2}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
    return ".".join(parts)


def _layer(module: str) -> int | None:
    return next((layer for prefix, layer in LAYERS.items() if module == prefix or module.startswith(prefix + ".")),
                None)


def _import_graph() -> dict[str, set[str]]:
    """Every oar_verl module -> the oar_verl modules it imports by name, at any depth of its code (lazy imports
    count: an import inside a function is still a dependency); ``from pkg import name`` is an edge to the submodule
    ``pkg.name`` where there is one, else to ``pkg``. A package's implicit import of its parents is not an edge."""
    files = {_module_name(f): f for f in (ROOT / "oar_verl").rglob("*.py")}
    graph = {}
    for name, f in files.items():
        edges = set()
        for m in _imported_modules(f):
            if not m.startswith("oar_verl"):
                continue
            if m in files:
                edges.add(m)
            elif m.rsplit(".", 1)[0] in files and m.rsplit(".", 1)[0] != name:
                edges.add(m.rsplit(".", 1)[0])
        # `from pkg import sub` yields both pkg and pkg.sub: keep the submodule only
        graph[name] = {e for e in edges if not any(o.startswith(e + ".") for o in edges)} - {name}
    return graph


def test_no_import_reaches_up_a_layer():
    """core < integration, openrlhf, rewards, data, viz < quickstart (verl on CPU and the tiny task): the maths never imports the
    glue, the glue never imports the CPU platform or the quickstart."""
    graph = _import_graph()
    up = {(a, b) for a, edges in graph.items() for b in edges
          if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)}
    assert not up, sorted(up)


def test_the_import_graph_has_no_cycle():
    graph = _import_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:  # depth-first, on a graph of ~100 modules
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
