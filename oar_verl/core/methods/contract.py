"""The attribution methods' common contract: what a method takes and returns, and the registry ``algorithm.oar.mode``
names them in, each entry with the traits the layers around it read (docs/method.md §10).

A method is a function ``(backend, batch, cfg, inputs) -> AttributionResult`` written once over the backend interface
(:mod:`oar_verl.core.backends.base`), registered with :func:`method`: ``gradient``
(:mod:`oar_verl.core.methods.gradient`), ``perturbation`` (:mod:`oar_verl.core.methods.policies`), ``fisher``
(:mod:`oar_verl.core.methods.fisher`), ``path`` (:mod:`oar_verl.core.methods.path`). Nothing else names a mode:
budgets, start-up checks and preprocessing ask ``METHODS.get(cfg.mode)`` for its traits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oar_verl.core.registry import Registry


@dataclass(frozen=True)
class MethodInputs:
    """The per-row inputs a method may need besides the batch.

    Attributes:
        mask_token_id: the token that replaces a masked token (OAR-P) or whose embedding the swap moves to (fisher).
        seeds: (B,) int64 per-sequence noise seeds (OAR-G; :func:`oar_verl.core.methods.gradient.sequence_seeds`).
        teachers: every row's clean probe read from a forward that ran anyway (a method with ``shared_teacher``;
            :class:`~oar_verl.core.backends.shared.SharedTeacher`), or None: the method runs its clean passes.
    """

    mask_token_id: int | None = None
    seeds: torch.Tensor | None = None
    teachers: object | None = None


@dataclass(frozen=True)
class AttributionResult:
    """What a method computed.

    Attributes:
        importance: (B, L) float32, 0 off the reasoning tokens.
        passes: the passes this rank ran for itself (before alignment with the other ranks).
        copies: (B,) long OAR-P masked copies per row (None for the gradient methods).
        refined: (B,) long reasoning tokens per row with a token-level OAR-P score (None for the gradient methods).
        reasoning: (B,) long reasoning tokens per row (None for the gradient methods).
    """

    importance: torch.Tensor
    passes: int
    copies: torch.Tensor | None = None
    refined: torch.Tensor | None = None
    reasoning: torch.Tensor | None = None


def _never(cfg) -> bool:
    return False


def _one(cfg) -> int:
    return 1


@dataclass(frozen=True)
class Method:
    """A registered attribution method and its traits.

    Attributes:
        run: (backend, batch, cfg, inputs) -> AttributionResult.
        forward_only: its passes are forward-only (they take the budget of the actor's log-prob pass), else forward +
            backward (the budget of the policy update).
        reads_gradients: its scores read a gradient of the outcome (warned of on sliding-window models past the
            window, :mod:`oar_verl.core.checks.sliding_window`).
        uses_mask_token: it masks tokens with ``algorithm.oar.mask`` (a mask operator; a ``pad`` / ``token`` one is
            vetted at start-up, :mod:`oar_verl.core.checks.mask_token`); else the mask keys are ignored.
        linearises_mask: it differentiates at the clean point along the move of a masked token to *one* embedding,
            so it takes only the mask operators that have one (``MaskOperator.one_embedding``: not ``resample``).
        segments: cfg -> whether this configuration needs the rows' reasoning segments (``AttributionBatch.segments``).
        propagation_rules: its backward runs under the backend's conservative propagation rules
            (``AttributionBackend.propagation_rules``), which an engine without them refuses at start-up.
        shared: (backend, batch, cfg, inputs) -> its :class:`~oar_verl.core.backends.shared.SharedTarget`: a
            clean-point gradient method that can read its scores from a forward the trainer runs anyway (verl's
            old-log-prob pass); None: it runs its own passes.
        shared_columns: cfg -> the loss columns of its shared target (backwards from one forward; an engine whose
            schedule runs one backward per forward, Megatron's, shares only at 1).
        shared_teacher: it differentiates at points off the clean one (OAR-G's noise), so only its clean teacher
            probes can be read from a forward the trainer runs anyway (``MethodInputs.teachers``); its other passes
            run after that forward.
        ranks_past_window: a gradient method measured to rank well above random on rows longer than a sliding
            window (conservative on Gemma 3: research/docs/faithfulness.md §17), so the sliding-window warning, whose
            premise is a random ranking there, does not name it.
    """

    run: Callable[..., AttributionResult]
    forward_only: bool
    reads_gradients: bool
    uses_mask_token: bool
    linearises_mask: bool = False
    segments: Callable[[object], bool] = _never
    propagation_rules: bool = False
    shared: Callable[..., object] | None = None
    ranks_past_window: bool = False
    shared_columns: Callable[[object], int] = _one
    shared_teacher: bool = False

    @property
    def backward_pass(self) -> str:
        """The memory model's kind of its input-gradient pass (:class:`~oar_verl.core.backends.memory.PassKind`)."""
        from oar_verl.core.backends.memory import PassKind

        return PassKind.RULES_GRADIENT if self.propagation_rules else PassKind.INPUT_GRADIENT


METHODS: Registry[Method] = Registry("attribution method", "algorithm.oar.mode")


def method(name: str, *, forward_only: bool, reads_gradients: bool, uses_mask_token: bool,
           linearises_mask: bool = False, segments: Callable[[object], bool] | None = None,
           propagation_rules: bool = False, shared: Callable[..., object] | None = None,
           ranks_past_window: bool = False, shared_columns: Callable[[object], int] | None = None,
           shared_teacher: bool = False):
    """Decorator: register the decorated ``run`` function as the method ``name`` (``algorithm.oar.mode``) with its
    traits (:class:`Method`; the first three have no default: every method declares them)."""

    def add(run: Callable[..., AttributionResult]) -> Callable[..., AttributionResult]:
        METHODS.register(name)(Method(run, forward_only, reads_gradients, uses_mask_token, linearises_mask,
                                      segments or _never, propagation_rules, shared, ranks_past_window,
                                      shared_columns or _one, shared_teacher))
        return run

    return add


def require(value, need: str, fix: str):
    """``value``, or a ValueError saying what the method needs and how to give it."""
    if value is None:
        raise ValueError(f"{need}: {fix}")
    return value
