"""The wheel holds the product alone: it is built here, its files listed, and every module in it must be reachable from
what a user runs — the ``verl.plugins`` entry point, a ``python -m oar_verl...`` command of the README, the recipes or
the docs, a ``pkg://`` path in a recipe or config, or the core's public API — through imports or dotted names in shipped
files. A module only tests, research or docs generation use fails, as does any file of ``devtools/``, ``tests/`` or
``research/`` in the wheel."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from devtools.imports import imported_modules as _imported_modules

ROOT = Path(__file__).resolve().parents[1]
DOTTED = re.compile(r"\boar_verl(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
COMMAND = re.compile(r"python3? -m (oar_verl(?:\.[A-Za-z_][A-Za-z_0-9]*)*)")
IMPORT = re.compile(r"^from (oar_verl(?:\.[A-Za-z_][A-Za-z_0-9]*)*) import", re.M)  # what the user docs' code imports


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools keeps a build/ folder in the source tree, whose stale files would ship
    src = tmp_path_factory.mktemp("src") / "oar-verl"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "outputs", "*.egg-info",
                                                             "__pycache__", ".hypothesis", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (wheel,) = out.glob("oar_verl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _module(name: str) -> str:
    parts = name[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _user_roots() -> set[str]:
    """What a user runs: the plugin entry point, the commands in the README, recipes and user docs, the modules their
    code examples import, the ``pkg://`` paths of recipes and shipped configs, and the core's public API."""
    roots = {"oar_verl", "oar_verl.core"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    roots |= set(re.findall(r'^\w+ = "(oar_verl[\w.]*)"', pyproject, flags=re.M))
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").rglob("*.sh"),
             *(ROOT / "recipes").rglob("*.md"), *(ROOT / "oar_verl").rglob("*.yaml")]
    for page in pages:
        text = page.read_text()
        roots |= set(COMMAND.findall(text))
        roots |= set(IMPORT.findall(text)) if page.suffix == ".md" else set()
        roots |= {m.split("pkg://", 1)[1] for m in re.findall(r"pkg://oar_verl[\w.]*", text)}
    return roots


def test_the_wheel_ships_no_development_tooling(wheel_files):
    stray = [f for f in wheel_files if f.split("/")[0] in {"devtools", "tests", "research", "scripts", "benchmarks"}]
    assert not stray, stray
    assert any(f == "oar_verl/integration/config/oar_trainer.yaml" for f in wheel_files)
    assert any(f.startswith("oar_verl/quickstart/") for f in wheel_files), "the CPU quickstart ships"


def unreachable(modules: dict[str, Path], roots: set[str]) -> list[str]:
    """The modules (name -> source) that no root reaches through imports or dotted names in the reached sources."""

    def edges(name: str) -> set[str]:
        path = modules[name]
        found = {m for m in _imported_modules(path) if m.startswith("oar_verl")}
        found |= set(DOTTED.findall(path.read_text()))  # names loaded by string (registries, Hydra targets, Ray)
        out = set()
        for m in found:
            while m and m not in modules:
                m = m.rpartition(".")[0]
            if m:
                out.add(m)
        # a package's __init__ runs whenever a module under it is imported, and `python -m pkg` runs pkg.__main__
        out |= {p for p in modules if name.startswith(p + ".")}
        if name + ".__main__" in modules:
            out.add(name + ".__main__")
        return out

    seen, todo = set(), [r for r in roots if r in modules]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges(name) - seen)
    return sorted(set(modules) - seen)


def _shipped_modules(wheel_files: list[str]) -> dict[str, Path]:
    return {_module(f): ROOT / f for f in wheel_files if f.startswith("oar_verl/") and f.endswith(".py")}


def test_every_shipped_module_is_reachable_from_what_a_user_runs(wheel_files):
    roots = _user_roots()
    assert {"oar_verl.integration.plugin", "oar_verl.quickstart", "oar_verl.main"} <= roots, sorted(roots)
    unused = unreachable(_shipped_modules(wheel_files), roots)
    assert not unused, f"modules in the wheel no user path reaches (move them to devtools/ or research/): {unused}"


def test_a_module_only_tests_use_is_reported(wheel_files, tmp_path):
    """The check is not vacuous: a shipped module that only a test imports (here the Ulysses stand-in, were it put
    back under oar_verl) is reported."""
    modules = _shipped_modules(wheel_files)
    orphan = tmp_path / "ulysses_attention.py"
    orphan.write_text((ROOT / "devtools" / "ulysses_attention.py").read_text())
    modules["oar_verl.quickstart.ulysses_attention"] = orphan
    assert unreachable(modules, _user_roots()) == ["oar_verl.quickstart.ulysses_attention"]
