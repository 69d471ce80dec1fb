"""OAR-P's perturbation policies (``algorithm.oar.perturbation``), a registry: ``exact`` (one masked copy per
reasoning token) and, for long reasoning, ``segment``, ``hierarchical`` and ``auto`` over reasoning segments
(:mod:`oar_verl.core.text.segments`). What each computes, and why the segment score is spread s / n over its n tokens:
docs/method.md §8; costs: docs/scaling.md.

Every policy runs its levels through the same OAR-P passes (a block layout in, one score per block out:
:func:`oar_verl.core.methods.perturbation.oar_p` on the step's backend), given to it as a callable; each level runs on
every data-parallel rank alike. The registered ``perturbation`` method (:func:`run_oar_p`) is OAR-P under the policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oar_verl.core.backends.base import AttributionBackend
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.contract import AttributionResult, MethodInputs, method
from oar_verl.core.methods.mask_operator import method_replacement
from oar_verl.core.methods.perturbation import block_copies, mask_blocks, oar_p
from oar_verl.core.registry import Registry

# (B, L) block ids -> (B, L) float32 score of each token's block (0 off the blocks); see
# oar_verl.core.methods.perturbation.oar_p
RunBlocks = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["POLICIES", "Policy", "PolicyOptions", "PolicyResult", "policy_importance", "refined_segments",
           "register_policy", "segment_table", "spread_segment_scores", "token_blocks"]


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


@dataclass(frozen=True)
class PolicyOptions:
    """The settings a policy reads.

    Attributes:
        refine_share: share of a row's reasoning tokens refined at token level (``hierarchical``, ``auto``), in (0, 1].
        exact_max_tokens: ``auto`` runs exact OAR-P on rows with at most this many reasoning tokens.
        exact_blocks: (B, L) long token-level layout of ``exact`` (None: one block per reasoning token;
            :func:`~oar_verl.core.methods.perturbation.mask_blocks` for ``mask_span`` blocks).
    """

    refine_share: float = 0.1
    exact_max_tokens: int = 512
    exact_blocks: torch.Tensor | None = None


# (run_blocks, reasoning_mask (B, L) bool, segments (B, L) long ids inside the reasoning or None, options) -> result
RunPolicy = Callable[[RunBlocks, torch.Tensor, "torch.Tensor | None", PolicyOptions], "PolicyResult"]


@dataclass(frozen=True)
class Policy:
    """A registered perturbation policy and its facts.

    Attributes:
        run: (run_blocks, reasoning_mask, segments, options) -> PolicyResult.
        segments: it reads the rows' reasoning segments (preprocessing builds them only then).
        mask_span: its token level takes ``algorithm.oar.mask_span`` > 1 blocks (elsewhere mask_span must be 1).
    """

    run: RunPolicy
    segments: bool
    mask_span: bool


POLICIES: Registry[Policy] = Registry("perturbation policy", "algorithm.oar.perturbation")


def register_policy(name: str, *, segments: bool, mask_span: bool = False) -> Callable[[RunPolicy], RunPolicy]:
    """Decorator: register the decorated function as the policy ``name`` (``algorithm.oar.perturbation``)."""

    def add(run: RunPolicy) -> RunPolicy:
        POLICIES.register(name)(Policy(run, segments, mask_span))
        return run

    return add


def policy_importance(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor | None,
                      policy: str, *, refine_share: float = 0.1, exact_max_tokens: int = 512,
                      exact_blocks: torch.Tensor | None = None) -> PolicyResult:
    """OAR-P importance under the registered perturbation policy ``policy`` (see the module docstring).

    Args:
        run_blocks: runs OAR-P on a block layout: (B, L) long block ids (-1 = not perturbed) -> (B, L) score of each
            token's block. Called once per level the policy has, on every data-parallel rank alike (a level with no
            local copies still runs, to align collectives).
        reasoning_mask: (B, L) bool.
        segments: (B, L) long segment ids (-1 off), required by a policy that reads segments; segments lie inside the
            reasoning.
        policy: a name in :data:`POLICIES`: ``exact`` | ``segment`` | ``hierarchical`` | ``auto``.
        refine_share, exact_max_tokens, exact_blocks: :class:`PolicyOptions`.

    Returns:
        PolicyResult.
    """
    entry = POLICIES.get(policy)
    reasoning_mask = reasoning_mask.bool()
    if entry.segments:
        if segments is None:
            raise ValueError(f"the {policy!r} perturbation policy needs reasoning segments")
        segments = torch.where(reasoning_mask, segments, -1)
    return entry.run(run_blocks, reasoning_mask, segments, PolicyOptions(refine_share, exact_max_tokens, exact_blocks))


@register_policy("exact", segments=False, mask_span=True)
def exact_policy(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor | None,
                 options: PolicyOptions) -> PolicyResult:
    """One masked copy per reasoning token (or per ``mask_span`` block): one level."""
    reasoning = reasoning_mask.sum(-1)
    blocks = token_blocks(reasoning_mask) if options.exact_blocks is None else options.exact_blocks
    return PolicyResult(run_blocks(blocks), _copies_per_row(blocks), reasoning.clone(), reasoning)


@register_policy("segment", segments=True)
def segment_policy(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor,
                   options: PolicyOptions) -> PolicyResult:
    """One copy per segment, its score spread s / n over its n tokens: one level."""
    reasoning = reasoning_mask.sum(-1)
    _, _, spread, copies = _segment_level(run_blocks, segments, torch.ones_like(reasoning, dtype=torch.bool))
    return PolicyResult(spread, copies, torch.zeros_like(reasoning), reasoning)


@register_policy("hierarchical", segments=True)
def hierarchical_policy(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor,
                        options: PolicyOptions) -> PolicyResult:
    """The segment level, then exact OAR-P inside the top segments covering ``refine_share`` of each row: two
    levels."""
    by_segment = torch.ones(reasoning_mask.shape[0], dtype=torch.bool, device=reasoning_mask.device)
    return _refined(run_blocks, reasoning_mask, segments, by_segment, options.refine_share)


@register_policy("auto", segments=True)
def auto_policy(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor,
                options: PolicyOptions) -> PolicyResult:
    """Exact OAR-P on rows with at most ``exact_max_tokens`` reasoning tokens, hierarchical on the others: two
    levels (run on every rank whatever its rows)."""
    by_segment = reasoning_mask.sum(-1) > options.exact_max_tokens
    return _refined(run_blocks, reasoning_mask, segments, by_segment, options.refine_share)


def _segment_level(run_blocks: RunBlocks, segments: torch.Tensor, by_segment: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The segment level on the rows ``by_segment`` (B,) bool: (segment blocks (B, L), their scores (B, L), the
    spread scores (B, L) float32, copies per row (B,))."""
    seg_blocks = torch.where(by_segment[:, None], segments, -1)
    seg_scores = run_blocks(seg_blocks)
    return seg_blocks, seg_scores, spread_segment_scores(seg_scores, seg_blocks), _copies_per_row(seg_blocks)


def _refined(run_blocks: RunBlocks, reasoning_mask: torch.Tensor, segments: torch.Tensor, by_segment: torch.Tensor,
             share: float) -> PolicyResult:
    """The segment level on the rows ``by_segment`` (B,) bool, then a token level over the top segments of those
    rows (:func:`refined_segments`) and every reasoning token of the others."""
    reasoning = reasoning_mask.sum(-1)
    seg_blocks, seg_scores, spread, copies = _segment_level(run_blocks, segments, by_segment)
    scores, lengths = segment_table(seg_scores, seg_blocks)
    refine = refined_segments(scores, lengths, share)
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


@method("perturbation", forward_only=True, reads_gradients=False, uses_mask_token=True,
        segments=lambda cfg: POLICIES.get(cfg.perturbation).segments)
def run_oar_p(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=perturbation``: OAR-P under the policy ``perturbation`` (:data:`POLICIES`), each level one
    :func:`~oar_verl.core.methods.perturbation.oar_p` over the backend (levels aligned over the ranks one by one)."""
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
