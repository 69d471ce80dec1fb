"""The one place a comparative word in the generated docs comes from (issue #68 item 1): a phrase computed from an
interval, never written beside it by hand.

:func:`verdict` turns a statistic's 95 % interval ``(lo, hi)`` (and, where known, its exact sign-flip p over rows, the
number of runs or rows ``n`` and the largest leave-one-out share) into the words the docs print:

- ``n == 1``: "one run" (one measurement: no direction is claimed, whatever the figure);
- an undefined interval (``None`` / NaN bound: a ratio whose denominator is not above 0): "undefined";
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


def _bad(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def pval(p: float) -> str:
    """``0.003`` / ``< 0.001``."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def verdict(lo: float | None, hi: float | None, *, p: float | None = None, n: int | None = None,
            loo: float | None = None, above: str = "above", below: str = "below", level: str = "level",
            unit: str = "row") -> str:
    """The phrase for an interval ``[lo, hi]`` of a signed statistic (a difference or a gain; 0 = no difference).

    Args:
        lo, hi: the interval's bounds (None / NaN: undefined).
        p: the paired sign-flip p, printed beside a direction (never alone decides it: the interval does).
        n: runs or rows the interval rests on; 1 gives "one run".
        loo: the largest leave-one-out share of the estimate (see the module docstring); beyond :data:`LOO_SHARE`
            in magnitude it is named.
        above, below, level: the words for the three outcomes.
        unit: what was left out one at a time ("row", "prompt").

    Returns:
        e.g. "above (p 0.003), one row carries 74 %", "level", "below", "one run", "undefined".
    """
    if n is not None and n < 1:
        raise ValueError(f"verdict: n must be >= 1 (runs or rows), got {n}")
    if n == 1:
        return "one run"
    if _bad(lo) or _bad(hi):
        return "undefined"
    if lo > hi:
        raise ValueError(f"verdict: the interval's lo ({lo}) is above its hi ({hi})")
    word = above if lo > 0 else below if hi < 0 else level
    if p is not None and word != level:
        word += f" (p {pval(p)})"
    if loo is not None and not _bad(loo) and abs(loo) > LOO_SHARE:
        word += (f", one {unit} carries {100 * loo:.0f} %" if loo > 0 else
                 f", leaving one {unit} out moves it {100 * -loo:.0f} %")
    return word
