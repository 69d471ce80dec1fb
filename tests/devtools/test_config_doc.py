"""docs/config.md and the trainer YAML comments are generated from OARConfig field metadata: they must stay current."""

from __future__ import annotations

import dataclasses

import pytest

from devtools import config_doc
from oar_verl.core.config import GROUPS, PRESETS, OARConfig


def test_generated_files_are_current():
    """Regenerate and compare: a help text edited in config.py without `python -m devtools.config_doc` fails."""
    assert config_doc.stale_files() == [], "run `python -m devtools.config_doc` and commit the result"
    assert config_doc.main(["--check"]) == 0


def test_every_key_has_a_group_and_help():
    keys = {f.name for f in dataclasses.fields(OARConfig)} - {"prefix"}
    documented = config_doc.key_fields()
    assert {f.name for f in documented} == keys
    for f in documented:
        assert f.metadata["group"] in GROUPS
        assert len(f.metadata["help"].strip()) > 10, f.name
    assert {f.metadata["group"] for f in documented} == set(GROUPS)  # no empty section in docs/config.md


def test_every_key_appears_in_both_generated_files():
    md, yaml = config_doc.CONFIG_MD.read_text(), config_doc.TRAINER_YAML.read_text()
    for f in config_doc.key_fields():
        assert f"| `{f.name}` |" in md
        assert f"\n    {f.name}: {config_doc.yaml_value(f.default)}\n" in yaml


def test_check_detects_an_edited_comment_and_a_hand_edited_reference(tmp_path, monkeypatch):
    """The staleness check can fail: a changed YAML comment and a changed docs/config.md line are both reported, and
    regenerating restores them."""
    yaml_text = config_doc.TRAINER_YAML.read_text()
    md_text = config_doc.CONFIG_MD.read_text()
    edited_yaml = yaml_text.replace("# Lowest raw weight of a suppressed token", "# Lowest weight", 1)
    edited_md = md_text.replace("Lowest raw weight of a suppressed token", "Lowest weight", 1)
    assert edited_yaml != yaml_text and edited_md != md_text
    (tmp_path / "oar_trainer.yaml").write_text(edited_yaml)
    (tmp_path / "config.md").write_text(edited_md)
    monkeypatch.setattr(config_doc, "TRAINER_YAML", tmp_path / "oar_trainer.yaml")
    monkeypatch.setattr(config_doc, "CONFIG_MD", tmp_path / "config.md")
    assert config_doc.stale_files() == [tmp_path / "config.md", tmp_path / "oar_trainer.yaml"]
    assert config_doc.main(["--check"]) == 1
    assert config_doc.main([]) == 0
    assert (tmp_path / "oar_trainer.yaml").read_text() == yaml_text
    assert (tmp_path / "config.md").read_text() == md_text


def test_markers_are_required():
    with pytest.raises(ValueError, match="BEGIN generated"):
        config_doc.update_yaml("algorithm:\n  oar:\n    mode: gradient\n")


def test_preset_help_states_the_preset_values():
    """The preset's help names its values; changing PRESETS without the help would leave the reference wrong."""
    help_text = next(f for f in config_doc.key_fields() if f.name == "preset").metadata["help"]
    for name, values in PRESETS.items():
        assert f"`{name}`" in help_text
        for key, value in values.items():
            assert f"{key} = {value}" in help_text, (name, key)


def test_every_registered_name_is_documented():
    """Each key that names a registry's entry (mode, probe, mask, perturbation) documents every registered name in
    its help: registering a method, operator or policy without documenting it fails here, and with it the generated
    reference."""
    from oar_verl.core.checks.startup import registered_names

    helps = {f.name: f.metadata["help"] for f in config_doc.key_fields()}
    for key, names in registered_names().items():
        missing = [name for name in names if f"`{name}`" not in helps[key]]
        assert not missing, (key, missing)
