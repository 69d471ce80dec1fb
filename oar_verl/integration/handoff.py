"""Hands the worker's token importance from the OAR trainer to the ``oar`` estimator.

verl calls registered estimators with a fixed argument list (verl-0.9.1.md §3.2); ``token_importance`` is never among
them. Rather than copy verl's advantage step (KL-in-reward, rollout correction, multi-trajectory handling), the OAR
trainers run verl's own step and leave the importance here, in the trainer's process, for the estimator to take. The
estimator checks that the response mask it receives is the one the importance was computed for, so a reordered or
filtered batch fails loudly instead of pairing the wrong rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingImportance:
    """Importance of one batch, response-aligned and in the batch's row order.

    Attributes:
        token_importance: (B, T) float32 raw importance (0 on rows not attributed).
        reasoning_mask: (B, T) bool tokens to reshape.
        attributed: (B,) bool rows that were attributed; the others keep w = 1.
        response_mask: (B, T) the batch's response mask, to check alignment.
    """

    token_importance: torch.Tensor
    reasoning_mask: torch.Tensor
    attributed: torch.Tensor
    response_mask: torch.Tensor


class _State:
    # process-global on purpose: the trainer and verl's advantage step run in the same process (the TaskRunner), but
    # nothing guarantees the same thread
    pending: PendingImportance | None = None
    result = None


_state = _State()


def put(pending: PendingImportance) -> None:
    _state.pending = pending
    _state.result = None


def take(response_mask: torch.Tensor) -> PendingImportance | None:
    """Pop the pending importance, checking it belongs to the batch with this (B, T) response mask."""
    pending = _state.pending
    _state.pending = None
    if pending is None:
        return None
    rm = pending.response_mask.to(response_mask.device)
    if rm.shape != response_mask.shape or not torch.equal(rm.bool(), response_mask.bool()):
        raise RuntimeError(
            "oar: the batch reaching the advantage estimator is not the batch the token importance was computed "
            f"for (response masks differ: {tuple(rm.shape)} vs {tuple(response_mask.shape)}); something between the "
            "attribution and the advantage step reordered or filtered the rows")
    return pending


def record_result(result) -> None:
    """The estimator leaves its full result (weights, base advantages) for the trainer's metrics."""
    _state.result = result


def pop_result():
    result = _state.result
    _state.result = None
    return result
