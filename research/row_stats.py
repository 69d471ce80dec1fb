"""Row statistics beside a ratio of sums (issue #68 item 2), from the per-row values a results file keeps.

A fidelity figure is R = Σ_rows (a − c) / Σ_rows c (a ranking's AOPC a against a control's or another ranking's c,
summed over the rows, :func:`oar_verl.core.fidelity.summary.bootstrap_ratio`); its bootstrap interval says nothing of
how many rows agree with it or how much one row carries. :func:`ratio_row_stats` gives, from the same rows:

- ``above`` / ``rows``: rows where a > c (rows where either value is NaN are left out, as the summary leaves them);
- ``p``: the two-sided paired sign-flip p of Σ (a − c) over rows (exact: every sign pattern for ≤ 16 rows, else
  20,000 seeded draws), the test beside the interval's direction;
- ``loo``: the largest leave-one-out share (R − R without row i) / R over rows i, signed (positive: the row pushes
  the estimate its way), with ``loo_row`` its index and ``without`` R without it;
- ``undefined``: True where Σ c ≤ 0 (the ratio is undefined, as the summary's NaN).

numpy only (no torch): ``python -m research.tables --check`` runs it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

EXACT_ROWS = 16  # up to this many rows the sign-flip p enumerates every sign pattern (2^16 × 16 floats)
DRAWS = 20_000  # above it, this many seeded random sign patterns


@dataclass(frozen=True)
class RowStats:
    estimate: float  # R = Σ (a − c) / Σ c (NaN where Σ c ≤ 0)
    above: int  # rows with a > c
    rows: int  # rows with both defined
    p: float  # two-sided paired sign-flip p of Σ (a − c)
    loo: float  # the largest |share| of R carried by one row, signed (NaN where R is undefined or 0)
    loo_row: int  # that row's index among the rows given (−1 where undefined)
    without: float  # R without that row

    @property
    def undefined(self) -> bool:
        return self.estimate != self.estimate


def sign_flip_p(d: np.ndarray, seed: int = 0) -> float:
    """Two-sided sign-flip p of Σ d over rows: the share of sign patterns whose |Σ ± d| reaches |Σ d|.

    Args:
        d: (B,) paired differences, B ≥ 1.
    """
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 1 or not len(d):
        raise ValueError(f"sign_flip_p: d must be a non-empty 1-D array, got shape {d.shape}")
    flips = (np.array(list(itertools.product((1.0, -1.0), repeat=len(d)))) if len(d) <= EXACT_ROWS else
             np.random.default_rng(seed).choice((1.0, -1.0), (DRAWS, len(d))))
    return float((np.abs(flips @ d) >= abs(d.sum()) - 1e-12).mean())


def ratio_row_stats(a, c) -> RowStats:
    """:class:`RowStats` of R = Σ (a − c) / Σ c over the rows where both are defined.

    Args:
        a, c: (B,) per-row values (NaN: undefined on that row).
    """
    a, c = np.asarray(a, dtype=np.float64), np.asarray(c, dtype=np.float64)
    if a.shape != c.shape or a.ndim != 1:
        raise ValueError(f"ratio_row_stats: a and c must be 1-D of one length, got {a.shape} and {c.shape}")
    ok = ~(np.isnan(a) | np.isnan(c))
    a, c = a[ok], c[ok]
    if not len(a):
        raise ValueError("ratio_row_stats: no row has both values defined")
    d = a - c
    nan = float("nan")
    est = float(d.sum() / c.sum()) if c.sum() > 0 else nan
    loo, row, without = nan, -1, nan
    if est == est and est != 0 and len(a) > 1:
        rest = c.sum() - c
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(rest > 0, (d.sum() - d) / rest, np.nan)
        share = (est - r) / est
        if not np.isnan(share).all():
            row = int(np.nanargmax(np.abs(share)))
            loo, without = float(share[row]), float(r[row])
    return RowStats(est, int((d > 0).sum()), len(d), sign_flip_p(d), loo, row, without)
