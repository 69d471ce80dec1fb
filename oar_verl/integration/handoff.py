"""The one channel from the OAR step to the ``oar`` estimator, open only around verl's own advantage step.

verl calls a registered estimator with a fixed argument list that never includes per-token data (docs/verl.md
"Why a handoff"). Rather than copy verl's advantage step (KL-in-reward, rollout correction, multi-trajectory
handling), the OAR step runs it unchanged inside a scope that makes the step's inputs visible to the estimator::

    with handoff.scope(inputs) as scope:   # the only way in
        <verl's advantage step>            # calls the `oar` estimator, which takes `inputs` and leaves its result
    scope.result                           # the only way out

Outside a scope the estimator finds nothing (and explains how to run OAR). The scope lives in the trainer's process
(verl runs the advantage step there), so a module-level slot holds the open scope; scopes do not nest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EstimatorInputs:
    """What the estimator needs beyond verl's arguments, for one batch, in the batch's row order.

    Attributes:
        token_importance: (B, T) float32 raw importance (0 on rows not attributed).
        reasoning_mask: (B, T) bool tokens to reshape.
        attributed: (B,) bool rows that were attributed; the others keep w = 1.
        response_mask: (B, T) the response mask the importance was computed for.
        token_level_rewards: (B, T) the rewards ``base_advantages`` was computed from (None: not computed).
        base_advantages: (B, T) the base estimator's advantages, computed once by the step (None: the estimator
            computes them, e.g. when verl adds a KL penalty to the rewards first).
        base_returns: (B, T) the base estimator's returns (None with ``base_advantages``).
    """

    token_importance: torch.Tensor
    reasoning_mask: torch.Tensor
    attributed: torch.Tensor
    response_mask: torch.Tensor
    token_level_rewards: torch.Tensor | None = None
    base_advantages: torch.Tensor | None = None
    base_returns: torch.Tensor | None = None

    def base_for(self, token_level_rewards: torch.Tensor,
                 response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's base (advantages, returns) if they were computed from exactly these rewards and mask."""
        if self.base_advantages is None or self.token_level_rewards is None:
            return None
        same = (self.token_level_rewards.shape == token_level_rewards.shape
                and torch.equal(self.token_level_rewards.to(token_level_rewards.device), token_level_rewards)
                and torch.equal(self.response_mask.to(response_mask.device).bool(), response_mask.bool()))
        if not same:
            return None
        device = token_level_rewards.device
        return self.base_advantages.to(device), self.base_returns.to(device)


@dataclass
class Scope:
    """An open handoff: the step's inputs in, the estimator's result out."""

    inputs: EstimatorInputs
    result: Any = None  # oar_verl.core.reshaping.reshape.Reshaped, once the estimator ran
    taken: bool = False

    def take(self, response_mask: torch.Tensor) -> EstimatorInputs:
        """The inputs, checked against the batch the estimator received.

        verl's rollout correction may mask rejected tokens out before the advantage step, so the estimator's mask may
        be a subset of the step's; any other difference means rows were reordered or filtered, which would pair the
        wrong importance with a row.
        """
        expected = self.inputs.response_mask.to(response_mask.device).bool()
        got = response_mask.bool()
        if expected.shape != got.shape or bool((got & ~expected).any()):
            raise RuntimeError(
                "oar: the batch reaching the advantage estimator is not the batch the token importance was computed "
                f"for (response masks {tuple(expected.shape)} vs {tuple(got.shape)}, or tokens outside the attributed "
                "responses); something between the attribution and the advantage step reordered or filtered rows")
        self.taken = True
        return self.inputs


_lock = threading.Lock()
_open: Scope | None = None


@contextlib.contextmanager
def scope(inputs: EstimatorInputs) -> Iterator[Scope]:
    """Make ``inputs`` available to the ``oar`` estimator for the duration; the yielded scope holds its result."""
    global _open
    with _lock:
        if _open is not None:
            raise RuntimeError("oar: an advantage step is already open (handoff scopes do not nest)")
        _open = opened = Scope(inputs)
    try:
        yield opened
    finally:
        with _lock:
            _open = None


def current() -> Scope | None:
    """The open scope, or None outside one (the estimator's way in)."""
    return _open
