"""The row layout of multi-turn responses (verl's agent loop, OpenRLHF's agent path): which response tokens are the
model's own and which are context (tool outputs, user turns, the chat-template tokens between turns), and the
assistant turns the model's tokens form (docs/multi_turn.md).

The rules, written once here and read by every step that touches a row (docs/multi_turn.md §1):

* the **model's tokens** are the response tokens the policy sampled (verl's ``response_mask`` = 1; OpenRLHF's
  ``action_mask``; TRL's ``completion_mask`` x ``tool_mask``); every other valid response token is **context**: kept
  in every pass's input, never masked, replaced, scored, reshaped or counted in the advantage mass;
* an **assistant turn** is a maximal run of the model's tokens; turn k is the k-th run (0-based);
* the **answer span** is the last span among the **model's own tokens**, searched turn by turn from the final turn
  back (a match never spans a tool output): a span that appears only inside a tool output is never used (the
  recipes' reward grades the last ``#### N`` of the model's own text alike, oar_verl/rewards); a row with no span in
  any of its turns follows the single-turn rule for such rows (docs/method.md §2: no reasoning token, w = 1, left
  out of fidelity);
* reasoning tokens are the model's tokens (EOS / pad excluded) before the answer marker: every turn before the
  answer's, and that turn's tokens before the marker; the model's tokens after the answer (a later turn) are
  neither reasoning nor answer (w = 1), as tokens after the answer are in a single-turn row.

A single-turn row (every valid token the model's) has one turn, its final turn is the whole response, and every rule
reduces to the single-turn one bit for bit. Verl-free; no per-token Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["TurnLayout", "split_segments_at_turns", "turn_layout", "turn_shares"]


@dataclass(frozen=True)
class TurnLayout:
    """The turns of a batch of responses.

    Attributes:
        model: (B, T) bool the model's own tokens (valid and sampled by the policy).
        context: (B, T) bool valid response tokens that are not the model's (tool outputs, user turns, template).
        turn: (B, T) long the assistant turn of each model token (0, 1, ...), -1 on context and padding.
        final: (B, T) bool the model's tokens of each row's final (last) turn.
        turns: (B,) long assistant turns per row.
        context_runs: (B,) long maximal runs of context tokens per row: one per round of tool responses the agent
            loop appended (verl's ToolAgentLoop puts a round's parallel calls' outputs in one run, and counts the
            round as one turn in its ``num_turns``).
    """

    model: torch.Tensor
    context: torch.Tensor
    turn: torch.Tensor
    final: torch.Tensor
    turns: torch.Tensor
    context_runs: torch.Tensor


def _run_starts(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool first token of every maximal run of True in a (B, T) bool mask."""
    prev = F.pad(mask[:, :-1], (1, 0), value=False)
    return mask & ~prev


def turn_layout(valid: torch.Tensor, model: torch.Tensor | None = None) -> TurnLayout:
    """The turns of B responses.

    Args:
        valid: (B, T) 0/1, bool or float: the real response tokens (the model's and the context's).
        model: (B, T) 0/1, bool or float: the model's own tokens (verl's ``response_mask``); None: every valid token
            (a single-turn batch).

    Returns:
        TurnLayout (B, T) on ``valid``'s device; ``model`` is taken inside ``valid``.
    """
    valid = valid.bool()
    model = valid if model is None else (model.to(valid.device).bool() & valid)
    if model.shape != valid.shape or valid.dim() != 2:
        raise ValueError(f"valid and model must both be (B, T); got {tuple(valid.shape)} and {tuple(model.shape)}")
    starts = _run_starts(model)
    index = starts.long().cumsum(-1) - 1  # (B, T) the turn a model token belongs to
    turns = starts.sum(-1)
    turn = torch.where(model, index, -1)
    final = model & (index == (turns - 1)[:, None])
    context = valid & ~model
    return TurnLayout(model, context, turn, final, turns, _run_starts(context).sum(-1))


def split_segments_at_turns(segments: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Reasoning-segment ids renumbered so that no segment crosses a turn boundary (a segment that would hold tokens
    of two turns, around a tool output, becomes two): OAR-P's segment-level copies then mask one turn's tokens.

    Args:
        segments: (B, T) long segment ids 0..S-1 in order of position on the reasoning tokens, -1 elsewhere
            (:func:`oar_verl.core.text.segments.reasoning_segments`).
        turn: (B, T) long turn ids (:attr:`TurnLayout.turn`), -1 off the model's tokens.

    Returns:
        (B, T) long ids 0..S'-1 in order of position, -1 where ``segments`` is -1; unchanged on single-turn rows.
    """
    if segments.numel() == 0:
        return segments
    on = segments >= 0
    key = torch.where(on, segments * (turn.max().clamp(min=0) + 1) + turn.clamp(min=0), -1)
    # the previous reasoning token's key (of the row), by carrying the last seen key forward over the gaps
    pos = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    last_on = torch.where(on, pos, -1).cummax(-1).values  # (B, T) index of the latest reasoning token at or before
    prev_idx = F.pad(last_on[:, :-1], (1, 0), value=-1)
    prev_key = torch.where(prev_idx >= 0, key.gather(1, prev_idx.clamp(min=0)), -1)
    start = on & (key != prev_key)
    return torch.where(on, start.long().cumsum(-1) - 1, -1)


def turn_shares(weights: torch.Tensor, reasoning: torch.Tensor, layout: TurnLayout,
                rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each turn's share of a row's reshaped credit, over the rows with at least two turns that were reshaped.

    A turn's share is Σ w over its reasoning tokens / Σ w over the row's reasoning tokens (= R, the mass OAR moves:
    docs/method.md §5); GRPO's (uniform) share is the turn's reasoning tokens / R.

    Args:
        weights: (B, T) token weights w. reasoning: (B, T) bool the reshaped (reasoning) tokens.
        layout: TurnLayout (B, T). rows: (B,) bool the rows reshaped.

    Returns:
        0-d float64 tensors (NaN where no row qualifies): ``first`` / ``last`` (OAR's share of the first and the final
        turn), ``first_uniform`` / ``last_uniform`` (GRPO's), and ``rows``: the qualifying rows.
    """
    reasoning = reasoning.bool() & layout.model
    keep = rows.bool() & (layout.turns >= 2) & reasoning.any(-1)
    w = torch.where(reasoning, weights.double(), 0.0)
    total, count = w.sum(-1).clamp(min=1e-30), reasoning.sum(-1).clamp(min=1).double()
    first, last = reasoning & (layout.turn == 0), reasoning & layout.final
    n = keep.sum()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(n > 0, torch.where(keep, x, 0.0).sum() / n.clamp(min=1), float("nan"))

    return {"first": mean(torch.where(first, w, 0.0).sum(-1) / total),
            "last": mean(torch.where(last, w, 0.0).sum(-1) / total),
            "first_uniform": mean(first.sum(-1) / count), "last_uniform": mean(last.sum(-1) / count),
            "rows": n.double()}
