"""OAR-P's and fisher's mask operators (``algorithm.oar.mask``): what replaces a masked token, built once per batch as
a :class:`~oar_verl.core.backends.base.Replacement` that every backend applies (docs/method.md §3).

Each operator is registered in :data:`MASK_OPERATORS` with its facts (:class:`MaskOperator`: does it insert a token,
is that token ``mask_token_id``, does every masked token move to one embedding), which the start-up checks and the
methods read instead of testing names. ``resample`` has one meaning: a token drawn, seeded, from the same row's own
reasoning tokens (:func:`resample_ids`). Which inserted tokens are refused, and why:
:mod:`oar_verl.core.checks.mask_token`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oar_verl.core.backends.base import AttributionBackend, Replacement
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.contract import METHODS, Method, MethodInputs, require
from oar_verl.core.methods.gradient import draw_seeds
from oar_verl.core.registry import Registry

__all__ = ["MASK_OPERATORS", "MaskOperator", "mask_replacement", "method_replacement", "operator_names",
           "operators_for", "replacement_embedding", "resample_ids"]

# (backend, batch (B, L), token id of an inserting operator, (B,) int64 row seeds) -> Replacement
BuildReplacement = Callable[[AttributionBackend, AttributionBatch, "int | None", "torch.Tensor | None"], Replacement]


@dataclass(frozen=True)
class MaskOperator:
    """A registered mask operator and its facts.

    Attributes:
        run: (backend, batch, token_id, seeds) -> the batch's Replacement.
        inserts_token: a token id replaces ``input_ids`` (the tokenizer's pad, ``mask_token_id``): the token is vetted
            at start-up (:mod:`oar_verl.core.checks.mask_token`) and required at run time.
        needs_mask_token_id: the inserted token is ``algorithm.oar.mask_token_id`` (required; with every other
            operator the key must be null).
        one_embedding: every masked token moves to one embedding (a token's, the zero or the mean vector), the move a
            method with ``Method.linearises_mask`` (fisher) differentiates along; ``resample`` draws one per token.
    """

    run: BuildReplacement
    inserts_token: bool
    needs_mask_token_id: bool
    one_embedding: bool


MASK_OPERATORS: Registry[MaskOperator] = Registry("mask operator", "algorithm.oar.mask")


def operator_names(where: Callable[[MaskOperator], bool]) -> tuple[str, ...]:
    """The names of the registered operators whose facts satisfy ``where``, in registration order."""
    return tuple(name for name in MASK_OPERATORS.names() if where(MASK_OPERATORS.get(name)))


def operators_for(method: Method, *, inserting: bool = True) -> tuple[str, ...]:
    """The mask operators ``method`` can run with (every one for a method that does not linearise the mask), in
    registration order; ``inserting=False``: only those that insert no token."""
    return operator_names(lambda op: (op.one_embedding or not method.linearises_mask)
                          and (inserting or not op.inserts_token))


def resample_ids(batch: AttributionBatch, seeds: torch.Tensor) -> torch.Tensor:
    """(B, L) long: every reasoning token replaced by one of its own row's reasoning tokens, drawn uniformly (the
    row's empirical token marginal); other tokens unchanged.

    Draw k of row b is hash(seeds[b], k) mod R_b, k the token's rank among the row's R_b reasoning tokens: a pure
    function of (seed, rank), so no generator state, device or layout enters.

    Args:
        batch: AttributionBatch (B, L).
        seeds: (B,) int64 per-row seeds (content-derived, :func:`oar_verl.core.methods.gradient.sequence_seeds`).
    """
    mask = batch.reasoning_mask.bool()
    L = mask.shape[1]
    rank = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L) reasoning rank of each column
    counts = mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    # splitmix64-style mixes of (seed, rank): draw_seeds over the ranks 0..L-1, column k+1 -> rank k (column 0 keeps
    # the seed itself, a poor draw for rank 0)
    mixed = draw_seeds(seeds.to(mask.device), L + 1)[:, 1:]  # (B, L) non-negative int64
    pick = mixed.gather(1, rank).remainder(counts)  # (B, L) index into the row's reasoning tokens
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # reasoning columns first, in order
    drawn = batch.input_ids.gather(1, order.gather(1, pick))
    return torch.where(mask, drawn, batch.input_ids)


def mask_replacement(backend: AttributionBackend, batch: AttributionBatch, operator: str, token_id: int | None,
                     seeds: torch.Tensor | None) -> Replacement:
    """The :class:`~oar_verl.core.backends.base.Replacement` of ``operator`` for this batch, built once per batch.

    Args:
        backend: the model runtime (the table's mean embedding, the embedding's width).
        batch: AttributionBatch (B, L).
        operator: a name registered in :data:`MASK_OPERATORS`.
        token_id: the resolved token of an inserting operator (``pad``, ``token``).
        seeds: (B,) int64 per-row seeds for ``resample`` (:attr:`oar_verl.core.preprocess.PreparedAttribution.seeds`).
    """
    op = MASK_OPERATORS.get(operator)
    if op.inserts_token and token_id is None:
        raise ValueError(f"mask={operator} needs a mask token: set algorithm.oar.mask=token and "
                         "algorithm.oar.mask_token_id, give the tokenizer a pad token, or use mask="
                         f"{'|'.join(operator_names(lambda op: not op.inserts_token))}")
    return op.run(backend, batch, token_id, seeds)


def _inserted_token(backend: AttributionBackend, batch: AttributionBatch, token_id: int | None,
                    seeds: torch.Tensor | None) -> Replacement:
    """``pad`` / ``token``: the token id replaces ``input_ids``."""
    return Replacement(token=int(token_id))


def _mean(backend: AttributionBackend, batch: AttributionBatch, token_id: int | None,
          seeds: torch.Tensor | None) -> Replacement:
    """``mean``: the input-embedding output set to the mean of the embedding table's rows (as the embedding module
    outputs them, i.e. with a scaled embedding's ``embed_scale``)."""
    return Replacement(vector=backend.mean_embedding(), embedding=True)


def _zero(backend: AttributionBackend, batch: AttributionBatch, token_id: int | None,
          seeds: torch.Tensor | None) -> Replacement:
    """``zero``: the input-embedding output set to the zero vector."""
    e = backend.mean_embedding()  # (H,) where an embedding lives: its width and dtype
    return Replacement(vector=None if e is None else torch.zeros_like(e), embedding=True)


def _resample(backend: AttributionBackend, batch: AttributionBatch, token_id: int | None,
              seeds: torch.Tensor | None) -> Replacement:
    """``resample``: each masked token replaced by a token drawn from its own row's reasoning (:func:`resample_ids`)."""
    if seeds is None:
        raise ValueError("mask=resample needs per-row seeds (PreparedAttribution.seeds: from the seed, the step "
                         "and each row's tokens)")
    return Replacement(ids=resample_ids(batch, seeds))


# registration order is the order errors and docs list the operators in; `mean` is the default (no token inserted)
MASK_OPERATORS.register("mean")(MaskOperator(_mean, inserts_token=False, needs_mask_token_id=False, one_embedding=True))
MASK_OPERATORS.register("zero")(MaskOperator(_zero, inserts_token=False, needs_mask_token_id=False, one_embedding=True))
MASK_OPERATORS.register("resample")(MaskOperator(_resample, inserts_token=False, needs_mask_token_id=False,
                                                 one_embedding=False))
MASK_OPERATORS.register("pad")(MaskOperator(_inserted_token, inserts_token=True, needs_mask_token_id=False,
                                            one_embedding=True))
MASK_OPERATORS.register("token")(MaskOperator(_inserted_token, inserts_token=True, needs_mask_token_id=True,
                                              one_embedding=True))


def method_replacement(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs, need: str
                       ) -> Replacement:
    """A masking method's (OAR-P, fisher) :func:`mask_replacement` of the run's ``mask``; an inserting operator
    without a token is an error saying ``need`` and naming the keys and the operators this mode takes instead."""
    if MASK_OPERATORS.get(cfg.mask).inserts_token:
        p = cfg.prefix
        others = "|".join(operators_for(METHODS.get(cfg.mode), inserting=False))
        require(inputs.mask_token_id, f"{need} needs a mask token",
                f"set {p}.mask=token and {p}.mask_token_id, give the tokenizer a pad token, or use {p}.mask={others}")
    return mask_replacement(backend, batch, cfg.mask, inputs.mask_token_id, inputs.seeds)


def replacement_embedding(backend: AttributionBackend, replacement: Replacement) -> torch.Tensor | None:
    """(H,) the embedding output a masked token moves to (fisher's δ_t = this − e_t): the token's embedding, or the
    zero / mean vector; None where no embedding lives (Megatron's later stages)."""
    if replacement.ids is not None:
        raise ValueError("fisher linearises a move to one embedding; mask=resample has none (use algorithm.oar.mask="
                         f"{'|'.join(operator_names(lambda op: op.one_embedding))})")
    return replacement.vector if replacement.embedding else backend.embedding(replacement.token)
