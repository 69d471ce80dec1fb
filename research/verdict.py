"""The one place a comparative word in the generated docs comes from (issue #68 item 1): a phrase computed from an
interval, never written beside it by hand.

:func:`verdict` turns a statistic's 95 % interval ``(lo, hi)`` (and, where known, its exact sign-flip p over rows, the
number of runs or rows ``n`` and the largest leave-one-out share) into the words the docs print:

- ``n == 1``: "one run" (one measurement: no direction is claimed, whatever the figure);
- an undefined interval (``None`` / NaN bound: a ratio whose denominator is not above 0): "undefined";
- a ratio of sums whose bootstrap left out more than :data:`DROPPED_SHARE` of its resamples (their denominator not
  above 0, ``dropped``): "not shown (more than 10 % of resamples undefined)", whatever the bounds;
- ``lo > 0``: the ``above`` word ("above", or the caller's, e.g. "faster"), with "p …" beside it when ``p`` is given;
- ``hi < 0``: the ``below`` word likewise;
- otherwise (the interval holds 0): the ``level`` word ("level", or e.g. "not shown" for a one-sided test);
- then, whatever the direction, "one row carries X %" when leaving one row out moves the estimate by more than
  :data:`LOO_SHARE` of itself (``loo`` = (estimate − estimate without that row) / estimate; a negative share, a row
  that pulls against the estimate, reads "leaving one row out moves it X %").

Torch-free: ``python -m research.tables --check`` imports it on a machine without torch.
"""

from __future__ import annotations

import math

# leave-one-out threshold: a single row whose removal moves the estimate by more than half of it is named
LOO_SHARE = 0.5
# undefined-resample threshold: past it the percentile interval describes only the resamples whose denominator is
# positive, a selected tenth or more of the bootstrap distribution, so no direction is read from it
DROPPED_SHARE = 0.1


def _bad(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def pval(p: float) -> str:
    """``0.003`` / ``< 0.001``."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def verdict(lo: float | None, hi: float | None, *, p: float | None = None, n: int | None = None,
            loo: float | None = None, dropped: float | None = None, above: str = "above", below: str = "below",
            level: str = "level", unit: str = "row") -> str:
    """The phrase for an interval ``[lo, hi]`` of a signed statistic (a difference or a gain; 0 = no difference).

    Args:
        lo, hi: the interval's bounds (None / NaN: undefined).
        p: the paired sign-flip p, printed beside a direction (never alone decides it: the interval does).
        n: runs or rows the interval rests on; 1 gives "one run".
        loo: the largest leave-one-out share of the estimate (see the module docstring); beyond :data:`LOO_SHARE`
            in magnitude it is named.
        above, below, level: the words for the three outcomes.
        dropped: the share of bootstrap resamples left out for an undefined ratio
            (:attr:`oar_verl.core.fidelity.summary.Interval.dropped`); beyond :data:`DROPPED_SHARE`: "not shown".
        unit: what was left out one at a time ("row", "prompt").

    Returns:
        e.g. "above (p 0.003), one row carries 74 %", "level", "below", "one run", "undefined",
        "not shown (more than 10 % of resamples undefined)".
    """
    if n is not None and n < 1:
        raise ValueError(f"verdict: n must be >= 1 (runs or rows), got {n}")
    if n == 1:
        return "one run"
    if _bad(lo) or _bad(hi):
        return "undefined"
    if lo > hi:
        raise ValueError(f"verdict: the interval's lo ({lo}) is above its hi ({hi})")
    if dropped is not None and not _bad(dropped) and dropped > DROPPED_SHARE:
        word = f"not shown (more than {100 * DROPPED_SHARE:.0f} % of resamples undefined)"
    else:
        word = above if lo > 0 else below if hi < 0 else level
    if p is not None and word in (above, below):
        word += f" (p {pval(p)})"
    if loo is not None and not _bad(loo) and abs(loo) > LOO_SHARE:
        word += (f", one {unit} carries {100 * loo:.0f} %" if loo > 0 else
                 f", leaving one {unit} out moves it {100 * -loo:.0f} %")
    return word
