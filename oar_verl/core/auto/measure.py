"""A rank's share of a ``mode=auto`` calibration step (docs/auto.md §4): every candidate attributes the rank's first
``fidelity_rows`` rows with reasoning tokens, timed, and :func:`~oar_verl.core.auto.evidence.candidate_metrics`
scores them against the controls. Written over the backend interface like the in-step fidelity metric, so every
engine and both integrations call it the same way. Shapes: B rows of the rank, n measured rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from oar_verl.core.auto.evidence import candidate_metrics
from oar_verl.core.backends.base import AttributionBackend
from oar_verl.core.checks.startup import require_resolved
from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.controls import EntropySource, entropies_of, response_aligned
from oar_verl.core.fidelity.step import measured_rows
from oar_verl.core.methods.attribution import run_attribution
from oar_verl.core.methods.mask_operator import mask_replacement
from oar_verl.core.preprocess import PreparedAttribution, prepare_attribution

__all__ = ["measure_candidates"]

BackendFor = Callable[[OARConfig, PreparedAttribution], AttributionBackend]


def measure_candidates(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], tokenizer,
                       cfg: OARConfig, step: int, candidates: Sequence[str], backend_for: BackendFor, *,
                       has_reasoning: torch.Tensor | None = None, ground_truths: Sequence[str] | None = None,
                       device: torch.device | str | None = None, min_gap: float = 0.0,
                       entropies: EntropySource | None = None,
                       model_masks: Sequence[torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
    """Score every candidate on this rank's first ``cfg.fidelity_rows`` rows with reasoning tokens.

    Every rank calls this with the same ``candidates`` in the same order, and ``backend_for`` aligns the pass counts
    (a rank without such rows runs one filler row, whose results are NaN).

    Args:
        prompts, responses: the rank's B unpadded 1-D id tensors (as :func:`~oar_verl.core.pipeline.attribute`).
        tokenizer: the policy's. cfg: the resolved configuration (the run's mask operator, ``fidelity_rows``, seed).
        step: the training step. candidates: the modes to score.
        backend_for: (cfg with a candidate's mode, its prepared rows) -> the backend it runs on.
        has_reasoning: (B,) bool rows with reasoning tokens (the step's attribution found them); None: found here
            (the rows prepared under ``cfg``).
        ground_truths: B answers with ``target=reference``. device: where the rows go. min_gap: the static floor.
        entropies: B 1-D per-response-token policy entropies (the old-log-prob pass's), or a function of the
            measured rows' indices returning theirs (called once on every rank, with the filler row on a rank that
            measures none): the entropy control; None: skipped (no ``entropy`` entry).
        model_masks: B 1-D masks of the model's own tokens of multi-turn rows (docs/multi_turn.md); None: all.

    Returns:
        ``aopc``: name -> (B,) float64 (candidates and controls; NaN on the rows not measured); ``static`` (B,);
        ``seconds_per_token``: candidate -> () float64, its attribution's seconds over the measured rows' tokens
        (prompt + response) on this rank; ``tokens``: () the measured rows' tokens.
    """
    require_resolved(cfg)
    B = len(responses)
    if has_reasoning is None:
        has_reasoning = prepare_attribution(prompts, responses, tokenizer, cfg, step, ground_truths=ground_truths,
                                            model_masks=model_masks).batch.reasoning_mask.bool().any(-1)
    picked = measured_rows(has_reasoning.cpu(), cfg)
    rows = picked if picked.numel() else torch.zeros(min(B, 1), dtype=torch.long)  # a filler row only
    sub = ([prompts[i] for i in rows.tolist()], [responses[i] for i in rows.tolist()])
    truths = None if ground_truths is None else [ground_truths[i] for i in rows.tolist()]
    masks = None if model_masks is None else [model_masks[i] for i in rows.tolist()]
    prepare = (lambda c: prepare_attribution(*sub, tokenizer, c, step, ground_truths=truths, device=device,
                                             model_masks=masks))
    base = prepare(cfg)  # the rows every ranking is scored on (same columns for every candidate)
    importances, spt = {}, {}
    tokens = float(base.batch.attention_mask.sum())
    for name in candidates:
        c = dataclasses.replace(cfg, mode=name)
        prep = prepare(c)
        start = time.perf_counter()
        result = run_attribution(backend_for(c, prep), prep.batch, c, mask_token_id=prep.mask_token_id,
                                 seeds=prep.seeds)
        importances[name] = result.importance.double().cpu().to(base.batch.input_ids.device)  # syncs the device
        spt[name] = torch.tensor((time.perf_counter() - start) / max(tokens, 1.0), dtype=torch.float64)
    backend = backend_for(cfg, base)
    replacement = mask_replacement(backend, base.batch, cfg.mask, base.mask_token_id, base.seeds)
    entropy = None if entropies is None else response_aligned(entropies_of(entropies, rows.tolist()), base.batch)
    got = candidate_metrics(backend, base.batch, importances, replacement=replacement, seed=cfg.seed, min_gap=min_gap,
                            entropy=entropy)
    nan = (lambda: torch.full((B,), float("nan"), dtype=torch.float64))
    aopc, static = {}, nan()
    keep = picked.numel() > 0
    for name, v in got.items():
        if name == "passes":
            continue
        out = static if name == "static" else aopc.setdefault(name, nan())
        if keep:
            out[rows] = v.double().cpu()
    return {"aopc": aopc, "static": static, "seconds_per_token": spt,
            "tokens": torch.tensor(tokens if keep else 0.0, dtype=torch.float64)}
