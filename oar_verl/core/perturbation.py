"""OAR-P: counterfactual masking (docs/method.md §3, with the official code's memory blow-up fixed, §7).

For every reasoning position t, replace y_t by the mask token (length unchanged) and score
I_t = KL(P_clean ‖ P^(t)) (or φ_clean − φ^(t) with AS-Joint). Full-vocabulary logits are computed only at the probe
positions, and the masked copies stream through the model in chunks of ``chunk_size`` rows, so peak memory depends on
the chunk size, not on the reasoning length R.

Two execution paths, same numbers:

* **batched** (default): copies of all sequences are packed into chunks, each chunk trimmed to the columns its rows
  use;
* **prefix cache** (``prefix_cache=True``): a copy masked at t shares tokens [0, t) with the clean sequence, so each
  sequence runs one clean forward that keeps its key/value cache, and each chunk of its copies (consecutive positions
  from t_first on) recomputes only the suffix [t_first, n) on top of the cached prefix. This saves the prompt and
  the reasoning before each chunk: roughly half the OAR-P compute for typical prompt/response lengths.

``mask_span`` = k > 1 masks k consecutive reasoning tokens per copy (each token of the block gets the block's score):
k times fewer forwards, an approximation of k = 1 (the exact method).
"""

from __future__ import annotations

import copy
import math

import torch

from oar_verl.core.layout import AttributionBatch
from oar_verl.core.probes import ProbeOutput, outcome_shift, probe_forward, probe_from_logits


def clean_probe(model: torch.nn.Module, batch: AttributionBatch, micro_batch_size: int) -> ProbeOutput:
    """Outcome probe of the unperturbed rows, (B, V) / (B,), computed ``micro_batch_size`` rows at a time."""
    B = batch.input_ids.shape[0]
    outs = []
    for s in range(0, B, micro_batch_size):
        rows = torch.arange(s, min(s + micro_batch_size, B), device=batch.input_ids.device)
        lo, hi = column_window(batch.attention_mask, rows)
        spec = batch.probe.index(rows).columns(lo, hi)
        outs.append(probe_forward(model, spec, **batch.model_inputs(rows, lo, hi)))
    if not outs:
        dev = batch.input_ids.device
        return ProbeOutput(torch.zeros(0, 0, device=dev), torch.zeros(0, device=dev))
    return ProbeOutput(torch.cat([o.logp for o in outs]), torch.cat([o.phi for o in outs]))


def mask_blocks(reasoning_mask: torch.Tensor, span: int) -> torch.Tensor:
    """(B, L) long block id of every reasoning token (its rank among the row's reasoning tokens // span), -1 off."""
    rank = reasoning_mask.long().cumsum(-1) - 1
    return torch.where(reasoning_mask, rank // span, torch.full_like(rank, -1))


def masked_copies(reasoning_mask: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked copies OAR-P runs: one per block of ``span`` consecutive reasoning tokens.

    Args:
        reasoning_mask: (B, L) bool. span: reasoning tokens masked together (1 = exact OAR-P).

    Returns:
        (source row (N,), first masked column (N,), block ids (B, L) of :func:`mask_blocks`), copies in row-major
        order (a row's copies are consecutive, by position).
    """
    blocks = mask_blocks(reasoning_mask, span)
    # a block's first token is a reasoning token whose rank among the row's reasoning tokens is a multiple of span
    rank = reasoning_mask.long().cumsum(-1) - 1
    rows, cols = (reasoning_mask & (rank % span == 0)).nonzero().unbind(1)
    return rows, cols, blocks


def copy_masks(blocks: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(N, n) bool: the tokens each copy masks, i.e. those sharing the block id at its first masked column.

    Args:
        blocks: (N, n) block ids of each copy's source row (a column window of :func:`mask_blocks`).
        first: (N,) first masked column of each copy, in the window's coordinates.
    """
    return blocks == blocks.gather(1, first[:, None])


def collective_rounds(batch: AttributionBatch, chunk_size: int, micro_batch_size: int, prefix_cache: bool = False,
                      mask_span: int = 1) -> int:
    """Forward passes :func:`oar_p_importance` runs on this batch (each a collective round under sharding)."""
    B = batch.input_ids.shape[0]
    n_copies = (batch.reasoning_mask.sum(-1) + mask_span - 1) // mask_span  # (B,)
    if prefix_cache:
        return int((n_copies > 0).sum()) + int(((n_copies + chunk_size - 1) // chunk_size).sum())
    return math.ceil(B / micro_batch_size) + math.ceil(int(n_copies.sum()) / chunk_size)


@torch.no_grad()
def oar_p_importance(model: torch.nn.Module, batch: AttributionBatch, mask_token_id: int, chunk_size: int = 64,
                     micro_batch_size: int = 8, min_rounds: int = 0, prefix_cache: bool = False,
                     mask_span: int = 1) -> torch.Tensor:
    """OAR-P importance of every reasoning token.

    Args:
        model: Hugging Face causal LM (or a sharded wrapper), in eval mode.
        batch: AttributionBatch (B, L).
        mask_token_id: the replacement token (the tokenizer's pad token by default).
        chunk_size: masked copies per forward.
        micro_batch_size: rows per clean forward (batched path).
        min_rounds: run at least this many forwards (the max of :func:`collective_rounds` over data-parallel ranks,
            so that every rank issues the same collectives); extra rounds repeat the first row's clean forward and
            are discarded; needs B >= 1.
        prefix_cache: reuse each sequence's clean key/value cache for the unchanged prefix (model must support
            ``past_key_values``).
        mask_span: reasoning tokens masked together per copy (1 = exact OAR-P).

    Returns:
        (B, L) float32 importance at reasoning positions, 0 elsewhere. Non-finite model outputs propagate as
        NaN/inf; the gating turns such rows into uniform weights.
    """
    if prefix_cache:
        importance, ran = _prefix_cached(model, batch, mask_token_id, chunk_size, mask_span)
    else:
        importance, ran = _batched(model, batch, mask_token_id, chunk_size, micro_batch_size, mask_span)
    if min_rounds > ran:
        if batch.input_ids.shape[0] == 0:
            raise ValueError("min_rounds needs at least one local row to repeat")
        first = torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)
        for _ in range(min_rounds - ran):
            probe_forward(model, batch.probe.index(first), **batch.model_inputs(first))
    return importance


def _batched(model, batch: AttributionBatch, mask_token_id: int, chunk_size: int, micro_batch_size: int,
             span: int) -> tuple[torch.Tensor, int]:
    device = batch.input_ids.device
    clean = clean_probe(model, batch, micro_batch_size)
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    rows_all, cols_all, blocks = masked_copies(batch.reasoning_mask, span)
    ran = math.ceil(batch.input_ids.shape[0] / micro_batch_size)
    for s in range(0, rows_all.shape[0], chunk_size):
        rows, first = rows_all[s: s + chunk_size], cols_all[s: s + chunk_size]
        lo, hi = column_window(batch.attention_mask, rows)
        inputs = batch.model_inputs(rows, lo, hi)
        masked = copy_masks(blocks[rows, lo:hi], first - lo)
        inputs["input_ids"] = inputs["input_ids"].masked_fill(masked, mask_token_id)
        spec = batch.probe.index(rows).columns(lo, hi)
        shift = outcome_shift(clean.index(rows), probe_forward(model, spec, **inputs), spec.joint).float()
        _assign(importance, rows, lo, masked, shift)
        ran += 1
    return importance, ran


def _prefix_cached(model, batch: AttributionBatch, mask_token_id: int, chunk_size: int,
                   span: int) -> tuple[torch.Tensor, int]:
    device = batch.input_ids.device
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    rows_all, cols_all, blocks = masked_copies(batch.reasoning_mask, span)
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
        for s in range(starts[b], starts[b + 1], chunk_size):
            first = cols_all[s: min(s + chunk_size, starts[b + 1])] - lo
            c, t0 = first.shape[0], int(first.min())
            if int(keep.min()) < t0:  # a probe position before the masked tokens: cannot come from the suffix
                raise ValueError("prefix_cache needs every probe position after the perturbed tokens")
            masked = copy_masks(blocks[b, lo:hi].expand(c, -1), first)  # (c, n)
            suffix = inputs["input_ids"].expand(c, -1).masked_fill(masked, mask_token_id)[:, t0:]
            prefix = copy.deepcopy(cache)  # the forward appends to the cache it is given
            prefix.crop(t0)
            prefix.batch_repeat_interleave(c)
            logits = model(input_ids=suffix, attention_mask=inputs["attention_mask"].expand(c, -1),
                           position_ids=inputs["position_ids"][:, t0:].expand(c, -1), past_key_values=prefix,
                           logits_to_keep=keep - t0, use_cache=True).logits
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
