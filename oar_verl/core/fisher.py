"""Second-order attribution patching of OAR-P's masking shift (docs/method.md §11), written once over the attribution
backend interface (:mod:`oar_verl.core.backend`).

OAR-P scores token t by I_t = KL(P_clean ‖ P^(t)), P^(t) the outcome distribution with y_t swapped for the mask token.
Write the swap as a move of the token's embedding, δ_t = e_mask − e_t, and the outcome logits as a function of the
embeddings. The KL's first-order term vanishes at the clean point (a KL is minimal at zero), and its second-order term
is the Fisher quadratic form of the probe distribution p::

    I_t ≈ ½ δ_tᵀ J_tᵀ F J_t δ_t,     F = Σ_v p_v g_v g_vᵀ,   g_v = ∇_z log p_v,

so, with the Jacobian folded in, I_t ≈ ½ Σ_v p_v ⟨∂ log p_v / ∂e_t, δ_t⟩². The sum over the vocabulary is truncated to
the ``outcomes`` most likely answers of each row (an answer distribution carries its mass on a few tokens): one
clean-point backward of log p_v per kept outcome gives ⟨∂ log p_v / ∂e_t, δ_t⟩ for every token t at once, so the cost
is one forward and ``outcomes`` backwards per sequence, independent of the reasoning length R (OAR-P: R copies). At
K = 1 the score is ½ p_top ⟨∂ log p_top / ∂e_t, δ_t⟩²: first-order attribution patching of log p(top outcome), a
lower bound of the Fisher form that keeps only its leading term (docs/method.md §11).
AS-Joint rows read a scalar φ whose shift has a first-order term: I_t ≈ φ_clean − φ^(t) ≈ −⟨∂φ/∂e_t, δ_t⟩ (signed,
as OAR-P's).

The forward is the clean one (no noise, no teacher pass): the row's top outcomes are read from the very probe that is
differentiated, and on a backend whose forward serves several backwards (``shared_backwards``: Hugging Face modules,
Ulysses) its K log-probabilities are K loss columns of one pass. Megatron's schedule runs one backward per
micro-batch, so there each outcome is a *draw row* e = b·K + k, packed like OAR-G's noise draws. AS-Joint rows have
one loss (φ), never a pass of their own for the other K − 1 columns. The projection on δ_t = e_mask − e_t is this module's
(:func:`oar_verl.core.gradient.embedding_projection` with the backend's embedding of the mask token).
"""

from __future__ import annotations

import torch

from oar_verl.core.backend import (AttributionBackend, EmbeddingHook, Pass, Replacement, collect, first_row,
                                   plan_draws, with_fillers)
from oar_verl.core.gradient import embedding_projection
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.mask_operator import TOKEN_OPERATORS, mask_replacement, replacement_embedding
from oar_verl.core.memory import PassKind
from oar_verl.core.methods import AttributionResult, MethodInputs, method, require
from oar_verl.core.perturbation import as_replacement


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


def fisher(backend: AttributionBackend, batch: AttributionBatch, mask_token_id: int | Replacement, outcomes: int
           ) -> tuple[torch.Tensor, int]:
    """Second-order masking scores of every reasoning token, on any backend (see the module docstring).

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        mask_token_id: the token whose embedding e_mask the swap moves to, or a
            :class:`~oar_verl.core.backend.Replacement` (``algorithm.oar.mask``: e_mask the zero or mean vector).
        outcomes: K >= 1 most likely outcomes of each row's probe kept in the Fisher sum (``fisher_outcomes``).

    Returns:
        ((B, L) float32 scores at reasoning positions, 0 elsewhere; the passes this rank needed before alignment).
    """
    B, L = batch.input_ids.shape
    K = outcomes
    device = batch.input_ids.device
    # where one forward serves K backwards, a row is one pass item with K loss columns; elsewhere (Megatron's
    # schedule) each outcome is a draw row e = b·K + k with one loss
    columns = K if backend.shared_backwards else 1
    draw_rows, packs = plan_draws(backend, batch, K // columns, PassKind.INPUT_GRADIENT)
    passes = with_fillers([Pass(draw_rows[p]) for p in packs], backend.align(len(packs)),
                          Pass(first_row(batch), filler=True), batch)
    weights = torch.zeros(B * K // columns, columns, dtype=torch.float32, device=device)
    outcome_of = torch.arange(B * K // columns, device=device) % (K // columns)  # the outcome of a one-column item

    def loss(i: int, probe) -> torch.Tensor:
        p = passes[i]
        logp_top, ids = probe.top(K)  # the clean distribution's top outcomes (the forward is the clean one)
        if columns == 1:  # this item's outcome only
            k = outcome_of[packs[i]] if not p.filler else torch.zeros(1, dtype=torch.long, device=device)
            k = k.to(ids.device)[:, None]
            logp_top, ids = logp_top.gather(1, k), ids.gather(1, k)
        if not p.filler:
            weights[packs[i]] = logp_top.detach().exp().float().to(device)
        logp = torch.stack([probe.log_prob(ids[:, c]) for c in range(columns)], 1)  # (n, columns): K at most
        joint = batch.probe.joint[p.rows].to(logp.device)
        first = (outcome_of[packs[i]] == 0 if columns == 1 and not p.filler
                 else torch.ones(len(p.rows), dtype=torch.bool, device=device)).to(logp.device)
        # AS-Joint rows: φ's gradient once (its first outcome), no other loss
        phi = torch.zeros_like(logp)
        phi[:, 0] = torch.where(first, probe.phi, torch.zeros_like(probe.phi))
        losses = torch.where(joint[:, None], phi, logp)
        return losses if columns > 1 else losses[:, 0]  # one loss per row where each outcome has its own pass

    # (H,); None where no embedding lives (Megatron's later stages)
    mask_embedding = replacement_embedding(backend, as_replacement(mask_token_id))
    hook = EmbeddingHook(lambda grad, clean: embedding_projection(grad, clean, mask_embedding), outputs=columns)
    shape = (B * K // columns, columns, L) if columns > 1 else (B * K, L)
    projections = collect(backend.run(batch, passes, loss, hook), packs, shape, device).view(B, K, L)
    scores = fisher_importance(projections, weights.view(B, K), batch.probe.joint)
    # the weights exist where the probe was read (Megatron: the last stage): the scores go from there to every rank
    return backend.share(torch.where(batch.reasoning_mask, scores, 0.0)), len(packs)


@method("fisher")
def run_fisher(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=fisher``: :func:`fisher` with ``fisher_outcomes`` of the configuration."""
    if cfg.mask in TOKEN_OPERATORS:
        require(inputs.mask_token_id, f"{cfg.prefix}.mode=fisher needs a mask token",
                f"set {cfg.prefix}.mask=token and {cfg.prefix}.mask_token_id, give the tokenizer a pad token, or use "
                f"{cfg.prefix}.mask=mean|zero")
    mask = mask_replacement(backend, batch, cfg.mask, inputs.mask_token_id, inputs.seeds)
    return AttributionResult(*fisher(backend, batch, mask, cfg.fisher_outcomes))
