"""Deletion curves: which reasoning tokens a ranking removes at each fraction (docs/fidelity.md §1).

A ranking orders each row's R reasoning tokens (a method's scores, a seeded random ranking, the positional control).
At fraction f its top ⌈f·R⌉ tokens are removed jointly; the suppression ratio removes a method's bottom ⌈s·R⌉ and a
random ranking's top ⌈s·R⌉. Batch maths only: no model runs here (:mod:`oar_verl.core.fidelity.shifts` runs them).
Shapes: B rows, L columns, Q rankings, F fractions, M methods, J random rankings, G removal sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oar_verl.core.batch.hashing import _mix, _uniform
from oar_verl.core.batch.layout import AttributionBatch

__all__ = ["FRACTIONS", "bottom_removal", "deletion_sets", "full_columns", "position_scores", "random_scores",
           "rankings", "ranks_from_scores", "removal_count", "row_keys", "top_removal"]

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
_STREAM_RANDOM = 0x52414E44  # the hash stream of the random rankings


def row_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64 content key of each row (its real tokens and their order), independent of padding and batching."""
    mask = attention_mask.long()
    pos = mask.cumsum(-1)
    return (mask * _mix(input_ids.long() * 1_000_003 + pos)).sum(-1)


def ranks_from_scores(scores: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """Rank of each reasoning token by score, highest first.

    Args:
        scores: (..., L) float; NaN counts as −inf (ranked last). Ties: the earlier column first.
        reasoning: (..., L) bool, broadcast to ``scores``.

    Returns:
        (..., L) long: 0..R_b−1 on the reasoning tokens of row b, L elsewhere.
    """
    L = scores.shape[-1]
    s = torch.nan_to_num(scores.double(), nan=float("-inf"))
    reasoning = reasoning.expand_as(s)
    order = torch.sort(-s, dim=-1, stable=True).indices  # descending score, earlier column on ties
    order = order.gather(-1, torch.sort((~reasoning).gather(-1, order).byte(), dim=-1, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(L, device=scores.device).expand_as(order))
    return torch.where(reasoning, rank, L)


def random_scores(batch: AttributionBatch, seed: int, index: int) -> torch.Tensor:
    """(B, L) float64 uniform scores on the reasoning tokens (0 elsewhere): random ranking ``index`` of each row, a
    function of (seed, index, the row's content, the token's reasoning rank) only."""
    key = row_keys(batch.input_ids, batch.attention_mask)[:, None].cpu()
    rank = batch.reasoning_mask.long().cumsum(-1) - 1  # each token's index among its row's reasoning tokens
    u = _uniform(seed, _STREAM_RANDOM + index, key, rank.cpu())
    return torch.where(batch.reasoning_mask.cpu(), u, 0.0).to(batch.input_ids.device)


def position_scores(batch: AttributionBatch) -> torch.Tensor:
    """(B, L) float64 scores that rank each row's reasoning tokens by position alone, the latest first (0 elsewhere): a
    control to pass beside the methods. The outcome is read right after the reasoning, so removing the last tokens
    moves it by itself; a method that does not beat this ranking found nothing position does not already give, and
    suppressing the earliest tokens is a low bar for S (docs/fidelity.md §4)."""
    reasoning = batch.reasoning_mask.bool()
    return torch.where(reasoning, reasoning.double().cumsum(-1), 0.0)


def full_columns(scores: torch.Tensor, batch: AttributionBatch, name: str) -> torch.Tensor:
    """(B, L) scores from (B, L) full-sequence or (B, L − P) response-aligned ones (left-padded with 0 by the P prompt
    columns); a ValueError naming ``name`` and both shapes otherwise."""
    B, L = batch.input_ids.shape
    s = scores.to(batch.input_ids.device)
    if s.shape == (B, L):
        return s
    if s.shape == (B, L - batch.response_start):
        return torch.nn.functional.pad(s, (batch.response_start, 0))
    raise ValueError(f"fidelity: scores {name!r} have shape {tuple(s.shape)}; expected (B, L) = {(B, L)} or the "
                     f"response-aligned {(B, L - batch.response_start)}")


def rankings(batch: AttributionBatch, scores: Sequence[torch.Tensor], random_rankings: int, seed: int
             ) -> torch.Tensor:
    """(Q, B, L) long ranks (:func:`ranks_from_scores`) of each of ``scores`` ((B, L) each), then of ``random_rankings``
    = J seeded random rankings (:func:`random_scores`); Q = len(scores) + J."""
    reasoning = batch.reasoning_mask.bool()
    every = [s.to(reasoning.device) for s in scores] + [random_scores(batch, seed, j) for j in range(random_rankings)]
    return ranks_from_scores(torch.stack(every), reasoning)


def removal_count(fraction: float | torch.Tensor, reasoning_tokens: torch.Tensor) -> torch.Tensor:
    """⌈f·R⌉ (at most R; 1e-9 slack so that e.g. 0.1·30 is 3, not 4), long, ``fraction`` broadcast against
    ``reasoning_tokens`` (B,) (a (F, 1) tensor of fractions gives (F, B))."""
    r = reasoning_tokens.double()
    return torch.minimum(torch.ceil(fraction * r - 1e-9).clamp(min=0), r).long()


def top_removal(rank: torch.Tensor, reasoning: torch.Tensor, fraction: float) -> torch.Tensor:
    """(B, L) bool: each row's top ⌈f·R⌉ reasoning tokens of ``rank`` (B, L) (:func:`ranks_from_scores`)."""
    k = removal_count(fraction, reasoning.sum(-1))
    return reasoning & (rank < k[:, None])


def bottom_removal(rank: torch.Tensor, reasoning: torch.Tensor, fraction: float) -> torch.Tensor:
    """(B, L) bool: each row's bottom ⌈f·R⌉ reasoning tokens of ``rank`` (B, L)."""
    r = reasoning.sum(-1)
    return reasoning & (rank >= (r - removal_count(fraction, r))[:, None])


def deletion_sets(ranks: torch.Tensor, reasoning: torch.Tensor, fractions: Sequence[float], *, methods: int,
                  random_rankings: int, suppress_fraction: float) -> torch.Tensor:
    """Every removal set of the deletion metric, in one vectorised pass.

    Args:
        ranks: (Q, B, L) :func:`rankings`: the M methods first, the J random rankings last.
        reasoning: (B, L) bool. fractions: the F fractions of the curve.
        methods: M, the rankings whose bottom share S removes. random_rankings: J, those whose top share it removes.
        suppress_fraction: the share s of S.

    Returns:
        (G, B, L) bool, G = Q·F + M + J, in this order: every ranking's top ⌈f·R⌉ per f (ranking-major), then the
        first M rankings' bottom ⌈s·R⌉, then the last J rankings' top ⌈s·R⌉.
    """
    Q, B, L = ranks.shape
    r = reasoning.sum(-1)
    k = removal_count(torch.tensor(fractions, dtype=torch.float64, device=r.device)[:, None], r)  # (F, B)
    tops = reasoning & (ranks[:, None] < k[None, :, :, None])  # (Q, F, B, L)
    s = removal_count(suppress_fraction, r)[:, None]  # (B, 1)
    bottoms = reasoning & (ranks[:methods] >= r[:, None] - s)  # (M, B, L)
    rand_s = reasoning & (ranks[Q - random_rankings:] < s)  # (J, B, L)
    return torch.cat([tops.reshape(-1, B, L), bottoms, rand_s])
