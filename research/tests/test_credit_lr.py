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


def test_each_seed_at_the_rate_chosen_without_it():
    # GRPO is best at 6e-4 on seeds 0 and 2 (fold 0) but best at 3e-4 on seeds 1 and 3 (fold 1): each fold is then
    # evaluated at the rate the *other* fold prefers, which a same-seed choice would hide
    def grpo(lr, s):
        good = (lr == 6e-4) == (s % 2 == 0)
        return _run("grpo", s, [0.3, 0.7 if good else 0.4, 0.8 if good else 0.5])
    runs = {lr: [grpo(lr, s) for s in range(4)] + [_run("oar_g", s, [0.3, 0.5, 0.6]) for s in range(4)]
            for lr in (3e-4, 6e-4)}
    held = credit_lr.cross_fitted(runs, ["grpo", "oar_g"])
    assert held["chosen_lr"]["grpo"] == ["0.0003", "0.0006"]  # fold 0 (seeds 0, 2) chosen on seeds 1, 3 and back
    auc = lambda v: (v[0] + 2 * v[1] + v[2]) / 4  # noqa: E731
    assert held["values"]["grpo"]["auc"] == {s: pytest.approx(auc([0.3, 0.4, 0.5])) for s in range(4)}
    got = credit_lr.summarise(runs, ["grpo", "oar_g"])
    assert got["held_out"]["chosen_lr"] == held["chosen_lr"]
    c = got["held_out"]["comparisons"]["oar_g - grpo"]["auc"]
    assert c["diff"] == pytest.approx(auc([0.3, 0.5, 0.6]) - auc([0.3, 0.4, 0.5])) and c["seeds"] == 4
    assert "Each seed at the rate chosen on the other fold's seeds" in credit_lr.report(got)


def test_a_bracket_rate_run_on_fewer_seeds_is_compared_on_those_seeds():
    # 6e-4 on seeds 0-5, the bracket 3e-4 on seeds 0-1 only: 3e-4 beats 6e-4 on seeds 0-1 (0.8 vs 0.6-0.61) though
    # its mean (0.8) is below 6e-4's mean over all six seeds (0.6 ... 0.95, mean 0.81): chosen on the shared seeds
    auc = {6e-4: {0: 0.6, 1: 0.61, 2: 0.9, 3: 0.95, 4: 0.95, 5: 0.85}, 3e-4: {0: 0.8, 1: 0.8}}
    assert credit_lr.best_rate(auc) == 3e-4
    assert credit_lr.best_rate({6e-4: auc[6e-4], 3e-4: {0: 0.5, 1: 0.5}}) == 6e-4
    assert credit_lr.best_rate({6e-4: {0: 0.5}, 3e-4: {1: 0.7}}) == 3e-4  # no shared seed: each rate's own mean
    # a third rate still running (one seed, a collapse) does not shrink the comparison of the other two to that seed
    runs = {6e-4: {s: 0.7 for s in range(10)}, 1.2e-3: {**{s: 0.6 for s in range(10)}, 0: 0.9}, 2.4e-3: {0: 0.02}}
    assert credit_lr.best_rate(runs) == 6e-4
