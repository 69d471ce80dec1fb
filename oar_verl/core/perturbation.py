"""OAR-P: counterfactual masking (docs/method.md §3, with the official code's memory blow-up fixed, §7).

For every reasoning position t, replace y_t by the mask token (length unchanged) and score
I_t = KL(P_clean ‖ P^(t)) (or φ_clean − φ^(t) with AS-Joint). Full-vocabulary logits are computed only at the probe
positions, and the masked copies stream through the model in passes packed under a token budget
(:mod:`oar_verl.core.budget`: a copy holds its whole row, so a pass of c copies of an n-token row holds c × n tokens),
so peak memory is set by the budget, not by the reasoning length R.

Two execution paths, same numbers:

* **batched**: copies of all sequences are packed into passes, each trimmed to the columns its rows use;
* **prefix cache** (``prefix_cache=True``, the default): a copy masked at t shares tokens [0, t) with the clean
  sequence, so each sequence runs one clean forward that keeps its key/value cache, and each pass of its copies
  (consecutive positions from t_first on) recomputes only the suffix [t_first, n) on top of the cached prefix, which
  is read in place, never copied per copy. This saves the prompt and the reasoning before each pass: roughly half the
  OAR-P compute for typical prompt/response lengths.

``mask_span`` = k > 1 masks k consecutive reasoning tokens per copy (each token of the block gets the block's score):
k times fewer forwards, an approximation of k = 1 (the exact method).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oar_verl.core.budget import PassLimits, copies_per_pass, pack_copies, pack_rows, row_spans
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.memory import PassKind
from oar_verl.core.prefix_cache import shared_prefix_cache
from oar_verl.core.probes import ProbeOutput, outcome_shift, probe_forward, probe_from_logits


def clean_probe(model: torch.nn.Module, batch: AttributionBatch, limits: PassLimits) -> tuple[ProbeOutput, int]:
    """Outcome probe of the unperturbed rows, (B, V) / (B,), in passes packed under the budget; and the pass count."""
    B = batch.input_ids.shape[0]
    logp, phi = None, None
    packs = pack_rows(batch.attention_mask, limits, PassKind.FORWARD)
    for rows in packs:
        lo, hi = column_window(batch.attention_mask, rows)
        out = probe_forward(model, batch.probe.index(rows).columns(lo, hi), **batch.model_inputs(rows, lo, hi))
        if logp is None:
            logp = out.logp.new_zeros(B, out.logp.shape[-1])
            phi = out.phi.new_zeros(B)
        logp[rows], phi[rows] = out.logp, out.phi
    if logp is None:
        dev = batch.input_ids.device
        return ProbeOutput(torch.zeros(B, 0, device=dev), torch.zeros(B, device=dev)), 0
    return ProbeOutput(logp, phi), len(packs)


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
    explicit layout (reasoning segments, :mod:`oar_verl.core.hierarchical`).

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


def copy_masks(blocks: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(N, n) bool: the tokens each copy masks, i.e. those sharing the block id at its first masked column.

    Args:
        blocks: (N, n) block ids of each copy's source row (a column window of :func:`mask_blocks`).
        first: (N,) first masked column of each copy, in the window's coordinates.
    """
    return blocks == blocks.gather(1, first[:, None])


def collective_rounds(batch: AttributionBatch, limits: PassLimits, prefix_cache: bool = True,
                      mask_span: int = 1, blocks: torch.Tensor | None = None) -> int:
    """Forward passes :func:`oar_p_importance` runs on this batch (each a collective round under sharding)."""
    rows, _, _ = masked_copies(batch.reasoning_mask, mask_span, blocks)
    if prefix_cache:
        src, counts = torch.unique_consecutive(rows.cpu(), return_counts=True)
        start, end = _spans(batch)
        return sum(1 + -(-n // copies_per_pass(end[b] - start[b], limits, PassKind.FORWARD_CACHED))
                   for b, n in zip(src.tolist(), counts.tolist()))
    clean = len(pack_rows(batch.attention_mask, limits, PassKind.FORWARD))
    return clean + len(pack_copies(rows, batch.attention_mask, limits, PassKind.FORWARD))


@torch.no_grad()
def oar_p_importance(model: torch.nn.Module, batch: AttributionBatch, mask_token_id: int, limits: PassLimits,
                     min_rounds: int = 0, prefix_cache: bool = True, mask_span: int = 1,
                     blocks: torch.Tensor | None = None) -> torch.Tensor:
    """OAR-P importance of every reasoning token (or of every token of an explicit block layout).

    Args:
        model: Hugging Face causal LM (or a sharded wrapper), in eval mode.
        batch: AttributionBatch (B, L).
        mask_token_id: the replacement token (the tokenizer's pad token by default).
        limits: the token budget of one pass (and optional caps and memory guard).
        min_rounds: run at least this many forwards (the max of :func:`collective_rounds` over data-parallel ranks,
            so that every rank issues the same collectives); extra rounds repeat the first row's clean forward and
            are discarded; needs B >= 1.
        prefix_cache: reuse each sequence's clean key/value cache for the unchanged prefix (model must support
            ``past_key_values``).
        mask_span: reasoning tokens masked together per copy (1 = exact OAR-P).
        blocks: (B, L) long explicit block layout (:func:`block_copies`), one copy per block; overrides
            ``mask_span``.

    Returns:
        (B, L) float32 importance at reasoning positions (every token of a block gets the block's score), 0
        elsewhere. Non-finite model outputs propagate as
        NaN/inf; the gating turns such rows into uniform weights.
    """
    if prefix_cache:
        importance, ran = _prefix_cached(model, batch, mask_token_id, limits, masked_copies(
            batch.reasoning_mask, mask_span, blocks))
    else:
        importance, ran = _batched(model, batch, mask_token_id, limits, masked_copies(batch.reasoning_mask, mask_span,
                                                                                      blocks))
    if min_rounds > ran:
        if batch.input_ids.shape[0] == 0:
            raise ValueError("min_rounds needs at least one local row to repeat")
        first = torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
        lo, hi = column_window(batch.attention_mask, first)
        for _ in range(min_rounds - ran):
            probe_forward(model, batch.probe.index(first).columns(lo, hi), **batch.model_inputs(first, lo, hi))
    return importance


def _spans(batch: AttributionBatch) -> tuple[list[int], list[int]]:
    """Each row's first and one-past-last real column, as host lists (metadata, once per batch)."""
    start, end = row_spans(batch.attention_mask.cpu())
    return start.tolist(), end.tolist()


def _batched(model, batch: AttributionBatch, mask_token_id: int, limits: PassLimits,
             copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    device = batch.input_ids.device
    clean, ran = clean_probe(model, batch, limits)
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    rows_all, cols_all, blocks = copies
    for s, e in pack_copies(rows_all, batch.attention_mask, limits, PassKind.FORWARD):
        rows, first = rows_all[s:e], cols_all[s:e]
        lo, hi = column_window(batch.attention_mask, rows)
        inputs = batch.model_inputs(rows, lo, hi)
        masked = copy_masks(blocks[rows, lo:hi], first - lo)
        inputs["input_ids"] = inputs["input_ids"].masked_fill(masked, mask_token_id)
        spec = batch.probe.index(rows).columns(lo, hi)
        shift = outcome_shift(clean.index(rows), probe_forward(model, spec, **inputs), spec.joint).float()
        _assign(importance, rows, lo, masked, shift)
        ran += 1
    return importance, ran


def _prefix_cached(model, batch: AttributionBatch, mask_token_id: int, limits: PassLimits,
                   copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    device = batch.input_ids.device
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    rows_all, cols_all, blocks = copies
    starts = rows_all.new_zeros(batch.input_ids.shape[0] + 1)
    starts[1:] = torch.bincount(rows_all, minlength=batch.input_ids.shape[0]).cumsum(0)
    starts = starts.tolist()  # host metadata, once per batch
    ran = 0
    for b in range(batch.input_ids.shape[0]):  # one clean forward per sequence: its cache is the shared prefix
        if starts[b] == starts[b + 1]:
            continue  # nothing to perturb in this row
        row = torch.tensor([b], device=device)
        lo, hi = column_window(batch.attention_mask, row)
        inputs = batch.model_inputs(row, lo, hi)
        spec = batch.probe.index(row).columns(lo, hi)
        keep = (spec.logit_weight != 0).any(0).nonzero().squeeze(1)
        out = model(**inputs, logits_to_keep=keep, use_cache=True)
        clean = probe_from_logits(out.logits, spec.logit_weight[:, keep], spec.target_ids[:, keep], spec.joint)
        cache = out.past_key_values
        ran += 1
        per_pass = copies_per_pass(hi - lo, limits, PassKind.FORWARD_CACHED)
        for s in range(starts[b], starts[b + 1], per_pass):
            first = cols_all[s: min(s + per_pass, starts[b + 1])] - lo
            c, t0 = first.shape[0], int(first.min())
            if int(keep.min()) < t0:  # a probe position before the masked tokens: cannot come from the suffix
                raise ValueError("prefix_cache needs every probe position after the perturbed tokens")
            masked = copy_masks(blocks[b, lo:hi].expand(c, -1), first)  # (c, n)
            suffix = inputs["input_ids"].expand(c, -1).masked_fill(masked, mask_token_id)[:, t0:]
            logits = model(input_ids=suffix, attention_mask=inputs["attention_mask"].expand(c, -1),
                           position_ids=inputs["position_ids"][:, t0:].expand(c, -1),
                           past_key_values=shared_prefix_cache(cache, t0, c), logits_to_keep=keep - t0,
                           use_cache=True).logits
            rows = row.expand(c)
            w = spec.logit_weight[:, keep].expand(c, -1)
            pert = probe_from_logits(logits, w, spec.target_ids[:, keep].expand(c, -1), spec.joint.expand(c))
            shift = outcome_shift(clean.index(torch.zeros(c, dtype=torch.long, device=device)), pert,
                                  spec.joint.expand(c)).float()
            _assign(importance, rows, lo, masked, shift)
            ran += 1
    return importance, ran


def _assign(importance: torch.Tensor, rows: torch.Tensor, lo: int, masked: torch.Tensor, shift: torch.Tensor) -> None:
    """Give every masked token of each copy its copy's score: importance[rows, lo + j] = shift where masked."""
    r, j = masked.nonzero().unbind(1)
    importance[rows[r], lo + j] = shift[r]


def column_window(attention_mask: torch.Tensor, rows: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) columns that hold a real token in any of ``rows``; padding-only columns are skipped."""
    used = attention_mask[rows].bool().any(0)
    if not bool(used.any()):
        return 0, attention_mask.shape[1]
    cols = used.nonzero().squeeze(1)
    return int(cols[0]), int(cols[-1]) + 1
