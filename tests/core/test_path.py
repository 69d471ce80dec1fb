"""``mode=path`` (oar_verl.core.methods.path): integrated gradients of the outcome shift along the run's mask path.
Completeness against the joint removal of every reasoning token, the backend against a per-row, per-point float64
autograd reference (devtools.reference.path), batch and budget invariance, the sign convention against fisher's
first-order AS-Joint score, the configuration and the cost (OAR-G's plan with K = M draws)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from devtools import reference
from oar_verl.core import OARConfig, attribute, module_backend, prepare_attribution, run_attribution
from oar_verl.core.backends.base import Replacement
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.checks.startup import check_config
from oar_verl.core.config import OARConfigError
from oar_verl.core.methods.contract import METHODS
from oar_verl.core.methods.fisher import fisher
from oar_verl.core.methods.mask_operator import mask_replacement
from oar_verl.core.methods.path import path_alphas, path_integrated
from oar_helpers import count_g

MASK = 0  # the token operator's id (make_batch draws its ids from 1..96, so no δ_t is 0)
KINDS = [ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT]


def replacement(backend, batch, mask: str | int):
    """The run's mask operator: ``mean`` / ``zero`` (embedding operators) or a token id (``token``)."""
    if isinstance(mask, int):
        return mask
    return mask_replacement(backend, batch, mask, None, None)


def batch_of(rows, kind):
    return build_attribution_batch(*rows, torch.full((rows[0].shape[0],), int(kind)))


def joint_removal(lm, rows, kind, mask) -> torch.Tensor:
    """(B,) float64 the shift of one forward with every reasoning embedding of a row set to e_mask, row by row."""
    out = torch.zeros(rows[0].shape[0], dtype=torch.float64)
    embed = lm.get_input_embeddings()
    for b in range(rows[0].shape[0]):
        ids, reasoning, answer, _ = reference._row(*rows, b)
        with torch.no_grad():
            e = embed(ids[None])
            clean = reference.outcome(lm(inputs_embeds=e).logits[0], ids, kind, reasoning, answer)
            removed = e.clone()
            removed[0, reasoning] = reference.mask_vector(lm, mask)
            out[b] = reference.shift(clean, reference.outcome(lm(inputs_embeds=removed).logits[0], ids, kind,
                                                              reasoning, answer))
    return out


@given(st.integers(1, 8))
@settings(max_examples=20, deadline=None)
def test_the_points_are_the_midpoints_of_m_equal_cells(points):
    a = path_alphas(points)
    assert a.shape == (points,) and bool((a > 0).all() and (a < 1).all())
    torch.testing.assert_close(a + a.flip(0), torch.ones(points, dtype=torch.float64))  # symmetric about ½
    torch.testing.assert_close(a.diff(), torch.full((points - 1,), 1.0 / points, dtype=torch.float64))


@pytest.mark.parametrize("kind", KINDS)
def test_completeness_the_scores_sum_to_the_joint_removal_shift(lm64, make_batch, kind):
    """Σ_t c_t (signed) → shift(α = 1) − shift(α = 0) = the shift of removing every reasoning token at once."""
    rows = make_batch(B=4, P=4, T=10, seed=5)
    batch = batch_of(rows, kind)
    got, passes = path_integrated(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, 64)
    want = joint_removal(lm64, rows, kind, MASK)
    assert passes == 1 and bool((want.abs() > 1e-12).all())
    torch.testing.assert_close(got.double().sum(-1), want, rtol=1e-3, atol=0.0)
    # a coarse sum is not that close: the test can fail (the midpoint rule converges as M grows)
    coarse, _ = path_integrated(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, 2)
    assert float(((coarse.double().sum(-1) - want) / want).abs().max()) > 1e-2


def test_one_point_is_the_midpoint_gradient_by_hand(lm64, make_batch):
    """M = 1: c_t = ⟨∂J/∂e_t at α = ½, e_mask − e_t⟩ with J the AS-Mean KL, by torch.autograd on one row."""
    rows = make_batch(B=1, P=3, T=9, seed=8)
    batch = batch_of(rows, ProbeKind.AS_MEAN)
    backend = ModuleBackend(lm64, PassLimits(10**6))
    got, _ = path_integrated(backend, batch, replacement(backend, batch, "mean"), 1)
    ids, reasoning, answer, p = reference._row(*rows, 0)
    embed = lm64.get_input_embeddings()
    e_mask = embed.weight.mean(0)  # Qwen2's embedding has no scale: its output is the table row
    with torch.no_grad():
        e = embed(ids[None])[0]
        clean = torch.log_softmax(torch.stack([lm64(ids[None]).logits[0, a - 1] for a in answer]).mean(0), -1)
    delta = torch.zeros_like(e)
    delta[reasoning] = e_mask - e[reasoning]
    x = (e + 0.5 * delta).detach().requires_grad_(True)
    logp = torch.log_softmax(torch.stack([lm64(inputs_embeds=x[None]).logits[0, a - 1] for a in answer]).mean(0), -1)
    kl = (clean.exp() * (clean - logp)).sum()
    (grad,) = torch.autograd.grad(kl, x)
    want = (grad * delta).sum(-1)  # (L,), 0 off the reasoning tokens
    start = batch.response_start - p  # the row's first column (left-padded prompt)
    torch.testing.assert_close(got[0, start:start + len(ids)].double(), want, rtol=1e-6, atol=1e-12)
    assert bool((want[reasoning] != 0).all())


CASES = [(kind, mask, tokens) for kind, mask, tokens in
         [(ProbeKind.LT_LOGITS, "mean", 10**6), (ProbeKind.LT_LOGITS, "zero", 24), (ProbeKind.LT_LOGITS, MASK, 10**6),
          (ProbeKind.AS_MEAN, "mean", 24), (ProbeKind.AS_MEAN, "zero", 10**6), (ProbeKind.AS_MEAN, MASK, 24),
          (ProbeKind.AS_JOINT, "mean", 10**6), (ProbeKind.AS_JOINT, "zero", 24), (ProbeKind.AS_JOINT, MASK, 10**6)]]


@pytest.mark.parametrize("kind,mask,tokens", CASES)
def test_path_matches_the_per_row_per_point_reference(lm64, make_batch, kind, mask, tokens):
    """Padded rows of different lengths, batched (one pass) or spread (a 24-token budget: a row's 3 points over
    several passes), against plain per-row autograd at each point; the importance is the clamped score."""
    rows = make_batch(B=4, P=4, T=9, seed=3)
    batch = batch_of(rows, kind)
    backend = ModuleBackend(lm64, PassLimits(tokens))
    got, passes = path_integrated(backend, batch, replacement(backend, batch, mask), 3)
    ref = reference.batch_path(lm64, *rows, kind, mask, 3)
    # float32 scores (the interface's), each point's rounded before the signed mean: an absolute floor at float32's
    # resolution of the largest score
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6,
                               atol=1e-7 * float(ref.abs().max()))
    assert bool((ref[rows[4]] != 0).all()) and bool((got[~batch.reasoning_mask] == 0).all())
    assert (passes == 1) == (tokens > 10**5)
    cfg = OARConfig(mode="path", path_points=3, **({"mask": mask} if isinstance(mask, str) else
                                                   {"mask": "token", "mask_token_id": mask}))
    result = run_attribution(module_backend(lm64, cfg, limits=PassLimits(tokens)), batch, cfg, mask_token_id=MASK)
    torch.testing.assert_close(result.importance, got.clamp(min=0.0), rtol=1e-6, atol=1e-12)
    assert bool((result.importance >= 0).all()) and result.passes == passes


def test_path_is_budget_and_batch_composition_invariant(lm64, make_batch):
    """A row's scores do not depend on the other rows of the batch, nor on how its points are spread over passes."""
    rows = make_batch(B=5, P=4, T=8, seed=11)
    batch = batch_of(rows, ProbeKind.AS_MEAN)
    whole, _ = path_integrated(ModuleBackend(lm64, PassLimits(10**6)), batch, MASK, 4)
    sub = batch_of(tuple(r[[1, 3]] for r in rows), ProbeKind.AS_MEAN)
    part, passes = path_integrated(ModuleBackend(lm64, PassLimits(20, rows=1)), sub, MASK, 4)
    assert passes == 8  # one point per pass
    torch.testing.assert_close(part[:, sub.response_start:], whole[[1, 3], batch.response_start:], rtol=1e-6,
                               atol=1e-9 * float(whole.abs().max()))


def test_one_point_has_fishers_first_order_sign_convention(lm64, make_batch):
    """On AS-Joint rows fisher's score is the first-order −⟨∂φ/∂e_t, e_mask − e_t⟩ at the clean point and M = 1 the
    same product at α = ½: both say "removing t lowers φ" with a positive score, so they mostly agree in sign and
    correlate (a flipped sign would give the opposite)."""
    rows = make_batch(B=4, P=4, T=12, seed=5)
    batch = batch_of(rows, ProbeKind.AS_JOINT)
    backend = ModuleBackend(lm64, PassLimits(10**6))
    mean = replacement(backend, batch, "mean")
    first_order, _ = fisher(backend, batch, mean, outcomes=1)
    midpoint, _ = path_integrated(backend, batch, mean, 1)
    sel = batch.reasoning_mask & batch.probe.joint[:, None]  # rows with an answer (the others read LT-Logits)
    assert int(sel.sum()) >= 8
    a, b = first_order[sel].double(), midpoint[sel].double()
    assert float(((a > 0) == (b > 0)).double().mean()) >= 0.8
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.5


def test_the_configuration_and_its_errors():
    assert OARConfig().path_points == 2 and OARConfig(mode="path", path_points=8).path_points == 8
    for bad in (0, 9):
        with pytest.raises(OARConfigError, match=rf"algorithm\.oar\.path_points={bad} is out of range: must be an "
                                                 r"integer in \[1, 8\]"):
            OARConfig(mode="path", path_points=bad)
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.path_points=True must be an integer in \[1, 8\]"):
        OARConfig(path_points=True)
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=resample is not allowed with algorithm\.oar\."
                                             r"mode=path .*choose algorithm\.oar\.mask=mean\|zero\|pad\|token"):
        check_config(OARConfig(mode="path", mask="resample"))


def test_the_cost_is_oar_gs_with_k_equal_m_draws(lm64, make_batch):
    """Forward + backward passes (the policy update's budget, like OAR-G), packed as OAR-G's K = M draw rows."""
    assert METHODS.get("path").forward_only == METHODS.get("gradient").forward_only is False
    rows = make_batch(B=4, P=4, T=9, seed=3)
    batch = batch_of(rows, ProbeKind.AS_MEAN)
    for tokens, points in ((24, 3), (60, 2), (10**6, 4)):
        _, passes = path_integrated(ModuleBackend(lm64, PassLimits(tokens)), batch, MASK, points)
        assert passes == count_g(batch, PassLimits(tokens), samples=points)


def test_path_through_the_one_way_in(make_lm):
    """oar_verl.core.attribute (prepare → run_attribution → pad) with mode=path: the clamped scores, non-zero."""
    from oar_verl.quickstart.tokenizers import train_tiny_bpe

    tok = train_tiny_bpe(["What is 3 plus 4? 3 plus 4 is 7. The answer is 7.", "so the sum is 9"] * 50, vocab_size=300)
    prompts = [torch.tensor(tok.encode(t, add_special_tokens=False)) for t in ("What is 3 plus 4?", "Add.")]
    responses = [torch.tensor(tok.encode(t, add_special_tokens=False) + [tok.eos_token_id])
                 for t in ("3 plus 4 is 7. The answer is 7.", "so the sum is 9. The answer is 9.")]
    cfg = OARConfig(mode="path", probe="as_joint", path_points=2)
    model = make_lm(torch.float64, vocab=len(tok))
    att = attribute(model, prompts, responses, tok, cfg)
    assert att.importance.shape == (2, max(len(r) for r in responses))
    assert bool((att.importance >= 0).all()) and float(att.importance.sum()) > 0
    assert bool((att.importance[~att.reasoning_mask] == 0).all())
    # the clamp of the method's signed scores on the prepared batch
    prepared = prepare_attribution(prompts, responses, tok, cfg, 0)
    backend = module_backend(model, cfg)
    signed, _ = path_integrated(backend, prepared.batch, Replacement(vector=backend.mean_embedding(), embedding=True),
                                2)
    assert bool((signed < 0).any())  # the clamp has something to do
    torch.testing.assert_close(att.result.importance, signed.clamp(min=0.0))
