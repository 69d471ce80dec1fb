"""The method registry is the one source of facts about ``algorithm.oar.mode``: every registered mode declares its
traits, the layers read them (never a mode's name), and a method registered in a test gets the start-up behaviour its
traits call for without any other change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import Gemma3TextConfig

from oar_verl.core.checks.registries import METHODS
from oar_verl.core.checks.sliding_window import sliding_window_warning
from oar_verl.core.checks.startup import check_config, startup_checks
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.methods.contract import Method

ROOT = Path(__file__).resolve().parents[2]
GEMMA = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, vocab_size=300, sliding_window=512)


def test_every_registered_mode_declares_its_traits():
    traits = ("forward_only", "reads_gradients", "uses_mask_token", "linearises_mask")
    declared = {name: tuple(getattr(METHODS.get(name), t) for t in traits) for name in METHODS.names()}
    assert declared == {
        "gradient": (False, True, False, False),
        "perturbation": (True, False, True, False),
        "fisher": (False, True, True, True),
        "path": (False, True, True, True),
        "conservative": (False, True, False, False),
    }
    for name in METHODS.names():
        entry = METHODS.get(name)
        assert all(isinstance(getattr(entry, t), bool) for t in traits), name
        assert isinstance(entry.segments(OARConfig(mode=name)), bool), name
    with pytest.raises(TypeError):  # a method cannot leave its traits to defaults
        Method(lambda *a: None)


@pytest.fixture
def saliency():
    """A gradient method registered for one test only (``reads_gradients=True``, no mask), removed afterwards."""
    METHODS.register("test_saliency")(Method(lambda *a: None, forward_only=False, reads_gradients=True,
                                             uses_mask_token=False))
    try:
        yield "test_saliency"
    finally:
        METHODS.unregister("test_saliency")


def test_a_new_gradient_method_is_warned_of_past_a_sliding_window(saliency, tmp_path):
    """Registered with reads_gradients=True: the config accepts it and the sliding-window warning names it, though
    no check names it; the same method registered as a masking one would not be warned of."""
    gemma = Gemma3TextConfig(**GEMMA)
    cfg = check_config(OARConfig(mode=saliency))
    msg = sliding_window_warning(cfg, gemma.to_dict(), 1024)
    assert msg is not None and f"algorithm.oar.mode={saliency} on a model with sliding-window attention" in msg
    gemma.save_pretrained(str(tmp_path))
    assert startup_checks(cfg, model_path=str(tmp_path), max_tokens=1024) == [msg]  # the one start-up path
    assert startup_checks(cfg, model_path=str(tmp_path), max_tokens=256) == []  # rows within the window


def test_a_new_method_that_does_not_read_gradients_is_not_warned_of():
    METHODS.register("test_masking")(Method(lambda *a: None, forward_only=True, reads_gradients=False,
                                            uses_mask_token=True))
    try:
        cfg = check_config(OARConfig(mode="test_masking"))
        assert sliding_window_warning(cfg, Gemma3TextConfig(**GEMMA).to_dict(), 1024) is None
    finally:
        METHODS.unregister("test_masking")
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mode='test_masking' is not allowed; choose one of: "
                                             r"conservative, fisher, gradient, path, perturbation"):
        check_config(OARConfig(mode="test_masking"))


def test_a_method_that_linearises_the_mask_refuses_the_operators_without_one_embedding():
    """The fisher + resample refusal comes from the facts (linearises_mask, one_embedding), not the names."""
    METHODS.register("test_linear")(Method(lambda *a: None, forward_only=False, reads_gradients=True,
                                           uses_mask_token=True, linearises_mask=True))
    try:
        with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=resample is not allowed with algorithm\.oar\."
                                                 r"mode=test_linear .*mask=mean\|zero\|pad\|token"):
            check_config(OARConfig(mode="test_linear", mask="resample"))
        check_config(OARConfig(mode="test_linear", mask="zero"))
    finally:
        METHODS.unregister("test_linear")


# `mode == "x"`, `mode in (...)`, `GRADIENT_MODES`, `MODES`: the string tests the registry replaced
STRING_TESTS = re.compile(r"""mode (==|!=|in|not in) ['"(]|GRADIENT_MODES|\bMODES\b""")
# verl's *trainer* modes (sync / colocate_async / separate_async), not attribution modes
TRAINER_MODES = ROOT / "oar_verl" / "integration" / "trainer_v1.py"


def test_no_layer_tests_a_mode_by_name():
    """The acceptance grep: no module of the core or either integration compares ``mode`` with a name."""
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
             for package in ("core", "openrlhf", "integration")
             for f in sorted((ROOT / "oar_verl" / package).rglob("*.py")) if f != TRAINER_MODES
             for i, line in enumerate(f.read_text().splitlines(), 1) if STRING_TESTS.search(line)]
    assert not found, found
    assert STRING_TESTS.search('if cfg.mode == "fisher":')  # the pattern can fail
