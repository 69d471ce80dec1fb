"""From a rank's rows to what the attribution methods run on: spans → target → attribution batch (→ reasoning
segments, for OAR-P's segment-level policies) → seeds.

One function, :func:`prepare_attribution`, called by :func:`oar_verl.core.pipeline.attribute` (the one way in, for
every integration) and by the tests that check the integrations against the core. Everything here is verl-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oar_verl.core.methods.attribution import METHODS, probe_kinds
from oar_verl.core.checks.startup import check_config, require_resolved
from oar_verl.core.config import OARConfig
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import (AttributionBatch, build_attribution_batch, build_reference_responses,
                                        with_segments)
from oar_verl.core.checks.mask_token import check_mask_token
from oar_verl.core.text.segments import reasoning_segments
from oar_verl.core.text.spans import AnswerSpans, locate_answer_spans
from oar_verl.core.text.turns import split_segments_at_turns, turn_layout

__all__ = ["PreparedAttribution", "model_token_mask", "pad_rows", "prepare_attribution", "row_fingerprints",
           "spans_to_weight"]


@dataclass(frozen=True)
class PreparedAttribution:
    """A batch of rows ready for :func:`oar_verl.core.methods.attribution.run_attribution`.

    Attributes:
        batch: AttributionBatch (B, L): each prompt followed by its response, or with ``target=reference`` by the
            response's reasoning + the conclusion text + the ground-truth answer.
        seeds: (B,) int64 OAR-G noise seeds, from (seed, step, the row's content).
        mask_token_id: the replacement token of ``mask=pad`` / ``mask=token`` (:func:`oar_verl.core.checks.mask_token.
            check_mask_token`); None with the other operators.
        spans: AnswerSpans (B, T) of the responses themselves, after :func:`spans_to_weight` (what the estimator
            reshapes and the dumps show: with the response's own target, a row without an answer span has no
            reasoning tokens).
        response_lengths: (B,) tokens of each response.
        model_mask: (B, T) bool the model's own tokens of each response (multi-turn rows: not the tool outputs, user
            turns and template tokens between turns; docs/multi_turn.md); None: every response token (single-turn).
    """

    batch: AttributionBatch
    seeds: torch.Tensor
    mask_token_id: int | None
    spans: AnswerSpans
    response_lengths: list[int]
    model_mask: torch.Tensor | None = None

    @property
    def answer_probe(self) -> torch.Tensor:
        """(B,) bool: the probe read answer tokens (AS-Mean / AS-Joint on a span), the response's own or, with
        ``target=reference``, the ground truth's; False where it read LT-Logits."""
        return self.batch.probe.reads_span.cpu()

    @property
    def response_mask(self) -> torch.Tensor:
        """(B, T) bool valid tokens of the responses (T: the longest response), as :attr:`spans` is laid out."""
        lengths = torch.tensor(self.response_lengths, dtype=torch.long)
        return torch.arange(self.spans.reasoning_mask.shape[1])[None, :] < lengths[:, None]

    @property
    def longest(self) -> int:
        """Tokens of the longest attributed sequence (0 without rows): what a pass budget must at least hold."""
        lengths = self.batch.attention_mask.sum(-1)
        return int(lengths.max()) if lengths.numel() else 0

    def padded_importance(self, importance: torch.Tensor) -> torch.Tensor:
        """(B, T) float32 CPU importance of the response tokens from (B, L) full-sequence scores, 0 on padding.

        With ``target=reference`` the attributed response is reasoning + conclusion + ground truth; the reasoning is a
        prefix of both it and the real response, so the scores map back position by position (0 beyond).
        """
        mask = self.response_mask
        scores = importance[:, self.batch.response_start:].float().cpu()[:, :mask.shape[1]]
        padded = scores.new_zeros(mask.shape)
        padded[:, :scores.shape[1]] = scores
        return torch.where(mask, padded, 0.0)

    def response_importance(self, importance: torch.Tensor) -> list[torch.Tensor]:
        """Per row, the (n_i,) float32 CPU importance of its response tokens (:meth:`padded_importance`, unpadded)."""
        padded = self.padded_importance(importance)
        return [padded[i, :n] for i, n in enumerate(self.response_lengths)]


def pad_rows(rows: Sequence[torch.Tensor], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) padded ids and (B, N) 0/1 mask from a list of 1-D tensors (left or right padding)."""
    n = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):  # per row; the copy itself is a slice assignment
        if len(r):
            sl = slice(n - len(r), n) if left else slice(0, len(r))
            ids[i, sl] = r.long()
            mask[i, sl] = 1
    return ids, mask


def row_fingerprints(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64 content hash of each unpadded (prompt, response): a sequence id that does not depend on padding,
    micro-batching or the data-parallel layout.

    Args:
        prompts: (B, P) ids.
        prompt_mask: (B, P) 0/1.
        responses: (B, T) ids.
        response_mask: (B, T) 0/1.
    """
    ids = torch.cat([prompts, responses], dim=1).long()
    mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    pos = mask.cumsum(-1)  # 1-based position among the real tokens
    return (mask * (ids + 1) * (pos * 0x9E3779B1 + 7)).sum(-1)  # wrapping int64 arithmetic


def spans_to_weight(spans: AnswerSpans, target: str) -> AnswerSpans:
    """The spans whose reasoning tokens OAR weights (docs/method.md §2, "Rows without an answer span").

    With ``target=response`` a row without an answer span has no outcome of its own to read (its probe would explain
    log p(EOS), or the token after a truncated row's cut): it gets no reasoning tokens, so it is not scored and keeps
    GRPO's uniform weights (w = 1 on every token). With ``target=reference`` the probe reads the ground truth appended
    after the reasoning, defined on every row: the spans are returned unchanged.

    Args:
        spans: AnswerSpans (B, T) of the responses (:func:`~oar_verl.core.text.spans.locate_answer_spans`).
        target: ``algorithm.oar.target`` (``response`` | ``reference``).

    Returns:
        AnswerSpans (B, T): ``reasoning_mask`` kept on rows with a span (``found``), empty on the others; the other
        fields unchanged.
    """
    if target == "reference":
        return spans
    return dataclasses.replace(spans, reasoning_mask=spans.reasoning_mask & spans.found[:, None])


def model_token_mask(responses: Sequence[torch.Tensor], model_masks: Sequence[torch.Tensor] | None,
                     width: int) -> torch.Tensor | None:
    """(B, width) bool the model's own tokens of B responses from per-row 1-D 0/1 masks (verl's agent-loop
    ``response_mask``, OpenRLHF's ``action_mask``), right-padded with False; None for ``model_masks`` None or a
    batch whose every response token is the model's (a single-turn batch: the single-turn path, bit for bit).

    Raises:
        ValueError: not one mask per response, or a mask whose length differs from its response's.
    """
    if model_masks is None:
        return None
    if len(model_masks) != len(responses):
        raise ValueError(f"model_masks: {len(model_masks)} masks for {len(responses)} responses")
    bad = [i for i, (m, r) in enumerate(zip(model_masks, responses)) if m.numel() != r.numel()]  # per row
    if bad:
        i = bad[0]
        raise ValueError(f"model_masks: row {i} has {model_masks[i].numel()} mask entries for "
                         f"{responses[i].numel()} response tokens (the model-token mask must cover the response: "
                         "verl's response_mask, 0 on tool outputs)")
    mask, _ = pad_rows([m.reshape(-1).long() != 0 for m in model_masks], 0, left=False)
    mask = mask[:, :width] if mask.shape[1] >= width else torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
    lengths = torch.tensor([r.numel() for r in responses], dtype=torch.long)
    valid = torch.arange(width)[None, :] < lengths[:, None]
    model = mask.bool() & valid
    return None if bool(torch.equal(model, valid)) else model


def prepare_attribution(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], tokenizer,
                        cfg: OARConfig, global_step: int, *, ground_truths: Sequence[str] | None = None,
                        device: torch.device | str | None = None,
                        model_masks: Sequence[torch.Tensor] | None = None) -> PreparedAttribution:
    """Build the attribution inputs of a batch of (prompt, response) token rows.

    Args:
        prompts: B unpadded 1-D prompt id tensors.
        responses: B unpadded 1-D response id tensors.
        tokenizer: the policy's tokenizer (answer spans via its byte table; conclusion and ground truths encoded
            with it; pad and mask tokens).
        cfg: OARConfig.
        global_step: selects the probe (``probe=auto``) and seeds the OAR-G noise.
        ground_truths: B answer strings, required with ``target=reference``.
        device: where the attribution batch goes (the model's device).
        model_masks: B 1-D 0/1 masks of each response's own tokens (multi-turn rows: 0 on tool outputs and the
            template between turns); None: every token. Only the model's tokens are ever reasoning (masked,
            replaced, scored, reshaped) or answer (the last span among them), and OAR-P's segments never cross a
            turn (:mod:`oar_verl.core.text.turns`, docs/multi_turn.md).

    Returns:
        PreparedAttribution.

    Raises:
        ValueError: ``target=reference`` without one ground truth per row; ``model_masks`` not matching the rows.
        OARConfigError: ``mask=pad`` / ``mask=token`` with an unsafe token (an EOS, end-of-turn or other special
            token; :func:`oar_verl.core.checks.mask_token.unsafe_mask_reason`).
    """
    check_config(require_resolved(cfg))  # the names and their combinations (core-only users have no start-up)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids, prompt_mask = pad_rows(prompts, pad_id, left=True)
    response_ids, response_mask = pad_rows(responses, pad_id, left=False)
    model = model_token_mask(responses, model_masks, response_ids.shape[1])
    spans = spans_to_weight(locate_answer_spans(response_ids, response_mask, tokenizer, cfg.answer_patterns,
                                                model_mask=model), cfg.target)
    target = (response_ids, response_mask, spans.reasoning_mask, spans.answer_mask)
    if cfg.target == "reference":
        if ground_truths is None or len(ground_truths) != len(responses) or any(t is None for t in ground_truths):
            raise ValueError(f"{cfg.prefix}.target=reference needs a ground-truth answer for every sample "
                             "(reward_model.ground_truth in the data set, as verl's RL parquet format has it)")
        conclude = tokenizer.encode(cfg.conclude_text, add_special_tokens=False)
        answers = [tokenizer.encode(str(t), add_special_tokens=False) for t in ground_truths]
        target = build_reference_responses(response_ids, response_mask, spans.reasoning_mask, conclude, answers,
                                           pad_id)
    device = torch.device("cpu") if device is None else torch.device(device)
    kinds = probe_kinds(cfg, global_step, len(responses))
    batch = build_attribution_batch(*(t.to(device) for t in (prompt_ids, prompt_mask, *target, kinds)))
    if METHODS.get(cfg.mode).segments(cfg):  # OAR-P's segment-level policies
        segments = reasoning_segments(response_ids, response_mask, spans.reasoning_mask, tokenizer, cfg.segment_split,
                                      cfg.segment_min_tokens, cfg.segment_max_tokens)
        if model is not None:  # a segment never crosses a tool output: each turn's tokens are masked on their own
            segments = split_segments_at_turns(segments, turn_layout(response_mask, model).turn)
        batch = with_segments(batch, segments)
    seeds = sequence_seeds(cfg.seed, global_step, row_fingerprints(prompt_ids, prompt_mask, response_ids,
                                                                    response_mask)).to(device)
    mask_id = check_mask_token(cfg, tokenizer)  # pad / token: vetted (not an EOS or end-of-turn marker); else None
    return PreparedAttribution(batch, seeds, mask_id, spans, [len(r) for r in responses], model)
