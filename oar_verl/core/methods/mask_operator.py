"""OAR-P's mask operator (``algorithm.oar.mask``): what replaces a masked token, built once per batch as a
:class:`~oar_verl.core.backends.base.Replacement` that every backend applies (docs/method.md §3).

* ``pad`` / ``token``: the token id (the tokenizer's pad token / ``mask_token_id``) replaces ``input_ids``;
* ``zero`` / ``mean``: the masked position's input-embedding output is set to the zero vector / the mean of the
  embedding table's rows (as the embedding module outputs them, i.e. with a scaled embedding's ``embed_scale``);
* ``resample``: each masked token is replaced by a token id drawn from the same row's own reasoning tokens (the
  policy's empirical marginal, not the model's conditional), seeded by the row's seed and the token's reasoning rank,
  so the draw does not depend on batching, padding or the data-parallel layout.

Which pad / mask tokens are refused, and why: :mod:`oar_verl.core.checks.mask_token`.
"""

from __future__ import annotations

import torch

from oar_verl.core.backends.base import AttributionBackend, Replacement
from oar_verl.core.methods.gradient import draw_seeds
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.contract import MethodInputs, require

MASK_OPERATORS = ("mean", "zero", "resample", "pad", "token")
TOKEN_OPERATORS = ("pad", "token")  # a token id replaces input_ids (the ones oar_verl.core.checks.mask_token vets)
EMBEDDING_OPERATORS = ("zero", "mean")  # the embedding output is replaced
DEFAULT_MASK = "mean"  # always safe (no token is inserted); the one place the default lives

__all__ = ["DEFAULT_MASK", "EMBEDDING_OPERATORS", "MASK_OPERATORS", "TOKEN_OPERATORS", "mask_replacement",
           "method_replacement", "replacement_embedding", "resample_ids"]


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
        operator: one of :data:`MASK_OPERATORS`.
        token_id: the resolved token of ``pad`` / ``token``.
        seeds: (B,) int64 per-row seeds for ``resample`` (:attr:`oar_verl.core.preprocess.PreparedAttribution.seeds`).
    """
    if operator in TOKEN_OPERATORS:
        if token_id is None:
            raise ValueError(f"mask={operator} needs a mask token: set algorithm.oar.mask=token and "
                             "algorithm.oar.mask_token_id, give the tokenizer a pad token, or use mask=mean|zero")
        return Replacement(token=int(token_id))
    if operator == "resample":
        if seeds is None:
            raise ValueError("mask=resample needs per-row seeds (PreparedAttribution.seeds: from the seed, the step "
                             "and each row's tokens)")
        return Replacement(ids=resample_ids(batch, seeds))
    if operator == "mean":
        return Replacement(vector=backend.mean_embedding(), embedding=True)
    if operator == "zero":
        e = backend.mean_embedding()  # (H,) where an embedding lives: its width and dtype
        return Replacement(vector=None if e is None else torch.zeros_like(e), embedding=True)
    raise ValueError(f"unknown mask operator {operator!r}; one of {', '.join(MASK_OPERATORS)}")


def method_replacement(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs, need: str
                       ) -> Replacement:
    """A masking method's (OAR-P, fisher) :func:`mask_replacement` of the run's ``mask``; a token operator without a
    token is an error saying ``need`` and naming the keys and the operators this mode takes instead."""
    if cfg.mask in TOKEN_OPERATORS:
        p = cfg.prefix
        others = "|".join(m for m in MASK_OPERATORS
                          if m not in TOKEN_OPERATORS and not (cfg.mode == "fisher" and m == "resample"))
        require(inputs.mask_token_id, f"{need} needs a mask token",
                f"set {p}.mask=token and {p}.mask_token_id, give the tokenizer a pad token, or use {p}.mask={others}")
    return mask_replacement(backend, batch, cfg.mask, inputs.mask_token_id, inputs.seeds)


def replacement_embedding(backend: AttributionBackend, replacement: Replacement) -> torch.Tensor | None:
    """(H,) the embedding output a masked token moves to (fisher's δ_t = this − e_t): the token's embedding, or the
    zero / mean vector; None where no embedding lives (Megatron's later stages)."""
    if replacement.ids is not None:
        raise ValueError("fisher linearises a move to one embedding; mask=resample has none (use "
                         "algorithm.oar.mask=mean|zero|pad|token)")
    return replacement.vector if replacement.embedding else backend.embedding(replacement.token)
