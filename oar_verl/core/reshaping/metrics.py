"""OAR diagnostics (docs/method.md §9): how the weights redistribute credit, as scalars for verl's tracking.

All scalars are batch means over the reshaped rows (ESS, top-k mass) or their reasoning tokens (weight statistics).
Every step logs the same keys: when no row was reshaped, the weight statistics, the floor/boost fractions and the
top-10 % mass are 0, and the ESS ratio is 1 (the value of uniform weights, i.e. plain GRPO).
"""

from __future__ import annotations

import torch

from oar_verl.core.reshaping.gating import TokenWeights


def ess_ratio(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) effective-sample-size ratio (Σw)² / (R Σw²) over each row's masked tokens; 1 = uniform (plain GRPO)."""
    w = torch.where(mask, weights.double(), 0.0)
    r = mask.sum(-1).double()
    return ((w.sum(-1) ** 2) / (r * (w**2).sum(-1)).clamp(min=1e-12)).float()


def top_mass(weights: torch.Tensor, mask: torch.Tensor, frac: float = 0.1) -> torch.Tensor:
    """(B,) share of Σw carried by the top ceil(frac·R) tokens of each row, ranked by weight."""
    w = torch.where(mask, weights.double(), float("-inf"))
    srt = w.sort(-1, descending=True).values.clamp(min=0)
    r = mask.sum(-1)
    k = (r.double() * frac).ceil().long().clamp(min=1)
    csum = srt.cumsum(-1)
    top = csum.gather(-1, (k - 1).clamp(max=max(w.shape[-1] - 1, 0))[:, None]).squeeze(-1)
    return (top / csum[:, -1].clamp(min=1e-12)).float() if w.shape[-1] else torch.zeros(w.shape[0])


def flat_rows(weights: torch.Tensor, mask: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """(B,) bool: rows with two or more masked tokens whose weights are all equal (within ``tol``): the scores were
    flat, so the gate moved no credit (plain GRPO on that row)."""
    w = weights.double()
    spread = torch.where(mask, w, float("-inf")).amax(-1) - torch.where(mask, w, float("inf")).amin(-1)
    return (mask.sum(-1) >= 2) & (spread <= tol)


def oar_metrics(tw: TokenWeights, base_advantages: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, span_found: torch.Tensor | None = None,
                answer_probe: torch.Tensor | None = None, prefix: str = "oar/") -> dict[str, float]:
    """Scalar OAR metrics of one batch.

    Args:
        tw: TokenWeights of the batch (B, T).
        base_advantages, advantages: (B, T) advantages before / after reshaping.
        response_mask: (B, T) 0/1.
        span_found: (N,) bool over the attributed rows, an answer span was located (None: not reported).
        answer_probe: (N,) bool over the attributed rows, the row used an answer-span probe rather than LT-Logits
            (None: not reported).

    Returns:
        dict of python floats: weight mean/std/min/max over reshaped tokens, floor and boost fractions, ESS ratio,
        top-10 % mass, fractions of reshaped, flat (:func:`flat_rows`) and fallback rows, of rows to reshape kept
        uniform for want of a reasoning token (``no_reasoning_seq_frac``: with ``target=response`` every row without
        an answer span, docs/method.md §2, and a row that opens with its answer), advantage mass before/after and its
        relative error.
    """
    mask = tw.reshaped
    rows = mask.any(-1)
    n_tok = int(mask.sum())
    n_rows = int(rows.sum())
    B = int(response_mask.shape[0])
    w = tw.weights[mask].double()
    valid = response_mask.bool()
    mass_before = float((base_advantages.double().abs() * valid).sum())
    mass_after = float((advantages.double().abs() * valid).sum())
    out = {
        "weight_mean": float(w.mean()) if n_tok else 0.0,
        "weight_std": float(w.std(unbiased=False)) if n_tok else 0.0,
        "weight_min": float(w.min()) if n_tok else 0.0,
        "weight_max": float(w.max()) if n_tok else 0.0,
        "frac_floor": float(tw.floored.sum()) / n_tok if n_tok else 0.0,
        "frac_boosted": float(tw.boosted.sum()) / n_tok if n_tok else 0.0,
        "ess_ratio": float(ess_ratio(tw.weights, mask)[rows].mean()) if n_rows else 1.0,
        "top10_mass": float(top_mass(tw.weights, mask, 0.1)[rows].mean()) if n_rows else 0.0,
        "reshaped_seq_frac": n_rows / B if B else 0.0,
        "reshaped_tokens": float(n_tok),
        "fallback_seq_frac": float(tw.fallback.sum()) / B if B else 0.0,
        "flat_seq_frac": float(flat_rows(tw.weights, mask).sum()) / B if B else 0.0,
        "no_reasoning_seq_frac": float(tw.no_reasoning.sum()) / B if B else 0.0,
        "adv_mass_before": mass_before,
        "adv_mass_after": mass_after,
        "adv_mass_rel_err": abs(mass_after - mass_before) / mass_before if mass_before > 0 else 0.0,
    }
    if span_found is not None:
        out["span_found_frac"] = float(span_found.float().mean()) if span_found.numel() else 0.0
    if answer_probe is not None:
        out["answer_probe_frac"] = float(answer_probe.float().mean()) if answer_probe.numel() else 0.0
    return {prefix + k: v for k, v in out.items()}


def flat_warning(metrics: dict[str, float], step: int, prefix: str = "oar/") -> str | None:
    """A line for the log when every reshaped row of a step came out flat (:func:`flat_rows`; ``metrics`` as
    :func:`oar_metrics` gives them, reduced over the ranks), else None: the scores read nothing of the outcome, so the
    step ran plain GRPO while paying for attribution."""
    reshaped, flat = metrics.get(prefix + "reshaped_seq_frac", 0.0), metrics.get(prefix + "flat_seq_frac", 0.0)
    if reshaped <= 0 or flat < reshaped - 1e-9:
        return None
    return (f"oar: step {step}: every reshaped row's scores were flat ({prefix}flat_seq_frac = "
            f"{prefix}reshaped_seq_frac = {reshaped:.3g}): all weights 1, no credit moved; check "
            f"{prefix}span_found_frac, algorithm.oar.probe / target and the method (logged once a run)")
