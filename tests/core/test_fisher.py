"""Second-order attribution patching of the masking shift (oar_verl.core.methods.fisher) against its float64 per-sequence
reference, and the reference against the quantity it approximates: the masking KL's second-order term."""

from __future__ import annotations

import pytest
import torch

from devtools import reference
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.fisher import fisher
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.batch.probes import ProbeKind

MASK = 0


@pytest.mark.parametrize("kind", [ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT])
@pytest.mark.parametrize("tokens", [10**6, 24])  # one pass for everything; one row (or draw row) per pass
@pytest.mark.parametrize("shared", [True, False])  # one forward, K backwards; or K draw rows (Megatron's plan)
def test_fisher_matches_the_per_sequence_reference(lm64, make_batch, kind, tokens, shared):
    rows = make_batch(B=4, P=4, T=9, seed=3)
    batch = build_attribution_batch(*rows, torch.full((4,), int(kind)))
    backend = ModuleBackend(lm64, PassLimits(tokens))
    backend.shared_backwards = shared
    got, rounds = fisher(backend, batch, MASK, outcomes=3)
    ref = reference.batch_fisher(lm64, *rows, kind, MASK, 3)
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6, atol=1e-12)
    assert bool((ref != 0).sum() > 10)
    assert bool((got[~batch.reasoning_mask] == 0).all())
    assert (rounds == 1) == (tokens > 10**5)  # the small budget spreads the rows over several passes
    # K outcomes share their row's pass (rows packed), or take one draw row each (12 draw rows packed; an AS-Joint
    # row, whose one loss is φ, takes one draw row)
    row_passes = len(backend.plan(batch, torch.arange(4), PassKind.INPUT_GRADIENT))
    draws = torch.where(batch.probe.joint, 1, 3)
    draw_passes = len(backend.plan(batch, torch.arange(4).repeat_interleave(draws), PassKind.INPUT_GRADIENT))
    assert rounds == (row_passes if shared else draw_passes)
    assert row_passes < draw_passes or tokens > 10**5 or kind == ProbeKind.AS_JOINT


def test_the_quadratic_form_is_the_masking_kl_at_second_order(lm64, make_batch):
    """With every outcome kept (K = V) the score is ½ δᵀJᵀFJδ exactly: KL(P_clean ‖ P(e_t + εδ_t)) / ε² tends to it."""
    rows = make_batch(B=1, P=3, T=8, seed=7)
    ids, reasoning, answer, _ = reference._row(*rows, 0)
    kind = ProbeKind.AS_MEAN
    V = lm64.config.vocab_size
    scores = reference.fisher(lm64, ids, reasoning, answer, kind, MASK, V)
    embed = lm64.get_input_embeddings()
    with torch.no_grad():
        e = embed(ids[None])
        clean = reference.outcome(lm64(inputs_embeds=e).logits[0], ids, kind, reasoning, answer)
        for t in reasoning[:3]:
            delta = embed(torch.tensor([[MASK]]))[0, 0] - e[0, t]
            eps = 1e-3
            moved = e.clone()
            moved[0, t] += eps * delta
            kl = reference.shift(clean, reference.outcome(lm64(inputs_embeds=moved).logits[0], ids, kind, reasoning,
                                                          answer))
            assert float(kl) / eps**2 == pytest.approx(float(scores[t]), rel=1e-2)


def test_fisher_is_budget_and_batch_composition_invariant(lm64, make_batch):
    rows = make_batch(B=5, P=4, T=8, seed=11)
    batch = build_attribution_batch(*rows, torch.full((5,), int(ProbeKind.AS_MEAN)))
    whole, _ = fisher(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, outcomes=4)
    sub = build_attribution_batch(*(r[[1, 3]] for r in rows), torch.full((2,), int(ProbeKind.AS_MEAN)))
    part, _ = fisher(ModuleBackend(lm64, PassLimits(20, rows=1)), sub, MASK, outcomes=4)
    scale = float(whole.abs().max())
    torch.testing.assert_close(part[:, sub.response_start:], whole[[1, 3], batch.response_start:], rtol=1e-6,
                               atol=1e-9 * scale)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_forward_and_k_backwards_equal_k_backward_passes(lm64, make_batch, checkpointing):
    """The backend interface lets a method take several backwards from one forward (``EmbeddingHook.outputs``): each
    loss column's projection equals that of a pass with that loss alone, with and without checkpointed layers."""
    from oar_verl.core.backends.base import EmbeddingHook, Pass
    from oar_verl.core.methods.gradient import embedding_projection

    rows = make_batch(B=3, P=4, T=8, seed=2)
    batch = build_attribution_batch(*rows, torch.full((3,), int(ProbeKind.AS_MEAN)))
    backend = ModuleBackend(lm64, PassLimits(10**6), checkpointing=checkpointing)
    passes = [Pass(torch.arange(3))]

    def outcome(probe, k):
        return probe.log_prob(probe.top(2)[1][:, k])

    both = backend.run(batch, passes, lambda i, probe: torch.stack([outcome(probe, 0), outcome(probe, 1)], 1),
                       EmbeddingHook(embedding_projection, outputs=2))[0]
    assert both.shape == (3, 2, batch.input_ids.shape[1])
    for k in range(2):
        alone = backend.run(batch, passes, lambda i, probe: outcome(probe, k), EmbeddingHook(embedding_projection))[0]
        torch.testing.assert_close(both[:, k], alone, rtol=1e-10, atol=1e-12)
    assert not torch.equal(both[:, 0], both[:, 1])
    assert all(p.grad is None and p.requires_grad for p in lm64.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# the unbiased estimator: the top K exact, the rest of the vocabulary in S Rademacher sketches
# ---------------------------------------------------------------------------------------------------------------------


def _full_form(lm, rows, kind):
    """(B, T) the full-vocabulary Fisher form of every row, from the float64 Jacobian (reference.fisher_full)."""
    out = torch.zeros(rows[2].shape, dtype=torch.float64)
    for b in range(rows[2].shape[0]):
        ids, reasoning, answer, p = reference._row(*rows, b)
        out[b, : len(ids) - p] = reference.fisher_full(lm, ids, reasoning, answer, kind, MASK)[p:]
    return out


@pytest.mark.parametrize("kind", [ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN])
def test_all_outcomes_kept_is_the_full_form(lm64, make_batch, kind):
    """K = V: the truncated estimator is the full-vocabulary Fisher form (the Jacobian's, computed apart)."""
    rows = make_batch(B=2, P=3, T=8, seed=4)
    batch = build_attribution_batch(*rows, torch.full((2,), int(kind)))
    got, _ = fisher(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, outcomes=lm64.config.vocab_size)
    ref = _full_form(lm64, rows, kind)
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6, atol=1e-12)
    assert bool((ref != 0).sum() > 5)


@pytest.mark.parametrize("kind,outcomes,sketches,shared", [  # shared: K + S loss columns of one forward; else
    (ProbeKind.LT_LOGITS, 0, 3, True), (ProbeKind.LT_LOGITS, 1, 2, False),  # K + S draw rows (Megatron's plan)
    (ProbeKind.AS_MEAN, 3, 1, True), (ProbeKind.AS_MEAN, 0, 2, False), (ProbeKind.AS_JOINT, 2, 2, False)])
def test_sketches_match_the_reference_with_the_same_signs(lm64, make_batch, kind, outcomes, sketches, shared):
    """The engine's sketch losses (Σ_v s_v √sg(p_v) log p_v, one backward each) equal the reference's sketches of the
    Jacobian's rows with the same signs; AS-Joint rows keep their first-order score."""
    rows = make_batch(B=4, P=4, T=9, seed=3)
    batch = build_attribution_batch(*rows, torch.full((4,), int(kind)))
    backend = ModuleBackend(lm64, PassLimits(30))
    backend.shared_backwards = shared
    got, rounds = fisher(backend, batch, MASK, outcomes, sketches, seed=5)
    ref = reference.batch_fisher(lm64, *rows, kind, MASK, outcomes, sketches, seed=5)
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6, atol=1e-12)
    assert bool((ref != 0).sum() > 10)
    assert bool((got[~batch.reasoning_mask] == 0).all())
    # AS-Joint rows take one draw row (their φ), never K + S
    draws = torch.where(batch.probe.joint, 1, outcomes + sketches) if not shared else torch.ones(4, dtype=torch.long)
    assert rounds == len(backend.plan(batch, torch.arange(4).repeat_interleave(draws), PassKind.INPUT_GRADIENT))
    other = fisher(backend, batch, MASK, outcomes, sketches, seed=6)[0]
    joint = batch.probe.joint  # AS-Joint's rows without an answer span read LT-Logits
    assert torch.equal(other[joint], got[joint]) and not torch.equal(other[~joint], got[~joint])  # the seed moves
    # the sketched scores only


def test_the_sketch_is_unbiased_for_the_full_form(lm64, make_batch):
    """The sketched score's expectation over the signs is the full-vocabulary form, for K = 0 and K = 1. With S
    sketches its standard deviation is sd_t = ½ sqrt((2 (Σ a²)² − 2 Σ a⁴) / S) per token (a_v = √p_v ⟨∂ log p_v/∂e_t,
    δ_t⟩ over the sketched outcomes; reference.fisher_sketch_variance): S = 20000 sketches must land within 5 sd_t of
    the full form at every token (a deterministic seed; ~6e-7 two-sided per token for a Gaussian mean), and the
    truncated K = 1 sum must not (it misses the tail). The sketches are the reference's (the Jacobian's rows times the
    signs: S backwards of the engine would take minutes on CPU); the engine equals the reference with the same signs
    (test_sketches_match_the_reference_with_the_same_signs), checked here again at S = 64."""
    rows = make_batch(B=1, P=3, T=9, seed=12)
    kind = ProbeKind.AS_MEAN
    ids, reasoning, answer, _ = reference._row(*rows, 0)
    full = reference.fisher_full(lm64, ids, reasoning, answer, kind, MASK)[reasoning]
    S = 20000
    for K in (0, 1):
        got = reference.fisher(lm64, ids, reasoning, answer, kind, MASK, K, S, seed=1)[reasoning]
        sd = reference.fisher_sketch_variance(lm64, ids, reasoning, answer, kind, MASK, K, S)[reasoning].sqrt()
        assert bool(((got - full).abs() <= 5 * sd).all()), ((got - full) / sd)
        assert float(sd.max() / full.max()) < 0.03  # a test with teeth: the tolerance is a few % of the scores
    truncated = reference.fisher(lm64, ids, reasoning, answer, kind, MASK, 1)[reasoning]
    assert bool((truncated < full).all())  # a lower bound of the full form, strictly short of it here
    batch = build_attribution_batch(*rows, torch.full((1,), int(kind)))
    engine = fisher(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, 1, 64, seed=1)[0]
    torch.testing.assert_close(engine[:, batch.response_start:].double(),
                               reference.batch_fisher(lm64, *rows, kind, MASK, 1, 64, seed=1), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("outcomes,sketches", [(1, 0), (1, 4), (0, 8), (2, 3)])
def test_one_forward_and_k_plus_s_backwards(lm64, make_batch, outcomes, sketches, monkeypatch):
    """A pass is one forward of the model and K + S backwards (HF / Ulysses: ``shared_backwards``)."""
    rows = make_batch(B=3, P=4, T=8, seed=2)
    batch = build_attribution_batch(*rows, torch.full((3,), int(ProbeKind.AS_MEAN)))
    forwards, backwards = [], []
    handle = lm64.register_forward_hook(lambda *a: forwards.append(1))
    original = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: (backwards.append(1), original(self, *a,
                                                                                                       **k))[1])
    try:
        _, rounds = fisher(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, outcomes, sketches)
    finally:
        handle.remove()
    assert rounds == 1 and len(forwards) == 1 and len(backwards) == outcomes + sketches


def test_run_attribution_reads_the_sketch_keys(lm64, make_batch):
    from oar_verl.core import OARConfig, module_backend, run_attribution
    from oar_helpers import count_passes

    rows = make_batch(B=3, P=4, T=8, seed=9)
    batch = build_attribution_batch(*rows, torch.full((3,), int(ProbeKind.LT_LOGITS)))
    cfg = OARConfig(mode="fisher", fisher_outcomes=0, fisher_sketches=2, seed=3, max_token_len_per_gpu=10, mask="token",
                    mask_token_id=MASK)
    res = run_attribution(module_backend(lm64, cfg), batch, cfg, mask_token_id=MASK)
    want, rounds = fisher(ModuleBackend(lm64, PassLimits(10)), batch, MASK, 0, 2, seed=3)
    torch.testing.assert_close(res.importance, want, rtol=0, atol=0)
    assert res.passes == rounds == count_passes(batch, cfg, PassLimits(10))


def test_sketch_signs_do_not_depend_on_the_shard():
    from oar_verl.core.methods.fisher import sketch_signs

    whole = sketch_signs(7, 3, torch.arange(100))
    assert set(whole.unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(torch.cat([sketch_signs(7, 3, torch.arange(40)),
                                          sketch_signs(7, 3, torch.arange(40, 100))], 1), whole, rtol=0, atol=0)
    torch.testing.assert_close(sketch_signs(7, 2, torch.arange(100)), whole[:2], rtol=0, atol=0)
    assert not torch.equal(sketch_signs(8, 3, torch.arange(100)), whole)
    assert abs(float(sketch_signs(0, 64, torch.arange(1000)).mean())) < 0.01  # balanced
