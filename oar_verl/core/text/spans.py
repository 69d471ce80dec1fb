"""Final-answer spans of responses, as token masks: the response bytes are scanned for the answer
(:mod:`oar_verl.core.text.answer_patterns`) and byte spans are mapped back to token positions through per-token byte offsets
(:mod:`oar_verl.core.text.token_bytes`). Nothing is ever re-tokenised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from oar_verl.core.text.answer_patterns import BUILTIN_PATTERNS, find_answer_span
from oar_verl.core.text.token_bytes import selected_byte_lengths
from oar_verl.core.text.turns import turn_layout


__all__ = ["AnswerSpans", "locate_answer_spans"]


@dataclass(frozen=True)
class AnswerSpans:
    """Per-token masks of the reasoning and answer parts of a batch of responses.

    Attributes:
        reasoning_mask: (B, T) bool. Valid response tokens whose bytes end at or before the answer marker (without a
            found answer: every valid token except EOS / pad tokens).
        answer_mask: (B, T) bool. Valid tokens overlapping the answer value (e.g. the ``42`` of ``\\boxed{42}``).
        found: (B,) bool. Whether some pattern matched the row.
        pattern_index: (B,) long. Index into the ``patterns`` tuple of the pattern that matched, -1 if none.

    Marker tokens (``\\boxed{``, ``#### ``, "The answer is "), tokens after the value and EOS are in neither mask.
    """

    reasoning_mask: torch.Tensor
    answer_mask: torch.Tensor
    found: torch.Tensor
    pattern_index: torch.Tensor


def _as_id_list(ids: int | Iterable[int] | None) -> list[int]:
    """An int, an iterable of ints (Nones dropped) or None as a list of ints."""
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids if i is not None]


def _turn_byte_offsets(tok_len: torch.Tensor, turn: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """(B, K) long the byte offset at which each assistant turn starts in the row's model-token bytes (K the most
    turns of a row; entries past a row's turns unused).

    Args:
        tok_len: (B, T) long byte length of each scanned token, 0 elsewhere. turn: (B, T) long turn ids, -1 off the
            model's tokens. turns: (B,) long turns per row.
    """
    K = max(int(turns.max()) if turns.numel() else 0, 1)
    per_turn = torch.zeros(turn.shape[0], K + 1, dtype=torch.long)
    per_turn.scatter_add_(1, (turn + 1).clamp(min=0), tok_len)  # column 0 collects the non-model tokens (0 bytes)
    return per_turn[:, 1:].cumsum(-1) - per_turn[:, 1:]


def locate_answer_spans(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tokenizer,
    patterns: Sequence[str] = BUILTIN_PATTERNS,
    eos_token_ids: int | Iterable[int] | None = None,
    model_mask: torch.Tensor | None = None,
) -> AnswerSpans:
    """Reasoning and answer token masks of a batch of responses.

    Args:
        response_ids: (B, T) long token ids (right-padded; any layout works, only ``response_mask`` counts).
        response_mask: (B, T) 0/1, bool or float: which positions are real response tokens.
        tokenizer: a transformers tokenizer; its byte table is built once and cached (:func:`token_byte_table`).
        patterns: answer patterns, see :func:`find_answer_span`.
        eos_token_ids: int or ids never counted as reasoning; default ``tokenizer.eos_token_id``.  Positions holding
            ``tokenizer.pad_token_id`` (if the tokenizer has one) are never reasoning either.
        model_mask: (B, T) 0/1 the model's own tokens of multi-turn responses (verl's agent-loop ``response_mask``:
            0 on tool outputs); None: every valid token (single-turn). Only the model's tokens are ever searched,
            reasoning or answer: the answer is the last span among the model's own tokens, searched turn by turn
            from the final turn back (never across a tool output), so a span inside a tool output is never found
            (:mod:`oar_verl.core.text.turns`).

    Returns:
        :class:`AnswerSpans` with (B, T) bool masks and (B,) ``found`` / ``pattern_index``, on ``response_ids.device``.
        Found: reasoning = valid tokens ending at or before the marker start (EOS / pad excluded); answer = valid
        tokens overlapping [value_start, value_end).  Not found: reasoning = valid tokens except EOS / pad; answer
        empty.  Rows with no valid token: all False, not found.

    Raises:
        ValueError: shapes differ, or a valid token id is negative. Ids beyond the tokenizer's vocabulary (unused
        embedding rows a model may still sample) count as empty text, with one warning per process.
    """
    if response_ids.dim() != 2 or response_mask.shape != response_ids.shape:
        raise ValueError(
            f"response_ids and response_mask must both be (B, T); got {tuple(response_ids.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    device = response_ids.device
    B, T = response_ids.shape
    if B == 0 or T == 0:
        empty = torch.zeros(B, T, dtype=torch.bool, device=device)
        found = torch.zeros(B, dtype=torch.bool, device=device)
        return AnswerSpans(empty, empty.clone(), found, torch.full((B,), -1, dtype=torch.long, device=device))

    ids = response_ids.detach().to("cpu", torch.long)
    valid = response_mask.detach().to("cpu") != 0
    layout = turn_layout(valid, None if model_mask is None else model_mask.detach().to("cpu"))
    # Byte offsets of the model's tokens, batch-wide: every other token (padding, context) gets length 0 so it
    # shifts no offset (docs/multi_turn.md §1).
    scanned = layout.model  # single-turn: every valid token, as always
    table, known, tok_len = selected_byte_lengths(ids, scanned, tokenizer, "response")
    ends = tok_len.cumsum(dim=1)
    starts = ends - tok_len
    turn_bytes = _turn_byte_offsets(tok_len, layout.turn, layout.turns)

    # Byte spans per row (the only per-row Python work: joining each turn's bytes and scanning them, from the final
    # turn back; a match never spans two turns).  Rows without an answer keep (0, 0, 0, -1); the `found` gate below
    # makes those values irrelevant.
    spans = [(0, 0, 0, -1)] * B
    for b in range(B):
        row_ids, row_turns = ids[b][known[b]], layout.turn[b][known[b]]
        for k in range(int(layout.turns[b]) - 1, -1, -1):
            part = row_ids[row_turns == k].tolist()
            hit = find_answer_span(b"".join([table[i] for i in part]), patterns) if part else None
            if hit is not None:
                base = int(turn_bytes[b, k])
                spans[b] = (hit[0] + base, hit[1] + base, hit[2] + base, hit[3])
                break
    marker, v_start, v_end, pattern_index = torch.tensor(spans, dtype=torch.long).reshape(B, 4).unbind(1)
    found = pattern_index >= 0

    never_reasoning = _as_id_list(tokenizer.eos_token_id if eos_token_ids is None else eos_token_ids)
    never_reasoning += _as_id_list([getattr(tokenizer, "pad_token_id", None)])
    if never_reasoning:
        special = torch.isin(ids, torch.tensor(never_reasoning, dtype=torch.long))
    else:
        special = torch.zeros_like(valid)
    candidates = layout.model & ~special
    f = found[:, None]
    reasoning = candidates & (~f | (ends <= marker[:, None]))
    answer = scanned & f & (starts < v_end[:, None]) & (ends > v_start[:, None])
    return AnswerSpans(
        reasoning.to(device), answer.to(device), found.to(device), pattern_index.contiguous().to(device)
    )
