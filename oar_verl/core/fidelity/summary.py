"""The fidelity metric's summaries of deletion curves (docs/fidelity.md §1): AOPC, NAOPC against random and best
rankings, the suppression ratio S with its noise floor, the share of gated advantage mass on the best ranking's top
tokens, and row means with paired-bootstrap intervals. Pure tensor maths on shifts already measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Interval", "aopc", "bootstrap_mean", "default_min_gap", "mass_on_target", "naopc", "suppression_ratio"]


def aopc(curve: torch.Tensor) -> torch.Tensor:
    """Area over the perturbation curve: (..., O, F) shifts -> (...) mean over the F fractions, then the O
    operators."""
    return curve.mean(-1).mean(-1)


def _degenerate(den: torch.Tensor, min_gap: float, *scale: torch.Tensor) -> torch.Tensor:
    """Where a denominator is not above max(``min_gap``, 1e-12, 1e-9 · max |scale|) (also True for NaN)."""
    tol = torch.clamp(1e-9 * torch.stack([s.abs() for s in scale]).amax(0), min=max(min_gap, 1e-12))
    return ~(den > tol)


def naopc(method: torch.Tensor, random: torch.Tensor, best: torch.Tensor, min_gap: float = 0.0) -> torch.Tensor:
    """NAOPC = (AOPC_method − AOPC_random) / (AOPC_best − AOPC_random), elementwise; NaN where the denominator is
    not above max(``min_gap``, 1e-12, 1e-9 · max(|best|, |random|)) (best no better than random, within the numerical
    noise of the shifts: the row cannot tell rankings apart) or an input is NaN."""
    den = best - random
    return torch.where(_degenerate(den, min_gap, best, random), float("nan"), (method - random) / den)


def suppression_ratio(bottom: torch.Tensor, random: torch.Tensor, min_gap: float = 0.0) -> torch.Tensor:
    """S = shift(remove the method's bottom share) / shift(remove a random share of the same size), elementwise;
    NaN where the random removal's shift is not above max(``min_gap``, 1e-12, 1e-9 · |random|)."""
    return torch.where(_degenerate(random, min_gap, random), float("nan"), bottom / random)


def default_min_gap(model: torch.nn.Module) -> float:
    """The smallest denominator (in shift units) NAOPC and S trust, from the model's parameter dtype: 0 for float64
    (the relative 1e-9 rule alone), 1e-6 for float32, 1e-3 for 16-bit types (a perturbed row runs in another batch
    and padding than its clean row, so even an empty removal shifts by about the dtype's rounding)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return 0.0 if dtype == torch.float64 else 1e-6 if dtype == torch.float32 else 1e-3


def mass_on_target(weights: torch.Tensor, target: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """Share of the gated advantage mass on the target tokens.

    Args:
        weights: (B, L) gated token weights (:func:`oar_verl.core.reshaping.gating.oar_token_weights`).
        target: (B, L) bool target tokens (the best ranking's top share). reasoning: (B, L) bool.

    Returns:
        (B,) float64 Σ_{target} w / Σ_{reasoning} w; NaN on rows without reasoning tokens.
    """
    w = torch.where(reasoning, weights.double(), 0.0)
    tot = w.sum(-1)
    return torch.where(tot > 0, (w * target).sum(-1) / tot, float("nan"))


@dataclass(frozen=True)
class Interval:
    """A mean over rows with a paired-bootstrap percentile interval.

    Attributes:
        mean: the mean over the rows where the value is defined (NaN if none). lo, hi: the interval's bounds.
        rows: rows where the value is defined. undefined: rows where it is NaN (degenerate denominators etc.).
    """

    mean: float
    lo: float
    hi: float
    rows: int
    undefined: int


def bootstrap_mean(values: torch.Tensor, *, resamples: int = 1000, seed: int = 0,
                   alpha: float = 0.05) -> list[Interval]:
    """Percentile bootstrap of the NaN-ignoring row mean, vectorised over S statistics sharing one resampling.

    Args:
        values: (S, B); NaN = undefined on that row (excluded from the mean, counted). Rows are resampled jointly
            for all S statistics (paired: a statistic that is a difference of two methods on the same rows gets
            the paired interval).
        resamples: bootstrap resamples. seed: the resampling seed. alpha: 1 − the interval's coverage.

    Returns:
        S :class:`Interval` s.
    """
    v = values.detach().double().cpu()
    S, B = v.shape
    ok = ~torch.isnan(v)
    x = torch.where(ok, v, 0.0)
    n = ok.sum(-1)
    mean = x.sum(-1) / n.clamp(min=1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, max(B, 1), (resamples, B), generator=g)
    bs = x[:, idx].sum(-1) / ok[:, idx].sum(-1).clamp(min=1)  # (S, resamples)
    bs = torch.where(ok[:, idx].any(-1), bs, float("nan"))
    lo = torch.nanquantile(bs, alpha / 2, dim=-1)
    hi = torch.nanquantile(bs, 1 - alpha / 2, dim=-1)
    nan = float("nan")
    return [Interval(float(mean[s]) if n[s] else nan, float(lo[s]) if n[s] else nan,
                     float(hi[s]) if n[s] else nan, int(n[s]), int(B - n[s])) for s in range(S)]
