"""``mode=path``: integrated gradients of the outcome shift along the run's mask path, every reasoning token of a row
moved together toward the mask embedding, written once over the backend interface (:mod:`oar_verl.core.backends.base`):
c_t = (1/M) Σ_m ⟨∂φ/∂e_t at α_m, e_mask − e_t⟩, α_m = (m − ½)/M, a point being one of OAR-G's draw rows. What it
estimates, completeness and cost: docs/method.md §12.
"""

from __future__ import annotations

import torch

from oar_verl.core.backends.base import AttributionBackend, EmbeddingHook, Replacement
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.contract import AttributionResult, MethodInputs, method
from oar_verl.core.methods.gradient import draw_plan, embedding_projection
from oar_verl.core.methods.mask_operator import method_replacement, replacement_embedding
from oar_verl.core.methods.perturbation import as_replacement


def path_alphas(points: int, device=None) -> torch.Tensor:
    """(M,) float64 midpoints α_m = (m − ½)/M, m = 1..M, of the M = ``points`` >= 1 cells of [0, 1]."""
    if points < 1:
        raise ValueError(f"path needs points >= 1 (got {points})")
    return (torch.arange(points, dtype=torch.float64, device=device) + 0.5) / points


def path_displacement(alpha: torch.Tensor, clean: torch.Tensor, mask_embedding: torch.Tensor) -> torch.Tensor:
    """(m, H) α_j (e_mask − e_j) of m tokens: ``alpha`` (m,) each token's point, ``clean`` (m, H) their clean
    embedding outputs e_j, ``mask_embedding`` (H,) e_mask; in float32 or the clean dtype where wider."""
    acc = torch.promote_types(clean.dtype, torch.float32)
    return alpha.to(clean.device, acc)[:, None] * (mask_embedding.to(clean.device, acc) - clean.to(acc))


def path_integrated(backend: AttributionBackend, batch: AttributionBatch, mask_token_id: int | Replacement,
                    points: int) -> tuple[torch.Tensor, int]:
    """Signed path-integrated gradients c_t of every reasoning token, on any backend (see the module docstring).

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        mask_token_id: the token whose embedding e_mask the path ends at, or a
            :class:`~oar_verl.core.backends.base.Replacement` (``algorithm.oar.mask``: the zero or mean vector).
        points: M >= 1 points α_m = (m − ½)/M on the path (``path_points``), one draw row each.

    Returns:
        ((B, L) float32 c_t = (1/M) Σ_m ⟨∂φ/∂e_t |_{α_m}, e_mask − e_t⟩ at reasoning positions (signed), 0 elsewhere;
        the student passes this rank needed before alignment). No parameter has a gradient afterwards.
    """
    alphas = path_alphas(points, batch.input_ids.device)
    plan = draw_plan(backend, batch, points)
    student_alpha = plan.per_pass(alphas.repeat(batch.input_ids.shape[0]))  # the point of each draw row b·M + m
    # (H,); None where no embedding lives (Megatron's later stages, which never call the hook)
    mask_embedding = replacement_embedding(backend, as_replacement(mask_token_id))

    def move(i: int, slot: torch.Tensor, rank: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        return path_displacement(student_alpha[i].to(clean.device)[slot.to(clean.device)], clean, mask_embedding)

    hook = EmbeddingHook(lambda grad, clean: embedding_projection(grad, clean, mask_embedding), move)
    signed = plan.collect(backend.run(batch, plan.students, plan.loss(backend, batch), hook), batch, points).mean(1)
    return torch.where(batch.reasoning_mask, signed, 0.0), len(plan.packs)


@method("path", forward_only=False, reads_gradients=True, uses_mask_token=True, linearises_mask=True)
def run_path(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=path``: :func:`path_integrated` with ``mask`` and ``path_points`` of the configuration. The importance
    handed to gating is max(c_t, 0): a token whose removal along the path *reduces* the shift earns no credit."""
    mask = method_replacement(backend, batch, cfg, inputs, f"{cfg.prefix}.mode=path")
    signed, passes = path_integrated(backend, batch, mask, cfg.path_points)
    return AttributionResult(signed.clamp(min=0.0), passes)
