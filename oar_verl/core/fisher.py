"""Second-order attribution patching of OAR-P's masking shift (docs/method.md §11), written once over the attribution
backend interface (:mod:`oar_verl.core.backend`).

OAR-P scores token t by I_t = KL(P_clean ‖ P^(t)), P^(t) the outcome distribution with y_t swapped for the mask token.
Write the swap as a move of the token's embedding, δ_t = e_mask − e_t, and the outcome logits as a function of the
embeddings. The KL's first-order term vanishes at the clean point (a KL is minimal at zero), and its second-order term
is the Fisher quadratic form of the probe distribution p::

    I_t ≈ ½ δ_tᵀ J_tᵀ F J_t δ_t,     F = Σ_v p_v g_v g_vᵀ,   g_v = ∇_z log p_v,

so, with the Jacobian folded in, I_t ≈ ½ Σ_v p_v ⟨∂ log p_v / ∂e_t, δ_t⟩². The sum over the vocabulary is truncated to
the ``outcomes`` most likely answers of each row (an answer distribution carries its mass on a few tokens): one
clean-point forward + backward of log p_v per kept outcome gives ⟨∂ log p_v / ∂e_t, δ_t⟩ for every token t at once,
so the cost is ``outcomes`` gradient passes per sequence, independent of the reasoning length R (OAR-P: R copies).
AS-Joint rows read a scalar φ whose shift has a first-order term: I_t ≈ φ_clean − φ^(t) ≈ −⟨∂φ/∂e_t, δ_t⟩ (signed,
as OAR-P's).

Each outcome of a row is a *draw row* e = b·K + k, packed under the token budget like OAR-G's noise draws, with no
noise: the forward is the clean one, so the row's top outcomes are read from the very probe that is differentiated
(no teacher pass). The projection on δ_t = e_mask − e_t is this module's
(:func:`oar_verl.core.gradient.embedding_projection` with the backend's embedding of the mask token).
"""

from __future__ import annotations

import torch

from oar_verl.core.backend import (AttributionBackend, EmbeddingHook, Pass, collect, first_row, plan_draws,
                                   with_fillers)
from oar_verl.core.gradient import embedding_projection
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.memory import PassKind
from oar_verl.core.methods import METHODS, AttributionResult, MethodInputs, require


def fisher_importance(projections: torch.Tensor, weights: torch.Tensor, joint: torch.Tensor) -> torch.Tensor:
    """(B, L) second-order masking scores from per-outcome first-order projections.

    Args:
        projections: (B, K, L) ⟨∂ log p_k / ∂e_t, δ_t⟩ of outcome k (AS-Joint rows: ⟨∂φ/∂e_t, δ_t⟩ at k = 0).
        weights: (B, K) p_k, the clean probability of outcome k.
        joint: (B,) bool AS-Joint rows.

    Returns:
        (B, L) float32: ½ Σ_k p_k projection_k² (distribution probes), −projection_0 (AS-Joint).
    """
    quadratic = 0.5 * (weights[:, :, None] * projections.square()).sum(1)
    return torch.where(joint[:, None], -projections[:, 0], quadratic).float()


def fisher(backend: AttributionBackend, batch: AttributionBatch, mask_token_id: int, outcomes: int = 4
           ) -> tuple[torch.Tensor, int]:
    """Second-order masking scores of every reasoning token, on any backend (see the module docstring).

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        outcomes: K >= 1 most likely outcomes of each row's probe kept in the Fisher sum.

    Returns:
        ((B, L) float32 scores at reasoning positions, 0 elsewhere; the passes this rank needed before alignment).
    """
    B, L = batch.input_ids.shape
    K = outcomes
    device = batch.input_ids.device
    draw_rows, packs = plan_draws(backend, batch, K, PassKind.INPUT_GRADIENT)  # draw row e = b·K + k: outcome k
    passes = with_fillers([Pass(draw_rows[p]) for p in packs], backend.align(len(packs)),
                          Pass(first_row(batch), filler=True), batch)
    weights = torch.zeros(B * K, dtype=torch.float32, device=device)

    def loss(i: int, probe) -> torch.Tensor:
        p = passes[i]
        k = packs[i] % K if not p.filler else torch.zeros(1, dtype=torch.long, device=device)
        logp_top, ids = probe.top(K)  # the clean distribution's top outcomes (the forward is the clean one)
        pick = ids.gather(1, k.to(ids.device)[:, None]).squeeze(1)
        if not p.filler:
            weights[packs[i]] = logp_top.detach().gather(1, k.to(ids.device)[:, None]).squeeze(1).exp().float().to(
                device)
        joint = batch.probe.joint[p.rows].to(pick.device)
        first = (k == 0).to(pick.device)
        return torch.where(joint, torch.where(first, probe.phi, torch.zeros_like(probe.phi)), probe.log_prob(pick))

    mask_embedding = backend.embedding(mask_token_id)  # (H,); None where no embedding lives (Megatron's later stages)
    hook = EmbeddingHook(lambda grad, clean: embedding_projection(grad, clean, mask_embedding))
    per_draw = collect(backend.run(batch, passes, loss, hook), packs, (B * K, L), device)
    scores = fisher_importance(per_draw.view(B, K, L), weights.view(B, K), batch.probe.joint)
    # the weights exist where the probe was read (Megatron: the last stage): the scores go from there to every rank
    return backend.share(torch.where(batch.reasoning_mask, scores, 0.0)), len(packs)


@METHODS.register("fisher")
def run_fisher(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=fisher``: :func:`fisher` with ``fisher_outcomes`` of the configuration."""
    mask = require(inputs.mask_token_id, f"{cfg.prefix}.mode=fisher needs a mask token",
                   f"set {cfg.prefix}.mask_token_id or give the tokenizer a pad token")
    return AttributionResult(*fisher(backend, batch, mask, cfg.fisher_outcomes))
