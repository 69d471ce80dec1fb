"""Gating and metrics: hand-computed values, the official arithmetic (τ bug fixed), hypothesis invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.core.reshaping.gating import masked_quantile, normalize_scores, oar_token_weights
from oar_verl.core.reshaping.metrics import ess_ratio, flat_rows, flat_warning, oar_metrics, top_mass


def official_weights(importance: np.ndarray, tau: float, beta: float) -> np.ndarray:
    """The official OAR-main.py arithmetic for one sequence (numpy), with its τ-overwrite bug fixed."""
    log_imp = np.log1p(importance)
    mn, mx = log_imp.min(), log_imp.max()
    norm = (log_imp - mn) / (mx - mn) if mx > mn else np.zeros_like(log_imp)
    threshold = np.quantile(norm, tau)
    w = np.where(norm < threshold, np.maximum(norm / (threshold + 1e-8), 0.1),
                 1.0 + beta * (norm - threshold) / (1.0 - threshold + 1e-8))
    return w * len(w) / w.sum()


def official_loop_with_bug(seqs: list[np.ndarray], tau: float, beta: float) -> list[np.ndarray]:
    """The official loop as published: `threshold` (τ) is overwritten by the quantile value of the previous row."""
    threshold = tau
    out = []
    for imp in seqs:
        log_imp = np.log1p(imp)
        norm = (log_imp - log_imp.min()) / (log_imp.max() - log_imp.min())
        threshold = np.quantile(norm, threshold)
        w = np.where(norm < threshold, np.maximum(norm / (threshold + 1e-8), 0.1),
                     1.0 + beta * (norm - threshold) / (1.0 - threshold + 1e-8))
        out.append(w * len(w) / w.sum())
    return out


def pad(seqs: list[np.ndarray], T: int):
    imp = torch.zeros(len(seqs), T, dtype=torch.float64)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        imp[i, : len(s)] = torch.from_numpy(s)
        mask[i, : len(s)] = True
    return imp, mask


def test_hand_computed_example():
    # I = e^u - 1 for u = 0, 1, 2, 3  →  n = 0, 1/3, 2/3, 1 ; τ = 0.5 → θ = 0.5 (linear interpolation)
    imp = torch.tensor([[math.exp(u) - 1 for u in (0, 1, 2, 3)]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    tw = oar_token_weights(imp, mask, mask.long(), tau=0.5, beta=2.0, floor=0.1)
    raw = [0.1, (1 / 3) / 0.5, 1 + 2 * (2 / 3 - 0.5) / 0.5, 1 + 2 * (1 - 0.5) / 0.5]
    expect = torch.tensor([[r * 4 / sum(raw) for r in raw]])
    torch.testing.assert_close(tw.weights, expect.float(), rtol=1e-6, atol=1e-6)
    assert tw.floored.tolist() == [[True, False, False, False]]
    assert tw.boosted.tolist() == [[False, False, True, True]]


def test_masked_quantile_matches_numpy():
    rng = np.random.default_rng(0)
    seqs = [rng.random(n) for n in (1, 2, 5, 17)]
    vals, mask = pad(seqs, 20)
    for q in (0.0, 0.25, 0.4, 0.77, 1.0):
        got = masked_quantile(vals, mask, q)
        want = torch.tensor([np.quantile(s, q) for s in seqs], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tau,beta", [(0.4, 2.0), (0.25, 1.0), (0.0, 2.0), (0.9, 0.5)])
def test_matches_official_arithmetic(tau, beta):
    rng = np.random.default_rng(1)
    seqs = [rng.exponential(1.0, n) for n in (3, 8, 30)]
    imp, mask = pad(seqs, 32)
    tw = oar_token_weights(imp, mask, mask.long(), tau=tau, beta=beta, floor=0.1)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(tw.weights[i, : len(s)].numpy(), official_weights(s, tau, beta), rtol=1e-5)


def test_official_tau_bug_would_differ():
    """Documents the official code's τ overwrite (docs/method.md §7, bug 1): the published loop reuses the previous
    row's quantile value as the next row's level."""
    rng = np.random.default_rng(2)
    seqs = [rng.exponential(1.0, 12) for _ in range(3)]
    buggy = official_loop_with_bug(seqs, 0.4, 2.0)
    imp, mask = pad(seqs, 12)
    ours = oar_token_weights(imp, mask, mask.long(), tau=0.4, beta=2.0).weights
    np.testing.assert_allclose(ours[0].numpy(), buggy[0], rtol=1e-5)  # first row: same
    assert not np.allclose(ours[1].numpy(), buggy[1], rtol=1e-3)


def test_answer_eos_and_padding_weights():
    imp = torch.tensor([[5.0, 1.0, 0.0, 9.0, 9.0, 0.0]])
    reasoning = torch.tensor([[1, 1, 1, 0, 0, 0]]).bool()
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]])
    tw = oar_token_weights(imp, reasoning, valid, tau=0.4, beta=2.0)
    assert tw.weights[0, 3:5].tolist() == [1.0, 1.0]  # answer span and EOS keep 1
    assert tw.weights[0, 5] == 0.0  # padding keeps 0
    assert math.isclose(float(tw.weights[0, :3].sum()), 3.0, rel_tol=1e-6)


def test_nonfinite_rows_fall_back_to_uniform():
    imp = torch.tensor([[1.0, float("nan"), 2.0], [1.0, float("inf"), 0.5], [3.0, 1.0, 2.0]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    tw = oar_token_weights(imp, mask, mask.long(), tau=0.4, beta=2.0)
    assert tw.fallback.tolist() == [True, True, False]
    assert (tw.weights[:2] == 1).all()
    assert torch.isfinite(tw.weights).all()
    # non-finite values off the reasoning tokens are ignored
    imp2 = torch.tensor([[1.0, 2.0, float("nan")]])
    tw2 = oar_token_weights(imp2, torch.tensor([[1, 1, 0]]).bool(), torch.ones(1, 3), tau=0.4, beta=2.0)
    assert not tw2.fallback.any() and torch.isfinite(tw2.weights).all()


def test_negative_joint_drops_do_not_make_nan():
    imp = torch.tensor([[-5.0, -1.0, -0.999, 0.5, 2.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    n = normalize_scores(imp, mask)
    assert torch.isfinite(n).all()
    tw = oar_token_weights(imp, mask, mask.long(), tau=0.4, beta=2.0)
    assert torch.isfinite(tw.weights).all() and (tw.weights > 0).all()


def test_reshape_rows_leaves_other_rows_uniform():
    imp = torch.rand(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    tw = oar_token_weights(imp, mask, mask.long(), 0.4, 2.0, reshape_rows=torch.tensor([True, False, True]))
    assert (tw.weights[1] == 1).all() and not (tw.weights[0] == 1).all()


def test_metrics_values():
    w = torch.tensor([[2.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    torch.testing.assert_close(ess_ratio(w, m), torch.tensor([16 / (3 * 6), 1.0]))
    torch.testing.assert_close(top_mass(w, m, 0.1), torch.tensor([0.5, 0.25]))
    imp = torch.tensor([[0.1, 3.0, 0.2, 0.0], [1.0, 1.0, 1.0, 1.0]])
    tw = oar_token_weights(imp, m, torch.ones(2, 4), 0.4, 2.0)
    base = torch.tensor([[1.0] * 4, [-0.5] * 4])
    metrics = oar_metrics(tw, base, base * tw.weights, torch.ones(2, 4), span_found=torch.tensor([True, False]))
    assert metrics["oar/span_found_frac"] == 0.5
    assert metrics["oar/reshaped_seq_frac"] == 1.0
    assert metrics["oar/flat_seq_frac"] == 0.5  # row 2's equal scores moved no credit
    assert flat_rows(w, m).tolist() == [False, True]
    assert not flat_rows(w[:1], torch.tensor([[True, False, False, False]])).any()  # one token is not a spread
    assert metrics["oar/adv_mass_rel_err"] < 1e-6
    assert all(math.isfinite(v) for v in metrics.values())
    assert flat_warning(metrics, 3) is None  # row 1 moved credit
    flat = oar_token_weights(torch.ones(2, 4), m, torch.ones(2, 4), 0.4, 2.0)  # nothing to rank: every row flat
    line = flat_warning(oar_metrics(flat, base, base * flat.weights, torch.ones(2, 4)), 3)
    assert line.startswith("oar: step 3: every reshaped row's scores were flat")
    assert flat_warning({"oar/reshaped_seq_frac": 0.0, "oar/flat_seq_frac": 0.0}, 3) is None  # nothing reshaped


# ------------------------------------------------------------------------------------------- invariants
rows_strategy = st.lists(
    st.lists(st.floats(0.0, 1e4, allow_nan=False, allow_infinity=False), min_size=1, max_size=24),
    min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(rows_strategy, st.floats(0.0, 0.95), st.floats(0.0, 5.0), st.floats(0.01, 1.0))
def test_invariants_sum_positive_composition(seqs, tau, beta, floor):
    seqs = [np.array(s) for s in seqs]
    imp, mask = pad(seqs, 24)
    tw = oar_token_weights(imp, mask, mask.long(), tau, beta, floor)
    w = tw.weights.double()
    # Σw = R and w > 0 over the reasoning tokens
    torch.testing.assert_close(w.sum(-1), mask.sum(-1).double(), rtol=1e-5, atol=1e-5)
    assert (w[mask] > 0).all()
    # a row's weights do not depend on the other rows of the batch
    for i in range(len(seqs)):
        alone = oar_token_weights(imp[i: i + 1], mask[i: i + 1], mask[i: i + 1].long(), tau, beta, floor).weights
        torch.testing.assert_close(alone[0], tw.weights[i], rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.floats(0.0, 1e3), st.floats(0.0, 0.95), st.floats(0.0, 5.0))
def test_all_equal_scores_give_uniform_weights(n, value, tau, beta):
    imp = torch.full((1, n), value, dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.bool)
    tw = oar_token_weights(imp, mask, mask.long(), tau, beta)
    torch.testing.assert_close(tw.weights, torch.ones(1, n), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- rows without a span
# docs/method.md §2, "Rows without an answer span": preparation gives such a row (target=response) no reasoning token,
# so the gate leaves it at GRPO's w = 1 and counts it (oar/no_reasoning_seq_frac)
no_span_rows = st.lists(st.tuples(st.lists(st.floats(0.0, 1e4, allow_nan=False, allow_infinity=False), min_size=1,
                                           max_size=20),
                                  st.booleans(),  # the row has an answer span (its reasoning is weighted)
                                  st.sampled_from([-1.0, 0.0, 0.5])),  # its sequence advantage
                        min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(no_span_rows, st.floats(0.0, 0.95), st.floats(0.0, 5.0), st.floats(0.01, 1.0))
def test_rows_without_reasoning_keep_uniform_weights(rows, tau, beta, floor):
    """Σw = R and w > 0 on every reshaped row; a row with valid tokens but no reasoning token (no answer span) keeps
    w = 1 and its advantage bit for bit, whatever its advantage; zero-advantage rows are untouched; each row's weights
    do not depend on the others; the flag marks exactly the rows to reshape that had nothing to weight."""
    from oar_verl.core import OARConfig
    from oar_verl.core.reshaping.reshape import reshape_advantages

    T = 24  # every row has 4 more valid tokens than scores: an answer span and EOS, never reasoning
    imp = torch.zeros(len(rows), T, dtype=torch.float64)
    reasoning = torch.zeros(len(rows), T, dtype=torch.bool)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (scores, found, _) in enumerate(rows):
        imp[i, :len(scores)] = torch.tensor(scores, dtype=torch.float64)
        reasoning[i, :len(scores)] = found
        valid[i, :len(scores) + 4] = True
    adv = torch.tensor([a for *_, a in rows], dtype=torch.float64)
    base = torch.where(valid, adv[:, None], 0.0)
    cfg = OARConfig(tau=tau, beta=beta, floor=floor)
    out = reshape_advantages(base, imp, reasoning, valid, cfg)
    tw = out.token_weights
    w = tw.weights.double()
    wanted = adv != 0
    torch.testing.assert_close((w * reasoning).sum(-1), reasoning.sum(-1).double(), rtol=1e-5, atol=1e-5)
    assert (w[valid] > 0).all() and (w[~valid] == 0).all()
    untouched = ~reasoning.any(-1) | ~wanted
    assert (w[untouched][valid[untouched]] == 1).all()
    assert torch.equal(out.advantages[untouched], base[untouched])
    assert tw.no_reasoning.tolist() == (wanted & ~reasoning.any(-1)).tolist()
    assert not tw.reshaped[untouched].any()
    for i in range(len(rows)):
        alone = reshape_advantages(base[i:i + 1], imp[i:i + 1], reasoning[i:i + 1], valid[i:i + 1], cfg)
        assert torch.equal(alone.token_weights.weights[0], tw.weights[i])
    m = out.metrics()
    assert m["oar/no_reasoning_seq_frac"] == float((wanted & ~reasoning.any(-1)).sum()) / len(rows)
    assert m["oar/adv_mass_rel_err"] < 1e-5


def test_no_reasoning_metric_counts_rows_to_reshape_only():
    """oar/no_reasoning_seq_frac: of the batch's rows, those the gate would reshape (non-zero advantage, kept by
    apply_to, attributed) that kept w = 1 for want of a reasoning token; a row of padding only is not one."""
    imp = torch.tensor([[0.1, 3.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4])
    reasoning = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]).bool()
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]).bool()
    rows = torch.tensor([True, True, False, True, True])  # row 2: zero advantage; row 4: no valid token
    tw = oar_token_weights(imp, reasoning, valid, 0.4, 2.0, reshape_rows=rows)
    assert tw.no_reasoning.tolist() == [False, True, False, True, False]
    assert (tw.weights[1:4][valid[1:4]] == 1).all()
    base = torch.where(valid, 1.0, 0.0)
    m = oar_metrics(tw, base, base * tw.weights, valid)
    assert m["oar/no_reasoning_seq_frac"] == 2 / 5 and m["oar/reshaped_seq_frac"] == 1 / 5
    assert m["oar/flat_seq_frac"] == 0.0  # left alone, not reshaped flat: no flat-score warning for them


# ------------------------------------------------------------------------------------------- signed scores
# algorithm.oar.signed_scores: how the gate reads signed scores (the default mode's relevance is signed; a negative
# score means the token argues against the stated answer)
def old_normalize(importance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """normalize_scores as it was before the choice (the `clamp` rule must stay this, bit for bit)."""
    u = torch.log1p(importance.double().clamp(min=0))
    u = torch.where(mask, u, 0.0)
    umin = torch.where(mask, u, float("inf")).amin(-1, keepdim=True)
    umax = torch.where(mask, u, float("-inf")).amax(-1, keepdim=True)
    span = umax - umin
    span = torch.where(torch.isfinite(span) & (span > 0), span, torch.ones_like(span))
    umin = torch.where(torch.isfinite(umin), umin, torch.zeros_like(umin))
    return torch.where(mask, (u - umin) / span, 0.0)


def rank_reference(row: np.ndarray) -> np.ndarray:
    """0-based average ranks / (R − 1), 0 on a row of one token or of equal scores (scipy's rankdata 'average' − 1)."""
    if len(row) < 2 or row.min() == row.max():
        return np.zeros(len(row))
    below = (row[None, :] < row[:, None]).sum(1)
    at_or_below = (row[None, :] <= row[:, None]).sum(1)
    return (below + at_or_below - 1) / 2 / (len(row) - 1)


# what each rule's weights are monotone in (non-decreasing, equal keys -> equal weights)
MONOTONE_KEY = {"clamp": lambda i: i.clamp(min=0), "signed": lambda i: i, "magnitude": lambda i: i.abs(),
                "rank": lambda i: i}

signed_value = st.one_of(st.sampled_from([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]),  # many ties, zeros
                         st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False))
signed_rows = st.lists(st.tuples(st.lists(signed_value, min_size=1, max_size=24), st.booleans()),  # (scores, reshape)
                       min_size=1, max_size=6)


def test_signed_score_names_are_the_configs():
    from oar_verl.core.config import SIGNED_SCORE_NAMES
    from oar_verl.core.reshaping.gating import SIGNED_SCORES

    assert tuple(SIGNED_SCORES) == SIGNED_SCORE_NAMES == ("clamp", "signed", "magnitude", "rank")
    with pytest.raises(ValueError, match=r"algorithm\.oar\.signed_scores='sign' is not allowed; choose one of: "
                                         r"clamp, signed, magnitude, rank"):
        normalize_scores(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), "sign")


@settings(max_examples=100, deadline=None)
@given(signed_rows, st.floats(0.0, 0.95), st.floats(0.0, 5.0), st.floats(0.01, 1.0))
def test_clamp_is_the_old_rule_bit_for_bit(rows, tau, beta, floor):
    from oar_verl.core.reshaping.gating import gate

    imp, mask = pad([np.array(s) for s, _ in rows], 24)
    old = old_normalize(imp, mask)
    assert torch.equal(normalize_scores(imp, mask, "clamp"), old)
    w_old = torch.where(mask, gate(old, mask, tau, beta, floor)[0], mask.double()).float()
    assert torch.equal(oar_token_weights(imp, mask, mask.long(), tau, beta, floor, signed="clamp").weights, w_old)
    # the default (`magnitude`) reads scores that are never negative exactly as the old rule did
    plain = imp.abs()
    assert torch.equal(normalize_scores(plain, mask), old_normalize(plain, mask))


@pytest.mark.parametrize("name", ["clamp", "signed", "magnitude", "rank"])
@settings(max_examples=80, deadline=None)
@given(rows=signed_rows, tau=st.floats(0.0, 0.95), beta=st.floats(0.0, 5.0), floor=st.floats(0.01, 1.0))
def test_signed_score_invariants(name, rows, tau, beta, floor):
    """Every rule on signed scores (negative, zero, positive, ties, rows of 1-2 tokens, padding, rows left alone):
    Σw = R on reshaped rows, w > 0 there, w = 1 on rows left alone, 0 on padding; a row's weights do not depend on
    the others; the weights are monotone in the rule's key (clamp: max(I, 0); signed, rank: I; magnitude: |I|)."""
    from oar_verl.core.reshaping.gating import gate

    T = 26  # two padding columns at least
    imp, mask = pad([np.array(s) for s, _ in rows], T)
    valid = mask.clone()
    valid[:, -1] = True  # a valid non-reasoning token (EOS) on every row
    keep = torch.tensor([r for _, r in rows])
    tw = oar_token_weights(imp, mask, valid.long(), tau, beta, floor, reshape_rows=keep, signed=name)
    w = tw.weights
    n = normalize_scores(imp, mask, name)
    assert ((n >= 0) & (n <= 1)).all() and (n[~mask] == 0).all()
    w64 = gate(n, mask, tau, beta, floor)[0]
    torch.testing.assert_close(w64.sum(-1), mask.sum(-1).double(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.double().sum(-1)[keep], mask.sum(-1).double()[keep] + 1, rtol=1e-5, atol=1e-5)
    assert (w[mask] > 0).all()
    assert (w[~keep][valid[~keep]] == 1).all() and (w[~valid] == 0).all() and (w[:, -1] == 1).all()
    assert not tw.reshaped[~keep].any()
    for i in range(len(rows)):
        alone = oar_token_weights(imp[i:i + 1], mask[i:i + 1], valid[i:i + 1].long(), tau, beta, floor,
                                  reshape_rows=keep[i:i + 1], signed=name)
        assert torch.equal(alone.weights[0], w[i])
        if keep[i]:
            key, wi = MONOTONE_KEY[name](imp[i][mask[i]]), w[i][mask[i]]
            lower = key[:, None] < key[None, :]
            assert (wi[:, None] <= wi[None, :])[lower].all()
            assert (wi[:, None] == wi[None, :])[key[:, None] == key[None, :]].all()


@pytest.mark.parametrize("name", ["clamp", "signed", "magnitude", "rank"])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), value=st.floats(-1e3, 1e3), tau=st.floats(0.0, 0.95), beta=st.floats(0.0, 5.0))
def test_all_equal_signed_scores_give_uniform_weights(name, n, value, tau, beta):
    imp = torch.full((1, n), value, dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.bool)
    tw = oar_token_weights(imp, mask, mask.long(), tau, beta, signed=name)
    assert torch.equal(tw.weights, torch.ones(1, n))


@settings(max_examples=150, deadline=None)
@given(signed_rows)
def test_rank_matches_a_per_row_reference(rows):
    from oar_verl.core.reshaping.gating import rank_scores

    seqs = [np.array(s) for s, _ in rows]
    imp, mask = pad(seqs, 24)
    got = rank_scores(imp, mask)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(got[i, :len(s)].numpy(), rank_reference(s), rtol=0, atol=1e-12)
        assert (got[i, len(s):] == 0).all()


def test_rank_hand_computed_ties():
    imp = torch.tensor([[1.0, 1.0, 1.0, 2.0, 2.0, -7.0], [-1.0, 5.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]).bool()
    # row 0: ranks (0-based, averaged) 1, 1, 1, 3.5, 3.5 over R − 1 = 4 (the padding's −7 is not a score)
    expect = torch.tensor([[0.25, 0.25, 0.25, 0.875, 0.875, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(normalize_scores(imp, mask, "rank"), expect)


def test_counter_evidence_under_clamp_and_signed():
    """The defect `signed` fixes: more than τ of a row's tokens argue against the answer. Under `clamp` they all read
    as 0, the gate's θ is 0 and no token is suppressed (every raw weight >= 1: the counter-evidence ends with the
    zero-evidence token's weight, no floor); under `signed` the most negative tokens get the lowest weights, at the
    floor before renormalisation."""
    from oar_verl.core.reshaping.gating import gate

    imp = torch.tensor([[-5.0, -4.0, -3.0, -2.0, -1.0, -0.5, 0.0, 1.0, 2.0, 4.0]])
    mask = torch.ones(1, 10, dtype=torch.bool)
    tau, beta, floor = 0.4, 2.0, 0.1
    n = normalize_scores(imp, mask, "clamp")
    assert float(masked_quantile(n, mask, tau)[0]) == 0.0
    w, floored, _ = gate(n, mask, tau, beta, floor)
    assert not floored.any()
    assert torch.equal(w[0, :7], w[0, :7].min().expand(7))  # -5 .. 0 alike: the counter-evidence is not told apart
    tw = oar_token_weights(imp, mask, mask.long(), tau, beta, floor, signed="clamp")
    assert not tw.floored.any() and float(tw.weights[0, 0]) == float(tw.weights[0, 6])
    tw = oar_token_weights(imp, mask, mask.long(), tau, beta, floor)  # the default, `magnitude`: |score| decides
    assert float(tw.weights[0, 0]) > float(tw.weights[0, 6]) and tw.floored[0, 6]

    tw = oar_token_weights(imp, mask, mask.long(), tau, beta, floor, signed="signed")
    w = tw.weights[0]
    assert int(w.argmin()) == 0 and tw.floored[0, 0]
    assert (w[1:] >= w[:-1]).all() and (w[1:] > w[:-1]).sum() >= 7  # ordered by the signed score
    assert float(w[0]) < float(w[4]) < float(w[6])  # counter-evidence below no evidence


def test_reshape_advantages_reads_signed_scores_from_the_config():
    from oar_verl.core import OARConfig
    from oar_verl.core.reshaping.reshape import reshape_advantages

    imp = torch.tensor([[-5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0]])
    mask = torch.ones(1, 8, dtype=torch.bool)
    base = torch.ones(1, 8)
    for name in ("clamp", "signed", "magnitude", "rank"):
        got = reshape_advantages(base, imp, mask, mask, OARConfig(signed_scores=name)).token_weights.weights
        assert torch.equal(got, oar_token_weights(imp, mask, mask.long(), 0.4, 2.0, 0.1, signed=name).weights)
    assert not torch.equal(reshape_advantages(base, imp, mask, mask, OARConfig()).token_weights.weights,
                           reshape_advantages(base, imp, mask, mask, OARConfig(signed_scores="signed"))
                           .token_weights.weights)
