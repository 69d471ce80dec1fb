"""Segment-level and hierarchical OAR-P against the per-sequence float64 references of devtools.reference, and
the policy's invariants (fully refined = exact, budget invariance, rank alignment, what ran)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.core import OARConfig
from devtools import reference
from oar_verl.core.methods.attribution import module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.policies import policy_importance, refined_segments, segment_table, spread_segment_scores
from oar_verl.core.batch.layout import build_attribution_batch, with_segments
from oar_verl.core.batch.probes import ProbeKind
from oar_helpers import run_p

MASK = 0
LT_LOGITS, AS_MEAN, AS_JOINT = ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT


def random_segments(reasoning: torch.Tensor, max_len: int, seed: int) -> torch.Tensor:
    """(B, T) long: the reasoning of every row cut into consecutive segments of 1..max_len tokens, -1 off."""
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(reasoning.shape, generator=g) < 1.0 / max_len) & reasoning
    starts[:, 0] = reasoning[:, 0]
    rank = reasoning.long().cumsum(-1) - 1
    forced = reasoning & (rank % max_len == 0)  # no segment longer than max_len
    ids = (starts | forced).long().cumsum(-1) - 1
    return torch.where(reasoning, ids, -1)


def row_lists(rows, segments, b):
    """Row b's ids, reasoning and answer positions, prompt length and segments (lists of positions)."""
    ids, reasoning, answer, p = reference._row(*rows, b)
    n = int(rows[3][b].sum())
    seg = segments[b, :n]
    groups = [[p + int(i) for i in (seg == k).nonzero().squeeze(1)] for k in range(int(seg.max()) + 1)] \
        if (seg >= 0).any() else []
    return ids, reasoning, answer, p, [g for g in groups if g]


def naive(model, rows, segments, kind, policy, share=0.3):
    out = torch.zeros(rows[2].shape, dtype=torch.float64)
    for b in range(rows[2].shape[0]):
        ids, reasoning, answer, p, segs = row_lists(rows, segments, b)
        if policy == "segment":
            scores = reference.oar_p_segments(model, ids, reasoning, answer, kind, MASK, segs)
        else:
            scores = reference.oar_p_hierarchical(model, ids, reasoning, answer, kind, MASK, segs, share)
        out[b, : len(ids) - p] = scores[p:]
    return out


def make(make_batch, kind, seed, B=4, P=5, T=12, max_len=4):
    rows = make_batch(B=B, P=P, T=T, seed=seed)
    segments = random_segments(rows[4], max_len, seed)
    batch = with_segments(build_attribution_batch(*rows, torch.full((B,), kind)), segments)
    return rows, segments, batch


def fast(model, batch, policy, prefix_cache=True, share=0.3, limits=None, exact_max_tokens=0, align=None):
    cfg = OARConfig(mode="perturbation", perturbation=policy, refine_share=share, prefix_cache=prefix_cache,
                    exact_max_tokens=exact_max_tokens, mask="pad")  # the token MASK, as the references
    backend = module_backend(model, cfg, limits=limits or PassLimits(10**6, copies=3), align=align)
    return run_attribution(backend, batch, cfg, mask_token_id=MASK)


@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("policy", ["segment", "hierarchical"])
def test_policy_matches_naive_reference(lm64, make_batch, kind, prefix_cache, policy):
    rows, segments, batch = make(make_batch, kind, seed=int(kind) * 7 + prefix_cache)
    got = fast(lm64, batch, policy, prefix_cache).importance[:, batch.response_start:]
    want = naive(lm64, rows, segments, kind, policy)
    assert (got[~rows[4]] == 0).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)
    assert want.abs().sum() > 0  # not vacuous


@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
def test_every_segment_refined_is_exact_oar_p(lm64, make_batch, kind):
    _, _, batch = make(make_batch, kind, seed=11)
    got = fast(lm64, batch, "hierarchical", share=1.0)
    exact = run_p(lm64, batch, MASK, PassLimits(10**6, copies=3))
    torch.testing.assert_close(got.importance, exact, rtol=1e-6, atol=1e-10)
    assert torch.equal(got.refined, batch.reasoning_mask.sum(-1))  # every token scored at token level


def test_auto_is_exact_on_short_rows_and_hierarchical_on_long_ones(lm64, make_batch):
    rows, segments, batch = make(make_batch, AS_MEAN, seed=5, B=6, T=14)
    reasoning = batch.reasoning_mask.sum(-1)
    threshold = int(reasoning.median())
    got = fast(lm64, batch, "auto", exact_max_tokens=threshold, share=0.3).importance
    exact = run_p(lm64, batch, MASK, PassLimits(10**6))
    hier = fast(lm64, batch, "hierarchical", share=0.3).importance
    short = reasoning <= threshold
    assert short.any() and (~short).any()
    torch.testing.assert_close(got[short], exact[short], rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(got[~short], hier[~short], rtol=1e-6, atol=1e-10)


def test_what_ran_is_counted(lm64, make_batch):
    _, segments, batch = make(make_batch, AS_MEAN, seed=3)
    res = fast(lm64, batch, "hierarchical", share=0.3)
    n_segments = (segments.max(-1).values + 1).clamp(min=0)
    assert torch.equal(res.copies, n_segments + res.refined)
    assert bool((res.refined <= res.reasoning).all()) and bool((res.refined[res.reasoning > 0] > 0).all())
    seg = fast(lm64, batch, "segment")
    assert torch.equal(seg.copies, n_segments) and int(seg.refined.sum()) == 0


@pytest.mark.parametrize("tokens,copies", [(40, 1), (64, 2), (10**6, None)])
def test_budget_invariance(lm64, make_batch, tokens, copies):
    _, _, batch = make(make_batch, AS_JOINT, seed=9)
    want = fast(lm64, batch, "hierarchical", limits=PassLimits(10**6)).importance
    got = fast(lm64, batch, "hierarchical", limits=PassLimits(tokens, copies=copies)).importance
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-10)


def test_ranks_align_level_by_level(lm64, make_batch):
    """``align`` is asked once per level with this rank's rounds; the extra (filler) rounds change nothing."""
    _, _, batch = make(make_batch, AS_MEAN, seed=4)
    asked = []
    res = fast(lm64, batch, "hierarchical", align=lambda n: asked.append(n) or n + 3)
    plain = fast(lm64, batch, "hierarchical")
    assert len(asked) == 2 and sum(asked) == res.passes
    torch.testing.assert_close(res.importance, plain.importance, rtol=0, atol=0)


def test_rows_without_reasoning_or_segments(lm64, make_batch):
    rows, _, _ = make(make_batch, AS_MEAN, seed=1)
    segments = torch.full(rows[2].shape, -1)
    batch = with_segments(build_attribution_batch(*rows, torch.full((4,), AS_MEAN)), segments)
    res = fast(lm64, batch, "hierarchical")
    assert (res.importance == 0).all() and int(res.copies.sum()) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.integers(1, 9)), max_size=8), min_size=1,
                max_size=4), st.floats(0.01, 1.0))
def test_refined_segments_cover_the_share_with_the_top_segments(table, share):
    S = max(len(r) for r in table)
    scores = torch.zeros(len(table), S, dtype=torch.float64)
    lengths = torch.zeros(len(table), S, dtype=torch.long)
    for b, row in enumerate(table):
        for k, (s, n) in enumerate(row):
            scores[b, k], lengths[b, k] = s, n
    pick = refined_segments(scores, lengths, share)
    for b, row in enumerate(table):
        total = int(lengths[b].sum())
        chosen = pick[b, : len(row)]
        assert not pick[b, len(row):].any()
        if not row:
            continue
        lens, sc = lengths[b, : len(row)], scores[b, : len(row)]
        covered = int(lens[chosen].sum())
        assert covered >= share * total - 1e-9  # the share is covered
        # ... by the top segments: every refined segment scores at least as high as every other one
        if (~chosen).any():
            assert float(sc[chosen].min()) >= float(sc[~chosen].max())
        # and minimally: without the last refined segment in rank order (score, then position) it would not be
        ranked = sorted((k for k in range(len(row)) if chosen[k]), key=lambda k: (-row[k][0], k))
        assert covered - row[ranked[-1]][1] < share * total
    if share == 1.0:
        assert bool((pick == (lengths > 0)).all())


def test_segment_table_and_spread():
    segments = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 1, 2, -1, -1]])
    scores = torch.tensor([[2.0, 2.0, 3.0, 3.0, 3.0, 0.0], [1.0, 4.0, 4.0, 5.0, 0.0, 0.0]])
    table, lengths = segment_table(scores, segments)
    assert lengths.tolist() == [[2, 3, 0], [1, 2, 1]]
    assert table.tolist() == [[2.0, 3.0, 0.0], [1.0, 4.0, 5.0]]
    spread = spread_segment_scores(scores, segments)
    assert spread.tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 2.0, 2.0, 5.0, 0.0, 0.0]]
    # a segment's tokens carry its score in total
    assert torch.allclose(spread.sum(-1), table.sum(-1))


def test_policy_needs_segments_and_a_known_name():
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="segments"):
        policy_importance(lambda b: torch.zeros(1, 3), mask, None, "hierarchical")
    with pytest.raises(ValueError, match=r"algorithm\.oar\.perturbation='fast' is not a registered perturbation "
                                         r"policy; registered: auto, exact, hierarchical, segment"):
        policy_importance(lambda b: torch.zeros(1, 3), mask, None, "fast")


def test_the_policies_are_a_registry_whose_facts_the_layers_read():
    """Registration order is the listed order; only exact takes mask_span blocks; the segment-level policies read
    segments, and the perturbation method asks the registry whether a configuration needs them."""
    from oar_verl.core.methods.contract import METHODS
    from oar_verl.core.methods.policies import POLICIES

    assert POLICIES.names() == ("exact", "segment", "hierarchical", "auto")
    assert [n for n in POLICIES.names() if POLICIES.get(n).mask_span] == ["exact"]
    assert [n for n in POLICIES.names() if POLICIES.get(n).segments] == ["segment", "hierarchical", "auto"]
    needs = METHODS.get("perturbation").segments
    cfgs = [OARConfig(mode="perturbation", perturbation=n) for n in POLICIES.names()]
    assert [needs(cfg) for cfg in cfgs] == [False, True, True, True]


def test_a_registered_policy_runs_without_any_other_change():
    """A policy registered under a new name is dispatched by policy_importance and accepted by the start-up check:
    nothing else names the policies."""
    from oar_verl.core.checks.startup import check_config
    from oar_verl.core.methods.policies import POLICIES, PolicyResult, register_policy

    @register_policy("test_first_only", segments=False)
    def first_only(run_blocks, reasoning_mask, segments, options):  # one copy: the row's first reasoning token
        first = reasoning_mask & (reasoning_mask.long().cumsum(-1) == 1)
        blocks = torch.where(first, 0, -1)
        reasoning = reasoning_mask.sum(-1)
        return PolicyResult(run_blocks(blocks), first.sum(-1), first.sum(-1), reasoning)

    try:
        mask = torch.tensor([[False, True, True], [True, True, False]])
        res = policy_importance(lambda b: (b >= 0).float() * 2.0, mask, None, "test_first_only")
        assert res.importance.tolist() == [[0.0, 2.0, 0.0], [2.0, 0.0, 0.0]] and res.copies.tolist() == [1, 1]
        check_config(OARConfig(mode="perturbation", perturbation="test_first_only"))
    finally:
        POLICIES.unregister("test_first_only")
    with pytest.raises(ValueError, match="not a registered perturbation policy"):
        policy_importance(lambda b: b.float(), mask, None, "test_first_only")
