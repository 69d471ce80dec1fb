"""The fidelity metric's controls and its primary statistic's summaries (oar_verl.core.fidelity.controls, .summary):
the policy's next-token entropy by hand on a tiny float64 Qwen2, and the ratio of sums with its prompt-clustered
bootstrap on numbers chosen by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.fidelity import (CONTROLS, DEFAULT_CONTROLS, bootstrap_mean, bootstrap_ratio, check_controls,
                                    control_scores, entropy_from_logits, entropy_scores, ratio_of_sums, static_rows)

KINDS = torch.tensor([ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN])


def make(make_batch, B=4, P=5, T=12, seed=0, extra_pad=0):
    prompts, prompt_mask, *rest = make_batch(B=B, P=P, T=T, seed=seed)
    if extra_pad:  # the same rows with more left padding
        prompts = torch.nn.functional.pad(prompts, (extra_pad, 0))
        prompt_mask = torch.nn.functional.pad(prompt_mask, (extra_pad, 0))
    return build_attribution_batch(prompts, prompt_mask, *rest, KINDS[:B].clone())


def entropy_by_hand(model, batch, b, c):
    """H of the next-token distribution that produced token c of row b: one unpadded row, its full logits."""
    cols = [j for j in range(batch.input_ids.shape[1]) if batch.attention_mask[b, j]]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids[b, cols][None]).logits[0].double()
    p = torch.softmax(logits[cols.index(c) - 1], -1)
    return float(-(p * p.log()).sum())


def test_entropy_scores_by_hand(lm64, make_batch):
    """(c) the entropy at a reasoning position is the entropy of a direct forward's prediction of it; 0 off the
    reasoning; the same with more padding and with other rows in the batch."""
    batch = make(make_batch, seed=3)
    got = entropy_scores(lm64, batch)
    r = batch.reasoning_mask
    assert got.dtype == torch.float64 and (got[~r] == 0).all() and (got[r] > 0).all()
    for b, c in r.nonzero().tolist():
        assert float(got[b, c]) == pytest.approx(entropy_by_hand(lm64, batch, b, c), rel=1e-9)
    assert got[r].max() > 2 * got[r].min()  # positions differ: not a constant
    padded = entropy_scores(lm64, make(make_batch, seed=3, extra_pad=3))
    torch.testing.assert_close(padded[:, 3:], got, rtol=1e-9, atol=1e-12)
    for rows in ([2], [3, 0]):
        idx = torch.tensor(rows)
        sub = dataclasses.replace(batch, input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx],
                                  position_ids=batch.position_ids[idx], reasoning_mask=r[idx],
                                  probe=batch.probe.index(idx))
        torch.testing.assert_close(entropy_scores(lm64, sub), got[idx], rtol=1e-9, atol=1e-12)
    # from logits already computed (the old-log-prob pass's): a padded batch's full forward gives the same
    with torch.no_grad():
        logits = lm64(**batch.model_inputs()).logits
    torch.testing.assert_close(entropy_from_logits(logits, batch), got, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(entropy_from_logits(torch.log_softmax(logits, -1), batch), got, rtol=1e-7, atol=1e-10)


def test_entropy_from_logits_on_numbers_by_hand(make_batch):
    batch = make(make_batch, B=2, seed=1)
    B, L = batch.input_ids.shape
    logits = torch.zeros(B, L, 4, dtype=torch.float64)  # uniform over 4 tokens: H = log 4
    b, c = batch.reasoning_mask.nonzero()[0].tolist()
    logits[b, c - 1] = torch.tensor([0.0, math.log(3.0), -math.inf, -math.inf])  # p = (1/4, 3/4, 0, 0)
    got = entropy_from_logits(logits, batch)
    want = torch.where(batch.reasoning_mask, math.log(4.0), 0.0).double()
    want[b, c] = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="logits have shape"):
        entropy_from_logits(logits[:, 1:], batch)


def test_the_controls_registry():
    assert DEFAULT_CONTROLS == CONTROLS.names() == ("random", "position", "entropy")
    assert check_controls(["position", "random", "position"]) == ("position", "random")
    with pytest.raises(ValueError, match="controls='length' is not a registered fidelity control; registered: "
                                         "entropy, position, random"):
        check_controls(["length"])


def test_ratio_of_sums_and_static_rows_by_hand():
    """(b) no row is dropped for its value: a row where the method loses and a row where nothing moves stay in Σ."""
    method = torch.tensor([0.5, 0.1, 0.0, 0.4, float("nan")], dtype=torch.float64)
    control = torch.tensor([0.2, 0.3, 0.0, 0.1, 0.2], dtype=torch.float64)
    got = float(ratio_of_sums(method - control, control))
    assert got == pytest.approx((0.3 - 0.2 + 0.0 + 0.3) / (0.2 + 0.3 + 0.0 + 0.1))
    assert math.isnan(float(ratio_of_sums(torch.tensor([0.1, -0.1]), torch.tensor([1e-13, -1e-13]))))
    aopcs = torch.stack([method, control])  # (Q = 2, B)
    assert static_rows(aopcs).tolist() == [False, False, True, False, False]
    assert static_rows(aopcs, min_gap=0.25).tolist() == [False, False, True, False, False]
    assert static_rows(aopcs, min_gap=0.45).tolist() == [False, True, True, True, False]
    ivs = bootstrap_ratio((method - control)[None], control[None], resamples=500)
    assert ivs[0].mean == pytest.approx(got) and ivs[0].rows == 4 and ivs[0].undefined == 1
    assert ivs[0].lo < got < ivs[0].hi


def test_the_share_of_resamples_dropped_for_an_undefined_ratio():
    """``dropped``: the share of resamples whose denominator sum is not above 0 (nanquantile leaves them out of the
    percentiles); 0 where every row's denominator is positive; mean, lo, hi as before, the bounds over the rest."""
    g = torch.Generator().manual_seed(1)
    num = torch.randn(2, 2, generator=g, dtype=torch.float64)
    den = torch.tensor([[1.0, 2.0], [2.0, -1.0]], dtype=torch.float64)  # Σ den > 0; row 1 drawn twice: Σ den < 0
    R, seed = 4000, 3
    pos, mixed = bootstrap_ratio(num, den, resamples=R, seed=seed)
    assert pos.dropped == 0.0 and bootstrap_mean(num)[0].dropped == 0.0
    # the same resamples by hand: R draws of K = 2 rows with replacement, each row's draw count
    idx = torch.randint(0, 2, (R, 2), generator=torch.Generator().manual_seed(seed))
    counts = torch.stack([(idx == k).sum(-1) for k in range(2)], -1).double()  # (R, 2)
    assert mixed.dropped == pytest.approx((counts[:, 1] == 2).double().mean().item(), abs=1e-12)
    assert mixed.dropped == pytest.approx(0.25, abs=0.03)  # P(both draws row 1) = 1/4
    for iv, n, d in ((pos, num[0], den[0]), (mixed, num[1], den[1])):
        assert iv.mean == pytest.approx(float(ratio_of_sums(n, d)))
        ratio = (counts @ n) / (counts @ d)
        kept = ratio[counts @ d > 0]  # the bounds: percentiles of the defined resamples only
        assert (iv.lo, iv.hi) == pytest.approx((torch.quantile(kept, 0.025).item(),
                                                torch.quantile(kept, 0.975).item()), rel=1e-12)


def test_the_cluster_bootstrap():
    """(d) one cluster: every resample is the whole sample, the interval is the point; rows duplicated within their
    cluster: the interval is the row bootstrap of the distinct rows, not the narrower one of independent copies."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, generator=g, dtype=torch.float64)
    den = 1.0 + torch.rand(1, 12, generator=g, dtype=torch.float64)
    one = torch.zeros(12, dtype=torch.long)
    for iv in (bootstrap_mean(x, groups=one)[0], bootstrap_ratio(x, den, groups=one)[0]):
        assert iv.lo == iv.mean == iv.hi and iv.rows == 12
    twice, twice_den = torch.cat([x, x], 1), torch.cat([den, den], 1)
    pairs = torch.arange(12).repeat(2) * 7 + 3  # any integer ids: row i and its copy share one
    for clustered, independent, alone in (
            (bootstrap_mean(twice, groups=pairs)[0], bootstrap_mean(twice)[0], bootstrap_mean(x)[0]),
            (bootstrap_ratio(twice, twice_den, groups=pairs)[0], bootstrap_ratio(twice, twice_den)[0],
             bootstrap_ratio(x, den)[0])):
        assert clustered.mean == pytest.approx(independent.mean) and clustered.rows == 24
        assert (clustered.lo, clustered.hi) == pytest.approx((alone.lo, alone.hi), rel=1e-12)
        assert clustered.hi - clustered.lo > 1.2 * (independent.hi - independent.lo)
    # the default is each row its own cluster
    assert bootstrap_mean(x, groups=torch.arange(12))[0] == bootstrap_mean(x)[0]
    with pytest.raises(ValueError, match="groups"):
        bootstrap_mean(x, groups=torch.zeros(11, dtype=torch.long))


def test_per_row_values_become_response_aligned_scores(lm64, make_batch):
    """verl's old-log-prob entropies (one 1-D tensor per response, of any length) land at each row's response
    columns: value j of row b at response column j, cut to the batch's width, 0 past the row's values; and as the
    entropy control they rank exactly like the entropies computed from the model."""
    from oar_verl.core.fidelity.controls import response_aligned

    batch = make(make_batch, seed=3)
    B, L = batch.input_ids.shape
    P = batch.response_start
    full = entropy_scores(lm64, batch)  # (B, L), 0 off the reasoning
    lengths = batch.attention_mask[:, P:].sum(-1).tolist()
    values = [full[b, P:P + n] for b, n in enumerate(lengths)]  # what verl hands over: each response's own tokens
    got = response_aligned(values, batch)
    assert got.shape == (B, L - P) and got.dtype == torch.float64
    torch.testing.assert_close(control_scores("entropy", batch, None, got), full)
    longer = response_aligned([torch.cat([v, torch.ones(5, dtype=v.dtype)]) for v in values], batch)
    assert longer.shape == (B, L - P)  # cut to the batch's width, never a shape error
    short = response_aligned([v[:1] for v in values], batch)
    assert (short[:, 1:] == 0).all() and torch.equal(short[:, 0], got[:, 0])
    with pytest.raises(ValueError, match="rows of per-token values"):
        response_aligned(values[:-1], batch)
