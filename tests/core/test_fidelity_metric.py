"""The offline fidelity report (oar_verl.core.fidelity) against naive, one-row-at-a-time references on a tiny float64
Qwen2."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools import reference
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.fidelity import (
    DEFAULT_OPERATORS, FRACTIONS, MEASURES, OPERATORS, bootstrap_mean, fidelity_report, leave_one_out_scores, naopc,
    outcome_shifts, position_scores, random_scores, ranks_from_scores, removal_count, resample_tokens,
    suppression_ratio, top_removal,
)
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind

MASK = 0
KINDS = torch.tensor([ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN,
                      ProbeKind.LT_LOGITS])


def make(make_batch, B=5, P=4, T=12, seed=0, with_answer=True):
    rows = make_batch(B=B, P=P, T=T, seed=seed, with_answer=with_answer)
    return build_attribution_batch(*rows, KINDS[:B].clone())


def sub_batch(batch, idx):
    """The rows ``idx`` of an AttributionBatch (same columns)."""
    return dataclasses.replace(batch, input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx],
                               position_ids=batch.position_ids[idx], reasoning_mask=batch.reasoning_mask[idx],
                               probe=batch.probe.index(idx))


def hand_ranking(scores, reasoning, b):
    """Row b's reasoning columns, highest score first, earlier column on ties (plain Python)."""
    cols = [c for c in range(reasoning.shape[1]) if reasoning[b, c]]
    return sorted(cols, key=lambda c: (-float(scores[b, c]), c))


# ------------------------------------------------------------------------------------------------ naive reference
def naive_probe(logits, positions, weights, targets):
    """logsoftmax(Σ w z) and φ = Σ w log p(target) from one unpadded row's full logits (n, V)."""
    z = sum(w * logits[p] for p, w in zip(positions, weights))
    phi = sum(w * torch.log_softmax(logits[p], -1)[t] for p, w, t in zip(positions, weights, targets))
    return torch.log_softmax(z, -1), phi


def naive_shift(model, batch, b, removed, op, sampled=None):
    """(kl, logp) shifts of row b with the columns in ``removed`` (a set) removed by ``op``, one row, no padding."""
    L = batch.input_ids.shape[1]
    cols = [c for c in range(L) if batch.attention_mask[b, c]]
    ids = batch.input_ids[b]
    w, tgt = batch.probe.logit_weight[b], batch.probe.target_ids[b]
    probe_cols = [j for j in range(L) if w[j] != 0]
    valid = all(j + 1 < L and batch.attention_mask[b, j + 1] for j in probe_cols)
    joint = bool(batch.probe.joint[b])

    def run(row_ids, embeds=None):
        with torch.no_grad():
            if embeds is not None:
                return model(inputs_embeds=embeds[None]).logits[0].double()
            return model(input_ids=row_ids[None]).logits[0].double()

    clean_logits = run(ids[cols])
    pos = [cols.index(j) for j in probe_cols]
    c_logp, c_phi = naive_probe(clean_logits, pos, [w[j] for j in probe_cols], [tgt[j] for j in probe_cols])
    outs = []
    draws = sampled.shape[-1] if op == "resample" else 1
    for d in range(draws):
        if op == "delete":
            kept = [c for c in cols if c not in removed]
            new_ids = ids[kept]
            logits = run(new_ids)
            npos = [sum(1 for c in kept if c <= j) - 1 for j in probe_cols]
            ntgt = [int(new_ids[p + 1]) if p + 1 < len(kept) else 0 for p in npos]
            logp, phi = naive_probe(logits, npos, [w[j] for j in probe_cols], ntgt)
            if batch.probe.reads_span[b]:  # independent check of the moved span positions: the spec's reference
                answer = [kept.index(j + 1) for j in probe_cols]
                reasoning = [i for i, c in enumerate(kept) if batch.reasoning_mask[b, c]]
                kind = ProbeKind.AS_JOINT if joint else ProbeKind.AS_MEAN
                out = reference.outcome(logits, new_ids, kind, reasoning, answer)
                if joint:
                    torch.testing.assert_close(out.phi, phi)
                else:
                    torch.testing.assert_close(out.logp, logp)
        else:
            row = ids.clone()
            embeds = None
            if op in ("token", "pad"):
                row[list(removed)] = MASK
            elif op == "resample":
                row[list(removed)] = sampled[b, list(removed), d]
            if op in ("zero", "mean"):
                table = model.get_input_embeddings().weight
                vector = table.mean(0) if op == "mean" else torch.zeros_like(table[0])
                embeds = model.get_input_embeddings()(row[cols]).clone()
                for i, c in enumerate(cols):
                    if c in removed:
                        embeds[i] = vector
            logits = run(row[cols], embeds)
            logp, phi = naive_probe(logits, pos, [w[j] for j in probe_cols], [tgt[j] for j in probe_cols])
        kl = float((c_logp.exp() * (c_logp - logp)).sum())
        drop = float(c_phi - phi)
        outs.append((drop if joint else kl, drop if valid else float("nan")))
    return tuple(sum(o[i] for o in outs) / len(outs) for i in range(2))


def random_removals(batch, n_per_row, seed):
    """(N, L) removal masks: per row, n_per_row random non-empty subsets of its reasoning tokens; and src (N,)."""
    g = torch.Generator().manual_seed(seed)
    B, L = batch.input_ids.shape
    src = torch.arange(B).repeat_interleave(n_per_row)
    u = torch.rand(len(src), L, generator=g)
    keep_share = torch.rand(len(src), 1, generator=g)
    removed = batch.reasoning_mask[src] & (u < keep_share)
    first = batch.reasoning_mask[src].int().argmax(-1)  # at least one token where the row has reasoning
    removed[torch.arange(len(src)), first] |= batch.reasoning_mask[src].any(-1)
    return removed, src


# ------------------------------------------------------------------------------------------------ operators
@pytest.mark.parametrize("op", OPERATORS)  # every removal operator: OAR-P's mask operators and delete
def test_joint_removal_matches_one_row_by_hand(lm64, make_batch, op):
    assert set(OPERATORS) == {"mean", "zero", "resample", "pad", "token", "delete"}
    batch = make(make_batch, seed=3)
    removed, src = random_removals(batch, 2, seed=1)
    kw = dict(src=src, mask_token_id=MASK, seed=7, draws=4)
    fast = outcome_shifts(lm64, batch, removed, op, limits=PassLimits(40), **kw)  # several packed passes
    sampled = resample_tokens(batch, 4, seed=7) if op == "resample" else None
    for i in range(len(src)):
        b = int(src[i])
        gone = {c for c in range(removed.shape[1]) if removed[i, c]}
        ref = naive_shift(lm64, batch, b, gone, op, sampled)
        for m in range(2):
            if math.isnan(ref[m]):
                assert math.isnan(float(fast[m, i]))
            else:
                assert float(fast[m, i]) == pytest.approx(ref[m], rel=1e-6, abs=1e-9), (op, MEASURES[m], i)
    assert fast[0].abs().sum() > 1e-6  # not vacuous
    if op == "resample":  # the draws differ, so the mean over draws is not one draw's shift
        assert (sampled[batch.reasoning_mask][:, 1:] != sampled[batch.reasoning_mask][:, :1]).any()
    # one budget or another, the same numbers
    alone = outcome_shifts(lm64, batch, removed, op, limits=PassLimits(10**6), **kw)
    torch.testing.assert_close(fast, alone, equal_nan=True, rtol=1e-9, atol=1e-12)


def test_delete_shortens_rows_and_lt_probe_follows(lm64, make_batch):
    """No-span rows read LT-Logits at the last reasoning token; deleting that very token must move the probe to the
    last kept token before it (the position predicting the same next token)."""
    batch = make(make_batch, seed=5, with_answer=False)
    assert not batch.probe.reads_span.any()
    L = batch.input_ids.shape[1]
    lt = batch.probe.logit_weight.argmax(-1)
    removed = torch.zeros_like(batch.reasoning_mask)
    removed[torch.arange(len(lt)), lt] = True
    assert (removed & batch.reasoning_mask).sum() == len(lt)
    fast = outcome_shifts(lm64, batch, removed, "delete", limits=PassLimits(30))
    for b in range(len(lt)):
        ref = naive_shift(lm64, batch, b, {int(lt[b])}, "delete")
        assert float(fast[0, b]) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert L > 0 and fast[0].abs().min() > 0  # the row really changed


def test_resample_draws_come_from_the_row_and_the_seed_only(make_batch):
    """``resample`` means what it means for OAR-P: a token drawn from the same row's reasoning tokens."""
    from oar_verl.core.methods.gradient import sequence_seeds
    from oar_verl.core.methods.mask_operator import resample_ids

    batch = make(make_batch, B=3, seed=2)
    D = 4000
    draws = resample_tokens(batch, D, seed=1)
    r = batch.reasoning_mask
    assert torch.equal(draws[~r], batch.input_ids[~r][:, None].expand(-1, D))  # the row's own tokens elsewhere
    b, t = (r.nonzero()[-1]).tolist()  # one reasoning position: empirical vs the row's reasoning-token marginal
    own = batch.input_ids[b, r[b]]
    assert own.unique().numel() > 2  # several tokens to draw from: the comparison has teeth
    p = torch.bincount(own, minlength=int(batch.input_ids.max()) + 1).double() / own.numel()
    freq = torch.bincount(draws[b, t], minlength=p.numel()).double() / D
    assert 0.5 * (freq - p).abs().sum() < 0.05
    alone = resample_tokens(sub_batch(batch, torch.tensor([b])), 64, seed=1)
    assert torch.equal(alone[0], draws[b, :, :64])  # a row's draws depend on neither the batch nor the other rows
    assert not torch.equal(resample_tokens(batch, 64, seed=2), draws[..., :64])  # but on the seed
    seeds = sequence_seeds(5, 0, torch.arange(3))  # the run's seeds, one draw: OAR-P's resample exactly
    assert torch.equal(resample_tokens(batch, 1, seeds=seeds)[..., 0], resample_ids(batch, seeds))


# ------------------------------------------------------------------------------------------------ report formulas
def curve_by_hand(model, batch, scores, ops, fractions, seed=0, draws=4):
    """(2, B, O, F) deletion curve: per row a Python sort, the top ⌈f·R⌉ removed, one operator at a time."""
    B, L = batch.input_ids.shape
    out = torch.zeros(2, B, len(ops), len(fractions), dtype=torch.float64)
    for fi, f in enumerate(fractions):
        removed = torch.zeros(B, L, dtype=torch.bool)
        for b in range(B):
            order = hand_ranking(scores, batch.reasoning_mask, b)
            removed[b, order[:math.ceil(round(f * len(order), 9))]] = True
        for oi, op in enumerate(ops):
            out[:, :, oi, fi] = outcome_shifts(model, batch, removed, op, mask_token_id=MASK, seed=seed,
                                               draws=draws)
    return out


OPS3 = ("token", "zero", "delete")


@pytest.fixture(scope="module")
def small_report(lm64, make_batch):
    batch = make(make_batch, B=5, seed=11, T=14)
    g = torch.Generator().manual_seed(0)
    scores = {"a": torch.rand(batch.input_ids.shape, generator=g, dtype=torch.float64),
              "b": torch.rand(batch.input_ids.shape, generator=g, dtype=torch.float64)}
    fr = (0.1, 0.2, 0.5)
    rep = fidelity_report(lm64, batch, scores, mask_token_id=MASK, operators=OPS3, fractions=fr,
                          random_rankings=3, limits=PassLimits(64), seed=3, resamples=500)
    return batch, scores, fr, rep


def test_aopc_and_naopc_formulas(lm64, small_report):
    batch, scores, fr, rep = small_report
    for name, s in scores.items():
        hand = curve_by_hand(lm64, batch, s, OPS3, fr)
        m = rep.methods[name]
        torch.testing.assert_close(m.curve, hand, equal_nan=True, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(m.aopc, hand.mean(-1).mean(-1), equal_nan=True)
    rand = torch.stack([curve_by_hand(lm64, batch, random_scores(batch, 3, j), OPS3, fr).mean(-1).mean(-1)
                        for j in range(3)]).mean(0)
    torch.testing.assert_close(rep.random_aopc, rand, equal_nan=True, rtol=1e-7, atol=1e-12)
    best = torch.maximum(rep.methods["a"].aopc, rep.methods["b"].aopc)
    torch.testing.assert_close(rep.best_aopc, best, equal_nan=True)
    for name in scores:
        a = rep.methods[name].aopc
        for i in range(2):
            for b in range(a.shape[1]):
                den = float(best[i, b] - rand[i, b])
                got = float(rep.methods[name].naopc[i, b])
                if math.isnan(den) or den <= 1e-9 * max(abs(float(best[i, b])), abs(float(rand[i, b]))) + 1e-12:
                    assert math.isnan(got)
                else:
                    assert got == pytest.approx((float(a[i, b]) - float(rand[i, b])) / den, rel=1e-9)


def test_best_candidate_has_naopc_one(small_report):
    _, _, _, rep = small_report
    stacked = torch.stack([rep.methods[n].naopc for n in ("a", "b")])  # (2 methods, 2 measures, B)
    ok = ~torch.isnan(stacked)
    assert ok.any()
    assert (stacked[ok] <= 1 + 1e-12).all()
    for i in range(2):
        for b in range(stacked.shape[-1]):
            winner = stacked[int(rep.best[i, b]), i, b]
            assert math.isnan(float(winner)) or float(winner) == pytest.approx(1.0)


def test_the_positional_control_removes_the_latest_reasoning_tokens(make_batch):
    batch = make(make_batch)
    reasoning = batch.reasoning_mask.bool()
    scores = position_scores(batch)
    assert (scores[~reasoning] == 0).all()
    for b in range(reasoning.shape[0]):  # the latest first, by hand
        cols = [c for c in range(reasoning.shape[1]) if reasoning[b, c]]
        assert hand_ranking(scores, reasoning, b) == cols[::-1]
    removed = top_removal(ranks_from_scores(scores, reasoning), reasoning, 0.2)
    for b in range(reasoning.shape[0]):
        cols = [c for c in range(reasoning.shape[1]) if reasoning[b, c]]
        k = int(removal_count(0.2, torch.tensor(len(cols))))
        assert removed[b].nonzero().squeeze(1).tolist() == sorted(cols[len(cols) - k:])


def test_removal_counts_are_exact_ceilings():
    from fractions import Fraction
    R = torch.arange(0, 400)
    rounding = 0
    for f in (*FRACTIONS, 0.07, 0.14, 0.28, 0.3, 0.4, 0.7):
        want = [math.ceil(Fraction(str(f)) * r) for r in range(400)]
        assert removal_count(f, R).tolist() == want, f
        rounding += sum(math.ceil(f * r) != w for r, w in enumerate(want))
    assert rounding > 0  # some f·R round above an integer in floating point: the test has teeth


def test_naopc_degenerate_denominator_is_nan():
    got = naopc(torch.tensor([0.3, 0.2, 0.5]), torch.tensor([0.1, 0.4, 0.1]), torch.tensor([0.5, 0.4, 0.1]))
    assert got[0] == pytest.approx(0.5) and math.isnan(got[1]) and math.isnan(got[2])
    got = naopc(torch.tensor([2e-6, 2e-6]), torch.tensor([0.0, 0.0]), torch.tensor([4e-6, 4e-7]), min_gap=1e-6)
    assert got[0] == pytest.approx(0.5) and math.isnan(got[1])  # a gap below the noise floor is no denominator
    assert math.isnan(float(naopc(torch.tensor([0.0]), torch.tensor([float("nan")]), torch.tensor([1.0]))[0]))
    assert math.isnan(float(suppression_ratio(torch.tensor([1e-7]), torch.tensor([1e-7]), min_gap=1e-6)[0]))


def test_leave_one_out_mask_ranking_is_the_best_at_one_token(lm64, make_batch):
    batch = make(make_batch, B=4, seed=8)
    R = batch.reasoning_mask.sum(-1)
    assert (R >= 2).all() and (R < 100).all()  # f = 1 % covers exactly one token on every row
    loo = leave_one_out_scores(lm64, batch, "token", mask_token_id=MASK)
    # the LOO scores are the shift of each token alone, by hand
    for b in range(4):
        for c in hand_ranking(loo, batch.reasoning_mask, b)[:2]:
            assert float(loo[b, c]) == pytest.approx(naive_shift(lm64, batch, b, {c}, "token")[0], rel=1e-6)
    g = torch.Generator().manual_seed(1)
    scores = {"loo_copy": loo.clone(), "noise": torch.rand(loo.shape, generator=g, dtype=torch.float64),
              "anti": -loo}
    rep = fidelity_report(lm64, batch, scores, mask_token_id=MASK, operators=("token",), fractions=(0.01,),
                          candidates={"loo": loo}, random_rankings=4, seed=0, resamples=200)
    top = rep.methods["loo_copy"].aopc[0]
    for name in ("noise", "anti"):
        assert (rep.methods[name].aopc[0] <= top + 1e-12).all()
    assert (top >= rep.random_aopc[0] - 1e-12).all()
    assert (rep.methods["anti"].aopc[0] < top).any()
    torch.testing.assert_close(rep.best_aopc[0], top)
    defined = ~torch.isnan(rep.methods["loo_copy"].naopc[0])
    assert defined.any()
    torch.testing.assert_close(rep.methods["loo_copy"].naopc[0][defined],
                               torch.ones(int(defined.sum()), dtype=torch.float64))


def test_suppression_and_mass_on_target_by_hand(lm64, small_report):
    batch, scores, fr, rep = small_report
    B, L = batch.input_ids.shape
    r = batch.reasoning_mask
    rand_top = torch.zeros(3, B, L, dtype=torch.bool)
    for j in range(3):
        rs = random_scores(batch, 3, j)
        for b in range(B):
            order = hand_ranking(rs, r, b)
            rand_top[j, b, order[:math.ceil(round(0.4 * len(order), 9))]] = True
    rand_shift = torch.stack([torch.stack([outcome_shifts(lm64, batch, rand_top[j], op, mask_token_id=MASK)
                                           for op in OPS3]).mean(0) for j in range(3)]).mean(0)
    torch.testing.assert_close(rep.random_shift, rand_shift, equal_nan=True, rtol=1e-7, atol=1e-12)
    for name, s in scores.items():
        bottom = torch.zeros(B, L, dtype=torch.bool)
        for b in range(B):
            order = hand_ranking(s, r, b)
            k = math.ceil(round(0.4 * len(order), 9))
            bottom[b, order[len(order) - k:]] = True
        shift = torch.stack([outcome_shifts(lm64, batch, bottom, op, mask_token_id=MASK) for op in OPS3]).mean(0)
        # S is undefined (NaN) where the random removal did not move the outcome (e.g. a negative log p drop)
        want = torch.where(rand_shift > 1e-12 + 1e-9 * rand_shift.abs(), shift / rand_shift, float("nan"))
        torch.testing.assert_close(rep.methods[name].suppression, want, equal_nan=True, rtol=1e-6, atol=1e-12)
        assert (~torch.isnan(want)).sum() >= 6  # mostly defined: the check is not vacuous
        # mass: the per-sequence reference gate, the best candidate's top 20 % by hand
        for b in range(B):
            cols = [c for c in range(L) if r[b, c]]
            w = reference.token_weights(s[b, cols], 0.4, 2.0, 0.1)
            best = scores[rep.candidates[int(rep.best[0, b])]]
            order = hand_ranking(best, r, b)
            target = set(order[:math.ceil(round(0.2 * len(order), 9))])
            want = sum(float(w[i]) for i, c in enumerate(cols) if c in target) / float(w.sum())
            assert float(rep.methods[name].mass[b]) == pytest.approx(want, rel=1e-5)


def test_bootstrap_intervals(small_report):
    _, _, _, rep = small_report
    for key, iv in rep.summary.items():
        if iv.rows and not math.isnan(iv.mean):  # (a ratio of sums is NaN where its Σ denominator is not positive)
            assert iv.lo - 1e-12 <= iv.mean <= iv.hi + 1e-12, key
        elif iv.rows:
            assert "gain_over_" in key and math.isnan(iv.lo) and math.isnan(iv.hi), key
    same = rep.difference("a", "a", "naopc")
    assert same.mean == 0 and same.lo == 0 and same.hi == 0
    diff = rep.difference("a", "b", "aopc")
    want = float((rep.methods["a"].aopc[0] - rep.methods["b"].aopc[0]).mean())
    assert diff.mean == pytest.approx(want) and diff.lo <= diff.mean <= diff.hi
    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0, 5.0, 3.0]])
    iv = bootstrap_mean(x, resamples=2000, seed=0)[0]
    assert iv.mean == pytest.approx(3.0) and iv.rows == 5 and iv.undefined == 1 and 1.0 < iv.lo < 3 < iv.hi < 5.0
    assert bootstrap_mean(x, resamples=2000, seed=0)[0] == iv  # seeded
    m = rep.metrics()
    assert m["oar/fidelity/a/naopc"] == rep.summary["a/naopc"].mean
    assert {"oar/fidelity/b/mass_lo", "oar/fidelity/a/suppression_logp_undefined", "oar/fidelity/forwards",
            "oar/fidelity/a/gain_over_random_dropped"} <= set(m)
    assert all(isinstance(v, float) for v in m.values())


# ------------------------------------------------------------------------------------------------ invariants
@pytest.fixture(scope="module")
def full_report(lm64, make_batch):
    batch = make(make_batch, B=5, seed=21, T=10)
    scores = {"m": torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)}
    kw = dict(mask_token_id=MASK, operators=OPERATORS, fractions=(0.2, 0.5), random_rankings=2, draws=4, seed=5,
              resamples=100)
    return batch, scores, kw, fidelity_report(lm64, batch, scores, limits=PassLimits(10**6), **kw)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True), tokens=st.integers(8, 200))
def test_a_rows_numbers_do_not_depend_on_other_rows_or_the_budget(lm64, full_report, rows, tokens):
    batch, scores, kw, full = full_report
    idx = torch.tensor(sorted(rows))
    part = fidelity_report(lm64, sub_batch(batch, idx), {k: v[idx] for k, v in scores.items()},
                           limits=PassLimits(tokens), **kw)
    a, b = full.methods["m"], part.methods["m"]
    for x, y in ((a.curve[:, idx], b.curve), (a.naopc[:, idx], b.naopc), (a.suppression[:, idx], b.suppression),
                 (a.mass[idx], b.mass), (full.random_aopc[:, idx], part.random_aopc)):
        torch.testing.assert_close(x, y, equal_nan=True, rtol=1e-7, atol=1e-12)


def test_model_left_as_found_and_errors(lm64, make_batch):
    batch = make(make_batch, B=2, seed=1)
    scores = {"m": torch.rand(batch.input_ids.shape, dtype=torch.float64)}
    lm64.train()
    lm64.model.layers[0].eval()  # a mixed state must come back as it was
    before = {n: p.clone() for n, p in lm64.named_parameters()}
    flags = [m.training for m in lm64.modules()]
    try:
        fidelity_report(lm64, batch, scores, mask_token_id=MASK, fractions=(0.5,), random_rankings=1, draws=1,
                        resamples=10)
        assert [m.training for m in lm64.modules()] == flags
        assert not lm64.get_input_embeddings()._forward_hooks
        assert all(torch.equal(p, before[n]) and p.grad is None for n, p in lm64.named_parameters())
    finally:
        lm64.eval()
    with pytest.raises(ValueError, match="allowed: mean, zero, resample, pad, token, delete"):
        fidelity_report(lm64, batch, scores, mask_token_id=MASK, operators=("mean", "blur"))
    with pytest.raises(ValueError, match="'mask' is now 'token'"):  # the old name says its new one
        fidelity_report(lm64, batch, scores, mask_token_id=MASK, operators=("mask", "zero"))
    with pytest.raises(ValueError, match="mask_token_id"):
        fidelity_report(lm64, batch, scores, operators=("token", "zero"))
    with pytest.raises(ValueError, match="draws"):
        fidelity_report(lm64, batch, scores, operators=("resample",), draws=0)
    assert "token" not in DEFAULT_OPERATORS and "pad" not in DEFAULT_OPERATORS  # the default needs no mask token
    with pytest.raises(ValueError, match="shape"):
        fidelity_report(lm64, batch, {"m": scores["m"][:, :3]}, operators=("zero",))
    rep = fidelity_report(lm64, batch, {"m": scores["m"][:, batch.response_start:]}, operators=("zero",),
                          fractions=(0.5,), random_rankings=1, resamples=10)  # response-aligned scores work
    assert rep.methods["m"].curve.shape == (2, 2, 1, 1)


# ------------------------------------------------------------------------------------------------ gain over a control
CHEAP = dict(mask_token_id=MASK, operators=("token",), fractions=(0.2, 0.5), random_rankings=4, seed=2,
             resamples=300)


@pytest.fixture(scope="module")
def one_and_three(lm64, make_batch):
    batch = make(make_batch, B=5, seed=31, T=14)
    g = torch.Generator().manual_seed(7)
    scores = {k: torch.rand(batch.input_ids.shape, generator=g, dtype=torch.float64) for k in ("a", "b", "c")}
    one = fidelity_report(lm64, batch, {"a": scores["a"]}, **CHEAP)
    three = fidelity_report(lm64, batch, scores, **CHEAP)
    return batch, scores, one, three


def test_a_methods_gain_does_not_depend_on_the_other_methods(one_and_three):
    """(a) candidate independence: the gain over every control is the same with 1 or 3 methods; NAOPC is not, and the
    report names the candidate set it is relative to."""
    _, _, one, three = one_and_three
    assert one.controls == three.controls == ("random", "position", "entropy")
    a1, a3 = one.methods["a"], three.methods["a"]
    assert set(a1.gain_over) == {f"{c}{s}" for c in one.controls for s in ("", "_logp")}
    for key in a1.gain_over:
        for x, y in ((a1.gain_over[key], a3.gain_over[key]), (a1.mean_gain_over[key], a3.mean_gain_over[key])):
            for f in ("mean", "lo", "hi"):
                u, v = getattr(x, f), getattr(y, f)
                assert (math.isnan(u) and math.isnan(v)) or u == pytest.approx(v, rel=1e-9, abs=1e-12), (key, f)
            assert (x.rows, x.undefined) == (y.rows, y.undefined)
        assert one.summary[f"a/gain_over_{key}"] == a1.gain_over[key]
    for c in one.controls:
        torch.testing.assert_close(a1.gain[c], a3.gain[c], equal_nan=True, rtol=1e-9, atol=1e-12)
    kl = [a1.gain_over[c] for c in one.controls]
    assert all(not math.isnan(iv.mean) for iv in kl)  # defined: the comparison has teeth
    # NAOPC depends on the candidates: alone, "a" wins every row (1 by construction); beside b and c it does not
    assert one.naopc_candidates == ("a",) and three.naopc_candidates == ("a", "b", "c")
    ok1 = ~a1.naopc[0].isnan()
    assert ok1.any() and torch.allclose(a1.naopc[0][ok1], torch.ones(int(ok1.sum()), dtype=torch.float64))
    assert (a3.naopc[0][~a3.naopc[0].isnan()] < 1 - 1e-9).any()
    table = three.table()
    assert "against the best of: a, b, c" in table and "gain over entropy" in table
    m = three.metrics()
    assert m["oar/fidelity/naopc_candidates"] == 3.0 and "oar/fidelity/a/gain_over_position_lo" in m


def test_the_controls_aopc_by_hand(lm64, one_and_three):
    """(c) the report's position and entropy controls are the deletion curves of position_scores and entropy_scores
    ranked by hand; random is the mean of the J random rankings."""
    from oar_verl.core.fidelity import entropy_scores

    batch, _, one, _ = one_and_three
    fr = CHEAP["fractions"]
    for name, s in (("position", position_scores(batch)), ("entropy", entropy_scores(lm64, batch))):
        hand = curve_by_hand(lm64, batch, s, ("token",), fr).mean(-1).mean(-1)
        torch.testing.assert_close(one.control_aopc[name], hand, equal_nan=True, rtol=1e-7, atol=1e-12)
    assert one.control_aopc["random"] is one.random_aopc
    assert not torch.allclose(one.control_aopc["position"], one.control_aopc["entropy"])  # two different rankings
    got = one.methods["a"].gain["position"]
    torch.testing.assert_close(got, one.methods["a"].aopc - one.control_aopc["position"], equal_nan=True)


def test_no_row_is_dropped_for_its_result(lm64, make_batch):
    """(b) a planted row where nothing moves (one reasoning token, removed by ``resample``, which can only draw that
    token back) is counted in rows_static and stays in the sums, as do rows where the method loses to its control:
    the ratio is Σ gain / Σ AOPC_control over every row, the mean gain Σ gain / (all rows)."""
    batch = make(make_batch, B=5, seed=41, T=14)
    r = batch.reasoning_mask.clone()
    first = r[0].nonzero()[0, 0]
    r[0] = False
    r[0, first] = True  # row 0: a single reasoning token
    batch = dataclasses.replace(batch, reasoning_mask=r)
    assert (r.sum(-1)[1:] >= 3).all()
    g = torch.Generator().manual_seed(3)
    scores = {"m": torch.rand(r.shape, generator=g, dtype=torch.float64)}
    rep = fidelity_report(lm64, batch, scores, operators=("resample",), draws=2, fractions=(0.2, 0.5),
                          random_rankings=4, seed=1, resamples=200, controls=("random", "position"))
    assert bool(rep.static[0, 0]) and not bool(rep.static[0, 1:].any())  # kl (logp: static where defined)
    assert bool(rep.static[1, 0]) or bool(rep.methods["m"].aopc[1, 0].isnan())
    met = rep.metrics()
    assert met["oar/fidelity/rows_static"] == 1.0
    m = rep.methods["m"]
    lost = False
    for c in ("random", "position"):
        for i, sfx in ((0, ""), (1, "_logp")):
            gain, ctrl = m.gain[c][i], rep.control_aopc[c][i]
            ok = ~(gain.isnan() | ctrl.isnan())
            if i == 0:
                assert bool(ok.all())  # every row counts under kl, the static one included
                lost |= bool((gain < 0).any())
            iv, mean = m.gain_over[c + sfx], m.mean_gain_over[c + sfx]
            assert iv.rows == int(ok.sum()) and mean.rows == int(ok.sum())
            want = float(gain[ok].sum() / ctrl[ok].sum())
            if float(ctrl[ok].sum()) > 1e-12 * int(ok.sum()):
                assert iv.mean == pytest.approx(want, rel=1e-12)
            assert mean.mean == pytest.approx(float(gain[ok].sum()) / int(ok.sum()), rel=1e-12)
            if i == 0:  # dropping the static row would divide by one row less
                assert mean.mean != pytest.approx(float(gain[ok][1:].sum()) / (int(ok.sum()) - 1), rel=1e-6)
    assert lost  # a row where the method loses to a control: kept


def test_a_cluster_bootstrap_in_the_report(lm64, one_and_three):
    """(d) groups= reaches every interval: one cluster collapses each interval to its point estimate."""
    batch, scores, _, _ = one_and_three
    B = batch.input_ids.shape[0]
    rep = fidelity_report(lm64, batch, {"a": scores["a"]}, groups=torch.zeros(B, dtype=torch.long),
                          **{**CHEAP, "operators": ("zero",)})
    assert rep.clusters == 1
    for key, iv in rep.summary.items():
        if not math.isnan(iv.mean):
            assert iv.lo == iv.mean == iv.hi, key
    with pytest.raises(ValueError, match="groups"):
        fidelity_report(lm64, batch, {"a": scores["a"]}, groups=torch.zeros(B + 1, dtype=torch.long), **CHEAP)
    with pytest.raises(ValueError, match="controls='recency' is not a registered fidelity control; registered: "):
        fidelity_report(lm64, batch, {"a": scores["a"]}, controls=("random", "recency"), **CHEAP)
    with pytest.raises(ValueError, match="entropy"):
        fidelity_report(lm64, batch, {"a": scores["a"]}, controls=("random",), entropy=scores["b"], **CHEAP)
