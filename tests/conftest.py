"""Fixtures shared by the verl and integration tests: offline tiny assets, built once per test session."""

from __future__ import annotations

import pytest

from oar_verl.cpu.tiny_assets import TinyAssets, build_tiny_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    """A tiny random Qwen2 + byte-level BPE tokenizer and the arithmetic parquet data (seed 0, ~5 s)."""
    return build_tiny_assets(tmp_path_factory.mktemp("tiny_assets"), seed=0)
