"""The docs' comparative words come from one function and agree with their intervals (issue #68 items 1, 2, 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, strategies as st

from research import REPO, tables
from research.row_stats import ratio_row_stats, sign_flip_p
from research.verdict import DROPPED_SHARE, LOO_SHARE, verdict


def test_the_words_follow_the_interval():
    assert verdict(0.12, 2.92, p=0.0026, loo=0.74) == "above (p 0.003), one row carries 74 %"
    assert verdict(-0.96, -0.83, p=0.0004) == "below (p < 0.001)"
    assert verdict(-0.59, 0.19, p=0.2) == "level"  # no p beside a level verdict
    assert verdict(-0.004, 0.081, above="faster", level="not shown") == "not shown"
    assert verdict(0.1, 0.3, n=1) == "one run"
    assert verdict(float("nan"), float("nan")) == "undefined" and verdict(None, 0.2) == "undefined"
    assert verdict(-0.2, 0.3, loo=-2.09) == "level, leaving one row out moves it 209 %"
    assert verdict(0.1, 0.3, loo=LOO_SHARE) == "above"  # the threshold itself is not named
    # a ratio whose bootstrap left out more than DROPPED_SHARE of its resamples: no direction, whatever the bounds
    assert verdict(0.22, 57.2, p=0.015, loo=-0.73, dropped=0.31) == \
        "not shown (more than 10 % of resamples undefined), leaving one row out moves it 73 %"
    assert verdict(0.22, 57.2, p=0.015, dropped=DROPPED_SHARE) == "above (p 0.015)"  # the threshold itself passes
    assert verdict(-0.5, 0.2, dropped=0.08) == "level"
    with pytest.raises(ValueError, match="lo"):
        verdict(0.3, 0.1)
    with pytest.raises(ValueError, match="n must be"):
        verdict(0.1, 0.3, n=0)


finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(finite, finite, st.none() | st.floats(0, 1), st.none() | st.floats(-50, 50), st.none() | st.integers(1, 50))
def test_the_phrase_always_agrees_with_the_intervals_sign(a, b, p, loo, n):
    lo, hi = min(a, b), max(a, b)
    word = verdict(lo, hi, p=p, loo=loo, n=n)
    if n == 1:
        assert word == "one run"
    elif lo > 0:
        assert word.startswith("above") and "below" not in word
    elif hi < 0:
        assert word.startswith("below") and "above" not in word
    else:
        assert word.startswith("level") and "above" not in word and "below" not in word and "(p" not in word
    assert ("one row" in word) == (n != 1 and loo is not None and abs(loo) > LOO_SHARE)


def test_row_statistics_of_a_ratio_of_sums():
    a, c = np.array([2.0, 1.0, 3.0, 1.5]), np.array([1.0, 1.5, 1.0, 1.0])
    s = ratio_row_stats(a, c)
    assert s.estimate == pytest.approx((a - c).sum() / c.sum()) and (s.above, s.rows) == (3, 4)
    without = [((a - c).sum() - (a - c)[i]) / (c.sum() - c[i]) for i in range(4)]
    shares = [(s.estimate - w) / s.estimate for w in without]
    assert s.loo_row == int(np.argmax(np.abs(shares))) and s.loo == pytest.approx(shares[s.loo_row])
    # the exact sign-flip p by hand: 16 patterns of ±d, |Σ| ≥ |Σ d| = 3
    d = a - c
    hits = sum(abs(sum(x * y for x, y in zip(signs, d))) >= 3.0 - 1e-12
               for signs in np.array(np.meshgrid(*[[1, -1]] * 4)).T.reshape(-1, 4))
    assert s.p == pytest.approx(hits / 16) == sign_flip_p(d)
    assert ratio_row_stats([1.0, np.nan, 2.0], [1.0, 5.0, 1.0]).rows == 2  # a NaN row is left out
    assert ratio_row_stats([1.0, 2.0], [-1.0, 0.5]).undefined  # Σ c ≤ 0
    with pytest.raises(ValueError, match="one length"):
        ratio_row_stats([1.0], [1.0, 2.0])


def test_the_kept_files_give_the_issues_row_figures():
    """SmolLM2's default over position: 13 of 16 rows, sign-flip p 0.003, row 9 carries 74 % (+0.22 without it)."""
    s = tables.fidelity_stats("fidelity_smollm2_1024", "conservative", "position", "kl")
    assert (s.above, s.rows, round(s.p, 3), s.loo_row, round(s.loo, 2), round(s.without, 2)) == \
        (13, 16, 0.003, 9, 0.74, 0.22)


def test_every_judged_figure_in_the_docs_agrees_with_its_interval():
    """Every `[lo, hi]: word` the generated blocks print: above only where lo > 0, below only where hi < 0."""
    import re

    pat = re.compile(r"\[([+−-][\d.]+), ([+−-][\d.]+)\](?:, (< 1|\d+) % of resamples undefined)?"
                     r"(?:, \d+/\d+ (?:rows|prompts))?: (above|below|level|not shown)")
    seen = 0
    for doc in tables.DOCS:
        for lo, hi, dropped, word in pat.findall(doc.read_text()):
            lo, hi = (float(x.replace("−", "-")) for x in (lo, hi))
            seen += 1
            if dropped and dropped != "< 1" and int(dropped) > 100 * DROPPED_SHARE:
                assert word == "not shown", (doc.name, lo, hi, dropped, word)
                continue
            assert (word == "above") == (lo > 0) and (word == "below") == (hi < 0), (doc.name, lo, hi, word)
    assert seen >= 10


def test_the_tables_check_runs_without_torch():
    """`python -m research.tables --check` on a machine without torch: torch made unimportable in the subprocess."""
    code = textwrap.dedent("""
        import runpy, sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is unimportable in this test")

        sys.meta_path.insert(0, NoTorch())
        sys.argv = ["research.tables", "--check"]
        runpy.run_module("research.tables", run_name="__main__")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch" not in r.stderr
