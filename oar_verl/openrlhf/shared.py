"""Attribution read from OpenRLHF's experience-maker forward (``--oar.shared_forward``; docs/method.md §14).

OpenRLHF's experience maker asks the policy actors for every sample's action log-probs (``PolicyModelActor.forward``)
with the weights its next ``fit`` starts from. That forward is the clean forward ``fisher`` and ``conservative``
need: the OAR actor runs it inside the method's :class:`~oar_verl.core.backends.shared.SharedAttribution`
(:func:`attributed_forward`), OpenRLHF's log-probs unchanged, and keeps each sample's scores by its tokens
(:class:`SharedRows`). OpenRLHF may send a sample to another rank's replay buffer (``balance_experiences``), so at
``fit`` every rank's rows are gathered (:meth:`SharedRows.gathered`) and each item finds its own by its tokens; an
item with none is attributed by the method's own passes, as without sharing. The seconds of attribution's own work
inside those forwards (the preparation, the method's backwards, reading the scores out; not OpenRLHF's forward) are
kept with the rows (:attr:`SharedRows.seconds`) for ``fit`` to report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from oar_verl.core.backends.collectives import gather_objects
from oar_verl.core.backends.memory import fixed_recompute
from oar_verl.core.backends.budget import row_spans
from oar_verl.core.backends.shared import ForwardLayout, Stopwatch
from oar_verl.core.config import OARConfig
from oar_verl.core.methods.attribution import shared_attribution
from oar_verl.core.methods.contract import AttributionResult
from oar_verl.core.pipeline import RowAttribution, row_attribution
from oar_verl.core.preprocess import prepare_attribution
from oar_verl.openrlhf.reshape import item_rows

__all__ = ["SharedRows", "attributed_forward", "batch_items", "row_key"]


def row_key(sequences: torch.Tensor, attention_mask: torch.Tensor) -> bytes:
    """A sample's identity across OpenRLHF's calls: its real tokens (int64 bytes)."""
    return sequences.reshape(-1)[attention_mask.reshape(-1).bool()].to("cpu", torch.int64).numpy().tobytes()


def batch_items(sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor) -> list:
    """The forward's (b, L) rows as the replay buffer will hold them: one item per row, the right padding cut as
    OpenRLHF's ``remove_padding_in_sequences`` cuts it (``sequences``, ``action_mask``, ``attention_mask``)."""
    items = []
    for i in range(sequences.shape[0]):  # per row: rows of different lengths
        right = int(attention_mask[i].flip(0).argmax())
        end = None if right == 0 else -right
        items.append(SimpleNamespace(sequences=sequences[i, :end].cpu(), action_mask=action_mask[i, :end].cpu(),
                                     attention_mask=attention_mask[i, :end].cpu()))
    return items


def forward_layout(attention_mask: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                   packed: bool) -> ForwardLayout:
    """Where OpenRLHF's forward holds each row's first ``lengths[i]`` real tokens (the prompt and response the
    attribution batch holds from column ``starts[i]``): packed end to end in row order (``packing_samples``), else at
    their (b, L) positions.

    Args:
        attention_mask: (b, L) the forward's. starts, lengths: (b,) long, the attribution batch's.
    """
    real = attention_mask.bool().cpu()
    b, L = real.shape
    slot, pos = real.nonzero().unbind(1)  # row-major, as OpenRLHF's unpad orders them
    rank = real.long().cumsum(-1)[slot, pos] - 1  # each token's index among its row's real tokens
    flat = torch.arange(slot.shape[0]) if packed else slot * L + pos
    keep = rank < lengths.cpu()[slot]
    slot, flat, rank = slot[keep], flat[keep], rank[keep]
    rows = torch.arange(b)
    return ForwardLayout(rows, flat, slot, rows[slot], starts.cpu()[slot] + rank)


@dataclass
class SharedRows:
    """Per sample (:func:`row_key`), its response-aligned scores read from the experience-maker forward of one step.

    Attributes:
        step: the training step they were read for (the probe schedule's).
        mode: the method that read them.
        rows: key -> (importance (n,) float32, reasoning (n,) bool, answer (n,) bool, span found, answer probe).
        seconds: attribution's own seconds inside the forwards that read them (accelerator-synchronised at each
            timed segment's ends; OpenRLHF's forwards not counted): this rank's, or after :meth:`gathered` the
            slowest rank's.
    """

    step: int
    mode: str
    rows: dict[bytes, tuple] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, keys: Sequence[bytes], att: RowAttribution) -> None:
        for i, key in enumerate(keys):  # per row
            n = int(att.response_mask[i].sum())
            self.rows[key] = (att.importance[i, :n].float().clone(), att.reasoning_mask[i, :n].clone(),
                              att.answer_mask[i, :n].clone(), bool(att.span_found[i]), bool(att.answer_probe[i]))

    def gathered(self) -> SharedRows:
        """Every rank's rows, and the slowest rank's seconds (every rank calls it together)."""
        out = SharedRows(self.step, self.mode)
        for rows, seconds in gather_objects((self.rows, self.seconds)):
            out.rows.update(rows)
            out.seconds = max(out.seconds, seconds)
        return out

    def attribution(self, items: Sequence, response_mask: torch.Tensor) -> RowAttribution:
        """The items' rows found here as a :class:`RowAttribution` of the whole replay buffer (``response_mask``
        (N, T)); the others not attributed."""
        att = RowAttribution.unattributed(response_mask)
        for i, it in enumerate(items):  # per item
            found = self.rows.get(row_key(it.sequences, it.attention_mask))
            if found is None:
                continue
            imp, reasoning, answer, span, probe = found
            n = imp.shape[0]
            if n != int(response_mask[i].sum()):
                continue  # another response split: not this item's row
            att.importance[i, :n], att.reasoning_mask[i, :n], att.answer_mask[i, :n] = imp, reasoning, answer
            att.attributed[i], att.span_found[i], att.answer_probe[i] = True, span, probe
        return att


@contextlib.contextmanager
def attributed_forward(model: torch.nn.Module, tokenizer, cfg: OARConfig, step: int, items: Sequence,
                       attention_mask: torch.Tensor, *, packed: bool, checkpointing: bool,
                       device: torch.device) -> Iterator[SharedRows]:
    """Run OpenRLHF's one policy forward of ``items``' rows inside: on the way out the yielded :class:`SharedRows`
    holds their ``cfg.mode`` scores.

    Args:
        model: the policy's causal LM (the DeepSpeed engine's module) the forward runs.
        items: :func:`batch_items` of the forward's rows. attention_mask: (b, L) the forward's.
        packed: OpenRLHF's ``packing_samples`` (rows packed end to end).
        checkpointing: the actor's gradient checkpointing (the backward recomputes alike unless ``recompute`` says).
    """
    clock = Stopwatch()  # attribution's work around the forward; the reader times its own inside it
    out = SharedRows(step, cfg.mode)
    with clock():
        rows = item_rows(items)
        prepared = prepare_attribution(rows.prompts, rows.responses, tokenizer, cfg, step, device=device,
                                       model_masks=rows.actions)  # tool outputs: context (docs/multi_turn.md)
        batch = prepared.batch
        start, end = row_spans(batch.attention_mask)
        held = [it.sequences[it.attention_mask.bool()] for it in items]  # what the forward attends to, row by row
        unread = any(len(h) < int(n) or not torch.equal(h[:int(n)], batch.input_ids[i, int(s):int(e)].cpu())
                     for i, (h, s, e, n) in enumerate(zip(held, start, end, end - start)))  # per row
    if unread:
        out.seconds = clock.seconds
        yield out  # a row whose prompt holds masked tokens: its items are attributed by their own passes
        return
    with clock():
        layout = forward_layout(attention_mask, start, end - start, packed)
        shared = shared_attribution(model, batch, cfg, fixed_recompute(cfg.recompute, checkpointing),
                                    mask_token_id=prepared.mask_token_id, seeds=prepared.seeds)
    with shared.forward(ForwardLayout(*(t.to(device) for t in (layout.rows, layout.flat, layout.slot, layout.row,
                                                              layout.col)))):
        yield out
    with clock():
        result = AttributionResult(shared.result(), len(shared.choices))
        out.add([row_key(it.sequences, it.attention_mask) for it in items], row_attribution(prepared, result))
    out.seconds = clock.seconds + shared.seconds
