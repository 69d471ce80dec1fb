"""The start-up warning for gradient attribution on sliding-window models (oar_verl.core.checks.sliding_window), read from
real transformers configs (the start-ups that call it: tests/integration/test_startup_on_cpu.py)."""

from __future__ import annotations

import logging
from transformers import Gemma3Config, Gemma3TextConfig, MistralConfig, Qwen2Config

from oar_verl.core.config import OARConfig
from oar_verl.core.checks.sliding_window import check_model_sliding_window, sliding_window, sliding_window_warning

GEMMA = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, vocab_size=300, sliding_window=512)


def test_the_window_is_read_only_where_a_layer_slides():
    assert sliding_window(Gemma3TextConfig(**GEMMA).to_dict()) == 512  # five sliding layers per full one
    assert sliding_window(Gemma3Config(text_config=GEMMA).to_dict()) == 512  # multimodal: its text_config
    full = Gemma3TextConfig(**{**GEMMA, "layer_types": ["full_attention"] * 6}).to_dict()
    assert sliding_window(full) is None
    # Qwen2 configs on the Hub carry a width they switch off
    assert sliding_window({**Qwen2Config().to_dict(), "sliding_window": 131072, "use_sliding_window": False}) is None
    assert sliding_window(MistralConfig(sliding_window=4096).to_dict()) == 4096
    assert sliding_window(MistralConfig(sliding_window=None).to_dict()) is None


def test_gradient_methods_past_the_window_are_warned_of():
    gemma = Gemma3TextConfig(**GEMMA).to_dict()
    for mode in ("gradient", "fisher"):
        msg = sliding_window_warning(OARConfig(mode=mode), gemma, 1024)
        assert f"algorithm.oar.mode={mode}" in msg and "window 512" in msg and "up to 1024 tokens" in msg
        assert "algorithm.oar.fidelity_every" in msg and "algorithm.oar.mode=perturbation" in msg
    grad = OARConfig(mode="gradient")
    assert "unknown length" in sliding_window_warning(grad, gemma, None)
    assert sliding_window_warning(grad, gemma, 512) is None  # rows within the window
    assert sliding_window_warning(OARConfig(mode="perturbation"), gemma, 4096) is None
    assert sliding_window_warning(grad, Qwen2Config().to_dict(), 16384) is None
    # conservative propagation (the default) ranks well above random past the window: not warned of
    assert sliding_window_warning(OARConfig(mode="conservative"), gemma, 4096) is None


def test_a_model_directory_is_read_and_the_warning_logged(tmp_path, caplog):
    Gemma3TextConfig(**GEMMA).save_pretrained(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="oar_verl.core.checks.sliding_window"):
        msg = check_model_sliding_window(OARConfig(mode="fisher"), str(tmp_path), 2048)
    assert msg is not None and msg in caplog.text
    assert check_model_sliding_window(OARConfig(), "google/gemma-3-270m", 2048) is None  # remote: not read
    assert check_model_sliding_window(OARConfig(), None, 2048) is None
    (tmp_path / "config.json").write_text("{not json")  # unreadable: a warning check never stops a start-up
    assert check_model_sliding_window(OARConfig(), str(tmp_path), 2048) is None
