"""Which sequences OAR reshapes, from the base estimator's advantages (shared by the verl and OpenRLHF glue)."""

from __future__ import annotations

import torch


def sequence_advantage(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the sequence-level advantage: the mean over valid tokens (outcome estimators broadcast one value).

    Args:
        advantages: (B, T) token advantages. response_mask: (B, T) 0/1 or bool valid response tokens.
    """
    m = response_mask.to(advantages.dtype)
    return (advantages * m).sum(-1) / m.sum(-1).clamp(min=1)


def rows_to_reshape(seq_adv: torch.Tensor, apply_to: str) -> torch.Tensor:
    """(B,) bool rows whose weights OAR reshapes: non-zero advantage, filtered by ``apply_to`` (``all`` |
    ``negative`` | ``positive``)."""
    if apply_to == "negative":
        return seq_adv < 0
    if apply_to == "positive":
        return seq_adv > 0
    return seq_adv != 0
