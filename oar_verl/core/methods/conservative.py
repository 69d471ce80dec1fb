"""``mode=conservative``: gradient × input of the answer tokens' log-probability at the clean point, with the backward
changed so that relevance is conserved through the layers (attention probabilities and norm scales constant, the gated
MLP by the identity and half rules: :mod:`oar_verl.core.backends.rules`); written once over the backend interface
(:mod:`oar_verl.core.backends.base`). Definition, conservation and cost: docs/method.md §13.

One input-gradient pass per row at the clean point (no noise, no masking): fisher's cost with one outcome. The target
is φ = Σ_k w_k log p(a_k | ·), the teacher-forced answer tokens' log-probability over the probe's own positions and
weights (AS-Mean: the mean over the answer; LT-Logits: its first token; AS-Joint: φ itself), so a token's score is the
relevance it carries to the answer the row stated: positive where it supports it.
"""

from __future__ import annotations

import dataclasses

import torch

from oar_verl.core.backends.base import AttributionBackend, EmbeddingHook, Pass, collect, first_row, with_fillers
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.backends.shared import SharedTarget
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.contract import AttributionResult, MethodInputs, method
from oar_verl.core.methods.gradient import embedding_projection


def answer_target(batch: AttributionBatch) -> AttributionBatch:
    """``batch`` with every row's probe read as φ (its answer tokens' log-probability over the probe's positions and
    weights), whatever its probe kind."""
    return dataclasses.replace(batch, probe=dataclasses.replace(batch.probe, joint=torch.ones_like(batch.probe.joint)))


def conservative(backend: AttributionBackend, batch: AttributionBatch, attention_rule: str = "values"
                 ) -> tuple[torch.Tensor, int]:
    """Conserved relevance of every reasoning token to its row's answer, on any backend that has the rules.

    Args:
        backend: the model runtime (``propagation_rules(attention_rule)``: the rules' context).
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        attention_rule: ``algorithm.oar.attention_rule`` (``values`` or ``uniform``).

    Returns:
        ((B, L) float32 signed relevance ⟨∂φ/∂e_t, e_t⟩ at reasoning positions, 0 elsewhere; the passes this rank
        needed before alignment).
    """
    B, L = batch.input_ids.shape
    target = answer_target(batch)
    rows = torch.arange(B, device=batch.input_ids.device)
    packs = backend.plan(target, rows, PassKind.RULES_GRADIENT)  # the rules hold more per layer (core/backends/memory)
    passes = with_fillers([Pass(rows[p]) for p in packs], backend.align(len(packs)),
                          Pass(first_row(batch), filler=True), batch)
    hook = EmbeddingHook(lambda grad, clean: embedding_projection(grad, clean))
    with backend.propagation_rules(attention_rule):
        got = backend.run(target, passes, lambda i, probe: probe.phi, hook)
    scores = collect(got, packs, (B, L), batch.input_ids.device)
    # where the probe is read (Megatron: the last stage) the scores go to every rank
    return backend.share(torch.where(batch.reasoning_mask, scores, 0.0)), len(packs)


def conservative_target(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs
                        ) -> SharedTarget:
    """``mode=conservative`` read from a shared clean forward (:mod:`oar_verl.core.backends.shared`): φ of every row,
    one backward under the rules (which leave the forward's values unchanged)."""
    return SharedTarget(answer_target(batch), 1, lambda probe, rows: (probe.phi[:, None], torch.ones_like(
        probe.phi[:, None], dtype=torch.float32)), lambda grad, clean: embedding_projection(grad, clean),
        lambda projections, weights: projections[:, 0], rules=cfg.attention_rule)


@method("conservative", forward_only=False, reads_gradients=True, uses_mask_token=False, propagation_rules=True,
        shared=conservative_target, ranks_past_window=True)
def run_conservative(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs
                     ) -> AttributionResult:
    """``mode=conservative``: :func:`conservative` (its key: ``attention_rule``)."""
    return AttributionResult(*conservative(backend, batch, cfg.attention_rule))
