"""The in-step deletion metric (oar_verl.core.fidelity.step) over the backend interface equals the offline fidelity
report's curves under the same mask operator on a tiny float64 Qwen2, whatever the budget and the rank alignment."""

from __future__ import annotations

import math

import pytest
import torch

from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.base import Replacement
from oar_verl.core.fidelity import deletion_metrics, fidelity_report, removal_sets, rows_of, suppression_ratio
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind

MASK = 0
KINDS = torch.tensor([ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN,
                      ProbeKind.LT_LOGITS])
FR = (0.1, 0.2, 0.5)


def make(make_batch, B=5, T=14, seed=11):
    return build_attribution_batch(*make_batch(B=B, P=4, T=T, seed=seed), KINDS[:B].clone())


@pytest.fixture(scope="module")
def case(lm64, make_batch):
    batch = make(make_batch)
    scores = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rep = fidelity_report(lm64, batch, {"m": scores}, mask_token_id=MASK, operators=("token",), fractions=FR,
                          random_rankings=3, limits=PassLimits(64), seed=3, resamples=10, min_gap=0.0)
    return batch, scores, rep


@pytest.mark.parametrize("tokens,prefix_cache,align_to", [(64, True, 0), (10**6, False, 0), (40, True, 50)])
def test_equals_the_offline_token_report(lm64, case, tokens, prefix_cache, align_to):
    batch, scores, rep = case
    backend = ModuleBackend(lm64, PassLimits(tokens), prefix_cache=prefix_cache, align=lambda n: max(n, align_to))
    got = deletion_metrics(backend, batch, scores, replacement=Replacement(token=MASK), fractions=FR,
                           random_rankings=3, seed=3, suppress_fraction=0.4)
    m = rep.methods["m"]
    tol = dict(rtol=1e-7, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(got["aopc"], m.aopc[0], **tol)  # measure 0: kl
    torch.testing.assert_close(got["aopc_random"], rep.random_aopc[0], **tol)
    torch.testing.assert_close(got["suppression"], m.suppression[0], **tol)
    torch.testing.assert_close(got["gain"], m.aopc[0] / rep.random_aopc[0], **tol)
    assert torch.isfinite(got["aopc"]).all() and (got["aopc"] > 0).any()


def test_removal_sets_and_cost(lm64, case):
    batch, scores, _ = case
    J, F = 2, len(FR)
    sets = removal_sets(batch, scores, fractions=FR, random_rankings=J, seed=0, suppress_fraction=0.4)
    assert sets.shape == ((1 + J) * (F + 1), *batch.input_ids.shape)
    assert not (sets & ~batch.reasoning_mask).any()  # reasoning tokens only
    r = batch.reasoning_mask.sum(-1)
    assert (sets.sum(-1)[0] == torch.ceil(FR[0] * r - 1e-9)).all()
    calls = []
    backend = ModuleBackend(lm64, PassLimits(10**6), align=lambda n: calls.append(n) or n)
    out = deletion_metrics(backend, batch, scores, replacement=Replacement(token=MASK), fractions=FR,
                           random_rankings=J)
    # one clean pass and one pass of every perturbed row under an unlimited budget: independent of R
    assert calls == [2] and (out["passes"] == 2).all()


def test_rows_without_reasoning_are_nan_and_fill(lm64, make_batch, case):
    batch, scores, _ = case
    empty = rows_of(batch, torch.tensor([0, 1]))
    empty = type(empty)(**{**empty.__dict__, "reasoning_mask": torch.zeros_like(empty.reasoning_mask)})
    backend = ModuleBackend(lm64, PassLimits(64), align=lambda n: max(n, 3))  # other ranks run 3 passes
    seen = []
    run = backend.run
    backend.run = lambda b, passes, on_probe, hook=None: seen.append(len(passes)) or run(b, passes, on_probe, hook)
    out = deletion_metrics(backend, empty, scores[:2], replacement=Replacement(token=MASK), fractions=FR,
                           random_rankings=2)
    assert seen == [3]  # fillers only
    for k in ("aopc", "aopc_random", "gain", "suppression"):
        assert all(math.isnan(float(v)) for v in out[k])


def test_errors(lm64, case):
    batch, scores, _ = case
    backend = ModuleBackend(lm64, PassLimits(64))
    with pytest.raises(ValueError, match="fractions"):
        deletion_metrics(backend, batch, scores, replacement=Replacement(token=MASK), fractions=(0.0,))
    with pytest.raises(ValueError, match="random_rankings"):
        deletion_metrics(backend, batch, scores, replacement=Replacement(token=MASK), random_rankings=0)


def test_step_fidelity_measures_the_first_rows_on_due_steps(lm64, case):
    from oar_verl.core.config import OARConfig
    from oar_verl.core.fidelity import step_fidelity, step_metrics

    batch, scores, _ = case
    cfg = OARConfig(fidelity_every=5, fidelity_rows=2, seed=3, tau=0.4)
    backend = ModuleBackend(lm64, PassLimits(64))
    off = step_fidelity(backend, batch, scores, cfg, 7, replacement=Replacement(token=MASK))
    assert all(v.isnan().all() for v in off.values()) and step_metrics(off) == {}
    on = step_fidelity(backend, batch, scores, cfg, 10, replacement=Replacement(token=MASK))
    first = rows_of(batch, torch.tensor([0, 1]))
    ref = deletion_metrics(backend, first, scores[:2], replacement=Replacement(token=MASK), random_rankings=4, seed=3,
                           suppress_fraction=0.4)
    for k in ("aopc", "aopc_random", "suppression"):
        torch.testing.assert_close(on[k][:2], ref[k].cpu(), equal_nan=True)
        assert on[k][2:].isnan().all()
    assert (on["seconds"] > 0).all()
    m = step_metrics(on)
    assert m["oar/fidelity/rows"] == 2.0
    assert m["oar/fidelity/gain"] == pytest.approx(m["oar/fidelity/aopc"] / m["oar/fidelity/aopc_random"])
    assert step_fidelity(backend, batch, scores, cfg, 7, replacement=None)["aopc"].isnan().all()  # not due: nothing


@pytest.mark.parametrize("operator", ["mean", "zero", "resample"])
def test_every_mask_operator_is_row_independent(lm64, case, operator):
    """The run's operator replaces the removed tokens (an embedding vector, or resample's per-position ids following
    their rows into the expanded batch): measuring rows together equals measuring them one by one."""
    from oar_verl.core.methods.gradient import sequence_seeds
    from oar_verl.core.methods.mask_operator import mask_replacement

    batch, scores, _ = case
    backend = ModuleBackend(lm64, PassLimits(64))
    seeds = sequence_seeds(0, 0, torch.arange(batch.input_ids.shape[0]))
    rep = mask_replacement(backend, batch, operator, None, seeds)
    whole = deletion_metrics(backend, batch, scores, replacement=rep, fractions=FR, random_rankings=2)
    assert torch.isfinite(whole["aopc"]).all() and (whole["aopc"] > 0).any()
    for b in (1, 3):
        row = torch.tensor([b])
        one = mask_replacement(backend, rows_of(batch, row), operator, None, seeds[row])
        got = deletion_metrics(backend, rows_of(batch, row), scores[row], replacement=one, fractions=FR,
                               random_rankings=2)
        for k in ("aopc", "aopc_random", "suppression"):
            torch.testing.assert_close(got[k], whole[k][row], rtol=1e-5, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("operator", ["mean", "zero", "resample", "pad", "token"])
def test_the_offline_report_and_the_in_step_metric_agree_under_every_mask_operator(lm64, case, operator):
    """One scorer: on the same rows, rankings and seed, the in-step metric of the run's mask operator gives the
    offline report's figures under that operator (resample: the run's seeds and one draw)."""
    from oar_verl.core.methods.gradient import sequence_seeds
    from oar_verl.core.methods.mask_operator import mask_replacement

    batch, scores, _ = case
    seeds = sequence_seeds(0, 0, torch.arange(batch.input_ids.shape[0]))
    rep = fidelity_report(lm64, batch, {"m": scores}, mask_token_id=MASK, operators=(operator,), fractions=FR,
                          random_rankings=3, limits=PassLimits(64), seed=3, draws=1, seeds=seeds, resamples=10,
                          min_gap=0.0, controls=("random", "position"))  # the step's rankings: the same packing
    backend = ModuleBackend(lm64, PassLimits(64))
    got = deletion_metrics(backend, batch, scores, replacement=mask_replacement(backend, batch, operator, MASK, seeds),
                           fractions=FR, random_rankings=3, seed=3, suppress_fraction=0.4)
    m = rep.methods["m"]
    for key, want in (("aopc", m.aopc[0]), ("aopc_random", rep.random_aopc[0]), ("suppression", m.suppression[0]),
                      ("gain", suppression_ratio(m.aopc[0], rep.random_aopc[0]))):
        torch.testing.assert_close(got[key], want, rtol=1e-12, atol=1e-15, equal_nan=True)
    assert torch.isfinite(got["aopc"]).all() and (got["aopc"] > 1e-6).sum() >= 2  # (resample: a 1-token row stays)
    assert not torch.equal(m.curve[0, :, 0, 0], m.curve[0, :, 0, -1])  # the fractions differ: not vacuous


def test_the_controls_are_logged_and_equal_the_offline_report(lm64, case):
    """(e) the in-step metric logs the gains over random, position and (given entropies) entropy and the static rows;
    each gain equals the offline report's on the same rows, rankings and operator; without entropies the entropy
    gain is absent, not faked."""
    from oar_verl.core.config import OARConfig
    from oar_verl.core.fidelity import FRACTIONS, entropy_scores, step_fidelity, step_metrics

    batch, scores, _ = case
    cfg = OARConfig(fidelity_every=1, fidelity_rows=4, seed=3, tau=0.4)
    backend = ModuleBackend(lm64, PassLimits(64))
    entropy = entropy_scores(lm64, batch)
    on = step_fidelity(backend, batch, scores, cfg, 2, replacement=Replacement(token=MASK), entropy=entropy)
    m = step_metrics(on)
    for key in ("gain_over_random", "gain_over_position", "gain_over_entropy", "rows_static", "aopc_position",
                "aopc_entropy"):
        assert f"oar/fidelity/{key}" in m, key
    assert m["oar/fidelity/rows_static"] == float((on["static"] == 1).sum()) and on["static"][4:].isnan().all()
    first = rows_of(batch, torch.arange(4))
    rep = fidelity_report(lm64, first, {"m": scores[:4]}, mask_token_id=MASK, operators=("token",),
                          fractions=FRACTIONS, random_rankings=4, seed=3, suppress_fraction=0.4, min_gap=0.0,
                          entropy=entropy[:4], resamples=10)
    for c in ("random", "position", "entropy"):
        assert m[f"oar/fidelity/gain_over_{c}"] == pytest.approx(rep.summary[f"m/gain_over_{c}"].mean, rel=1e-9)
    torch.testing.assert_close(on["aopc_position"][:4], rep.control_aopc["position"][0], rtol=1e-9, atol=1e-12)
    assert len({round(m[f"oar/fidelity/gain_over_{c}"], 9) for c in ("random", "position", "entropy")}) == 3
    assert m["oar/fidelity/gain_over_random"] == pytest.approx(m["oar/fidelity/gain"] - 1, rel=1e-9)
    # no entropies: the entropy control is skipped and its metric absent; the others unchanged
    off = step_metrics(step_fidelity(backend, batch, scores, cfg, 2, replacement=Replacement(token=MASK)))
    assert "oar/fidelity/gain_over_entropy" not in off and "oar/fidelity/aopc_entropy" not in off
    assert off["oar/fidelity/gain_over_position"] == pytest.approx(m["oar/fidelity/gain_over_position"], rel=1e-9)
    # the worker's fields today (no position / entropy / static field shipped): those metrics are absent
    old = step_metrics({k: on[k] for k in ("aopc", "aopc_random", "suppression", "seconds")})
    assert "oar/fidelity/gain_over_random" in old and "oar/fidelity/gain_over_position" not in old
    assert "oar/fidelity/rows_static" not in old


def test_the_position_control_costs_f_rows_per_row(lm64, case):
    """The in-step cost: (1 + P + J)·F + 1 + J perturbed rows per row, P = 1 (position) or 2 (with entropy)."""
    from oar_verl.core.fidelity import position_scores

    batch, scores, _ = case
    J, F = 4, len(FR)
    for controls in ([position_scores(batch)], [position_scores(batch), torch.rand(scores.shape, dtype=torch.float64)]):
        sets = removal_sets(batch, scores, fractions=FR, random_rankings=J, seed=0, suppress_fraction=0.4,
                            controls=controls)
        assert sets.shape[0] == (1 + len(controls) + J) * F + 1 + J
        latest = sets[F + F - 1]  # the position control at the largest fraction: each row's latest tokens
        for b in range(batch.input_ids.shape[0]):
            cols = batch.reasoning_mask[b].nonzero().squeeze(1).tolist()
            k = int(latest[b].sum())
            assert k >= 1 and latest[b].nonzero().squeeze(1).tolist() == cols[len(cols) - k:]
