"""Second-order attribution patching of the masking shift (oar_verl.core.fisher) against its float64 per-sequence
reference, and the reference against the quantity it approximates: the masking KL's second-order term."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import reference
from oar_verl.core.backend_hf import ModuleBackend
from oar_verl.core.budget import PassLimits
from oar_verl.core.fisher import fisher
from oar_verl.core.layout import build_attribution_batch
from oar_verl.core.memory import PassKind
from oar_verl.core.probes import ProbeKind

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
    # K outcomes share their row's pass (rows packed), or take one draw row each (12 draw rows packed)
    row_passes = len(backend.plan(batch, torch.arange(4), PassKind.INPUT_GRADIENT))
    draw_passes = len(backend.plan(batch, torch.arange(4).repeat_interleave(3), PassKind.INPUT_GRADIENT))
    assert rounds == (row_passes if shared else draw_passes)
    assert row_passes < draw_passes or tokens > 10**5


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
    from oar_verl.core.backend import EmbeddingHook, Pass
    from oar_verl.core.gradient import embedding_projection

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
