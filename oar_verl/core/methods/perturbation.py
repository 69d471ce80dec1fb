"""OAR-P: counterfactual masking (docs/method.md §3, with the official code's memory blow-up fixed, §7), written once
over the backend interface (:mod:`oar_verl.core.backends.base`).

Each reasoning token y_t is replaced by the mask (:mod:`oar_verl.core.methods.mask_operator`) and scored
I_t = KL(P_clean ‖ P^(t)) (φ_clean − φ^(t) with AS-Joint). The masked copies stream through the model in passes packed
under the token budget, with full-vocabulary logits only at the probe positions, so peak memory is set by the budget,
not by the reasoning length R. Two plans give the same numbers: batched copies, or copies continuing their row's clean
key/value prefix (``prefix_cache``). ``mask_span`` > 1 and the segment policies (:mod:`oar_verl.core.methods.policies`)
mask blocks. Details: docs/method.md §3 ("Two plans, same numbers") and §8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oar_verl.core.backends.base import (AttributionBackend, Pass, Replacement, first_row, shift_callback,
                                         with_fillers)
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.backends.memory import PassKind


def mask_blocks(reasoning_mask: torch.Tensor, span: int) -> torch.Tensor:
    """(B, L) long block id of every reasoning token (its rank among the row's reasoning tokens // span), -1 off."""
    rank = reasoning_mask.long().cumsum(-1) - 1
    return torch.where(reasoning_mask, rank // span, torch.full_like(rank, -1))


def block_copies(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked copies of a block layout: one per block, at the block's first column.

    Args:
        blocks: (B, L) long block id of every token to perturb, -1 elsewhere; ids non-decreasing along each row
            (a block is the tokens sharing an id: consecutive tokens, or a run with non-perturbed tokens inside).

    Returns:
        (source row (N,), first column (N,)), row-major (a row's copies are consecutive, by position).
    """
    if blocks.shape[1] == 0:
        return blocks.new_zeros(0), blocks.new_zeros(0)
    before = F.pad(blocks[:, :-1], (1, 0), value=-1).cummax(-1).values  # highest id left of each column
    return (blocks > before).nonzero().unbind(1)


def masked_copies(reasoning_mask: torch.Tensor, span: int,
                  blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked copies OAR-P runs: one per block of ``span`` consecutive reasoning tokens, or one per block of an
    explicit layout (reasoning segments, :mod:`oar_verl.core.methods.policies`).

    Args:
        reasoning_mask: (B, L) bool. span: reasoning tokens masked together (1 = exact OAR-P).
        blocks: (B, L) long explicit block ids (see :func:`block_copies`); overrides ``span``.

    Returns:
        (source row (N,), first masked column (N,), block ids (B, L)), copies in row-major order (a row's copies are
        consecutive, by position).
    """
    if blocks is None:
        blocks = mask_blocks(reasoning_mask, span)
    rows, cols = block_copies(blocks)
    return rows, cols, blocks


def as_replacement(mask: int | Replacement) -> Replacement:
    """A mask token id as the :class:`~oar_verl.core.backends.base.Replacement` that swaps it in (a Replacement as is)."""
    return mask if isinstance(mask, Replacement) else Replacement(token=int(mask))


def oar_p_passes(backend: AttributionBackend, batch: AttributionBatch, blocks: torch.Tensor,
                 mask: int | Replacement) -> list[Pass]:
    """The passes OAR-P runs on ``batch`` for a block layout (B, L) (one copy per block, its block replaced by
    ``mask``: a token id or a :class:`~oar_verl.core.backends.base.Replacement`), before rank alignment.

    With the backend's prefix cache: per row with copies, its clean pass (cache kept), then its copies in passes that
    reuse the cache. Without: the clean rows packed, then every copy packed in order.
    """
    src, first = block_copies(blocks)
    mask = as_replacement(mask)
    if not backend.prefix_cache:
        rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
        return ([Pass(rows[p]) for p in backend.plan(batch, rows, PassKind.FORWARD)]
                + [Pass(src[p], first[p], blocks, mask)
                   for p in backend.plan(batch, src, PassKind.FORWARD, ordered=True)])
    passes = []
    row_ids, counts = torch.unique_consecutive(src, return_counts=True)
    offsets = (counts.cumsum(0) - counts).tolist()  # host metadata, once per batch
    for b, s, n in zip(row_ids.tolist(), offsets, counts.tolist()):  # per row with copies, never per copy
        passes.append(Pass(row_ids.new_tensor([b]), cache="keep"))
        idx = torch.arange(s, s + n, device=src.device)
        passes += [Pass(src[idx[p]], first[idx[p]], blocks, mask, cache="reuse")
                   for p in backend.plan(batch, src[idx], PassKind.FORWARD_CACHED, ordered=True)]
    return passes


def oar_p(backend: AttributionBackend, batch: AttributionBatch, blocks: torch.Tensor, mask: int | Replacement
          ) -> tuple[torch.Tensor, int]:
    """OAR-P importance of every token of a block layout, on any backend.

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        blocks: (B, L) long block id of every token to perturb, -1 elsewhere (:func:`mask_blocks`, or a segment
            layout); one masked copy per block.
        mask: what replaces a copy's block: a token id, or a :class:`~oar_verl.core.backends.base.Replacement`
            (``algorithm.oar.mask``, :func:`oar_verl.core.methods.mask_operator.mask_replacement`).

    Returns:
        ((B, L) float32 importance: every token of a block gets its copy's score, 0 off the blocks; the passes this
        rank needed before alignment). Non-finite model outputs propagate as
        NaN/inf; the gating turns such rows into uniform weights.
    """
    own = oar_p_passes(backend, batch, blocks, mask)
    passes = with_fillers(own, backend.align(len(own)), Pass(first_row(batch), filler=True), batch)
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)

    def emit(p: Pass, shift: torch.Tensor) -> None:
        r, j = p.replaced().nonzero().unbind(1)  # every token a copy masked gets the copy's score
        importance[p.rows[r], j] = shift.float().to(importance.device)[r]

    backend.run(batch, passes, shift_callback(backend, passes, batch.input_ids.shape[0], batch.probe.joint, emit))
    # every rank of a model-parallel group needs the scores: a policy's next level is planned from them
    return backend.share(importance), len(own)
