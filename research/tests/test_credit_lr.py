"""The tuned-learning-rate comparison (research/credit_lr.py) on recorded runs: each method's best rate, paired
comparisons over seeds at the best rates, an exact sign-flip p."""

from __future__ import annotations

import pytest

from research import credit_lr


def _run(method: str, seed: int, vals: list[float]) -> dict:
    return {"method": method, "seed": seed, "val": {"steps": list(range(0, 5 * len(vals), 5)), "values": vals}}


def test_best_rates_and_paired_comparisons():
    runs = {3e-4: [_run("grpo", s, [0.3, 0.5 + 0.01 * s, 0.6]) for s in range(4)]
            + [_run("oar_g", s, [0.3, 0.6 + 0.01 * s, 0.7]) for s in range(4)]
            + [_run("position", s, [0.3, 0.55, 0.65]) for s in range(4)],
            6e-4: [_run("grpo", s, [0.3, 0.7, 0.8 + 0.01 * s]) for s in range(4)]
            + [_run("oar_g", s, [0.3, 0.4, 0.5]) for s in range(4)]
            + [_run("position", s, [0.3, 0.5, 0.6]) for s in range(4)]}
    got = credit_lr.summarise(runs, ["grpo", "oar_g", "position"])
    assert got["best_lr"] == {"grpo": "0.0006", "oar_g": "0.0003", "position": "0.0003"}
    c = got["comparisons"]["oar_g - grpo"]["auc"]
    # trapezoid AUC over steps 0, 5, 10: (v0 + 2 v1 + v2) / 4; OAR-G at 3e-4 vs GRPO at 6e-4, seed by seed
    want = [((0.3 + 2 * (0.6 + 0.01 * s) + 0.7) - (0.3 + 2 * 0.7 + 0.8 + 0.01 * s)) / 4 for s in range(4)]
    assert c["diff"] == pytest.approx(sum(want) / 4) and c["seeds"] == 4
    assert c["ci95"][0] <= c["diff"] <= c["ci95"][1]
    assert c["p"] == pytest.approx(2 / 16)  # every seed the same sign: the two all-same flips of 2^4
    assert set(got["comparisons"]) == {"oar_g - grpo", "position - grpo", "oar_g - position"}
    assert "| oar_g - grpo |" in credit_lr.report(got)
