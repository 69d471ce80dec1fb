"""The learning protocol's analysis (evidence §9–10) on records whose answer is known: the plan covers every method,
task and fresh seed at its fixed rate; the primary test passes only for a positive, significant difference; Holm
adjusts the secondary tests together; the gate arm pairs on (task, seed) and applies the fixed margin."""

from __future__ import annotations

import numpy as np

from research import learning_protocol as lp


def _records(shift: dict[str, float], seed0: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed0)
    out = []
    for task in lp.TASKS:
        base = rng.uniform(0.5, 0.7, len(lp.SEEDS))
        for m in lp.METHODS:
            for s, b in zip(lp.SEEDS, base):
                auc = float(b + shift.get(m, 0.0) + rng.normal(0, 0.005))
                out.append({"task": task, "method": m, "seed": s, "lr": lp.RATES[task][m], "auc": auc, "final": auc,
                            "w_decisive": 1.0})
    return out


def test_the_plan_is_every_method_task_and_fresh_seed_at_its_fixed_rate():
    planned = {(t, s, m) for t, s, _, ms in lp.units() for m in ms}
    assert planned == {(t, s, m) for t in lp.TASKS for s in lp.SEEDS for m in lp.METHODS}
    assert min(lp.SEEDS) >= 10 and len(lp.SEEDS) >= 10  # fresh: the tuning seeds were 0–9
    assert all(lr == lp.RATES[t][m] for t, _, lr, ms in lp.units() for m in ms)


def test_primary_passes_only_for_a_positive_significant_difference_and_holm_covers_the_secondary():
    a = lp.analyse(_records({"conservative": 0.05}))
    assert all(p["passes"] and p["p"] < 0.01 and p["seeds"] == len(lp.SEEDS) for p in a["primary"])
    a = lp.analyse(_records({"conservative": -0.05}))
    assert not any(p["passes"] for p in a["primary"])  # significant, but the wrong way
    sec = a["secondary"]
    assert len(sec) == len(lp.TASKS) * len(lp.SECONDARY)
    ps = [s["p"] for s in sec]
    assert [s["p_holm"] for s in sec] == lp.holm(ps) and all(s["p_holm"] >= s["p"] for s in sec)


def test_the_gate_arm_pairs_on_task_and_seed_and_applies_the_margin(monkeypatch):
    monkeypatch.setattr(lp, "GATE_CANDIDATE", "magnitude")
    records = _records({})
    gate = [{**r, "signed_scores": "magnitude"} for r in records if r["method"] == "conservative"]
    same = lp.analyse_gate(records, gate)
    assert same["pooled"]["seeds"] == len(lp.TASKS) * len(lp.SEEDS) and abs(same["pooled"]["diff"]) < 1e-12
    assert same["non_inferior"]
    worse = lp.analyse_gate(records, [{**g, "auc": g["auc"] - 0.05} for g in gate])
    assert not worse["non_inferior"]
    assert not lp.analyse_gate(records, gate[:-1])["non_inferior"]  # a missing pair: no verdict


def test_section_11_runs_its_primary_pair_first_on_seeds_no_study_used_with_the_shipped_gate():
    p = lp.SECTION11
    plan = lp.units(p)
    assert {(t, s, m) for t, s, _, ms in plan for m in ms} == {(t, s, m) for t in p.tasks for s in p.seeds
                                                                for m in p.methods}
    first_other = next(i for i, (_, _, _, ms) in enumerate(plan) if not set(ms) <= set(p.primary))
    assert all(set(ms) <= set(p.primary) for _, _, _, ms in plan[:first_other])  # phase 1: the primary pair only
    assert all(not set(ms) & set(p.primary) for _, _, _, ms in plan[first_other:])
    assert not set(p.seeds) & set(range(20)) and len(p.seeds) >= 10  # §6–10 used seeds 0–19
    assert p.signed_scores == "magnitude" and p.results != lp.SECTION9.results
    a = lp.analyse([r for r in _records({"conservative": 0.05}) if r["method"] in p.methods], p)
    assert all(x["passes"] for x in a["primary"]) and len(a["secondary"]) == len(p.tasks) * len(p.secondary)
    assert a["planned_runs"] == len(p.tasks) * len(p.seeds) * len(p.methods)
