"""OAR-P: counterfactual one-token masking (oar-method.md §3, with bug 6 fixed).

For every reasoning position t, replace y_t by the mask token (length unchanged) and score
I_t = KL(P_clean ‖ P^(t)) (or φ_clean − φ^(t) with AS-Joint). The masked copies of all sequences are streamed through
the model in chunks of ``chunk_size`` rows, each chunk trimmed to the columns its rows use, with full-vocabulary
logits only at probe positions: peak memory depends on the chunk size, not on the reasoning length R.
"""

from __future__ import annotations

import math

import torch

from oar_verl.core.layout import AttributionBatch
from oar_verl.core.probes import ProbeOutput, outcome_shift, probe_forward


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


def num_forwards(batch: AttributionBatch, chunk_size: int, micro_batch_size: int) -> int:
    """Forward passes :func:`oar_p_importance` runs on this batch (clean micro-batches + masked chunks).

    Data-parallel ranks must run equally many collective forwards; the worker all-reduces the max of this number
    and passes it as ``pad_to_forwards``.
    """
    B = batch.input_ids.shape[0]
    n = int(batch.reasoning_mask.sum())
    return math.ceil(B / micro_batch_size) + math.ceil(n / chunk_size)


@torch.no_grad()
def oar_p_importance(model: torch.nn.Module, batch: AttributionBatch, mask_token_id: int, chunk_size: int = 64,
                     micro_batch_size: int = 8, pad_to_forwards: int = 0) -> torch.Tensor:
    """OAR-P importance of every reasoning token.

    Args:
        model: Hugging Face causal LM (or a sharded wrapper), in eval mode.
        batch: AttributionBatch (B, L).
        mask_token_id: the replacement token (the tokenizer's pad token by default).
        chunk_size: masked copies per forward.
        micro_batch_size: rows per clean forward.
        pad_to_forwards: repeat the first row's clean forward (result discarded) until this many forwards ran, so
            that every data-parallel rank issues the same collectives; needs B >= 1.

    Returns:
        (B, L) float32 importance at reasoning positions, 0 elsewhere. Non-finite model outputs propagate as
        NaN/inf; the gating turns such rows into uniform weights.
    """
    device = batch.input_ids.device
    clean = clean_probe(model, batch, micro_batch_size)
    importance = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    # (N, 2) (row, position) of every reasoning token; planned on the host once per batch
    targets = batch.reasoning_mask.nonzero()
    ran = math.ceil(batch.input_ids.shape[0] / micro_batch_size)
    for s in range(0, targets.shape[0], chunk_size):
        rows, pos = targets[s: s + chunk_size].unbind(1)
        lo, hi = column_window(batch.attention_mask, rows)
        inputs = batch.model_inputs(rows, lo, hi)
        ids = inputs["input_ids"].clone()
        ids[torch.arange(ids.shape[0], device=device), pos - lo] = mask_token_id
        inputs["input_ids"] = ids
        spec = batch.probe.index(rows).columns(lo, hi)
        perturbed = probe_forward(model, spec, **inputs)
        importance[rows, pos] = outcome_shift(clean.index(rows), perturbed, spec.joint).float()
        ran += 1
    if pad_to_forwards > ran:
        if batch.input_ids.shape[0] == 0:
            raise ValueError("pad_to_forwards needs at least one local row to repeat")
        first = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(pad_to_forwards - ran):
            probe_forward(model, batch.probe.index(first), **batch.model_inputs(first))
    return importance


def column_window(attention_mask: torch.Tensor, rows: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) columns that hold a real token in any of ``rows``; padding-only columns are skipped."""
    used = attention_mask[rows].bool().any(0)
    if not bool(used.any()):
        return 0, attention_mask.shape[1]
    cols = used.nonzero().squeeze(1)
    return int(cols[0]), int(cols[-1]) + 1
