"""Padded batch layout shared by the attribution methods.

verl's layout: prompts left-padded to P columns, responses right-padded to T columns, ``input_ids = [prompts |
responses]`` (B, P + T). Response-aligned masks therefore map to full-sequence masks by left-padding P columns, and a
full-sequence score maps back by dropping the first P columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from oar_verl.core.batch.probes import ProbeSpec, build_probe_spec


@dataclass(frozen=True)
class AttributionBatch:
    """Everything an attribution method needs, in full-sequence coordinates.

    Attributes:
        input_ids: (B, L) long, L = P + T.
        attention_mask: (B, L) long 0/1.
        position_ids: (B, L) long.
        reasoning_mask: (B, L) bool, the positions to attribute.
        probe: ProbeSpec over (B, L).
        response_start: P, the first response column.
        segments: (B, L) long reasoning-segment ids (-1 off), for OAR-P's segment-level policies; None when not
            needed (:func:`with_segments` adds them).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    reasoning_mask: torch.Tensor
    probe: ProbeSpec
    response_start: int
    segments: torch.Tensor | None = None

    def model_inputs(self, rows: torch.Tensor | None = None, lo: int = 0, hi: int | None = None) -> dict:
        """Model kwargs for a subset of rows and a column window [lo, hi)."""
        sel = (lambda t: t[rows, lo:hi]) if rows is not None else (lambda t: t[:, lo:hi])
        return {"input_ids": sel(self.input_ids), "attention_mask": sel(self.attention_mask),
                "position_ids": sel(self.position_ids)}


def with_segments(batch: AttributionBatch, segments: torch.Tensor) -> AttributionBatch:
    """The batch with response-aligned segment ids (B, T) laid out in full-sequence coordinates (B, L): shifted by
    the prompt columns, cut or padded (-1) to the batch's response width, and kept only on reasoning tokens (with
    ``target=reference`` the attributed reasoning is a prefix of the response's, position by position)."""
    B, L = batch.input_ids.shape
    width = L - batch.response_start
    seg = segments.to(batch.input_ids.device).long()[:, :width]
    seg = F.pad(seg, (batch.response_start, width - seg.shape[1]), value=-1)
    return dataclasses.replace(batch, segments=torch.where(batch.reasoning_mask, seg, -1))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids of a left-padded batch: 0 at the first real token, clamped to 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def first_index(mask: torch.Tensor, default: torch.Tensor | int) -> torch.Tensor:
    """(B,) index of the first True per row of a (B, N) mask, ``default`` where the row has none."""
    idx = mask.int().argmax(-1)
    return torch.where(mask.any(-1), idx, torch.as_tensor(default, device=mask.device))


def last_index(mask: torch.Tensor, default: torch.Tensor | int) -> torch.Tensor:
    """(B,) index of the last True per row of a (B, N) mask, ``default`` where the row has none."""
    n = mask.shape[-1]
    idx = n - 1 - mask.flip(-1).int().argmax(-1)
    return torch.where(mask.any(-1), idx, torch.as_tensor(default, device=mask.device))


def build_attribution_batch(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                            response_mask: torch.Tensor, reasoning_mask: torch.Tensor, answer_mask: torch.Tensor,
                            probe_kind: torch.Tensor) -> AttributionBatch:
    """Assemble the full-sequence attribution batch.

    Args:
        prompts: (B, P) long, left-padded.
        prompt_mask: (B, P) 0/1.
        responses: (B, T) long, right-padded.
        response_mask: (B, T) 0/1.
        reasoning_mask: (B, T) bool, response tokens to attribute.
        answer_mask: (B, T) bool, answer-value tokens (the probe's teacher-forced answer).
        probe_kind: (B,) long :class:`~oar_verl.core.batch.probes.ProbeKind` per row.

    Returns:
        AttributionBatch; LT-Logits reads the position predicting the first answer token, or (no span) the last
        reasoning token, or (no reasoning either) the last real token.
    """
    P = prompts.shape[1]
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    reasoning_full = F.pad(reasoning_mask.bool() & response_mask.bool(), (P, 0))
    answer_full = F.pad(answer_mask.bool() & response_mask.bool(), (P, 0))
    last_real = last_index(attention_mask.bool(), 0)
    lt_no_span = last_index(reasoning_full, last_real)
    lt = torch.where(answer_full.any(-1), first_index(answer_full, 0) - 1, lt_no_span).clamp(min=0)
    probe = build_probe_spec(input_ids, answer_full, lt, probe_kind)
    return AttributionBatch(input_ids, attention_mask, position_ids_from_mask(attention_mask), reasoning_full, probe, P)


def build_reference_responses(responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                              conclude_ids: list[int], answer_ids: list[list[int]], pad_token_id: int):
    """Responses for ``target=reference``: each row's response up to its last reasoning token + conclude text + its
    ground-truth answer.

    The kept head is positions [0, c_b) of the response, c_b one past the last reasoning token: on a single-turn row
    the reasoning itself (a prefix: it ends before the answer marker or before EOS); on a multi-turn row also the
    tool outputs between its turns, kept as context (docs/multi_turn.md). Positions [0, c_b) of the rebuilt response
    are the original ones, so scores map back unchanged.

    Args:
        responses: (B, T) long; response_mask: (B, T) 0/1; reasoning_mask: (B, T) bool.
        conclude_ids: token ids of the conclusion text. answer_ids: per row, token ids of the ground-truth answer.
        pad_token_id: filler for the new right padding.

    Returns:
        (responses', response_mask', reasoning_mask', answer_mask'), each (B, T') with T' the longest rebuilt row.
    """
    B, T = responses.shape
    if len(answer_ids) != B:
        raise ValueError(f"target=reference needs one ground-truth answer per row: got {len(answer_ids)} for {B} rows")
    reasoning_mask = reasoning_mask.bool() & response_mask.bool()
    cut_t = torch.where(reasoning_mask.any(-1), last_index(reasoning_mask, 0) + 1, 0)
    cut = cut_t.tolist()  # host metadata, once per batch
    rows, ans = [], []
    for b in range(B):  # per sequence, not per token: concatenation of three token lists
        head = responses[b, : cut[b]]
        tail = torch.tensor(list(conclude_ids) + list(answer_ids[b]), dtype=responses.dtype, device=responses.device)
        rows.append(torch.cat([head, tail]))
        ans.append((cut[b] + len(conclude_ids), len(answer_ids[b])))
    t_new = max([len(r) for r in rows], default=0)
    out = torch.full((B, t_new), pad_token_id, dtype=responses.dtype, device=responses.device)
    lengths = torch.tensor([len(r) for r in rows], device=responses.device)
    if B:
        out[torch.arange(t_new, device=responses.device)[None, :] < lengths[:, None]] = torch.cat(rows)
    col = torch.arange(t_new, device=responses.device)[None, :]
    mask = (col < lengths[:, None]).long()
    kept = F.pad(reasoning_mask, (0, max(t_new - T, 0)))[:, :t_new]
    reasoning = kept & (col < cut_t.to(responses.device)[:, None])
    a0 = torch.tensor([a for a, _ in ans], device=responses.device)[:, None]
    an = torch.tensor([n for _, n in ans], device=responses.device)[:, None]
    answer = (col >= a0) & (col < a0 + an)
    return out, mask, reasoning, answer
