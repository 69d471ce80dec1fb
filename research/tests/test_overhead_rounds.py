"""research.overhead's alternating rounds and the cost renderers' statistics over them (issue #68 item 3): the order
rotates, every run is kept, ratios are per round, the rerun round is checked against the rounds' min–max."""

import pytest

from research import tables
from research.overhead import round_order, summary_rows

NAMES = ["GRPO", "conservative-shared", "conservative-separate", "OAR-G", "OAR-P"]


def test_round_order_rotates_first_and_predecessor():
    orders = [round_order(NAMES, r) for r in range(4)]
    for o in orders:
        assert sorted(o) == sorted(NAMES)
    assert len({o[0] for o in orders}) == 4  # no configuration always first
    for name in NAMES:  # nor always after the same one
        before = {o[o.index(name) - 1] if o.index(name) else None for o in orders}
        assert len(before) > 1, name


def _run(method, r, step, logp, update=0.5, oar=0.0, adv=0.1):
    return {"method": method, "round": r, "step_s": step, "log_prob_s": logp, "update_s": update,
            "train_s": logp + update - oar, "oar_s": oar, "oar_share_of_training": oar / (logp + update - oar),
            "adv_s": adv, "attributed_frac": 1.0, "load_average_before_after": [1.0, 2.0]}


def test_per_round_ratios_and_rerun_check(monkeypatch):
    runs = [_run("GRPO", 0, 2.0, 0.3), _run("OAR-G", 0, 2.2, 0.5, oar=0.1),
            _run("OAR-G", 1, 3.3, 0.4, oar=0.1), _run("GRPO", 1, 3.0, 0.3),
            _run("GRPO", 2, 2.0, 0.2), _run("OAR-G", 2, 2.4, 0.5, oar=0.1)]
    rows = {r["method"]: r for r in summary_rows(runs)}
    assert rows["OAR-G"]["n"] == 3 and rows["OAR-G"]["step_s_min"] == 2.2 and rows["OAR-G"]["step_s_max"] == 3.3
    got = [x for x in tables._with_grpo(runs) if x["method"] == "OAR-G"]
    assert [x["ratio"] for x in got] == pytest.approx([1.1, 1.1, 1.2])  # each round against its own GRPO
    assert [x["added"] for x in got] == pytest.approx([0.2 / 0.8, 0.1 / 0.8, 0.3 / 0.7])
    # what the trainer logs and the advantage step's extra time, over the same round's GRPO training compute (not the
    # run's own, which holds the pass's slow-down)
    assert [x["logged"] for x in got] == pytest.approx([0.1 / 0.8, 0.1 / 0.8, 0.1 / 0.7])
    assert [x["adv_added"] for x in got] == pytest.approx([0.0, 0.0, 0.0])
    assert tables._with_grpo([{**_run("GRPO", 0, 2.0, 0.3), "adv_s": 0.1},
                              {**_run("OAR-G", 0, 2.2, 0.5), "adv_s": 0.26}])[1]["adv_added"] == pytest.approx(0.2)
    old = {k: v for k, v in _run("OAR-G", 0, 2.2, 0.5).items() if k != "adv_s"}  # a run written before adv_s
    assert tables._with_grpo([_run("GRPO", 0, 2.0, 0.3), old])[1]["adv_added"] is None
    assert tables._spread([x["ratio"] for x in got]) == "1.10 [1.10–1.20]"
    assert tables._spread([1.23]) == "1.23 (one run)"
    rep = {}
    for x in tables._with_grpo([_run("GRPO", 3, 2.0, 0.3), _run("OAR-G", 3, 2.6, 0.4),  # two rerun rounds:
                                _run("OAR-G", 4, 2.2, 0.4), _run("GRPO", 4, 2.0, 0.3)]):  # each one checked
        rep.setdefault(x["method"], []).append(x)
    by = {"GRPO": [x for x in tables._with_grpo(runs) if x["method"] == "GRPO"], "OAR-G": got}
    checks = tables._reproduction(by, rep)
    assert [(k, label, ok) for k, label, _, ok in checks] == [("OAR-G", "× GRPO", False), ("OAR-G", "added", True),
                                                              ("OAR-G", "× GRPO", True), ("OAR-G", "added", True)]
    sentence = tables._reproduction_sentence(checks, by)
    assert "for 3 of 4 (outside: OAR-G × GRPO 1.30)" in sentence
    assert "inside for 2.0 of 4 on average" in sentence  # 3 runs in the rounds: each check inside with p 1/2
    assert tables._spread([-0.004, 0.01, 0.03]) == "0.01 [0.00–0.03]"  # −0.00 is 0.00
    assert tables._spread([-0.02, 0.01, 0.03]) == "0.01 [\u22120.02 to 0.03]"


def test_a_second_name_for_one_configuration_is_refused():
    with pytest.raises(ValueError, match="OAR-G-shared"):
        tables._with_grpo([_run("GRPO", 0, 2.0, 0.3), _run("OAR-G-shared", 0, 2.2, 0.4)])


def test_every_run_kept_when_rounds_or_reruns_are_added():
    from research.overhead import merged_record

    meta = {"date": "d", "command": "c1", "commit": "a"}
    first = merged_record(None, meta, [_run("GRPO", 0, 2.0, 0.3)], "new")
    more = merged_record(first, {**meta, "command": "c2"}, [_run("GRPO", 1, 2.1, 0.3)], "append")
    assert [x["round"] for x in more["runs"]] == [0, 1] and more["meta"]["appended"][0]["command"] == "c2"
    rerun = merged_record(more, {**meta, "command": "c3"}, [_run("GRPO", 2, 2.2, 0.3)], "reproduction")
    again = merged_record(rerun, {**meta, "command": "c4"}, [_run("GRPO", 3, 2.3, 0.3)], "reproduction")
    assert [x["round"] for x in again["reproduction"]["runs"]] == [2, 3]  # the earlier rerun kept
    assert again["reproduction"]["meta"]["command"] == "c3"
    assert [a["command"] for a in again["reproduction"]["meta"]["appended"]] == ["c4"]
    assert again["runs"] == more["runs"]
    with pytest.raises(ValueError, match="allowed: new, append, reproduction"):
        merged_record(first, meta, [], "replace")
