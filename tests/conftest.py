"""Fixtures shared by the verl and integration tests: offline tiny assets, built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oar_verl.quickstart.tiny_assets import TinyAssets, build_tiny_assets

# the tests' shorthands over the public API (tests/core/oar_helpers.py) import as a plain module, from any folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "core"))


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    """A tiny random Qwen2 + byte-level BPE tokenizer and the arithmetic parquet data (seed 0, ~5 s)."""
    return build_tiny_assets(tmp_path_factory.mktemp("tiny_assets"), seed=0)
