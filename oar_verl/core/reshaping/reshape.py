"""From importance to advantages, the same for every integration (the verl estimator and step, the OpenRLHF adapter):
which rows to attribute → which rows to reshape → gate → Â_t = w_t · A_t → ``oar/*`` metrics (docs/method.md §5, §9)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar_verl.core.config import OARConfig
from oar_verl.core.reshaping.gating import TokenWeights, oar_token_weights
from oar_verl.core.reshaping.metrics import oar_metrics
from oar_verl.core.batch.selection import rows_to_reshape, sequence_advantage

__all__ = ["Reshaped", "attribution_rows", "reshape_advantages"]


def attribution_rows(base_advantages: torch.Tensor, response_mask: torch.Tensor, cfg: OARConfig,
                     eligible: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) bool rows whose importance is needed: the rows that will be reshaped (non-zero base advantage, kept by
    ``apply_to``), or every row without ``skip_zero_advantage``; only ``eligible`` ones (default: all).

    Args:
        base_advantages: (B, T) the base estimator's token advantages. response_mask: (B, T) valid response tokens.
    """
    if cfg.skip_zero_advantage:
        wanted = rows_to_reshape(sequence_advantage(base_advantages, response_mask), cfg.apply_to)
    else:
        wanted = torch.ones(base_advantages.shape[0], dtype=torch.bool, device=base_advantages.device)
    return wanted if eligible is None else wanted & eligible.to(wanted.device).bool()


@dataclass(frozen=True)
class Reshaped:
    """Advantages reshaped by OAR, with what the metrics read.

    Attributes:
        advantages: (B, T) Â = w · A_base.
        returns: (B, T) the base returns reshaped like the advantages (None when none were given).
        base_advantages: (B, T) the base estimator's advantages.
        token_weights: TokenWeights (B, T); w = 1 on rows left alone.
        response_mask: (B, T) valid response tokens.
        span_found: (N,) bool over the attributed rows, an answer span was found (None: not known here).
        answer_probe: (N,) bool over the attributed rows, the probe read answer tokens (None: not known here).
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None
    base_advantages: torch.Tensor
    token_weights: TokenWeights
    response_mask: torch.Tensor
    span_found: torch.Tensor | None = None
    answer_probe: torch.Tensor | None = None

    def metrics(self, span_found: torch.Tensor | None = None, answer_probe: torch.Tensor | None = None,
                prefix: str = "oar/") -> dict[str, float]:
        """``oar/*`` scalars of this batch (:func:`oar_verl.core.reshaping.metrics.oar_metrics`); ``span_found`` /
        ``answer_probe`` default to this batch's own."""
        return oar_metrics(self.token_weights, self.base_advantages, self.advantages, self.response_mask,
                           span_found=self.span_found if span_found is None else span_found,
                           answer_probe=self.answer_probe if answer_probe is None else answer_probe, prefix=prefix)


def reshape_advantages(base_advantages: torch.Tensor, importance: torch.Tensor, reasoning_mask: torch.Tensor,
                       response_mask: torch.Tensor, cfg: OARConfig, *, attributed: torch.Tensor | None = None,
                       base_returns: torch.Tensor | None = None) -> Reshaped:
    """Reshape the base advantages token by token with the gated importance.

    Args:
        base_advantages: (B, T) the base estimator's token advantages (one value per row for outcome estimators).
        importance: (B, T) raw importance, response-aligned.
        reasoning_mask: (B, T) bool tokens to reshape (the others keep w = 1).
        response_mask: (B, T) valid response tokens.
        cfg: OARConfig (tau, beta, floor, signed_scores, apply_to).
        attributed: (B,) bool rows whose importance was computed (default: all); the others keep w = 1.
        base_returns: (B, T) the base returns, reshaped like the advantages when given.

    Returns:
        Reshaped. Rows with zero base advantage, rows excluded by ``apply_to`` or not attributed, and rows with
        non-finite importance keep their base advantage unchanged.
    """
    rows = rows_to_reshape(sequence_advantage(base_advantages, response_mask), cfg.apply_to)
    if attributed is not None:
        rows = rows & attributed.to(rows.device).bool()
    device = base_advantages.device
    tw = oar_token_weights(importance.to(device), reasoning_mask.to(device), response_mask.to(device), cfg.tau,
                           cfg.beta, cfg.floor, reshape_rows=rows, signed=cfg.signed_scores)
    w = tw.weights.to(base_advantages.dtype)
    returns = None if base_returns is None else base_returns * w
    return Reshaped(base_advantages * w, returns, base_advantages, tw, response_mask)
