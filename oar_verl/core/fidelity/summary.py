"""The fidelity metric's summaries of deletion curves (docs/fidelity.md §1): AOPC, the gain over a control (the
primary statistic, a ratio of sums over every row), NAOPC against random and best rankings, the suppression ratio S
with its noise floor, the share of gated advantage mass on the best ranking's top tokens, the rows where nothing moves,
and paired bootstrap intervals clustered by prompt. Pure tensor maths on shifts already measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Interval", "aopc", "bootstrap_mean", "bootstrap_ratio", "clusters", "default_min_gap", "gain",
           "mass_on_target", "naopc", "ratio_of_sums", "static_rows", "suppression_ratio"]


def aopc(curve: torch.Tensor) -> torch.Tensor:
    """Area over the perturbation curve: (..., O, F) shifts -> (...) mean over the F fractions, then the O
    operators."""
    return curve.mean(-1).mean(-1)


def gain(method: torch.Tensor, control: torch.Tensor) -> torch.Tensor:
    """Per-row gain over a control, AOPC_method − AOPC_control, elementwise, in the shift's own units: a function of
    the method's and the control's curves only, whichever other rankings ran."""
    return method - control


def static_rows(aopcs: torch.Tensor, min_gap: float = 0.0) -> torch.Tensor:
    """(..., Q, B) AOPC of Q rankings -> (..., B) bool: rows where nothing moves, every ranking's |AOPC| not above
    max(``min_gap``, 1e-12) (False where any is NaN). Such rows are counted, never dropped: they stay in the sums."""
    return (aopcs.abs() <= max(min_gap, 1e-12)).all(-2)


def _ratio(num: torch.Tensor, den: torch.Tensor, count: torch.Tensor, min_gap: float) -> torch.Tensor:
    """Σ num / Σ den from the sums and the row count; NaN where no row counts or the mean denominator Σ den / count
    is not above max(``min_gap``, 1e-12) (the control moves nothing beyond the noise on these rows)."""
    ok = (count > 0) & (den > max(min_gap, 1e-12) * count)
    return torch.where(ok, num / torch.where(ok, den, 1.0), float("nan"))


def ratio_of_sums(num: torch.Tensor, den: torch.Tensor, min_gap: float = 0.0) -> torch.Tensor:
    """(..., B) -> (...): Σ_rows num / Σ_rows den over the rows where both are defined (not NaN), whatever their values
    (no row is dropped because of its result); NaN as :func:`_ratio`. With ``num`` = :func:`gain` and ``den`` =
    AOPC_control it is the gain over the control as a share of the control's AOPC."""
    ok = ~(num.isnan() | den.isnan())
    return _ratio(torch.where(ok, num, 0.0).sum(-1), torch.where(ok, den, 0.0).sum(-1), ok.sum(-1), min_gap)


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
    """A mean over rows (or a ratio of sums over rows) with a paired bootstrap percentile interval.

    Attributes:
        mean: the mean (the ratio) over the rows where the value is defined (NaN if none). lo, hi: the interval's
            bounds.
        rows: rows where the value is defined. undefined: rows where it is NaN (degenerate denominators etc.).
        dropped: the share (0..1) of bootstrap resamples where the ratio was undefined (the resample's mean
            denominator not above ``min_gap``), left out of the percentiles: ``lo``, ``hi`` then describe only the
            resamples with a positive denominator. 0 for a mean (its denominator is a row count).
    """

    mean: float
    lo: float
    hi: float
    rows: int
    undefined: int
    dropped: float = 0.0


def clusters(groups: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, int]:
    """((B,) long cluster index in 0..K−1, K) of the rows: rows with the same ``groups`` id (e.g. a prompt's index:
    a GRPO group) form one cluster; ``None``: every row its own cluster. A ValueError naming ``groups`` on a wrong
    shape."""
    if groups is None:
        return torch.arange(rows), rows
    g = torch.as_tensor(groups).detach().cpu()
    if g.shape != (rows,) or g.is_floating_point():
        raise ValueError(f"fidelity: groups must be a (B,) integer tensor of row cluster ids with B = {rows}, got "
                         f"{g.dtype} of shape {tuple(g.shape)}")
    ids, index = torch.unique(g, return_inverse=True)
    return index, int(ids.numel())


def bootstrap_ratio(num: torch.Tensor, den: torch.Tensor, *, groups: torch.Tensor | None = None,
                    resamples: int = 1000, seed: int = 0, alpha: float = 0.05, min_gap: float = 0.0
                    ) -> list[Interval]:
    """:func:`ratio_of_sums` of S statistics with percentile intervals from a bootstrap clustered by ``groups``.

    Args:
        num, den: (S, B); a row counts for statistic s where both are defined (NaN: undefined there, counted).
        groups: (B,) integer cluster ids (:func:`clusters`): a resample draws K clusters with replacement, each with
            all its rows; default every row its own cluster. All S statistics share the resampling (paired).
        resamples: bootstrap resamples. seed: the resampling seed. alpha: 1 − the interval's coverage.
        min_gap: the smallest mean denominator trusted (:func:`ratio_of_sums`).

    Returns:
        S :class:`Interval` s: ``mean`` the ratio on all rows, ``lo``, ``hi`` the percentile bounds over the
        resamples where the ratio is defined (NaN where the ratio on all rows is), ``dropped`` the share of resamples
        left out for an undefined ratio; with one cluster every resample is the whole sample and the interval
        collapses to the ratio.
    """
    n, d = num.detach().double().cpu(), den.detach().double().cpu()
    S, B = n.shape
    ok = ~(n.isnan() | d.isnan())
    index, K = clusters(groups, B)
    per = torch.zeros(3, S, K, dtype=torch.float64).index_add_(
        2, index, torch.stack([torch.where(ok, n, 0.0), torch.where(ok, d, 0.0), ok.double()]))  # (3, S, K) sums
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, max(K, 1), (resamples, K), generator=g)
    times = torch.zeros(resamples, K, dtype=torch.float64).scatter_add_(1, idx, torch.ones(resamples, K,
                                                                                             dtype=torch.float64))
    point = _ratio(*per.sum(-1), min_gap)  # (S,)
    boot = _ratio(*(per @ times.T), min_gap)  # (S, resamples): each cluster's sums times its draws
    lo = torch.nanquantile(boot, alpha / 2, dim=-1)
    hi = torch.nanquantile(boot, 1 - alpha / 2, dim=-1)
    dropped = boot.isnan().double().mean(-1)  # (S,) the share of resamples nanquantile leaves out
    rows = ok.sum(-1)
    nan = float("nan")
    return [Interval(float(point[s]), float(lo[s]) if not point[s].isnan() else nan,
                     float(hi[s]) if not point[s].isnan() else nan, int(rows[s]), int(B - rows[s]),
                     float(dropped[s])) for s in range(S)]


def bootstrap_mean(values: torch.Tensor, *, groups: torch.Tensor | None = None, resamples: int = 1000,
                   seed: int = 0, alpha: float = 0.05) -> list[Interval]:
    """Percentile bootstrap of the NaN-ignoring row mean, vectorised over S statistics sharing one resampling:
    :func:`bootstrap_ratio` of the values over 1 per defined row.

    Args:
        values: (S, B); NaN = undefined on that row (excluded from the mean, counted). Rows are resampled jointly
            for all S statistics (paired: a statistic that is a difference of two methods on the same rows gets
            the paired interval).
        groups: (B,) cluster ids: rows of one cluster (one prompt) resample together (default: each row alone).
        resamples: bootstrap resamples. seed: the resampling seed. alpha: 1 − the interval's coverage.

    Returns:
        S :class:`Interval` s.
    """
    v = values.detach().double().cpu()
    return bootstrap_ratio(v, torch.where(v.isnan(), float("nan"), 1.0), groups=groups, resamples=resamples,
                           seed=seed, alpha=alpha)
