"""Metric curves from recorded verl file-logger JSONL (3 steps of GRPO and of OAR-G from the CPU e2e runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from oar_verl.viz import curves

FIXTURES = Path(__file__).parent / "fixtures"


def test_plot_overlays_runs(tmp_path):
    out = tmp_path / "curves.png"
    drawn = curves.plot_curves([FIXTURES / "metrics_grpo.jsonl", FIXTURES / "metrics_oar_g.jsonl"], out,
                               labels=["GRPO", "OAR-G"])
    assert drawn["reward"] == 6 and drawn["entropy"] == 6  # both runs, 3 steps each
    assert drawn["weight spread"] == 3 and drawn["effective sample size"] == 3  # OAR-only metrics
    assert drawn["suppressed / boosted tokens"] == 6 and drawn["attribution cost"] == 3
    image = Image.open(out).convert("RGB")
    assert image.size == (1500, 750)
    colours = {c for _, c in image.getcolors(maxcolors=1 << 20)}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours  # matplotlib's first two line colours


def test_cli(tmp_path):
    out = tmp_path / "c.png"
    proc = subprocess.run([sys.executable, "-m", "oar_verl.viz.curves", str(FIXTURES / "metrics_grpo.jsonl"), "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.exists() and "not logged: weight spread" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "oar_verl.viz.curves", str(tmp_path / "none.jsonl"), "--out",
                          str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "no metrics" in bad.stderr


def test_validation_scores_are_drawn_on_the_reward_panel(tmp_path):
    metrics = tmp_path / "run.jsonl"
    rows = [{"step": 0, "data": {"val-core/openai/gsm8k/acc/mean@1": 0.30}},
            {"step": 1, "data": {"critic/score/mean": 0.2}},
            {"step": 2, "data": {"critic/score/mean": 0.4, "val-core/openai/gsm8k/acc/mean@1": 0.45,
                                 "val-core/HuggingFaceH4/MATH-500/acc/mean@1": 0.2}}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = curves.plot_curves([metrics], tmp_path / "c.png")
    assert drawn["reward"] == 2 + 2 + 1 and drawn["weight spread"] == 0


def test_the_cost_panel_reads_oar_s_total_cost():
    """The attribution-cost panel is OAR's cost wherever it ran (``timing_s/oar_total``: verl's old-log-prob call
    included), ``timing_s/oar`` only in logs written before that key."""
    from oar_verl.viz.curves import _oar_share

    rows = [{"step": 1, "timing_s/oar": 0.06, "timing_s/oar_total": 0.46, "timing_s/step": 3.2},
            {"step": 2, "timing_s/oar": 0.08, "timing_s/step": 2.0}]
    steps, shares = _oar_share(rows)
    assert steps == [1, 2] and shares[0] == pytest.approx(14.375) and shares[1] == pytest.approx(4.0)
