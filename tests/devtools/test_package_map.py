"""docs/verl.md's package map is generated from the module docstrings: it must name every module of oar_verl as the
code has it now."""

from __future__ import annotations

from devtools import package_map


def test_the_package_map_is_current():
    assert package_map.main(["--check"]) == 0, "run `python -m devtools.package_map` and commit docs/verl.md"


def test_the_map_lists_every_module(tmp_path):
    text = package_map.render()
    for module in sorted(package_map.PACKAGE.rglob("*.py")):
        if "flash_attn_shim" in module.parts:
            continue
        label = f"{module.parent.relative_to(package_map.PACKAGE.parent)}/" if module.name == "__init__.py" \
            else module.name
        assert label in text, label
    # a stale map is caught: one module line less and --check fails
    doc = package_map.DOC.read_text()
    stale = doc.replace("  registry.py", "  registry_old.py", 1)
    assert package_map.updated(stale) != stale
