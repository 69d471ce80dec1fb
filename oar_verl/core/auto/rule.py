"""The decision of ``mode=auto`` (docs/auto.md §2-3): each candidate's gain over each control as a ratio of sums over
every row with a prompt-clustered bootstrap interval, and the rule that picks the cheapest candidate beating every
required control. Pure functions of the evidence; no model runs here. Shapes: N rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from oar_verl.core.auto.evidence import Evidence
from oar_verl.core.fidelity.controls import RANDOM
from oar_verl.core.fidelity.summary import Interval, bootstrap_ratio, gain

__all__ = ["BANDS", "DEFAULT_CONTROLS", "Decision", "bands_of", "decide", "gains"]

DEFAULT_CONTROLS = (RANDOM, "position", "entropy")  # entropy where measured
BANDS = ("all", "inside", "past")  # one band without a sliding window; inside / past the window otherwise


def bands_of(lengths: torch.Tensor | Sequence[int], window: int | None) -> tuple[str, ...]:
    """Each row's band from its length (prompt + response tokens) and the model's sliding window: ``all`` when the
    model has none, else ``inside`` (length <= window) or ``past``."""
    lengths = torch.as_tensor(lengths).tolist()
    if window is None:
        return tuple("all" for _ in lengths)
    return tuple("inside" if n <= window else "past" for n in lengths)


def gains(evidence: Evidence, candidates: Sequence[str], controls: Sequence[str], *, resamples: int = 1000,
          seed: int = 0, min_gap: float = 0.0) -> dict[str, dict[str, Interval]]:
    """candidate -> control -> gain over the control: Σ_rows (AOPC_c − AOPC_k) / Σ_rows AOPC_k over the rows where both
    are defined (none dropped for its value), with a percentile interval from a bootstrap clustered by
    ``evidence.groups`` (:func:`~oar_verl.core.fidelity.summary.bootstrap_ratio`). The resampling depends only on
    the groups and the seed, so a candidate's interval does not change when another candidate is added."""
    pairs = [(c, k) for c in candidates for k in controls]
    nan = torch.full((len(evidence),), float("nan"), dtype=torch.float64)
    col = (lambda name: evidence.aopc.get(name, nan).double())
    if not pairs:
        return {}
    num = torch.stack([gain(col(c), col(k)) for c, k in pairs])
    den = torch.stack([col(k) for _, k in pairs])
    got = bootstrap_ratio(num, den, groups=evidence.groups, resamples=resamples, seed=seed, min_gap=min_gap)
    out: dict[str, dict[str, Interval]] = {c: {} for c in candidates}
    for (c, k), iv in zip(pairs, got):
        out[c][k] = iv
    return out


@dataclass(frozen=True)
class Decision:
    """One band's decision.

    Attributes:
        choice: the chosen candidate, or None when none qualifies (see ``reason``).
        reason: one line saying why (loud when None).
        gains: candidate -> control -> :class:`~oar_verl.core.fidelity.summary.Interval`.
        rows: rows measured. prompts: distinct prompts among them. static: rows where nothing moved (kept in sums).
        cost: candidate -> its cost in training forward+backward units (NaN: unknown).
        random_like: candidates no better than the random control (its interval contains 0 or lies below).
        best: the candidate with the highest lower bound over its worst required control (the ``best`` fallback).
    """

    choice: str | None
    reason: str
    gains: Mapping[str, Mapping[str, Interval]]
    rows: int
    prompts: int
    static: int
    cost: Mapping[str, float] = field(default_factory=dict)
    random_like: tuple[str, ...] = ()
    best: str | None = None


def _lower(iv: Interval) -> float:
    return iv.lo if not math.isnan(iv.lo) else -math.inf


def decide(evidence: Evidence, costs: Mapping[str, float], *, max_cost: float,
           controls: Sequence[str] = DEFAULT_CONTROLS, resamples: int = 1000, seed: int = 0,
           min_gap: float = 0.0) -> Decision:
    """The cheapest candidate whose gain over EVERY control in ``controls`` has a lower bound > 0 and whose cost is <=
    ``max_cost`` (ties in cost: the higher worst lower bound); None and a loud reason when none qualifies.

    Args:
        evidence: the rows of one band (candidates' and controls' AOPC, groups, static flags).
        costs: candidate -> cost in training forward+backward units (the candidates are its keys, in order; NaN:
            unknown, counted as affordable and said so in the reason).
        max_cost: the cap (``auto_max_cost``). controls: the required controls, those the evidence measured
            (``entropy`` only where the batch had the policy's entropies).
        resamples, seed, min_gap: the bootstrap's (:func:`gains`).
    """
    candidates = list(costs)
    # a control the evidence did not measure (entropy without the old-log-prob entropies) is not required; the
    # reason names the controls used
    controls = tuple(k for k in controls if k in evidence.aopc)
    if not controls:
        raise ValueError("auto: the evidence measured none of the required controls")
    g = gains(evidence, candidates, controls, resamples=resamples, seed=seed, min_gap=min_gap)
    rows, prompts = len(evidence), int(torch.unique(evidence.groups).numel())
    static = int((evidence.static == 1).sum())
    worst = {c: min((_lower(g[c][k]) for k in controls), default=-math.inf) for c in candidates}
    random_like = tuple(c for c in candidates if RANDOM in g[c] and not _lower(g[c][RANDOM]) > 0)
    ranked = sorted(candidates, key=lambda c: (-worst[c], candidates.index(c)))
    best = ranked[0] if ranked and worst[ranked[0]] > -math.inf else None
    beats = [c for c in candidates if worst[c] > 0]
    affordable = [c for c in beats if not costs[c] > max_cost]  # NaN cost: unknown, not refused
    common = dict(gains=g, rows=rows, prompts=prompts, static=static, cost=dict(costs), random_like=random_like,
                  best=best)
    shown = ", ".join(f"{c} lo {worst[c]:+.3f}" for c in candidates)
    if affordable:
        choice = min(affordable, key=lambda c: (costs[c] if not math.isnan(costs[c]) else math.inf, -worst[c]))
        return Decision(choice, f"{choice}: cheapest (cost {costs[choice]:.2f}) whose gain over "
                                f"{'/'.join(controls)} has lower bound > 0 ({shown}; {rows} rows, {prompts} prompts, "
                                f"{static} static)", **common)
    if beats:
        why = (f"NO AFFORDABLE CANDIDATE: {', '.join(beats)} beat(s) the controls but cost(s) "
               f"{', '.join(f'{costs[c]:.2f}' for c in beats)} > auto_max_cost {max_cost}")
    else:
        why = f"NO CANDIDATE BEATS THE CONTROLS ({'/'.join(controls)})"
        if len(random_like) == len(candidates):
            why += ": every candidate ranks like random"
    return Decision(None, f"{why} ({shown}; {rows} rows, {prompts} prompts, {static} static)", **common)
