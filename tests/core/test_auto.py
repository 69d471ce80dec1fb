"""``mode=auto`` in the core (oar_verl.core.auto): the evidence from one scorer call equals the per-candidate deletion
metric, and the rule and the selector on planted evidence: a clear winner, a tie, nothing beating the controls, every
candidate random, a switch that needs two agreeing checks, static rows counted, a candidate's gain independent of the
others, a resumed selector, two ranks' rows gathered."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import settings as settings_h
from hypothesis import strategies as st

from oar_verl.core.auto import AutoSelector, AutoSettings, Evidence, bands_of, candidate_metrics, decide, gains
from oar_verl.core.backends.base import Replacement
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.checks.startup import check_config, concrete_configs, require_resolved, startup_checks
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.fidelity import deletion_metrics

CANDS = ("fisher", "gradient")
COSTS = {"fisher": 1.0, "gradient": 1.0}


def planted(lifts: dict[str, float], *, rows: int = 40, per_prompt: int = 4, seed: int = 0, band: str = "all",
            static: int = 0, noise: float = 0.05, first_prompt: int = 0) -> Evidence:
    """Rows whose random / position AOPC are ~U(0.5, 1.5) and each candidate's is the random one times (1 + lift) plus
    noise; the first ``static`` rows move nothing under any ranking."""
    g = torch.Generator().manual_seed(seed)
    base = 0.5 + torch.rand(rows, generator=g, dtype=torch.float64)
    aopc = {"random": base, "position": base * (1 + 0.02 * torch.randn(rows, generator=g, dtype=torch.float64))}
    for c, lift in lifts.items():
        aopc[c] = base * (1 + lift) + noise * torch.randn(rows, generator=g, dtype=torch.float64)
    moves = torch.zeros(rows, dtype=torch.float64)
    moves[:static] = 1.0
    for k in aopc:
        aopc[k] = torch.where(moves == 1, 0.0, aopc[k])
    return Evidence(aopc, moves, first_prompt + torch.arange(rows) // per_prompt, tuple(band for _ in range(rows)))


# -- the rule ---------------------------------------------------------------------------------------------------------
def test_a_clear_winner_is_chosen():
    d = decide(planted({"fisher": 0.8, "gradient": 0.0}), COSTS, max_cost=2.0)
    assert d.choice == "fisher" and d.gains["fisher"]["random"].lo > 0 and d.gains["fisher"]["position"].lo > 0
    assert d.gains["gradient"]["random"].lo < 0 < d.gains["gradient"]["random"].hi
    assert (d.rows, d.prompts, d.static) == (40, 10, 0) and "fisher: cheapest" in d.reason


def test_a_tie_goes_to_the_cheapest_and_the_cap_binds():
    ev = planted({"fisher": 0.5, "gradient": 0.5})
    assert decide(ev, {"fisher": 1.2, "gradient": 0.9}, max_cost=2.0).choice == "gradient"
    assert decide(ev, {"fisher": 0.9, "gradient": 1.2}, max_cost=2.0).choice == "fisher"
    # equal costs: the higher lower bound
    ev = planted({"fisher": 0.3, "gradient": 0.9})
    assert decide(ev, COSTS, max_cost=2.0).choice == "gradient"
    d = decide(ev, {"fisher": 3.0, "gradient": 3.0}, max_cost=2.0)  # both beat the controls, neither affordable
    assert d.choice is None and "NO AFFORDABLE CANDIDATE" in d.reason and d.best == "gradient"


def test_nothing_beats_the_controls_and_every_candidate_random_is_reported():
    d = decide(planted({"fisher": 0.0, "gradient": -0.3}), COSTS, max_cost=2.0)
    assert d.choice is None and "NO CANDIDATE BEATS THE CONTROLS" in d.reason
    assert "every candidate ranks like random" in d.reason and set(d.random_like) == set(CANDS)
    # beating random but not position is not enough
    ev = planted({"fisher": 0.5, "gradient": 0.5})
    ev = Evidence({**ev.aopc, "position": ev.aopc["random"] * 2}, ev.static, ev.groups, ev.bands)
    d = decide(ev, COSTS, max_cost=2.0)
    assert d.choice is None and d.random_like == () and "every candidate" not in d.reason


def test_static_rows_are_counted_not_dropped():
    ev = planted({"fisher": 0.8, "gradient": 0.0}, static=12)
    d = decide(ev, COSTS, max_cost=2.0)
    assert d.static == 12 and d.rows == 40 and d.gains["fisher"]["random"].rows == 40
    # the static rows' zeros are in the sums: the ratio equals the one over the moving rows (0 adds nothing) ...
    moving = ev.select(ev.static == 0)
    assert d.gains["fisher"]["random"].mean == pytest.approx(decide(moving, COSTS, max_cost=2.0)
                                                             .gains["fisher"]["random"].mean)
    # ... but they stay in the bootstrap's clusters, so the interval is that of all rows
    assert d.gains["fisher"]["random"].undefined == 0


def test_a_candidates_gain_does_not_change_when_another_is_added():
    ev = planted({"fisher": 0.4, "gradient": 0.1, "perturbation": 0.9})
    alone = gains(ev, ["fisher"], ["random", "position"], resamples=200, seed=3)
    every = gains(ev, ["gradient", "perturbation", "fisher"], ["random", "position"], resamples=200, seed=3)
    assert alone["fisher"] == every["fisher"]
    assert decide(ev, COSTS, max_cost=2.0).gains["fisher"] == decide(
        ev, {**COSTS, "perturbation": 50.0}, max_cost=2.0).gains["fisher"]


def test_bands_from_the_sliding_window():
    assert bands_of([10, 512, 513], None) == ("all", "all", "all")
    assert bands_of(torch.tensor([10, 512, 513]), 512) == ("inside", "inside", "past")


# -- the selector -----------------------------------------------------------------------------------------------------
def settings(**kw) -> AutoSettings:
    return AutoSettings(CANDS, "fisher", **{"rows": 32, "prompts": 8, "every": 5, "resamples": 200, **kw})


def test_the_selector_calibrates_then_decides_and_rechecks_on_fresh_rows():
    sel = AutoSelector(settings())
    assert sel.calibrating(0) and sel.mode("all") == "fisher"
    lines = sel.observe(0, planted({"fisher": 0.0, "gradient": 0.8}, rows=20), COSTS)  # 20 rows: not enough
    assert lines == [] and sel.mode("all") == "fisher" and sel.metrics(0)["oar/auto/all/decided"] == 0
    lines = sel.observe(1, planted({"fisher": 0.0, "gradient": 0.8}, rows=20, seed=1, first_prompt=5), COSTS)
    assert len(lines) == 1 and "DECIDED gradient" in lines[0] and sel.mode("all") == "gradient"
    assert not sel.calibrating(2) and sel.calibrating(6)  # next check: 5 steps after the decision
    assert sel.observe(3, planted({"fisher": 0.9, "gradient": 0.0}, rows=40), COSTS) == []  # not checking: ignored
    m = sel.metrics(3)
    assert m["oar/auto/all/mode/gradient"] == 1 and m["oar/auto/all/mode_index"] == 1 and m["oar/auto/calibrating"] == 0
    assert m["oar/auto/all/rows"] == 40 and m["oar/auto/all/gain/gradient/random_lo"] > 0


def test_a_switch_needs_two_agreeing_checks_and_nothing_beating_falls_back():
    sel = AutoSelector(settings())
    sel.observe(0, planted({"fisher": 0.8, "gradient": 0.0}), COSTS)
    assert sel.mode("all") == "fisher"
    # one disagreeing check: no switch
    lines = sel.observe(5, planted({"fisher": 0.0, "gradient": 0.8}, seed=1), COSTS)
    assert sel.mode("all") == "fisher" and "switching only if the next check agrees" in lines[0]
    # the next check goes back to fisher: the pending switch is dropped
    sel.observe(10, planted({"fisher": 0.8, "gradient": 0.0}, seed=2), COSTS)
    assert sel.mode("all") == "fisher" and sel.metrics()["oar/auto/all/pending"] == 0
    # two in a row for gradient: switch
    sel.observe(15, planted({"fisher": 0.0, "gradient": 0.8}, seed=3), COSTS)
    lines = sel.observe(20, planted({"fisher": 0.0, "gradient": 0.8}, seed=4), COSTS)
    assert sel.mode("all") == "gradient" and "SWITCH fisher -> gradient" in lines[0]
    assert sel.metrics()["oar/auto/all/switches"] == 1
    # nothing beats the controls twice: the grpo fallback, said so
    sel.observe(25, planted({"fisher": 0.0, "gradient": 0.0}, seed=5), COSTS)
    lines = sel.observe(30, planted({"fisher": 0.0, "gradient": 0.0}, seed=6), COSTS)
    assert sel.mode("all") == "grpo" and "FALLBACK plain GRPO" in lines[0] and "NO CANDIDATE BEATS" in lines[0]
    m = sel.metrics()
    assert m["oar/auto/all/no_candidate"] == 1 and m["oar/auto/all/random_like"] == 2
    assert m["oar/auto/all/mode_index"] == -1 and m["oar/auto/all/mode/grpo"] == 1


def test_the_best_fallback_and_the_first_decision_applies_at_once():
    sel = AutoSelector(settings(fallback="best"))
    lines = sel.observe(0, planted({"fisher": 0.0, "gradient": -0.5}), COSTS)
    assert sel.mode("all") == "fisher" and "FALLBACK best" in lines[0]
    sel = AutoSelector(settings())
    sel.observe(0, planted({"fisher": 0.0, "gradient": 0.0}), COSTS)
    assert sel.mode("all") == "grpo"  # nothing to keep before the first decision: the fallback applies at once


def test_bands_decide_separately():
    sel = AutoSelector(settings(window=512))
    inside = planted({"fisher": 0.8, "gradient": 0.8}, band="inside")
    past = planted({"fisher": 0.0, "gradient": 0.0}, band="past", seed=1)
    lines = sel.observe(0, Evidence.concat([inside, past]), {"fisher": 1.1, "gradient": 1.0})
    assert sel.modes() == {"inside": "gradient", "past": "grpo"} and len(lines) == 2
    assert "[past]" in lines[1] and "NO CANDIDATE" in lines[1]


def test_the_plan_gives_each_bands_rows_its_mode_in_one_order():
    """AutoSelector.plan: one entry per band's mode in the selector's band order (every rank the same, with or
    without rows of a band); a fallback band attributes with the default on a calibration step only, never reshaped."""
    sel = AutoSelector(settings(window=512))
    groups, plain = sel.plan(("past", "inside", "past"), 0)  # calibrating: both bands on the default
    assert list(groups) == ["fisher"] and groups["fisher"].tolist() == [True] * 3 and not plain.any()
    sel.observe(0, Evidence.concat([planted({"fisher": 0.8, "gradient": 0.8}, band="inside"),
                                    planted({"fisher": 0.0, "gradient": 0.0}, band="past", seed=1)]),
                {"fisher": 1.1, "gradient": 1.0})
    groups, plain = sel.plan(("past", "inside", "past"), 1)  # not calibrating: the past band stays plain GRPO
    assert {m: g.tolist() for m, g in groups.items()} == {"gradient": [False, True, False]}
    assert plain.tolist() == [True, False, True]
    groups, plain = sel.plan(("inside",), 1)  # no past row here: the same entries
    assert list(groups) == ["gradient"] and plain.tolist() == [False]
    groups, plain = sel.plan(("past", "inside"), 5)  # the re-check: the plain band attributes (evidence) again
    assert {m: g.tolist() for m, g in groups.items()} == {"gradient": [False, True], "fisher": [True, False]}
    assert plain.tolist() == [True, False]


def test_a_resumed_selector_keeps_and_continues_its_decision():
    a = AutoSelector(settings())
    a.observe(0, planted({"fisher": 0.8, "gradient": 0.0}), COSTS)
    a.observe(5, planted({"fisher": 0.0, "gradient": 0.8}, seed=1), COSTS)  # a pending switch
    a.observe(10, planted({"fisher": 0.0, "gradient": 0.8}, seed=2, rows=16), COSTS)  # a half-full check window
    b = AutoSelector(settings())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.modes() == a.modes() == {"all": "fisher"} and b.metrics(11) == a.metrics(11)
    more = planted({"fisher": 0.0, "gradient": 0.8}, seed=3, rows=16, first_prompt=4)
    assert a.observe(11, more, COSTS) == b.observe(11, more, COSTS) and b.mode("all") == "gradient"
    with pytest.raises(ValueError, match="auto_candidates"):
        AutoSelector(AutoSettings(("gradient",), "gradient")).load_state_dict(a.state_dict())


def test_two_ranks_gathered_decide_as_one_rank_with_all_rows():
    ev = planted({"fisher": 0.6, "gradient": 0.2}, rows=48)
    even, odd = torch.arange(48) % 2 == 0, torch.arange(48) % 2 == 1
    one, two = AutoSelector(settings()), AutoSelector(settings())
    one.observe(0, ev, COSTS)
    two.observe(0, Evidence.concat([ev.select(even), ev.select(odd)]), COSTS)  # rank 0's rows, then rank 1's
    assert one.modes() == two.modes()
    for k, v in one.metrics().items():
        assert two.metrics()[k] == pytest.approx(v, rel=1e-9), k


# -- the configuration ------------------------------------------------------------------------------------------------
def test_the_auto_keys_are_validated_naming_the_key():
    cfg = check_config(OARConfig(mode="auto"))
    assert [c.mode for c in concrete_configs(cfg)] == ["conservative", "fisher"]
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.auto_candidates: 'nope' is not allowed; choose"):
        check_config(OARConfig(mode="auto", auto_candidates=("gradient", "nope")))
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.auto_default: 'auto' is not allowed"):
        check_config(OARConfig(mode="auto", auto_default="auto"))
    with pytest.raises(OARConfigError, match=r"auto_fallback='x' is not allowed; choose one of: grpo, best"):
        OARConfig(mode="auto", auto_fallback="x")
    with pytest.raises(OARConfigError, match=r"auto_every=0 is out of range"):
        OARConfig(mode="auto", auto_every=0)
    with pytest.raises(OARConfigError, match=r"names a mode twice"):
        OARConfig(auto_candidates=["gradient", "gradient"])
    assert OARConfig.from_mapping({"mode": "auto", "auto_candidates": ["gradient"]}).auto_candidates == ("gradient",)
    with pytest.raises(OARConfigError, match=r"mode=auto is decided by the OAR trainer step"):
        require_resolved(cfg)
    assert startup_checks(cfg) == []


def test_core_calls_refuse_auto_and_say_who_decides_it(lm64, make_batch):
    """``mode=auto`` through the core (no trainer step to resolve it): every entry point says that the trainer step
    decides ``auto`` and how a core user picks a mode, never "not a registered attribution method"."""
    from oar_verl.core import oar_advantages
    from oar_verl.core.methods.attribution import module_backend, run_attribution
    from oar_verl.core.pipeline import attribute

    cfg = OARConfig(mode="auto")
    batch = build_attribution_batch(*make_batch(B=2, P=4, T=10, seed=3), torch.full((2,), int(ProbeKind.AS_MEAN)))
    tok = type("Tok", (), {"pad_token_id": 0})()
    rows = [torch.tensor([5, 6, 7])] * 2
    calls = {"run_attribution": lambda: run_attribution(module_backend(lm64, cfg), batch, cfg),
             "attribute": lambda: attribute(lm64, rows, rows, tok, cfg),
             "oar_advantages": lambda: oar_advantages(lm64, rows, rows, torch.tensor([1.0, -1.0]), tok, cfg)}
    for name, call in calls.items():
        with pytest.raises(OARConfigError) as e:
            call()
        msg = str(e.value)
        assert "decided by the OAR trainer step" in msg and "gradient" in msg and "measure_candidates" in msg, name
        assert "not a registered" not in msg, name


# -- the evidence on a real model -------------------------------------------------------------------------------------
def test_candidate_metrics_equal_the_deletion_metric_per_candidate(lm64, make_batch):
    kinds = torch.tensor([ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN])
    batch = build_attribution_batch(*make_batch(B=4, P=4, T=14, seed=5), kinds)
    g = torch.Generator().manual_seed(1)
    scores = {c: torch.rand(batch.input_ids.shape, generator=g, dtype=torch.float64) for c in ("a", "b", "c")}
    entropy = torch.rand(batch.input_ids.shape, generator=g, dtype=torch.float64)
    kw = dict(replacement=Replacement(token=0), fractions=(0.1, 0.5), random_rankings=4, seed=2, entropy=entropy)
    calls = []
    backend = ModuleBackend(lm64, PassLimits(10**6), align=lambda n: calls.append(n) or n)
    got = candidate_metrics(backend, batch, scores, **kw)
    assert len(calls) == 1  # one scorer call for every candidate and control
    tol = dict(rtol=1e-7, atol=1e-12, equal_nan=True)
    for name, s in scores.items():
        ref = deletion_metrics(ModuleBackend(lm64, PassLimits(64)), batch, s, suppress_fraction=0.4, **kw)
        torch.testing.assert_close(got[name], ref["aopc"], **tol)
        for control in ("random", "position", "entropy"):
            torch.testing.assert_close(got[control], ref[f"aopc_{control}"], **tol)
    assert torch.isfinite(got["a"]).all() and (got["static"] == 0).all()
    with pytest.raises(ValueError, match="random_rankings must be >= 4"):
        candidate_metrics(backend, batch, scores, replacement=Replacement(token=0), random_rankings=2)
    assert math.isfinite(float(got["passes"][0]))


def test_measure_candidates_scores_each_candidate_on_the_first_rows(make_lm):
    """A rank's calibration share: every candidate on the first ``fidelity_rows`` rows with reasoning tokens equals
    its own attribution of those rows scored by candidate_metrics; the other rows are NaN."""
    from oar_verl.core import module_backend, prepare_attribution, run_attribution
    from oar_verl.core.auto.measure import measure_candidates
    from oar_verl.quickstart.tokenizers import train_tiny_bpe

    tok = train_tiny_bpe(["What is 3 plus 4? 3 plus 4 is 7. The answer is 7.", "so the sum is 9"] * 50, vocab_size=300)
    enc = (lambda t: torch.tensor(tok.encode(t, add_special_tokens=False)))
    p = [enc("What is 3 plus 4?")] * 3 + [enc("What is 4 plus 5?")]
    r = [torch.cat([enc(t), torch.tensor([tok.eos_token_id])]) for t in
         ("3 plus 4 is 7. The answer is 7.", "no answer", "4 and 3 make 7. The answer is 7.",
          "so the sum is 9. The answer is 9.")]
    model = make_lm(torch.float64, vocab=len(tok))
    cfg = OARConfig(mode="gradient", probe="as_mean", fidelity_rows=2)
    has = torch.tensor([True, False, True, True])
    backend_for = (lambda c, prep: module_backend(model, c))
    got = measure_candidates(p, r, tok, cfg, 3, ("fisher", "gradient"), backend_for, has_reasoning=has)
    measured = torch.tensor([True, False, True, False])
    for name in ("fisher", "gradient", "random", "position"):
        assert torch.isfinite(got["aopc"][name][measured]).all() and got["aopc"][name][~measured].isnan().all(), name
    sub = prepare_attribution([p[0], p[2]], [r[0], r[2]], tok, cfg, 3)
    imps = {c: run_attribution(module_backend(model, cfg), sub.batch, dataclasses.replace(cfg, mode=c),
                               mask_token_id=sub.mask_token_id, seeds=sub.seeds).importance.double()
            for c in ("fisher", "gradient")}
    from oar_verl.core.methods.mask_operator import mask_replacement
    backend = module_backend(model, cfg)
    ref = candidate_metrics(backend, sub.batch, imps, seed=cfg.seed,
                            replacement=mask_replacement(backend, sub.batch, cfg.mask, None, sub.seeds))
    for name in ("fisher", "gradient", "random", "position"):
        torch.testing.assert_close(got["aopc"][name][measured], ref[name], rtol=1e-7, atol=1e-12)
    assert set(got["seconds_per_token"]) == {"fisher", "gradient"} and float(got["tokens"]) > 0
    with pytest.raises(OARConfigError, match="mode=auto is decided by the OAR trainer step"):
        measure_candidates(p, r, tok, OARConfig(mode="auto"), 3, ("gradient",), backend_for, has_reasoning=has)


@settings_h(max_examples=25, deadline=None)
@given(rows=st.integers(4, 40), per_prompt=st.integers(1, 5), lifts=st.lists(st.floats(-0.5, 1.0), min_size=2,
                                                                              max_size=4), seed=st.integers(0, 99))
def test_gains_are_independent_of_the_other_candidates_and_of_row_order(rows, per_prompt, lifts, seed):
    """Invariants of the statistic: a candidate's gain and interval do not depend on which other candidates ran, and a
    permutation of the rows (ranks gathered in another order) changes nothing beyond rounding."""
    names = [f"m{i}" for i in range(len(lifts))]
    ev = planted(dict(zip(names, lifts)), rows=rows, per_prompt=per_prompt, seed=seed)
    alone = gains(ev, names[:1], ["random", "position"], resamples=50, seed=seed)
    every = gains(ev, names[::-1], ["random", "position"], resamples=50, seed=seed)
    assert alone[names[0]] == every[names[0]]
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    shuffled = Evidence({k: v[perm] for k, v in ev.aopc.items()}, ev.static[perm], ev.groups[perm],
                        tuple(ev.bands[i] for i in perm.tolist()))
    again = gains(shuffled, names, ["random", "position"], resamples=50, seed=seed)
    for c in names:
        for k in ("random", "position"):
            a, b = every[c][k], again[c][k]
            assert (a.rows, a.undefined) == (b.rows, b.undefined)
            for x, y in ((a.mean, b.mean), (a.lo, b.lo), (a.hi, b.hi)):
                assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-9, abs=1e-12)


def test_a_control_the_evidence_did_not_measure_is_not_required():
    """Without the policy's entropies (rollout-correction bypass: no old-log-prob pass) the entropy control is absent
    from the evidence: the rule decides over random and position and says so, instead of refusing every candidate
    against an all-NaN control; with entropy measured it is required like the others."""
    ev = planted({"fisher": 0.5, "gradient": 0.0})
    d = decide(ev, COSTS, max_cost=2.0, controls=("random", "position", "entropy"))
    assert d.choice == "fisher" and "random/position" in d.reason and "entropy" not in d.reason
    entropy = dict(ev.aopc, entropy=ev.aopc["random"] * 2.0)  # a control fisher does not beat
    d = decide(dataclasses.replace(ev, aopc=entropy), COSTS, max_cost=2.0, controls=("random", "position", "entropy"))
    assert d.choice is None and "entropy" in d.reason
    with pytest.raises(ValueError, match="none of the required controls"):
        decide(ev, COSTS, max_cost=2.0, controls=("entropy",))
