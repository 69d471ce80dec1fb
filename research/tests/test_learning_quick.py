"""The learning study's quick mode, trimmed for CI: OAR-G through verl's real trainer (1 seed, 2 steps) from the
tiny model warm-started for 250 steps (the faithfulness quick test's model, so the session trains it once), with
verl validation at steps 0 and 2. Checks that it runs and logs what the study reads;
the numbers themselves are reported, not asserted. GRPO through verl's trainer is run by tests/e2e
(test_main_ppo_grpo_on_cpu.py), so the comparison with GRPO is checked here on recorded runs of both; OAR-P through
``python -m oar_verl.main`` is covered by tests/e2e, and learning-speed evidence comes from the credit-assignment
study (test_credit_quick.py)."""

from __future__ import annotations

import json
import math

import pytest

from research import learning


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_learning_quick(tmp_path):
    from research import faithfulness

    rc = learning.main(["--quick", "--steps", "2", "--warm-steps", str(faithfulness.QUICK_WARM_STEPS), "--methods",
                        "oar_g", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "learning.json").read_text())
    assert rc == 0, [(r["method"], r["returncode"], r["log"]) for r in res["runs"]]
    s = res["settings"]
    warm = res["assets"]["sampled_accuracy_t1"]
    assert 0.02 < warm < 0.98, f"warm start should give mixed rewards, got success rate {warm}"
    assert [r["method"] for r in res["runs"]] == ["oar_g"]
    for r in res["runs"]:
        assert r["val"]["steps"] == list(range(0, s["steps"] + 1, s["test_freq"])), r["val"]
        assert all(0.0 <= v <= 1.0 for v in r["val"]["values"])
        assert r["train"]["steps"] == list(range(1, s["steps"] + 1))
        assert all(math.isfinite(e) and e > 0 for e in r["train"]["entropy"])
        assert any(math.isfinite(t) and t > 0 for t in r["train"]["oar_s"]), "OAR attribution never ran"
    assert set(res["summary"]["methods"]) == {"oar_g"} and res["summary"]["vs_grpo"] == {}
    assert (tmp_path / "learning.png").stat().st_size > 10_000


def _run(method: str, seed: int, vals: list[float]) -> dict:
    n = len(vals) - 1
    return {"method": method, "seed": seed, "returncode": 0, "wall_s": 10.0,
            "val": {"steps": list(range(0, 2 * n + 1, 2)), "values": vals},
            "train": {"steps": list(range(1, 2 * n + 1)), "entropy": [1.0] * (2 * n), "reward": [0.5] * (2 * n),
                      "step_s": [2.0] * (2 * n), "oar_s": [0.1 if method != "grpo" else math.nan] * (2 * n)}}


def test_summary_compares_with_grpo():
    """The study's table and its comparison with GRPO (difference, standard error, permutation p) on recorded runs."""
    runs = [_run("grpo", 0, [0.4, 0.5, 0.55]), _run("grpo", 1, [0.4, 0.45, 0.5]),
            _run("oar_g", 0, [0.4, 0.6, 0.7]), _run("oar_g", 1, [0.4, 0.55, 0.65]),
            {**_run("oar_p", 0, [0.4, 0.5, 0.5]), "returncode": 1}]  # a failed run is left out
    summary = learning.summarize(runs, learning.QUICK)
    assert set(summary["methods"]) == {"grpo", "oar_g"} and set(summary["vs_grpo"]) == {"oar_g"}
    g, o = summary["methods"]["grpo"], summary["methods"]["oar_g"]
    assert g["n_seeds"] == o["n_seeds"] == 2 and g["start"] == o["start"] == pytest.approx(0.4)
    assert o["auc"] == pytest.approx([0.65, 0.6]) and g["final"] == pytest.approx([0.55, 0.5])
    c = summary["vs_grpo"]["oar_g"]
    assert c["final"]["diff"] == pytest.approx(0.675 - 0.525)
    assert c["final"]["se"] == pytest.approx(math.sqrt(0.00125))  # each arm: sample variance 0.00125 over 2 seeds, so √(2 · 0.00125/2)
    assert 0.0 < c["final"]["p_perm"] <= 1.0
    text = learning.report(summary, learning.QUICK, {"sampled_accuracy_t1": 0.4})
    assert "| vs GRPO |" in text and "+0.150" in text
