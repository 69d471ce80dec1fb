"""From raw importance to token weights: log-compression, per-sequence min-max, bi-level gating, renormalisation.

docs/method.md §5, with the official code's τ overwrite fixed (§7: the configured τ is the quantile level of
every sequence):

    u = log1p(max(I, 0));  n = (u − min u) / (max u − min u)   (divisor 1 when constant)
    u by signed_scores: magnitude (the default): log1p|I| | clamp (above) | signed: sign(I)·log1p|I| |
                        rank: n = rank(I)/(R − 1)   (the choice measured: research/docs/evidence.md §10)
    θ = quantile(n, τ)     (linear interpolation, numpy's default)
    w = max(n / (θ + 1e-8), floor)            if n < θ   (suppression ramp floor..1)
    w = 1 + β (n − θ) / (1 − θ + 1e-8)        if n ≥ θ   (boost ramp 1..1+β)
    w ← w · R / Σ w                            (mean one over the R reasoning tokens: advantage mass preserved)

All functions work on padded (B, T) batches with masks; no per-token Python loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from oar_verl.core.config import SIGNED_SCORE_NAMES, SIGNED_SCORES_DEFAULT

_EPS = 1e-8


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row quantile of the masked entries, numpy's ``linear`` method.

    Args:
        values: (B, T) float. mask: (B, T) bool. q: level in [0, 1].

    Returns:
        (B,) quantile of each row's masked values (0 for rows with no masked entry).
    """
    n = mask.sum(-1)
    srt = torch.where(mask, values, torch.full_like(values, float("inf"))).sort(-1).values
    pos = q * (n - 1).clamp(min=0).to(values.dtype)
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    frac = pos - lo.to(values.dtype)
    a = srt.gather(-1, lo[:, None]).squeeze(-1)
    b = srt.gather(-1, hi[:, None]).squeeze(-1)
    out = a + (b - a) * frac
    return torch.where(n > 0, out, torch.zeros_like(out))


def _min_max(u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row min-max of ``u`` to [0, 1] over the masked entries.

    Args:
        u: (B, T) float64, finite on masked entries. mask: (B, T) bool.

    Returns:
        (B, T) float64 in [0, 1] on masked entries (0 on a constant row: divisor 1), 0 elsewhere.
    """
    u = torch.where(mask, u, 0.0)
    umin = torch.where(mask, u, float("inf")).amin(-1, keepdim=True)
    umax = torch.where(mask, u, float("-inf")).amax(-1, keepdim=True)
    span = umax - umin
    span = torch.where(torch.isfinite(span) & (span > 0), span, torch.ones_like(span))
    umin = torch.where(torch.isfinite(umin), umin, torch.zeros_like(umin))
    return torch.where(mask, (u - umin) / span, 0.0)


def clamp_scores(importance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``clamp``: u = log1p(max(I, 0)), then per-row min-max; a negative score counts as no evidence (0).

    Args:
        importance: (B, T) raw scores, finite on masked entries. mask: (B, T) bool.

    Returns:
        (B, T) float64 in [0, 1] on masked entries, 0 elsewhere.
    """
    return _min_max(torch.log1p(importance.double().clamp(min=0)), mask)


def signed_scores(importance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``signed``: u = sign(I) log1p(|I|) (monotone in I: counter-evidence ranks below no evidence), then per-row
    min-max.

    Args:
        importance: (B, T) raw scores, finite on masked entries. mask: (B, T) bool.

    Returns:
        (B, T) float64 in [0, 1] on masked entries, 0 elsewhere.
    """
    i = importance.double()
    return _min_max(torch.sign(i) * torch.log1p(i.abs()), mask)


def magnitude_scores(importance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``magnitude``: u = log1p(|I|) (evidence for or against the answer alike), then per-row min-max.

    Args:
        importance: (B, T) raw scores, finite on masked entries. mask: (B, T) bool.

    Returns:
        (B, T) float64 in [0, 1] on masked entries, 0 elsewhere.
    """
    return _min_max(torch.log1p(importance.double().abs()), mask)


def rank_scores(importance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``rank``: n = the 0-based rank of I among the row's masked entries / (R − 1), ties given their average rank
    (scipy's ``rankdata(method="average")`` − 1); 0 on a row of one token or of equal scores (w ≡ 1 there).

    Args:
        importance: (B, T) raw scores, finite on masked entries. mask: (B, T) bool.

    Returns:
        (B, T) float64 in [0, 1] on masked entries, 0 elsewhere.
    """
    i = importance.double()
    srt = torch.where(mask, i, float("inf")).sort(-1).values  # padding sorts last (masked scores are finite)
    key = torch.where(mask, i, 0.0).contiguous()
    first = torch.searchsorted(srt, key, right=False)  # (B, T) position of the first equal score
    last = torch.searchsorted(srt, key, right=True) - 1  # and of the last
    avg = (first + last).double() / 2
    r = mask.sum(-1, keepdim=True)
    lo = torch.where(mask, i, float("inf")).amin(-1, keepdim=True)
    hi = torch.where(mask, i, float("-inf")).amax(-1, keepdim=True)
    n = avg / (r - 1).clamp(min=1).double()
    return torch.where(mask & (hi > lo), n, 0.0)


#: How the gate reads signed scores (``algorithm.oar.signed_scores``): name -> (importance (B, T), mask (B, T) bool)
#: -> normalised scores (B, T) float64 in [0, 1] on masked entries, 0 elsewhere. Its names are
#: :data:`oar_verl.core.config.SIGNED_SCORE_NAMES` (the configuration is a leaf; the import below fails on a mismatch).
SIGNED_SCORES: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = MappingProxyType({
    "clamp": clamp_scores, "signed": signed_scores, "magnitude": magnitude_scores, "rank": rank_scores})
if tuple(SIGNED_SCORES) != SIGNED_SCORE_NAMES:  # pragma: no cover  (a name added on one side only)
    raise ImportError(f"SIGNED_SCORES {tuple(SIGNED_SCORES)} != config.SIGNED_SCORE_NAMES {SIGNED_SCORE_NAMES}")


def normalize_scores(importance: torch.Tensor, mask: torch.Tensor,
                     signed: str = SIGNED_SCORES_DEFAULT) -> torch.Tensor:
    """Raw scores to [0, 1] per row over the masked entries, by the scaling ``signed`` names in :data:`SIGNED_SCORES`.

    Args:
        importance: (B, T) raw scores, finite on masked entries; signed (negative: the token argues against the
            stated answer). The default ``clamp`` counts negatives as 0 (log1p never sees −1 or less).
        mask: (B, T) bool.
        signed: a name in :data:`SIGNED_SCORES`.

    Returns:
        (B, T) float64 in [0, 1] on masked entries, 0 elsewhere.

    Raises:
        ValueError: ``signed`` is not a name in :data:`SIGNED_SCORES`.
    """
    if signed not in SIGNED_SCORES:
        raise ValueError(f"algorithm.oar.signed_scores={signed!r} is not allowed; choose one of: "
                         f"{', '.join(SIGNED_SCORES)}")
    return SIGNED_SCORES[signed](importance, mask)


@dataclass(frozen=True)
class TokenWeights:
    """OAR weights of a response batch and what the gate did to each token.

    Attributes:
        weights: (B, T) float32; reshaped on reasoning tokens of reshaped rows, 1 on other valid tokens (answer span,
            EOS, rows left alone), 0 on padding.
        reshaped: (B, T) bool, tokens whose weight came from the gate.
        floored: (B, T) bool, suppressed tokens that hit the floor before renormalisation.
        boosted: (B, T) bool, tokens on the boost branch with raw weight > 1.
        fallback: (B,) bool, rows with NaN/inf importance on a reasoning token: kept uniform (a defined fallback,
            never a silent NaN advantage).
        no_reasoning: (B,) bool, rows to reshape (``reshape_rows``) with valid tokens but no reasoning token to
            weight: kept uniform (the rows without an answer span, docs/method.md §2, and a response that opens
            with its answer).
    """

    weights: torch.Tensor
    reshaped: torch.Tensor
    floored: torch.Tensor
    boosted: torch.Tensor
    fallback: torch.Tensor
    no_reasoning: torch.Tensor


def gate(normalized: torch.Tensor, mask: torch.Tensor, tau: float, beta: float, floor: float):
    """Bi-level gating of normalised scores, then renormalisation to Σw = R per row.

    Args:
        normalized: (B, T) scores in [0, 1]. mask: (B, T) bool reasoning tokens.
        tau: quantile level in [0, 1). beta: boost >= 0. floor: in (0, 1].

    Returns:
        (w, floored, boosted): w (B, T) float64 weights > 0 on masked entries summing to the row's mask count, 0
        elsewhere; floored / boosted (B, T) bool as in :class:`TokenWeights`.
    """
    theta = masked_quantile(normalized, mask, tau)[:, None]
    ramp = normalized / (theta + _EPS)
    high = 1.0 + beta * (normalized - theta) / (1.0 - theta + _EPS)
    suppressed = normalized < theta
    w = torch.where(suppressed, ramp.clamp(min=floor), high)
    w = torch.where(mask, w, 0.0)
    r = mask.sum(-1, keepdim=True).to(w.dtype)
    w = w * r / w.sum(-1, keepdim=True).clamp(min=_EPS)
    return w, mask & suppressed & (ramp <= floor), mask & ~suppressed & (high > 1.0)


def oar_token_weights(importance: torch.Tensor, reasoning_mask: torch.Tensor, response_mask: torch.Tensor,
                      tau: float, beta: float, floor: float = 0.1,
                      reshape_rows: torch.Tensor | None = None, *,
                      signed: str = SIGNED_SCORES_DEFAULT) -> TokenWeights:
    """Per-token OAR weights of a response batch.

    Args:
        importance: (B, T) raw importance, response-aligned.
        reasoning_mask: (B, T) bool, the tokens to reshape.
        response_mask: (B, T) 0/1 valid response tokens.
        tau, beta, floor: gating parameters.
        reshape_rows: (B,) bool, rows to reshape (default all); other rows keep w = 1.
        signed: how the gate reads signed scores, a name in :data:`SIGNED_SCORES` (``algorithm.oar.signed_scores``).

    Returns:
        TokenWeights.
    """
    valid = response_mask.bool()
    mask = reasoning_mask.bool() & valid
    finite = (torch.isfinite(importance) | ~mask).all(-1)
    rows = finite if reshape_rows is None else finite & reshape_rows.bool()
    mask_r = mask & rows[:, None]
    safe = torch.where(mask_r, importance.double(), 0.0)
    w, floored, boosted = gate(normalize_scores(safe, mask_r, signed), mask_r, tau, beta, floor)
    weights = torch.where(mask_r, w, valid.double())
    wanted = torch.ones_like(finite) if reshape_rows is None else reshape_rows.bool()
    return TokenWeights(weights.float(), mask_r, floored, boosted, ~finite & mask.any(-1),
                        wanted & valid.any(-1) & ~mask.any(-1))
