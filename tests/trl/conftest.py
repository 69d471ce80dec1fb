"""Fixtures of the TRL adapter's tests (run in .venv-trl; tests/trl/test_trl_env.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def policy(tiny_assets):
    """(model, tokenizer): the quickstart's tiny offline Qwen2, fp32, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.model_dir), dtype=torch.float32).eval()
    return model, tok
