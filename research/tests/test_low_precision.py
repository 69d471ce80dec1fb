"""The bf16 comparison of the long-row study (research/long_fidelity.py): a LOW_PRECISION method runs its fp32 base's
configuration on the model rounded to bf16, and ``agreement`` measures its scores against the base's by hand-checkable
statistics (rank correlation, top-20 % overlap, relative L2 error) over every row."""

from __future__ import annotations

import math

import numpy as np
import pytest

from research import long_fidelity as lf


def _chunks(low_rows, base_rows, low="oar_g_bf16", base="oar_g"):
    return [{"scores": {low: [r], base: [b]}} for r, b in zip(low_rows, base_rows)]


def test_every_low_precision_method_has_an_fp32_base_that_is_a_method():
    assert lf.LOW_PRECISION and all(base in lf.METHODS for base in lf.LOW_PRECISION.values())
    assert not set(lf.LOW_PRECISION) & (set(lf.METHODS) | set(lf.DERIVED))


def test_identical_scores_agree_exactly():
    base = [list(np.linspace(0.1, 1.0, 10)), [3.0, 1.0, 2.0, 5.0, 4.0]]
    a = lf.agreement(_chunks(base, base), "oar_g_bf16", "oar_g")
    assert a["base"] == "oar_g"
    assert a["spearman"]["mean"] == pytest.approx(1.0) and a["top20_overlap"]["mean"] == pytest.approx(1.0)
    assert a["rel_l2_error"]["mean"] == pytest.approx(0.0)


def test_known_values_by_hand():
    base = [[1.0, 2.0, 3.0, 4.0, 5.0]]
    low = [[5.0, 4.0, 3.0, 2.0, 1.0]]  # the order reversed: rho −1, the top token (1 of 5) missed
    a = lf.agreement(_chunks(low, base), "oar_g_bf16", "oar_g")
    assert a["spearman"]["mean"] == pytest.approx(-1.0) and a["top20_overlap"]["mean"] == pytest.approx(0.0)
    assert a["rel_l2_error"]["mean"] == pytest.approx(math.sqrt(40) / math.sqrt(55))
    # a constant bf16 row (every score rounded alike) has no rank correlation: counted, not averaged
    a = lf.agreement(_chunks([[2.0] * 5, [1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0]]),
                     "oar_g_bf16", "oar_g")
    assert a["spearman"]["undefined"] == 1 and a["spearman"]["mean"] == pytest.approx(1.0)
