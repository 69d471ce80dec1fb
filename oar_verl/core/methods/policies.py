"""OAR-P's perturbation policies: exact, and for long reasoning segment-level and hierarchical (docs/method.md §8,
docs/scaling.md).

Exact OAR-P runs one masked copy per reasoning token, and each copy recomputes its suffix, so its cost grows with the
square of the reasoning length. Two cheaper policies mask whole reasoning *segments* (steps or sentences,
:mod:`oar_verl.core.text.segments`):

* **segment**: one copy per segment (every token of the segment replaced by the mask token, length unchanged); the
  segment's score s (the probe's KL, as in OAR-P) is spread evenly over its n tokens, s / n each, so that a
  segment's tokens carry its score in total and long segments do not dominate the per-sequence gating quantiles;
* **hierarchical**: the segment pass first, then exact token-level OAR-P only inside the top segments by score --
  those covering ``refine_share`` of the row's reasoning tokens -- while the other tokens keep their segment's spread
  score. With every segment refined (``refine_share = 1``) every token has its exact score: the result *is* exact
  OAR-P;
* **auto**: exact OAR-P on rows whose reasoning has at most ``exact_max_tokens`` tokens, hierarchical above.

Every level runs through the same OAR-P passes (a block layout in, one score per block out: prefix key/value reuse,
token budget and rank alignment included: :func:`oar_verl.core.methods.perturbation.oar_p` on the step's backend), given
here as a callable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oar_verl.core.backends.base import AttributionBackend
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.mask_operator import method_replacement
from oar_verl.core.methods.contract import AttributionResult, MethodInputs, method
from oar_verl.core.methods.perturbation import block_copies, mask_blocks, oar_p

POLICIES = ("exact", "segment", "hierarchical", "auto")

# (B, L) block ids -> (B, L) float32 score of each token's block (0 off the blocks); see oar_verl.core.methods.perturbation.oar_p
RunBlocks = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["POLICIES", "PolicyResult", "policy_importance", "refined_segments", "segment_table",
           "spread_segment_scores", "token_blocks"]


@dataclass(frozen=True)
class PolicyResult:
    """Importance under a perturbation policy, and what ran.

    Attributes:
        importance: (B, L) float32, 0 off the reasoning tokens.
        copies: (B,) long masked copies run per row (segment copies + token copies).
        refined: (B,) long reasoning tokens per row scored at token level (exact OAR-P scores).
        reasoning: (B,) long reasoning tokens per row.
    """

    importance: torch.Tensor
    copies: torch.Tensor
    refined: torch.Tensor
    reasoning: torch.Tensor


def token_blocks(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) long: one block per True token of ``mask`` (B, L) bool (its rank among the row's True tokens), -1 off."""
    rank = mask.long().cumsum(-1) - 1
    return torch.where(mask, rank, torch.full_like(rank, -1))


def segment_table(block_scores: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment scores and token counts.

    Args:
        block_scores: (B, L) each token's segment score (the output of a segment-level pass).
        segments: (B, L) long segment ids 0..S_b-1 per row, -1 off the segments.

    Returns:
        (scores (B, S), lengths (B, S) long), S = the most segments of any row; absent segments have length 0 and
        score 0.
    """
    B = segments.shape[0]
    S = int(segments.max()) + 1 if segments.numel() else 0
    S = max(S, 0)
    on = segments >= 0
    idx = segments.clamp(min=0)
    lengths = torch.zeros(B, S + 1, dtype=torch.long, device=segments.device)
    lengths.scatter_add_(1, torch.where(on, idx, S), on.long())
    scores = torch.zeros(B, S + 1, dtype=block_scores.dtype, device=segments.device)
    scores.scatter_(1, torch.where(on, idx, S), torch.where(on, block_scores, 0))  # a segment's tokens agree
    return scores[:, :S], lengths[:, :S]


def spread_segment_scores(block_scores: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """(B, L) float32: each segment token's share of its segment's score, s / n (n the segment's tokens), 0 off.

    Args:
        block_scores: (B, L) each token's segment score. segments: (B, L) long segment ids, -1 off.
    """
    _, lengths = segment_table(block_scores, segments)
    n = lengths.gather(1, segments.clamp(min=0)) if lengths.numel() else torch.ones_like(segments)
    return torch.where(segments >= 0, block_scores / n.clamp(min=1), 0.0).float()


def refined_segments(scores: torch.Tensor, lengths: torch.Tensor, share: float) -> torch.Tensor:
    """(B, S) bool: the segments to refine, top scores first, until they cover ``share`` of the row's tokens.

    A segment is refined when the segments ranked above it hold fewer than ``share`` × (the row's segment tokens), so
    at least the top segment of every non-empty row is refined (share > 0), and share = 1 refines every segment. A
    NaN score ranks first (the row's weights turn uniform in the gating anyway).

    Args:
        scores: (B, S) segment scores. lengths: (B, S) long tokens per segment (0: no such segment).
        share: in (0, 1].
    """
    key = torch.where(lengths > 0, scores.nan_to_num(nan=float("inf")), float("-inf"))
    order = key.argsort(dim=-1, descending=True, stable=True)
    ranked = lengths.gather(1, order)
    before = ranked.cumsum(-1) - ranked
    pick = (ranked > 0) & (before < share * lengths.sum(-1, keepdim=True))
    return torch.zeros_like(pick).scatter(1, order, pick)


def policy_importance(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor | None,
                      policy: str, *, refine_share: float = 0.1, exact_max_tokens: int = 512,
                      exact_blocks: torch.Tensor | None = None) -> PolicyResult:
    """OAR-P importance under a perturbation policy (see the module docstring).

    Args:
        run_blocks: runs OAR-P on a block layout: (B, L) long block ids (-1 = not perturbed) -> (B, L) score of each
            token's block. Called once per level the policy has, on every data-parallel rank alike (a level with no
            local copies still runs, to align collectives).
        reasoning_mask: (B, L) bool.
        segments: (B, L) long segment ids (-1 off), required unless ``policy='exact'``; segments lie inside the
            reasoning.
        policy: ``exact`` | ``segment`` | ``hierarchical`` | ``auto``.
        refine_share: share of a row's reasoning tokens refined at token level (hierarchical), in (0, 1].
        exact_max_tokens: ``auto`` runs exact OAR-P on rows with at most this many reasoning tokens.
        exact_blocks: the token-level layout of ``exact`` (default one block per reasoning token; ``mask_span`` blocks
            otherwise).

    Returns:
        PolicyResult.
    """
    if policy not in POLICIES:
        raise ValueError(f"perturbation policy {policy!r} is not one of {', '.join(POLICIES)}")
    reasoning_mask = reasoning_mask.bool()
    reasoning = reasoning_mask.sum(-1)
    if policy == "exact":
        blocks = token_blocks(reasoning_mask) if exact_blocks is None else exact_blocks
        importance = run_blocks(blocks)
        return PolicyResult(importance, _copies_per_row(blocks), reasoning.clone(), reasoning)
    if segments is None:
        raise ValueError(f"the {policy!r} perturbation policy needs reasoning segments")
    segments = torch.where(reasoning_mask, segments, -1)
    by_segment = (reasoning > exact_max_tokens) if policy == "auto" else torch.ones_like(reasoning, dtype=torch.bool)
    seg_blocks = torch.where(by_segment[:, None], segments, -1)
    seg_scores = run_blocks(seg_blocks)
    spread = spread_segment_scores(seg_scores, seg_blocks)
    copies = _copies_per_row(seg_blocks)
    if policy == "segment":
        return PolicyResult(spread, copies, torch.zeros_like(reasoning), reasoning)
    scores, lengths = segment_table(seg_scores, seg_blocks)
    refine = refined_segments(scores, lengths, refine_share)
    in_refined = (seg_blocks >= 0) & refine.gather(1, seg_blocks.clamp(min=0)) if refine.numel() else \
        torch.zeros_like(reasoning_mask)
    refine_mask = torch.where(by_segment[:, None], in_refined, reasoning_mask)
    tok_blocks = token_blocks(refine_mask)
    token_scores = run_blocks(tok_blocks)
    importance = torch.where(refine_mask, token_scores, spread)
    return PolicyResult(importance, copies + _copies_per_row(tok_blocks), refine_mask.sum(-1), reasoning)


def _copies_per_row(blocks: torch.Tensor) -> torch.Tensor:
    """(B,) long masked copies a block layout (B, L) runs per row."""
    rows, _ = block_copies(blocks)
    return torch.bincount(rows, minlength=blocks.shape[0])


@method("perturbation", forward_only=True, segments=lambda cfg: cfg.perturbation != "exact")
def run_oar_p(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=perturbation``: OAR-P under ``perturbation`` (exact, segment, hierarchical, auto), each level one
    :func:`~oar_verl.core.methods.perturbation.oar_p` over the backend (levels are aligned over the ranks one by one)."""
    mask = method_replacement(backend, batch, cfg, inputs, "OAR-P")  # once for every level
    own = 0

    def run_blocks(blocks: torch.Tensor) -> torch.Tensor:  # one level of the policy, aligned over the ranks
        nonlocal own
        importance, n = oar_p(backend, batch, blocks, mask)
        own += n
        return importance

    res = policy_importance(run_blocks, batch.reasoning_mask, batch.segments, cfg.perturbation,
                            refine_share=cfg.refine_share, exact_max_tokens=cfg.exact_max_tokens,
                            exact_blocks=mask_blocks(batch.reasoning_mask, cfg.mask_span))
    return AttributionResult(res.importance, own, res.copies, res.refined, res.reasoning)
